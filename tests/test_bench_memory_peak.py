"""The peak memory of one training step per memory-saving configuration (bench/bench_memory.py
--peak), measured on the CPU with torch's MemTracker at a size where the ratios are those of the
bench's default size: a Llama of d_model 128, 4 layers, batch 2 x 256 tokens (1.1M parameters,
the embedding and LM head 6% of them; 4 tokens a model dimension, so that activations are most
of the baseline's peak, as in training without activation checkpointing).

The goal, "bf16 parameters + FP8 Linears + FP8AdamW + FP8 activations" at <= 0.50x of the
baseline's peak (float32 parameters, bf16 autocast, torch AdamW), is met without the CPU
emulation's kept scratch buffers once fp8_activations covers attention (the "fp8_attention" row,
fp8_activations(attention=True)): 0.449x here (0.611x with the scratch buffers); without
attention, fp8_activations() (its SwiGLU product included) is at 0.515x. The peak is at the
start of backward, where the activations saved for it are the largest part; the FP8 weight
casts (1-byte data plus its transposed copy: 2 bytes a parameter, as much as the bf16
parameter) are next. The scratch buffers
(fp8ops.ops.scratch, alive through the step) and the float32 decodes of FP8 operands are the
emulation's: a GPU FP8 GEMM makes neither, so the CPU figures of the FP8
configurations are upper bounds of a GPU's; the offload row is host plus device memory here, so
only its device state is checked."""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_memory  # noqa: E402

SIZE = dict(d_model=128, n_layer=4, seq=256, batch=2)
CHAIN = ("baseline", "fp8_linear", "fp8_adamw", "bf16_params", "fp8_activations")


