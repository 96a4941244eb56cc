"""bench/profile_linear.py runs end to end on the CPU (--smoke): host times of the bf16 and the FP8
steps and a profiler table of each FP8 step, in which the fp8ops ops appear."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_linear.py"),
                           *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def test_smoke_profiles_every_variant():
    proc = _run("--device", "cpu", "--smoke", "--rows", "40")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("bf16", "current", "delayed"):
        assert f"== {name} M=64 K=128 N=96: host " in proc.stdout, proc.stdout
    assert "fp8ops::quantize_current" in proc.stdout and "fp8ops::quantize_delayed" in proc.stdout
    assert "fp8ops::gemm" in proc.stdout


def test_cpu_without_smoke_is_refused():
    proc = _run("--device", "cpu")
    assert proc.returncode != 0 and "only with --smoke" in proc.stderr


def test_smoke_op_costs_and_python_profile():
    proc = _run("--device", "cpu", "--smoke", "--ops", "--python", "--rows", "10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== host us per call" in proc.stdout
    for name in ("torch.mm bf16", "fp8ops quantize_current (transpose)",
                 "fp8ops quantize_delayed (update, record)", "fp8ops gemm promoted"):
        assert name in proc.stdout, proc.stdout
    for recipe in ("current", "delayed"):
        assert f"== cProfile {recipe}: fp8ops's own functions" in proc.stdout, proc.stdout
