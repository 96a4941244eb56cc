"""GPU tests of the Hopper grouped FP8 GEMM (csrc/gemm_sm90_grouped*.cu) behind
fp8ops::grouped_gemm and fp8ops::grouped_gemm_wgrad. Needs an sm_90 GPU and the built
extension; skipped otherwise. References on the same CUDA tensors: the emulation (a loop of the
dense float32 GEMM over the groups) and a float64 product per group. Every element is compared;
outputs land in memory last filled with NaN, so an element no group writes shows up.
"""
from __future__ import annotations

import pytest
import torch

import fp8ops  # noqa: F401  (defines torch.ops.fp8ops.*)
from fp8ops.ops import backend, emulation_grouped
from fp8ops.ops.grouped import sm90_suits

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_ops = torch.ops.fp8ops


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs sm_90, got {torch.cuda.get_device_capability()}"
    if not backend.extension_loaded():
        return f"fp8ops._C not loaded: {backend._state['why_not']}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("fp8ops::grouped_gemm_sm90", "CUDA"):
        return "fp8ops._C built without the grouped sm_90a GEMM"
    return None


_reason = _skip_reason()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

OUT_EPS = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -23}
ACC_TOL = 2.0 ** -10  # promoted accumulation, relative to sum |a||b| (as the dense GEMM's test)
SIZES = {
    "balanced": [256, 256, 256, 256],
    "skewed": [64, 1024, 64, 128],          # one expert at 4x the mean
    "empty": [0, 300, 0, 77],               # empty groups, ragged ends
    "tiny": [1, 2, 3, 5, 7, 11, 13, 17],    # no group starts 16-aligned
    "tail": [100, 50, 30],                  # rows past the last group belong to none
}


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _poison():
    torch.full((1 << 26,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def _offsets(sizes):
    return torch.tensor(sizes, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)


def _fp8(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, device="cuda", generator=g) * scale
    return x.clamp(-400, 400).to(dtype)


def _scales(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(n, device="cuda", generator=g) * 0.01 + 0.001


def _check(out, ref64, mag64, out_dtype, what):
    assert out.dtype == out_dtype and out.shape == ref64.shape, what
    o = out.double()
    assert not torch.isnan(o).any(), f"{what}: NaN in output (an element no group wrote)"
    tol = OUT_EPS[out_dtype] * ref64.abs() + ACC_TOL * mag64 + 1e-30
    bad = (o - ref64).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements off"


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("a_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_grouped_gemm_kernel_matches_references(case, a_dtype, out_dtype):
    sizes = SIZES[case]
    E, N, K = len(sizes), 384, 512
    M = sum(sizes) + (37 if case == "tail" else 0)
    a, b = _fp8((M, K), a_dtype, 1), _fp8((E, N, K), E4M3, 2, 0.05)
    offsets, sa, sb = _offsets(sizes), _scales(E, 3), _scales(E, 4)
    assert sm90_suits("grouped_gemm", a, b, offsets, sa, sb, None, out_dtype)
    _poison()
    out = _ops.grouped_gemm(a, b, offsets, sa, sb, None, out_dtype)
    emu = emulation_grouped.grouped_gemm(a, b, offsets, sa, sb, None, out_dtype)
    ref, mag = torch.zeros(M, N, dtype=torch.float64, device="cuda"), torch.zeros_like(emu, dtype=torch.float64)
    lo = 0
    for g, hi in enumerate(offsets.tolist()):
        alpha = sa[g].double() * sb[g].double()
        ref[lo:hi] = a[lo:hi].double() @ b[g].double().t() * alpha
        mag[lo:hi] = a[lo:hi].double().abs() @ b[g].double().abs().t() * alpha
        lo = hi
    _check(out, ref, mag, out_dtype, f"{case} kernel vs float64")
    _check(emu, ref, mag, out_dtype, f"{case} emulation vs float64")
    assert torch.equal(out[lo:], torch.zeros_like(out[lo:])), "rows past the last group must be zeros"


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_grouped_wgrad_kernel_matches_references(case, out_dtype):
    sizes = SIZES[case]
    E, N, K = len(sizes), 256, 384
    M = sum(sizes) + (37 if case == "tail" else 0)
    dy_t, x_t = _fp8((N, M), E5M2, 5), _fp8((K, M), E4M3, 6)
    offsets, sa, sb = _offsets(sizes), _scales(E, 7), _scales(E, 8)
    assert sm90_suits("grouped_gemm_wgrad", dy_t, x_t, offsets, sa, sb, None, out_dtype)
    _poison()
    out = _ops.grouped_gemm_wgrad(dy_t, x_t, offsets, sa, sb, out_dtype)
    emu = emulation_grouped.grouped_gemm_wgrad(dy_t, x_t, offsets, sa, sb, out_dtype)
    lo = 0
    for g, hi in enumerate(offsets.tolist()):
        alpha = sa[g].double() * sb[g].double()
        a64, b64 = dy_t[:, lo:hi].double(), x_t[:, lo:hi].double()
        ref, mag = a64 @ b64.t() * alpha, a64.abs() @ b64.abs().t() * alpha
        _check(out[g], ref, mag, out_dtype, f"{case} group {g} kernel vs float64")
        _check(emu[g], ref, mag, out_dtype, f"{case} group {g} emulation vs float64")
        if hi == lo:
            assert torch.equal(out[g], torch.zeros_like(out[g])), "an empty group's dW must be zeros"
        lo = hi


def _groups(sizes):
    lo = 0
    for size in sizes:
        yield lo, lo + size
        lo += size


def test_what_the_kernel_does_not_take_runs_the_dense_op_per_group():
    sizes = SIZES["empty"]
    E, N, K, M = len(sizes), 128, 256, sum(sizes)
    a, b, offsets = _fp8((M, K), E4M3, 9), _fp8((E, N, K), E4M3, 10, 0.05), _offsets(sizes)
    sa, sb = _scales(E, 11), _scales(E, 12)
    bias = torch.randn(E, N, device="cuda")
    for args in [(a, b, offsets, sa, sb, bias, torch.bfloat16),   # a bias
                 (a, b, offsets, sa, sb, None, torch.float16)]:   # an fp16 output
        assert not sm90_suits("grouped_gemm", *args)
        _poison()
        out = _ops.grouped_gemm(*args)
        for g, (lo, hi) in enumerate(_groups(sizes)):  # each group: the dense op's bytes
            want = _ops.gemm(a[lo:hi], b[g], sa[g], sb[g], args[5] if args[5] is None
                             else args[5][g], args[6])
            assert torch.equal(out[lo:hi], want), (g, args[6])
    # row-wise scales: the dense op takes one scale per operand, so the emulation's GEMM
    rowwise = (a, b, offsets, torch.rand(M, 1, device="cuda"), sb, None, torch.bfloat16)
    assert torch.equal(_ops.grouped_gemm(*rowwise), emulation_grouped.grouped_gemm(*rowwise))


def test_blockwise_groups_run_the_dense_blockwise_op():
    """grouped_gemm_blockwise and its wgrad on CUDA: each group the dense gemm_blockwise op
    (the CUTLASS blockwise kernel on Hopper), its bytes, and close to a float64 product."""
    sizes = SIZES["empty"] + [130]
    E, N, K, M = len(sizes), 256, 384, sum(sizes)
    a, b, offsets = _fp8((M, K), E4M3, 23), _fp8((E, N, K), E4M3, 24, 0.05), _offsets(sizes)
    sa = torch.rand(M, K // 128, device="cuda") * 0.01 + 0.001
    sb = torch.rand(E, N // 128, K // 128, device="cuda") * 0.01 + 0.001
    _poison()
    out = _ops.grouped_gemm_blockwise(a, b, offsets, sa, sb, None, torch.bfloat16)
    for g, (lo, hi) in enumerate(_groups(sizes)):
        want = _ops.gemm_blockwise(a[lo:hi], b[g], sa[lo:hi], sb[g], None, torch.bfloat16)
        assert torch.equal(out[lo:hi], want), g
        ad = a[lo:hi].double() * sa[lo:hi].double().repeat_interleave(128, 1)
        bd = b[g].double() * sb[g].double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        ref = ad @ bd.t()
        mag = ad.abs() @ bd.abs().t()
        _check(out[lo:hi], ref, mag, torch.bfloat16, f"blockwise group {g}")
    # the wgrad: 1x128 blocks along M from each group's first row (packed scales)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    _, _, x_t, sx_t = _ops.quantize_blockwise_grouped(x, offsets, E4M3, False)
    _, _, dy_t, sdy_t = _ops.quantize_blockwise_grouped(dy, offsets, E4M3, False)
    _poison()
    dw = _ops.grouped_gemm_wgrad_blockwise(dy_t, x_t, offsets, sdy_t, sx_t, torch.float32)
    assert torch.equal(dw, emulation_grouped.grouped_gemm_wgrad_blockwise(
        dy_t, x_t, offsets, sdy_t, sx_t, torch.float32, gemm=_ops.gemm_blockwise))
    for g, (lo, hi) in enumerate(_groups(sizes)):
        if hi == lo:
            assert torch.equal(dw[g], torch.zeros_like(dw[g])), "an empty group's dW is zeros"
            continue
        ref = dy[lo:hi].double().t() @ x[lo:hi].double()
        mag = dy[lo:hi].double().abs().t() @ x[lo:hi].double().abs()
        assert ((dw[g].double() - ref).abs() <= 0.13 * mag + 1e-6).all(), g  # two E4M3 roundings


def test_no_host_sync_replays_in_a_cuda_graph_with_new_offsets():
    E, N, K, M = 4, 256, 256, 512
    a, b = _fp8((M, K), E4M3, 13), _fp8((E, N, K), E4M3, 14, 0.05)
    sa, sb = _scales(E, 15), _scales(E, 16)
    offsets = _offsets([128, 128, 128, 128])
    _ops.grouped_gemm(a, b, offsets, sa, sb, None, torch.bfloat16)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _ops.grouped_gemm(a, b, offsets, sa, sb, None, torch.bfloat16)
    for sizes in ([128, 128, 128, 128], [0, 500, 12, 0], [3, 0, 0, 509]):
        offsets.copy_(_offsets(sizes))
        graph.replay()
        want = _ops.grouped_gemm(a, b, offsets, sa, sb, None, torch.bfloat16)
        assert torch.equal(out, want), sizes


@pytest.mark.parametrize("name", ["grouped_gemm_sm90", "grouped_gemm_wgrad_sm90"])
def test_opcheck(name):
    sizes = SIZES["empty"]
    E, N, K, M = len(sizes), 128, 256, sum(sizes)
    offsets, sa, sb = _offsets(sizes), _scales(E, 17), _scales(E, 18)
    if name == "grouped_gemm_sm90":
        args = (_fp8((M, K), E4M3, 19), _fp8((E, N, K), E4M3, 20, 0.05), offsets, sa, sb, torch.bfloat16)
    else:
        args = (_fp8((N, M), E5M2, 21), _fp8((K, M), E4M3, 22), offsets, sa, sb, torch.float32)
    torch.library.opcheck(getattr(_ops, name).default, args,
                          test_utils=["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"])
