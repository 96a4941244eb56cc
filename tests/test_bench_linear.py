"""bench/bench_linear.py runs end to end on the CPU (--smoke): a training step for bf16 and every
recipe, side by side, with a speed-up column per recipe and the geomean row. The timings of a
smoke run mean nothing; the test checks only that every variant ran and the table is complete.

The smoke runs call the benchmarks' main() in this process, on one thread (conftest.py's
one_thread), with no timeout. A subprocess imports torch and torch._dynamo (which the first
optimizer imports) anew for each run: on a loaded 2-core machine they took 6.5 s and 8 s of a
22 s run whose steps took 2.4 s."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_linear  # noqa: E402

RECIPES = ["current", "delayed", "mxfp8", "blockwise"]
pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py says why)


def run_smoke(capsys, module, out, *extra):
    """bench/<module>.py --device cpu --smoke --out <out> <extra>: what it printed."""
    importlib.import_module(module).main(["--device", "cpu", "--smoke", "--out", str(out), *extra])
    return capsys.readouterr().out


def _is_number(cell):
    try:
        return float(cell) > 0
    except ValueError:
        return False


def test_bench_linear_smoke(tmp_path, capsys):
    stdout = run_smoke(capsys, "bench_linear", tmp_path)
    table = (tmp_path / "linear.md").read_text()
    assert table in stdout and "NOT a measurement" in table
    assert "| " + " | ".join(f"{r} speed-up" for r in RECIPES) + " |" in table, table
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    shapes = [r for r in rows if r[0].strip().isdigit()]
    assert [tuple(int(c) for c in r[:3]) for r in shapes] == [(64, 128, 96), (32, 64, 64)]
    for r in shapes:  # bf16 ms, then one speed-up per recipe: every variant ran
        assert all(_is_number(c) for c in r[3:]) and len(r) == 4 + len(RECIPES), r
    geomean = [r for r in rows if r[0].strip() == "geomean"]
    assert len(geomean) == 1 and all(_is_number(c) for c in geomean[0][4:]), table
    for kind in ("CurrentScaling", "DelayedScaling", "MXFP8Scaling", "BlockwiseScaling"):
        assert f"'{kind}'): Crossover(min_tokens=" in table, kind  # a row per recipe


def test_bench_linear_with_the_fallback_applied(tmp_path, capsys):
    """--with-auto adds a column per recipe with fallback="auto" (what a user gets); the
    crossover rows still come from the FP8-everywhere columns only."""
    run_smoke(capsys, "bench_linear", tmp_path, "--recipes", "current,delayed", "--with-auto")
    table = (tmp_path / "linear.md").read_text()
    head = "| current speed-up | delayed speed-up | current auto speed-up | delayed auto speed-up |"
    assert head in table, table
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    assert all(_is_number(c) for r in rows if r[0].strip().isdigit() for c in r[3:]), table
    assert table.count("Crossover(min_tokens=") == 2, table


def test_crossover_runs_fp8_only_where_it_was_measured_faster():
    measured = [((16384, 8192, 7168), 1.6), ((16384, 8192, 1280), 1.3), ((4096, 4096, 4096), 1.1),
                ((1024, 4096, 4096), 0.8), ((4096, 512, 512), 0.6), ((16384, 4096, 14336), None)]
    # the 4096^3 shape cannot run FP8 without the unknown one (no threshold parts them), so the
    # two fast K = 8192 shapes do, with the largest thresholds that keep them
    assert bench_linear.crossover(measured) == \
        "Crossover(min_tokens=16384, min_in_features=8192, min_out_features=1280)"
    measured[-1] = ((16384, 4096, 14336), 1.4)  # now measured fast: 4096^3 joins
    assert bench_linear.crossover(measured) == \
        "Crossover(min_tokens=4096, min_in_features=4096, min_out_features=1280)"
    # nothing faster than bf16: nothing runs FP8
    assert bench_linear.crossover([((64, 64, 64), 0.5)]) == \
        "Crossover(min_tokens=65, min_in_features=65, min_out_features=65)"


def test_graph_mode_needs_cuda_and_prints_no_crossover_rows(capsys):
    """--graph replays forward and backward from CUDA graphs: on the CPU it is refused at once;
    its table says so and leaves out the fallback's rows (they are read from eager runs)."""
    with pytest.raises(SystemExit) as exit_:
        bench_linear.main(["--device", "cpu", "--graph", "--smoke"])
    err = capsys.readouterr().err
    assert exit_.value.code != 0 and "--graph needs a CUDA device" in err, err
    args = argparse.Namespace(rounds=2, iters=3, smoke=False, graph=True, device="cuda")
    rows = [((64, 128, 96), {"bf16": 2.0, "current": 1.0})]
    table = bench_linear.render(rows, ["current"], {"device": "a GPU"}, args)
    assert "replayed from a CUDA graph" in table and "| 64 | 128 | 96 | 2.000 | 2.00 |" in table
    assert "Crossover(" not in table
    args.graph = False
    assert "Crossover(" in bench_linear.render(rows, ["current"], {"device": "a GPU"}, args)
