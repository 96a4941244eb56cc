"""The grouped ops of mixture-of-experts layers: schemas, fake implementations, registration.

Tokens sorted by expert, `offsets` int32 [E] the cumulative end row of each group (the convention
of torch._grouped_mm); emulation_grouped.py is their meaning (a loop over the groups of the dense
ops); it serves CUDA tensors too, except where the Hopper kernel takes the GEMM (below) and
where the CUDA extension registers its own kernels (quantize_current_grouped and
quantize_scaled_grouped: csrc/cast_grouped.cu, the bytes the same). On CUDA the GEMMs the Hopper
kernel does not take (blockwise scales, a bias, an fp16 output, another GPU) loop over the
groups with the dense GEMM op as each group's GEMM, so that its kernels serve them.

  grouped_gemm            Y_g = X_g W_g^T, a [M, K], b [E, N, K]; scales per group [E] or per
                          row [M, 1] for a, per expert [E] or per output column [E, N] for b
  grouped_gemm_blockwise  the same with 1x128 (a) and 128x128 or 1x128 (b) block scales
  grouped_gemm_wgrad      dW_g = dY_g^T X_g from dY^T [N, M] and X^T [K, M]: [E, N, K]
  grouped_gemm_wgrad_blockwise   the same with 1x128 blocks along M, packed per group
  quantize_current_grouped       per-group current scaling (and the transposed copy)
  quantize_blockwise_grouped     per-group 1x128 casts of x and of x^T
  quantize_scaled_grouped        per-group casts with given scales [E] (delayed scaling), and
                                 each group's amax
dgrad (dX_g = dY_g W_g) is grouped_gemm with the weight's transposed copy [E, K, N] as b.

On a Hopper GPU, grouped_gemm and grouped_gemm_wgrad with one scale per group run the CUTLASS
sm90 grouped kernel (csrc/gemm_sm90_grouped*.cu) through two ops of their own, KERNEL_SCHEMAS,
which only the CUDA extension implements; other scales, a bias, fp16 outputs or rows that are
not 16-byte multiples keep the emulation. The kernel reads the offsets on the device: it never
synchronizes, and it checks them with an asynchronous device assert instead of a host check.
"""
from __future__ import annotations

import torch

from . import emulation_grouped
from .emulation_grouped import check_offsets_meta, packed_blocks

SCHEMAS = {
    "grouped_gemm": "(Tensor a, Tensor b, Tensor offsets, Tensor a_scale_inv, "
                    "Tensor b_scale_inv, Tensor? bias, ScalarType out_dtype) -> Tensor",
    "grouped_gemm_blockwise": "(Tensor a, Tensor b, Tensor offsets, Tensor a_scale_inv, "
                              "Tensor b_scale_inv, Tensor? bias, ScalarType out_dtype) -> Tensor",
    "grouped_gemm_wgrad": "(Tensor a, Tensor b, Tensor offsets, Tensor a_scale_inv, "
                          "Tensor b_scale_inv, ScalarType out_dtype) -> Tensor",
    "grouped_gemm_wgrad_blockwise": "(Tensor a, Tensor b, Tensor offsets, Tensor a_scale_inv, "
                                    "Tensor b_scale_inv, ScalarType out_dtype) -> Tensor",
    "quantize_current_grouped": "(Tensor x, Tensor offsets, ScalarType dtype, float margin, "
                                "bool power_of_two, bool transpose=False) "
                                "-> (Tensor, Tensor, Tensor, Tensor)",
    "quantize_blockwise_grouped": "(Tensor x, Tensor offsets, ScalarType dtype, "
                                  "bool power_of_two) -> (Tensor, Tensor, Tensor, Tensor)",
    "quantize_scaled_grouped": "(Tensor x, Tensor offsets, Tensor scale, ScalarType dtype, "
                               "bool transpose=False) -> (Tensor, Tensor, Tensor)",
}


