"""fp8ops._cpu, the emulation's CPU kernels (csrc/*_cpu.cpp), against the emulation's own tensor
code and the frozen reference (tests/reference_emulation.py): the same bytes, on every path that
uses them. The kernels' tests need the extension built (scripts/setup_env.sh builds it whenever
torch and a C++ compiler are present); once it is, it must load."""
import glob
import os

import pytest
import torch

import reference_emulation as R
from fp8ops.ops import cpu_kernels
from fp8ops.ops import emulation as E
from fp8ops.formats import get_format

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = bool(glob.glob(os.path.join(ROOT, "fp8ops", "_cpu*.so")))
needs_kernels = pytest.mark.skipif(
    not BUILT, reason="fp8ops/_cpu*.so not built (pip install --no-build-isolation -e .)")
SEEDS = [(0, 0), (1234, 5), (0x123456789ABCDEF0, 7), (2**64 - 1, 2**64 - 1), (42, 2**40 + 3),
         (7, -3), (-5, 2**32 - 1)]


@pytest.fixture
def without_kernels(monkeypatch):
    monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    monkeypatch.setitem(cpu_kernels._state, "why_not", "disabled by the test")


def same_bytes(fast, plain, want, what=""):
    """The outputs with the kernels (fast), without (plain) and of the reference (want): same
    dtypes and shapes, contiguous kernel outputs, and the same bytes."""
    assert len(fast) == len(plain) == len(want)
    for a, b, c in zip(fast, plain, want):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape, (what, a.shape, c.shape)
        assert a.is_contiguous(), what
        ints = torch.uint8 if a.element_size() == 1 else torch.int32
        assert torch.equal(a.contiguous().view(ints), c.contiguous().view(ints)), what
        assert torch.equal(b.contiguous().view(ints), c.contiguous().view(ints)), what


@needs_kernels
def test_built_extension_loads():
    assert cpu_kernels.loaded(), cpu_kernels.why_not()
    assert cpu_kernels.why_not() == ""


