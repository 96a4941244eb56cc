"""bench/bench_block.py runs end to end on the CPU (--smoke, a tiny Llama-shaped block, eager
only): a training step for bf16 and every recipe, each in a table row with a time and a speed-up.
The timings of a smoke run mean nothing; the test checks only that every variant ran."""
from __future__ import annotations

import pytest

from test_bench_linear import RECIPES, _is_number, run_smoke

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py says why)


def test_bench_block_smoke(tmp_path, capsys):
    stdout = run_smoke(capsys, "bench_block", tmp_path)
    table = (tmp_path / "block.md").read_text()
    assert table in stdout and "NOT a measurement" in table
    assert "hidden 64, ffn 128, 4 heads, 2 KV heads, batch 1 x seq 32" in table
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line
            for line in table.splitlines() if line.startswith("| eager |")}
    assert set(rows) == {("eager", name) for name in ["bf16"] + RECIPES}, table
    for line in rows.values():
        ms, speed_up = (c.strip() for c in line.strip("|").split("|")[2:])
        assert _is_number(ms) and _is_number(speed_up), line
    assert "| graph |" not in table  # no CUDA graphs on the CPU


def test_bench_block_with_one_attention_backend(tmp_path, capsys):
    """--sdpa pins scaled_dot_product_attention to one backend (the math one runs on the CPU)."""
    run_smoke(capsys, "bench_block", tmp_path, "--sdpa", "math", "--recipes", "current")
    table = (tmp_path / "block.md").read_text()
    assert "attention backend: math" in table, table
    assert "| eager | current |" in table and "Error" not in table, table
    # and it reaches the attention: cuDNN's has no CPU kernel, so every variant reports that
    run_smoke(capsys, "bench_block", tmp_path, "--sdpa", "cudnn", "--recipes", "current")
    table = (tmp_path / "block.md").read_text()
    assert table.count("No viable backend for scaled_dot_product_attention") == 2, table
