"""The CUTLASS sm90 GEMMs accept every problem the binding gives them, checked on the host (no
GPU): tests/csrc/gemm_can_implement.cu builds fp8ops' exact kernel types and asks CUTLASS's
can_implement for the padded problem of every shape in tests/gemm_shapes.py, for each
configuration and output dtype. The same shapes run through the emulation here and through the
kernels in tests/test_gemm_gpu.py, so neither backend rejects what the other accepts."""
import os
import shutil
import subprocess
from importlib.util import find_spec

import pytest
import torch

import fp8ops  # noqa: F401
from fp8ops.ops import emulation
from gemm_shapes import BLOCKWISE_SHAPES, GEMM_SHAPES, HOST_ONLY_SHAPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["coop128", "pingpong64", "fast_pingpong128", "fast_coop256", "blockwise_b128x128",
           "blockwise_b1x128"]


def _nvcc():
    cands = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            cands.append(os.path.join(home, "bin", "nvcc"))
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _cutlass_include():
    root = os.environ.get("CUTLASS_PATH")
    if root:
        return os.path.join(root, "include")
    spec = find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "source", "include")


def _build(tmp_path_factory, name: str) -> str:
    """tests/csrc/<name>.cu built for the host with fp8ops' CUTLASS flags: the executable."""
    nvcc, include = _nvcc(), _cutlass_include()
    if nvcc is None or include is None:
        pytest.skip("needs nvcc and the CUTLASS headers (pip install --no-deps nvidia-cutlass)")
    exe = str(tmp_path_factory.mktemp(name) / name)
    cmd = [nvcc, "-std=c++17", "-O1", "-DNDEBUG", "--expt-relaxed-constexpr",
           "-gencode=arch=compute_90a,code=sm_90a", "-I", os.path.join(ROOT, "csrc"), "-I", include,
           os.path.join(ROOT, "tests", "csrc", name + ".cu"), "-o", exe]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return exe


