"""Autograd for the FP8 linear layer: y = x @ W.T + b with FP8 GEMMs in forward and backward.

Hopper FP8 GEMMs take K-major operands only (TN, ops.gemm computes a @ b.T), so:
  forward  y  = gemm(X,    W)      X [M,K],    W [N,K]
  dgrad    dX = gemm(dY,   W^T)    dY [M,N],   W^T [K,N]
  wgrad    dW = gemm(dY^T, X^T)    dY^T [N,M], X^T [K,M]
Each cast produces the transposed copy it needs in the same pass. Only the FP8 input (X^T) is saved
for backward; the weight is cast once per accumulation window (ScalingState.cached_weight). Every GEMM
accumulates in float32. These Functions call only ops (torch.ops.fp8ops.*).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..distributed import amax_reduction
from ..distributed.amax import shard_amax
from ..ops import fused
from ..scaling import ScalingState, current_scale, grad_margin, recipe_formats
from . import cast_stats

_ops = torch.ops.fp8ops
_F32 = torch.float32


def in_recompute() -> bool:
    """True while activation checkpointing re-runs a forward inside backward: that forward must
    neither record amax nor step the scales a second time."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def steps_state(state: Optional[ScalingState]) -> bool:
    """Whether this forward steps and records the delayed-scaling state."""
    return state is not None and state.delayed and state.recording and not in_recompute()


def takes_warm_scale(state: ScalingState, role: str, live: bool) -> bool:
    """Whether this cast of a delayed-scaling role takes a warm scale (nothing recorded yet).
    A live forward decides and keeps the choice: its activation-checkpointing recompute (after
    the role has recorded) must cast exactly as it did."""
    if live:
        state.warm[role] = not getattr(state, role).started
    elif not in_recompute():
        return not getattr(state, role).started
    return state.warm[role]


def _shards(state: Optional[ScalingState], role: str):
    """The mesh the tensor of `role` is sharded over (tensor parallelism), or None."""
    return None if state is None else state.shard_meshes.get(role)


