"""A frozen copy of fp8ops/ops/emulation.py before its fast paths: the plain reference that
tests/test_emulation_fast.py compares the current emulation against, byte for byte. Never edit it
for speed; it follows only changes of the numerics themselves (since then: the blockwise GEMM's
promotion multiplies its two scales before the partial sum).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from fp8ops.formats import E8M0_BIAS, E8M0_NAN, NAN_BYTE, get_format

_MASK32 = 0xFFFFFFFF
FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN = torch.finfo(torch.float32).tiny


# ----------------------------------------------------------------------------------------------
# small exact helpers
# ----------------------------------------------------------------------------------------------
def _rne_fp8(y: torch.Tensor, fmt) -> torch.Tensor:
    """float32 -> FP8, saturating round to nearest even; NaN becomes the canonical 0x7F byte."""
    y = y.clamp(-fmt.max, fmt.max)  # NaN passes through clamp
    q = y.to(fmt.dtype)
    return torch.where(torch.isnan(y), torch.full_like(q.view(torch.uint8), NAN_BYTE),
                       q.view(torch.uint8)).view(fmt.dtype)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for finite a > 0 (int32), exact for subnormals too."""
    _, e = torch.frexp(a)  # a = m * 2^e with m in [0.5, 1)
    return e - 1


def _exp2_f32(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-149, 127], built from bits (exact)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    sub = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, sub)


def _abs_max(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| as float32; NaN wins over everything, empty gives 0."""
    a = x.float().abs()
    if dim is None:
        if a.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        return a.amax()
    return a.amax(dim=dim)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """[rows, last dim] view (rows = product of the leading dims; 0-d counts as [1, 1])."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


# ----------------------------------------------------------------------------------------------
# Philox4x32-10 (docs/design.md, "Stochastic rounding"), in int64 arithmetic: any device
# ----------------------------------------------------------------------------------------------
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def _mulhilo32(a, m: int):
    """(hi, lo) 32-bit halves of a * m without int64 overflow (a < 2^32 split into 16-bit halves)."""
    p_lo = (a & 0xFFFF) * m  # < 2^48
    p_hi = (a >> 16) * m  # < 2^48
    mid = ((p_hi & 0xFFFF) << 16) + p_lo  # < 2^49
    return ((p_hi >> 16) + (mid >> 32)) & _MASK32, mid & _MASK32


def philox4x32_10(counter, key):
    """Philox4x32-10. counter: 4 int64 tensors or ints (< 2^32); key: 2 ints. Returns 4 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo32(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo32(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_words(n: int, seed: int, offset: int, device) -> torch.Tensor:
    """The 32-bit random word (as int64) of each flat element 0..n-1."""
    j = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)
    counter = (j & _MASK32, j >> 32, offset & _MASK32, (offset >> 32) & _MASK32)
    words = philox4x32_10(counter, (seed & _MASK32, (seed >> 32) & _MASK32))
    words = [w if torch.is_tensor(w) else torch.full_like(j, w) for w in words]
    return torch.stack(words, dim=1).reshape(-1)[:n]


def _stochastic_fp8(y: torch.Tensor, fmt, seed: int, offset: int) -> torch.Tensor:
    """Stochastic rounding of float32 y (already scaled) to FP8 (docs/design.md, "Stochastic
    rounding")."""
    y = y.clamp(-fmt.max, fmt.max)
    r = random_words(y.numel(), seed, offset, y.device).reshape(y.shape)
    u = (r >> 8).to(torch.float32) * 2.0 ** -24
    a = y.abs()
    nonzero = a > 0
    e = torch.where(nonzero, _floor_log2(torch.where(nonzero, a, 1.0)), 0)
    ulp = _exp2_f32(torch.clamp(e, min=fmt.emin) - fmt.mbits)
    k = a / ulp  # exact: ulp is a power of two and k stays small
    fk = torch.floor(k)
    up = (k - fk) > u
    fmax = torch.full((), fmt.max, dtype=torch.float32, device=y.device)
    mag = torch.minimum((fk + up.to(torch.float32)) * ulp, fmax)
    res = torch.where(nonzero, torch.copysign(mag, y), y)  # keeps signed zero and NaN
    return _rne_fp8(res, fmt)  # exact: res is already an FP8 value (or NaN)


# ----------------------------------------------------------------------------------------------
# per-tensor ops
# ----------------------------------------------------------------------------------------------
def amax(x: torch.Tensor) -> torch.Tensor:
    return _abs_max(x)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool = False,
             stochastic: bool = False, seed: int = 0, offset: int = 0):
    fmt = get_format(dtype)
    y = x.float() * scale.float().reshape(())  # a [1] scale must not broadcast a 0-d x
    data = _stochastic_fp8(y, fmt, seed, offset) if stochastic else _rne_fp8(y, fmt)
    data = data.contiguous()
    if transpose:
        data_t = _as_2d(data).t().clone(memory_format=torch.contiguous_format)
    else:
        data_t = data.new_empty((0,))
    return data, data_t, _abs_max(x)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale_inv.float().reshape(())).to(out_dtype).contiguous()


