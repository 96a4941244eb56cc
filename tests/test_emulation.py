"""The emulation backend against independent references: ml_dtypes for casts, plain-Python
Philox and stochastic rounding, per-block Python for MXFP8 and blockwise scaling."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ops
from fp8ops.ops import emulation as E
from fp8ops.formats import E4M3, E5M2

ML = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
FMTS = [E4M3, E5M2]


def ref_cast_bytes(y: np.ndarray, fmt) -> np.ndarray:
    """float32 -> FP8 bytes by ml_dtypes after the clamp; NaN as 0x7F."""
    y = np.clip(y.astype(np.float32), -fmt.max, fmt.max)
    with np.errstate(invalid="ignore"):
        b = y.astype(ML[fmt]).view(np.uint8).copy()
    b[np.isnan(y)] = 0x7F
    return b


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).cpu().numpy()


def all_bf16() -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def wide_fp32(n=200_000) -> torch.Tensor:
    bits = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32)


def fp8_ties(fmt) -> torch.Tensor:
    """Every midpoint between neighbouring finite FP8 values (exact in float32), both signs,
    plus the values around the saturation point."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float()
    pos = torch.sort(vals[torch.isfinite(vals) & (vals >= 0)]).values.unique()
    mids = (pos[:-1] + pos[1:]) / 2
    top = torch.tensor([fmt.max, fmt.max * 1.03, fmt.max * 1.07, fmt.max * 2, 3e38])
    out = torch.cat([mids, top, pos])
    return torch.cat([out, -out])


SPECIALS = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45,
                         1.17e-38, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -16, 2.0 ** -17,
                         448.0, 464.0, 480.0, 57344.0, 61440.0, 3.4e38, -3.4e38])


# ----------------------------------------------------------------------------------------------
# round to nearest
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scale", [1.0, 3.0, 2.0 ** -10, 1000.0, 0.37])
def test_nearest_all_bf16_patterns(fmt, scale):
    x = all_bf16()
    data, data_t, amax = E.quantize(x, torch.tensor(scale), fmt.dtype)
    y = x.float().numpy() * np.float32(scale)  # one float32 multiply
    assert np.array_equal(bytes_of(data), ref_cast_bytes(y, fmt))
    assert data_t.numel() == 0
    assert math.isnan(amax.item())  # the patterns include NaN


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nearest_wide_fp32_specials_and_ties(fmt, dtype):
    x = torch.cat([wide_fp32(), SPECIALS, fp8_ties(fmt), fp8_ties(fmt) * 2.0 ** -20]).to(dtype)
    for scale in (1.0, 2.0 ** 20, 0.75):
        data, _, _ = E.quantize(x, torch.tensor(scale), fmt.dtype)
        y = x.float().numpy() * np.float32(scale)
        assert np.array_equal(bytes_of(data), ref_cast_bytes(y, fmt))


def test_nearest_key_cases_by_hand():
    x = torch.tensor([float("inf"), float("-inf"), 1e9, -0.0, float("nan"), 2.0 ** -10, 3 * 2.0 ** -10])
    data, _, _ = E.quantize(x, torch.tensor(1.0), torch.float8_e4m3fn)
    b = bytes_of(data).tolist()
    assert b[0] == 0x7E and b[1] == 0xFE and b[2] == 0x7E  # +-inf and overflow saturate to +-448
    assert b[3] == 0x80  # -0 kept
    assert b[4] == 0x7F  # canonical NaN
    assert b[5] == 0x00  # 2^-10 is a tie between 0 and 2^-9: even is 0
    assert b[6] == 0x02  # 3*2^-10 = 1.5 * 2^-9 ties to the even 2 * 2^-9


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8])
@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (130, 3), (0, 4), (64, 64)])
def test_transpose_fp8_moves_the_bytes(dtype, shape):
    raw = np.random.default_rng(3).integers(0, 256, shape, dtype=np.uint8)
    got = E.transpose_fp8(torch.from_numpy(raw).view(dtype))
    assert got.dtype == dtype and got.is_contiguous()
    np.testing.assert_array_equal(got.view(torch.uint8).numpy(), raw.T)