def _scale_before_cast(role, x, fmt, recipe, step: bool, margin: float, warm: bool,
                       shards) -> torch.Tensor:
    """The scale for casting x: from the delayed-scaling role (stepped first when `step`), or,
    with no role (current scaling), from x's own amax. warm: use x's own amax, not the role's
    scale (the role has recorded nothing yet). shards: x is one shard of a tensor sharded over
    this mesh, whose amax is the MAX over the shards (a role all-reduces over its own
    shard_mesh)."""
    if role is not None:
        if step:
            role.update(recipe, fmt, margin)
        if warm:
            return role.warm_scale(x, fmt, margin, recipe)
        return role.scale.clone()  # a copy: the buffer changes before backward uses it
    pct = getattr(recipe, "amax_percentile", None)
    amax = _ops.amax(x) if pct is None else _ops.amax_percentile(x, pct)
    if shards is not None:
        amax = shard_amax(amax, shards, recipe)
    return current_scale(amax, fmt, margin, recipe.power_of_two)


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would return for input x: autocast's for x's device while autocast is
    on there, else x's own. (The FP8 casts read x as it comes, so autocast adds no conversion
    pass; the input gradient still comes back in x's dtype, as through autocast's own cast.)"""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _fusable(role, recipe, shards, warm: bool) -> bool:
    """Whether a cast's scale math and amax bookkeeping can run inside its op: not when an amax
    must cross processes before the cast (current scaling of a tensor sharded by tensor
    parallelism, a delayed-scaling warm start under torch.distributed) or is a percentile.
    (Under torch.distributed a delayed-scaling role records on its rank, sharded or not, and
    one all-reduce at the end of the backward pass folds every layer's records:
    amax_reduction.)"""
    if role is None:
        return shards is None and getattr(recipe, "amax_percentile", None) is None
    return not (warm and _distributed())


def cast_per_tensor(x, role, fmt, recipe, margin: float, *, update: bool = False,
                    warm: bool = False, record: bool = False, sum_dtype=None, rng=None,
                    shards=None, state: Optional[ScalingState] = None, name: str = ""):
    """One per-tensor cast with its transposed copy: (data, data_t, scale, scale_inv, column
    sums of x or None). role: the delayed-scaling RoleState (None: current scaling), stepped
    first when `update`, cast with x's own amax when `warm`, x's amax recorded when `record`.
    sum_dtype: also the sums over x's rows in that dtype (a bias gradient). rng: round
    stochastically with this random stream (ScalingState.rng), advanced on the device. One op
    call when nothing crosses processes (ops.quantize_current / quantize_delayed), else the
    unfused ops. state, name: the ScalingState and the role's name in it (delayed scaling).
    (No autograd here: the ops' outputs carry none, and the column sums are taken in backward.)"""
    stochastic = rng is not None
    if _fusable(role, recipe, shards, warm):
        if role is not None and _distributed():
            if update and state.needs_reduce(name):  # its scale must see every rank's records
                state.reduce_records()
            if record:
                state.record_locally(name)
        if role is None:
            outs = _ops.quantize_current(x, fmt.dtype, margin, recipe.power_of_two, True,
                                         sum_dtype, stochastic, 0, 0, rng)
        else:
            b = role._buffers  # (seven module attribute lookups each cost a Python call)
            outs = _ops.quantize_delayed(
                x, b["amax_history"], b["scale"], b["scale_inv"], b["amax_rep"],
                b["pending_amax"], b["step"], b["nonfinite_count"], fmt.dtype, margin,
                recipe.interval, recipe.amax_compute_algo, recipe.ema_alpha, recipe.percentile,
                recipe.power_of_two, update, warm, record, True, sum_dtype, stochastic, 0, 0,
                rng)
        data, data_t, scale, scale_inv, sums = outs
        return data, data_t, scale, scale_inv, None if sum_dtype is None else sums
    scale = _scale_before_cast(role, x, fmt, recipe, update, margin, warm, shards)
    data, data_t, amax = fused.cast(x, scale, fmt.dtype, True, stochastic, 0, 0, rng)
    if record:
        role.record(amax, recipe.process_group, recipe)
    sums = None if sum_dtype is None else fused.column_sums(x, sum_dtype)
    return data, data_t, scale, torch.reciprocal(scale), sums


_NO_DOUBLE_BACKWARD = (
    "fp8ops.linear / FP8Linear does not support double backward (create_graph=True through an "
    "FP8 layer, e.g. a gradient penalty): its FP8 backward has no second-order term. Keep that "
    "layer in high precision (convert_to_fp8's filter_fn) or use torch.nn.functional.linear there")


def first_order_only(backward):
    """Like torch.autograd.function.once_differentiable, with an error that names fp8ops, and
    for every result: differentiating one raises instead of silently dropping the second-order
    term, even when the incoming gradient is a constant (once_differentiable lets that through)."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():  # no create_graph (autograd's backward runs so)
            return backward(ctx, *grads)
        with torch.no_grad():
            outs = backward(ctx, *grads)
        err = torch._C._functions.DelayedError(_NO_DOUBLE_BACKWARD, len(outs))
        return err(*[o.detach().requires_grad_() if isinstance(o, torch.Tensor) else o
                     for o in outs])
    return wrapper


def weight_grad(weight: torch.Tensor, gemm) -> Optional[torch.Tensor]:
    """dW from gemm(out_dtype): written in the parameter's dtype by the GEMM itself (no float32
    temporary, no conversion pass), or in float32 and added to weight.main_grad when the weight
    has one (returning no .grad)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return gemm(weight.dtype)
    main_grad.add_(gemm(_F32))
    return None


def _vouching_grad(state: Optional[ScalingState], dw: Optional[torch.Tensor]) -> None:
    """The weight gradient dw this backward returns comes from the state's cached cast: its
    accumulation into .grad may vouch for that cast (weight_cache). Eager only: a compiled
    layer casts every call."""
    if state is not None and dw is not None and not torch.compiler.is_compiling():
        state.weight_cache.expect_grad()


