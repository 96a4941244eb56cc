"""One quantizer per recipe: how an FP8 layer casts its operands and multiplies them.

The recipes differ in their casts and GEMMs only, so the dense layer has one autograd Function
(autograd.FP8LinearFunction) and asks the recipe's quantizer for:
  cast_weight(state)          the weight cache's Cast (weight_cache.Cast): W and its dgrad copy
  cast_input(x2, state, live) X and its wgrad copy
  cast_grad(...)              dY for dgrad and for wgrad, with the bias gradient
  forward / dgrad / wgrad     the three GEMMs on those casts
  *_stats                     a sampled cast's statistics (fp8ops.monitor)
The layers above (experts, FSDP2, tensor parallelism) ask it what the recipe allows instead of
asking which recipe it is:
  kind            "current", "delayed", "mxfp8" or "blockwise"
  delayed         scales from an amax history (a ScalingState holds its roles)
  scales_from_max a per-tensor scale from the tensor's own max |x| (current scaling without a
                  percentile): its amax can be fused into the cast, taken per expert, or
                  all-reduced over shards before one cast
  gathers_fp8     FSDP2 may gather a dense weight in FP8
  grouped         fp8ops.grouped_linear takes it
  scale_block     the length of a scale block along a sharded dimension (None: per tensor)

quantizer_for(recipe) makes one; it is small and holds nothing but the recipe and what it reads
from it. quantizer_type(recipe) gives its class alone, whose kind and delayed answer without
making one.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops import fused
from ..ops.expert_casts import BLOCK, quantize_experts_blockwise, quantize_experts_current
from ..formats import get_format
from ..scaling import (BlockwiseScaling, CurrentScaling, DelayedScaling, MXFP8Scaling,
                       ScalingState, check_recipe, grad_margin)
from ..scaling import amax_reduction
from . import cast_stats
from .autograd import (FP8LinearFunction, cached_weight_cast, is_gathered, pad, steps_state,
                       takes_warm_scale)
from .per_tensor_cast import cast_per_tensor, shards

_ops = torch.ops.fp8ops


class Quantizer:
    """The casts and GEMMs of one recipe (module doc). Subclasses set the class attributes."""

    kind = ""
    delayed = False
    scales_from_max = False
    gathers_fp8 = False
    grouped = False
    scale_block: Optional[int] = None

    def __init__(self, recipe):
        self.recipe = recipe
        self.fwd, self.bwd = get_format(recipe.fwd_fmt), get_format(recipe.bwd_fmt)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.recipe})"

    # -- the layer's forward (functional.linear) ------------------------------------------------
    def linear(self, x2, weight, bias, state: Optional[ScalingState], out_dtype, x_cast=None):
        """y = x2 @ weight.T + bias: the weight's cast (from the state's cache), X's, then the
        Function. x_cast: X cast already (per-tensor current scaling only)."""
        if x_cast is not None:
            raise ValueError("a pre-cast input takes CurrentScaling")
        w_cast = cached_weight_cast(weight, state, self.cast_weight(state))
        self._observe_weight(state, weight, w_cast)
        x_cast = self.cast_input(x2, state, False)
        return FP8LinearFunction.apply(x2, weight, bias, self, x_cast, w_cast, state, out_dtype)

    def _observe_weight(self, state, weight, w_cast) -> None:
        # a weight gathered in FP8 has no high-precision values here: no cast error to measure
        if cast_stats.sampling(state) and not is_gathered(weight):
            values = cast_stats.weight_values(state, weight)
            cast_stats.observe(state, "weight", self.weight_stats(values, w_cast))

    def grad_warm(self, state) -> bool:
        """Whether the backward's gradient cast takes a warm scale (delayed scaling only)."""
        return False

    def expert_cast(self, values: torch.Tensor, transpose: bool = True) -> tuple:
        """Each expert of values [E, out, in] cast from its own values, as the grouped layer's
        Function takes the experts (nn/grouped.py); transpose=False: without the transposed
        copy (an FSDP2 gather makes it after)."""
        raise NotImplementedError(f"{self.kind} scaling has no expert cast of its own")


