"""fp8ops.fp8_activations: the inputs that norms and activation functions save for backward,
stored in FP8.

FP8Linear already saves only its FP8 input. Inside `with fp8ops.fp8_activations():` a
TorchFunctionMode also routes F.layer_norm, F.rms_norm (and torch.layer_norm / torch.rms_norm,
which nn.LayerNorm / nn.RMSNorm reach through them), F.gelu and F.silu to one autograd Function:
its forward runs the plain op (the same output bytes) and keeps the input as FP8 data plus
float32 scales; its backward dequantizes it and recomputes the op on it to take the gradient.
A multiply of a covered silu's output by a tensor (the SwiGLU product) saves that tensor in FP8
and reuses the silu's FP8 input instead of saving the silu output; with attention=True,
F.scaled_dot_product_attention saves q, k and v in FP8 and recomputes attention in backward.
Everything else runs unchanged. docs/design.md, "FP8 activations", states the numerics.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
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
    """A covered call, split into the inputs saved in FP8, the parameters saved as they are
    (weight, bias, an attention mask: None when absent) and the plain op of (*xs, *params).
    grad_forward: run the forward with grad enabled on leaves that require grad as the inputs
    do (attention: which kernel runs may depend on it, and the recompute in backward runs so)."""
    xs: Tuple[torch.Tensor, ...]
    params: Tuple[Optional[torch.Tensor], ...]
    op: Callable
    grad_forward: bool = False


# -- the covered functions: each binds its arguments as its torch signature does --------------
def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    shape = tuple(normalized_shape) if not isinstance(normalized_shape, int) else normalized_shape
    return _Call((input,), (weight, bias), lambda x, w, b: F.layer_norm(x, shape, w, b, eps))


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    shape = tuple(normalized_shape) if not isinstance(normalized_shape, int) else normalized_shape
    return _Call((input,), (weight,), lambda x, w: F.rms_norm(x, shape, w, eps))


def _gelu(input, approximate="none"):
    return _Call((input,), (), lambda x: F.gelu(x, approximate=approximate))


def _silu(input, inplace=False):
    # an in-place silu overwrites its input: nothing to save, it runs plain
    return None if inplace else _Call((input,), (), F.silu)


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               **kwargs):
    # dropout: a recompute would draw another mask, so it runs plain. kwargs: enable_gqa, where
    # the installed torch has it (torch refuses what it does not know, in the plain call)
    if dropout_p != 0:
        return None

    def op(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                              is_causal=is_causal, scale=scale, **kwargs)

    return _Call((query, key, value), (attn_mask,), op, grad_forward=True)


# F.gelu is torch._C._nn.gelu itself; F.layer_norm / F.rms_norm call torch.layer_norm /
# torch.rms_norm, which a mode sees only when the user calls them directly
COVERED = {F.layer_norm: _layer_norm, torch.layer_norm: _layer_norm,
           F.rms_norm: _rms_norm, torch.rms_norm: _rms_norm,
           F.gelu: _gelu, F.silu: _silu}
ATTENTION = {F.scaled_dot_product_attention: _attention}  # with fp8_activations(attention=True)
# the multiplies a SwiGLU product may be written with: `a * b`, `2 * a` and operator.mul reach
# the mode as Tensor.mul
MULTIPLIES = frozenset({torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__,
                        torch.Tensor.multiply, torch.mul, torch.multiply})

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


class _SiluInput(NamedTuple):
    """What a covered silu keeps of its input (data, scale_inv, recipe, shape, dtype), and its
    output's version then (an in-place change to the output makes it no silu output)."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    recipe: str
    shape: torch.Size
    dtype: torch.dtype
    version: int


def _autocast_context(state, device_type: str):
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=state[1], enabled=state[0])


def _detached(t):
    # detached: a saved output kept with its grad_fn would hold its own graph in a cycle
    return t.detach()


def _same(t):
    return t


@contextlib.contextmanager
def _plain_saves():
    """Tensors saved for backward inside are kept as they are, whatever saved_tensors_hooks the
    caller has set (where hooks are disabled, saving is plain already)."""
    hooks = torch.autograd.graph.saved_tensors_hooks(_detached, _same)
    try:
        hooks.__enter__()
    except RuntimeError:
        hooks = None
    try:
        yield
    finally:
        if hooks is not None:
            hooks.__exit__(None, None, None)


