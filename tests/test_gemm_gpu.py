"""GPU tests of the CUTLASS Hopper FP8 GEMMs (fp8ops::gemm, fp8ops::gemm_blockwise).

Needs an sm_90 GPU and the built extension; skipped cleanly otherwise. References, on the same
CUDA tensors: the emulation (emulation.gemm / gemm_blockwise, float32), a float64 product of the
dequantized operands, and torch._scaled_mm on identical FP8 inputs. Every element is compared;
a NaN anywhere fails. Outputs land in memory the caching allocator last filled with NaN, so an
element the kernel does not write shows up.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import fp8ops  # noqa: F401  (defines torch.ops.fp8ops.*)
from fp8ops.ops import backend, emulation
from gemm_shapes import BLOCKWISE_SHAPES, GEMM_SHAPES

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
# Final rounding of the output: half an ulp, doubled for safety.
OUT_EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -23}


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs sm_90, got {torch.cuda.get_device_capability()}"
    if not backend.extension_loaded():
        return f"fp8ops._C not loaded: {backend._state['why_not']}"
    if not torch.ops.fp8ops_C.has_cutlass_sm90():
        return "fp8ops._C built without the CUTLASS sm_90a GEMM"
    return None


_reason = _skip_reason()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    # The float32 references must not use TF32.
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _seed(*parts):
    """A different, reproducible seed per test case (hash() of str is salted per process)."""
    return zlib.crc32(repr(parts).encode()) % (1 << 30)


def _poison():
    """Fill freed cached memory with NaN so an unwritten output element reads NaN."""
    torch.full((1 << 26,), float("nan"), device="cuda")  # 256 MiB, freed at once
    torch.cuda.synchronize()


def _quantize(x: torch.Tensor, dtype):
    """Per-tensor current scaling, as docs/design.md, "Per-tensor casts" (clamp, then RNE cast)."""
    amax = x.abs().amax().float()
    scale = FMAX[dtype] / amax
    q = (x.float() * scale).clamp(-FMAX[dtype], FMAX[dtype]).to(dtype)
    return q, (1.0 / scale).reshape(())


def _operands(m, n, k, a_dtype, b_dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=g) * 3.0
    b = torch.randn(n, k, device="cuda", generator=g) * 0.02
    qa, sa = _quantize(a, a_dtype)
    qb, sb = _quantize(b, b_dtype)
    return qa, sa, qb, sb


def _bias(n, dtype, seed):
    if dtype is None:
        return None
    g = torch.Generator(device="cuda").manual_seed(seed + 7)
    return torch.randn(n, device="cuda", generator=g).to(dtype)


def _check(out, ref64, mag64, out_dtype, acc_tol, what):
    """|out - ref| <= OUT_EPS*|ref| + acc_tol*mag, element by element; mag = sum |a||b| scaled."""
    assert out.dtype == out_dtype, what
    assert out.shape == ref64.shape, what
    assert out.is_contiguous(), what
    o = out.double()
    assert not torch.isnan(o).any(), f"{what}: NaN in output"
    tol = OUT_EPS[out_dtype] * ref64.abs() + acc_tol * mag64 + 1e-30
    err = (o - ref64).abs()
    bad = err > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off; worst "
                           f"err {float((err / tol).max()):.3g} x tol")


def _ref64(qa, sa, qb, sb, bias):
    a64, b64 = qa.double(), qb.double()
    alpha = sa.double() * sb.double()
    ref = (a64 @ b64.t()) * alpha
    mag = (a64.abs() @ b64.abs().t()) * alpha.abs()
    if bias is not None:
        ref = ref + bias.double()
    return ref, mag


# Accumulation tolerance (relative to sum |a||b|): FP8 WGMMA accumulates with fewer bits than
# FP32; promotion every 128 of K bounds the loss, fast accumulation does not.
ACC_TOL = {False: 2.0 ** -10, True: 2.0 ** -7}

SHAPES = GEMM_SHAPES  # (M, N, K): M 1 / 17 / 4095 (small- and large-M tiles), odd N and K
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)]
OUTS = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{str(p[0])[-6:]}-{str(p[1])[-6:]}")
@pytest.mark.parametrize("out_dtype", OUTS, ids=str)
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gemm_matches_references(shape, pair, out_dtype, bias_dtype, fast_accum):
    m, n, k = shape
    seed = _seed(shape, pair, out_dtype, bias_dtype, fast_accum)
    qa, sa, qb, sb = _operands(m, n, k, pair[0], pair[1], seed)
    bias = _bias(n, bias_dtype, seed)
    _poison()
    out = torch.ops.fp8ops.gemm(qa, qb, sa, sb, bias, out_dtype, fast_accum)
    torch.cuda.synchronize()
    ref64, mag = _ref64(qa, sa, qb, sb, bias)
    tol = ACC_TOL[fast_accum]
    _check(out, ref64, mag, out_dtype, tol, "vs float64")
    emu = emulation.gemm(qa, qb, sa, sb, bias, out_dtype, fast_accum)
    # The emulation is itself rounded to out_dtype: allow its rounding too.
    _check(out, emu.double(), mag, out_dtype, tol + OUT_EPS[out_dtype] * 4, "vs emulation")


@pytest.mark.parametrize("pair", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", OUTS, ids=str)
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("m", [16, 4096])
def test_gemm_matches_scaled_mm(pair, out_dtype, fast_accum, m):
    n, k = 2048, 4096  # _scaled_mm needs K and N multiples of 16
    qa, sa, qb, sb = _operands(m, n, k, pair[0], pair[1], 11 + m)
    _poison()
    out = torch.ops.fp8ops.gemm(qa, qb, sa, sb, None, out_dtype, fast_accum)
    ref = torch._scaled_mm(qa, qb.t(), scale_a=sa.float(), scale_b=sb.float(), out_dtype=out_dtype,
                           use_fast_accum=fast_accum)
    _, mag = _ref64(qa, sa, qb, sb, None)
    # Two differently ordered reductions, each rounded to out_dtype.
    _check(out, ref.double(), mag, out_dtype, 2 * ACC_TOL[fast_accum] + 4 * OUT_EPS[out_dtype],
           "vs torch._scaled_mm")



@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scales_that_are_views_at_any_offset(fast_accum, with_bias):
    """A scale may be a 0-dim view into a vector (a per-expert scale, s[g]) at any 4-byte
    offset; cuBLASLt refuses a scale pointer that is not 16-byte aligned, so the op must not
    hand it one. The bytes equal those from scales that own their memory. M = 300 is no
    multiple of 16."""
    qa, _, qb, _ = _operands(300, 128, 256, E4M3, E4M3, 77)
    scales = torch.rand(8, device="cuda") + 0.5
    bias = torch.randn(128, device="cuda") if with_bias else None
    for i in range(1, 4):
        sa, sb = scales[i], scales[i + 4]
        assert sa.data_ptr() % 16 != 0
        _poison()
        out = torch.ops.fp8ops.gemm(qa, qb, sa, sb, bias, torch.bfloat16, fast_accum)
        want = torch.ops.fp8ops.gemm(qa, qb, sa.clone(), sb.clone(), bias, torch.bfloat16, fast_accum)
        assert torch.equal(out, want), i

def _kernels(fn):
    """Names of the CUDA kernels fn launches."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.parametrize("pair", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(4096, 2048, 4096), (300, 1001, 520)],
                         ids=lambda s: "x".join(map(str, s)))
