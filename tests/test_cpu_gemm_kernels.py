"""fp8ops._cpu's readers of FP8 bytes and the emulated GEMMs built on them (csrc/decode_cpu.cpp,
csrc/gemm_cpu.cpp), and the one-pass casts (csrc/per_tensor_cpu.cpp, the blockwise pair of
csrc/blockwise_cpu.cpp): with the kernels, without them, and the frozen reference
(tests/reference_emulation.py) give the same bytes, float outputs bit for bit with NaN
payloads, at thread counts 1-3."""
import glob
import os

import pytest
import torch

import reference_emulation as R
from fp8ops.ops import cpu_kernels, fused
from fp8ops.ops import emulation as E

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not glob.glob(os.path.join(ROOT, "fp8ops", "_cpu*.so")),
                                reason="fp8ops/_cpu*.so not built")
F8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b, what=""):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for x, y in zip(a, b):
            same(x, y, what)
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.shape, b.shape)
    assert [s for s, n in zip(a.stride(), a.shape) if n > 1] == \
        [s for s, n in zip(b.stride(), b.shape) if n > 1], (what, a.stride(), b.stride())
    assert torch.equal(bits(a), bits(b)), what


def three_ways(monkeypatch, fn, ref):
    """fn with the kernels and without, and ref (the reference): the same bytes."""
    monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    plain = fn()
    monkeypatch.setitem(cpu_kernels._state, "loaded", True)
    fast = fn()
    same(fast, plain, "kernels against tensor code")
    same(fast, ref(), "kernels against the reference")
    return fast


@pytest.fixture(params=[1, 2, 3])
def threads(request):
    prev = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(prev)


def random_bytes(shape, dtype, seed, nan=False):
    """FP8 data of every byte but NaN (or with some NaN bytes)."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    first_nan = 0x7F if dtype == torch.float8_e4m3fn else 0x7D
    b = torch.where((b & 0x7F) >= first_nan, b & 0xF0, b)
    if nan and b.numel() > 3:
        b.view(-1)[[1, b.numel() // 2]] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
    return b.view(dtype)


def scaled_fp8(shape, dtype, seed, scale=1.0):
    """FP8 data of normal values (the products and sums of a GEMM stay finite)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@pytest.fixture(autouse=True)
def _loaded():
    assert cpu_kernels.loaded(), cpu_kernels.why_not()


# ----------------------------------------------------------------------------------------------
# reading FP8 back, the byte transpose
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", F8)
def test_decode_every_byte_and_layout(dtype, threads):
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = random_bytes((300, 77), dtype, 1)
    big = random_bytes((9, 70001), dtype, 2)  # several tasks
    for data in (every, finite, finite.t(), finite[:, :40].t()[:5], big):
        out = torch.empty_like(data, dtype=torch.float32)
        if not E._dense(data):
            continue
        decoded = torch.ops.fp8ops_cpu.decode_fp8(data, out)
        has_nan = bool(torch.isnan(data.float()).any())
        assert decoded == (not has_nan)
        if decoded:
            assert out.stride() == data.float().stride()
            assert torch.equal(bits(out), bits(data.float()))
        assert torch.equal(bits(E._fp8_to_f32(data)), bits(data.float()))


def test_decode_rejects_bad_arguments():
    data = random_bytes((4, 6), torch.float8_e4m3fn, 0)
    with pytest.raises(RuntimeError, match="dense float8"):
        torch.ops.fp8ops_cpu.decode_fp8(data[:, ::2], torch.empty(4, 3))
    with pytest.raises(RuntimeError, match="sizes and strides"):
        torch.ops.fp8ops_cpu.decode_fp8(data.t(), torch.empty(6, 4))
    with pytest.raises(RuntimeError, match="sizes and strides"):
        torch.ops.fp8ops_cpu.decode_fp8(data, torch.empty(4, 6, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(1, 1), (16, 16), (17, 33), (64, 128), (130, 1000), (1000, 3),
                                   (2, 4099)])
