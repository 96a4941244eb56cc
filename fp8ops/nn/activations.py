"""fp8ops.fp8_activations: the inputs that norms and activation functions save for backward,
stored in FP8.

FP8Linear already saves only its FP8 input. Inside `with fp8ops.fp8_activations():` a
TorchFunctionMode also routes F.layer_norm, F.rms_norm (and torch.layer_norm / torch.rms_norm,
which nn.LayerNorm / nn.RMSNorm reach through them), F.gelu and F.silu to one autograd Function:
its forward runs the plain op (the same output bytes) and keeps the input as FP8 data plus
float32 scales; its backward dequantizes it and recomputes the op on it to take the gradient.
Everything else runs unchanged. docs/design.md, "FP8 activations", states the numerics.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from ..formats import FP8Format, get_format

RECIPES = ("1x128", "tensor")
BLOCK = 128  # elements per scale along the last dim with recipe "1x128"
_SAVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the casts take
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # subclasses (DTensor...) run plain


class _Call(NamedTuple):
    """A covered call, split into the input saved in FP8, the parameters saved as they are
    (weight, bias: None when absent) and the plain op of (x, *params)."""
    x: torch.Tensor
    params: Tuple[Optional[torch.Tensor], ...]
    op: Callable


# -- the covered functions: each binds its arguments as its torch signature does --------------
def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    shape = tuple(normalized_shape) if not isinstance(normalized_shape, int) else normalized_shape
    return _Call(input, (weight, bias), lambda x, w, b: F.layer_norm(x, shape, w, b, eps))


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    shape = tuple(normalized_shape) if not isinstance(normalized_shape, int) else normalized_shape
    return _Call(input, (weight,), lambda x, w: F.rms_norm(x, shape, w, eps))


def _gelu(input, approximate="none"):
    return _Call(input, (), lambda x: F.gelu(x, approximate=approximate))


def _silu(input, inplace=False):
    # an in-place silu overwrites its input: nothing to save, it runs plain
    return None if inplace else _Call(input, (), F.silu)


# F.gelu is torch._C._nn.gelu itself; F.layer_norm / F.rms_norm call torch.layer_norm /
# torch.rms_norm, which a mode sees only when the user calls them directly
COVERED = {F.layer_norm: _layer_norm, torch.layer_norm: _layer_norm,
           F.rms_norm: _rms_norm, torch.rms_norm: _rms_norm,
           F.gelu: _gelu, F.silu: _silu}

# set while a covered op runs (forward or the backward's recompute) on this thread: the plain op
# inside must not be intercepted again by an enclosing fp8_activations context
_inside = threading.local()


@contextlib.contextmanager
def _running_covered_op():
    prev = getattr(_inside, "active", False)
    _inside.active = True
    try:
        yield
    finally:
        _inside.active = prev


# -- the FP8 copy of a saved input -------------------------------------------------------------
def _quantize(x: torch.Tensor, recipe: str, fmt: FP8Format):
    """(data, scale_inv) of x: saturating RNE to fmt with power-of-two scales, so that the
    dequantized values are exactly the FP8 values times a power of two."""
    if recipe == "tensor":
        data, _, _, scale_inv, _ = torch.ops.fp8ops.quantize_current(x.contiguous(), fmt.dtype,
                                                                     1.0, True)
        return data, scale_inv
    x2d = x.reshape(1, 1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])
    return torch.ops.fp8ops.quantize_blockwise(x2d.contiguous(), fmt.dtype, 1, BLOCK, True)


def _dequantize(data, scale_inv, recipe: str, shape, dtype) -> torch.Tensor:
    # float16: a value within 1/32 of its max can round up past it in FP8: clamped, not inf
    via = torch.float32 if dtype == torch.float16 else dtype
    if recipe == "tensor":
        x = torch.ops.fp8ops.dequantize(data, scale_inv, via)
    else:
        x = torch.ops.fp8ops.dequantize_blockwise(data, scale_inv, 1, BLOCK, via)
    if via != dtype:
        x = x.clamp_(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return x.reshape(shape)


def _autocast_state(device_type: str):
    """(enabled, dtype) of autocast on device_type now, or None where torch has no autocast."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _SavedInFP8(torch.autograd.Function):
    """out = op(x, *params), with x saved in FP8; backward recomputes op on the dequantized x."""

    @staticmethod
    def forward(ctx, op, recipe, fmt, x, *params):
        out = op(x, *params)
        data, scale_inv = _quantize(x.detach(), recipe, fmt)
        ctx.save_for_backward(data, scale_inv, *params)
        ctx.op, ctx.recipe, ctx.shape, ctx.dtype = op, recipe, x.shape, x.dtype
        # the recompute must run at the forward's precision (autocast runs norms in float32)
        ctx.autocast = _autocast_state(x.device.type)
        return out

    @staticmethod
    @once_differentiable  # the recompute's graph is not kept: no double backward
    def backward(ctx, grad_out):
        data, scale_inv, *params = ctx.saved_tensors
        x = _dequantize(data, scale_inv, ctx.recipe, ctx.shape, ctx.dtype)
        need = ctx.needs_input_grad[3:]
        x = x.requires_grad_(need[0])
        params = [p.detach().requires_grad_(n) if p is not None else None
                  for p, n in zip(params, need[1:])]
        wrt = [t for t, n in zip([x, *params], need) if n]
        autocast = contextlib.nullcontext()
        if ctx.autocast is not None:
            autocast = torch.autocast(data.device.type, dtype=ctx.autocast[1],
                                      enabled=ctx.autocast[0])
        with torch.enable_grad(), autocast, _running_covered_op():
            out = ctx.op(x, *params)
            grads = iter(torch.autograd.grad(out, wrt, grad_out))
        return (None, None, None, *(next(grads) if n else None for n in need))