@needs_kernels
@pytest.mark.parametrize("seed,offset", SEEDS)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 1023, 1024, 1025, 4099, 8 * 1024 * 3 + 5])
def test_stochastic_round_any_seed_and_size(seed, offset, n):
    """Every seed and offset form (64-bit, negative), sizes around the kernel's chunks and tasks."""
    y = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 100.0
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fast = E._stochastic_fp8(y.clone(), get_format(dtype), seed, offset)
        want = R._stochastic_fp8(y.clone(), get_format(dtype), seed, offset)
        assert torch.equal(fast.view(torch.uint8), want.view(torch.uint8)), (seed, offset, n)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_stochastic_round_any_thread_count(threads):
    """The split into tasks does not change which random word an element takes."""
    x, prev = torch.randn(8 * 1024 * 5 + 3), torch.get_num_threads()
    args = (x, torch.tensor(30.0), torch.float8_e5m2, False, True, 77, 2**33)
    want = R.quantize(*args)[0]
    torch.set_num_threads(threads)
    try:
        got = E.quantize(*args)[0]
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (333, 129), (64, 2048)])
def test_stochastic_quantize_same_bytes(dtype, shape, without_kernels, monkeypatch):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3.0
    if x.numel() > 4:
        x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-30])
    s = torch.tensor(37.5)
    args = (x, s, dtype, x.dim() == 2, True, 2**40 + 11, 5)
    plain = E.quantize(*args)
    monkeypatch.setitem(cpu_kernels._state, "loaded", True)
    fast = E.quantize(*args)
    want = R.quantize(*args)
    same_bytes(fast, plain, want, tuple(shape))


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("FP8OPS_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setitem(cpu_kernels._state, "loaded", None)
    assert not cpu_kernels.loaded()
    assert "FP8OPS_DISABLE_CPU_KERNELS=1" in cpu_kernels.why_not()
    x = torch.randn(1001)
    args = (x, torch.tensor(3.0), torch.float8_e5m2, False, True, 3, 4)
    assert torch.equal(E.quantize(*args)[0].view(torch.uint8), R.quantize(*args)[0].view(torch.uint8))


def _wide_f32(n, seed):
    """Random float32 bit patterns (every exponent: subnormals, huge values, inf, NaN) plus the
    FP8 grids' values, their midpoints (ties) and the saturation points."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int64, generator=g).to(torch.int32)
    vals = [b.view(torch.float32), torch.tensor([0.0, -0.0, float("inf"), float("-inf"),
                                                 float("nan"), 1e-45, 448.0, 464.0, 57344.0])]
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        v = torch.arange(256, dtype=torch.uint8).view(dt).float()
        v = torch.sort(v[torch.isfinite(v)]).values
        vals += [v, (v[:-1] + v[1:]) / 2]
    return torch.cat(vals)


def _mx_inputs():
    g = torch.Generator().manual_seed(5)
    normal = torch.randn(96, 256, generator=g) * 7.0
    spread = torch.randn(64, 64, generator=g) * torch.logspace(-42, 38, 64).unsqueeze(1)
    wide = _wide_f32(64 * 64 * 3, 3)[-64 * 64 * 3:].reshape(3, 64, 64)  # the specials come last
    nan_block = normal.clone()
    nan_block[5, 40] = float("nan")
    nan_block[70, 3] = float("-inf")
    return [normal, spread, wide, nan_block, normal[:0], torch.randn(4, 32, 3, generator=g)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rceil", [False, True])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_mx_same_bytes(dtype, rceil, in_dtype, without_kernels, monkeypatch):
    """Every axis and a few block sizes, including NaN / inf blocks, subnormals and ties."""
    cases = []
    for x in _mx_inputs():
        x = x.to(in_dtype)
        for axis in range(-1, x.dim()):
            for block in (32, 16, 64):
                if x.shape[axis] % block == 0:
                    cases.append((x, axis, block))
    cases.append((_mx_inputs()[0].to(in_dtype).t(), 0, 32))  # a non-contiguous x
    for x, axis, block in cases:
        monkeypatch.setitem(cpu_kernels._state, "loaded", False)
        plain = E.quantize_mx(x, dtype, block, axis, rceil)
        monkeypatch.setitem(cpu_kernels._state, "loaded", True)
        fast = E.quantize_mx(x, dtype, block, axis, rceil)
        want = R.quantize_mx(x, dtype, block, axis, rceil)
        same_bytes(fast, plain, want, (tuple(x.shape), axis, block))


@needs_kernels
def test_quantize_mx_kernel_rejects_bad_arguments():
    assert cpu_kernels.loaded()
    op = torch.ops.fp8ops_cpu.quantize_mx
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        op(x.t(), torch.float8_e4m3fn, 32, 0, False)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        op(x.double(), torch.float8_e4m3fn, 32, 1, False)
    with pytest.raises(RuntimeError, match="float8_e4m3fn or float8_e5m2"):
        op(x, torch.float16, 32, 1, False)
    with pytest.raises(RuntimeError, match="multiple of block_size"):
        op(x, torch.float8_e4m3fn, 48, 1, False)
    with pytest.raises(RuntimeError, match="axis out of range"):
        op(x, torch.float8_e4m3fn, 32, 2, False)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("tile", [(1, 128), (128, 128), (1, 32), (3, 5)])
def test_quantize_blockwise_same_bytes(dtype, power_of_two, tile, without_kernels, monkeypatch):
    """Whole and partial tiles, a transposed input, NaN / inf / zero tiles, subnormals, ties."""
    g = torch.Generator().manual_seed(7)
    wide = _wide_f32(130 * 300, 11)[-130 * 300:].reshape(130, 300)
    zeros_and_specials = torch.randn(200, 260, generator=g) * 5.0
    zeros_and_specials[:128, :128] = 0.0
    zeros_and_specials[150, 7] = float("nan")
    zeros_and_specials[199, 259] = float("-inf")
    tiny = torch.randn(129, 257, generator=g) * 1e-39  # subnormal amax: the quotient overflows
    cases = [torch.randn(256, 384, generator=g) * 3.0, wide, zeros_and_specials, tiny,
             torch.randn(384, 256, generator=g).t(), torch.randn(2, 3, 128, generator=g),
             torch.randn(0, 128)]
    for x in cases:
        args = (x, dtype, tile[0], tile[1], power_of_two)
        monkeypatch.setitem(cpu_kernels._state, "loaded", False)
        plain = E.quantize_blockwise(*args)
        monkeypatch.setitem(cpu_kernels._state, "loaded", True)
        fast = E.quantize_blockwise(*args)
        want = R.quantize_blockwise(*args)
        same_bytes(fast, plain, want, tuple(x.shape))


@needs_kernels
def test_tile_kernels_reject_bad_arguments():
    assert cpu_kernels.loaded()
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="contiguous 2-D float32 CPU tensor"):
        torch.ops.fp8ops_cpu.tile_amax(x.t(), 1, 32)
    with pytest.raises(RuntimeError, match="contiguous 2-D float32 CPU tensor"):
        torch.ops.fp8ops_cpu.tile_amax(x.double(), 1, 32)
    with pytest.raises(RuntimeError, match="block sizes must be positive"):
        torch.ops.fp8ops_cpu.tile_amax(x, 0, 32)
    with pytest.raises(RuntimeError, match="one value per tile"):
        torch.ops.fp8ops_cpu.cast_tiles(x, torch.ones(4, 3), 1, 32, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="float8_e4m3fn or float8_e5m2"):
        torch.ops.fp8ops_cpu.cast_tiles(x, torch.ones(4, 2), 1, 32, torch.bfloat16)


@needs_kernels
def test_stochastic_round_kernel_rejects_bad_arguments():
    assert cpu_kernels.loaded()
    op = torch.ops.fp8ops_cpu.stochastic_round
    y = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensor"):
        op(y.t(), torch.float8_e5m2, 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensor"):
        op(y.half(), torch.float8_e5m2, 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="float8_e4m3fn or float8_e5m2"):
        op(y, torch.bfloat16, 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="32-bit"):
        op(y, torch.float8_e5m2, 0, 2**32, 0, 0)
    assert op(torch.empty(0, 3), torch.float8_e5m2, 0, 0, 0, 0).shape == (0, 3)