# The Hopper kernels' own ops: a per-group scale [E] each, bfloat16 or float32 out, no bias.
KERNEL_SCHEMAS = {
    "grouped_gemm_sm90": "(Tensor a, Tensor b, Tensor offsets, Tensor a_scale_inv, "
                         "Tensor b_scale_inv, ScalarType out_dtype) -> Tensor",
    "grouped_gemm_wgrad_sm90": "(Tensor a, Tensor b, Tensor offsets, Tensor a_scale_inv, "
                               "Tensor b_scale_inv, ScalarType out_dtype) -> Tensor",
}
_ROUTED = {"grouped_gemm": "grouped_gemm_sm90", "grouped_gemm_wgrad": "grouped_gemm_wgrad_sm90"}


def register(lib: torch.library.Library, kernel) -> None:
    """Define the grouped ops in `lib` with kernel(fn) (the no-grad wrapper of the other ops)
    around their emulation, for CPU and, where no C++ kernel is registered, CUDA; grouped_gemm
    and grouped_gemm_wgrad on CUDA go to the Hopper kernel where it suits (sm90_suits)."""
    for name, schema in KERNEL_SCHEMAS.items():
        lib.define(name + schema)
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
        impl = kernel(getattr(emulation_grouped, name))
        lib.impl(name, impl, "CPU")
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8ops::{name}", "CUDA"):
            routed = _ROUTED.get(name)
            if routed:
                lib.impl(name, kernel(_routed(name, routed)), "CUDA")
            elif name in _PER_GROUP_DENSE:
                lib.impl(name, kernel(_per_group_dense(name)), "CUDA")
            else:
                lib.impl(name, impl, "CUDA")
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
    for name, fake in _FAKES.items():
        torch.library.register_fake(f"fp8ops::{name}", fake, lib=lib)


# ----------------------------------------------------------------------------------------------
# CUDA: the Hopper kernel where it suits, the emulation elsewhere
# ----------------------------------------------------------------------------------------------
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_hopper = {}  # device index -> whether it is an sm_90 GPU (read once)