def test_transpose_fp8_rejects_what_it_cannot_transpose():
    with pytest.raises(ValueError, match="2-D"):
        E.transpose_fp8(torch.zeros(2, 3, 4).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="bfloat16"):
        E.transpose_fp8(torch.zeros(4, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_is_one_float32_multiply(fmt):
    x = torch.randn(1000) * 50
    data, _, _ = E.quantize(x, torch.tensor(2.5), fmt.dtype)
    for out in (torch.float32, torch.bfloat16, torch.float16):
        got = E.dequantize(data, torch.tensor(0.4), out)
        ref = torch.from_numpy(data.view(torch.uint8).numpy().view(ML[fmt]).astype(np.float32)
                               * np.float32(0.4)).to(out)
        assert torch.equal(got, ref)


def test_transpose_copy_is_the_2d_transpose():
    x = torch.randn(3, 5, 7)
    data, data_t, amax = E.quantize(x, torch.tensor(10.0), torch.float8_e4m3fn, True)
    assert data_t.shape == (7, 15) and data_t.is_contiguous()
    assert np.array_equal(bytes_of(data_t), bytes_of(data.reshape(15, 7).t().contiguous()))
    assert amax.item() == x.abs().max().item()


def test_amax_nan_inf_empty():
    assert E.amax(torch.tensor([1.0, -5.0, 2.0])).item() == 5.0
    assert math.isnan(E.amax(torch.tensor([1.0, float("nan"), float("inf")])).item())
    assert E.amax(torch.tensor([1.0, float("-inf")])).item() == float("inf")
    z = E.amax(torch.empty(0, 4))
    assert z.item() == 0.0 and z.dtype == torch.float32 and z.dim() == 0
    assert E.amax(torch.tensor([-3.0], dtype=torch.bfloat16)).dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# Philox and stochastic rounding
# ----------------------------------------------------------------------------------------------
def philox_py(counter, key):
    """Philox4x32-10 in plain Python integers (independent of the torch implementation)."""
    c, (k0, k1), m = list(counter), key, 0xFFFFFFFF
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & m, p1 & m, ((p0 >> 32) ^ c[3] ^ k1) & m, p0 & m]
    return c


KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    assert tuple(philox_py(counter, key)) == expected
    got = E.philox4x32_10(tuple(torch.tensor([c]) for c in counter), key)
    assert tuple(int(w) for w in got) == expected


def test_random_words_counter_layout():
    seed, offset = 0x123456789ABCDEF0, 0xFEDCBA9876543210 - 2**64  # offset as a signed int64
    words = E.random_words(10, seed, offset, "cpu").tolist()
    off = offset & (2**64 - 1)
    for i in range(10):
        j = i // 4
        ref = philox_py((j, 0, off & 0xFFFFFFFF, off >> 32), (seed & 0xFFFFFFFF, seed >> 32))
        assert words[i] == ref[i % 4]


def sr_ref(y: float, r: int, fmt) -> float:
    """docs/design.md, "Stochastic rounding", for one float32 value y (scaled and clamped)."""
    if y != y or y == 0:
        return y
    a = abs(y)
    ulp = 2.0 ** (max(math.frexp(a)[1] - 1, fmt.emin) - fmt.mbits)
    k = a / ulp
    fk = math.floor(k)
    up = 1 if k - fk > (r >> 8) * 2.0 ** -24 else 0
    return math.copysign(min((fk + up) * ulp, fmt.max), y)


@pytest.mark.parametrize("fmt", FMTS)
def test_stochastic_rounding_matches_python_reference(fmt):
    x = torch.cat([torch.randn(3000) * 4, torch.randn(500) * 2.0 ** -8, SPECIALS,
                   fp8_ties(fmt)[:200]])
    scale, seed, offset = 1.5, 99, 7
    data, _, _ = E.quantize(x, torch.tensor(scale), fmt.dtype, False, True, seed, offset)
    y = np.clip(x.numpy() * np.float32(scale), -fmt.max, fmt.max)
    ref = []
    for i, v in enumerate(y.tolist()):
        r = philox_py((i // 4, 0, offset, 0), (seed, 0))[i % 4]
        ref.append(sr_ref(v, r, fmt))
    assert np.array_equal(bytes_of(data), ref_cast_bytes(np.array(ref, dtype=np.float32), fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_stochastic_rounding_is_unbiased_and_brackets(fmt):
    v = 1.0 + 2.0 ** -(fmt.mbits + 2)  # a quarter of the way from 1 to the next FP8 value
    x = torch.full((20000,), v)
    q = E.quantize(x, torch.tensor(1.0), fmt.dtype, False, True, 5, 0)[0].float()
    hi = 1.0 + 2.0 ** -fmt.mbits
    assert set(q.unique().tolist()) == {1.0, hi}
    assert abs(q.mean().item() - v) < 4 * (hi - 1.0) * math.sqrt(0.25 * 0.75 / x.numel())


def test_stochastic_rounding_reproducible_and_offset_sensitive():
    x = torch.randn(4096)
    s = torch.tensor(20.0)
    a = E.quantize(x, s, torch.float8_e4m3fn, False, True, 1, 0)[0]
    b = E.quantize(x, s, torch.float8_e4m3fn, False, True, 1, 0)[0]
    c = E.quantize(x, s, torch.float8_e4m3fn, False, True, 1, 1)[0]
    d = E.quantize(x, s, torch.float8_e4m3fn, False, True, 2, 0)[0]
    assert np.array_equal(bytes_of(a), bytes_of(b))
    assert not np.array_equal(bytes_of(a), bytes_of(c))
    assert not np.array_equal(bytes_of(a), bytes_of(d))


# ----------------------------------------------------------------------------------------------
# MXFP8
# ----------------------------------------------------------------------------------------------
def mx_ref(block: np.ndarray, fmt, rceil: bool):
    """(data bytes, scale byte) of one 32-element block by the OCP MX rules, in Python."""
    vals = [float(v) for v in block]
    if any(math.isnan(v) or math.isinf(v) for v in vals):
        return np.full(len(vals), 0x7F, np.uint8), 0xFF
    amax = max(abs(v) for v in vals)
    if amax == 0:
        e = -127
    elif rceil:
        e = math.frexp(amax)[1] - 1 - fmt.emax - 1
        while amax / 2.0 ** e > fmt.max:  # smallest e with amax / 2^e <= max
            e += 1
    else:
        e = math.frexp(amax)[1] - 1 - fmt.emax
    e = max(-127, min(127, e))
    y = block.astype(np.float32) * np.float32(2.0 ** -e)
    return ref_cast_bytes(y, fmt), e + 127


def mx_blocks(rng) -> np.ndarray:
    """Blocks of 32 that exercise the rules: random magnitudes, zeros, NaN, inf, values whose
    mantissa exceeds 1.75 (FLOOR saturates them), exact powers of two, subnormal float32."""
    blocks = [rng.standard_normal(32) * 10.0 ** rng.integers(-30, 30) for _ in range(60)]
    blocks += [np.zeros(32), -np.zeros(32), np.full(32, 1.9), np.full(32, 1.75) * 2.0 ** 10,
               np.full(32, 2.0 ** 8), np.full(32, 1e-40), np.full(32, 3.3e38)]
    for special in (np.nan, np.inf, -np.inf):
        b = rng.standard_normal(32)
        b[rng.integers(32)] = special
        blocks.append(b)
    b = rng.standard_normal(32)
    b[3] = 1.99 * 2.0 ** 20  # FLOOR: scaled value 1.99 * 2^emax > max -> saturates
    blocks.append(b)
    return np.stack(blocks).astype(np.float32)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rceil", [False, True])
def test_mx_matches_ocp_rules(fmt, rceil):
    blocks = mx_blocks(np.random.default_rng(0))
    x = torch.from_numpy(blocks[:68].reshape(17, 4 * 32))  # 4 blocks per row
    data, scales = E.quantize_mx(x, fmt.dtype, 32, -1, rceil)
    assert data.shape == x.shape and scales.shape == (17, 4)
    tail_data, tail_scales = E.quantize_mx(torch.from_numpy(blocks[68:]), fmt.dtype, 32, -1, rceil)
    got = [(bytes_of(data[r, c * 32:(c + 1) * 32]), scales[r, c].item())
           for r in range(17) for c in range(4)]
    got += [(bytes_of(tail_data[i]), tail_scales[i, 0].item()) for i in range(len(blocks) - 68)]
    for bi, (blk, (d, sc)) in enumerate(zip(blocks, got)):
        ref_data, ref_scale = mx_ref(blk, fmt, rceil)
        assert sc == ref_scale, (bi, blk)
        assert np.array_equal(d, ref_data), bi


def test_mx_floor_saturates_where_rceil_does_not():
    x = torch.full((1, 32), 1.9)  # mantissa 1.9 > 1.75: FLOOR puts 1.9 * 2^8 = 486 > 448
    d_floor, s_floor = E.quantize_mx(x, torch.float8_e4m3fn, 32, -1, False)
    d_rceil, s_rceil = E.quantize_mx(x, torch.float8_e4m3fn, 32, -1, True)
    assert s_floor.item() == 127 - 8 and d_floor.float().max().item() == 448.0
    assert s_rceil.item() == 127 - 7 and d_rceil.float()[0, 0].item() == 240.0  # 1.9*128 -> 240


def test_mx_axis0_is_axis_last_of_the_transpose():
    x = torch.randn(64, 40) * 100
    d0, s0 = E.quantize_mx(x, torch.float8_e4m3fn, 32, 0, False)
    dt, st = E.quantize_mx(x.t().contiguous(), torch.float8_e4m3fn, 32, -1, False)
    assert np.array_equal(bytes_of(d0), bytes_of(dt.t()))
    assert torch.equal(s0, st.t()) and s0.shape == (2, 40)


@pytest.mark.parametrize("fmt", FMTS)
def test_mx_dequantize_is_exact(fmt):
    x = torch.randn(8, 64) * 1e-3
    d, s = E.quantize_mx(x, fmt.dtype, 32, -1, False)
    deq = E.dequantize_mx(d, s, 32, -1, torch.float32)
    vals = d.view(torch.uint8).numpy().view(ML[fmt]).astype(np.float64)
    scale = 2.0 ** (s.numpy().astype(np.float64) - 127)
    ref = vals.reshape(8, 2, 32) * scale[:, :, None]
    assert np.array_equal(deq.numpy().astype(np.float64), ref.reshape(8, 64))


def test_mx_nan_block_dequantizes_to_nan():
    x = torch.randn(1, 64)
    x[0, 40] = float("inf")
    d, s = E.quantize_mx(x, torch.float8_e4m3fn, 32, -1, False)
    deq = E.dequantize_mx(d, s, 32, -1, torch.float32)
    assert s[0, 1].item() == 0xFF and torch.isnan(deq[0, 32:]).all() and torch.isfinite(deq[0, :32]).all()


# ----------------------------------------------------------------------------------------------
# blockwise
# ----------------------------------------------------------------------------------------------
def blockwise_ref(x: np.ndarray, fmt, br, bc, p2):
    R, C = x.shape
    data = np.zeros((R, C), np.uint8)
    sinv = np.zeros((-(-R // br), -(-C // bc)), np.float32)
    for i in range(sinv.shape[0]):
        for j in range(sinv.shape[1]):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc].astype(np.float32)
            amax = np.float32(np.max(np.abs(blk)))
            if not np.isfinite(amax):
                s, si, blk = np.float32(1), np.float32(np.nan), np.full_like(blk, np.nan)
            elif amax == 0:
                s, si = np.float32(1), np.float32(1)
            else:
                with np.errstate(over="ignore"):
                    if p2:
                        raw = float(amax / np.float32(fmt.max))
                        m, e = math.frexp(raw)
                        si = np.float32(2.0 ** (e - 1 if m == 0.5 else e))
                        s = np.float32(1.0 / float(si))
                    else:
                        s, si = np.float32(fmt.max) / amax, amax / np.float32(fmt.max)
                s = min(s, np.float32(np.finfo(np.float32).max))  # tiny amax: quotient overflows
            data[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = ref_cast_bytes(blk * s, fmt)
            sinv[i, j] = si
    return data, sinv


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (4, 32)])
@pytest.mark.parametrize("p2", [False, True])
def test_blockwise_matches_reference(fmt, block, p2):
    x = (torch.randn(130, 300) * torch.logspace(-3, 3, 300)).numpy()  # partial last blocks
    x[0, :128] = 0.0  # an all-zero 1x128 block
    x[1, :128] = 0.0
    x[1, 5], x[1, 6] = 1e-37, -5e-38  # amax < max / FLT_MAX: scale clamps, zeros stay zero
    x[129, 299] = np.inf
    data, sinv = E.quantize_blockwise(torch.from_numpy(x), fmt.dtype, *block, p2)
    ref_data, ref_sinv = blockwise_ref(x, fmt, *block, p2)
    assert np.array_equal(bytes_of(data), ref_data)
    assert np.array_equal(sinv.numpy(), ref_sinv, equal_nan=True)


def test_blockwise_tiny_block_keeps_zeros_and_order():
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 1e-37, 5e-38
    data, _ = E.quantize_blockwise(x, torch.float8_e4m3fn, 1, 128, False)
    d = data.float()
    assert not torch.isnan(d).any() and (d[0, 2:] == 0).all() and d[0, 0] > d[0, 1] > 0


def test_blockwise_roundtrip_error_is_fp8_sized():
    x = torch.randn(256, 512, dtype=torch.float64).float()
    data, sinv = E.quantize_blockwise(x, torch.float8_e4m3fn, 128, 128, False)
    back = E.dequantize_blockwise(data, sinv, 128, 128, torch.float32)
    rel = ((back - x).norm() / x.norm()).item()
    assert 0.005 < rel < 0.04  # 3 mantissa bits: about 2^-4 / sqrt(3) relative, not exact


# ----------------------------------------------------------------------------------------------
# GEMMs
# ----------------------------------------------------------------------------------------------
def test_gemm_is_exact_products_with_float32_accumulation():
    a = E.quantize(torch.randn(33, 70), torch.tensor(30.0), torch.float8_e4m3fn)[0]
    b = E.quantize(torch.randn(21, 70), torch.tensor(2.0), torch.float8_e5m2)[0]
    bias = torch.randn(21)
    out = E.gemm(a, b, torch.tensor(1 / 30.0), torch.tensor(0.5), bias, torch.float32)
    ref = (a.double() @ b.double().t()) * (np.float32(1 / 30.0) * np.float32(0.5)) + bias.double()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_gemm_blockwise_per_block_promotion():
    x, w = torch.randn(5, 300), torch.randn(7, 300)
    xd, xs = E.quantize_blockwise(x, torch.float8_e4m3fn, 1, 128, False)
    for br in (1, 128):
        wd, ws = E.quantize_blockwise(w, torch.float8_e4m3fn, br, 128, False)
        out = E.gemm_blockwise(xd, wd, xs, ws, None, torch.float32)
        ref = (E.dequantize_blockwise(xd, xs, 1, 128, torch.float64)
               @ E.dequantize_blockwise(wd, ws, br, 128, torch.float64).t())
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("br", [1, 128], ids=["b1x128", "b128x128"])
def test_gemm_blockwise_multiplies_the_scales_first(br):
    """Activations near 1e37 times small weights: a K block's partial sum times its activation
    scale alone overflows float32, while the result is near 1e34. Each block's two scales are
    multiplied first (as the CUTLASS kernel does), so the result is finite and accurate."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 300, generator=gen) * 1e37
    w = torch.randn(8, 300, generator=gen) * 1e-3
    xq = fp8ops.quantize_blockwise(x, block=(1, 128))
    wq = fp8ops.quantize_blockwise(w, block=(br, 128))
    out = fp8ops.gemm(xq, wq, out_dtype=torch.float32)
    ref = xq.dequantize().double() @ wq.dequantize().double().t()
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=0)
    # the promotion, step by step: acc += partial * (a_scale_inv * b_scale_inv), from zeros
    sb = wq.scale_inv if br == 1 else wq.scale_inv.repeat_interleave(128, 0)[:8]
    acc = torch.zeros(4, 8)
    for kb in range(3):
        cols = slice(128 * kb, 128 * (kb + 1))
        part = xq.data[:, cols].float() @ wq.data[:, cols].float().t()
        acc = acc + part * (xq.scale_inv[:, kb:kb + 1] * sb[:, kb])
    assert torch.equal(out, acc)
