"""The MXFP8 GEMM on CUDA GPUs without an MX kernel of fp8ops' own (Hopper, Ada): the operands
are dequantized to bfloat16 and multiplied on the bf16 tensor cores with float32 accumulation
and output (aten::mm with out_dtype), instead of a float32 matmul.

bfloat16 holds every MXFP8 value exactly (at most 4 significant bits, float32's exponent range)
down to 2^-126; only products of blocks scaled below that round, by less than 2^-126 each. The
result matches the emulation's float32 GEMM within float32 accumulation error, as every GEMM of
fp8ops does (docs/numerics.md)."""
from __future__ import annotations

from typing import Optional

import torch

from . import emulation

# Whether this torch multiplies bf16 into float32 on CUDA (aten::mm.dtype); an older one takes
# the emulation's float32 GEMM. Asked of the dispatcher once: an error of the call itself (out of
# memory, say) is the caller's to see, never a reason to change paths.
BF16_MM = ("dtype" in torch.ops.aten.mm.overloads()
           and torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA"))


def gemm_mx(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
            bias: Optional[torch.Tensor], out_dtype: torch.dtype, block_size: int) -> torch.Tensor:
    if not a.is_cuda or not BF16_MM:
        return emulation.gemm_mx(a, a_scales, b, b_scales, bias, out_dtype, block_size)
    # one kernel each (fp8ops' dequantize_mx, bit-exact with the emulation's), straight to bf16
    ad = torch.ops.fp8ops.dequantize_mx(a, a_scales, block_size, -1, torch.bfloat16)
    bd = torch.ops.fp8ops.dequantize_mx(b, b_scales, block_size, -1, torch.bfloat16)
    return emulation._epilogue(torch.mm(ad, bd.t(), out_dtype=torch.float32), bias, out_dtype)