def test_promoted_gemm_is_cublaslt_unless_cutlass_is_asked_for(pair, shape, monkeypatch):
    """Promoted accumulation (FP8Linear's dgrad and wgrad) runs cuBLASLt without fast
    accumulation; FP8OPS_SM90_PROMOTED_GEMM=cutlass keeps the CUTLASS kernel. Both within the
    promoted tolerance of float64; a bad value is refused."""
    m, n, k = shape
    qa, sa, qb, sb = _operands(m, n, k, pair[0], pair[1], _seed("promoted", pair, shape))
    ref64, mag = _ref64(qa, sa, qb, sb, None)

    def promoted():
        _poison()
        return torch.ops.fp8ops.gemm(qa, qb, sa, sb, None, torch.bfloat16, False)
    _check(promoted(), ref64, mag, torch.bfloat16, ACC_TOL[False], "cuBLASLt promoted")
    assert not any("GemmUniversal" in name for name in _kernels(promoted))  # (CUTLASS 3)
    monkeypatch.setenv("FP8OPS_SM90_PROMOTED_GEMM", "cutlass")
    _check(promoted(), ref64, mag, torch.bfloat16, ACC_TOL[False], "CUTLASS promoted")
    assert any("GemmUniversal" in name for name in _kernels(promoted))
    monkeypatch.setenv("FP8OPS_SM90_PROMOTED_GEMM", "fastest")
    with pytest.raises(RuntimeError, match="FP8OPS_SM90_PROMOTED_GEMM must be"):
        promoted()


