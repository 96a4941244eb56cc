"""bench/bench_comm.py counts the collectives of one FSDP2 step (tiny GPT, 2 gloo processes):
CurrentScaling's FP8 weight all-gather moves half the bytes of bf16 FSDP2's, with one amax
all-reduce for all its layers, and the table is written."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_comm  # noqa: E402


def test_bench_comm_tiny(tmp_path):
    out = tmp_path / "comm.md"
    results = bench_comm.main(["--models", "tiny", "--recipes", "current", "--gathers", "fp8",
                               "--out", str(out)])
    bf16, fp8 = results["tiny", "bf16"], results["tiny", "current:fp8"]
    assert fp8["fp8_gathered"] == fp8["converted"] and len(fp8["converted"]) == 4
    # the four FP8Linear weights: 1 byte per element against 2, exactly (the scale is not sent)
    assert fp8["weight_bytes"] * 2 == bf16["weight_bytes"] > 0
    # the whole step: biases, LayerNorms, embeddings and LM head still go in bf16
    ratio = fp8["bytes"]["all_gather"] / bf16["bytes"]["all_gather"]
    assert 0.5 < ratio < 0.7, ratio
    assert fp8["calls"]["all_gather"] == bf16["calls"]["all_gather"] == 3  # root, block x2
    # gradients reduce-scatter in bf16 either way
    assert fp8["bytes"]["reduce_scatter"] == bf16["bytes"]["reduce_scatter"] > 0
    assert fp8["calls"]["all_reduce"] == 1 and bf16["calls"]["all_reduce"] == 0
    assert fp8["calls"]["other"] == bf16["calls"]["other"] == 0
    table = out.read_text()
    assert "| tiny | current | FP8 | 4/4 |" in table and "| 0.5000 |" in table, table
    assert (tmp_path / "comm.json").exists()


def test_bench_comm_one_process_has_no_all_gather_ratio(tmp_path):
    """FSDP2 in one process gathers nothing: the table says nan rather than dividing by 0."""
    out = tmp_path / "comm.md"
    results = bench_comm.main(["--world", "1", "--models", "tiny", "--recipes", "current",
                               "--gathers", "fp8", "--out", str(out)])
    assert results["tiny", "bf16"]["bytes"]["all_gather"] == 0
    rows = {r["recipe"]: r for r in bench_comm.rows(results)}
    assert all(r["all_gather_ratio"] != r["all_gather_ratio"] for r in rows.values())  # nan
    assert "| tiny | current | FP8 |" in out.read_text()


def test_bench_comm_gradient_reductions(tmp_path):
    """FP8 gradients: FSDP2's reduce-scatter and DDP's hook send at most 0.53x / 0.55x of the
    bytes of their bf16 reductions (about 1.03 bytes a value against 2), and nothing else."""
    out = tmp_path / "comm.md"
    results = bench_comm.main(["--models", "tiny", "--recipes", "current", "--gathers", "fp8",
                               "--out", str(out)])
    rows = {(r["engine"], r["sent"]): r for r in bench_comm._comm_reductions.rows(results)}
    assert set(rows) == {tuple(s.split(":")) for s in bench_comm._comm_reductions.SETUPS}
    assert rows["fsdp", "float32"]["gradient_bytes"] == 2 * rows["fsdp", "bf16"]["gradient_bytes"]
    assert rows["ddp", "float32"]["gradient_bytes"] == 2 * rows["ddp", "bf16"]["gradient_bytes"]
    fsdp, ddp = rows["fsdp", "fp8"], rows["ddp", "fp8"]
    assert 0.5 < fsdp["ratio"] <= 0.53 and fsdp["reduce_scatter_bytes"] == 0
    assert 0.5 < ddp["ratio"] <= 0.55 and ddp["all_reduce_bytes"] == 0
    assert "| tiny | FSDP | fp8 |" in out.read_text()
