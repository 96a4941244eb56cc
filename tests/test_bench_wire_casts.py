"""bench/bench_wire_casts.py runs (a CPU smoke run: the GPU's figures need a GPU)."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_wire_casts  # noqa: E402


def test_bench_wire_casts_smoke(tmp_path):
    rows = bench_wire_casts.main(["--device", "cpu", "--sizes-mb", "0.5", "--world", "3",
                                  "--out", str(tmp_path)])
    (row,) = rows
    assert row["values"] % 3 == 0 and set(row["ms"]) == {"copy", "encode", "decode_sum"}
    assert all(ms > 0 for ms in row["ms"].values())
    assert "| 0.5 |" in (tmp_path / "wire_casts.md").read_text()
