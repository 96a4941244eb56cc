"""CUDA cast kernels vs the emulation, bit for bit (same CUDA tensors in, bytes compared)."""
import math

import pytest
import torch

from conftest import skip_without_fp8_kernels

import fp8ops  # noqa: F401  (registers the ops, loads the extension when it can)
from fp8ops.ops import emulation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _need_kernels():
    skip_without_fp8_kernels()


OPS = torch.ops.fp8ops
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
INPUTS = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1,), (7,), (33,), (1000,), (31, 33), (4, 7, 9), (1000, 1001), (64, 128), (3, 64, 256), (300, 520), (0,),
          (0, 7), (2, 3, 17)]
MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _bytes_equal(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    ua, ub = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if not torch.equal(ua, ub):
        bad = (ua != ub).nonzero()
        raise AssertionError(f"{bad.shape[0]} bytes differ, first at {bad[:5].tolist()}: "
                             f"{ua[tuple(bad[0])].item():#x} vs {ub[tuple(bad[0])].item():#x}")


def _float_equal(a, b):
    """Bitwise equal, except that any NaN matches any NaN (payloads differ across paths)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(na, nb), "NaN positions differ"
    ia = a.masked_fill(na, 0).reshape(-1).view(torch.uint8)  # reshape: 0-d cannot be viewed
    ib = b.masked_fill(nb, 0).reshape(-1).view(torch.uint8)
    assert torch.equal(ia, ib), f"values differ: {(a.float() - b.float()).abs().max().item()}"


def _random(shape, dtype, magnitude=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * magnitude
    return x.to(dtype)


def _specials(dtype, fmt):
    """NaN, +-inf, -0, subnormals, exact ties between FP8 values, values just above max."""
    m = MAX[fmt]
    vals = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, m, -m, m * 1.01, -m * 1.07, 2 * m,
            1e-8, -3e-10, 2.0 ** -10, 2.0 ** -17, 2.0 ** -126, 1e-40, 3.4e38, -3.4e38]
    # ties: midpoints between neighbouring FP8 values (exact in float32)
    grid = torch.arange(0, 255, dtype=torch.uint8, device="cuda").view(fmt).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mids = ((grid[1:] + grid[:-1]) / 2)
    x = torch.cat([torch.tensor(vals, device="cuda"), mids, -mids, grid])
    return x.to(dtype)


def _magnitudes():
    return [1.0, 1e-3, 300.0, 1e5]


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("shape", SHAPES + [(), (5, 0)])
def test_amax(dtype, shape):
    x = _random(shape, dtype, 3.0)
    _float_equal(OPS.amax(x), emulation.amax(x))


@pytest.mark.parametrize("dtype", INPUTS)
def test_amax_nan_and_misaligned(dtype):
    x = _random((10001,), dtype, 2.0)
    for off in range(0, 9):  # base pointers that are not 16-byte aligned
        _float_equal(OPS.amax(x[off:]), emulation.amax(x[off:]))
    x[5000] = float("nan")
    assert torch.isnan(OPS.amax(x))


def _check_quantize(x, fmt, scale, transpose, stochastic, seed=0, offset=0):
    s = torch.tensor(scale, device="cuda", dtype=torch.float32)
    got = OPS.quantize(x, s, fmt, transpose, stochastic, seed, offset)
    ref = emulation.quantize(x, s, fmt, transpose, stochastic, seed, offset)
    _bytes_equal(got[0], ref[0])
    if transpose:
        _bytes_equal(got[1], ref[1])
    else:
        assert got[1].numel() == 0
    _float_equal(got[2], ref[2])


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize(fmt, dtype, shape, transpose, stochastic):
    for i, mag in enumerate(_magnitudes()):
        x = _random(shape, dtype, mag, seed=i)
        scale = MAX[fmt] / max(float(emulation.amax(x)), 1e-30) * (0.5 if i % 2 else 2.0)
        _check_quantize(x, fmt, scale, transpose, stochastic, seed=1234 + i, offset=7 * i)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_specials(fmt, dtype, stochastic):
    x = _specials(dtype, fmt)
    for scale in [1.0, 0.5, 2.0 ** -7, 3.0]:
        _check_quantize(x, fmt, scale, False, stochastic, seed=2 ** 40 + 3, offset=2 ** 33 + 1)
        _check_quantize(x[: x.numel() // 8 * 8].reshape(8, -1), fmt, scale, True, stochastic, seed=-5,
                        offset=11)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("via", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_via_a_gather_dtype(fmt, via, transpose, stochastic):
    """The float32 shard rounded to the gather's dtype inside the cast (FSDP2's FP8 gather)."""
    for shape in [(1000, 1001), (64, 128), (7,), (31, 33)]:
        for i, mag in enumerate([1.0, 300.0, 7e4]):
            x = _random(shape, torch.float32, mag, seed=i)
            s = torch.tensor(MAX[fmt] / mag / 4, device="cuda")
            got = OPS.quantize(x, s, fmt, transpose, stochastic, 3, i, None, via)
            ref = emulation.quantize(x, s, fmt, transpose, stochastic, 3, i, None, via)
            for g, r in zip(got[:2], ref[:2]):
                _bytes_equal(g, r)
            _float_equal(got[2], ref[2])
    x = _specials(torch.float32, fmt)
    s = torch.tensor(1.0, device="cuda")
    for g, r in zip(OPS.quantize(x, s, fmt, False, stochastic, 5, 0, None, via)[::2],
                    emulation.quantize(x, s, fmt, False, stochastic, 5, 0, None, via)[::2]):
        (_bytes_equal if g.element_size() == 1 else _float_equal)(g, r)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
def test_quantize_misaligned_and_noncontiguous(fmt, dtype):
    x = _random((130, 67), dtype, 10.0)
    for t in [x[:, 3:], x.t(), x.reshape(-1)[5:], x[1:, :64]]:
        for stochastic in (False, True):
            _check_quantize(t, fmt, 4.0, False, stochastic, seed=9, offset=3)
            _check_quantize(t, fmt, 4.0, True, stochastic, seed=9, offset=3)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("out_dtype", INPUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize(fmt, out_dtype, shape):
    data = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(fmt)
    for si in [1.0, 3.7e-3, 1e30, 2.0 ** -130]:
        s = torch.tensor(si, device="cuda")
        _float_equal(OPS.dequantize(data, s, out_dtype), emulation.dequantize(data, s, out_dtype))
    if data.numel() > 3:
        _float_equal(OPS.dequantize(data.reshape(-1)[3:], s, out_dtype),
                     emulation.dequantize(data.reshape(-1)[3:], s, out_dtype))


TRANSPOSE_SHAPES = [(1, 1), (1, 17), (17, 1), (64, 64), (65, 63), (100, 36), (256, 48), (48, 256),
                    (1000, 1001), (4096, 112), (0, 5), (5, 0)]


def _poison_bytes():
    """Freed cached memory filled with 0xA5, so that an unwritten output byte reads 0xA5."""
    torch.full((1 << 26,), 0xA5, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", FP8 + [torch.uint8])
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES)
def test_transpose_fp8(dtype, shape):
    """The tiled kernel's every read and write width (16 bytes, 4, 1), partial tiles, empty."""
    data = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(dtype)
    _poison_bytes()
    _bytes_equal(OPS.transpose_fp8(data), emulation.transpose_fp8(data))


