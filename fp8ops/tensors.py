"""Quantized tensors and the user-facing quantize / dequantize / gemm functions.

Float8Tensor, MXTensor and BlockwiseTensor are plain frozen containers (not tensor subclasses):
the FP8 payload plus what it takes to read it back. Each function validates its arguments and
names the problem; the numerics live in the ops (fp8ops.ops).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ._checks import check_int, check_int64
from .formats import FP8Format, get_format
from .scaling import check_margin, current_scale

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Float8Tensor:
    """Per-tensor scaled FP8: value = data * scale_inv. data_t is the transposed 2-D copy
    ([cols, rows]) when it was asked for."""

    data: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    fmt: FP8Format
    data_t: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.ops.fp8ops.dequantize(self.data, self.scale_inv, _check_out_dtype(dtype))


@dataclass(frozen=True)
class MXTensor:
    """MXFP8: data with one E8M0 scale byte per `block_size` elements along `axis`."""

    data: torch.Tensor
    scales: torch.Tensor
    block_size: int
    axis: int
    fmt: FP8Format

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.ops.fp8ops.dequantize_mx(self.data, self.scales, self.block_size, self.axis,
                                              _check_out_dtype(dtype))


@dataclass(frozen=True)
class BlockwiseTensor:
    """Blockwise scaled FP8 over the 2-D view [rows, last dim]: one float32 scale_inv per
    block[0] x block[1] tile (the last tiles may be partial)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Tuple[int, int]
    fmt: FP8Format

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.ops.fp8ops.dequantize_blockwise(self.data, self.scale_inv, *self.block,
                                                     _check_out_dtype(dtype))


QuantizedTensor = Union[Float8Tensor, MXTensor, BlockwiseTensor]


# ----------------------------------------------------------------------------------------------
# argument checks (messages name the argument and what was expected)
# ----------------------------------------------------------------------------------------------
def _check_input(x, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    return x


def _check_out_dtype(dtype) -> torch.dtype:
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"output dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype


_BAD_SCALE = "scale must be a positive finite number, in float32 and with a finite reciprocal"


def _scale_tensor(scale, device) -> torch.Tensor:
    """scale as a float32 0-d tensor on x's device. It is checked as the ops see it: in float32
    (1e39 overflows, 1e-50 underflows) and its reciprocal, which dequantizes, finite. A tensor
    scale off the CPU is checked asynchronously (torch._assert_async: no host sync; a bad value
    fails as a device-side assert), as is any tensor scale under torch.compile."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must hold one value, got shape {tuple(scale.shape)}")
        if scale.device != device:
            raise ValueError(f"scale is on {scale.device} but x is on {device}")
        if not scale.is_floating_point():
            raise TypeError(f"scale must be a floating-point tensor or a number, got a "
                            f"{scale.dtype} tensor")
        # the Float8Tensor keeps it: a scale that requires grad would carry its graph along
        s = scale.detach().reshape(()).to(torch.float32)
    else:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a number or a one-element tensor, got "
                            f"{type(scale).__name__} {scale!r}")
        # host data: checked on the CPU (whatever the default device), no sync
        s = torch.tensor(float(scale), dtype=torch.float32, device="cpu")
    ok = (s > 0) & torch.isfinite(s) & torch.isfinite(torch.reciprocal(s))
    if s.device.type == "cpu" and not torch.compiler.is_compiling():
        if not ok:
            value = scale.item() if isinstance(scale, torch.Tensor) else scale
            raise ValueError(f"{_BAD_SCALE}, got {value}")
    else:
        torch._assert_async(ok, _BAD_SCALE)
    return s.to(device)


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------
def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor on x's device (NaN if x holds NaN, 0 if x is empty)."""
    return torch.ops.fp8ops.amax(_check_input(x))


def quantize(x: torch.Tensor, fmt="e4m3", scale=None, *, rounding: str = "nearest",
             seed: int = 0, offset: int = 0, margin: float = 1.0,
             transpose: bool = False) -> Float8Tensor:
    """Per-tensor FP8 quantization. scale=None uses current scaling: scale = max / (amax * margin)
    (1.0 when amax is 0 or not finite). rounding is "nearest" (saturating RNE) or "stochastic"
    (Philox with `seed`, `offset`; advance `offset` between calls)."""
    _check_input(x)
    fmt = get_format(fmt)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    seed, offset = check_int64("seed", seed), check_int64("offset", offset)
    if transpose and x.dim() == 0:
        raise ValueError("transpose=True needs a tensor with at least one dimension")
    check_margin(margin)
    if scale is None:
        scale = current_scale(torch.ops.fp8ops.amax(x), fmt, margin)
    else:
        scale = _scale_tensor(scale, x.device)
    data, data_t, _ = torch.ops.fp8ops.quantize(x, scale, fmt.dtype, transpose,
                                                rounding == "stochastic", seed, offset)
    return Float8Tensor(data, scale, torch.reciprocal(scale), fmt, data_t if transpose else None)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if not isinstance(q, (Float8Tensor, MXTensor, BlockwiseTensor)):
        raise TypeError(f"dequantize expects a Float8Tensor, MXTensor or BlockwiseTensor, "
                        f"got {type(q).__name__}")
    return q.dequantize(dtype)


def quantize_mx(x: torch.Tensor, fmt="e4m3", block_size: int = 32, axis: int = -1,
                scale_mode: str = "floor") -> MXTensor:
    """MXFP8 (OCP MX v1.0): E8M0 scale per `block_size` elements along `axis`."""
    _check_input(x)
    fmt = get_format(fmt)
    if scale_mode not in ("floor", "rceil"):
        raise ValueError(f"scale_mode must be 'floor' or 'rceil', got {scale_mode!r}")
    block_size, axis = check_int("block_size", block_size), check_int("axis", axis)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if x.dim() == 0:
        raise ValueError("quantize_mx needs a tensor with at least one dimension")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for a {x.dim()}-D tensor")
    axis = axis % x.dim()
    if x.shape[axis] % block_size:
        raise ValueError(f"the length along axis {axis} ({x.shape[axis]}) must be a multiple of "
                         f"block_size {block_size}")
    data, scales = torch.ops.fp8ops.quantize_mx(x, fmt.dtype, block_size, axis,
                                                scale_mode == "rceil")
    return MXTensor(data, scales, block_size, axis, fmt)


def quantize_blockwise(x: torch.Tensor, fmt="e4m3", block=(1, 128),
                       power_of_two: bool = False) -> BlockwiseTensor:
    """DeepSeek-V3 style blockwise scaling of the 2-D view [rows, last dim]: (1, 128) for
    activations, (128, 128) for weights; scale_inv = amax / max per block."""
    _check_input(x)
    fmt = get_format(fmt)
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in block)):
        raise TypeError(f"block must be a (rows, cols) pair of ints, e.g. (1, 128) for "
                        f"activations or (128, 128) for weights, got {block!r}")
    block = tuple(int(b) for b in block)
    if min(block) <= 0:
        raise ValueError(f"block must be two positive sizes, e.g. (1, 128), got {block}")
    if x.dim() == 0:
        raise ValueError("quantize_blockwise needs a tensor with at least one dimension")
    data, scale_inv = torch.ops.fp8ops.quantize_blockwise(x, fmt.dtype, block[0], block[1],
                                                          power_of_two)
    return BlockwiseTensor(data, scale_inv, block, fmt)


