"""fp8ops._cpu, the emulation's CPU kernels (csrc/*_cpu.cpp), against the emulation's own tensor
code and the frozen reference (tests/reference_emulation.py): the same bytes, on every path that
uses them. Both paths run in every test; the kernels' own tests need the extension built (it is,
by scripts/setup_env.sh, whenever torch and a C++ compiler are present)."""
import glob
import os

import pytest
import torch

import reference_emulation as R
from fp8ops import _cpu_kernels
from fp8ops import _emulation as E
from fp8ops import _philox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = bool(glob.glob(os.path.join(ROOT, "fp8ops", "_cpu*.so")))
needs_kernels = pytest.mark.skipif(
    not BUILT, reason="fp8ops/_cpu*.so not built (pip install --no-build-isolation -e .)")
SEEDS = [(0, 0), (1234, 5), (0x123456789ABCDEF0, 7), (2**64 - 1, 2**64 - 1), (42, 2**40 + 3),
         (7, -3), (-5, 2**32 - 1)]


@pytest.fixture
def without_kernels(monkeypatch):
    monkeypatch.setitem(_cpu_kernels._state, "loaded", False)
    monkeypatch.setitem(_cpu_kernels._state, "why_not", "disabled by the test")


def bits(t):
    return t.contiguous().view(torch.int32)


@needs_kernels
def test_built_extension_loads():
    assert _cpu_kernels.loaded(), _cpu_kernels.why_not()
    assert _cpu_kernels.why_not() == ""


@needs_kernels
@pytest.mark.parametrize("seed,offset", SEEDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 1000, 8191, 8193, 4 * 2048 * 3 + 1, 300001])
def test_uniform24_same_as_tensor_code_and_reference(seed, offset, n, without_kernels, monkeypatch):
    want = (R.random_words(n, seed, offset, "cpu") >> 8).float() * 2.0 ** -24
    plain = _philox.uniform24(n, seed, offset, "cpu").clone()  # the tensor code (no kernels)
    monkeypatch.setitem(_cpu_kernels._state, "loaded", True)
    fast = _philox.uniform24(n, seed, offset, "cpu").clone()
    assert fast.shape == want.shape == plain.shape == (n,)
    assert torch.equal(bits(fast), bits(want)) and torch.equal(bits(plain), bits(want))


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_uniform24_any_thread_count(threads):
    """The split into tasks does not change which counter an element takes."""
    n, prev = 4 * 2048 * 5 + 3, torch.get_num_threads()
    want = (R.random_words(n, 77, 2**33, "cpu") >> 8).float() * 2.0 ** -24
    torch.set_num_threads(threads)
    try:
        got = _philox.uniform24(n, 77, 2**33, "cpu")
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(bits(got), bits(want))


@needs_kernels
def test_kernel_writes_every_element():
    """Every element of a poisoned output is written (and nothing is a leftover of the poison)."""
    assert _cpu_kernels.loaded()
    for n in (4, 8, 4 * 2048 + 4, 4 * 30011):
        out = torch.full((n,), float("nan"))
        torch.ops.fp8ops_cpu.philox_uniform24_(out, 9, 0, 3, 0)
        want = (R.random_words(n, 9, 3, "cpu") >> 8).float() * 2.0 ** -24
        assert torch.equal(bits(out), bits(want))


@needs_kernels
def test_kernel_rejects_bad_arguments():
    assert _cpu_kernels.loaded()
    op = torch.ops.fp8ops_cpu.philox_uniform24_
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensor"):
        op(torch.empty(8, dtype=torch.float64), 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensor"):
        op(torch.empty(8, 2)[:, 0], 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="32-bit"):
        op(torch.empty(8), 2**32, 0, 0, 0)
    with pytest.raises(RuntimeError, match="32-bit"):
        op(torch.empty(8), 0, 0, -1, 0)
    op(torch.empty(0), 0, 0, 0, 0)  # empty: nothing to write, no error


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
    monkeypatch.setitem(_cpu_kernels._state, "loaded", True)
    fast = E.quantize(*args)
    want = R.quantize(*args)
    for a, b, c in zip(fast, plain, want):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
        ints = torch.uint8 if a.element_size() == 1 else torch.int32
        assert torch.equal(a.contiguous().view(ints), c.contiguous().view(ints))
        assert torch.equal(b.contiguous().view(ints), c.contiguous().view(ints))


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("FP8OPS_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setitem(_cpu_kernels._state, "loaded", None)
    assert not _cpu_kernels.loaded()
    assert "FP8OPS_DISABLE_CPU_KERNELS=1" in _cpu_kernels.why_not()
    want = (R.random_words(1001, 3, 4, "cpu") >> 8).float() * 2.0 ** -24
    assert torch.equal(bits(_philox.uniform24(1001, 3, 4, "cpu")), bits(want))