@pytest.mark.parametrize("dtype", FP8)
def test_transpose_fp8_misaligned_and_noncontiguous(dtype):
    flat = torch.randint(0, 256, (130 * 96 + 5,), dtype=torch.uint8, device="cuda").view(dtype)
    base = flat[:130 * 96].view(130, 96)
    for data in [flat[5:].view(130, 96), base[:, 3:], base.t(), base[1:, :64]]:
        _poison_bytes()
        _bytes_equal(OPS.transpose_fp8(data), emulation.transpose_fp8(data))


def test_transpose_fp8_rejects_what_it_cannot_transpose():
    with pytest.raises(RuntimeError, match="2-D"):
        OPS.transpose_fp8(torch.zeros(2, 3, 4, device="cuda").to(torch.float8_e4m3fn))
    with pytest.raises(RuntimeError, match="bfloat16"):
        OPS.transpose_fp8(torch.ones(4, 4, device="cuda", dtype=torch.bfloat16))


MX_SHAPES = [((32,), -1), ((3, 64), -1), ((5, 7, 96), -1), ((64, 33), 0), ((2, 64, 5), 1), ((64,), 0),
             ((4, 32, 3), -2), ((0, 32), -1), ((1000, 1024), -1), ((1024, 1000), 0)]


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("shape,axis", MX_SHAPES)
@pytest.mark.parametrize("rceil", [False, True])
@pytest.mark.parametrize("block_size", [32, 16])
def test_quantize_mx(fmt, dtype, shape, axis, rceil, block_size):
    for i, mag in enumerate(_magnitudes() + [1e-38]):
        x = _random(shape, dtype, mag, seed=i)
        if x.numel() > 40:  # a block with NaN, one with inf, one of zeros
            flat = x.view(-1)
            flat[3] = float("nan")
            flat[x.numel() // 2] = float("inf")
        got = OPS.quantize_mx(x, fmt, block_size, axis, rceil)
        ref = emulation.quantize_mx(x, fmt, block_size, axis, rceil)
        _bytes_equal(got[0], ref[0])
        _bytes_equal(got[1], ref[1])
        for out_dtype in INPUTS:
            _float_equal(OPS.dequantize_mx(got[0], got[1], block_size, axis, out_dtype),
                         emulation.dequantize_mx(ref[0], ref[1], block_size, axis, out_dtype))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("rceil", [False, True])
def test_quantize_mx_specials(fmt, dtype, rceil):
    x = _specials(dtype, fmt)
    x = x[: x.numel() // 32 * 32]
    for scale in [1.0, 2.0 ** 100, 2.0 ** -100]:
        xs = (x.float() * scale).to(dtype)
        got = OPS.quantize_mx(xs, fmt, 32, -1, rceil)
        ref = emulation.quantize_mx(xs, fmt, 32, -1, rceil)
        _bytes_equal(got[0], ref[0])
        _bytes_equal(got[1], ref[1])
    # amax exactly on the RCEIL boundary (significand 1.75) and just above / below
    m = MAX[fmt]
    for a in [m, math.nextafter(m, 0), math.nextafter(m, math.inf), m / 4, 1.75, 1.7500001, 0.0]:
        xb = torch.full((32,), a / 3, device="cuda")
        xb[7] = -a
        xb = xb.to(dtype)
        got = OPS.quantize_mx(xb, fmt, 32, 0, rceil)
        ref = emulation.quantize_mx(xb, fmt, 32, 0, rceil)
        _bytes_equal(got[0], ref[0])
        _bytes_equal(got[1], ref[1])


BW_SHAPES = [(1,), (7,), (31, 33), (1000, 1001), (128, 128), (300, 257), (2, 130, 200), (0, 128), (129,)]


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("shape", BW_SHAPES)
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (3, 5)])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_quantize_blockwise(fmt, dtype, shape, block, power_of_two):
    for i, mag in enumerate(_magnitudes() + [1e-40]):
        x = _random(shape, dtype, mag, seed=i)
        if x.numel() > 300:
            flat = x.view(-1)
            flat[1] = float("nan")
            flat[x.numel() - 2] = -float("inf")
            flat[150:200] = 0.0
        got = OPS.quantize_blockwise(x, fmt, block[0], block[1], power_of_two)
        ref = emulation.quantize_blockwise(x, fmt, block[0], block[1], power_of_two)
        _bytes_equal(got[0], ref[0])
        _float_equal(got[1], ref[1])
        for out_dtype in INPUTS:
            _float_equal(OPS.dequantize_blockwise(got[0], got[1], block[0], block[1], out_dtype),
                         emulation.dequantize_blockwise(ref[0], ref[1], block[0], block[1], out_dtype))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
