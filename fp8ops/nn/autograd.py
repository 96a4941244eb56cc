"""Autograd for the FP8 linear layer: y = x @ W.T + b with FP8 GEMMs in forward and backward.

Hopper FP8 GEMMs take K-major operands only (TN, ops.gemm computes a @ b.T), so:
  forward  y  = gemm(X,    W)      X [M,K],    W [N,K]
  dgrad    dX = gemm(dY,   W^T)    dY [M,N],   W^T [K,N]
  wgrad    dW = gemm(dY^T, X^T)    dY^T [N,M], X^T [K,M]
Each cast produces the copy its backward GEMM needs in the same pass. Only the FP8 input (X^T) is
saved for backward; the weight is cast once per accumulation window (ScalingState.cached_weight).
Every GEMM accumulates in float32. One Function serves every recipe: the recipe's quantizer
(quantizers.py) makes the casts and runs the GEMMs, which call only ops (torch.ops.fp8ops.*).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..scaling import ScalingState
from . import cast_stats

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


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would return for input x: autocast's for x's device while autocast is
    on there, else x's own. (The FP8 casts read x as it comes, so autocast adds no conversion
    pass; the input gradient still comes back in x's dtype, as through autocast's own cast.)"""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


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


class FP8LinearFunction(torch.autograd.Function):
    """y = x2 @ weight.T + bias through `quantizer` (quantizers.py). x2 carries the gradient; its
    cast (x_cast) and the weight's (w_cast) are made before (Quantizer.linear), where a
    delayed-scaling state may change."""

    @staticmethod
    def forward(ctx, x2, weight, bias, quantizer, x_cast, w_cast, state, out_dtype):
        # an undefined dY stays None (backward); ctx.set_materialize_grads(False) without its
        # Python call
        ctx.materialize_grads = False
        ctx.sampled = cast_stats.sampling(state)
        if ctx.sampled:  # (the cast has recorded its amax already)
            cast_stats.observe(state, "input", quantizer.input_stats(x2, x_cast))
        shape = (x2.shape[0], x2.shape[1], weight.shape[0])  # M, K, N
        y = quantizer.forward(x_cast, w_cast, bias, out_dtype, shape)
        # The backward reads the casts. The weight is saved where dgrad reads it (x2 takes a
        # gradient), as nn.Linear saves it: a write to it before the backward (an optimizer
        # step) raises autograd's version error there, as on the C++ step. The bias is not
        # saved (only its dtype is read), as nn.Linear does not save it.
        ctx.save_for_backward(*quantizer.saved(x_cast, w_cast),
                              weight if x2.requires_grad else None)
        ctx.quantizer, ctx.state, ctx.x_dtype, ctx.shape = quantizer, state, x2.dtype, shape
        ctx.weight = weight  # (its main_grad and dtype: what the backward reads of it)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.grad_warm = quantizer.grad_warm(state)
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        if dy is None:  # y took no part in the loss: no gradients and no state change, as
            return (None,) * 8  # nn.Linear and the C++ step
        saved = ctx.saved_tensors[:-1]  # (unpacking checks the saved weight's version)
        weight, quantizer, state, shape = ctx.weight, ctx.quantizer, ctx.state, ctx.shape
        dy2 = dy.contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if state is not None:
            state.follow_stream(dy2.device)
            if not torch.compiler.is_compiling():  # (a compiled layer's weight is never one
                state.weight_cache.release()       # FSDP2 gathered in FP8)
        sum_dtype = ctx.bias_dtype if need_db else None
        g, db = quantizer.cast_grad(dy2, state, ctx.grad_warm, need_dx, need_dw, sum_dtype)
        if ctx.sampled:
            stats = quantizer.grad_stats(dy2, g, need_dx, need_dw)
            if stats is not None:
                cast_stats.observe(state, "grad", stats)
        dx = dw = None
        if need_dx:
            dx = quantizer.dgrad(g, saved, ctx.x_dtype, shape)
        if need_dw:
            dw = weight_grad(weight, lambda dtype: quantizer.wgrad(g, saved, dtype, shape))
            _vouching_grad(state, dw)
        return dx, dw, db, None, None, None, None, None


def _vouching_grad(state: Optional[ScalingState], dw: Optional[torch.Tensor]) -> None:
    """The weight gradient dw this backward returns comes from the state's cached cast: its
    accumulation into .grad may vouch for that cast (weight_cache). Eager only: a compiled
    layer casts every call."""
    if state is not None and dw is not None and not torch.compiler.is_compiling():
        state.weight_cache.expect_grad()


def pad(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return torch.nn.functional.pad(t, pad)


def is_gathered(weight: torch.Tensor) -> bool:
    """A weight FSDP2 gathered in FP8 (distributed/fsdp/weights.py: FP8GatheredWeight)."""
    return hasattr(weight, "fp8_payload")


def cached_weight_cast(weight, state: Optional[ScalingState], cast, live: bool = False):
    """The FP8 weight: cast once per accumulation window when there is a state, else every
    call. cast(w, step, scale) -> (payload, scale used): see weight_cache.Cast. A weight FSDP2
    gathered in FP8 (distributed/fsdp/) carries its payload: nothing to cast. Runs without
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


