"""The receiving end of a sum that travels in FP8 blocks (fp8ops.distributed.wire): the op
`dequantize_sum`, its emulation (the definition) and its fake.

    out = torch.ops.fp8ops.dequantize_sum(data, scale_inv, block_size, divisor, out_dtype)

data [R, n] FP8 holds R contributions (one per rank) to the same n values, each cast by
`quantize_blockwise(x, dtype, 1, block_size, False)`: one float32 scale_inv per block of
block_size contiguous elements, [R, ceil(n / block_size)]. Each element is decoded
(data * scale_inv, float32) and the R values are added in row order starting from +0 in float32,
one rounding per addition, so every run and device gives the same bits; the sum is divided by
float32(divisor) and rounded once to out_dtype. A NaN byte gives NaN: a block that held inf or NaN
was cast to NaN, and stays NaN through the sum. The CUDA kernel (csrc/block_sum.cu) does the same
arithmetic in one pass."""
from __future__ import annotations

import math

import torch

SCHEMAS = {
    "dequantize_sum": "(Tensor data, Tensor scale_inv, int block_size, float divisor, "
                      "ScalarType out_dtype) -> Tensor",
}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.float32, torch.bfloat16, torch.float16)


def _check(data, scale_inv, block_size, divisor, out_dtype) -> int:
    """The checks of the CUDA binding, in its words; the number of blocks per row."""
    if data.dim() != 2 or data.dtype not in _FP8:
        raise ValueError(f"fp8ops: dequantize_sum: data must be 2-D float8_e4m3fn or float8_e5m2, "
                         f"got {data.dtype} {list(data.shape)}")
    if block_size <= 0:
        raise ValueError(f"fp8ops: dequantize_sum: block_size must be positive, got {block_size}")
    rows, cols = data.shape
    blocks = -(-cols // block_size)
    if tuple(scale_inv.shape) != (rows, blocks) or scale_inv.dtype != torch.float32:
        raise ValueError(f"fp8ops: dequantize_sum: scale_inv must be float32 [{rows}, {blocks}], "
                         f"got {scale_inv.dtype} {list(scale_inv.shape)}")
    if scale_inv.device != data.device:
        raise ValueError(f"fp8ops: data ({data.device}) and scale_inv ({scale_inv.device}) must be "
                         f"on the same device")
    if not (math.isfinite(divisor) and divisor > 0):
        raise ValueError(f"fp8ops: dequantize_sum: divisor must be positive and finite, got "
                         f"{divisor}")
    if out_dtype not in _OUT:
        raise ValueError(f"fp8ops: dequantize_sum: out_dtype must be float32, bfloat16 or "
                         f"float16, got {out_dtype}")
    return blocks


def dequantize_sum(data: torch.Tensor, scale_inv: torch.Tensor, block_size: int, divisor: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    _check(data, scale_inv, block_size, divisor, out_dtype)
    rows, cols = data.shape
    scales = scale_inv.repeat_interleave(block_size, dim=1)[:, :cols]
    decoded = data.to(torch.float32).mul_(scales)  # exact decode, one float32 rounding
    acc = torch.zeros(cols, dtype=torch.float32, device=data.device)
    for r in range(rows):  # in row order, one rounding per addition (no tree, no FMA)
        acc.add_(decoded[r])
    if divisor != 1.0:
        acc.div_(torch.tensor(divisor, dtype=torch.float32, device=acc.device))
    return acc.to(out_dtype)


def _fake(data, scale_inv, block_size, divisor, out_dtype):
    torch._check(data.dim() == 2, lambda: "fp8ops: dequantize_sum: data must be 2-D")
    return data.new_empty((data.shape[1],), dtype=out_dtype)


def register(lib: torch.library.Library, kernel) -> None:
    """Define the op in `lib` with kernel(fn) (the no-grad wrapper of the other ops) around its
    emulation, for CPU and, where the extension registered no kernel, CUDA; and its fake."""
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
        impl = kernel(dequantize_sum)
        lib.impl(name, impl, "CPU")
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8ops::{name}", "CUDA"):
            lib.impl(name, impl, "CUDA")
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
        torch.library.register_fake(f"fp8ops::{name}", _fake, lib=lib)