# ----------------------------------------------------------------------------------------------
# MXFP8 (docs/design.md, "MXFP8")
# ----------------------------------------------------------------------------------------------
def _blocks_last(x: torch.Tensor, block_size: int, axis: int) -> torch.Tensor:
    """Move axis last and split it into (n_blocks, block_size)."""
    xt = x.movedim(axis, -1)
    return xt.reshape(*xt.shape[:-1], xt.shape[-1] // block_size, block_size)


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
    xb = _blocks_last(x.float(), block_size, axis)
    amax_b = _abs_max(xb, dim=-1)
    bad = ~torch.isfinite(amax_b)
    e = mx_exponent(amax_b, fmt, rceil)
    y = xb * _exp2_f32(-e).unsqueeze(-1)
    y = torch.where(bad.unsqueeze(-1), torch.full_like(y, float("nan")), y)
    data = _rne_fp8(y, fmt).reshape(*xb.shape[:-2], xb.shape[-2] * block_size).movedim(-1, axis)
    scales = torch.where(bad, E8M0_NAN, e + E8M0_BIAS).to(torch.uint8).movedim(-1, axis)
    return data.contiguous(), scales.contiguous()


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    s = _exp2_f32(scales.to(torch.int32) - E8M0_BIAS)
    return torch.where(scales == E8M0_NAN, float("nan"), s)


def dequantize_mx(data: torch.Tensor, scales: torch.Tensor, block_size: int, axis: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    axis = axis % data.dim()
    xb = _blocks_last(data.float(), block_size, axis)
    s = e8m0_to_float(scales).movedim(axis, -1).unsqueeze(-1)
    flat = (xb * s).reshape(*xb.shape[:-2], xb.shape[-2] * block_size)
    return flat.movedim(-1, axis).to(out_dtype).contiguous()


# ----------------------------------------------------------------------------------------------
# Blockwise (DeepSeek-V3 style, docs/design.md, "Blockwise")
# ----------------------------------------------------------------------------------------------
def _tiles(x2: torch.Tensor, br: int, bc: int, fill: float) -> torch.Tensor:
    """[R, C] -> [Rb, br, Cb, bc], padding the last partial blocks with `fill`."""
    R, C = x2.shape
    Rb, Cb = -(-R // br), -(-C // bc)
    padded = torch.nn.functional.pad(x2, (0, Cb * bc - C, 0, Rb * br - R), value=fill)
    return padded.reshape(Rb, br, Cb, bc)


def _expand_tiles(s: torch.Tensor, br: int, bc: int, R: int, C: int) -> torch.Tensor:
    return s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :C]


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
    x2 = _as_2d(x.float())
    R, C = x2.shape
    amax_b = _abs_max(_tiles(x2, block_rows, block_cols, 0.0), dim=(1, 3))
    scale, scale_inv = blockwise_scales(amax_b, fmt, power_of_two)
    y = x2 * _expand_tiles(scale, block_rows, block_cols, R, C)
    bad = _expand_tiles(~torch.isfinite(amax_b), block_rows, block_cols, R, C)
    y = torch.where(bad, float("nan"), y)
    return _rne_fp8(y, fmt).reshape(x.shape).contiguous(), scale_inv


def dequantize_blockwise(data: torch.Tensor, scale_inv: torch.Tensor, block_rows: int,
                         block_cols: int, out_dtype: torch.dtype) -> torch.Tensor:
    d2 = _as_2d(data.float())
    s = _expand_tiles(scale_inv, block_rows, block_cols, *d2.shape)
    return (d2 * s).to(out_dtype).reshape(data.shape).contiguous()


# ----------------------------------------------------------------------------------------------
# Delayed-scaling update (docs/numerics.md, "Delayed scaling state machine")
# ----------------------------------------------------------------------------------------------
_ALGOS = ("max", "most_recent", "ema", "percentile")


def scale_from_amax(amax: torch.Tensor, prev_scale: torch.Tensor, fp8_max: float, margin: float,
                    power_of_two: bool) -> torch.Tensor:
    """scale = max / (amax * margin); unchanged for amax 0 or non-finite; inf -> FLT_MAX;
    0 (amax * margin overflowed) -> FLT_MIN; power_of_two rounds down to a power of two."""
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


def delayed_scale_update(amax_history: torch.Tensor, scale: torch.Tensor, amax_rep: torch.Tensor,
                         pending_amax: torch.Tensor, step: torch.Tensor, fp8_max: float,
                         margin: float, interval: int, algo: str, ema_alpha: float,
                         percentile: float, power_of_two: bool):
    """One step of the delayed-scaling state machine, with no host sync.

    `step` counts calls (the caller increments it first). On steps that are a multiple of
    `interval`: roll the history, put the pending amax in slot 0, reset pending to 0, compute the
    representative amax by `algo` and the new scale. Otherwise everything is returned unchanged.
    Returns (amax_history, scale, scale_inv, amax_rep, pending_amax).
    """
    L = amax_history.numel()
    do = (step % interval) == 0
    n_updates = step // interval
    hist = torch.roll(amax_history, 1)
    hist = torch.cat([pending_amax.reshape(1), hist[1:]])
    if algo == "max":
        rep = hist.amax()
    elif algo == "most_recent":
        rep = hist[0]
    elif algo == "ema":
        a = torch.full((), ema_alpha, dtype=torch.float32, device=hist.device)
        b = torch.full((), 1.0 - ema_alpha, dtype=torch.float32, device=hist.device)
        rep = torch.where(n_updates <= 1, hist[0], a * hist[0] + b * amax_rep)
    elif algo == "percentile":  # nearest rank over the filled slots (unfilled slots are 0)
        n = n_updates.clamp(1, L)
        srt = torch.sort(hist).values
        q = torch.full((), percentile / 100.0, dtype=torch.float64, device=hist.device)
        rank = torch.ceil(q * n).long().clamp(1, L)
        rep = srt.gather(0, (L - n + rank - 1).reshape(1)).reshape(())
    else:
        raise ValueError(f"unknown amax_compute_algo {algo!r}; expected one of {_ALGOS}")
    new_scale = scale_from_amax(rep, scale, fp8_max, margin, power_of_two)
    hist = torch.where(do, hist, amax_history)
    rep = torch.where(do, rep, amax_rep)
    new_scale = torch.where(do, new_scale, scale)
    pending = torch.where(do, torch.zeros_like(pending_amax), pending_amax)
    return hist, new_scale, torch.reciprocal(new_scale), rep, pending


# ----------------------------------------------------------------------------------------------
# GEMMs: exact upcast of FP8 operands, float32 accumulation
# ----------------------------------------------------------------------------------------------
def _epilogue(acc: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype):
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
         bias: Optional[torch.Tensor], out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    alpha = a_scale_inv.float() * b_scale_inv.float()
    return _epilogue((a.float() @ b.float().t()) * alpha, bias, out_dtype)


def gemm_blockwise(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                   b_scale_inv: torch.Tensor, bias: Optional[torch.Tensor],
                   out_dtype: torch.dtype) -> torch.Tensor:
    """a [M,K] with 1x128 scales [M, Kb]; b [N,K] with 1x128 [N, Kb] or 128x128 [Nb, Kb] scales.
    Each 128-long K block is accumulated in float32, then scaled and added (promotion)."""
    M, K = a.shape
    N = b.shape[0]
    sb = b_scale_inv if b_scale_inv.shape[0] == N else b_scale_inv.repeat_interleave(128, 0)[:N]
    acc = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    af, bf = a.float(), b.float()
    for kb in range(-(-K // 128)):
        part = af[:, kb * 128:(kb + 1) * 128] @ bf[:, kb * 128:(kb + 1) * 128].t()
        acc = acc + part * (a_scale_inv[:, kb:kb + 1].float() * sb[:, kb].float().unsqueeze(0))
    return _epilogue(acc, bias, out_dtype)


def gemm_mx(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
            bias: Optional[torch.Tensor], out_dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """a [M,K], b [N,K], both with E8M0 scales along K: dequantize (exact) and accumulate in fp32."""
    ad = dequantize_mx(a, a_scales, block_size, -1, torch.float32)
    bd = dequantize_mx(b, b_scales, block_size, -1, torch.float32)
    return _epilogue(ad @ bd.t(), bias, out_dtype)