# ----------------------------------------------------------------------------------------------
# per-tensor scaling (current or delayed): one float32 scale per tensor; each cast writes its
# transposed copy in the same pass (Hopper's FP8 GEMMs take K-major operands only)
# ----------------------------------------------------------------------------------------------
class PerTensorQuantizer(Quantizer):
    """x_cast and a gradient's cast: (data, data^T, scale, scale_inv); the weight's payload:
    (data, data^T, scale_inv, scale)."""

    def __init__(self, recipe):
        super().__init__(recipe)
        self.stochastic = recipe.grad_rounding == "stochastic"

    def cast_weight(self, state):
        recipe, fwd, delayed = self.recipe, self.fwd, self.delayed

        def cast(w, step, scale):
            if scale is not None:  # a decided scale (a restored cast): never steps the role
                data, data_t, _ = _ops.quantize(w, scale, fwd.dtype, True)
                return (data, data_t, torch.reciprocal(scale), scale), scale
            role = state.weight if delayed else None
            data, data_t, scale, scale_inv, _ = cast_per_tensor(
                w, role, fwd, recipe, recipe.margin, update=step,
                warm=delayed and not role.started, record=step,
                shards=shards(state, "weight"), state=state, name="weight")
            if step:
                role.started = True
            return (data, data_t, scale_inv, scale), scale
        return cast

    def cast_input(self, x2, state, live: bool):
        delayed = self.delayed
        warm = delayed and takes_warm_scale(state, "input", live)
        xq, xq_t, scale, scale_inv, _ = cast_per_tensor(
            x2, state.input if delayed else None, self.fwd, self.recipe, self.recipe.margin,
            update=live, warm=warm, record=live, shards=shards(state, "input"), state=state,
            name="input")
        return xq, xq_t, scale, scale_inv

    def linear(self, x2, weight, bias, state, out_dtype, x_cast=None):
        """x_cast: (data, data^T, amax, scale), X cast already (current scaling only; x2 then
        only carries the gradient)."""
        live = steps_state(state)
        if x_cast is not None and self.delayed:
            raise ValueError("a pre-cast input takes current scaling, not DelayedScaling")
        w_cast = cached_weight_cast(weight, state, self.cast_weight(state), live)
        self._observe_weight(state, weight, w_cast)
        if x_cast is None:
            x_cast = self.cast_input(x2, state, live)
        else:
            xq, xq_t, _, scale = x_cast
            x_cast = (xq, xq_t, scale, torch.reciprocal(scale))
        if self.stochastic and state is None:
            raise ValueError("grad_rounding='stochastic' needs a state (fp8ops.ScalingState) to "
                             "carry the random seed and offset")
        if live:  # decided here, outside the Function, so that a recompute sees the same choice
            state.warm["grad"] = not state.grad.started
        y = FP8LinearFunction.apply(x2, weight, bias, self, x_cast, w_cast, state, out_dtype)
        if live:
            state.input.started = True
            # the grad role records in backward; its first backward took a warm scale (ctx)
            state.grad.started = state.grad.started or torch.is_grad_enabled()
        return y

    def grad_warm(self, state) -> bool:
        return self.delayed and state.warm["grad"]

    def forward(self, x_cast, w_cast, bias, out_dtype, shape):
        return _ops.gemm(x_cast[0], w_cast[0], x_cast[3], w_cast[2], bias, out_dtype, True)

    def saved(self, x_cast, w_cast) -> tuple:
        return x_cast[1], w_cast[1], x_cast[3], w_cast[2]  # X^T, W^T and their scale_inv

    def cast_grad(self, dy2, state, grad_warm: bool, need_dx: bool, need_dw: bool, sum_dtype):
        """(dY cast, the bias gradient or None). Steps and records the grad role (delayed
        scaling, recording); the step's amax all-reduce follows the last layer's backward."""
        eager = not torch.compiler.is_compiling()  # (no state writes in a traced backward)
        delayed = self.delayed
        stepping = delayed and state.recording
        role = state.grad if delayed else None
        # stochastic rounding reads its random stream from the state's device buffer
        rng = state.rng if self.stochastic else None
        gq, gq_t, scale, scale_inv, db = cast_per_tensor(
            dy2, role, self.bwd, self.recipe, grad_margin(self.recipe), update=stepping,
            warm=grad_warm, record=stepping, sum_dtype=sum_dtype, rng=rng,
            shards=shards(state, "grad"), state=state, name="grad")
        if stepping and eager:
            # the role has recorded: later forwards take its scale (set here too for a forward
            # that ran under no_grad, as reentrant activation checkpointing runs it)
            role.started = True
        if stepping and state.needs_reduce() and not amax_reduction.defer(state):
            state.reduce_records()
        return (gq, gq_t, scale, scale_inv), db

    def dgrad(self, g, saved, x_dtype, shape):
        return _ops.gemm(g[0], saved[1], g[3], saved[3], None, x_dtype, False)

    def wgrad(self, g, saved, dtype, shape):
        return _ops.gemm(g[1], saved[0], g[3], saved[2], None, dtype, False)

    def input_stats(self, x2, x_cast):
        return cast_stats.per_tensor_stats(x2, x_cast[0], x_cast[2])

    def weight_stats(self, values, w_cast):
        return cast_stats.per_tensor_stats(values, w_cast[0], w_cast[3])

    def grad_stats(self, dy2, g, need_dx: bool, need_dw: bool):
        return cast_stats.per_tensor_stats(dy2, g[0], g[2])  # (cast whole either way)


