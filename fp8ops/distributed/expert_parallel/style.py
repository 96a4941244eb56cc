"""FP8ExpertParallel: the DTensor ParallelStyle that splits a mixture-of-experts layer's experts
over an expert-parallel mesh and moves its tokens in FP8.

    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(experts, ep_mesh, fp8ops.FP8ExpertParallel())

`experts` is one of:
  - an FP8GroupedLinear, or a module of FP8GroupedLinear layers (all with the same number of
    experts and recipe) whose forward(x, offsets) takes tokens sorted by expert (x [M, in],
    offsets int32 [E], as FP8GroupedLinear) and applies its layers to them row by row (e.g. up,
    an activation, down);
  - a transformers experts module converted by fp8ops.convert_to_fp8 (nn/hf_moe.py), whose
    forward(hidden_states, top_k_index, top_k_weights) sorts the (token, expert) pairs itself.
Each expert weight (and bias) becomes a DTensor sharded on its expert dimension (Shard(0)):
rank r holds experts r * E / n ... (r + 1) * E / n - 1. The module keeps its forward's contract
over all E experts: each rank passes its own tokens (and routing) and gets their outputs back,
in its order. In between (dispatch.py):
  1. the counts per expert go to every rank (one all_to_all_single, read on the host once);
  2. the tokens travel to the ranks of their experts as the FP8 bytes and scales of the cast
     the first grouped GEMM reads (wire.py), which it reads there without a second cast;
  3. the module's own forward runs on the local experts, the layers on their local shards;
  4. the outputs come back in high precision; in backward their gradient goes to the experts
     in FP8, and the tokens' gradient comes back in high precision.
CurrentScaling (a scale per expert over all ranks' tokens: one MAX all-reduce of [E] amaxes)
and BlockwiseScaling (1x128 blocks, no reduction); DelayedScaling is refused. With
fp8_dispatch=False everything travels in the tokens' dtype (the baseline to compare with).

The experts' weights are cast every forward (the weight cache is not used under expert
parallelism). FSDP2 can shard the experts further over a data-parallel mesh dimension
(fully_shard on the other dimension of a 2-D mesh): it then gathers them in high precision.
"""
from __future__ import annotations

import functools
from typing import List

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from ...nn import hf_moe
from ...nn.grouped import FP8GroupedLinear, grouped_linear
from ..tensor_parallel import TP_WEIGHT
from . import wire
from .dispatch import DISPATCHED, combine, dispatch
from .routing import exchange

_NAME = "FP8ExpertParallel"


def _layers(module: nn.Module) -> List[FP8GroupedLinear]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_NAME} parallelizes a module, got {type(module).__name__}")
    layers = [m for m in module.modules() if isinstance(m, FP8GroupedLinear)]
    if not layers:
        raise TypeError(f"{_NAME} takes an FP8GroupedLinear or a module of FP8GroupedLinear "
                        f"layers (forward(x, offsets) on tokens sorted by expert); "
                        f"{type(module).__name__} holds none (convert it first)")
    return layers


def _check_mesh(mesh) -> None:
    if mesh is None or mesh.ndim != 1:
        raise ValueError(f"{_NAME} takes the 1-D expert-parallel mesh (e.g. mesh['ep'] of a "
                         f"2-D ('dp', 'ep') mesh), got a mesh with "
                         f"{None if mesh is None else mesh.ndim} dimensions")


def _check_recipe_and_split(recipe, experts: int, mesh) -> None:
    if not wire.takes(recipe):
        raise NotImplementedError(f"{_NAME} takes CurrentScaling or BlockwiseScaling experts, "
                                  f"not {recipe}")
    if experts % mesh.size():
        raise ValueError(f"{_NAME}: {experts} experts do not split evenly over the "
                         f"{mesh.size()} ranks of the mesh")


def _check(module: nn.Module, layers: List[FP8GroupedLinear], mesh) -> None:
    experts = {layer.num_experts for layer in layers}
    if len(experts) > 1:
        raise ValueError(f"{_NAME}: the FP8GroupedLinear layers of {type(module).__name__} "
                         f"have different numbers of experts {sorted(experts)}; the tokens of "
                         f"one routing go through all of them")
    recipes = {layer.recipe for layer in layers}
    if len(recipes) > 1:
        raise ValueError(f"{_NAME}: the FP8GroupedLinear layers of {type(module).__name__} "
                         f"have different recipes ({recipes}); give them one")
    (recipe,), (num,) = recipes, experts
    _check_recipe_and_split(recipe, num, mesh)
    for layer in layers:
        if isinstance(layer.weight, DTensor):
            raise ValueError(f"{_NAME}: this FP8GroupedLinear's weight is a DTensor already "
                             f"(parallelized twice, or parallelize before fully_shard)")
        if layer.weight_cache.host is not None:
            raise ValueError(f"{_NAME}: this FP8GroupedLinear's weight is owned by a "
                             f"CPUOffloadOptimizer; parallelize before building the optimizer")