class _SavedInFP8(torch.autograd.Function):
    """out = op(*xs, *params), with the n inputs xs saved in FP8; backward recomputes op on the
    dequantized inputs. sink, when a list, receives (data, scale_inv) of the first input."""

    @staticmethod
    def forward(ctx, call, recipe, fmt, sink, *tensors):
        n = len(call.xs)
        xs, params = tensors[:n], tensors[n:]
        if call.grad_forward:
            # the throwaway graph's saved tensors skip the user's saved_tensors_hooks
            with torch.enable_grad(), _plain_saves():
                leaves = [t.detach().requires_grad_(t.requires_grad)
                          if t is not None and t.is_floating_point() else t for t in tensors]
                out = call.op(*leaves).detach()
            del leaves
        else:
            out = call.op(*tensors)
        fp8 = []
        for x in xs:
            fp8 += _quantize(x.detach(), recipe, fmt)
        if sink is not None:
            sink += fp8[:2]
        ctx.save_for_backward(*fp8, *params)
        ctx.op, ctx.recipe, ctx.n = call.op, recipe, n
        ctx.shapes, ctx.dtypes = [x.shape for x in xs], [x.dtype for x in xs]
        # the recompute must run at the forward's precision (autocast runs norms in float32)
        ctx.autocast = _autocast_state(xs[0].device.type)
        return out

    @staticmethod
    @once_differentiable  # the recompute's graph is not kept: no double backward
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        n = ctx.n
        fp8, params = saved[:2 * n], saved[2 * n:]
        need = ctx.needs_input_grad[4:]
        xs = [_dequantize(fp8[2 * i], fp8[2 * i + 1], ctx.recipe, ctx.shapes[i],
                          ctx.dtypes[i]).requires_grad_(need[i]) for i in range(n)]
        params = [p.detach().requires_grad_(g) if p is not None else None
                  for p, g in zip(params, need[n:])]
        wrt = [t for t, g in zip([*xs, *params], need) if g]
        with torch.enable_grad(), _autocast_context(ctx.autocast, fp8[0].device.type), \
                _running_covered_op():
            out = ctx.op(*xs, *params)
            grads = iter(torch.autograd.grad(out, wrt, grad_out))
        return (None, None, None, None, *(next(grads) if g else None for g in need))


class _SiluProduct(torch.autograd.Function):
    """out = s * b (or b * s), s the output of a covered silu of a: saves b in FP8 and the silu's
    FP8 copy of a (the same tensors, no second cast), not s. Backward recomputes s = silu(a')
    and takes torch's multiply gradient at (s, b'); the gradient for s goes on to the silu's
    own backward, which recomputes silu at the same a'."""

    @staticmethod
    def forward(ctx, silu_in, recipe, fmt, s_first, s, b):
        out = s * b if s_first else b * s
        b_data, b_scale_inv = _quantize(b.detach(), recipe, fmt)
        ctx.save_for_backward(silu_in.data, silu_in.scale_inv, b_data, b_scale_inv)
        ctx.a = (silu_in.recipe, silu_in.shape, silu_in.dtype)
        ctx.b = (recipe, b.shape, b.dtype)
        ctx.s_first = s_first
        ctx.autocast = _autocast_state(b.device.type)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        a_data, a_scale_inv, b_data, b_scale_inv = ctx.saved_tensors
        need_s, need_b = ctx.needs_input_grad[4:]
        a = _dequantize(a_data, a_scale_inv, *ctx.a)
        b = _dequantize(b_data, b_scale_inv, *ctx.b).requires_grad_(need_b)
        with torch.enable_grad(), _autocast_context(ctx.autocast, a.device.type), \
                _running_covered_op():
            s = F.silu(a).requires_grad_(need_s)
            out = s * b if ctx.s_first else b * s
            wrt = [t for t, g in ((s, need_s), (b, need_b)) if g]
            grads = iter(torch.autograd.grad(out, wrt, grad_out))
        return (None, None, None, None, next(grads) if need_s else None,
                next(grads) if need_b else None)


