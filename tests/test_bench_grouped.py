"""bench/bench_grouped.py runs end to end on the CPU (--smoke): every variant ran or says why
(torch._scaled_grouped_mm has no CPU kernel), and the table is complete. The timings of a smoke
run mean nothing. The routing and the torch._scaled_grouped_mm variant's operands are checked
here too: the latter against torch's own shape and stride checks (its meta function) and a float
reference of its arithmetic."""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_grouped  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py says why)


def _is_number(cell):
    try:
        return float(cell) > 0
    except ValueError:
        return False


def test_bench_grouped_smoke(tmp_path, capsys):
    importlib.import_module("bench_grouped").main(["--device", "cpu", "--smoke", "--out",
                                                   str(tmp_path)])
    stdout = capsys.readouterr().out
    table = (tmp_path / "grouped.md").read_text()
    assert table in stdout and "NOT a measurement" in table
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in rows[0]]
    others = [v for v in bench_grouped.VARIANTS if v != bench_grouped.BASELINE]
    assert head[-len(others):] == [f"{v} speed-up" for v in others], head
    shapes = [[c.strip() for c in r] for r in rows[1:] if r[0].strip() == "tiny"]
    assert [(r[1], r[6]) for r in shapes] == [("gate_up", "balanced"), ("gate_up", "skewed"),
                                              ("down", "balanced"), ("down", "skewed")]
    for r in shapes:
        assert r[8] == bench_grouped.BASELINE and _is_number(r[9]), r
        cells = dict(zip(others, r[10:]))
        for v in ("bf16 loop", "current", "blockwise"):
            assert _is_number(cells[v]), (v, r)
        # no CPU kernel in torch: the cell names the error instead of a number
        assert _is_number(cells["scaled_grouped_mm"]) or "Error" in cells["scaled_grouped_mm"]
    assert [r[7] for r in shapes] == ["64", "256", "64", "256"]  # the largest group
    assert any(r[0].strip() == "geomean" for r in rows)


@pytest.mark.parametrize("m, e", [(8192, 8), (65536, 16), (8192, 32), (512, 8)])
def test_routing(m, e):
    balanced = bench_grouped.group_sizes(m, e, "balanced")
    skewed = bench_grouped.group_sizes(m, e, "skewed")
    for sizes in (balanced, skewed):
        assert len(sizes) == e and sum(sizes) == m
        assert all(s % bench_grouped.ALIGN == 0 for s in sizes)
    assert set(balanced) == {m // e}
    assert skewed[0] == 4 * m // e and max(skewed[1:]) - min(skewed[1:]) <= bench_grouped.ALIGN


def test_scaled_grouped_mm_variant_computes_the_step(monkeypatch):
    """The variant's three calls pass torch's checks of torch._scaled_grouped_mm (its meta
    function: dtypes, layouts, alignment, scale shapes) and, computed in float32 as the op
    defines them, give the step's output and gradients within FP8 error."""
    real = torch._scaled_grouped_mm

    def checked(a, b, scale_a, scale_b, offs=None, out_dtype=None, **kw):
        meta = [t.to("meta") for t in (a, b, scale_a, scale_b, offs)]
        out = real(*meta[:4], offs=meta[4], out_dtype=out_dtype)  # torch's own checks
        ends = offs.tolist()
        bounds = list(zip([0] + ends[:-1], ends))
        if b.dim() == 3:  # 2d x 3d: a [M, K] per row, b [E, K, N] per (expert, column)
            res = torch.zeros(out.shape)
            for g, (lo, hi) in enumerate(bounds):
                res[lo:hi] = ((a[lo:hi].float() * scale_a[lo:hi, None])
                              @ (b[g].float() * scale_b[g][None, :]))
        else:  # 2d x 2d, grouped along M: a [N, M], b [M, K], scales per (group, row)
            n, k = a.shape[0], b.shape[1]
            res = torch.stack([(a[:, lo:hi].float() * scale_a[g * n:(g + 1) * n, None])
                               @ (b[lo:hi].float() * scale_b[g * k:(g + 1) * k][None, :])
                               for g, (lo, hi) in enumerate(bounds)])
        assert res.shape == out.shape
        return res.to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", checked)
    e, k, n = 8, 64, 48
    sizes = bench_grouped.group_sizes(512, e, "skewed")
    offsets = bench_grouped.offsets_of(sizes, "cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, k, generator=g).bfloat16()
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5).bfloat16()
    dy = torch.randn(512, n, generator=g).bfloat16()
    step = bench_grouped.scaled_grouped_mm(x, w, dy, sizes, offsets)
    y = step()
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    yr = torch.cat([xr[lo:hi] @ wr[i].t() for i, (lo, hi) in
                    enumerate(bench_grouped._bounds(sizes))])
    yr.backward(dy.float())

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    gx, gw = (t.grad for t in step.leaves)
    assert rel(y, yr.detach()) < 0.08
    assert rel(gx, xr.grad) < 0.08
    assert rel(gw, wr.grad) < 0.08
