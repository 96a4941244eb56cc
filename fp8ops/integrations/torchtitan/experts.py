"""FP8GroupedExperts: torchtitan's GroupedExperts whose three grouped GEMMs run in FP8 through
fp8ops.grouped_linear (a scale per expert). The parameters w1_EFD, w2_EDF and w3_EFD are
GroupedExperts' own, unchanged ([E, out, in]: the layout grouped_linear reads).

grouped_linear takes current scaling and blockwise scaling without a state of its own; the
experts of a "delayed" or "mxfp8" conversion run current scaling (the dense layers keep the
chosen recipe): per-expert delayed scaling keeps its amax histories in a state module per
parameter, which torchtitan's module protocol and sharding configs do not provide for, and
grouped_linear has no MXFP8 path.

Each parameter has a WeightCache (`fp8_weight_caches`, by name), as a converted transformers
experts module has: all its experts are cast once per optimizer step and the cast is reused by
the micro-batches of an accumulation window and by activation checkpointing's recompute. Under
torchtitan's FSDP2 (whole experts per rank, Shard(0) on a 1-D mesh) the parameters are gathered
in FP8 (fp8ops/distributed/fsdp/experts.py): each rank casts its experts, and the bytes and
per-expert scales are gathered instead of the high-precision weights; other placements (expert
parallelism's, an expert split over ranks) gather in high precision, logged with the reason."""
import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts

from ...nn import caches
from ...nn.autograd import is_gathered
from ...nn.grouped import grouped_linear
from ...nn.sharding import SHARDED_EXPERTS_HOOKS
from ...scaling import WeightCache
from .recipes import recipe_named

# the recipe the experts run for each recipe name of the conversion
EXPERT_RECIPES = {"current": "current", "blockwise": "blockwise", "delayed": "current",
                  "mxfp8": "current"}
WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


class FP8GroupedExperts(GroupedExperts):
    """GroupedExperts with FP8 grouped GEMMs (fp8ops.grouped_linear)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        """GroupedExperts.Config's fields, the conversion's recipe name (EXPERT_RECIPES says
        which recipe the experts then run) and fp8_all_gather (FSDP2 gathers the experts in
        FP8 where their placement allows)."""

        recipe: str = "current"
        fp8_all_gather: bool = True

    def __init__(self, config: Config):
        if config.recipe not in EXPERT_RECIPES:
            recipe_named(config.recipe)  # (raises the error naming the known recipes)
        # (before the parameters exist: __setattr__ reads them)
        self.__dict__["fp8_weight_caches"] = {name: WeightCache() for name in WEIGHTS}
        super().__init__(config)
        self.fp8_recipe = recipe_named(EXPERT_RECIPES[config.recipe])
        self.fp8_all_gather = config.fp8_all_gather
        caches.track(self)  # (an optimizer given only parameters finds the caches)

    def __setattr__(self, name, value):
        # FSDP2 sets its sharded parameter through setattr when a module defines it: there
        # fp8ops.distributed's hook has FSDP2 gather the experts in FP8 (nn.sharding)
        if name in WEIGHTS and isinstance(value, DTensor):
            for hook in SHARDED_EXPERTS_HOOKS:
                hook(self, name, value)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        # Module._apply may swap a parameter for a new tensor (torchtitan's to_empty after
        # fully_shard), which refuses a tensor with weak references: the caches drop theirs
        with contextlib.ExitStack() as stack:
            for name, cache in self.fp8_weight_caches.items():
                stack.enter_context(cache.unreferenced(self._parameters.get(name)))
            return super()._apply(fn, recurse)

    def _init_self_parameters(self) -> None:
        # torchtitan's init (param_init), then no cast of the old values may be reused
        super()._init_self_parameters()
        for cache in self.fp8_weight_caches.values():
            cache.invalidate()

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(self._fp8_mm(x_RD, "w1_EFD", offsets)) * self._fp8_mm(x_RD, "w3_EFD",
                                                                            offsets)
        return self._fp8_mm(h_RF, "w2_EDF", offsets).type_as(x_RD)

    def _fp8_mm(self, x: torch.Tensor, name: str, offsets: torch.Tensor):
        weight = self._parameters[name]
        if isinstance(weight, DTensor):  # (expert or tensor parallelism: the local experts)
            weight = weight.to_local()
        cache = self.fp8_weight_caches[name]
        # grouped_linear wants the weight in the activations' dtype (torchtitan's mixed precision
        # casts the parameters; a full-precision run has both in float32). A weight gathered in
        # FP8 carries its cast, which a copy would lose: it goes as it is.
        if weight.dtype != x.dtype and not is_gathered(weight):
            weight, cache = weight.to(x.dtype), None  # (a copy: no cache keys on it)
        return grouped_linear(x, weight, offsets, recipe=self.fp8_recipe, weight_cache=cache)
