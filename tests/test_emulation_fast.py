"""The emulation's fast paths against the frozen plain formulation (tests/reference_emulation.py):
every op, byte for byte (float outputs bit for bit, NaN payloads included), on random data, every
special value, ties, subnormals, odd shapes, strided inputs and the chunk edges of Philox."""
import pytest
import torch

import reference_emulation as R
from fp8ops.ops import emulation as E
from fp8ops.ops import philox
from fp8ops.formats import E4M3, E5M2

FMTS = [E4M3, E5M2]
F8 = [torch.float8_e4m3fn, torch.float8_e5m2]
NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000]


@pytest.fixture(autouse=True, params=["cpu paths", "device paths"])
def _paths(request, monkeypatch):
    """Every test twice: as on the CPU, and through the branches other devices take (no host
    reads), which must agree with the reference too."""
    if request.param == "device paths":
        monkeypatch.setattr(E, "_on_host", lambda t: False)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t as integers, so that NaN compares by its bits."""
    t = t.contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
    # the same layout (the stride of a size-1 dim is moot)
    assert [st for st, n in zip(a.stride(), a.shape) if n > 1] == \
        [st for st, n in zip(b.stride(), b.shape) if n > 1]
    assert torch.equal(bits(a), bits(b))


def specials() -> torch.Tensor:
    """Specials, NaN payloads of both signs, float32 subnormals, every FP8 value, their midpoints
    (ties) and the values around both saturation points."""
    nan = torch.tensor([v - 2**32 if v >= 2**31 else v for v in NAN_BITS],
                       dtype=torch.int64).to(torch.int32).view(torch.float32)
    vals = [torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45, 1.17e-38, 3.4e38,
                          448.0, 464.0, 480.0, 57344.0, 61440.0, 65536.0]), nan]
    for dt in F8:
        v = torch.arange(256, dtype=torch.uint8).view(dt).float()
        v = torch.sort(v[torch.isfinite(v)]).values
        vals += [v, (v[:-1] + v[1:]) / 2, v * 2.0 ** -20]
    out = torch.cat(vals)
    return torch.cat([out, -out])


def wide(n=20000, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int64, generator=g).to(torch.int32)
    return torch.cat([b.view(torch.float32), specials()])


def normal(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# ---- helpers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FMTS)
def test_rne_fp8(fmt):
    x = wide()
    same(E._rne_fp8(x, fmt), R._rne_fp8(x, fmt))
    finite = x[torch.isfinite(x)]
    same(E._rne_fp8(finite, fmt, nan_possible=False), R._rne_fp8(finite, fmt))


@pytest.mark.parametrize("dtype", F8)
def test_fp8_to_f32_every_byte_and_layout(dtype):
    q = torch.arange(256, dtype=torch.uint8).view(dtype)
    same(E._fp8_to_f32(q), q.float())
    q2 = (normal(64, 48, scale=100.0)).clamp(-448, 448).to(dtype)
    for v in (q2.t(), q2[::2, 1::3], q2.reshape(8, 8, 48).permute(2, 0, 1)):
        same(E._fp8_to_f32(v), v.float())
    g = torch.Generator().manual_seed(1)
    for n in (1, 35, 1000, 70001):  # NaN bytes in the vector body and in the scalar tail
        u = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        u[-1] = 0x7F
        for v in (u, u & 0xBF):  # with NaN bytes, and with none
            same(E._fp8_to_f32(v.view(dtype)), v.view(dtype).float())


# ---- Philox --------------------------------------------------------------------------------------
SEEDS = [(0, 0), (1234, 5), (0x123456789ABCDEF0, 7), (2**64 - 1, 2**64 - 1), (42, 2**40 + 3),
         (7, -3)]


@pytest.mark.parametrize("seed,offset", SEEDS)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 1000, 4 * 37 + 2])
def test_random_words(seed, offset, n, monkeypatch):
    monkeypatch.setattr(philox, "CHUNK", 37)  # many chunks, a partial last one
    same(E.random_words(n, seed, offset, "cpu"), R.random_words(n, seed, offset, "cpu"))
    u = E.uniform24(n, seed, offset, "cpu")
    same(u, (R.random_words(n, seed, offset, "cpu") >> 8).float() * 2.0 ** -24)


def test_random_words_default_chunks():
    n = 3 * philox.CHUNK * 4 + 9
    same(E.random_words(n, 99, 12, "cpu"), R.random_words(n, 99, 12, "cpu"))


def test_random_words_padded_block():
    """A block just under the parallel size computes extra counters and drops their words."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        n = 4 * 20000 + 3
        same(E.random_words(n, 5, 6, "cpu"), R.random_words(n, 5, 6, "cpu"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("start", [0, 2**31 - 3, 2**32, 2**32 + 5, 2**33 + 2**32 - 7, 2**62])
def test_philox_block_at_any_counter(start):
    """A block of counters past 2^32 (the second counter word set) against plain Python ints."""
    m, seed, offset = 7, 0x123456789ABCDEF0, 0xFEDCBA9876543210
    key = (seed & 0xFFFFFFFF, seed >> 32)
    off = (offset & 0xFFFFFFFF, offset >> 32)
    bufs = [torch.empty(m, dtype=torch.int64) for _ in range(6)]
    words = [w & 0xFFFFFFFF for w in philox._block(start, m, key, off, bufs)]
    for i in range(m):
        j = start + i
        want = R.philox4x32_10((j & 0xFFFFFFFF, j >> 32, off[0], off[1]), key)
        assert tuple(int(w[i]) for w in words) == want, (start, i)


def test_philox_tensor_and_int_counters():
    g = torch.Generator().manual_seed(3)
    c = [torch.randint(0, 2**32, (500,), dtype=torch.int64, generator=g) for _ in range(4)]
    c[0][:4] = torch.tensor([0, 2**32 - 1, 2**31, 2**31 - 1])
    for key in ((0, 0), (2**32 - 1, 2**32 - 1), (0xA4093822, 0x299F31D0)):
        same(E.philox4x32_10(c, key), R.philox4x32_10(c, key))
        ints = (5, 0, 2**32 - 1, 3)
        assert E.philox4x32_10(ints, key) == R.philox4x32_10(ints, key)


# ---- per-tensor ----------------------------------------------------------------------------------
SCALES = [1.0, 0.37, 2.0 ** 20, 2.0 ** -10, 3.0e38, 0.0, float("inf"), float("nan")]


def quantize_inputs():
    yield wide()
    yield normal(33, 70, scale=30.0)
    yield normal(64, 48).t()  # strided
    yield normal(3, 5, 7)
    yield torch.tensor(2.5)
    yield torch.empty(0, 5)
    yield wide(4000).to(torch.bfloat16)
    yield wide(4000).to(torch.float16)


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize(dtype, stochastic):
    for i, x in enumerate(quantize_inputs()):
        for scale in SCALES:
            for s in (torch.tensor(scale), torch.tensor([scale])):
                args = (x, s, dtype, x.dim() >= 1, stochastic, 11 + i, 2**33 + i)
                same(E.quantize(*args), R.quantize(*args))


@pytest.mark.parametrize("dtype", F8)
def test_quantize_at_current_scale(dtype):
    """scale = max / amax puts amax * scale on max or one float32 step either side of it: the
    cast skips its clamp only when no element can exceed max."""
    fmax = E.get_format(dtype).max
    for i in range(60):
        x = normal(40, 30, scale=float(10.0 ** (i % 7 - 3)), seed=i)
        s = torch.tensor(fmax) / x.abs().amax()
        for stochastic in (False, True):
            args = (x, s, dtype, True, stochastic, 3, i)
            same(E.quantize(*args), R.quantize(*args))


def test_amax_and_dequantize():
    for x in quantize_inputs():
        same(E.amax(x), R.amax(x))
    for v in (-0.0, 0.0, float("inf"), float("-inf"), float("nan"), -3.0):
        for x in (torch.tensor([v, -0.0]), torch.tensor([-0.0, v]), torch.tensor([v] * 3)):
            same(E.amax(x), R.amax(x))
    for dtype in F8:
        q = torch.arange(256, dtype=torch.uint8).view(dtype)
        q2 = normal(40, 24, scale=50.0).clamp(-448, 448).to(dtype)
        for data in (q, q2, q2.t()):
            for s in (0.4, 3.0e38, 0.0, float("inf"), float("nan")):
                for out in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                    args = (data, torch.tensor(s), out)
                    same(E.dequantize(*args), R.dequantize(*args))


@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
@pytest.mark.parametrize("margin", [1.0, 1.3, 2.0 ** 100])
@pytest.mark.parametrize("p2", [False, True])
def test_scale_from_amax_one_value(fp8_max, margin, p2):
    """The CPU path for one value (Python floats) against the tensor formula."""
    amax = torch.cat([wide(3000).abs(), torch.tensor([0.0, 1e-45, 1e-40, 3e38, 448.0, 7.0])])
    prev = torch.tensor(0.75)
    for a in amax:
        same(E.scale_from_amax(a, prev, fp8_max, margin, p2),
             R.scale_from_amax(a, prev, fp8_max, margin, p2))
    same(E.scale_from_amax(amax, prev, fp8_max, margin, p2),
         R.scale_from_amax(amax, prev, fp8_max, margin, p2))


@pytest.mark.parametrize("algo", ["max", "most_recent", "ema", "percentile"])
@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("p2", [False, True])
def test_delayed_scale_update_host_path(algo, interval, p2):
    """The CPU path in Python floats against the tensor formula, over a run of updates and
    histories with zeros, -0, NaN, inf, subnormal and huge amaxes."""
    g = torch.Generator().manual_seed(7)
    specials = [0.0, -0.0, float("nan"), float("inf"), 1e-42, 3e38, 1e-30]
    for trial in range(40):
        L = [1, 4, 16][trial % 3]
        hist = torch.rand(L, generator=g) * 10.0 ** float(trial % 9 - 4)
        if trial % 5 == 4:
            hist[trial % L] = specials[trial % len(specials)]
        scale = torch.tensor([1.0, 0.0, 3e-39, 7.5][trial % 4])
        rep = torch.tensor(float(hist.max()) if trial % 7 else float("nan"))
        pending = torch.tensor(specials[trial % len(specials)] if trial % 6 == 5 else 2.5 * trial)
        for step in (0, 1, 2, 3, 6, 17):
            args = (hist, scale, rep, pending, torch.tensor(step), 448.0, 1.3, interval, algo,
                    0.1, 90.0, p2)
            same(E.delayed_scale_update(*args), R.delayed_scale_update(*args))


# ---- MXFP8 ---------------------------------------------------------------------------------------
def mx_inputs():
    x = normal(64, 96, scale=100.0) * torch.logspace(-20, 20, 96)
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, 5] = float("nan")
    x[3, 40] = float("-inf")
    x[4, 70] = float("inf")
    x[5, :32] = 1e-42
    x[40, 64] = float("nan")
    yield x
    yield normal(32, 64, scale=1e-3)  # no special: the pass that skips NaN bytes
    yield normal(2, 32, 64)
    yield x.to(torch.bfloat16)
    yield x.t()  # strided
    yield wide(64 * 32)[: 64 * 32].reshape(64, 32)
    yield torch.empty(0, 64)


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("rceil", [False, True])
def test_quantize_and_dequantize_mx(dtype, rceil):
    for x in mx_inputs():
        for axis in range(-x.dim(), x.dim()):
            if x.shape[axis] % 32:
                continue
            got = E.quantize_mx(x, dtype, 32, axis, rceil)
            same(got, R.quantize_mx(x, dtype, 32, axis, rceil))
            for out in (torch.float32, torch.bfloat16):
                same(E.dequantize_mx(*got, 32, axis, out), R.dequantize_mx(*got, 32, axis, out))
    with pytest.raises(ValueError):
        E.quantize_mx(torch.randn(4, 40), dtype, 32, -1, rceil)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rceil", [False, True])
def test_mx_exponent_bits(fmt, rceil):
    amax = wide().abs()
    e, bad = E._mx_exponent_bits(amax, fmt, rceil)
    ok = torch.isfinite(amax)
    assert torch.equal(bad, (~ok).to(torch.int32))
    assert torch.equal(e[ok], R.mx_exponent(amax, fmt, rceil)[ok])
    nan = torch.tensor([0xFFC00000 - 2**32], dtype=torch.int32).view(torch.float32)  # signed NaN
    assert E._mx_exponent_bits(nan, fmt, rceil)[1].item() == 1


def test_e8m0_to_float_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    same(E.e8m0_to_float(b), R.e8m0_to_float(b))


def test_dequantize_mx_strided_views():
    d, s = E.quantize_mx(normal(64, 96, scale=9.0), torch.float8_e4m3fn, 32, 0, False)
    same(E.dequantize_mx(d.t(), s.t(), 32, -1, torch.float32),
         R.dequantize_mx(d.t(), s.t(), 32, -1, torch.float32))


# ---- blockwise -----------------------------------------------------------------------------------
def blockwise_inputs():
    x = normal(130, 300) * torch.logspace(-3, 3, 300)
    x[0, :128] = 0.0
    x[1, 5], x[1, 6] = 1e-37, -5e-38
    x[129, 299] = float("inf")
    x[7, 3] = float("nan")
    yield x
    yield normal(256, 384, scale=5.0)  # whole blocks, no special
    yield normal(384, 256, scale=5.0).t()  # strided
    yield normal(2, 3, 128)
    yield x.to(torch.bfloat16)
    yield x.t()  # strided, partial blocks, specials
    yield torch.empty(0, 128)


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (4, 32)])
@pytest.mark.parametrize("p2", [False, True])
def test_quantize_and_dequantize_blockwise(dtype, block, p2):
    for x in blockwise_inputs():
        got = E.quantize_blockwise(x, dtype, *block, p2)
        same(got, R.quantize_blockwise(x, dtype, *block, p2))
        for out in (torch.float32, torch.bfloat16, torch.float64):
            same(E.dequantize_blockwise(*got, *block, out),
                 R.dequantize_blockwise(*got, *block, out))
        sinv64 = got[1].double()  # the scale's dtype takes part in the promotion
        same(E.dequantize_blockwise(got[0], sinv64, *block, torch.float32),
             R.dequantize_blockwise(got[0], sinv64, *block, torch.float32))


