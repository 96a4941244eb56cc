"""Pure-PyTorch implementation of every fp8ops op: the exact reference the CUDA kernels match.

Each function has the same signature as its op (schemas in ops/__init__.py) and runs on any
device. The numerics are those of docs/design.md ("Per-tensor casts", "Stochastic rounding",
"Block scaling"): one float32 multiply by the scale, clamp (so +-inf saturate and torch's
version-dependent overflow never matters), round to nearest even, NaN written as 0x7F.

The full-size passes avoid boolean masks (torch.where, isnan, comparisons): on CPU those run an
order of magnitude slower than arithmetic. Masks stay on the small per-block and per-tensor
tensors; NaN is carried by arithmetic (a NaN scale) and canonicalized on the bytes. Each rewrite is
exact, and tests/test_emulation_fast.py checks it byte for byte against the plain formulation.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import cpu_kernels, philox
from .philox import philox4x32_10, random_words, uniform24  # noqa: F401 (tests use them here)
# the optimizer ops' emulation lives beside its helpers
from .adamw import adamw_step, adamw_step_multi  # noqa: F401
from .scratch import scratch, scratch_like
from ..formats import E8M0_BIAS, E8M0_NAN, get_format, round_f32

FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN = torch.finfo(torch.float32).tiny


# ----------------------------------------------------------------------------------------------
# small exact helpers
# ----------------------------------------------------------------------------------------------
def _on_host(t: torch.Tensor) -> bool:
    """Whether t is on the CPU, where reading a value costs nothing. Elsewhere the ops take the
    plain tensor formulas, which never sync with the host (CUDA graphs)."""
    return t.device.type == "cpu"


def _maybe(flag: torch.Tensor) -> bool:
    """bool(flag) on the host; elsewhere True, the safe answer."""
    return not _on_host(flag) or bool(flag)


# Smallest magnitude byte (sign bit clear) that is NaN: E4M3 0x7F; E5M2 0x7D-0x7F.
_FIRST_NAN = {"e4m3": 0x7F, "e5m2": 0x7D}


def _canonical_nan_bytes(q: torch.Tensor, fmt) -> torch.Tensor:
    """Every NaN byte of q (uint8, modified in place) becomes 0x7F, in integer ops only."""
    h = (q & 0x7F).add_(0x80 - _FIRST_NAN[fmt.name]).bitwise_and_(0x80)  # 0x80 iff NaN
    return q.bitwise_or_(h - (h >> 7)).bitwise_and_(h ^ 0xFF)  # NaN: (q | 0x7F) & 0x7F


def _rne_fp8(y: torch.Tensor, fmt, nan_possible: bool = True,
             inplace: bool = False) -> torch.Tensor:
    """float32 -> FP8, saturating round to nearest even; NaN becomes the canonical 0x7F byte.
    nan_possible=False skips the NaN pass when the caller knows y has none; inplace clamps y."""
    y = y.clamp_(-fmt.max, fmt.max) if inplace else y.clamp(-fmt.max, fmt.max)  # NaN passes
    return _cast_in_range(y, fmt, nan_possible)


def _cast_in_range(y: torch.Tensor, fmt, nan_possible: bool = True) -> torch.Tensor:
    """_rne_fp8 of a y already within +-max (or NaN): no clamp."""
    q = y.to(fmt.dtype)
    if nan_possible:
        q = _canonical_nan_bytes(q.view(torch.uint8), fmt).view(fmt.dtype)
    return q


def _fp8_to_f32(data: torch.Tensor, slot: Optional[str] = None) -> torch.Tensor:
    """FP8 -> float32, bit for bit what data.float() gives (layout too), several times faster on
    CPU: both formats are exact in float16, whose conversion is vectorized. Data holding NaN bytes
    takes data.float(): torch's float16 conversion gives a NaN payload that depends on where the
    element falls (vector body or scalar tail). With `slot`, a contiguous input is decoded into
    that scratch buffer (for a result the caller consumes before returning)."""
    fmt = get_format(data.dtype)
    if not _on_host(data) or data.numel() == 0:
        return data.float()
    if cpu_kernels.loaded() and _dense(data):
        # csrc/decode_cpu.cpp: one pass; it declines data holding a NaN byte
        out = _decode_buffer(data, slot)
        return out if torch.ops.fp8ops_cpu.decode_fp8(data, out) else data.float()
    u8 = data.view(torch.uint8)
    if int(torch.bitwise_and(u8, 0x7F, out=scratch_like("fp8_mag", u8)).max()) >= \
            _FIRST_NAN[fmt.name]:
        return data.float()
    if slot is not None and data.is_contiguous():
        h = scratch_like("fp8_half", data, torch.int16)
        out = scratch_like(slot, data, torch.float32)
    else:  # same layout as data.float()
        h = torch.empty_like(data, dtype=torch.int16)
        out = torch.empty_like(data, dtype=torch.float32)
    if fmt.name == "e5m2":  # E5M2 is the top byte of a float16
        return out.copy_(h.copy_(u8).bitwise_left_shift_(8).view(torch.float16))
    # E4M3 s.eeee.mmm -> float16 s.0eeee.mmm0000000, which is the value times 2^-8 (subnormals
    # too). The sign-extended int8 shifted by 7 sets bit 14 for negative bytes: cleared by the mask.
    h.copy_(data.view(torch.int8)).bitwise_left_shift_(7).bitwise_and_(-0x4001)
    return out.copy_(h.view(torch.float16)).mul_(256.0)


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its span of memory once each (contiguous in some order of its
    dims, such as a transpose), all strides positive."""
    if t.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _decode_buffer(data: torch.Tensor, slot: Optional[str]) -> torch.Tensor:
    """Where _fp8_to_f32 decodes data: scratch `slot` for a contiguous data, else a new tensor
    of data.float()'s layout."""
    if slot is not None and data.is_contiguous():
        return scratch_like(slot, data, torch.float32)
    return torch.empty_like(data, dtype=torch.float32)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """t.float() without an op call when t already is float32."""
    return t if t.dtype == torch.float32 else t.float()