def _bias_grad(dy2: torch.Tensor, bias: Optional[torch.Tensor], needed: bool):
    if bias is None or not needed:
        return None
    return fused.column_sums(dy2, bias.dtype)


def _pad(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return torch.nn.functional.pad(t, pad)


# ----------------------------------------------------------------------------------------------
# per-tensor scaling (delayed or current)
# ----------------------------------------------------------------------------------------------
class PerTensorLinear(torch.autograd.Function):
    """x2 carries the gradient; its FP8 cast (x_cast: data, transposed data, scale, scale_inv)
    is made before (linear_per_tensor), where the delayed-scaling state may change."""

    @staticmethod
    def forward(ctx, x2, weight, bias, x_cast, w_data, w_data_t, w_scale_inv, recipe, state,
                out_dtype):
        _, bwd = recipe_formats(recipe)
        xq, xq_t, x_scale, x_scale_inv = x_cast
        ctx.sampled = cast_stats.sampling(state)
        if ctx.sampled:
            # (the cast has recorded its amax already: linear_per_tensor)
            cast_stats.observe(state, "input", cast_stats.per_tensor_stats(x2, xq, x_scale))
        y = _ops.gemm(xq, w_data, x_scale_inv, w_scale_inv, bias, out_dtype, True)
        ctx.save_for_backward(xq_t, w_data_t, x_scale_inv, w_scale_inv, weight, bias)
        ctx.recipe, ctx.bwd, ctx.state, ctx.x_dtype = recipe, bwd, state, x2.dtype
        ctx.grad_warm = state is not None and state.delayed and state.warm["grad"]
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        xq_t, w_data_t, x_scale_inv, w_scale_inv, weight, bias = ctx.saved_tensors
        state: Optional[ScalingState] = ctx.state
        recipe = ctx.recipe
        dy2 = dy.contiguous()
        delayed = state is not None and state.delayed
        eager = not torch.compiler.is_compiling()  # (no state writes in a traced backward)
        if state is not None:
            state.follow_stream(dy2.device)
            if eager:  # (a compiled layer's weight is never one FSDP2 gathered in FP8)
                state.weight_cache.release()
        # stochastic rounding reads its random stream from the state's device buffer
        rng = state.rng if recipe.grad_rounding == "stochastic" else None
        stepping = delayed and state.recording
        sum_dtype = bias.dtype if bias is not None and ctx.needs_input_grad[2] else None
        role = state.grad if delayed else None
        gq, gq_t, g_scale, g_scale_inv, db = cast_per_tensor(
            dy2, role, ctx.bwd, recipe, grad_margin(recipe), update=stepping,
            warm=ctx.grad_warm, record=stepping, sum_dtype=sum_dtype, rng=rng,
            shards=_shards(state, "grad"), state=state, name="grad")
        if stepping and eager:
            # the role has recorded: later forwards take its scale (set here too for a forward
            # that ran under no_grad, as reentrant activation checkpointing runs it)
            role.started = True
        # the step's all-reduce: one for every layer at the end of the backward pass
        if stepping and state.needs_reduce() and not amax_reduction.defer(state):
            state.reduce_records()
        if ctx.sampled:
            cast_stats.observe(state, "grad", cast_stats.per_tensor_stats(dy2, gq, g_scale))
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _ops.gemm(gq, w_data_t, g_scale_inv, w_scale_inv, None, ctx.x_dtype, False)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(weight, lambda dtype: _ops.gemm(gq_t, xq_t, g_scale_inv, x_scale_inv,
                                                        None, dtype, False))
            if eager and dw is not None and state is not None:
                state.weight_cache.expect_grad()  # (as _vouching_grad)
        return dx, dw, db, None, None, None, None, None, None, None


def is_gathered(weight: torch.Tensor) -> bool:
    """A weight FSDP2 gathered in FP8 (distributed/fsdp.py: FP8GatheredWeight)."""
    return hasattr(weight, "fp8_payload")


def _cast_weight(weight, state: Optional[ScalingState], cast, live: bool = False):
    """The FP8 weight: cast once per accumulation window when there is a state, else every
    call. cast(w, step, scale) -> (payload, scale used): see weight_cache.Cast. A weight FSDP2
    gathered in FP8 (distributed/fsdp.py) carries its payload: nothing to cast. Runs without
    grad (set directly in eager mode: torch.no_grad() costs a context object per call)."""
    if torch.compiler.is_compiling():
        with torch.no_grad():
            return _cast_weight_no_grad(weight, state, cast, live)
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return _cast_weight_no_grad(weight, state, cast, live)
    finally:
        torch._C._set_grad_enabled(enabled)


def _cast_weight_no_grad(weight, state: Optional[ScalingState], cast, live: bool):
    if is_gathered(weight):
        payload = weight.fp8_payload(state, live)
        if payload is None:  # cast for another kind of forward
            payload = weight.recast(state, cast, live, in_recompute())
        return payload
    if state is None:
        return cast(weight, False, None)[0]
    return state.cached_weight(weight, cast, live, in_recompute())


def linear_per_tensor(x2, weight, bias, recipe, state: Optional[ScalingState], x_cast=None,
                      out_dtype=None):
    """x_cast: (data, transposed data, amax, scale), x2 already cast (current scaling only; x2
    then only carries the gradient). out_dtype: the output's (default x2's; output_dtype)."""
    fwd, _ = recipe_formats(recipe)
    delayed = state is not None and state.delayed
    live = steps_state(state)
    if x_cast is not None and delayed:
        raise ValueError("a pre-cast input takes current scaling, not DelayedScaling")

    def cast_weight(w, step, scale):
        if scale is not None:  # a decided scale (a restored cast): never steps the role
            data, data_t, _ = _ops.quantize(w, scale, fwd.dtype, True)
            return (data, data_t, torch.reciprocal(scale), scale), scale
        role = state.weight if delayed else None
        data, data_t, scale, scale_inv, _ = cast_per_tensor(
            w, role, fwd, recipe, recipe.margin, update=step, warm=delayed and not role.started,
            record=step, shards=_shards(state, "weight"), state=state, name="weight")
        if step:
            role.started = True
        return (data, data_t, scale_inv, scale), scale

    w_data, w_data_t, w_scale_inv, w_scale = _cast_weight(weight, state, cast_weight, live)
    # a weight gathered in FP8 has no high-precision values here: no cast error to measure
    if cast_stats.sampling(state) and not is_gathered(weight):
        cast_stats.observe(state, "weight", cast_stats.per_tensor_stats(
            cast_stats.weight_values(state, weight), w_data, w_scale))
    if x_cast is None:
        warm = delayed and takes_warm_scale(state, "input", live)
        xq, xq_t, x_scale, x_scale_inv, _ = cast_per_tensor(
            x2, state.input if delayed else None, fwd, recipe, recipe.margin, update=live,
            warm=warm, record=live, shards=_shards(state, "input"), state=state, name="input")
    else:
        xq, xq_t, _, x_scale = x_cast
        x_scale_inv = torch.reciprocal(x_scale)
    if recipe.grad_rounding == "stochastic" and state is None:
        raise ValueError("grad_rounding='stochastic' needs a state (fp8ops.ScalingState) to "
                         "carry the random seed and offset")
    if live:  # decided here, outside the Function, so that a recompute sees the same choice
        state.warm["grad"] = not state.grad.started
    y = PerTensorLinear.apply(x2, weight, bias, (xq, xq_t, x_scale, x_scale_inv), w_data,
                              w_data_t, w_scale_inv, recipe, state, out_dtype or x2.dtype)
    if live:
        state.input.started = True
        # the grad role records in backward; its first backward took a warm scale (ctx)
        state.grad.started = state.grad.started or torch.is_grad_enabled()
    return y


# ----------------------------------------------------------------------------------------------
# MXFP8: 32-element E8M0 blocks along K; the backward GEMMs need copies blocked along the other
# axis. Dimensions are zero-padded to the block (zeros change neither amax nor the products).
# ----------------------------------------------------------------------------------------------
class MXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, w_row, w_col_t, recipe, state, out_dtype):
        fwd, bwd = recipe_formats(recipe)
        bs, rceil = recipe.block_size, recipe.scale_mode == "rceil"
        M, K = x2.shape
        N = weight.shape[0]
        # blocked along K for this GEMM, along M for wgrad: [M, Kp] and [Mp, Kp], zero-padded
        x_data, x_scales, xc_data, xc_scales, _ = _ops.quantize_mx_pair(x2, fwd.dtype, bs, rceil)
        ctx.sampled, ctx.state = cast_stats.sampling(state), state
        if ctx.sampled:
            cast_stats.observe(state, "input", cast_stats.mx_stats(x2, x_data, x_scales, bs, 1))
            cast_stats.observe(state, "weight", cast_stats.mx_stats(
                cast_stats.weight_values(state, weight), *w_row, bs, 1))
        bias_p = None if bias is None else _pad(bias, 0, bs)
        y = _ops.gemm_mx(x_data, x_scales, w_row[0], w_row[1], bias_p, out_dtype, bs)[:, :N]
        ctx.save_for_backward(xc_data.t(), xc_scales.t(), w_col_t[0], w_col_t[1], weight, bias)
        ctx.meta = (bwd, bs, rceil, M, K, N, x2.dtype)
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        xc_t, xc_t_scales, w_col_t, w_col_t_scales, weight, bias = ctx.saved_tensors
        bwd, bs, rceil, M, K, N, x_dtype = ctx.meta
        dy2 = dy.contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        sum_dtype = bias.dtype if bias is not None and need_db else None
        if need_dx and need_dw:  # both copies and the bias gradient in one call
            g_data, g_scales, gc_data, gc_scales, db = _ops.quantize_mx_pair(
                dy2, bwd.dtype, bs, rceil, sum_dtype)
            db = None if sum_dtype is None else db
        else:
            dyp = _pad(_pad(dy2, 1, bs), 0, bs)  # [Mp, Np]
            if need_dx:
                g_data, g_scales = _ops.quantize_mx(dyp[:M], bwd.dtype, bs, 1, rceil)
            if need_dw:
                gc_data, gc_scales = _ops.quantize_mx(dyp, bwd.dtype, bs, 0, rceil)
            db = _bias_grad(dy2, bias, need_db)
        if ctx.sampled and (need_dx or need_dw):
            cast_stats.observe(ctx.state, "grad", cast_stats.mx_stats(
                dy2, g_data, g_scales, bs, 1) if need_dx else cast_stats.mx_stats(
                dy2, gc_data, gc_scales, bs, 0))
        dx = dw = None
        if need_dx:
            dx = _ops.gemm_mx(g_data, g_scales, w_col_t, w_col_t_scales, None, x_dtype,
                              bs)[:, :K]
        if need_dw:
            dw = weight_grad(weight, lambda dtype: _ops.gemm_mx(
                gc_data.t(), gc_scales.t(), xc_t, xc_t_scales, None, dtype, bs)[:N, :K])
            _vouching_grad(ctx.state, dw)
        return dx, dw, db, None, None, None, None, None


