"""The casts of a mixture-of-experts weight [E, out, in]: each expert cast as a dense layer with
weight W[g] is cast, its bytes the same. With the row-wise copy [E, out, in] (forward) comes the
transposed one [E, in, out] (dgrad's operand).

The per-tensor casts are ops of their own (amax_experts, quantize_experts_current,
quantize_experts_scaled): their meaning is a loop of the dense ops over the experts (`_loop_*`,
the kernels on the CPU and wherever no C++ kernel is registered); on CUDA one launch casts every
expert (csrc/cast_experts.h), so a weight of 128 experts costs two launches, not 256. The
blockwise cast is the dense op on the [E * out, in] view where out is a multiple of 128 (no
block then spans two experts), else a loop over the experts.

The casts run with torch.autocast off: its type promotion knows no FP8 and refuses to stack the
experts' bytes, and nothing here is autocast's to retype (the ops' arithmetic is their
definition). They run under it when a converted experts module is called, or gathered by FSDP2,
inside the user's autocast region."""
from __future__ import annotations

import functools

import torch

_ops = torch.ops.fp8ops
_AUTOCAST_DEVICES = ("cuda", "cpu")  # torch.is_autocast_enabled raises for other device types
BLOCK = 128

SCHEMAS = {
    "amax_experts": "(Tensor w) -> Tensor",
    "quantize_experts_current": "(Tensor w, ScalarType dtype, float margin, bool power_of_two, "
                                "bool transpose) -> (Tensor, Tensor, Tensor, Tensor)",
    "quantize_experts_scaled": "(Tensor w, Tensor scale, ScalarType dtype, bool transpose) "
                               "-> (Tensor, Tensor, Tensor)",
}


def _outside_autocast(cast):
    @functools.wraps(cast)
    def run(w: torch.Tensor, *args, **kwargs):
        device = w.device.type
        if device not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(device):
            return cast(w, *args, **kwargs)
        with torch.autocast(device, enabled=False):
            return cast(w, *args, **kwargs)
    return run


# ----------------------------------------------------------------------------------------------
# the casts
# ----------------------------------------------------------------------------------------------
# the CUDA kernels take one expert per blockIdx.y (cast.cu), at most 65535; more take the loop
MAX_EXPERTS_PER_LAUNCH = 65535


def _one_launch(w: torch.Tensor) -> bool:
    """Whether the ops cast these experts in one launch: empty experts (nothing to launch) and
    more than the grid holds take the loop of dense ops, which they equal."""
    return w.numel() > 0 and w.shape[0] <= MAX_EXPERTS_PER_LAUNCH


@_outside_autocast
def quantize_experts_current(w: torch.Tensor, dtype: torch.dtype, margin: float,
                             power_of_two: bool, transpose: bool = True):
    """Current scaling, one scale per expert: (data [E, N, K], data^T [E, K, N] or an empty
    tensor without `transpose`, scale [E], scale_inv [E])."""
    _need_3d(w)
    if not _one_launch(w):
        return _loop_current(w, dtype, margin, power_of_two, transpose)
    return _ops.quantize_experts_current(w, dtype, margin, power_of_two, transpose)


@_outside_autocast
def quantize_experts_scaled(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                            transpose: bool = True):
    """Each expert cast with its given scale (delayed scaling), as the op quantize casts a dense
    weight: (data [E, N, K], data^T [E, K, N] or an empty tensor without `transpose`, amax [E]
    of each expert's values)."""
    _need_3d(w)
    _need_expert_scales(w, scale)
    if not _one_launch(w):
        return _loop_scaled(w, scale, dtype, transpose)
    return _ops.quantize_experts_scaled(w, scale, dtype, transpose)


@_outside_autocast
def experts_amax(w: torch.Tensor) -> torch.Tensor:
    """Each expert's amax [E] (float32), the one its cast records (the dense op amax)."""
    _need_3d(w)
    if w.shape[0] > MAX_EXPERTS_PER_LAUNCH:
        return _loop_amax(w)
    return _ops.amax_experts(w)


