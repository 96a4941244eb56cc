"""The FP8 grouped linear layer of mixture-of-experts models: fp8ops.grouped_linear and
FP8GroupedLinear.

Tokens come sorted by expert: x [M, in], expert g's rows offsets[g-1]:offsets[g] (int32, the
cumulative end row of each group, as torch._grouped_mm takes them), weight [E, out, in]. Three
grouped FP8 GEMMs, as fp8ops.linear's three dense ones, group by group:
  forward  Y_g  = X_g W_g^T     grouped_gemm(X, W)
  dgrad    dX_g = dY_g W_g      grouped_gemm(dY, W^T)     (the weight's transposed copy)
  wgrad    dW_g = dY_g^T X_g    grouped_gemm_wgrad(dY^T, X^T)
Current scaling scales each group of X and dY by its own amax and each expert's weight by its
own: a scale per group is what a loop of fp8ops.linear over the experts uses, so the layer gives
that loop's bytes.

The weight cache: given a WeightCache (FP8GroupedLinear holds one, as do converted transformers
experts modules, one per 3-D parameter), all experts of a weight are cast in one go and that cast
is reused under WeightCache's rule, the dense layers' (scaling/weight_cache.py): only while a
live optimizer holds the weight, its generation has not moved (an optimizer step) and the
weight's gradient is still the one this cast's backward accumulated; so once per optimizer step
across the micro-batches of an accumulation window, and every forward without an optimizer.
Without a cache, under torch.compile and during CUDA graph capture the weight is cast every call.

Under FSDP2 (fully_shard) FP8GroupedLinear's weight is gathered in FP8 (distributed/fsdp.py):
each rank casts its whole experts, the gathered bytes and scales come as the weight, and the
grouped GEMMs take them as they are.
Not here yet: delayed scaling, MXFP8 and stochastic rounding.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..distributed import on_weight_set
from ..ops.expert_casts import quantize_experts_blockwise, quantize_experts_current
from ..scaling import (BlockwiseScaling, CurrentScaling, WeightCache, check_recipe, grad_margin,
                       recipe_formats)
from .autograd import first_order_only, is_gathered, output_dtype, weight_grad
from .functional import check_operands

_ops = torch.ops.fp8ops
_F32 = torch.float32


def _bias_grad(dy: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each expert's bias gradient: the sum of its rows of dY, in float32, in bias's dtype.
    (Summed by index_add, so it agrees with the dense column sums to float32 rounding.)"""
    rows = torch.arange(dy.shape[0], dtype=offsets.dtype, device=dy.device)
    expert = torch.searchsorted(offsets, rows, right=True)  # E for rows past the last group
    sums = dy.new_zeros((offsets.shape[0] + 1, dy.shape[1]), dtype=_F32)
    return sums.index_add_(0, expert, dy.to(_F32))[:-1].to(bias.dtype)


def _cast_experts(weight: torch.Tensor, recipe, cache: Optional[WeightCache]) -> tuple:
    """The FP8 copies of all experts' weights, as the recipe's Function takes them: from the
    cache when its rule allows (module doc), else cast now (and kept in the cache)."""
    fwd, _ = recipe_formats(recipe)
    p2 = recipe.power_of_two
    blockwise = isinstance(recipe, BlockwiseScaling)

    def cast(w, step, scale):  # (weight_cache.Cast: no delayed scaling, so no step, no scale)
        w = w.detach()
        if blockwise:
            tensors = quantize_experts_blockwise(w, fwd.dtype, p2)
        else:
            data, data_t, _, scale_inv = quantize_experts_current(w, fwd.dtype, recipe.margin,
                                                                  p2)
            tensors = (data, data_t, scale_inv)
        return (recipe, tensors), None  # no per-tensor scale: one per expert, or blocks

    with torch.no_grad():
        if is_gathered(weight):  # FSDP2 gathered the experts in FP8 (distributed/fsdp.py)
            return weight.expert_payload(cache)
        if (cache is None or torch.compiler.is_compiling()
                or (weight.is_cuda and torch.cuda.is_current_stream_capturing())):
            return cast(weight, False, None)[0][1]
        made, tensors = cache.get(weight, cast, live=False)
        if made != recipe:  # the layer's recipe changed since that cast
            cache.invalidate()
            made, tensors = cache.get(weight, cast, live=False)
        return tensors


def _vouch_grad(cache: Optional[WeightCache], dw) -> None:
    """dw comes from the cached cast: its accumulation into .grad vouches for that cast (eager
    only: a compiled call casts every time)."""
    if cache is not None and dw is not None and not torch.compiler.is_compiling():
        cache.expect_grad()