def linear_mx(x2, weight, bias, recipe, state: Optional[ScalingState], out_dtype=None):
    fwd, _ = recipe_formats(recipe)
    bs, rceil = recipe.block_size, recipe.scale_mode == "rceil"

    def cast_weight(w, step, scale):
        wp = _pad(_pad(w, 1, bs), 0, bs)  # [Np, Kp]
        row = _ops.quantize_mx(wp, fwd.dtype, bs, 1, rceil)
        col = _ops.quantize_mx(wp, fwd.dtype, bs, 0, rceil)  # blocked along N, for dgrad
        return (row, (col[0].t(), col[1].t())), None

    w_row, w_col_t = _cast_weight(weight, state, cast_weight)
    return MXLinear.apply(x2, weight, bias, w_row, w_col_t, recipe, state, out_dtype or x2.dtype)


# ----------------------------------------------------------------------------------------------
# Blockwise (DeepSeek-V3): activations and gradients 1x128, weights 128x128.
# ----------------------------------------------------------------------------------------------
class BlockwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, w_data, w_scale_inv, w_data_t, recipe, state, out_dtype):
        fwd, bwd = recipe_formats(recipe)
        p2 = recipe.power_of_two
        # X 1x128 for this GEMM and X^T 1x128 (128 along M) for wgrad, in one call
        x_data, x_scale_inv, xt_data, xt_scale_inv, _ = _ops.quantize_blockwise_pair(
            x2, fwd.dtype, p2)
        ctx.sampled, ctx.state = cast_stats.sampling(state), state
        if ctx.sampled:
            cast_stats.observe(state, "input",
                               cast_stats.blockwise_stats(x2, x_data, x_scale_inv, 1, 128))
            if not is_gathered(weight):  # (as in linear_per_tensor)
                w_values = cast_stats.weight_values(state, weight)
                cast_stats.observe(state, "weight", cast_stats.blockwise_stats(
                    w_values, w_data, w_scale_inv, 128, 128))
        y = _ops.gemm_blockwise(x_data, w_data, x_scale_inv, w_scale_inv, bias, out_dtype)
        ctx.save_for_backward(xt_data, xt_scale_inv, w_data_t, w_scale_inv.t(), weight, bias)
        ctx.meta = (bwd, p2, x2.dtype)
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        xt_data, xt_scale_inv, w_data_t, w_t_scale_inv, weight, bias = ctx.saved_tensors
        bwd, p2, x_dtype = ctx.meta
        dy2 = dy.contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        sum_dtype = bias.dtype if bias is not None and need_db else None
        if need_dx and need_dw:  # both copies and the bias gradient in one call
            g_data, g_scale_inv, gt_data, gt_scale_inv, db = _ops.quantize_blockwise_pair(
                dy2, bwd.dtype, p2, sum_dtype)
            db = None if sum_dtype is None else db
        else:
            if need_dx:
                g_data, g_scale_inv = _ops.quantize_blockwise(dy2, bwd.dtype, 1, 128, p2)
            if need_dw:
                gt_data, gt_scale_inv = _ops.quantize_blockwise(dy2.t(), bwd.dtype, 1, 128, p2)
            db = _bias_grad(dy2, bias, need_db)
        if ctx.sampled and (need_dx or need_dw):
            cast_stats.observe(ctx.state, "grad", cast_stats.blockwise_stats(
                dy2, g_data, g_scale_inv, 1, 128) if need_dx else cast_stats.blockwise_stats(
                dy2.t(), gt_data, gt_scale_inv, 1, 128))
        dx = dw = None
        if need_dx:
            dx = _ops.gemm_blockwise(g_data, w_data_t, g_scale_inv, w_t_scale_inv, None,
                                     x_dtype)
        if need_dw:
            dw = weight_grad(weight, lambda dtype: _ops.gemm_blockwise(
                gt_data, xt_data, gt_scale_inv, xt_scale_inv, None, dtype))
            _vouching_grad(ctx.state, dw)
        return dx, dw, db, None, None, None, None, None, None


def linear_blockwise(x2, weight, bias, recipe, state: Optional[ScalingState], out_dtype=None):
    fwd, _ = recipe_formats(recipe)

    def cast_weight(w, step, scale):
        data, scale_inv = _ops.quantize_blockwise(w, fwd.dtype, 128, 128, recipe.power_of_two)
        return (data, scale_inv, _ops.transpose_fp8(data)), None

    w_data, w_scale_inv, w_data_t = _cast_weight(weight, state, cast_weight)
    return BlockwiseLinear.apply(x2, weight, bias, w_data, w_scale_inv, w_data_t, recipe, state,
                                 out_dtype or x2.dtype)
