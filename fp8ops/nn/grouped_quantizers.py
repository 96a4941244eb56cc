"""The grouped layer's casts and GEMMs per recipe: the dense quantizers (quantizers.py) with the
experts' grouped ones, which grouped.py's one autograd Function asks for.

  cast_experts(state)                     the experts' weight cast (weight_cache.Cast), all at once
  cast_rows(x, offsets, state, live)      X by groups, with its transposed copy for wgrad
  cast_grad_rows(dy, offsets, ...)        dY by groups (the transposed copy when wgrad runs)
  rows_from_cast(x, offsets, cast)        X's cast from its forward bytes made elsewhere
                                          (RowsCast: expert parallelism sends them)
  grouped_forward / grouped_dgrad / grouped_wgrad
                                          the three grouped GEMMs on those casts
Current scaling scales each group by its own amax, delayed scaling each group by its expert's
role (ExpertScalingState), blockwise scaling casts 1x128 blocks within each group.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..scaling import amax_reduction
from ..ops.expert_casts import experts_amax, quantize_experts_scaled
from ..scaling import grad_margin
from ..scaling.expert_state import ExpertScalingState
from .autograd import takes_warm_scale
from .quantizers import (BlockwiseQuantizer, CurrentQuantizer, DelayedQuantizer, Quantizer,
                         quantizer_type)

_ops = torch.ops.fp8ops
_F32 = torch.float32


class RowsCast(NamedTuple):
    """The forward operand of X's cast by groups, made before grouped_linear (expert parallelism
    casts the tokens on the rank that routes them and sends these bytes): data [M, K] in the
    recipe's forward format and scale_inv, [E] (a scale per group, current scaling) or [M, Kb]
    (1x128 blocks, blockwise scaling), as cast_rows would make them."""

    data: torch.Tensor
    scale_inv: torch.Tensor


class _PerTensorGEMMs:
    """The per-tensor grouped GEMMs: X's, dY's and the experts' casts are (data, data^T,
    scale_inv [E])."""

    def grouped_forward(self, x_cast, w_cast, offsets, bias, out_dtype):
        return _ops.grouped_gemm(x_cast[0], w_cast[0], offsets, x_cast[2], w_cast[2], bias,
                                 out_dtype)

    def grouped_saved(self, x_cast, w_cast) -> tuple:
        return x_cast[1], w_cast[1], x_cast[2], w_cast[2]  # X^T, W^T and their scale_inv

    def grouped_dgrad(self, g, saved, offsets, x_dtype):
        return _ops.grouped_gemm(g[0], saved[1], offsets, g[2], saved[3], None, x_dtype)

    def grouped_wgrad(self, g, saved, offsets, dtype):
        return _ops.grouped_gemm_wgrad(g[1], saved[0], offsets, g[2], saved[2], dtype)


class _ExpertsFromOwnValues:
    """The experts' weight_cache.Cast of current and blockwise scaling: each expert from its own
    values (no step, no given scale)."""

    def cast_experts(self, state):
        recipe, expert_cast = self.recipe, self.expert_cast

        def cast(w, step, scale):  # no per-tensor scale: one per expert, or blocks
            return (recipe, expert_cast(w.detach())), None
        return cast


class GroupedCurrent(_PerTensorGEMMs, _ExpertsFromOwnValues, CurrentQuantizer):
    """A scale per group of X and dY from its own amax (one per expert of W)."""

    def cast_rows(self, x, offsets, state, live: bool):
        data, data_t, _, scale_inv = _ops.quantize_current_grouped(
            x, offsets, self.fwd.dtype, self.recipe.margin, self.recipe.power_of_two, True)
        return data, data_t, scale_inv

    def rows_from_cast(self, x, offsets, cast: RowsCast):
        """The given bytes, and their transpose for wgrad (a scale per group: the same bytes)."""
        return cast.data, _ops.transpose_fp8(cast.data), cast.scale_inv

    def cast_grad_rows(self, dy, offsets, state, grad_warm: bool, need_dw: bool):
        data, data_t, _, scale_inv = _ops.quantize_current_grouped(
            dy, offsets, self.bwd.dtype, grad_margin(self.recipe), self.recipe.power_of_two,
            need_dw)
        return data, data_t, scale_inv


class GroupedDelayed(_PerTensorGEMMs, DelayedQuantizer):
    """Each group cast with its expert's scale of the role (the dense quantize_delayed per
    group): stepped first when the state records, each group's own amax as its scale while the
    role has recorded nothing (a warm start), the groups' amaxes recorded (0 for an empty one)."""

    def cast_experts(self, state: ExpertScalingState):
        """The experts' weight_cache.Cast, the dense layer's per expert: a given scale [E] (the
        window's) casts without stepping; else the weight role steps first when `step`, each
        expert is cast with its role's scale (its own amax before anything was recorded) and
        records its amax when `step`."""
        recipe, fwd, role = self.recipe, self.fwd, state.weight

        def cast(w, step, scale):
            w = w.detach()
            if scale is None:
                if step:
                    state.step_role("weight", recipe, fwd, recipe.margin)
                scale = (role.scale.clone() if role.started else
                         _warm_expert_scales(w, role, fwd, recipe))
            data, data_t, amax = quantize_experts_scaled(w, scale, fwd.dtype)
            if step:
                state.record_role("weight", amax)
                role.started = True
            return (recipe, (data, data_t, torch.reciprocal(scale))), scale
        return cast

    def rows_from_cast(self, x, offsets, cast: RowsCast):
        raise NotImplementedError("an input cast made before grouped_linear takes CurrentScaling "
                                  "or BlockwiseScaling, not DelayedScaling (its scales are "
                                  "stepped and recorded by the layer's own cast)")

    def cast_rows(self, x, offsets, state: ExpertScalingState, live: bool):
        return cast_rows(x, offsets, state, "input", self.fwd, self.recipe, self.recipe.margin,
                         update=live, warm=takes_warm_scale(state, "input", live), record=live,
                         transpose=True)

    def cast_grad_rows(self, dy, offsets, state: ExpertScalingState, grad_warm: bool,
                       need_dw: bool):
        stepping = state.recording
        cast = cast_rows(dy, offsets, state, "grad", self.bwd, self.recipe,
                         grad_margin(self.recipe), update=stepping, warm=grad_warm,
                         record=stepping, transpose=need_dw)
        if stepping and not torch.compiler.is_compiling():
            state.grad.started = True  # (also for a forward that ran under no_grad)
        # the step's all-reduce: one for every delayed-scaling layer at the end of the backward
        if stepping and state.needs_reduce() and not amax_reduction.defer(state):
            state.reduce_records()
        return cast