def _in_checkpoint() -> bool:
    """Inside a non-reentrant activation checkpoint's forward or its recompute: torch's own
    saved-tensors hooks are on top (it marks them). The checkpoint keeps none of the region's
    saved tensors, so FP8 copies would save nothing, and its recompute (in backward, where this
    context may be gone) must save what the forward saved: the covered ops run plain there."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "_checkpoint_internal", False)


def _worth_saving(x) -> bool:
    """Whether an op's input x can be saved in FP8: a plain floating tensor holding elements,
    with grad enabled (no_grad and inference_mode run plain, at no cost)."""
    return (type(x) in _PLAIN_TENSORS and x.dtype in _SAVED_DTYPES and x.numel() > 0
            and not x.is_nested and torch.is_grad_enabled())


class _FP8ActivationMode(TorchFunctionMode):
    def __init__(self, recipe: str, fmt: FP8Format, attention: bool):
        super().__init__()
        self.recipe, self.fmt = recipe, fmt
        self.covered = {**COVERED, **ATTENTION} if attention else COVERED
        # the live outputs of this context's covered silu calls: id -> (weakref, _SiluInput);
        # a multiply looks its operands up here (two dict lookups; none while it is empty)
        self.silu_outputs = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MULTIPLIES:
            if self.silu_outputs and len(args) == 2 and not kwargs:
                return self._multiply(func, *args)
            return func(*args, **kwargs)
        bind = self.covered.get(func)
        # torch.compile traces the plain ops: the FP8 copies are an eager-mode feature
        if bind is None or getattr(_inside, "active", False) or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        try:
            call = bind(*args, **kwargs)
        except TypeError:  # arguments torch would refuse: let it say so
            call = None
        if (call is None or not all(_worth_saving(x) for x in call.xs)
                or not any(x.requires_grad for x in call.xs) or _in_checkpoint()):
            return func(*args, **kwargs)
        sink = [] if func is F.silu else None
        with _running_covered_op():
            out = _SavedInFP8.apply(call, self.recipe, self.fmt, sink, *call.xs, *call.params)
        if sink:  # a later multiply by this output saves its operands in FP8 (_SiluProduct)
            x = call.xs[0]
            self._track(out, _SiluInput(sink[0], sink[1], self.recipe, x.shape, x.dtype,
                                        out._version))
        return out

    def _track(self, out, silu_input):
        outputs, key = self.silu_outputs, id(out)

        def forget(ref):  # out is gone (its id may since be another silu output's)
            if outputs.get(key, (None,))[0] is ref:
                del outputs[key]

        outputs[key] = (weakref.ref(out, forget), silu_input)

    def _silu_input(self, t) -> Optional[_SiluInput]:
        """t's _SiluInput if t is the unmodified output of a covered silu of this context."""
        entry = self.silu_outputs.get(id(t))
        if entry is None or entry[0]() is not t or entry[1].version != t._version:
            return None
        return entry[1]

    def _multiply(self, func, x, y):
        """silu(a) * b in either order: _SiluProduct; any other multiply runs plain."""
        tag = self._silu_input(x)
        s_first = tag is not None
        if tag is None:
            tag = self._silu_input(y)
        s, b = (x, y) if s_first else (y, x)
        # b a number, float64, an empty tensor...; grad disabled; torch.compile: plain
        if (tag is None or not _worth_saving(b) or getattr(_inside, "active", False)
                or torch.compiler.is_compiling() or _in_checkpoint()):
            return func(x, y)
        with _running_covered_op():
            return _SiluProduct.apply(tag, self.recipe, self.fmt, s_first, s, b)


class fp8_activations:  # noqa: N801  (used as a function: `with fp8_activations():`)
    """Inside the context, LayerNorm, RMSNorm, GELU and SiLU save their input for backward in
    FP8 (1 byte per element plus float32 scales) instead of in its own dtype, and a multiply of
    a SiLU's output by a tensor (SwiGLU) saves that tensor in FP8 instead of both operands;
    their outputs are unchanged. Backward may run outside the context. Contexts nest: the
    innermost one applies. Inside a torch.utils.checkpoint region they run plain: the
    checkpoint keeps none of the region's saved tensors (it recomputes them in backward), and
    a non-reentrant one checks that its recompute saves what the forward saved (a reentrant one
    runs the region's forward without grad).

    recipe: "1x128" (one scale per 128 consecutive elements along the last dim; the last block of
    a row is shorter when the last dim is not a multiple of 128) or "tensor" (one scale).
    fmt: "e4m3" (default) or "e5m2", or fp8ops.E4M3 / E5M2, or a torch float8 dtype.
    attention: F.scaled_dot_product_attention (dropout_p 0) saves q, k and v in FP8 (1x128 along
    the head dim: one scale per row up to 128) instead of them, its output and its logsumexp,
    and backward runs the attention forward again (one more attention forward per step)."""

    def __init__(self, *, recipe: str = "1x128", fmt="e4m3", attention: bool = False):
        if recipe not in RECIPES:
            raise ValueError(f"fp8_activations: recipe must be one of {RECIPES} (one scale per "
                             f"128 elements along the last dim, or one per tensor), got "
                             f"{recipe!r}")
        self.recipe, self.fmt, self.attention = recipe, get_format(fmt), bool(attention)
        self._modes = []

    def __enter__(self):
        self._modes.append(_FP8ActivationMode(self.recipe, self.fmt, self.attention))
        self._modes[-1].__enter__()
        return self

    def __exit__(self, *exc):
        return self._modes.pop().__exit__(*exc)