def _shard(layer: nn.Module, name: str, mesh, src_data_rank) -> None:
    param = layer._parameters.get(name)
    if param is None:
        return
    dt = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)],
                                        src_data_rank=src_data_rank),
                      requires_grad=param.requires_grad)
    setattr(dt, TP_WEIGHT, True)  # a parallel style's weight: FSDP2's FP8 gather leaves it
    setattr(layer, name, dt)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _layer_forward(layer: FP8GroupedLinear, x: torch.Tensor, offsets: torch.Tensor):
    """The layer on its local experts; the dispatched tokens' own cast when x is them."""
    return grouped_linear(x, _local(layer.weight), offsets, _local(layer.bias),
                          recipe=layer.recipe, input_cast=getattr(x, DISPATCHED, None))


def _check_input(x, offsets, experts: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{_NAME}: the input must be 2-D [tokens, features] sorted by expert, "
                         f"got {tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    if (not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32
            or offsets.shape != (experts,)):
        raise ValueError(f"{_NAME}: offsets must be an int32 tensor of shape ({experts},) over "
                         f"all experts (each expert's cumulative end row), got "
                         f"{getattr(offsets, 'dtype', type(offsets).__name__)} "
                         f"{tuple(getattr(offsets, 'shape', ()))}")


class FP8ExpertParallel(ParallelStyle):
    """Expert parallelism with FP8 token dispatch for FP8GroupedLinear experts (module doc).
    fp8_dispatch: False moves tokens and gradients in the tokens' dtype. src_data_rank: the rank
    whose weights are split (as torch's styles; None: each rank keeps its own local part)."""

    def __init__(self, *, fp8_dispatch: bool = True, src_data_rank=0):
        super().__init__()
        self.fp8_dispatch = fp8_dispatch
        self.src_data_rank = src_data_rank

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_mesh(device_mesh)
        if isinstance(module, nn.Module) and hf_moe.is_hf_experts(module):
            return _apply_hf(self, module, device_mesh)
        layers = _layers(module)
        _check(module, layers, device_mesh)
        for layer in layers:
            _shard(layer, "weight", device_mesh, self.src_data_rank)
            _shard(layer, "bias", device_mesh, self.src_data_rank)
            layer.forward = functools.partial(_layer_forward, layer)
        inner = module.forward
        module.forward = functools.partial(_expert_forward, self, device_mesh, layers[0], inner)
        module._distribute_module_applied = True
        return module


def _expert_forward(style: FP8ExpertParallel, mesh, first: FP8GroupedLinear, inner, x,
                    offsets):
    """The module's forward over all experts: dispatch, the local forward, combine."""
    experts = first.num_experts
    _check_input(x, offsets, experts)
    routing = exchange(offsets, mesh.get_group())
    rows = sum(routing.send_splits)  # = offsets[-1]: rows past it are zero rows, as unsplit
    if rows > x.shape[0]:
        raise ValueError(f"{_NAME}: offsets[-1] = {rows} is past the input's {x.shape[0]} rows")
    got = dispatch(x[:rows], offsets, routing, first.recipe, style.fp8_dispatch)
    y = combine(inner(got, routing.local_offsets), offsets, routing, first.recipe,
                style.fp8_dispatch)
    if rows < x.shape[0]:
        y = torch.cat([y, y.new_zeros(x.shape[0] - rows, *y.shape[1:])])
    return y


# ----------------------------------------------------------------------------------------------
# converted transformers experts modules
# ----------------------------------------------------------------------------------------------
_HF_PARAMS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias",
              "down_proj_bias")


def _apply_hf(style: FP8ExpertParallel, module: nn.Module, mesh) -> nn.Module:
    if "fp8_recipe" not in module.__dict__:
        raise TypeError(f"{_NAME}: this {type(module).__name__} is not converted to FP8; "
                        f"convert it first (fp8ops.convert_to_fp8)")
    _check_recipe_and_split(module.fp8_recipe, module.num_experts, mesh)
    names = [n for n in _HF_PARAMS if isinstance(module._parameters.get(n), nn.Parameter)]
    for name in names:
        if isinstance(module._parameters[name], DTensor):
            raise ValueError(f"{_NAME}: {type(module).__name__}.{name} is a DTensor already "
                             f"(parallelized twice, or parallelize before fully_shard)")
    if any(c.host is not None for c in module.__dict__.get("fp8_weight_caches", {}).values()):
        raise ValueError(f"{_NAME}: this experts module's weights are owned by a "
                         f"CPUOffloadOptimizer; parallelize before building the optimizer")
    for name in names:
        _shard(module, name, mesh, style.src_data_rank)
    module.forward = functools.partial(_hf_forward, style, mesh, module, tuple(names))
    module._distribute_module_applied = True
    return module


def _hf_forward(style: FP8ExpertParallel, mesh, module: nn.Module, names, hidden_states,
                top_k_index, top_k_weights):
    """The converted module's forward over all experts: its pairs sorted by expert, dispatched,
    the local experts' projections, combined, weighted and summed per token."""
    k = top_k_index.shape[1]
    recipe, fp8 = module.fp8_recipe, style.fp8_dispatch
    order, offsets = hf_moe.sort_by_expert(top_k_index, module.num_experts)
    routing = exchange(offsets, mesh.get_group())
    got = dispatch(hidden_states[order // k], offsets, routing, recipe, fp8)
    params = {name: _local(getattr(module, name)) for name in names}
    out = hf_moe.experts_rows(module, got, routing.local_offsets, params=params,
                              input_cast=getattr(got, DISPATCHED, None))
    out = combine(out, offsets, routing, recipe, fp8)
    return hf_moe.weighted_sum(out, order, top_k_weights, hidden_states.dtype)
