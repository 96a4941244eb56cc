"""Stochastic rounding of float32 to bfloat16, for masters kept in bf16 (fp8ops.optim.FP8AdamW).

A bf16 value is the top half of a float32's bits. With r the element's 32-bit Philox word
(philox.py: the same stream layout as the FP8 stochastic cast) the result is the top half of
`bits(x) + (r >> 16)`: x's low 16 bits plus 16 random bits carry into the kept half with
probability low16 / 2^16, so the rounding is unbiased to 16 bits, and a value already on the
bf16 grid is kept. Integer arithmetic on the bits makes it the same on every device. The carry
runs through the exponent as it should (the largest float32 magnitudes round up to inf, as
bf16 has no larger finite value); +-inf and +-0 are kept; NaN gives bf16 NaN.
"""
from __future__ import annotations

import torch

from . import philox

# elements rounded per pass: bounds the int64 temporaries (about 24 bytes per element)
PIECE = 1 << 20


def stochastic_round_bf16(x: torch.Tensor, seed: int, offset: int,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """x (float32) stochastically rounded to bfloat16, written to `out` (bf16, x's shape) when
    given. Element i of x's flat view uses the Philox word of element i of the stream
    (seed, offset)."""
    if x.dtype != torch.float32:
        raise TypeError(f"fp8ops: stochastic rounding to bfloat16 takes float32, got {x.dtype}")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    elif out.dtype != torch.bfloat16 or out.shape != x.shape or out.device != x.device:
        raise ValueError(f"fp8ops: out must be bfloat16 of shape {tuple(x.shape)} on {x.device}, "
                         f"got {out.dtype} of shape {tuple(out.shape)} on {out.device}")
    flat = x.reshape(-1)
    dest = out.view(-1) if out.is_contiguous() else torch.empty_like(flat, dtype=torch.bfloat16)
    n = flat.numel()
    for a in range(0, n, PIECE):
        piece = flat[a:a + PIECE]
        words = philox.random_words(piece.numel(), seed, offset, x.device, first=a)
        # int64: a sign-extended pattern plus 16 random bits never overflows; the mask keeps
        # the top 16 bits of the 32 (negative patterns stay negative, as their sign bit is set)
        bits = piece.contiguous().view(torch.int32).to(torch.int64)
        bits = bits.add_(words.bitwise_right_shift_(16)).bitwise_and_(~0xFFFF)
        rounded = bits.to(torch.int32).view(torch.float32)
        rounded = torch.where(torch.isnan(piece), piece, rounded)  # a NaN's carry is meaningless
        dest[a:a + PIECE].copy_(rounded)  # exact: the low 16 bits are zero
    if dest.data_ptr() != out.data_ptr():
        out.copy_(dest.view(out.shape))
    return out