def _worth_saving(x) -> bool:
    """Whether the op would save x for a gradient worth an FP8 copy: a plain floating tensor
    holding elements that needs grad, with grad enabled (no_grad and inference_mode run plain,
    at no cost)."""
    return (type(x) in _PLAIN_TENSORS and x.dtype in _SAVED_DTYPES and x.requires_grad
            and x.numel() > 0 and torch.is_grad_enabled())


class _FP8ActivationMode(TorchFunctionMode):
    def __init__(self, recipe: str, fmt: FP8Format):
        super().__init__()
        self.recipe, self.fmt = recipe, fmt

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bind = COVERED.get(func)
        # torch.compile traces the plain ops: the FP8 copies are an eager-mode feature
        if bind is None or getattr(_inside, "active", False) or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        try:
            call = bind(*args, **kwargs)
        except TypeError:  # arguments torch would refuse: let it say so
            call = None
        if call is None or not _worth_saving(call.x):
            return func(*args, **kwargs)
        with _running_covered_op():
            return _SavedInFP8.apply(call.op, self.recipe, self.fmt, call.x, *call.params)


class fp8_activations:  # noqa: N801  (used as a function: `with fp8_activations():`)
    """Inside the context, LayerNorm, RMSNorm, GELU and SiLU save their input for backward in
    FP8 (1 byte per element plus float32 scales) instead of in its own dtype; their outputs are
    unchanged. Backward may run outside the context. Contexts nest: the innermost one applies.

    recipe: "1x128" (one scale per 128 consecutive elements along the last dim; the last block of
    a row is shorter when the last dim is not a multiple of 128) or "tensor" (one scale).
    fmt: "e4m3" (default) or "e5m2", or fp8ops.E4M3 / E5M2, or a torch float8 dtype."""

    def __init__(self, *, recipe: str = "1x128", fmt="e4m3"):
        if recipe not in RECIPES:
            raise ValueError(f"fp8_activations: recipe must be one of {RECIPES} (one scale per "
                             f"128 elements along the last dim, or one per tensor), got "
                             f"{recipe!r}")
        self.recipe, self.fmt = recipe, get_format(fmt)
        self._modes = []

    def __enter__(self):
        self._modes.append(_FP8ActivationMode(self.recipe, self.fmt))
        self._modes[-1].__enter__()
        return self

    def __exit__(self, *exc):
        return self._modes.pop().__exit__(*exc)