def _exp2_f32(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-149, 127], built from bits (exact)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    sub = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, sub)


def _abs_max(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| as float32; NaN wins over everything, empty gives 0."""
    if dim is not None:
        return torch.abs(x.float(), out=scratch_like("abs", x, torch.float32)).amax(dim=dim)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if _on_host(x) and cpu_kernels.loaded() and x.dtype == torch.float32 and x.is_contiguous():
        a = torch.ops.fp8ops_cpu.abs_max(x)  # csrc/per_tensor_cpu.cpp: one pass
        if not math.isnan(a.item()):
            return a
    elif _on_host(x):
        # max(max x, -min x) reads x twice but writes no |x|; exact, as max and negation are.
        # NaN: the plain way below, for its bits.
        hi, lo = x.amax().item(), x.amin().item()
        if hi == hi and lo == lo:
            return torch.tensor(abs(max(hi, -lo)), dtype=torch.float32)
    return x.float().abs().amax()


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """[rows, last dim] view (rows = product of the leading dims; 0-d counts as [1, 1])."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


# ----------------------------------------------------------------------------------------------
# stochastic rounding (docs/design.md, "Stochastic rounding"); the random words: philox.py
# ----------------------------------------------------------------------------------------------
def _stochastic_fp8(y: torch.Tensor, fmt, seed: int, offset: int, nan_possible: bool = True,
                    clamp: bool = True) -> torch.Tensor:
    """Stochastic rounding of float32 y (already scaled; a temporary: clobbered) to FP8,
    docs/design.md, "Stochastic rounding", without masks:
    - ulp = 2^(max(floor(log2|y|), emin) - mbits) comes from |y|'s exponent field; a float32
      subnormal or zero gets emin, the right ulp for the first and harmless for zero;
    - up = (frac > u) is ceil(frac - u): the float32 difference of two values in [0, 1) lies in
      (-1, 1), is zero only when they are equal and never changes sign (ceil gives 1, or +-0);
    - y = +-0 gives k = 0, so copysign(0, y) = y; NaN stays NaN (its byte is canonical anyway).
    clamp=False: the caller knows |y| <= max already. On the CPU with fp8ops._cpu built, its
    kernel (csrc/stochastic_cpu.cpp) runs these steps, the clamp included, in one pass."""
    if _on_host(y) and y.is_contiguous() and cpu_kernels.loaded():
        m = philox.MASK32
        return torch.ops.fp8ops_cpu.stochastic_round(y, fmt.dtype, seed & m, (seed >> 32) & m,
                                                     offset & m, (offset >> 32) & m)
    if clamp:
        y = y.clamp_(-fmt.max, fmt.max)
    a = torch.abs(y, out=scratch_like("sr_abs", y))
    ulp = torch.bitwise_and(a.view(torch.int32), 0x7F800000,
                            out=scratch_like("sr_ulp", y, torch.int32))
    ulp = ulp.clamp_(min=(fmt.emin + 127) << 23).sub_(fmt.mbits << 23).view(torch.float32)
    k = a.div_(ulp)  # exact: ulp is a power of two and k stays small
    fk = torch.floor(k, out=scratch_like("sr_floor", y))
    u = uniform24(y.numel(), seed, offset, y.device).reshape(y.shape)
    # the min(., max) of the rule is the identity: max is on the grid, so rounding |y| <= max
    # up to the grid stays <= max
    mag = fk.add_(k.sub_(fk).sub_(u).ceil_()).mul_(ulp)
    return _cast_in_range(mag.copysign_(y), fmt, nan_possible)  # exact: an FP8 value


# ----------------------------------------------------------------------------------------------
# per-tensor ops
# ----------------------------------------------------------------------------------------------
def amax(x: torch.Tensor) -> torch.Tensor:
    return _abs_max(x)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool = False,
             stochastic: bool = False, seed: int = 0, offset: int = 0,
             rng: Optional[torch.Tensor] = None, via: Optional[torch.dtype] = None, *,
             x_amax: Optional[torch.Tensor] = None):
    """x (rounded to `via` first, when given) scaled and rounded to FP8: (data, data_t or an
    empty tensor, amax of x). x_amax (not in the op's schema): amax(x), which a caller that
    took it already passes rather than have x read again."""
    if via is not None:
        if via not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"fp8ops: via must be float32, bfloat16 or float16, got {via}")
        x = x.to(via)
    fmt = get_format(dtype)
    if rng is not None:
        seed, offset = rng_words(rng)
    s = _f32(scale)
    if s.dim():
        s = s.reshape(())  # a [1] scale must not broadcast a 0-d x
    if x_amax is None:
        x_amax = _abs_max(x)
    if _on_host(x) and cpu_kernels.loaded() and s.device.type == "cpu":
        xf = _f32(x)
        if xf.is_contiguous():
            return _cast_kernels(xf, s.item(), fmt, transpose, stochastic, seed, offset) + (x_amax,)
    y = torch.mul(_f32(x), s, out=scratch_like("cast_y", x, torch.float32))
    nan_possible = clamp = True
    if _on_host(x):
        # x * s is NaN only for a NaN or inf in x, or a non-finite s; and rounding is monotonic,
        # so no |x * s| exceeds the float32 amax * |s|: when that is within max, the clamp is
        # the identity
        a, sv = x_amax.item(), s.item()
        nan_possible = not (math.isfinite(a) and math.isfinite(sv))
        clamp = nan_possible or not round_f32(a * abs(sv)) <= fmt.max
    if stochastic:
        data = _stochastic_fp8(y, fmt, seed, offset, nan_possible, clamp)
    elif clamp:
        data = _rne_fp8(y, fmt, nan_possible, inplace=True)
    else:
        data = _cast_in_range(y, fmt, nan_possible)
    data = data.contiguous()
    if transpose:
        data_t = _as_2d(data).t().clone(memory_format=torch.contiguous_format)
    else:
        data_t = data.new_empty((0,))
    return data, data_t, x_amax