class CurrentQuantizer(PerTensorQuantizer):
    kind = "current"

    def __init__(self, recipe):
        super().__init__(recipe)
        self.scales_from_max = recipe.amax_percentile is None
        self.gathers_fp8 = self.scales_from_max
        self.grouped = self.scales_from_max and not self.stochastic

    def expert_cast(self, values, transpose=True):
        """(data, data^T, scale_inv), one scale per expert (data^T empty without transpose)."""
        data, data_t, _, scale_inv = quantize_experts_current(
            values, self.fwd.dtype, self.recipe.margin, self.recipe.power_of_two,
            transpose=transpose)
        return data, data_t, scale_inv


class DelayedQuantizer(PerTensorQuantizer):
    kind = "delayed"
    delayed = True
    gathers_fp8 = True

    def __init__(self, recipe):
        super().__init__(recipe)
        self.grouped = not self.stochastic


# ----------------------------------------------------------------------------------------------
# MXFP8: 32-element E8M0 blocks along K; the backward GEMMs need copies blocked along the other
# axis. Dimensions are zero-padded to the block (zeros change neither amax nor the products).
# ----------------------------------------------------------------------------------------------
class MXQuantizer(Quantizer):
    """x_cast: (data [M, Kp], scales, data blocked along M [Mp, Kp], its scales); the weight's
    payload: ((row data, row scales), (column data^T, column scales^T)), the layout the C++ step
    keeps too; a gradient's cast: (row data, row scales, column data, column scales)."""

    kind = "mxfp8"

    def __init__(self, recipe):
        super().__init__(recipe)
        self.block, self.rceil = recipe.block_size, recipe.scale_mode == "rceil"
        self.scale_block = recipe.block_size

    def cast_weight(self, state):
        fwd, bs, rceil = self.fwd, self.block, self.rceil

        def cast(w, step, scale):
            wp = pad(pad(w, 1, bs), 0, bs)  # [Np, Kp]
            row = _ops.quantize_mx(wp, fwd.dtype, bs, 1, rceil)
            col = _ops.quantize_mx(wp, fwd.dtype, bs, 0, rceil)  # blocked along N, for dgrad
            return (row, (col[0].t(), col[1].t())), None
        return cast

    def cast_input(self, x2, state, live: bool):
        data, scales, col_data, col_scales, _ = _ops.quantize_mx_pair(
            x2, self.fwd.dtype, self.block, self.rceil)
        return data, scales, col_data, col_scales

    def forward(self, x_cast, w_cast, bias, out_dtype, shape):
        bias_p = None if bias is None else pad(bias, 0, self.block)
        (w_data, w_scales), _ = w_cast
        return _ops.gemm_mx(x_cast[0], x_cast[1], w_data, w_scales, bias_p, out_dtype,
                            self.block)[:, :shape[2]]

    def saved(self, x_cast, w_cast) -> tuple:
        return x_cast[2].t(), x_cast[3].t(), w_cast[1][0], w_cast[1][1]

    def cast_grad(self, dy2, state, grad_warm, need_dx, need_dw, sum_dtype):
        bwd, bs, rceil = self.bwd.dtype, self.block, self.rceil
        data = scales = col_data = col_scales = None
        if need_dx and need_dw:  # both copies and the bias gradient in one call
            data, scales, col_data, col_scales, db = _ops.quantize_mx_pair(
                dy2, bwd, bs, rceil, sum_dtype)
            return (data, scales, col_data, col_scales), None if sum_dtype is None else db
        dyp = pad(pad(dy2, 1, bs), 0, bs)  # [Mp, Np]
        if need_dx:
            data, scales = _ops.quantize_mx(dyp[:dy2.shape[0]], bwd, bs, 1, rceil)
        if need_dw:
            col_data, col_scales = _ops.quantize_mx(dyp, bwd, bs, 0, rceil)
        db = None if sum_dtype is None else fused.column_sums(dy2, sum_dtype)
        return (data, scales, col_data, col_scales), db

    def dgrad(self, g, saved, x_dtype, shape):
        return _ops.gemm_mx(g[0], g[1], saved[2], saved[3], None, x_dtype,
                            self.block)[:, :shape[1]]

    def wgrad(self, g, saved, dtype, shape):
        return _ops.gemm_mx(g[2].t(), g[3].t(), saved[0], saved[1], None, dtype,
                            self.block)[:shape[2], :shape[1]]

    def input_stats(self, x2, x_cast):
        return cast_stats.mx_stats(x2, x_cast[0], x_cast[1], self.block, 1)

    def weight_stats(self, values, w_cast):
        return cast_stats.mx_stats(values, *w_cast[0], self.block, 1)

    def grad_stats(self, dy2, g, need_dx: bool, need_dw: bool):
        if not (need_dx or need_dw):
            return None  # (only the bias gradient: nothing was cast)
        if need_dx:
            return cast_stats.mx_stats(dy2, g[0], g[1], self.block, 1)
        return cast_stats.mx_stats(dy2, g[2], g[3], self.block, 0)


