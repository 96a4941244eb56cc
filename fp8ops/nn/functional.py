"""fp8ops.linear(): the FP8 linear layer as a function (autograd included)."""
from __future__ import annotations

from typing import Optional

import torch

from .autograd import is_gathered, output_dtype
from .quantizers import quantizer_for
from ..scaling import ScalingState

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_operands(input, weight) -> None:
    """Both operands of an FP8 layer are tensors of a dtype the casts take (grouped.py too)."""
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _check(input, weight, bias):
    check_operands(input, weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape "
                         f"{tuple(weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(f"input's last dimension must be in_features={weight.shape[1]}, got "
                         f"input shape {tuple(input.shape)}")
    if input.device != weight.device:
        raise ValueError(f"input is on {input.device} but weight is on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be a tensor of shape ({weight.shape[0]},), got "
                             f"{getattr(bias, 'shape', type(bias).__name__)}")
        if bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")


def linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           recipe=None, state: Optional[ScalingState] = None) -> torch.Tensor:
    """y = input @ weight.T + bias with FP8 GEMMs in forward and backward.

    input [..., in_features], weight [out_features, in_features]; the output has input's dtype,
    or under torch.autocast the autocast dtype, as nn.Linear's (the input gradient comes back in
    input's dtype).
    recipe=None means current per-tensor scaling (or the state's recipe when a state is given).
    DelayedScaling needs `state` (fp8ops.ScalingState(recipe)), which holds the amax history;
    a state also caches the FP8 weight between optimizer steps and carries the random stream
    of stochastic rounding."""
    _check(input, weight, bias)
    if is_gathered(weight) and torch.compiler.is_compiling():
        # FSDP2's FP8-gathered weight is a tensor subclass the compiler does not trace: this
        # layer runs eagerly inside the compiled model (a graph break)
        return weight.linear_eagerly(input, weight, bias, recipe=recipe, state=state)
    if state is not None:
        if not isinstance(state, ScalingState):
            raise TypeError(f"state must be an fp8ops.ScalingState, got {type(state).__name__}")
        if recipe is not None and recipe != state.recipe:
            raise ValueError(f"recipe {recipe} differs from the state's recipe {state.recipe}")
        recipe = state.recipe
    quantizer = quantizer_for(recipe)
    if quantizer.delayed and state is None:
        raise ValueError("DelayedScaling keeps an amax history: pass state=fp8ops.ScalingState("
                         "recipe) (FP8Linear does this for you)")
    if weight.shape[1] == 0:
        return _no_inputs(input, weight, bias)
    if state is not None:
        state.follow_stream(input.device)
    lead = input.shape[:-1]
    x2 = input.reshape(-1, weight.shape[1])
    out_dtype = output_dtype(input)
    if out_dtype == input.dtype:
        y = quantizer.linear(x2, weight, bias, state, out_dtype)
    else:  # autocast decided the output's dtype; nothing inside is for it to retype
        with torch.autocast(input.device.type, enabled=False):
            y = quantizer.linear(x2, weight, bias, state, out_dtype)
    return _unflatten(y, (*lead, weight.shape[0]))


def _unflatten(y: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The GEMM's [rows, out] result y in the output's shape, as a tensor of its own rather than
    a view (reshape would give a view: FSDP2 warns about a module output that is one, since an
    in-place op on it would skip FSDP2's pre-backward hook), contiguous in every grad mode as
    nn.Linear's. A 2-D input gives y itself, as nn.Linear does, unless y is a view or not
    contiguous (a slice of a padded GEMM result: under inference mode no view is recorded);
    any other case takes aten's _unsafe_view, which torch.matmul and reshape use for a fresh
    result in the same way: no copy (unless y is a non-contiguous slice), and y and its base are
    held by nothing else (autograd saves the FP8 operands, not the result), so an in-place op on
    the returned tensor cannot corrupt anything. Under torch.compile, which cannot ask whether a
    tensor is a view, every shape takes _unsafe_view (metadata only in a graph)."""
    if (tuple(y.shape) == shape and not torch.compiler.is_compiling()
            and not y._is_view() and y.is_contiguous()):
        return y
    return torch.ops.aten._unsafe_view(y.contiguous(), shape)


def _no_inputs(input: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """in_features == 0: an empty sum, so nothing to cast or multiply. The result is the bias
    broadcast over the batch (zeros without one) and the gradients are nn.Linear's: zeros
    [out, 0] for the weight, the sum of the incoming gradient for the bias. Nothing is cast,
    so delayed scaling records nothing."""
    dtype = input.dtype
    return torch.nn.functional.linear(input, weight.to(dtype),
                                      None if bias is None else bias.to(dtype))
