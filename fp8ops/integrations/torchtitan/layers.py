"""FP8TitanLinear: fp8ops' FP8Linear as a torchtitan Module, built from a Linear.Config.

Parameters (`weight` [out, in], `bias`) are nn.Linear's, so torchtitan's checkpoints, its
state-dict adapters and its sharding configs see the same names and shapes; the FP8 state is the
extra `fp8_state` submodule. torchtitan builds the model on the meta device, moves it with
to_empty and initialises it through init_states (param_init, not reset_parameters): the FP8
state is reset after the weight is initialised, so it starts fresh like a new layer's.

Under torchtitan's tensor parallelism the layer computes on its shard of the weight (its
sharding_config says which dimension the "tp" mesh axis cuts): parallelize() has its scales taken
as one process takes them (fp8ops.distributed.tensor_parallel.shard_scales), per-tensor amaxes
all-reduced over the "tp" mesh, and block recipes checked to cut on block boundaries."""
from dataclasses import dataclass
from typing import Optional

import spmd_types as spmd
from torchtitan.distributed.parallel_dims import MeshAxisName
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module

from ...distributed.tensor_parallel import shard_scales
from ...nn.modules import FP8Linear
from .recipes import recipe_named
from .states import as_titan_module


class FP8TitanLinear(FP8Linear, Module):
    """FP8Linear built from a torchtitan Linear.Config (and satisfying its Module protocol)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        """Linear.Config's fields (in/out features, bias, param_init, sharding_config) and the
        FP8 choices: recipe (a name of recipes.RECIPES), fp8_all_gather (FSDP2 gathers the
        weight in FP8 where the recipe allows) and fallback (FP8Linear's: "auto", "never")."""

        recipe: str = "current"
        fp8_all_gather: bool = True
        fallback: str = "auto"

    def __init__(self, config: Config):
        FP8Linear.__init__(self, config.in_features, config.out_features, bias=config.bias,
                           recipe=recipe_named(config.recipe),
                           fp8_all_gather=config.fp8_all_gather, fallback=config.fallback)

    def _new_state(self, recipe):
        return as_titan_module(super()._new_state(recipe))

    def _init_self_parameters(self) -> None:
        # torchtitan's init (param_init or reset_parameters), then a fresh FP8 state: after
        # to_empty its buffers hold garbage, and no cast of the old weight may be reused
        Module._init_self_parameters(self)
        self.fp8_state.reset()

    def parallelize(self, parallel_dims) -> None:
        Module.parallelize(self, parallel_dims)
        dim = tensor_parallel_dim(self._sharding_config)
        mesh = parallel_dims.get_optional_mesh(MeshAxisName.TP.value)
        if dim is not None and mesh is not None:
            shard_scales(self, mesh, dim, f"{type(self).__name__} under tensor parallelism")


def tensor_parallel_dim(sharding_config) -> Optional[int]:
    """The dimension of an [out, in] weight that the "tp" mesh axis shards (0: colwise, 1:
    rowwise), or None (not sharded over "tp", no sharding config)."""
    if sharding_config is None or "weight" not in sharding_config.state_shardings:
        return None
    placement = sharding_config.state_shardings["weight"].per_axis_spmd_types().get(
        MeshAxisName.TP)
    if not isinstance(placement, spmd.Shard):
        return None
    return placement.dim % 2