class GroupedLinearCurrent(torch.autograd.Function):
    """Current scaling: one scale per group of X and dY, one per expert of W."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, recipe, out_dtype, w_cast, cache):
        fwd, bwd = recipe_formats(recipe)
        p2 = recipe.power_of_two
        xq, xq_t, _, x_scale_inv = _ops.quantize_current_grouped(x, offsets, fwd.dtype,
                                                                 recipe.margin, p2, True)
        wq, wq_t, w_scale_inv = w_cast
        y = _ops.grouped_gemm(xq, wq, offsets, x_scale_inv, w_scale_inv, bias, out_dtype)
        ctx.save_for_backward(xq_t, wq_t, x_scale_inv, w_scale_inv, offsets, weight, bias)
        ctx.meta = (bwd, grad_margin(recipe), p2, x.dtype)
        ctx.cache = cache
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        xq_t, wq_t, x_scale_inv, w_scale_inv, offsets, weight, bias = ctx.saved_tensors
        bwd, margin, p2, x_dtype = ctx.meta
        dy = dy.contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        gq, gq_t, _, g_scale_inv = _ops.quantize_current_grouped(dy, offsets, bwd.dtype, margin,
                                                                 p2, need_dw)
        dx = dw = db = None
        if need_dx:
            dx = _ops.grouped_gemm(gq, wq_t, offsets, g_scale_inv, w_scale_inv, None, x_dtype)
        if need_dw:
            dw = weight_grad(weight, lambda dtype: _ops.grouped_gemm_wgrad(
                gq_t, xq_t, offsets, g_scale_inv, x_scale_inv, dtype))
            _vouch_grad(ctx.cache, dw)
        if need_db and bias is not None:
            db = _bias_grad(dy, offsets, bias)
        return dx, dw, db, None, None, None, None, None


class GroupedLinearBlockwise(torch.autograd.Function):
    """DeepSeek-V3 blocks: X and dY in 1x128 blocks (per group), W in 128x128 blocks."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, recipe, out_dtype, w_cast, cache):
        fwd, bwd = recipe_formats(recipe)
        p2 = recipe.power_of_two
        x_data, x_si, xt_data, xt_si = _ops.quantize_blockwise_grouped(x, offsets, fwd.dtype, p2)
        w_data, w_si, wt_data, wt_si = w_cast
        y = _ops.grouped_gemm_blockwise(x_data, w_data, offsets, x_si, w_si, bias, out_dtype)
        ctx.save_for_backward(xt_data, xt_si, wt_data, wt_si, offsets, weight, bias)
        ctx.meta = (bwd, p2, x.dtype)
        ctx.cache = cache
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        xt_data, xt_si, wt_data, wt_si, offsets, weight, bias = ctx.saved_tensors
        bwd, p2, x_dtype = ctx.meta
        dy = dy.contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        g_data, g_si, gt_data, gt_si = _ops.quantize_blockwise_grouped(dy, offsets, bwd.dtype, p2)
        dx = dw = db = None
        if need_dx:
            dx = _ops.grouped_gemm_blockwise(g_data, wt_data, offsets, g_si, wt_si, None, x_dtype)
        if need_dw:
            dw = weight_grad(weight, lambda dtype: _ops.grouped_gemm_wgrad_blockwise(
                gt_data, xt_data, offsets, gt_si, xt_si, dtype))
            _vouch_grad(ctx.cache, dw)
        if need_db and bias is not None:
            db = _bias_grad(dy, offsets, bias)
        return dx, dw, db, None, None, None, None, None