@_outside_autocast
def quantize_experts_blockwise(w: torch.Tensor, dtype: torch.dtype, power_of_two: bool,
                               transpose: bool = True):
    """128x128 blocks per expert: (data [E, N, K], scale_inv [E, Nb, Kb], data^T [E, K, N]
    (an empty tensor without `transpose`), scale_inv^T [E, Kb, Nb], the transposed copy's
    blocks being the same blocks)."""
    _need_3d(w)
    E, N, K = w.shape
    if w.numel() == 0:
        data, data_t, scale_inv, _ = _empty_experts(w, dtype, (E, -(-N // BLOCK), -(-K // BLOCK)))
        return data, scale_inv, data_t, scale_inv.transpose(1, 2)
    if N % BLOCK == 0:  # the dense op on all experts at once: its blocks never span two
        data, scale_inv = _ops.quantize_blockwise(w.reshape(E * N, K), dtype, BLOCK, BLOCK,
                                                  power_of_two)
        data, scale_inv = data.view(E, N, K), scale_inv.view(E, N // BLOCK, -1)
    else:
        casts = [_ops.quantize_blockwise(w[g], dtype, BLOCK, BLOCK, power_of_two)
                 for g in range(E)]
        data = torch.stack([c[0] for c in casts])
        scale_inv = torch.stack([c[1] for c in casts])
    data_t = transpose_experts(data) if transpose else data.new_empty((0,))
    return data, scale_inv, data_t, scale_inv.transpose(1, 2)


@_outside_autocast
def transpose_experts(data: torch.Tensor) -> torch.Tensor:
    """FP8 experts [E, N, K] as [E, K, N], contiguous: one byte copy for all experts."""
    return data.view(torch.uint8).transpose(1, 2).contiguous().view(data.dtype)


# ----------------------------------------------------------------------------------------------
# the ops' meaning: the dense ops, expert by expert
# ----------------------------------------------------------------------------------------------
def _loop_amax(w: torch.Tensor) -> torch.Tensor:
    _need_3d(w)
    if w.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=w.device)
    return torch.stack([_ops.amax(expert).float() for expert in w])


def _loop_current(w, dtype, margin, power_of_two, transpose):
    _need_3d(w)
    casts = [_ops.quantize_current(w[g], dtype, margin, power_of_two, transpose)
             for g in range(w.shape[0])]
    if not casts:
        return _empty_experts(w, dtype, (0,), transpose)
    return (torch.stack([c[0] for c in casts]), _stacked_t(casts, 1, transpose),
            torch.stack([c[2] for c in casts]), torch.stack([c[3] for c in casts]))


def _loop_scaled(w, scale, dtype, transpose):
    _need_3d(w)
    _need_expert_scales(w, scale)
    casts = [_ops.quantize(w[g], scale[g], dtype, transpose) for g in range(w.shape[0])]
    if not casts:
        data, data_t, amax, _ = _empty_experts(w, dtype, (0,), transpose)
        return data, data_t, amax
    return (torch.stack([c[0] for c in casts]), _stacked_t(casts, 1, transpose),
            torch.stack([c[2].float() for c in casts]))


_LOOPS = {"amax_experts": _loop_amax, "quantize_experts_current": _loop_current,
          "quantize_experts_scaled": _loop_scaled}


def _stacked_t(casts, index: int, transpose: bool) -> torch.Tensor:
    """The casts' transposed copies stacked, or an empty tensor when none was made."""
    if not transpose:
        return casts[0][index].new_empty((0,))
    return torch.stack([c[index] for c in casts])


def _need_3d(w: torch.Tensor) -> None:
    if w.dim() != 3:
        raise ValueError(f"fp8ops: an experts' weight must be 3-D [experts, out, in], got shape "
                         f"{tuple(w.shape)}")


def _need_expert_scales(w: torch.Tensor, scale: torch.Tensor) -> None:
    if tuple(scale.shape) != (w.shape[0],):
        raise ValueError(f"fp8ops: the experts' scales must have shape ({w.shape[0]},) (one per "
                         f"expert), got {tuple(scale.shape)}")


def _empty_experts(w: torch.Tensor, dtype: torch.dtype, scale_shape, transpose: bool = True):
    e, n, k = w.shape
    f32 = torch.float32
    data_t = w.new_empty((e, k, n) if transpose else (0,), dtype=dtype)
    return (w.new_empty((e, n, k), dtype=dtype), data_t, w.new_empty(scale_shape, dtype=f32),
            w.new_empty(scale_shape, dtype=f32))


# ----------------------------------------------------------------------------------------------
# registration and fakes
# ----------------------------------------------------------------------------------------------
def register(lib: torch.library.Library, kernel) -> None:
    """Define the experts' cast ops in `lib` with kernel(fn) (the no-grad wrapper of the other
    ops) around their loops, for CPU and, where the extension registered no kernel, CUDA."""
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
        impl = kernel(_LOOPS[name])
        lib.impl(name, impl, "CPU")
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8ops::{name}", "CUDA"):
            lib.impl(name, impl, "CUDA")
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
    for name, fake in _FAKES.items():
        torch.library.register_fake(f"fp8ops::{name}", fake, lib=lib)


def _fake_amax(w):
    return w.new_empty((w.shape[0],), dtype=torch.float32)


def _fake_casts(w, dtype, transpose):
    e, n, k = w.shape
    return (w.new_empty((e, n, k), dtype=dtype),
            w.new_empty((e, k, n) if transpose else (0,), dtype=dtype))


def _fake_current(w, dtype, margin, power_of_two, transpose):
    return (*_fake_casts(w, dtype, transpose), _fake_amax(w), _fake_amax(w))


def _fake_scaled(w, scale, dtype, transpose):
    return (*_fake_casts(w, dtype, transpose), _fake_amax(w))


_FAKES = {"amax_experts": _fake_amax, "quantize_experts_current": _fake_current,
          "quantize_experts_scaled": _fake_scaled}