def test_quantize_blockwise_specials(fmt, dtype):
    x = _specials(dtype, fmt)
    for block in [(1, 128), (1, 16), (4, 4)]:
        for p2 in (False, True):
            xr = x[: x.numel() // 16 * 16].reshape(16, -1)
            got = OPS.quantize_blockwise(xr, fmt, block[0], block[1], p2)
            ref = emulation.quantize_blockwise(xr, fmt, block[0], block[1], p2)
            _bytes_equal(got[0], ref[0])
            _float_equal(got[1], ref[1])


def _scale_state(L, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hist = torch.rand(L, generator=g, device="cuda") * 10
    return (hist, torch.tensor([2.5], device="cuda"), torch.tensor(3.0, device="cuda"),
            torch.tensor(7.25, device="cuda"))


@pytest.mark.parametrize("algo", ["max", "most_recent", "ema", "percentile"])
@pytest.mark.parametrize("L", [1, 2, 16, 1000, 1024])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_delayed_scale_update(algo, L, power_of_two):
    for fp8_max in (448.0, 57344.0):
        for margin in (1.0, 0.7):
            for interval in (1, 3):
                for step in range(0, 6):
                    for pending in (7.25, 0.0, float("inf"), float("nan"), 1e-40, 3e38):
                        hist, scale, rep, _ = _scale_state(L, step)
                        pend = torch.tensor(pending, device="cuda")
                        st = torch.tensor(step, device="cuda")
                        args = (fp8_max, margin, interval, algo, 0.37, 95.0, power_of_two)
                        got = OPS.delayed_scale_update(hist, scale, rep, pend, st, *args)
                        ref = emulation.delayed_scale_update(hist, scale, rep, pend, st, *args)
                        for g_, r_ in zip(got, ref):
                            _float_equal(g_, r_.reshape(g_.shape).to(g_.dtype))


def test_delayed_scale_update_rejects_long_history():
    hist, scale, rep, pend = _scale_state(1025, 0)
    with pytest.raises(RuntimeError, match="1024"):
        OPS.delayed_scale_update(hist, scale, rep, pend, torch.tensor(1, device="cuda"), 448.0, 1.0, 1,
                                 "max", 0.1, 99.0, False)


def test_errors_are_clear():
    x = torch.randn(3, 40, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of block_size"):
        OPS.quantize_mx(x, torch.float8_e4m3fn, 32, -1, False)
    with pytest.raises(RuntimeError, match="float8"):
        OPS.quantize(x, torch.tensor(1.0, device="cuda"), torch.float16)
