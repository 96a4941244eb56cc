"""The casts of a mixture-of-experts weight [E, out, in]: each expert cast on its own, by the
dense cast ops, so that expert g's bytes are those a dense layer with weight W[g] casts. With the
row-wise copy [E, out, in] (forward) comes the transposed one [E, in, out] (dgrad's operand).
The loop is over the experts (a count fixed by the weight's shape), not over data.

The casts run with torch.autocast off: its type promotion knows no FP8 and refuses to stack the
experts' bytes, and nothing here is autocast's to retype (the ops' arithmetic is their
definition). They run under it when a converted experts module is called, or gathered by FSDP2,
inside the user's autocast region."""
from __future__ import annotations

import functools

import torch

_ops = torch.ops.fp8ops
_AUTOCAST_DEVICES = ("cuda", "cpu")  # torch.is_autocast_enabled raises for other device types


def _outside_autocast(cast):
    @functools.wraps(cast)
    def run(w: torch.Tensor, *args, **kwargs):
        device = w.device.type
        if device not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(device):
            return cast(w, *args, **kwargs)
        with torch.autocast(device, enabled=False):
            return cast(w, *args, **kwargs)
    return run


@_outside_autocast
def quantize_experts_current(w: torch.Tensor, dtype: torch.dtype, margin: float,
                             power_of_two: bool, transpose: bool = True):
    """Current scaling, one scale per expert: (data [E, N, K], data^T [E, K, N] or an empty
    tensor without `transpose`, scale [E], scale_inv [E])."""
    _need_3d(w)
    casts = [_ops.quantize_current(w[g], dtype, margin, power_of_two, transpose)
             for g in range(w.shape[0])]
    if not casts:
        return _empty_experts(w, dtype, (0,))
    return (torch.stack([c[0] for c in casts]), _stacked_t(casts, 1, transpose),
            torch.stack([c[2] for c in casts]), torch.stack([c[3] for c in casts]))


@_outside_autocast
def quantize_experts_scaled(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                            transpose: bool = True):
    """Each expert cast with its given scale (delayed scaling), as the op quantize casts a dense
    weight: (data [E, N, K], data^T [E, K, N] or an empty tensor without `transpose`, amax [E]
    of each expert's values)."""
    _need_3d(w)
    if tuple(scale.shape) != (w.shape[0],):
        raise ValueError(f"fp8ops: the experts' scales must have shape ({w.shape[0]},) (one per "
                         f"expert), got {tuple(scale.shape)}")
    casts = [_ops.quantize(w[g], scale[g], dtype, transpose) for g in range(w.shape[0])]
    if not casts:
        data, data_t, amax, _ = _empty_experts(w, dtype, (0,))
        return data, data_t, amax
    return (torch.stack([c[0] for c in casts]), _stacked_t(casts, 1, transpose),
            torch.stack([c[2].float() for c in casts]))


@_outside_autocast
def quantize_experts_blockwise(w: torch.Tensor, dtype: torch.dtype, power_of_two: bool,
                               transpose: bool = True):
    """128x128 blocks per expert: (data [E, N, K], scale_inv [E, Nb, Kb], data^T [E, K, N]
    (an empty tensor without `transpose`), scale_inv^T [E, Kb, Nb], the transposed copy's
    blocks being the same blocks)."""
    _need_3d(w)
    casts = [_ops.quantize_blockwise(w[g], dtype, 128, 128, power_of_two)
             for g in range(w.shape[0])]
    if not casts:
        data, data_t, scale_inv, _ = _empty_experts(w, dtype, (0, 0, 0))
        return data, scale_inv, data_t, scale_inv
    data = torch.stack([c[0] for c in casts])
    scale_inv = torch.stack([c[1] for c in casts])
    data_t = transpose_experts(data) if transpose else data.new_empty((0,))
    return data, scale_inv, data_t, scale_inv.transpose(1, 2)


@_outside_autocast
def experts_amax(w: torch.Tensor) -> torch.Tensor:
    """Each expert's amax [E] (float32), the one its cast records (the dense op amax)."""
    _need_3d(w)
    if w.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=w.device)
    return torch.stack([_ops.amax(expert).float() for expert in w])


@_outside_autocast
def transpose_experts(data: torch.Tensor) -> torch.Tensor:
    """FP8 experts [E, N, K] as [E, K, N], contiguous: one byte copy for all experts."""
    return data.view(torch.uint8).transpose(1, 2).contiguous().view(data.dtype)


def _stacked_t(casts, index: int, transpose: bool) -> torch.Tensor:
    """The casts' transposed copies stacked, or an empty tensor when none was made."""
    if not transpose:
        return casts[0][index].new_empty((0,))
    return torch.stack([c[index] for c in casts])


def _need_3d(w: torch.Tensor) -> None:
    if w.dim() != 3:
        raise ValueError(f"fp8ops: an experts' weight must be 3-D [experts, out, in], got shape "
                         f"{tuple(w.shape)}")


def _empty_experts(w: torch.Tensor, dtype: torch.dtype, scale_shape):
    _, n, k = w.shape
    f32 = torch.float32
    return (w.new_empty((0, n, k), dtype=dtype), w.new_empty((0, k, n), dtype=dtype),
            w.new_empty(scale_shape, dtype=f32), w.new_empty(scale_shape, dtype=f32))
