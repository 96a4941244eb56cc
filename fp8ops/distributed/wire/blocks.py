"""Rows of values as FP8 blocks in one byte buffer, the unit that FP8 reductions send.

encode(x [R, n]) casts each row in blocks of block_size contiguous elements (a row's last block
may be short), one float32 scale per block that maps its amax to the format's largest value
(fp8ops.quantize_blockwise with 1 x block_size blocks: saturating round-to-nearest-even, a zero
block stays zero, a block holding inf or NaN becomes NaN), and packs each row's bytes and scales
side by side: [R, n + 4 * blocks] uint8, so one collective moves both. decode_sum and
decode_rows undo it on the receiving side."""
from __future__ import annotations

import torch

from ...formats import get_format

DEFAULT_BLOCK = 128


def check_settings(block_size, fmt):
    """The FP8 dtype of `fmt` (an FP8Format, a name or a float8 dtype); a clear error for a
    block size that is not a positive int."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"fp8ops: block_size must be a positive int, got {block_size!r}")
    return get_format(fmt).dtype


def blocks_of(n: int, block_size: int) -> int:
    return -(-n // block_size)


def encode(x: torch.Tensor, dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """x [R, n] (float32, bf16 or fp16) -> [R, n + 4 * ceil(n / block_size)] uint8: each row's
    FP8 bytes, then its float32 scale_inv per block."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"fp8ops: FP8 reductions take float32, bfloat16 or float16 values, got "
                        f"{x.dtype}")
    rows, n = x.shape
    if n == 0:
        return torch.empty((rows, 0), dtype=torch.uint8, device=x.device)
    return pack(*torch.ops.fp8ops.quantize_blockwise(x, dtype, 1, block_size, False))


def pack(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """[R, n] FP8 bytes and their [R, b] float32 scales side by side in one [R, n + 4 b] uint8
    buffer: one collective moves both."""
    return torch.cat([data.view(torch.uint8), scale_inv.contiguous().view(torch.uint8)], dim=1)


def unpack(packed: torch.Tensor, n: int, dtype: torch.dtype):
    """pack's inverse: (the [R, n] FP8 bytes, a view; their float32 scales, a fresh aligned
    copy)."""
    return packed[:, :n].view(dtype), packed[:, n:].contiguous().view(torch.float32)


def _split(packed: torch.Tensor, n: int, dtype: torch.dtype, block_size: int):
    nb = blocks_of(n, block_size)
    if packed.shape[1] != n + 4 * nb:
        raise ValueError(f"fp8ops: an FP8 buffer of {packed.shape[1]} bytes a row does not hold "
                         f"{n} values in blocks of {block_size}")
    return unpack(packed, n, dtype)


def decode_sum(packed: torch.Tensor, n: int, dtype: torch.dtype, block_size: int,
               divisor: float, out_dtype: torch.dtype) -> torch.Tensor:
    """The [n] sum of the packed rows, in row order in float32, over divisor, in out_dtype
    (fp8ops.dequantize_sum)."""
    if n == 0:
        return torch.empty(0, dtype=out_dtype, device=packed.device)
    data, scale_inv = _split(packed, n, dtype, block_size)
    return torch.ops.fp8ops.dequantize_sum(data, scale_inv, block_size, divisor, out_dtype)


def decode_rows(packed: torch.Tensor, n: int, dtype: torch.dtype, block_size: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The packed rows decoded, [R, n] in out_dtype."""
    if n == 0:
        return torch.empty((packed.shape[0], 0), dtype=out_dtype, device=packed.device)
    data, scale_inv = _split(packed, n, dtype, block_size)
    return torch.ops.fp8ops.dequantize_blockwise(data, scale_inv, 1, block_size, out_dtype)