@pytest.fixture(scope="module")
def rows():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (conftest.py's one_thread says why)
    try:
        cfg = bench_memory.llama_config(SIZE["d_model"], SIZE["n_layer"], SIZE["seq"])
        device = torch.device("cpu")
        out = {c: bench_memory.measure_peak(c, cfg, SIZE["batch"], device)
               for c in bench_memory.PEAK_CONFIGS}
        print(bench_memory.peak_table(list(out.values()), cfg, SIZE["batch"], device))
        return out
    finally:
        torch.set_num_threads(threads)


def test_tracker_counts_bytes_of_fp8_and_bf16_tensors():
    from torch.distributed._tools.mem_tracker import MemTracker
    kept = torch.zeros(1000, dtype=torch.bfloat16)
    tracker = MemTracker()
    tracker.track_external(kept)
    with tracker:
        before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
        a = torch.ones(1024, 3).to(torch.float8_e4m3fn)  # the float32 ones are freed
        b = torch.ones(4096, dtype=torch.bfloat16)
        after = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
    assert before == 2000
    assert after - before == 3 * 1024 + 2 * 4096
    del a, b


def test_tracker_counts_what_exists_before_the_step(rows):
    """Parameters, buffers, optimizer state, the batch, cached FP8 casts, offload masters and
    scratch: the tracker's count at the step's start is that of the same storages counted
    directly, in every configuration."""
    for r in rows.values():
        assert r["at_entry"] == r["expected_entry"] > 0, r["config"]


def test_tracker_agrees_with_the_cpu_allocator(rows):
    """The step's peak growth over its start, as the tracker counts it (tensors that ops return)
    and as the CPU allocator does (every block, temporaries inside an op too, from
    torch.profiler's memory events): equal at this size; within 1% allows for a temporary that
    an op allocates and frees inside itself, which the tracker cannot see (at the bench's
    default size the allocator's peak is 0.84% higher in the two FP8 rows with float32
    parameters)."""
    for r in rows.values():
        growth = r["peak"] - r["at_entry"]
        assert abs(r["allocator_growth"] - growth) <= 0.01 * growth, (r["config"], growth,
                                                                      r["allocator_growth"])


def test_sizes_are_representative(rows):
    base = rows["baseline"]
    cfg = bench_memory.llama_config(SIZE["d_model"], SIZE["n_layer"], SIZE["seq"])
    outside_blocks = 2 * cfg.vocab_size * cfg.d_model
    assert outside_blocks < 0.1 * base["n_params"]
    # the peak is in backward, and the activations are its largest part
    assert base["phase"] == "backward"
    assert base["categories"]["Activation"] > 0.5 * base["peak"]


def test_each_feature_lowers_the_peak(rows):
    """Without the emulation's scratch, every feature lowers the peak; with it, FP8 Linears
    alone raise the CPU peak (their scratch is more than the bytes they save), the features
    after them lower it."""
    less = [rows[c]["peak_less_scratch"] for c in CHAIN]
    assert all(b <= a for a, b in zip(less, less[1:])), less
    raw = [rows[c]["peak"] for c in CHAIN[1:]]
    assert all(b <= a for a, b in zip(raw, raw[1:])), raw
    # offload: what stays on the device is below the full configuration's device state
    full, off = rows["fp8_activations"]["device_state"], rows["offload"]["device_state"]
    assert off["total"] < 0.5 * full["total"]
    assert off["optimizer_state"] == 0 and off["gradients"] == 0


def test_full_configuration_peak_meets_half_less_scratch(rows):
    """The goal, without the emulation's scratch: measured 0.449x; with it 0.611x (a GPU FP8
    GEMM keeps no such buffers). Without attention covered: 0.515x."""
    base, full = rows["baseline"], rows["fp8_attention"]
    assert full["peak_less_scratch"] <= 0.50 * base["peak_less_scratch"]
    assert full["peak"] <= 0.65 * base["peak"]
    assert full["phase"] == "backward"
    assert rows["fp8_activations"]["peak_less_scratch"] <= 0.55 * base["peak_less_scratch"]


@pytest.mark.parametrize("limit, cap, expected", [
    (37, 256, (37, "")), (1000, 64, (64, "cap")), (0, 256, (0, "none")), (1, 256, (1, ""))])
def test_largest_batch_search(monkeypatch, limit, cap, expected):
    """The CUDA search's logic, on a stand-in for the step that runs out of memory above
    `limit` (the search itself needs a GPU)."""
    tried = []

    def build(config, cfg, batch, device, seed=0):
        tried.append(batch)
        if batch > limit:
            raise torch.cuda.OutOfMemoryError("stand-in")
        return None, None, lambda: None, None

    monkeypatch.setattr(bench_memory, "build_peak_step", build)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert bench_memory.largest_batch("baseline", None, None, cap=cap) == expected
    assert len(tried) <= 16


def test_cli_peak_smoke(tmp_path, capsys):
    rows = bench_memory.main(["--peak", "--smoke", "--no-gpu", "--out", str(tmp_path),
                              "--configs", "baseline,fp8_activations"])
    table = (tmp_path / "memory_peak.md").read_text()
    assert table in capsys.readouterr().out
    assert [r["config"] for r in rows] == ["baseline", "fp8_activations"]
    for r in rows:
        assert f"| {r['label']} | {r['peak']} |" in table


def test_gpu_table(monkeypatch):
    """The CUDA table's columns, from made-up rows (the CUDA run itself needs a GPU): the two
    counts side by side, flagged past 5% apart, and the largest batch."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(bench_memory.fp8ops, "backend", lambda device: "cuda")
    cats = dict.fromkeys(bench_memory.CATEGORIES, 0)
    rows = [dict(config=c, label=bench_memory.PEAK_CONFIGS[c], peak=peak, cuda_peak=cuda,
                 n_params=100, phase="backward", categories=cats, at_entry=1, expected_entry=1,
                 device_state={}, scratch=0, peak_less_scratch=peak, allocator_growth=None)
            for c, peak, cuda in (("baseline", 1000, 1040), ("fp8_linear", 500, 600))]
    cfg = bench_memory.llama_config(128, 2, 64)
    table = bench_memory.peak_table(rows, cfg, 2, torch.device("cuda", 0),
                                    {"baseline": (37, ""), "fp8_linear": (256, "cap")})
    assert "| 1040 | 37 |" in table
    assert "| 600 (differs > 5%) | 256 (cap) |" in table
    assert "| 0.500x | 5.00 |" in table