def _cast_kernels(x: torch.Tensor, scale: float, fmt, transpose: bool, stochastic: bool,
                  seed: int, offset: int):
    """quantize's (data, data_t) of a contiguous float32 x by the float32 `scale` with fp8ops._cpu:
    the multiply, clamp, rounding and transposed copy in one pass (csrc/per_tensor_cpu.cpp;
    stochastic rounding: csrc/stochastic_cpu.cpp, then the byte transpose). Their clamp is
    the identity where the tensor code skips it, and their NaN byte the canonical one."""
    if not stochastic:
        return tuple(torch.ops.fp8ops_cpu.cast_scaled(x, scale, fmt.dtype, transpose))
    m = philox.MASK32
    data = torch.ops.fp8ops_cpu.stochastic_round(x, fmt.dtype, seed & m, (seed >> 32) & m,
                                                 offset & m, (offset >> 32) & m, scale)
    data_t = torch.ops.fp8ops_cpu.transpose_bytes(_as_2d(data)) if transpose else \
        data.new_empty((0,))
    return data, data_t


def rng_words(rng: torch.Tensor):
    """(seed, offset) of a random-stream tensor (int64 [seed, offset]), read on the host."""
    if rng.dtype != torch.int64 or tuple(rng.shape) != (2,):
        raise ValueError(f"fp8ops: rng must be an int64 tensor [seed, offset], got {rng.dtype} "
                         f"of shape {tuple(rng.shape)}")
    seed, offset = rng.tolist()
    return seed, offset


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _fp8_to_f32(data).mul_(scale_inv.float().reshape(())).to(out_dtype).contiguous()