# ---- GEMMs ---------------------------------------------------------------------------------------
def fp8(shape, dtype, scale, seed):
    return (normal(*shape, scale=scale, seed=seed)).clamp(-448, 448).to(dtype)


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_gemm(out):
    for (m, n, k) in ((33, 21, 70), (128, 64, 256)):
        for da, db in ((F8[0], F8[0]), (F8[1], F8[0])):
            a, b = fp8((m, k), da, 30.0, 1), fp8((n, k), db, 3.0, 2)
            a[0, 0] = float("nan")
            for bias in (None, normal(n, seed=3)):
                for sa in (torch.tensor(1 / 30.0), torch.tensor([0.25])):
                    args = (a, b, sa, torch.tensor(0.5), bias, out)
                    same(E.gemm(*args), R.gemm(*args))
            at, bt = fp8((k, m), da, 30.0, 4).t(), fp8((k, n), db, 3.0, 5).t()  # strided
            args = (at, bt, torch.tensor(0.5), torch.tensor(0.25), None, out)
            same(E.gemm(*args), R.gemm(*args))


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_gemm_blockwise_and_mx(out):
    x, w = normal(5, 300, scale=3.0), normal(7, 300)
    x[1] = 0.0  # -0 products: the sum from zeros makes them +0
    w[2] = -w[2].abs()
    x[3, 200] = float("inf")  # a NaN block
    xd, xs = E.quantize_blockwise(x, torch.float8_e4m3fn, 1, 128, False)
    for br in (1, 128):
        wd, ws = E.quantize_blockwise(w, torch.float8_e4m3fn, br, 128, False)
        for bias in (None, normal(7, seed=4)):
            same(E.gemm_blockwise(xd, wd, xs, ws, bias, out),
                 R.gemm_blockwise(xd, wd, xs, ws, bias, out))
    for m, n, k in ((0, 7, 300), (5, 7, 0), (5, 0, 300)):  # empty operands
        xd, xs = E.quantize_blockwise(normal(m, k), torch.float8_e4m3fn, 1, 128, False)
        wd, ws = E.quantize_blockwise(normal(n, k), torch.float8_e4m3fn, 1, 128, False)
        same(E.gemm_blockwise(xd, wd, xs, ws, None, out),
             R.gemm_blockwise(xd, wd, xs, ws, None, out))
    a, b = normal(40, 96, scale=5.0), normal(24, 96)
    a[3, 7] = float("inf")
    (ad, asc), (bd, bsc) = (E.quantize_mx(t, torch.float8_e4m3fn, 32, -1, False) for t in (a, b))
    for bias in (None, normal(24, seed=5)):
        same(E.gemm_mx(ad, asc, bd, bsc, bias, out, 32), R.gemm_mx(ad, asc, bd, bsc, bias, out, 32))
    (ad, asc), (bd, bsc) = (E.quantize_mx(t, torch.float8_e4m3fn, 32, 0, False)
                            for t in (a.t(), b.t()))
    same(E.gemm_mx(ad.t(), asc.t(), bd.t(), bsc.t(), None, out, 32),
         R.gemm_mx(ad.t(), asc.t(), bd.t(), bsc.t(), None, out, 32))