@pytest.fixture(scope="module")
def can_implement(tmp_path_factory):
    exe = _build(tmp_path_factory, "gemm_can_implement")

    def run(problems):
        text = "\n".join(f"{m} {n} {k} {out} {mode}" for m, n, k, out, mode in problems) + "\n"
        p = subprocess.run([exe], input=text, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        results, problem = {}, None
        for line in p.stdout.splitlines():
            words = line.split()
            if words[0] == "problem":
                problem = tuple(words[1:])
            else:
                results[problem + (words[0],)] = " ".join(words[1:])
        return results

    return run


def test_every_configuration_accepts_every_padded_shape(can_implement):
    shapes = sorted(set(GEMM_SHAPES + BLOCKWISE_SHAPES + HOST_ONLY_SHAPES))
    problems = [(m, n, k, out, "padded") for m, n, k in shapes for out in ("bf16", "f32")]
    results = can_implement(problems)
    assert len(results) == len(problems) * len(CONFIGS)
    bad = {key: v for key, v in results.items() if v != "ok"}
    assert not bad, f"CUTLASS rejects {len(bad)} padded problems, e.g. {sorted(bad.items())[:5]}"


def test_the_check_rejects_unpadded_n(can_implement):
    """Without the padding, N = 17 (bf16) breaks TMA's 16-byte rule: the check must say so."""
    results = can_implement([(64, 17, 64, "bf16", "raw"), (64, 1001, 64, "f32", "raw")])
    assert results[("64", "17", "64", "bf16", "raw", "fast_coop256")].startswith("FAIL")
    assert results[("64", "1001", "64", "f32", "raw", "coop128")].startswith("FAIL")


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_emulation_accepts_every_gemm_shape(shape):
    m, n, k = shape
    g = torch.Generator().manual_seed(m * 7 + n)
    a = torch.randn(m, k, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn)
    s = torch.tensor(0.5)
    bias = torch.randn(n, generator=g)
    out = torch.ops.fp8ops.gemm(a, b, s, s, bias, torch.bfloat16, False)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    ref = (a.double() @ b.double().t()) * 0.25 + bias.double()
    mag = (a.double().abs() @ b.double().abs().t()) * 0.25 + bias.double().abs()
    assert ((out.double() - ref).abs() <= mag * 2.0 ** -7).all()


@pytest.mark.parametrize("shape", BLOCKWISE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("per_row_b", [False, True], ids=["b128x128", "b1x128"])
def test_emulation_accepts_every_blockwise_shape(shape, per_row_b):
    m, n, k = shape
    kb = -(-k // 128)
    g = torch.Generator().manual_seed(m * 5 + n)
    a = torch.randn(m, k, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn)
    sa = torch.rand(m, kb, generator=g) + 0.5
    sb = torch.rand(n if per_row_b else -(-n // 128), kb, generator=g) + 0.5
    out = emulation.gemm_blockwise(a, b, sa, sb, None, torch.float32)
    assert out.shape == (m, n)
    ea = sa.double().repeat_interleave(128, 1)[:, :k]
    eb = (sb.double() if per_row_b else sb.double().repeat_interleave(128, 0)[:n])
    ad, bd = a.double() * ea, b.double() * eb.repeat_interleave(128, 1)[:, :k]
    ref, mag = ad @ bd.t(), ad.abs() @ bd.abs().t()
    assert ((out.double() - ref).abs() <= mag * 2.0 ** -20).all()


# ---- the grouped (MoE) GEMM: every group's problem as the setup kernel makes it ----------------
@pytest.fixture(scope="module")
def grouped_can_implement(tmp_path_factory):
    exe = _build(tmp_path_factory, "grouped_can_implement")

    def run(cases):
        text = "\n".join(f"{kind} {out} {m} {n} {k} {len(ends)} " + " ".join(map(str, ends))
                         for kind, out, m, n, k, ends in cases) + "\n"
        p = subprocess.run([exe], input=text, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        results, case = [], None
        for line in p.stdout.splitlines():
            if line == "case":
                case = {}
                results.append(case)
            else:
                name, verdict = line.split(" ", 1)
                case[name] = verdict
        return results

    return run


def _ends(sizes):
    return torch.tensor(sizes).cumsum(0).tolist()


GROUPED_SIZES = [[5, 0, 200, 77], [0, 0, 0], [1, 2, 3, 5, 7, 11, 13, 17], [128, 256, 384], [300]]


def test_grouped_kernel_accepts_every_group_problem_the_op_lets_through(grouped_can_implement):
    """What ops/grouped.py's sm90_suits sends to the kernel (K a multiple of 16, 16-byte output
    rows), with ragged, empty and tiny groups and rows past the last group: CUTLASS accepts every
    group's problem, the wgrad's packed (16-column) reductions included."""
    cases = []
    for sizes in GROUPED_SIZES:
        m = sum(sizes) + 9
        for out, n in (("bf16", 96), ("bf16", 4104), ("f32", 100)):
            cases.append(("rows", out, m, n, 160, _ends(sizes)))
            cases.append(("wgrad", out, m, n, n, _ends(sizes)))  # dW [E, n, k = n]
    results = grouped_can_implement(cases)
    assert len(results) == len(cases)
    bad = [(c, r) for c, r in zip(cases, results) if set(r.values()) != {"ok"} or len(r) != 2]
    assert not bad, bad[:3]


def test_grouped_check_rejects_what_the_op_keeps_on_the_emulation(grouped_can_implement):
    """K not a multiple of 16, or output rows not 16 bytes: CUTLASS says no, which is why
    sm90_suits sends these to the emulation (and shows this check can fail)."""
    results = grouped_can_implement([("rows", "bf16", 400, 96, 24, [100, 400]),
                                     ("rows", "bf16", 400, 12, 160, [100, 400])])
    assert all(v.startswith("FAIL") for r in results for v in r.values()), results
