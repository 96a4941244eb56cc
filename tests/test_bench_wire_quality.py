"""bench/bench_wire_quality.py trains the demo under torchrun with and without FP8 gradients
(2 seeds, 2 steps, 2 gloo processes) and writes its table, data and plot."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_wire_quality  # noqa: E402


def test_bench_wire_quality_tiny(tmp_path):
    rows = bench_wire_quality.main(["--seeds", "0,1", "--steps", "2", "--recipes", "baseline",
                                    "--out", str(tmp_path)])
    (row,) = rows
    assert row["recipe"] == "baseline" and len(row["gaps"]) == 2
    assert all(math.isfinite(v) for v in (row["off"], row["on"], row["gap"], row["spread"]))
    assert row["spread"] > 0  # two seeds train apart
    assert "| baseline |" in (tmp_path / "wire_quality.md").read_text()
    assert json.loads((tmp_path / "wire_quality.json").read_text())["seeds"] == [0, 1]
    assert (tmp_path / "wire_quality.png").stat().st_size > 0


def test_one_seed_is_refused():
    with pytest.raises(SystemExit):
        bench_wire_quality.parse_args(["--seeds", "0"])
