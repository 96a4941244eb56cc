"""bench/bench_comm_ep.py counts the collectives of one expert-parallel step (small MoE MLP, 2
gloo processes): the FP8 dispatch and the combine's FP8 gradient move about half the bytes of
bf16's, everything else is the same, and the table is written."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_comm_ep  # noqa: E402


def test_bench_comm_ep_small(tmp_path):
    out = tmp_path / "comm_ep.md"
    results = bench_comm_ep.main(["--world", "2", "--experts", "4", "--d-model", "128",
                                  "--tokens", "64", "--out", str(out)])
    tokens, d, world = 64, 128, 2
    for recipe in ("current", "blockwise"):
        bf16, fp8 = results[2, recipe, False], results[2, recipe, True]
        # bf16: every rank sends its tokens and gets their outputs back, both ways
        for phase in ("dispatch", "combine", "combine_grad", "dispatch_grad"):
            assert bf16[phase] == world * tokens * d * 2, (phase, bf16)
        assert fp8["counts"] == bf16["counts"] == world * 4 * 8  # int64 [E] from each rank
        # FP8: one byte per element, plus the 1x128 float32 scales beside blockwise rows
        fp8_rows = world * tokens * (d + (4 * d // 128 if recipe == "blockwise" else 0))
        assert fp8["dispatch"] == fp8["combine_grad"] == fp8_rows, fp8
        assert fp8["combine"] == bf16["combine"] and fp8["dispatch_grad"] == bf16["dispatch_grad"]
        # current scaling: a MAX all-reduce of [4] float32 amaxes, forward and backward
        assert fp8["amax"] == (world * 2 * 4 * 4 if recipe == "current" else 0)
        assert bf16["amax"] == 0
    rows = {(r["recipe"], r["wire"]): r for r in bench_comm_ep.rows(results)}
    assert rows["blockwise", "FP8"]["dispatch_ratio"] <= 0.55
    assert rows["current", "FP8"]["dispatch_ratio"] == 0.5
    table = out.read_text()
    assert "| 2 | blockwise | FP8 |" in table and "| 0.5156 |" in table, table
    assert json.loads((tmp_path / "comm_ep.json").read_text())["rows"]


def test_bench_comm_ep_refuses_a_world_that_does_not_split_the_experts(capsys):
    import pytest
    with pytest.raises(SystemExit):
        bench_comm_ep.main(["--world", "3", "--experts", "4"])
    assert "divide --experts 4" in capsys.readouterr().err
