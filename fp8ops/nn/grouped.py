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

Delayed scaling: each expert has the dense layer's delayed-scaling state for its X rows, its
weight and its dY rows (ExpertScalingState, buffers with a leading expert dimension), and goes
through the dense delayed path (autograd.linear_per_tensor) on its own rows: the same steps,
warm start, casts and amax records (0 for an expert with no tokens), the weight role stepping
once per accumulation window as the cache decides. So expert g's bytes and state are those of
a dense FP8Linear run on its rows alone. The offsets stay on the device; torch.compile takes it
with no graph break. Under torch.distributed (data parallel, FSDP2) the experts' amaxes are
recorded on each rank and folded across the ranks by the dense layers' one MAX all-reduce at the
end of the backward pass (distributed/amax_reduction.py), and a warm start casts with each
expert's amax over all ranks: every rank's state stays identical, and is the state of one process
that ran every rank's tokens (an expert given no tokens on one rank takes the others' amaxes).
Under FSDP2 (fully_shard) FP8GroupedLinear's weight, and a converted transformers experts
module's 3-D parameters, are gathered in FP8 (distributed/fsdp.py): each rank casts its whole
experts, the gathered bytes and scales come as the weight, and the grouped GEMMs take them as
they are (current, delayed and blockwise scaling; delayed scaling steps and records as the
unsharded layer does, each rank casting its experts with their slice of the role's scales).
When a CPUOffloadOptimizer owns the weight, the parameter is a placeholder and the cache casts
the host master's values (optim/host_weight.py), once per optimizer step, as for a dense layer.
Not here yet: MXFP8 and stochastic rounding.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..distributed import amax_reduction, on_weight_set
from ..ops.expert_casts import experts_amax, quantize_experts_scaled
from ..scaling import WeightCache, grad_margin, recipe_formats
from ..scaling.expert_state import ExpertScalingState
from ..scaling.weight_cache import BACKWARD, GRADIENT, KEY
from . import caches
from .autograd import (first_order_only, in_recompute, is_gathered, output_dtype,
                       steps_state, takes_warm_scale, weight_grad)
from .functional import check_operands
from .quantizers import quantizer_for

_ops = torch.ops.fp8ops
_F32 = torch.float32


def _bias_grad(dy: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each expert's bias gradient: the sum of its rows of dY, in float32, in bias's dtype.
    (Summed by index_add, so it agrees with the dense column sums to float32 rounding.)"""
    rows = torch.arange(dy.shape[0], dtype=offsets.dtype, device=dy.device)
    expert = torch.searchsorted(offsets, rows, right=True)  # E for rows past the last group
    sums = dy.new_zeros((offsets.shape[0] + 1, dy.shape[1]), dtype=_F32)
    return sums.index_add_(0, expert, dy.to(_F32))[:-1].to(bias.dtype)


def _cast_experts(weight: torch.Tensor, recipe, cache: Optional[WeightCache],
                  state: Optional[ExpertScalingState] = None, host=None) -> tuple:
    """The FP8 copies of all experts' weights, as the recipe's Function takes them: from the
    cache when its rule allows (module doc), else cast now (and kept in the cache). state: the
    delayed-scaling state (DelayedScaling only), whose weight role a live forward steps when it
    casts anew, once per accumulation window (the cache decides, as for the dense layer).
    host: the host master of an offloaded weight (the cache's own when there is a cache)."""
    cast = _fresh_expert_cast(recipe) if state is None else _delayed_expert_cast(recipe, state)
    live = state is not None and steps_state(state)
    host = host if cache is None else cache.host
    if host is not None:  # offloaded (CPUOffloadOptimizer): weight is a placeholder
        cast = _from_host(cast, host)
    with torch.no_grad():
        if is_gathered(weight):  # FSDP2 gathered the experts in FP8 (distributed/fsdp.py)
            return weight.expert_payload(cache, live)
        if (cache is None or torch.compiler.is_compiling()
                or (weight.is_cuda and torch.cuda.is_current_stream_capturing())):
            return cast(weight, live, None)[0][1]
        # a delayed recompute (activation checkpointing) reuses its forward's cast on the key
        trust = KEY if state is not None and in_recompute() else GRADIENT
        source = cache.source_tensor()
        if host is not None:
            # as a dense layer's: the values change with the generation, or with a write to the
            # master in place (a state_dict tensor edited), which its version shows
            trust, source = max(trust, BACKWARD), host.master
        elif source is not None and source is not weight:
            # FSDP2's full weight gathered in high precision: its values change with the sharded
            # parameter (the key's source), and a backward since the cast vouches for it, as for
            # a dense layer (ScalingState.cached_weight)
            trust = max(trust, BACKWARD)
        else:
            source = None
        made, tensors = cache.get(weight, cast, live=live, trust=trust, source=source)
        if made != recipe:  # the layer's recipe changed since that cast
            cache.invalidate()
            made, tensors = cache.get(weight, cast, live=live, trust=trust, source=source)
        return tensors


def _from_host(cast, host):
    """cast, applied to the host master's values (optim/host_weight.py) in the layout of the
    placeholder it is given."""
    def from_host(w, step, scale):
        return cast(host.values_for(w), step, scale)
    return from_host


def _fresh_expert_cast(recipe):
    """weight_cache.Cast of current and blockwise scaling: each expert from its own values (no
    step, no given scale)."""
    quantizer = quantizer_for(recipe)

    def cast(w, step, scale):  # no per-tensor scale: one per expert, or blocks
        return (recipe, quantizer.expert_cast(w.detach())), None
    return cast


def _delayed_expert_cast(recipe, state: ExpertScalingState):
    """weight_cache.Cast of delayed scaling, the dense layer's per expert: a given scale [E]
    (the window's) casts without stepping; else the weight role steps first when `step`, each
    expert is cast with its role's scale (its own amax before anything was recorded) and records
    its amax when `step`."""
    fwd, _ = recipe_formats(recipe)
    role = state.weight

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


def _warm_row_scales(x, offsets, role, fmt, recipe, margin: float) -> torch.Tensor:
    """Each group's scale from its own rows' amax (its role has recorded nothing yet), over all
    ranks' rows under torch.distributed."""
    # the groups' amaxes (a cast's, its bytes unused: a warm start happens once)
    ones = torch.ones(offsets.shape[0], dtype=_F32, device=x.device)
    amax = _ops.quantize_scaled_grouped(x, offsets, ones, fmt.dtype, False)[2]
    return role.warm_scale(amax, fmt, margin, recipe)


def _warm_expert_scales(w: torch.Tensor, role, fmt, recipe) -> torch.Tensor:
    """Each expert's scale from its own weight's amax (the weight role has recorded nothing
    yet), over all ranks' weights under torch.distributed (as the dense layer's warm start)."""
    return role.warm_scale(experts_amax(w), fmt, recipe.margin, recipe)


def _cast_rows(x, offsets, state: ExpertScalingState, name: str, fmt, recipe, margin: float, *,
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


def _vouch_grad(cache: Optional[WeightCache], dw) -> None:
    """dw comes from the cached cast: its accumulation into .grad vouches for that cast (eager
    only: a compiled call casts every time)."""
    if cache is not None and dw is not None and not torch.compiler.is_compiling():
        cache.expect_grad()


def _per_tensor_grads(ctx, saved: tuple, dy: torch.Tensor, grad_cast: tuple,
                      x_dtype: torch.dtype) -> tuple:
    """(dx, dw, db) of a per-tensor recipe's backward (current or delayed) from dY's grouped
    cast (data, transposed data, scale_inv [E]) and the tensors its forward saved (unpacked
    once by the caller: activation checkpointing allows no second unpack)."""
    xq_t, wq_t, x_scale_inv, w_scale_inv, offsets, weight, bias = saved
    gq, gq_t, g_scale_inv = grad_cast
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx = dw = db = None
    if need_dx:
        dx = _ops.grouped_gemm(gq, wq_t, offsets, g_scale_inv, w_scale_inv, None, x_dtype)
    if need_dw:
        dw = weight_grad(weight, lambda dtype: _ops.grouped_gemm_wgrad(
            gq_t, xq_t, offsets, g_scale_inv, x_scale_inv, dtype))
        _vouch_grad(ctx.cache, dw)
    if need_db and bias is not None:
        db = _bias_grad(dy, offsets, bias)
    return dx, dw, db


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
        saved = ctx.saved_tensors
        offsets = saved[4]
        bwd, margin, p2, x_dtype = ctx.meta
        dy = dy.contiguous()
        gq, gq_t, _, g_scale_inv = _ops.quantize_current_grouped(dy, offsets, bwd.dtype, margin,
                                                                 p2, ctx.needs_input_grad[1])
        grads = _per_tensor_grads(ctx, saved, dy, (gq, gq_t, g_scale_inv), x_dtype)
        return (*grads, None, None, None, None, None)


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


class GroupedLinearDelayed(torch.autograd.Function):
    """Delayed scaling: each expert's X rows, weight and dY rows cast with the scales of its own
    amax histories (ExpertScalingState). X is cast before this Function (outside it the state's
    host flags may change under torch.compile), dY in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, recipe, out_dtype, w_cast, cache, x_cast, state):
        xq, xq_t, x_scale_inv = x_cast
        wq, wq_t, w_scale_inv = w_cast
        y = _ops.grouped_gemm(xq, wq, offsets, x_scale_inv, w_scale_inv, bias, out_dtype)
        ctx.save_for_backward(xq_t, wq_t, x_scale_inv, w_scale_inv, offsets, weight, bias)
        ctx.meta = (recipe, x.dtype, state.warm["grad"])
        ctx.state, ctx.cache = state, cache
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        offsets = saved[4]
        recipe, x_dtype, grad_warm = ctx.meta
        state = ctx.state
        _, bwd = recipe_formats(recipe)
        dy = dy.contiguous()
        stepping = state.recording
        gq, gq_t, g_scale_inv = _cast_rows(dy, offsets, state, "grad", bwd, recipe,
                                           grad_margin(recipe), update=stepping, warm=grad_warm,
                                           record=stepping, transpose=ctx.needs_input_grad[1])
        if stepping and not torch.compiler.is_compiling():
            state.grad.started = True  # (also for a forward that ran under no_grad)
        # the step's all-reduce: one for every delayed-scaling layer at the end of the backward
        if stepping and state.needs_reduce() and not amax_reduction.defer(state):
            state.reduce_records()
        grads = _per_tensor_grads(ctx, saved, dy, (gq, gq_t, g_scale_inv), x_dtype)
        return (*grads, None, None, None, None, None, None, None)


# the Function of each recipe that casts the experts from their own values
_FUNCTIONS = {"current": GroupedLinearCurrent, "blockwise": GroupedLinearBlockwise}


def _grouped_linear_delayed(x, weight, bias, offsets, recipe, out_dtype, cache,
                            state: ExpertScalingState, host=None):
    """The dense delayed path (autograd.linear_per_tensor) per expert: the weight cast, then X's
    (stepping and recording when live), the gradient's warm choice decided here so that a
    recompute sees the same."""
    fwd, _ = recipe_formats(recipe)
    live = steps_state(state)
    w_cast = _cast_experts(weight, recipe, cache, state, host)
    x_cast = _cast_rows(x, offsets, state, "input", fwd, recipe, recipe.margin, update=live,
                        warm=takes_warm_scale(state, "input", live), record=live, transpose=True)
    if live:
        state.warm["grad"] = not state.grad.started
    y = GroupedLinearDelayed.apply(x, weight, bias, offsets, recipe, out_dtype, w_cast, cache,
                                   x_cast, state)
    if live:
        state.input.started = True
        state.grad.started = state.grad.started or torch.is_grad_enabled()
    return y


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
    quantizer = quantizer_for(recipe)
    if not quantizer.grouped:
        raise NotImplementedError(
            f"grouped_linear takes CurrentScaling (without amax_percentile) or DelayedScaling, "
            f"both with round-to-nearest gradients, or BlockwiseScaling; not {quantizer.recipe}")
    return quantizer.recipe


def _check_state(state, recipe, weight: torch.Tensor, weight_cache) -> None:
    if not isinstance(state, ExpertScalingState):
        raise TypeError(f"state must be an fp8ops.nn.grouped.ExpertScalingState, got "
                        f"{type(state).__name__}")
    if recipe is not None and recipe != state.recipe:
        raise ValueError(f"recipe {recipe} differs from the state's recipe {state.recipe}")
    if state.num_experts != weight.shape[0]:
        raise ValueError(f"the state holds {state.num_experts} experts but the weight has "
                         f"{weight.shape[0]}")
    if weight_cache is not None and weight_cache is not state.weight_cache:
        raise ValueError("with a state, the weight cache is the state's (state.weight_cache): "
                         "pass weight_cache=None or that one")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, *, recipe=None,
                   weight_cache: Optional[WeightCache] = None,
                   state: Optional[ExpertScalingState] = None) -> torch.Tensor:
    """y_g = x_g @ weight[g].T (+ bias[g]) for each expert g, with FP8 GEMMs in forward and
    backward. x [M, in] sorted by expert, weight [E, out, in], offsets int32 [E] (expert g's
    rows end at offsets[g]; rows past offsets[-1] give zero rows), bias [E, out] or None.
    Returns [M, out] in x's dtype (under torch.autocast, the autocast dtype); the gradients come
    in x's and the weight's dtypes. recipe: None (current scaling, a scale per expert) or
    fp8ops.CurrentScaling / fp8ops.DelayedScaling / fp8ops.BlockwiseScaling. weight_cache: a
    WeightCache (one per weight) that keeps the experts' FP8 cast between calls under the dense
    layers' reuse rule (module doc); None: cast every call. DelayedScaling needs `state`
    (ExpertScalingState(recipe, E)), which holds each expert's amax histories and its own weight
    cache (used here; recipe may then be left out)."""
    _check(x, weight, offsets, bias)
    if state is not None:
        _check_state(state, recipe, weight, weight_cache)
        recipe, weight_cache = state.recipe, state.weight_cache
    recipe = _check_grouped_recipe(recipe)
    if state is None and quantizer_for(recipe).delayed:
        raise ValueError("DelayedScaling keeps an amax history per expert: pass "
                         "state=ExpertScalingState(recipe, num_experts) (FP8GroupedLinear does "
                         "this for you)")
    host = None if weight_cache is None else weight_cache.host
    if weight_cache is not None and torch.compiler.is_compiling():
        weight_cache = None  # (a compiled call casts every time, from the host master if any)
    out_dtype = output_dtype(x)
    device = x.device.type
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return _by_recipe(x, weight, bias, offsets, recipe, out_dtype, weight_cache, state, host)
    # the output's dtype is decided; nothing inside is autocast's to retype (it would refuse to
    # stack FP8 tensors), also when x already comes in autocast's dtype
    with torch.autocast(device, enabled=False):
        return _by_recipe(x, weight, bias, offsets, recipe, out_dtype, weight_cache, state, host)


def _by_recipe(x, weight, bias, offsets, recipe, out_dtype, weight_cache, state, host):
    if state is not None:  # (delayed scaling: grouped_linear checked)
        return _grouped_linear_delayed(x, weight, bias, offsets, recipe, out_dtype, weight_cache,
                                       state, host)
    function = _FUNCTIONS[quantizer_for(recipe).kind]
    w_cast = _cast_experts(weight, recipe, weight_cache, host=host)
    return function.apply(x, weight, bias, offsets, recipe, out_dtype, w_cast, weight_cache)


class FP8GroupedLinear(nn.Module):
    """E linear layers of the same shape (the experts of a mixture-of-experts layer) applied to
    tokens sorted by expert, with FP8 GEMMs: forward(x [M, in], offsets int32 [E]) -> [M, out].
    weight [E, out, in] (and bias [E, out] when bias=True), each expert initialized as
    nn.Linear initializes its weight. `weight_cache` (a WeightCache) keeps the experts' FP8 cast
    between calls: one cast per optimizer step for all experts (module doc); call
    `weight_cache.invalidate()` after changing the weight where an optimizer that holds it
    cannot see it (a `p.data` update between its steps). With DelayedScaling each expert's
    amax histories and scales are buffers of `fp8_state` (an ExpertScalingState, in the
    state_dict); eval mode casts with them as trained and records nothing. Under FSDP2 the
    weight is gathered in FP8 (module doc); set `fp8_all_gather = False` before fully_shard to
    gather it in high precision."""

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
        if quantizer_for(self.recipe).delayed:
            self.fp8_state = ExpertScalingState(self.recipe, num_experts, device,
                                                self.weight_cache)
        self.reset_parameters()
        caches.track(self)

    def __setstate__(self, state):  # copy.deepcopy and pickle do not call __init__
        super().__setstate__(state)
        caches.track(self)

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
        if "fp8_state" in self._modules:
            self.fp8_state.reset()
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, offsets, self.bias, recipe=self.recipe,
                              weight_cache=self.__dict__.get("weight_cache"),
                              state=self._delayed_state())

    def _delayed_state(self) -> Optional[ExpertScalingState]:
        """The delayed-scaling state of the layer's recipe (a fresh one after the recipe
        changed), recording in training mode only; None for the other recipes."""
        if not quantizer_for(self.recipe).delayed:
            return None
        state = self._modules.get("fp8_state")
        if state is None or state.recipe != self.recipe:
            state = self.fp8_state = ExpertScalingState(self.recipe, self.num_experts,
                                                        self.weight.device, self.weight_cache)
        state.set_recording(self.training)
        return state

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={type(self.recipe).__name__}")