_BYTE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """data^T, contiguous: the bytes of a 2-D FP8 (or uint8) tensor moved, never converted."""
    if data.dtype not in _BYTE_DTYPES or data.dim() != 2:
        raise ValueError(f"fp8ops: transpose_fp8: data must be a 2-D float8_e4m3fn, float8_e5m2 "
                         f"or uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
    if _on_host(data) and cpu_kernels.loaded():
        return torch.ops.fp8ops_cpu.transpose_bytes(data)  # csrc/decode_cpu.cpp: tiled
    return data.t().clone(memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------
# MXFP8 (docs/design.md, "MXFP8")
# ----------------------------------------------------------------------------------------------
def _split_axis(x: torch.Tensor, block_size: int, axis: int) -> torch.Tensor:
    """Split `axis` into (n_blocks, block_size) in place: a view, with no data movement."""
    return x.reshape(*x.shape[:axis], x.shape[axis] // block_size, block_size,
                     *x.shape[axis + 1:])


def mx_exponent(amax_block: torch.Tensor, fmt, rceil: bool) -> torch.Tensor:
    """Unbiased E8M0 exponent per block (int32) for finite amax; 0 amax gives -127."""
    pos = amax_block > 0
    safe = torch.where(pos & torch.isfinite(amax_block), amax_block, 1.0)
    m, e2 = torch.frexp(safe)  # safe = m * 2^e2, m in [0.5, 1)
    e = e2 - 1 - fmt.emax
    if rceil:  # one more when the mantissa exceeds max / 2^emax (= 1.75 for both formats)
        e = e + (m * 2 > fmt.max / 2.0 ** fmt.emax).to(torch.int32)
    e = torch.where(pos, e, -E8M0_BIAS)
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_mx(x: torch.Tensor, dtype: torch.dtype, block_size: int, axis: int, rceil: bool):
    fmt = get_format(dtype)
    if not -x.dim() <= axis < x.dim() or x.shape[axis] % block_size:
        raise ValueError(f"quantize_mx: axis {axis} must exist and its length must be a multiple "
                         f"of block_size {block_size}; got shape {tuple(x.shape)}")
    axis = axis % x.dim()
    if _on_host(x) and cpu_kernels.loaded():  # csrc/mx_cpu.cpp: the steps below in one pass
        return torch.ops.fp8ops_cpu.quantize_mx(x.contiguous(), dtype, block_size, axis, rceil)
    xb = _split_axis(_f32(x), block_size, axis)
    amax_b = _abs_max(xb, dim=axis + 1)  # scales' shape: x's with axis divided by the block
    e, bad = _mx_exponent_bits(amax_b, fmt, rceil)
    # 2^-e from its bits (-127 <= e <= 128 - emax, so 2^-e is normal); a block holding NaN or inf
    # (bad = 1) gets a NaN multiplier, which makes all its data NaN
    mult = (127 - e).bitwise_left_shift_(23).bitwise_or_(bad * 0x7FC00000)
    y = torch.mul(xb, mult.view(torch.float32).unsqueeze(axis + 1),
                  out=scratch_like("cast_y", xb))
    nan_possible = not _on_host(bad) or (bad.numel() > 0 and int(bad.max()) > 0)
    data = _rne_fp8(y, fmt, nan_possible, inplace=True).reshape(x.shape)
    scales = (e + E8M0_BIAS).bitwise_or_(bad * E8M0_NAN).to(torch.uint8)
    return data.contiguous(), scales.contiguous()


def _mx_exponent_bits(amax_b: torch.Tensor, fmt, rceil: bool):
    """(mx_exponent, 1 where the block holds NaN or inf else 0) from the bits of amax >= 0, in
    integer ops: floor(log2 amax) is the exponent field minus 127 (a subnormal or zero amax
    clamps to -127 either way) and RCEIL's mantissa > 1.75 is a fraction field > 0x600000.
    For a bad block the exponent is meaningless (its scale byte and data are NaN)."""
    bits = amax_b.view(torch.int32)
    field = (bits >> 23).bitwise_and_(0xFF)  # masked: a NaN amax may come back with its sign set
    e = field - (127 + fmt.emax)
    if rceil:
        e.add_((bits & 0x7FFFFF).add_(0x800000 - 0x600001).bitwise_right_shift_(23))
    return e.clamp_(-E8M0_BIAS, E8M0_BIAS), field.add_(1).bitwise_right_shift_(8)


def _e8m0_table(device) -> torch.Tensor:
    """2^(byte - 127) for every byte, from its bits: byte << 23, and bit 22 for byte 0 (the
    subnormal 2^-127) and byte 0xFF (which makes the canonical NaN 0x7FC00000)."""
    table = _E8M0_TABLES.get(device)
    if table is None:
        b = torch.arange(256, dtype=torch.int32)
        edge = ((b == 0) | (b == E8M0_NAN)).to(torch.int32)
        table = _E8M0_TABLES[device] = ((b << 23) | (edge << 22)).view(torch.float32).to(device)
    return table


_E8M0_TABLES = {}


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    idx = scales.reshape(-1).to(torch.int32)
    return _e8m0_table(scales.device).index_select(0, idx).view(scales.shape)


def _dequantize_mx_f32(data: torch.Tensor, scales: torch.Tensor, block_size: int, axis: int,
                       slot: Optional[str] = None) -> torch.Tensor:
    """dequantize_mx to float32, contiguous; into scratch `slot` when given."""
    axis = axis % data.dim()
    if _on_host(data) and cpu_kernels.loaded() and data.dim() == 2 and axis == 1 and \
            data.shape[1] % block_size == 0 and tuple(scales.shape) == \
            (data.shape[0], data.shape[1] // block_size) and scales.dtype == torch.uint8:
        # csrc/decode_cpu.cpp: one pass from data's own layout; it declines NaN bytes
        out = scratch_like(slot, data, torch.float32) if slot is not None else \
            torch.empty(data.shape, dtype=torch.float32)
        if torch.ops.fp8ops_cpu.dequantize_mx(data, scales, block_size, out):
            return out
    if not data.is_contiguous():  # bytes first: cheaper to transpose as FP8 than as float32
        data = scratch_like("mx_bytes", data).copy_(data) if slot else data.contiguous()
    xb = _split_axis(_fp8_to_f32(data, slot), block_size, axis)
    return xb.mul_(e8m0_to_float(scales).unsqueeze(axis + 1)).reshape(data.shape)


def dequantize_mx(data: torch.Tensor, scales: torch.Tensor, block_size: int, axis: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_mx_f32(data, scales, block_size, axis).to(out_dtype).contiguous()


# ----------------------------------------------------------------------------------------------
# Blockwise (DeepSeek-V3 style, docs/design.md, "Blockwise")
# ----------------------------------------------------------------------------------------------
def _tiles(x2: torch.Tensor, br: int, bc: int, fill: float) -> torch.Tensor:
    """[R, C] -> [Rb, br, Cb, bc], padding the last partial blocks with `fill` (a view when
    there is nothing to pad)."""
    R, C = x2.shape
    Rb, Cb = -(-R // br), -(-C // bc)
    if Rb * br != R or Cb * bc != C:
        x2 = torch.nn.functional.pad(x2, (0, Cb * bc - C, 0, Rb * br - R), value=fill)
    return x2.reshape(Rb, br, Cb, bc)


def _expand_tiles(s: torch.Tensor, br: int, bc: int, R: int, C: int) -> torch.Tensor:
    return s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :C]


def _times_block(x2: torch.Tensor, s: torch.Tensor, br: int, bc: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x2 [R, C] times the value of s [Rb, Cb] for each element's block (one float32 multiply
    each); broadcast over a tiled view when the blocks divide x2, so s is never expanded.
    `out`: a contiguous [R, C] tensor of the result's dtype to write into."""
    R, C = x2.shape
    Rb, Cb = s.shape
    if Rb * br != R or Cb * bc != C:
        return torch.mul(x2, _expand_tiles(s, br, bc, R, C), out=out)
    if out is None:
        return (x2.reshape(Rb, br, Cb, bc) * s[:, None, :, None]).reshape(R, C)
    torch.mul(x2.reshape(Rb, br, Cb, bc), s[:, None, :, None], out=out.view(Rb, br, Cb, bc))
    return out


def blockwise_scales(amax_b: torch.Tensor, fmt, power_of_two: bool):
    """(scale, scale_inv) per block: scale = max / amax, scale_inv = amax / max, 1 for amax 0."""
    zero, bad = amax_b == 0, ~torch.isfinite(amax_b)
    # tensor / tensor: one correctly rounded division on every device (torch turns a division
    # by a Python scalar into a multiply by its reciprocal on CUDA)
    fmax = torch.full((), fmt.max, dtype=torch.float32, device=amax_b.device)
    scale_inv = amax_b / fmax
    scale = fmax / amax_b
    if power_of_two:  # round scale_inv up to a power of two; scale is then its exact inverse
        safe = torch.where(zero | bad, 1.0, scale_inv)
        m, e2 = torch.frexp(safe)
        scale_inv = _exp2_f32(torch.where(m == 0.5, e2 - 1, e2).clamp(-149, 127))
        scale = 1.0 / scale_inv
    one = torch.ones_like(amax_b)
    scale_inv = torch.where(zero, one, torch.where(bad, float("nan"), scale_inv))
    # amax below max / FLT_MAX overflows the quotient: FLT_MAX keeps zeros zero (inf * 0 = NaN)
    scale = torch.where(zero | bad, one, scale.clamp(max=FLT_MAX))
    return scale, scale_inv


def quantize_blockwise(x: torch.Tensor, dtype: torch.dtype, block_rows: int, block_cols: int,
                       power_of_two: bool):
    fmt = get_format(dtype)
    x2 = _as_2d(_f32(x))
    if not x2.is_contiguous() and x2.t().is_contiguous():
        # the transpose of a dense [C, R]: quantize that with the blocks transposed (the same
        # blocks, element for element), then transpose the FP8 bytes rather than the floats
        data_t, scale_inv_t = _quantize_blockwise_2d(x2.t(), fmt, block_cols, block_rows,
                                                     power_of_two)
        return transpose_fp8(data_t).reshape(x.shape), scale_inv_t.t().contiguous()
    if not x2.is_contiguous():
        x2 = scratch_like("bw_x", x2).copy_(x2)
    data, scale_inv = _quantize_blockwise_2d(x2, fmt, block_rows, block_cols, power_of_two)
    return data.reshape(x.shape).contiguous(), scale_inv


def _quantize_blockwise_2d(x2: torch.Tensor, fmt, block_rows: int, block_cols: int,
                           power_of_two: bool):
    """quantize_blockwise of a dense float32 [R, C]. On the CPU with fp8ops._cpu built, one
    kernel (csrc/blockwise_cpu.cpp) takes the tile amax, the scales and the cast."""
    if _on_host(x2) and cpu_kernels.loaded():
        return tuple(torch.ops.fp8ops_cpu.quantize_tiles(x2, fmt.dtype, block_rows, block_cols,
                                                         power_of_two))
    amax_b = _abs_max(_tiles(x2, block_rows, block_cols, 0.0), dim=(1, 3))
    if _on_host(amax_b) and not power_of_two:
        mult, scale_inv, nan_possible = _block_multipliers(amax_b, fmt)
    else:
        scale, scale_inv = blockwise_scales(amax_b, fmt, power_of_two)
        bad = ~torch.isfinite(amax_b)
        mult, nan_possible = torch.where(bad, float("nan"), scale), _maybe(bad.any())
    # a block holding NaN or inf has a NaN multiplier, which makes all its data NaN
    y = _times_block(x2, mult, block_rows, block_cols, out=scratch_like("cast_y", x2))
    return _rne_fp8(y, fmt, nan_possible, inplace=True), scale_inv


def quantize_blockwise_pair_kernel(x: torch.Tensor, dtype: torch.dtype, power_of_two: bool):
    """fused.quantize_blockwise_pair's two casts of a 2-D x in one C++ call that reads each
    128-row panel of x once (csrc/blockwise_cpu.cpp): (data, scale_inv, data_t, scale_inv_t),
    the scales with their rows contiguous; None off the CPU or without fp8ops._cpu."""
    if not (_on_host(x) and cpu_kernels.loaded()):
        return None
    return tuple(torch.ops.fp8ops_cpu.quantize_blockwise_pair(_f32(x).contiguous(), dtype,
                                                              power_of_two))


def _block_multipliers(amax_b: torch.Tensor, fmt):
    """blockwise_scales without power_of_two, in fewer ops: (the data multiplier, NaN for a
    block holding NaN or inf; scale_inv; whether any block does). amax 0 is replaced by max,
    which gives 1 for both quotients; amax - amax is 0, or NaN for a bad block."""
    fmax = torch.full((), fmt.max, dtype=torch.float32)
    safe = torch.where(amax_b == 0, fmax, amax_b)
    mult = (fmax / safe).clamp_(max=FLT_MAX)  # a subnormal amax overflows the quotient
    scale_inv = safe / fmax
    top = amax_b.max().item() if amax_b.numel() else 0.0
    if math.isfinite(top):
        return mult, scale_inv, False
    bad = ~torch.isfinite(amax_b)  # rare: NaN as the plain formula writes it
    return mult.add_(amax_b - amax_b), torch.where(bad, float("nan"), scale_inv), True


def dequantize_blockwise(data: torch.Tensor, scale_inv: torch.Tensor, block_rows: int,
                         block_cols: int, out_dtype: torch.dtype) -> torch.Tensor:
    d2 = _as_2d(_fp8_to_f32(data, "dequant_in"))
    y = _times_block(d2, scale_inv, block_rows, block_cols)
    return y.to(out_dtype).reshape(data.shape).contiguous()


# ----------------------------------------------------------------------------------------------
# Cast statistics (fp8ops.monitor: fp8ops/monitoring.py says what each one means)
# ----------------------------------------------------------------------------------------------
# the pieces the statistics read x in: a bounded working set (float32 copies and masks, about 20
# bytes per element of a piece) whatever x's size
STATS_PIECE = 1 << 20


def cast_stats(x: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor, block_rows: int,
               block_cols: int):
    """(counts, amax) of a cast data = FP8(x * scale), over x's 2-D view [R, C]: counts (int64
    [3]) of the saturated (cast to the format's max although more than half an ulp of max above
    it: a clamp, not a rounding), the underflowed (non-zero, cast to zero) and the non-finite
    elements of x, and amax = max |x| (NaN if any is NaN; 0 when x is empty). The values are
    read back as the GEMMs read them, raw * scale_inv in float32: scale_inv is one float32
    multiplier (block_rows = block_cols = 0), or one per [block_rows, block_cols] tile of x,
    float32 or E8M0 bytes (uint8). data may be larger than x (padded); the padding is not
    read. Read in pieces of at most STATS_PIECE elements (whole tiles), with no full-size
    temporary; on the CPU one pass of fp8ops._cpu."""
    x2, d2 = _as_2d(x), _as_2d(data)
    R, C = x2.shape
    if d2.shape[0] < R or d2.shape[1] < C:
        raise ValueError(f"fp8ops: cast_stats: data {tuple(data.shape)} is smaller than x "
                         f"{tuple(x.shape)}")
    per_tensor = block_rows == 0 and block_cols == 0
    if not per_tensor and (block_rows < 1 or block_cols < 1):
        raise ValueError(f"fp8ops: cast_stats: block_rows and block_cols must both be 0 (one "
                         f"scale) or positive, got {block_rows} and {block_cols}")
    if _on_host(x2) and cpu_kernels.loaded():  # csrc/stats_cpu.cpp: one pass, no temporaries
        return torch.ops.fp8ops_cpu.cast_stats(x2, d2, scale_inv, block_rows, block_cols)
    fmt = get_format(data.dtype)
    counts = torch.zeros(3, dtype=torch.int64, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    if x2.numel() == 0:
        return counts, amax
    if per_tensor:
        multiplier = scale_inv.float().reshape(())
    else:
        multiplier = e8m0_to_float(scale_inv) if scale_inv.dtype == torch.uint8 else \
            scale_inv.float()
    br, bc = (1, 1) if per_tensor else (block_rows, block_cols)
    cols = min(C, max(bc, STATS_PIECE // bc * bc))  # whole tiles per piece
    rows = max(br, STATS_PIECE // max(cols, 1) // br * br)
    margin = 1 + 2.0 ** -(fmt.mbits + 1)
    for r0 in range(0, R, rows):
        for c0 in range(0, C, cols):
            xs = x2[r0:r0 + rows, c0:c0 + cols].float()
            raw = d2[r0:r0 + xs.shape[0], c0:c0 + xs.shape[1]].float()
            if per_tensor:
                dq = raw * multiplier
            else:
                s = multiplier[r0 // br:-(-(r0 + xs.shape[0]) // br),
                               c0 // bc:-(-(c0 + xs.shape[1]) // bc)]
                dq = _times_block(raw, s.contiguous(), br, bc)
            finite = torch.isfinite(xs)
            saturated = finite & (raw.abs() == fmt.max) & (xs.abs() > dq.abs() * margin)
            underflow = finite & (xs != 0) & (dq == 0)
            counts += torch.stack([saturated.sum(), underflow.sum(), (~finite).sum()])
            amax = torch.maximum(amax, xs.abs().amax())  # (NaN wins, as in amax)
    return counts, amax


# ----------------------------------------------------------------------------------------------
# Delayed-scaling update (docs/numerics.md, "Delayed scaling state machine")
# ----------------------------------------------------------------------------------------------
_ALGOS = ("max", "most_recent", "ema", "percentile")


def scale_from_amax(amax: torch.Tensor, prev_scale: torch.Tensor, fp8_max: float, margin: float,
                    power_of_two: bool) -> torch.Tensor:
    """scale = max / (amax * margin); unchanged for amax 0 or non-finite; inf -> FLT_MAX;
    0 (amax * margin overflowed) -> FLT_MIN; power_of_two rounds down to a power of two."""
    # (callers outside the ops, such as current_scale, may be traced by torch.compile)
    if _on_host(amax) and amax.dim() == 0 and prev_scale.dim() == 0 and \
            not torch.compiler.is_compiling():
        return _scale_from_amax_host(amax, prev_scale, fp8_max, margin, power_of_two)
    amax = amax.float()
    denom = amax * torch.full((), margin, dtype=torch.float32, device=amax.device)
    s = torch.full((), fp8_max, dtype=torch.float32, device=amax.device) / denom
    s = torch.where(torch.isinf(s), FLT_MAX, s)
    s = torch.where(s == 0, FLT_MIN, s)
    if power_of_two:
        m, e2 = torch.frexp(s)
        s = _exp2_f32((e2 - 1).clamp(-149, 127))
    keep = (amax == 0) | ~torch.isfinite(amax)
    return torch.where(keep, prev_scale.float(), s)


def _scale_from_amax_host(amax, prev_scale, fp8_max, margin, power_of_two) -> torch.Tensor:
    """scale_from_amax of one CPU value in Python floats, a dozen tensor ops cheaper. float32
    products are exact in float64 and a float64 quotient rounds to the float32 one (53 >= 2*24+2
    bits), so each float32 operation is one float64 operation and one rounding."""
    s = _scale_value(amax.item(), prev_scale.item(), fp8_max, margin, power_of_two)
    return torch.tensor(s, dtype=torch.float32)


def _scale_value(a: float, prev: float, fp8_max: float, margin: float,
                 power_of_two: bool) -> float:
    if a == 0 or not math.isfinite(a):
        return round_f32(prev)
    s = round_f32(round_f32(fp8_max) / round_f32(a * round_f32(margin)))
    s = FLT_MAX if math.isinf(s) else FLT_MIN if s == 0 else s
    if power_of_two:
        s = 2.0 ** min(max(math.frexp(s)[1] - 1, -149), 127)
    return s


def delayed_scale_update(amax_history: torch.Tensor, scale: torch.Tensor, amax_rep: torch.Tensor,
                         pending_amax: torch.Tensor, step: torch.Tensor, fp8_max: float,
                         margin: float, interval: int, algo: str, ema_alpha: float,
                         percentile: float, power_of_two: bool):
    """One step of the delayed-scaling state machine, with no host sync. (The tensor formulas
    also take a batch of state machines: history [..., L], the other tensors [...].)

    `step` counts calls (the caller increments it first). On steps that are a multiple of
    `interval`: roll the history, put the pending amax in slot 0, reset pending to 0, compute the
    representative amax by `algo` and the new scale. Otherwise everything is returned unchanged.
    Returns (amax_history, scale, scale_inv, amax_rep, pending_amax).
    """
    f32 = torch.float32
    if _on_host(amax_history) and amax_history.dim() == 1 and step.dim() == 0 and \
            amax_history.dtype == scale.dtype == amax_rep.dtype == pending_amax.dtype == f32 and \
            scale.dim() == amax_rep.dim() == pending_amax.dim() == 0 and algo in _ALGOS:
        outs = _delayed_update_host(amax_history.tolist(), scale.item(), amax_rep.item(),
                                    pending_amax.item(), int(step.item()), fp8_max, margin,
                                    interval, algo, ema_alpha, percentile, power_of_two)
        if outs is not None:
            hist, new_scale, scale_inv, rep, pending = outs
            return (torch.tensor(hist, dtype=f32), *(torch.tensor(v, dtype=f32)
                                                     for v in (new_scale, scale_inv, rep, pending)))
    # along the last dim: a history [..., L] with state [...] (a grouped layer's experts, [E])
    L = amax_history.shape[-1]
    do = (step % interval) == 0
    n_updates = step // interval
    hist = torch.roll(amax_history, 1, dims=-1)
    hist = torch.cat([pending_amax.unsqueeze(-1), hist[..., 1:]], dim=-1)
    if algo == "max":
        rep = hist.amax(dim=-1)
    elif algo == "most_recent":
        rep = hist[..., 0]
    elif algo == "ema":
        a = torch.full((), ema_alpha, dtype=torch.float32, device=hist.device)
        b = torch.full((), 1.0 - ema_alpha, dtype=torch.float32, device=hist.device)
        rep = torch.where(n_updates <= 1, hist[..., 0], a * hist[..., 0] + b * amax_rep)
    elif algo == "percentile":  # nearest rank over the filled slots (unfilled slots are 0)
        n = n_updates.clamp(1, L)
        srt = torch.sort(hist, dim=-1).values
        q = torch.full((), percentile / 100.0, dtype=torch.float64, device=hist.device)
        rank = torch.ceil(q * n).long().clamp(1, L)
        rep = srt.gather(-1, (L - n + rank - 1).unsqueeze(-1)).squeeze(-1)
    else:
        raise ValueError(f"unknown amax_compute_algo {algo!r}; expected one of {_ALGOS}")
    new_scale = scale_from_amax(rep, scale, fp8_max, margin, power_of_two)
    hist = torch.where(do.unsqueeze(-1), hist, amax_history)
    rep = torch.where(do, rep, amax_rep)
    new_scale = torch.where(do, new_scale, scale)
    pending = torch.where(do, torch.zeros_like(pending_amax), pending_amax)
    return hist, new_scale, torch.reciprocal(new_scale), rep, pending


def _delayed_update_host(hist, scale, rep_prev, pending, step, fp8_max, margin, interval, algo,
                         ema_alpha, percentile, power_of_two):
    """delayed_scale_update on Python floats (the float32 arithmetic as in _scale_value), two
    dozen tensor ops cheaper on CPU. None for a NaN or a -0 anywhere: Python's max and sort treat
    those differently from torch's."""
    values = hist + [scale, rep_prev, pending]
    if any(v != v or (v == 0 and math.copysign(1.0, v) < 0) for v in values) or scale == 0:
        return None
    if step % interval:
        return hist, scale, round_f32(1.0 / scale), rep_prev, pending
    n_updates, L = step // interval, len(hist)
    hist = [pending] + hist[:-1]
    if algo == "max":
        rep = max(hist)
    elif algo == "most_recent":
        rep = hist[0]
    elif algo == "ema":
        a, b = round_f32(ema_alpha), round_f32(1.0 - ema_alpha)
        rep = hist[0] if n_updates <= 1 else \
            round_f32(round_f32(a * hist[0]) + round_f32(b * rep_prev))
    else:  # percentile: nearest rank over the filled slots, rank in float64 as the tensor code
        n = min(max(n_updates, 1), L)
        rank = min(max(int(math.ceil((percentile / 100.0) * n)), 1), L)
        rep = sorted(hist)[L - n + rank - 1]
    new_scale = _scale_value(rep, scale, fp8_max, margin, power_of_two)
    return hist, new_scale, round_f32(1.0 / new_scale), rep, 0.0


# ----------------------------------------------------------------------------------------------
# GEMMs: exact upcast of FP8 operands, float32 accumulation
# ----------------------------------------------------------------------------------------------
def _epilogue(acc: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype):
    """acc is a temporary: the bias is added in place."""
    if bias is not None:
        acc = acc.add_(_f32(bias))
    return acc if out_dtype == torch.float32 else acc.to(out_dtype)


def gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
         bias: Optional[torch.Tensor], out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    alpha = _f32(a_scale_inv) * _f32(b_scale_inv)
    if _gemm_kernel(a, b, bias) and _dense(a) and _dense(b) and alpha.numel() == 1 and \
            _on_host(alpha):
        # csrc/gemm_cpu.cpp: both operands read in one pass, the same torch.mm, then alpha and
        # the bias in one pass
        acc = torch.ops.fp8ops_cpu.gemm(a, b, alpha, bias, _decode_buffer(a, "gemm_a"),
                                        _decode_buffer(b, "gemm_b"))
        return acc if out_dtype == torch.float32 else acc.to(out_dtype)
    af, bf = _fp8_to_f32(a, "gemm_a"), _fp8_to_f32(b, "gemm_b")
    return _epilogue((af @ bf.t()).mul_(alpha), bias, out_dtype)


def _gemm_kernel(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether a GEMM of a and b takes its fp8ops._cpu kernel (csrc/gemm_cpu.cpp)."""
    return _on_host(a) and cpu_kernels.loaded() and a.dim() == b.dim() == 2 and \
        a.shape[1] == b.shape[1] and (bias is None or tuple(bias.shape) == (b.shape[0],))


# the most bytes of K blocks' partial sums the blockwise GEMM's CPU kernel keeps at once
_PART_BYTES = 8 << 20


def gemm_blockwise(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                   b_scale_inv: torch.Tensor, bias: Optional[torch.Tensor],
                   out_dtype: torch.dtype) -> torch.Tensor:
    """a [M,K] with 1x128 scales [M, Kb]; b [N,K] with 1x128 [N, Kb] or 128x128 [Nb, Kb] scales.
    Each 128-long K block is accumulated in float32, then multiplied by the product of its two
    scales and added (promotion): acc += partial * (a_scale_inv * b_scale_inv).

    The scales are multiplied first (one float32 product), as the CUTLASS sm90 blockwise
    mainloop does (csrc/gemm_sm90.cuh: with 128x128 B scales it multiplies each row's A scale by
    the tile's B scale before promoting; its per-row B path is specialized to do the same).
    Multiplying the partial sum by one scale and then the other overflows float32 where the
    result does not (activations near 1e37 times small weights). The kernel fuses the multiply
    and the add (one FFMA) where this rounds the product first: they agree to float32 rounding,
    as their partial sums do (the tensor cores sum in their own order)."""
    M, K = a.shape
    N = b.shape[0]
    acc = torch.empty(M, N, dtype=torch.float32, device=a.device)
    if _gemm_kernel(a, b, bias) and M * N * K > 0 and _dense(a) and _dense(b):
        # csrc/gemm_cpu.cpp: both operands read in one pass, the same torch.mm calls, a group of
        # K blocks promoted in one pass (the bias with the last); it declines NaN scales and
        # NaN bytes (the code below keeps their payloads)
        n_kb = -(-K // 128)
        group = min(n_kb - 1, max(1, _PART_BYTES // (M * N * 4)))
        part = scratch("gemm_part", (group, M, N), torch.float32, a.device)
        if torch.ops.fp8ops_cpu.gemm_blockwise(
                a, b, _f32(a_scale_inv), _f32(b_scale_inv), bias, acc,
                _decode_buffer(a, "gemm_a"), _decode_buffer(b, "gemm_b"), part):
            return acc if out_dtype == torch.float32 else acc.to(out_dtype)
    sb = b_scale_inv if b_scale_inv.shape[0] == N else b_scale_inv.repeat_interleave(128, 0)[:N]
    af, bf = _fp8_to_f32(a, "gemm_a"), _fp8_to_f32(b, "gemm_b")
    part = scratch("gemm_part", (M, N), torch.float32, a.device)
    scale = scratch("gemm_scale", (M, N), torch.float32, a.device)
    # [M, 1] each; [Kb, N] (contiguous rows broadcast several times faster than strided ones)
    a_cols, b_rows = _f32(a_scale_inv).split(1, 1), _f32(sb).t().contiguous()
    n_kb = -(-K // 128)
    for kb, ak, bk in zip(range(n_kb), af.split(128, 1), bf.split(128, 1)):
        torch.mm(ak, bk.t(), out=acc if kb == 0 else part)
        torch.mul(a_cols[kb], b_rows[kb], out=scale)  # the block's scale per output element
        if kb == 0:  # the sum starts from zeros: 0 + v is v with -0 made +0 (NaN kept)
            acc.mul_(scale).add_(0.0)
        else:
            acc.add_(part.mul_(scale))
    if n_kb == 0:
        acc.zero_()
    return _epilogue(acc, bias, out_dtype)


def gemm_mx(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
            bias: Optional[torch.Tensor], out_dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """a [M,K], b [N,K], both with E8M0 scales along K: dequantize (exact) and accumulate in fp32."""
    if _gemm_kernel(a, b, bias) and a.numel() and b.numel() and a.shape[1] % block_size == 0 \
            and a_scales.dtype == b_scales.dtype == torch.uint8 and \
            tuple(a_scales.shape) == (a.shape[0], a.shape[1] // block_size) and \
            tuple(b_scales.shape) == (b.shape[0], b.shape[1] // block_size):
        # csrc/gemm_cpu.cpp: both operands dequantized in one pass, the same torch.mm, the bias
        # in one pass; it declines NaN bytes (the code below keeps their payloads)
        acc = torch.empty(a.shape[0], b.shape[0], dtype=torch.float32)
        if torch.ops.fp8ops_cpu.gemm_mx(a, a_scales, b, b_scales, block_size, bias, acc,
                                        scratch_like("gemm_a", a, torch.float32),
                                        scratch_like("gemm_b", b, torch.float32)):
            return acc if out_dtype == torch.float32 else acc.to(out_dtype)
    ad = _dequantize_mx_f32(a, a_scales, block_size, -1, "gemm_a")
    bd = _dequantize_mx_f32(b, b_scales, block_size, -1, "gemm_b")
    return _epilogue(ad @ bd.t(), bias, out_dtype)


def amax_percentile(x: torch.Tensor, percentile: float) -> torch.Tensor:
    """The outlier-robust amax: the value of nearest rank ceil(percentile / 100 * n) among the
    n values |x| in ascending order (percentile 100 is the max), as float32. NaN if x holds a
    NaN (the scale then stays, as for a NaN amax), 0 for an empty or all-zero x. When that rank
    holds 0 but x does not (mostly zeros), max |x| instead: amax 0 would keep scale 1, which
    flushes small values to zero. A selection, not an interpolation: the
    result is one of the |x|, identical on every device."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    a = x.float().abs().flatten()
    n = a.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # ceil(p / 100 * n) in float64, rounded to 1e-9 first so that a decimal percentile lands on
    # its exact rank (99.99 / 100 * 10000 is 9999.000000000002 in float64)
    k = min(max(math.ceil(round(percentile / 100.0 * n, 9)), 1), n)
    clean = torch.nan_to_num(a, nan=0.0)
    value = torch.kthvalue(clean, k).values
    if not _on_host(value) or value.item() == 0:  # (off the host: no sync, always the where)
        value = torch.where(value > 0, value, clean.amax())
    return torch.where(torch.isnan(a).any(), torch.full_like(value, float("nan")), value)