# ----------------------------------------------------------------------------------------------
# Blockwise (DeepSeek-V3): activations and gradients 1x128, weights 128x128.
# ----------------------------------------------------------------------------------------------
class BlockwiseQuantizer(Quantizer):
    """x_cast and a gradient's cast: (data, scale_inv, data^T, its scale_inv), each 1x128; the
    weight's payload: (data, scale_inv, data^T), 128x128."""

    kind = "blockwise"
    gathers_fp8 = True
    grouped = True
    scale_block = BLOCK

    def cast_weight(self, state):
        fwd, p2 = self.fwd, self.recipe.power_of_two

        def cast(w, step, scale):
            data, scale_inv = _ops.quantize_blockwise(w, fwd.dtype, BLOCK, BLOCK, p2)
            return (data, scale_inv, _ops.transpose_fp8(data)), None
        return cast

    def cast_input(self, x2, state, live: bool):
        # X 1x128 for the forward GEMM and X^T 1x128 (128 along M) for wgrad, in one call
        data, scale_inv, data_t, scale_inv_t, _ = _ops.quantize_blockwise_pair(
            x2, self.fwd.dtype, self.recipe.power_of_two)
        return data, scale_inv, data_t, scale_inv_t

    def forward(self, x_cast, w_cast, bias, out_dtype, shape):
        return _ops.gemm_blockwise(x_cast[0], w_cast[0], x_cast[1], w_cast[1], bias, out_dtype)

    def saved(self, x_cast, w_cast) -> tuple:
        return x_cast[2], x_cast[3], w_cast[2], w_cast[1].t()

    def cast_grad(self, dy2, state, grad_warm, need_dx, need_dw, sum_dtype):
        bwd, p2 = self.bwd.dtype, self.recipe.power_of_two
        data = scale_inv = data_t = scale_inv_t = None
        if need_dx and need_dw:  # both copies and the bias gradient in one call
            data, scale_inv, data_t, scale_inv_t, db = _ops.quantize_blockwise_pair(
                dy2, bwd, p2, sum_dtype)
            return (data, scale_inv, data_t, scale_inv_t), None if sum_dtype is None else db
        if need_dx:
            data, scale_inv = _ops.quantize_blockwise(dy2, bwd, 1, BLOCK, p2)
        if need_dw:
            data_t, scale_inv_t = _ops.quantize_blockwise(dy2.t(), bwd, 1, BLOCK, p2)
        db = None if sum_dtype is None else fused.column_sums(dy2, sum_dtype)
        return (data, scale_inv, data_t, scale_inv_t), db

    def dgrad(self, g, saved, x_dtype, shape):
        return _ops.gemm_blockwise(g[0], saved[2], g[1], saved[3], None, x_dtype)

    def wgrad(self, g, saved, dtype, shape):
        return _ops.gemm_blockwise(g[2], saved[0], g[3], saved[1], None, dtype)

    def input_stats(self, x2, x_cast):
        return cast_stats.blockwise_stats(x2, x_cast[0], x_cast[1], 1, BLOCK)

    def weight_stats(self, values, w_cast):
        return cast_stats.blockwise_stats(values, w_cast[0], w_cast[1], BLOCK, BLOCK)

    def grad_stats(self, dy2, g, need_dx: bool, need_dw: bool):
        if not (need_dx or need_dw):
            return None  # (only the bias gradient: nothing was cast)
        if need_dx:
            return cast_stats.blockwise_stats(dy2, g[0], g[1], 1, BLOCK)
        return cast_stats.blockwise_stats(dy2.t(), g[2], g[3], 1, BLOCK)

    def expert_cast(self, values, transpose=True):
        """(data, scale_inv, data^T, scale_inv^T): ops.expert_casts.quantize_experts_blockwise."""
        return quantize_experts_blockwise(values, self.fwd.dtype, self.recipe.power_of_two,
                                          transpose=transpose)


