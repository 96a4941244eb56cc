"""bench/profile_linear.py runs end to end on the CPU (--smoke): host times of the bf16 and the FP8
steps and a profiler table of each FP8 step, in which the fp8ops ops appear. Its main() runs in
this process, as the other benchmarks' smoke runs do (tests/test_bench_linear.py says why)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import profile_linear  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py says why)


def test_smoke_profiles_every_variant():
    out = profile_linear.main(["--device", "cpu", "--smoke", "--rows", "40"])
    for name in ("bf16", "current", "delayed", "current:python", "delayed:python"):
        assert f"== {name} M=64 K=128 N=96: host " in out, out
    # the C++ step, and the ops it calls through the dispatcher
    assert "fp8ops_step::linear_current" in out and "fp8ops_step::linear_delayed" in out
    assert "fp8ops::quantize_current" in out and "fp8ops::quantize_delayed" in out
    assert "fp8ops::gemm" in out


def test_cpu_without_smoke_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        profile_linear.main(["--device", "cpu"])
    assert exit_.value.code != 0 and "only with --smoke" in capsys.readouterr().err


def test_smoke_op_costs_and_python_profile():
    out = profile_linear.main(["--device", "cpu", "--smoke", "--ops", "--python", "--rows", "10"])
    assert "== host us per call" in out
    for name in ("torch.mm bf16", "fp8ops quantize_current (transpose)",
                 "fp8ops quantize_delayed (update, record)", "fp8ops gemm promoted"):
        assert name in out, out
    for recipe in ("current", "delayed"):
        assert f"== cProfile {recipe}: fp8ops's own functions" in out, out
