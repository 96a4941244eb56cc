"""bench/bench_activations.py runs end to end on the CPU (--smoke): a row per model with its
saved bytes, peak and step time with and without fp8_activations. The smoke run's times mean
nothing; its saved bytes are exact, and the context must lower them."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_activations  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py says why)


def test_bench_activations_smoke(tmp_path, capsys):
    rows = bench_activations.main(["--device", "cpu", "--smoke", "--out", str(tmp_path)])
    table = (tmp_path / "activations.md").read_text()
    assert table in capsys.readouterr().out
    assert [r["model"] for r in rows] == ["gpt", "llama"]
    for r in rows:
        assert r["saved"][1] < r["saved"][0]
        assert all(isinstance(v, float) and v > 0 for v in r["ms"])
        assert f"| {r['model']} |" in table