def test_transpose_bytes_any_shape_and_stride(shape, threads):
    data = random_bytes(shape, torch.float8_e5m2, sum(shape))
    for view in (data, data.t(), data[:, ::2], data[1:]):
        got = torch.ops.fp8ops_cpu.transpose_bytes(view)
        assert got.is_contiguous() and got.dtype == view.dtype
        assert torch.equal(bits(got), bits(view.t().contiguous()))


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("block", [32, 16])
def test_dequantize_mx_any_layout(dtype, block, threads, monkeypatch):
    g = torch.Generator().manual_seed(block)
    for shape, nan in (((96, 256), False), ((64, 64), True), ((200, 96), False), ((0, 32), False)):
        data = random_bytes(shape, dtype, shape[0], nan)
        scales = torch.randint(100, 150, (shape[0], shape[1] // block), dtype=torch.uint8,
                               generator=g)
        if scales.numel() > 2:  # the subnormal 2^-127, NaN, the largest
            scales.view(-1)[:3] = torch.tensor([0, 0xFF, 0xFE], dtype=torch.uint8)
        for d, s in ((data, scales), (data.t().contiguous().t(), scales.t().contiguous().t())):
            three_ways(monkeypatch, lambda: E._dequantize_mx_f32(d, s, block, -1),
                       lambda: R.dequantize_mx(d, s, block, -1, torch.float32))


# ----------------------------------------------------------------------------------------------
# the GEMMs
# ----------------------------------------------------------------------------------------------
def per_tensor_cases(dtype):
    a, b = scaled_fp8((70, 300), dtype, 1, 30.0), scaled_fp8((33, 300), torch.float8_e4m3fn, 2)
    yield a, b, torch.tensor(1 / 30.0), torch.tensor(0.5)
    yield a.t().contiguous().t(), b, torch.tensor([0.25]), torch.tensor(2.0)  # strided a
    yield random_bytes((20, 64), dtype, 3, nan=True), b[:, :64].contiguous(), torch.tensor(1.0), \
        torch.tensor(1.0)  # NaN bytes: torch's conversion
    yield a, b, torch.tensor(float("nan")), torch.tensor(1.0)  # a NaN scale: torch's ops
    yield a[:0], b, torch.tensor(1.0), torch.tensor(1.0)
    yield a[:, 5:5], b[:, 5:5], torch.tensor(1.0), torch.tensor(1.0)  # K = 0, strided empties


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_gemm_per_tensor(dtype, out, threads, monkeypatch):
    for a, b, sa, sb in per_tensor_cases(dtype):
        n = b.shape[0]
        nan_bias = torch.randn(n)
        nan_bias[3] = float("nan")
        for bias in (None, torch.randn(n), torch.randn(n).bfloat16(), nan_bias):
            args = (a, b, sa, sb, bias, out)
            three_ways(monkeypatch, lambda: E.gemm(*args), lambda: R.gemm(*args))


def blockwise_operands(dtype, m, n, k, seed, nan=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3.0
    w = torch.randn(n, k, generator=g)
    if nan:
        x[m // 2, k - 1] = float("inf")  # a NaN block: a NaN scale and NaN bytes
    xd, xs = E.quantize_blockwise(x, dtype, 1, 128, False)
    return x, w, xd, xs


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part_bytes", [1, 8 << 20])  # one K block per group, or all of them
def test_gemm_blockwise(dtype, out, part_bytes, threads, monkeypatch):
    monkeypatch.setattr(E, "_PART_BYTES", part_bytes)
    for m, n, k, nan in ((64, 48, 1000, False), (5, 7, 300, True), (130, 200, 128, False),
                         (3, 129, 50, False), (8, 8, 1100, False)):
        _, w, xd, xs = blockwise_operands(dtype, m, n, k, m + n, nan)
        nan_bias = torch.randn(n)
        nan_bias[0] = float("nan")
        for br in (1, 128):
            wd, ws = E.quantize_blockwise(w, torch.float8_e4m3fn, br, 128, False)
            for wd_, ws_ in ((wd, ws), (wd, ws.t().contiguous().t())):
                for bias in (None, torch.randn(n), nan_bias):
                    args = (xd, wd_, xs, ws_, bias, out)
                    three_ways(monkeypatch, lambda: E.gemm_blockwise(*args),
                               lambda: R.gemm_blockwise(*args))


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_gemm_mx(dtype, out, threads, monkeypatch):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, 96, generator=g) * 5.0, torch.randn(24, 96, generator=g)
    a_nan = a.clone()
    a_nan[3, 7] = float("inf")  # a NaN block
    for x in (a, a_nan):
        (ad, asc), (bd, bsc) = (E.quantize_mx(t, dtype, 32, -1, False) for t in (x, b))
        (adc, ascc), (bdc, bscc) = (E.quantize_mx(t.t(), dtype, 32, 0, False) for t in (x, b))
        for operands in ((ad, asc, bd, bsc), (adc.t(), ascc.t(), bdc.t(), bscc.t())):
            for bias in (None, torch.randn(24), torch.full((24,), float("nan"))):
                args = (*operands, bias, out, 32)
                three_ways(monkeypatch, lambda: E.gemm_mx(*args), lambda: R.gemm_mx(*args))


def test_gemm_kernels_reject_bad_arguments():
    a = scaled_fp8((4, 256), torch.float8_e4m3fn, 0)
    acc, part = torch.empty(4, 4), torch.empty(1, 4, 4)
    with pytest.raises(RuntimeError, match="one K"):
        torch.ops.fp8ops_cpu.gemm(a, a[:, :128], torch.tensor(1.0), None, torch.empty(4, 256),
                                  torch.empty(4, 128))
    with pytest.raises(RuntimeError, match="one float32 CPU value"):
        torch.ops.fp8ops_cpu.gemm(a, a, torch.ones(2), None, torch.empty(4, 256),
                                  torch.empty(4, 256))
    with pytest.raises(RuntimeError, match="bias must be a CPU tensor"):
        torch.ops.fp8ops_cpu.gemm(a, a, torch.tensor(1.0), torch.ones(5), torch.empty(4, 256),
                                  torch.empty(4, 256))
    with pytest.raises(RuntimeError, match="a_scale_inv must be"):
        torch.ops.fp8ops_cpu.gemm_blockwise(a, a, torch.ones(4, 3), torch.ones(4, 2), None, acc,
                                            torch.empty(4, 256), torch.empty(4, 256), part)
    with pytest.raises(RuntimeError, match="part must be"):
        torch.ops.fp8ops_cpu.gemm_blockwise(a, a, torch.ones(4, 2), torch.ones(4, 2), None, acc,
                                            torch.empty(4, 256), torch.empty(4, 256),
                                            torch.empty(0, 4, 4))
    with pytest.raises(RuntimeError, match="scales must be uint8"):
        torch.ops.fp8ops_cpu.gemm_mx(a, torch.ones(4, 8, dtype=torch.uint8), a,
                                     torch.ones(4, 9, dtype=torch.uint8), 32, None, acc,
                                     torch.empty(4, 256), torch.empty(4, 256))


# ----------------------------------------------------------------------------------------------
# the one-pass casts
# ----------------------------------------------------------------------------------------------
def cast_inputs():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(130, 300, generator=g) * 50.0
    x.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-30, 1e-45])
    return [x, torch.randn(3, 5, 200, generator=g), torch.randn(7, generator=g),
            torch.tensor(3.0), torch.randn(0, 4), torch.randn(4, 0), torch.randn(2, 3, 0),
            torch.randn(1000, 64, generator=g) * 1e-3, torch.randn(64, 100, generator=g).t()]


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("stochastic", [False, True])
def test_per_tensor_cast(dtype, stochastic, threads, monkeypatch):
    for x in cast_inputs():
        for scale in (torch.tensor(37.5), torch.tensor([1e30]), torch.tensor(float("nan"))):
            args = (x, scale, dtype, x.dim() >= 1, stochastic, 2**40 + 11, 5)
            three_ways(monkeypatch, lambda: E.quantize(*args), lambda: R.quantize(*args))