def _is_hopper(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _hopper:
        _hopper[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return _hopper[index]


def sm90_suits(name: str, a, b, offsets, a_scale_inv, b_scale_inv, bias, out_dtype) -> bool:
    """Whether the Hopper grouped kernel computes this call: built and on an sm_90 GPU, operands
    (E4M3 or E5M2, E4M3) with 16-byte aligned data, one float32 scale per group, no bias, a
    bfloat16 or float32 output whose rows are 16-byte multiples and (forward/dgrad) K a multiple
    of 16."""
    kernel = _ROUTED[name]
    if a.device.type != "cuda" or not torch._C._dispatch_has_kernel_for_dispatch_key(
            f"fp8ops::{kernel}", "CUDA"):
        return False
    groups = offsets.shape[0]
    if (bias is not None or out_dtype not in (torch.bfloat16, torch.float32) or groups == 0
            or a.dtype not in _FP8 or b.dtype != torch.float8_e4m3fn
            or a_scale_inv.shape != (groups,) or b_scale_inv.shape != (groups,)
            or a_scale_inv.dtype != torch.float32 or b_scale_inv.dtype != torch.float32):
        return False
    row = b.shape[1] if name == "grouped_gemm" else b.shape[0]  # the output's row length
    if row * (4 if out_dtype == torch.float32 else 2) % 16:
        return False
    if name == "grouped_gemm" and (a.shape[1] % 16 or b.dim() != 3 or b.shape[0] != groups):
        return False
    if a.data_ptr() % 16 or b.data_ptr() % 16:  # TMA: 16-byte aligned bases (a view may not be)
        return False
    return _is_hopper(a.device)


# The GEMMs the Hopper grouped kernel does not take run a loop over the groups on CUDA as the
# emulation does, each group's GEMM the dense op (its CUTLASS or cuBLASLt kernel where it has
# one, on any CUDA GPU): every group's bytes are the dense op's on that group. (The dense op
# takes one scale per operand: row-wise scales keep the emulation's float32 GEMM.) The loop
# reads the offsets on the host, as the emulation does.
_PER_GROUP_DENSE = {"grouped_gemm_blockwise": "gemm_blockwise",
                    "grouped_gemm_wgrad_blockwise": "gemm_blockwise"}


def _per_group_dense(name: str):
    loop = getattr(emulation_grouped, name)
    dense = getattr(torch.ops.fp8ops, _PER_GROUP_DENSE[name])

    def run(*args):
        return loop(*args, gemm=dense)
    return run


def _dense_gemm_for(a_scale_inv, b_scale_inv):
    """The dense gemm op for a per-tensor grouped GEMM's groups, when it takes their scales."""
    return torch.ops.fp8ops.gemm if a_scale_inv.dim() == 1 and b_scale_inv.dim() == 1 else None


def _routed(name: str, kernel_name: str):
    emulated = getattr(emulation_grouped, name)
    sm90 = getattr(torch.ops.fp8ops, kernel_name)

    def run(a, b, offsets, a_scale_inv, b_scale_inv, *rest):
        bias, out_dtype = (rest[0], rest[1]) if name == "grouped_gemm" else (None, rest[0])
        if not sm90_suits(name, a, b, offsets, a_scale_inv, b_scale_inv, bias, out_dtype):
            return emulated(a, b, offsets, a_scale_inv, b_scale_inv, *rest,
                            gemm=_dense_gemm_for(a_scale_inv, b_scale_inv))
        # (dtype and shape checked too; sm90_suits made sure of the group count)
        emulation_grouped.check_offset_values(
            name, offsets, a.shape[0] if name == "grouped_gemm" else a.shape[1])
        return sm90(a, b, offsets, a_scale_inv, b_scale_inv, out_dtype)
    return run


# ----------------------------------------------------------------------------------------------
# fake (meta) implementations: shapes and dtypes only (offsets' values are never read)
# ----------------------------------------------------------------------------------------------
def _gemm(a, b, offsets, a_scale_inv, b_scale_inv, bias, out_dtype):
    check_offsets_meta("grouped_gemm", offsets, b.shape[0])
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _wgrad(a, b, offsets, a_scale_inv, b_scale_inv, out_dtype):
    check_offsets_meta("grouped_gemm_wgrad", offsets)
    return a.new_empty((offsets.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype)


def _quantize_current(x, offsets, dtype, margin, power_of_two, transpose=False):
    check_offsets_meta("quantize_current_grouped", offsets)
    m, k = x.shape
    e = offsets.shape[0]
    return (x.new_empty((m, k), dtype=dtype), x.new_empty((k, m) if transpose else (0,),
                                                           dtype=dtype),
            x.new_empty((e,), dtype=torch.float32), x.new_empty((e,), dtype=torch.float32))


def _quantize_blockwise(x, offsets, dtype, power_of_two):
    check_offsets_meta("quantize_blockwise_grouped", offsets)
    m, k = x.shape
    f32 = torch.float32
    return (x.new_empty((m, k), dtype=dtype), x.new_empty((m, -(-k // 128)), dtype=f32),
            x.new_empty((k, m), dtype=dtype),
            x.new_empty((k, packed_blocks(m, offsets.shape[0])), dtype=f32))


def _gemm_sm90(a, b, offsets, a_scale_inv, b_scale_inv, out_dtype):
    return _gemm(a, b, offsets, a_scale_inv, b_scale_inv, None, out_dtype)


def _quantize_scaled(x, offsets, scale, dtype, transpose=False):
    check_offsets_meta("quantize_scaled_grouped", offsets)
    m, k = x.shape
    return (x.new_empty((m, k), dtype=dtype),
            x.new_empty((k, m) if transpose else (0,), dtype=dtype),
            x.new_empty((offsets.shape[0],), dtype=torch.float32))


_FAKES = {
    "grouped_gemm_sm90": _gemm_sm90,
    "grouped_gemm_wgrad_sm90": _wgrad,
    "grouped_gemm": _gemm,
    "grouped_gemm_blockwise": _gemm,
    "grouped_gemm_wgrad": _wgrad,
    "grouped_gemm_wgrad_blockwise": _wgrad,
    "quantize_current_grouped": _quantize_current,
    "quantize_blockwise_grouped": _quantize_blockwise,
    "quantize_scaled_grouped": _quantize_scaled,
}
