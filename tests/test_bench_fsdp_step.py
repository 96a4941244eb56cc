"""bench/bench_fsdp_step.py runs every setup side by side (tiny GPT, 2 gloo processes) and reports
the ratios the GPU figures are read from."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_fsdp_step  # noqa: E402


def test_bench_fsdp_step_tiny(capsys):
    results = bench_fsdp_step.main(["--models", "tiny", "--recipes", "current", "--steps", "1",
                                    "--rounds", "2"])
    times = results["tiny"]
    assert set(times) == {"bf16", "current:bf16", "current:fp8"}
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())
    out = capsys.readouterr().out
    assert "| tiny | current:fp8 |" in out and "| tiny | bf16 |" in out


def test_bench_fsdp_step_profiles_one_step_per_setup(capsys):
    bench_fsdp_step.main(["--world", "1", "--models", "tiny", "--recipes", "current",
                          "--steps", "1", "--rounds", "1", "--profile", "5"])
    out = capsys.readouterr().out
    assert out.count("## profile: tiny ") == 3 and "## profile: tiny current:fp8" in out
    assert "host operators: " in out and "Self CPU" in out