def test_amax_with_nan_keeps_torchs_bits(monkeypatch):
    x = torch.randn(1000)
    for payload in (0x7FC00000, 0x7F800001, 0xFFC00000 - 2**32, 0x7FA00000):
        x.view(torch.int32)[17] = payload
        three_ways(monkeypatch, lambda: E.amax(x), lambda: R.amax(x))


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("power_of_two", [False, True])
def test_blockwise_pair(dtype, power_of_two, threads, monkeypatch):
    g = torch.Generator().manual_seed(5)
    specials = torch.randn(200, 260, generator=g) * 5.0
    specials[:128, :128] = 0.0
    specials[150, 7] = float("nan")
    specials[199, 259] = float("-inf")
    tiny = torch.randn(129, 257, generator=g) * 1e-39
    for x in (torch.randn(256, 384, generator=g), specials, tiny, torch.randn(1, 5, generator=g),
              torch.randn(300, 128, generator=g).bfloat16(), torch.randn(0, 128), torch.randn(5, 0),
              torch.randn(128, 300, generator=g).t()):
        def pair():
            return fused.quantize_blockwise_pair(x, dtype, power_of_two, torch.float32)

        def ref():
            data, s = R.quantize_blockwise(x, dtype, 1, 128, power_of_two)
            data_t, s_t = R.quantize_blockwise(x.t(), dtype, 1, 128, power_of_two)
            return (data, fused.mn_major(s), data_t, fused.mn_major(s_t),
                    fused.column_sums(x, torch.float32))
        three_ways(monkeypatch, pair, ref)