class GroupedBlockwise(_ExpertsFromOwnValues, BlockwiseQuantizer):
    """X and dY in 1x128 blocks within each group, W in 128x128 blocks: casts (data,
    scale_inv, data^T, scale_inv^T)."""

    def cast_rows(self, x, offsets, state, live: bool):
        return _ops.quantize_blockwise_grouped(x, offsets, self.fwd.dtype,
                                               self.recipe.power_of_two)

    def rows_from_cast(self, x, offsets, cast: RowsCast):
        """The given 1x128 bytes and scales; the transposed copy for wgrad (blocks along M,
        which the rows' blocks do not give) cast from x, the values the bytes stand for."""
        _, _, data_t, scale_inv_t = _ops.quantize_blockwise_grouped(x, offsets, self.fwd.dtype,
                                                                    self.recipe.power_of_two)
        return cast.data, cast.scale_inv, data_t, scale_inv_t

    def cast_grad_rows(self, dy, offsets, state, grad_warm: bool, need_dw: bool):
        return _ops.quantize_blockwise_grouped(dy, offsets, self.bwd.dtype,
                                               self.recipe.power_of_two)

    def grouped_forward(self, x_cast, w_cast, offsets, bias, out_dtype):
        return _ops.grouped_gemm_blockwise(x_cast[0], w_cast[0], offsets, x_cast[1], w_cast[1],
                                           bias, out_dtype)

    def grouped_saved(self, x_cast, w_cast) -> tuple:
        return x_cast[2], x_cast[3], w_cast[2], w_cast[3]  # X^T, W^T and their scale_inv

    def grouped_dgrad(self, g, saved, offsets, x_dtype):
        return _ops.grouped_gemm_blockwise(g[0], saved[2], offsets, g[1], saved[3], None,
                                           x_dtype)

    def grouped_wgrad(self, g, saved, offsets, dtype):
        return _ops.grouped_gemm_wgrad_blockwise(g[2], saved[0], offsets, g[3], saved[1], dtype)


_GROUPED = {CurrentQuantizer: GroupedCurrent, DelayedQuantizer: GroupedDelayed,
            BlockwiseQuantizer: GroupedBlockwise}


def grouped_quantizer_for(recipe) -> Quantizer:
    """The grouped quantizer of `recipe` (None: CurrentScaling()); NotImplementedError for one
    grouped_linear does not take (its quantizer's `grouped` is False)."""
    dense, recipe = quantizer_type(recipe)
    grouped = _GROUPED.get(dense)
    quantizer = None if grouped is None else grouped(recipe)
    if quantizer is None or not quantizer.grouped:
        raise NotImplementedError(
            f"grouped_linear takes CurrentScaling (without amax_percentile) or DelayedScaling, "
            f"both with round-to-nearest gradients, or BlockwiseScaling; not {recipe}")
    return quantizer


def _warm_expert_scales(w: torch.Tensor, role, fmt, recipe) -> torch.Tensor:
    """Each expert's scale from its own weight's amax (the weight role has recorded nothing
    yet), over all ranks' weights under torch.distributed (as the dense layer's warm start)."""
    return role.warm_scale(experts_amax(w), fmt, recipe.margin, recipe)


def _warm_row_scales(x, offsets, role, fmt, recipe, margin: float) -> torch.Tensor:
    """Each group's scale from its own rows' amax (its role has recorded nothing yet), over all
    ranks' rows under torch.distributed."""
    # the groups' amaxes (a cast's, its bytes unused: a warm start happens once)
    ones = torch.ones(offsets.shape[0], dtype=_F32, device=x.device)
    amax = _ops.quantize_scaled_grouped(x, offsets, ones, fmt.dtype, False)[2]
    return role.warm_scale(amax, fmt, margin, recipe)


def cast_rows(x, offsets, state: ExpertScalingState, name: str, fmt, recipe, margin: float, *,
              update: bool, warm: bool, record: bool, transpose: bool):
    """Each group's rows cast with its expert's delayed scale in the role `name` ("input" or
    "grad"), the dense quantize_delayed per group: the role stepped first when `update`, each
    group's own amax as the scale when `warm` (nothing recorded yet), the groups' amaxes
    recorded when `record` (an empty group's is 0). (data, data_t, scale_inv [E])."""
    role = getattr(state, name)
    if update:
        state.step_role(name, recipe, fmt, margin)
    if warm:
        scale = _warm_row_scales(x, offsets, role, fmt, recipe, margin)
    else:
        scale = role.scale.clone()  # a copy: the buffer changes before backward uses it
    data, data_t, amax = _ops.quantize_scaled_grouped(x, offsets, scale, fmt.dtype, transpose)
    if record:
        state.record_role(name, amax)
    return data, data_t, torch.reciprocal(scale)