def gemm(a: QuantizedTensor, b: QuantizedTensor, *, out_dtype: torch.dtype = torch.bfloat16,
         bias: Optional[torch.Tensor] = None, fast_accum: bool = False) -> torch.Tensor:
    """a [M, K] @ b[N, K].T with float32 accumulation, for two quantized operands of one kind."""
    _check_out_dtype(out_dtype)
    if type(a) is not type(b):
        raise TypeError(f"gemm operands must be of one kind, got {type(a).__name__} and "
                        f"{type(b).__name__}")
    if a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError(f"gemm expects 2-D operands a [M, K] and b [N, K], got shapes "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"gemm: K differs: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
                         "(b is [N, K]; the product is a @ b.T)")
    if a.data.device != b.data.device:
        raise ValueError(f"gemm operands on different devices: {a.data.device}, {b.data.device}")
    if bias is not None and (bias.shape != (b.shape[0],) or bias.device != a.data.device):
        raise ValueError(f"bias must have shape ({b.shape[0]},) on {a.data.device}, got "
                         f"{tuple(bias.shape)} on {bias.device}")
    if bias is not None and bias.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"bias must be float32, bfloat16 or float16, got {bias.dtype}")
    if isinstance(a, Float8Tensor):
        return torch.ops.fp8ops.gemm(a.data, b.data, a.scale_inv, b.scale_inv, bias, out_dtype,
                                     fast_accum)
    if isinstance(a, BlockwiseTensor):
        if a.block != (1, 128) or b.block not in ((1, 128), (128, 128)):
            raise ValueError(f"blockwise gemm takes a with (1, 128) blocks and b with (1, 128) or "
                             f"(128, 128) blocks, got {a.block} and {b.block}")
        return torch.ops.fp8ops.gemm_blockwise(a.data, b.data, a.scale_inv, b.scale_inv, bias,
                                               out_dtype)
    if isinstance(a, MXTensor):
        if a.axis != 1 or b.axis != 1 or a.block_size != b.block_size:
            raise ValueError("MX gemm needs both operands blocked along K (axis=-1) with one "
                             "block size")
        return torch.ops.fp8ops.gemm_mx(a.data, a.scales, b.data, b.scales, bias, out_dtype,
                                        a.block_size)
    raise TypeError(f"gemm expects quantized operands, got {type(a).__name__}")