_BY_RECIPE = {CurrentScaling: CurrentQuantizer, DelayedScaling: DelayedQuantizer,
              MXFP8Scaling: MXQuantizer, BlockwiseScaling: BlockwiseQuantizer}


def quantizer_type(recipe) -> tuple:
    """(the quantizer class of `recipe`, the recipe checked) without making one: its class
    attributes (kind, delayed) answer for the recipe. None: CurrentScaling(); a recipe subclass
    takes its base's quantizer."""
    kind = _BY_RECIPE.get(type(recipe))
    if kind is not None:
        return kind, recipe
    recipe = check_recipe(recipe)
    for cls in type(recipe).__mro__:
        kind = _BY_RECIPE.get(cls)
        if kind is not None:
            return kind, recipe
    raise TypeError(f"no quantizer for {type(recipe).__name__}")  # (check_recipe refuses it)


def quantizer_for(recipe) -> Quantizer:
    """The quantizer of `recipe` (None: CurrentScaling()); a recipe subclass takes its base's.
    A new small object each call: a cache by recipe object would hold recipes (and their
    process groups) alive, and torch.compile would guard on it (a recompile per recipe)."""
    kind = _BY_RECIPE.get(type(recipe))  # (the common case without a call more)
    if kind is None:
        kind, recipe = quantizer_type(recipe)
    return kind(recipe)
