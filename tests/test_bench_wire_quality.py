"""bench/bench_wire_quality.py trains the demo under torchrun with and without FP8 gradients
(FSDP2 and DDP; 2 seeds, 2 steps, 2 gloo processes) and writes its table, data and plot."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_wire_quality  # noqa: E402


@pytest.mark.parametrize("engine", ["fsdp", "ddp"])
def test_bench_wire_quality_tiny(tmp_path, engine):
    rows = bench_wire_quality.main(["--engine", engine, "--seeds", "0,1", "--steps", "2",
                                    "--recipes", "baseline", "--out", str(tmp_path)])
    (row,) = rows
    assert row["recipe"] == "baseline" and len(row["gaps"]) == 2
    assert all(math.isfinite(v) for v in (row["off"], row["on"], row["gap"], row["spread"]))
    assert row["spread"] > 0  # two seeds train apart
    assert "| baseline |" in (tmp_path / f"wire_quality_{engine}.md").read_text()
    saved = json.loads((tmp_path / f"wire_quality_{engine}.json").read_text())
    assert saved["seeds"] == [0, 1] and saved["engine"] == engine
    assert (tmp_path / f"wire_quality_{engine}.png").stat().st_size > 0


def test_one_seed_is_refused():
    with pytest.raises(SystemExit):
        bench_wire_quality.parse_args(["--seeds", "0"])