def test_gemm_strided_and_offset_inputs():
    """Views whose rows are not 16-byte aligned or not K-major are copied, never misread."""
    m, n, k = 64, 96, 160
    qa, sa, qb, sb = _operands(m + 1, n, k + 8, E4M3, E4M3, 3)
    a_view = qa[1:, 3:3 + k]  # base offset 3 + row stride k + 8: unaligned
    b_view = qb[:, :k]
    at_view = qa[:m, :k].t().contiguous().t()  # column-major [m, k]
    for a in (a_view, at_view):
        out = torch.ops.fp8ops.gemm(a, b_view, sa, sb, None, torch.float32, False)
        ref, mag = _ref64(a, sa, b_view, sb, None)
        _check(out, ref, mag, torch.float32, ACC_TOL[False], "strided inputs")


@pytest.mark.parametrize("op", ["gemm", "gemm_blockwise"])
@pytest.mark.parametrize("mnk", [(0, 64, 128), (32, 64, 0), (0, 0, 0), (8, 0, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_empty_problems(op, mnk, with_bias):
    m, n, k = mnk
    a = torch.randn(m, k, device="cuda").to(E4M3)
    b = torch.randn(n, k, device="cuda").to(E4M3)
    bias = torch.randn(n, device="cuda") if with_bias else None
    if op == "gemm":
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
        out = torch.ops.fp8ops.gemm(a, b, sa, sb, bias, torch.bfloat16, False)
        ref = emulation.gemm(a, b, sa, sb, bias, torch.bfloat16, False)
    else:
        kb = -(-k // 128)
        sa = torch.rand(m, kb, device="cuda") + 0.5
        sb = torch.rand(-(-n // 128), kb, device="cuda") + 0.5
        out = torch.ops.fp8ops.gemm_blockwise(a, b, sa, sb, bias, torch.bfloat16)
        ref = emulation.gemm_blockwise(a, b, sa, sb, bias, torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.equal(out, ref)


def _blockwise_operands(m, n, k, a_dtype, b_dtype, per_row_b, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Rows and K blocks of very different magnitudes: the per-block scales matter. Small enough
    # that float16 outputs never overflow (4095x2048x4096 reached 65504 with logspace(-2, 2)).
    a = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-3, 1, k, device="cuda")
    b = torch.randn(n, k, device="cuda", generator=g) * torch.logspace(1, -1, n, device="cuda")[:, None]
    qa, sa = torch.ops.fp8ops.quantize_blockwise(a, a_dtype, 1, 128, False)
    qb, sb = torch.ops.fp8ops.quantize_blockwise(b, b_dtype, 1 if per_row_b else 128, 128, False)
    return qa, sa, qb, sb


def _blockwise_ref64(qa, sa, qb, sb, bias):
    m, k = qa.shape
    n = qb.shape[0]
    ea = sa.double().repeat_interleave(128, 1)[:, :k]
    sbx = sb.double() if sb.shape[0] == n else sb.double().repeat_interleave(128, 0)[:n]
    eb = sbx.repeat_interleave(128, 1)[:, :k]
    ad, bd = qa.double() * ea, qb.double() * eb
    ref = ad @ bd.t()
    mag = ad.abs() @ bd.abs().t()
    if bias is not None:
        ref = ref + bias.double()
    return ref, mag


@pytest.mark.parametrize("shape", BLOCKWISE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pair", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("per_row_b", [False, True], ids=["b128x128", "b1x128"])
@pytest.mark.parametrize("out_dtype", OUTS, ids=str)
@pytest.mark.parametrize("bias_dtype", [None, torch.float32], ids=str)
def test_gemm_blockwise(shape, pair, per_row_b, out_dtype, bias_dtype):
    m, n, k = shape
    seed = _seed(shape, pair, per_row_b, out_dtype, bias_dtype)
    qa, sa, qb, sb = _blockwise_operands(m, n, k, pair[0], pair[1], per_row_b, seed)
    assert sb.shape[0] == (n if per_row_b else -(-n // 128))
    bias = _bias(n, bias_dtype, seed)
    _poison()
    out = torch.ops.fp8ops.gemm_blockwise(qa, qb, sa, sb, bias, out_dtype)
    torch.cuda.synchronize()
    ref64, mag = _blockwise_ref64(qa, sa, qb, sb, bias)
    _check(out, ref64, mag, out_dtype, ACC_TOL[False], "blockwise vs float64")
    emu = emulation.gemm_blockwise(qa, qb, sa, sb, bias, out_dtype)
    _check(out, emu.double(), mag, out_dtype, ACC_TOL[False] + 4 * OUT_EPS[out_dtype],
           "blockwise vs emulation")


def test_registered_and_opcheck():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fp8ops::gemm", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fp8ops::gemm_blockwise", "CUDA")
    assert backend.backend("cuda") == "cutlass_sm90"
    # torch's SchemaCheckMode compares inputs with torch.allclose, which has no float8 kernel
    # ("mul_cuda" not implemented for Float8_e4m3fn): a limitation of the checker, as on the CPU.
    tests = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    qa, sa, qb, sb = _operands(32, 48, 64, E4M3, E4M3, 5)
    torch.library.opcheck(torch.ops.fp8ops.gemm.default,
                          (qa, qb, sa, sb, None, torch.bfloat16, True), test_utils=tests)
    qa, sa, qb, sb = _blockwise_operands(32, 48, 256, E4M3, E4M3, False, 6)
    torch.library.opcheck(torch.ops.fp8ops.gemm_blockwise.default,
                          (qa, qb, sa, sb, None, torch.bfloat16), test_utils=tests)


CONFIGS = ["coop128", "pingpong64", "fast_pingpong128", "fast_coop256"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("shape", [(1, 17, 16), (300, 1001, 520), (2048, 2049, 272)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pair", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", OUTS, ids=str)
def test_every_tile_config(config, shape, pair, out_dtype, monkeypatch):
    """Each CUTLASS configuration, forced, on shapes with partial tiles and padded N."""
    monkeypatch.setenv("FP8OPS_SM90_GEMM_CONFIG", config)
    m, n, k = shape
    seed = _seed(config, shape, pair, out_dtype)
    qa, sa, qb, sb = _operands(m, n, k, pair[0], pair[1], seed)
    bias = _bias(n, torch.float32, seed)
    for fast_accum in (False, True):
        _poison()
        out = torch.ops.fp8ops.gemm(qa, qb, sa, sb, bias, out_dtype, fast_accum)
        torch.cuda.synchronize()
        ref64, mag = _ref64(qa, sa, qb, sb, bias)
        _check(out, ref64, mag, out_dtype, ACC_TOL[fast_accum], f"{config} fast_accum={fast_accum}")


def test_gemm_on_a_side_stream():
    """The kernels run on the current stream: results on a side stream, in order with its work."""
    qa, sa, qb, sb = _operands(512, 1001, 384, E4M3, E4M3, 21)
    ref = torch.ops.fp8ops.gemm(qa, qb, sa, sb, None, torch.float32, False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000)  # keep the side stream busy: a wrong stream would race ahead
        out = torch.ops.fp8ops.gemm(qa, qb, sa, sb, None, torch.float32, False)
        blk = torch.ops.fp8ops.gemm_blockwise(qa, qb, torch.ones(512, 3, device="cuda"),
                                              torch.ones(8, 3, device="cuda"), None, torch.float32)
    side.synchronize()
    assert torch.equal(out, ref)
    ref_blk = emulation.gemm_blockwise(qa, qb, torch.ones(512, 3, device="cuda"),
                                        torch.ones(8, 3, device="cuda"), None, torch.float32)
    _, mag = _ref64(qa, sa, qb, sb, None)
    _check(blk, ref_blk.double(), mag / (sa * sb).double(), torch.float32, ACC_TOL[False] + 4 * OUT_EPS[torch.float32],
           "blockwise on a side stream")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gemm_on_a_non_current_device():
    qa, sa, qb, sb = [t.to("cuda:1") for t in _operands(64, 1001, 128, E4M3, E4M3, 22)]
    assert torch.cuda.current_device() == 0
    out = torch.ops.fp8ops.gemm(qa, qb, sa, sb, None, torch.float32, False)
    assert out.device == qa.device
    ref, mag = _ref64(qa, sa, qb, sb, None)
    _check(out, ref, mag, torch.float32, ACC_TOL[False], "non-current device")


def test_bad_arguments_raise_clearly():
    qa, sa, qb, sb = _operands(16, 32, 64, E4M3, E4M3, 9)
    with pytest.raises(RuntimeError, match="K mismatch"):
        torch.ops.fp8ops.gemm(qa, qb[:, :48], sa, sb, None, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="out_dtype"):
        torch.ops.fp8ops.gemm(qa, qb, sa, sb, None, torch.int32, False)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.fp8ops.gemm(qa, qb, sa, sb, torch.zeros(31, device="cuda"), torch.bfloat16, False)