def _check(x, weight, offsets, bias) -> None:
    check_operands(x, weight)
    if weight.dim() != 3:
        raise ValueError(f"weight must be 3-D [experts, out_features, in_features], got shape "
                         f"{tuple(weight.shape)}")
    if x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"input must be 2-D [tokens, in_features={weight.shape[2]}] sorted by "
                         f"expert, got shape {tuple(x.shape)}")
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 \
            or offsets.shape != (weight.shape[0],):
        raise ValueError(f"offsets must be an int32 tensor of shape ({weight.shape[0]},) (each "
                         f"expert's cumulative end row), got "
                         f"{getattr(offsets, 'dtype', type(offsets).__name__)} "
                         f"{tuple(getattr(offsets, 'shape', ()))}")
    for name, t in (("weight", weight), ("offsets", offsets), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but input is on {x.device}")
    if bias is not None and bias.shape != weight.shape[:2]:
        raise ValueError(f"bias must have shape {tuple(weight.shape[:2])} [experts, "
                         f"out_features], got {tuple(bias.shape)}")


def _check_grouped_recipe(recipe):
    recipe = check_recipe(recipe)
    if isinstance(recipe, CurrentScaling):
        if recipe.amax_percentile is not None or recipe.grad_rounding == "stochastic":
            raise NotImplementedError("grouped_linear takes CurrentScaling without "
                                      "amax_percentile and with round-to-nearest gradients")
        return recipe
    if isinstance(recipe, BlockwiseScaling):
        return recipe
    raise NotImplementedError(f"grouped_linear supports CurrentScaling and BlockwiseScaling, "
                              f"not {type(recipe).__name__} yet")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, *, recipe=None,
                   weight_cache: Optional[WeightCache] = None) -> torch.Tensor:
    """y_g = x_g @ weight[g].T (+ bias[g]) for each expert g, with FP8 GEMMs in forward and
    backward. x [M, in] sorted by expert, weight [E, out, in], offsets int32 [E] (expert g's
    rows end at offsets[g]; rows past offsets[-1] give zero rows), bias [E, out] or None.
    Returns [M, out] in x's dtype (under torch.autocast, the autocast dtype); the gradients come
    in x's and the weight's dtypes. recipe: None (current scaling, a scale per expert) or
    fp8ops.CurrentScaling / fp8ops.BlockwiseScaling. weight_cache: a WeightCache (one per
    weight) that keeps the experts' FP8 cast between calls under the dense layers' reuse rule
    (module doc); None: cast every call."""
    _check(x, weight, offsets, bias)
    recipe = _check_grouped_recipe(recipe)
    function = (GroupedLinearBlockwise if isinstance(recipe, BlockwiseScaling)
                else GroupedLinearCurrent)
    if weight_cache is not None and torch.compiler.is_compiling():
        weight_cache = None  # (a compiled call casts every time)
    out_dtype = output_dtype(x)
    if out_dtype == x.dtype:
        w_cast = _cast_experts(weight, recipe, weight_cache)
        return function.apply(x, weight, bias, offsets, recipe, out_dtype, w_cast, weight_cache)
    with torch.autocast(x.device.type, enabled=False):  # the output's dtype is decided
        w_cast = _cast_experts(weight, recipe, weight_cache)
        return function.apply(x, weight, bias, offsets, recipe, out_dtype, w_cast, weight_cache)


class FP8GroupedLinear(nn.Module):
    """E linear layers of the same shape (the experts of a mixture-of-experts layer) applied to
    tokens sorted by expert, with FP8 GEMMs: forward(x [M, in], offsets int32 [E]) -> [M, out].
    weight [E, out, in] (and bias [E, out] when bias=True), each expert initialized as
    nn.Linear initializes its weight. `weight_cache` (a WeightCache) keeps the experts' FP8 cast
    between calls: one cast per optimizer step for all experts (module doc); call
    `weight_cache.invalidate()` after changing the weight where an optimizer that holds it
    cannot see it (a `p.data` update between its steps). Under FSDP2 the weight is gathered in
    FP8 (module doc); set `fp8_all_gather = False` before fully_shard to gather it in high
    precision."""

    # under FSDP2, gather the experts in FP8 where the recipe allows (distributed/fsdp.py)
    fp8_all_gather = True

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 recipe=None, *, device=None, dtype=None):
        super().__init__()
        self.num_experts, self.in_features = num_experts, in_features
        self.out_features = out_features
        self.recipe = _check_grouped_recipe(recipe)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = (nn.Parameter(torch.empty(num_experts, out_features, **factory)) if bias
                     else None)
        self.weight_cache = WeightCache()
        self.reset_parameters()

    def __setattr__(self, name, value):
        # FSDP2 sets its sharded parameter through setattr when a module defines it: there
        # fp8ops.distributed has FSDP2 gather the experts in FP8
        if name == "weight":
            on_weight_set(self, value)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        # Module._apply may swap the weight for a new tensor (torch.utils.swap_tensors), which
        # refuses a tensor with weak references: the cache drops its own meanwhile
        cache = self.__dict__.get("weight_cache")
        if cache is None:
            return super()._apply(fn, recurse)
        with cache.unreferenced(self._parameters.get("weight")):
            return super()._apply(fn, recurse)

    def reset_parameters(self) -> None:
        for g in range(self.num_experts):  # each expert as nn.Linear would be
            nn.init.kaiming_uniform_(self.weight[g], a=math.sqrt(5))
        if "weight_cache" in self.__dict__:
            self.weight_cache.invalidate()
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, offsets, self.bias, recipe=self.recipe,
                              weight_cache=self.__dict__.get("weight_cache"))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={type(self.recipe).__name__}")
