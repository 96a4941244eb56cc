"""Facts about the FP8 formats (E4M3, E5M2) and the E8M0 block-scale byte, and the rounding of a
host scalar to float32 (the type every scale and step constant is computed in)."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    name: str
    dtype: torch.dtype
    max: float  # largest finite value
    emax: int  # exponent of the largest binade
    emin: int  # exponent of the smallest normal binade
    mbits: int  # explicit mantissa bits

    def __str__(self) -> str:
        return self.name


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0, 8, -6, 3)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0, 15, -14, 2)
_BY_NAME = {"e4m3": E4M3, "e5m2": E5M2}
_BY_DTYPE = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}

# Canonical NaN byte written by every cast (what PTX cvt.rn.satfinite produces).
NAN_BYTE = 0x7F
# E8M0 block-scale byte: value 2^(byte - 127); 0xFF is NaN.
E8M0_BIAS = 127
E8M0_NAN = 0xFF


def get_format(fmt) -> FP8Format:
    """Accept an FP8Format, a name ("e4m3"/"e5m2", any case) or a torch float8 dtype."""
    if isinstance(fmt, FP8Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        if fmt in _BY_DTYPE:
            return _BY_DTYPE[fmt]
    elif isinstance(fmt, str) and fmt.lower() in _BY_NAME:
        return _BY_NAME[fmt.lower()]
    raise ValueError(f"unknown FP8 format {fmt!r}; expected 'e4m3', 'e5m2', fp8ops.E4M3/E5M2 or "
                     "torch.float8_e4m3fn / torch.float8_e5m2")


def round_f32(v: float) -> float:
    """The float32 nearest to the Python float v (ties to even, overflow to inf)."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)
