"""bench/bench_cast.py runs end to end on the CPU (--smoke), every op and fused cast in its
table, and the bytes it credits each op with are the bytes the op really reads and writes (its
input, every output; plus a scale it reads), so that its GB/s and "vs copy" ratios on a GPU are
honest. The timings of a smoke run mean nothing."""
from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

from test_bench_linear import run_smoke

import bench_cast  # bench/ is on the path once test_bench_linear is imported

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py says why)

FUSED = ["fused current (+T)", "fused current (+T, + dbias)", "fused delayed (+T)",
         "fused blockwise pair", "fused mx pair (1x32)"]
# the mixture-of-experts casts, timed against what they stand for too
MOE = ["experts current (+T), 8", "experts scaled (+T), 8", "grouped current (+T), 8",
       "grouped scaled (+T), 8"]


def test_bytes_credited_are_the_bytes_moved():
    x = torch.randn(253, 512, dtype=torch.bfloat16) * 3 + 0.5  # ragged rows: padded copies count
    scale = torch.tensor(448.0 / float(x.float().abs().max()))
    cases = bench_cast._cases(x, scale)
    assert set(FUSED + MOE) <= set(cases)
    experts_rows = x.shape[0] // bench_cast.MOE_GROUPS * bench_cast.MOE_GROUPS
    for name, (fn, _, nbytes, unfused) in cases.items():
        outs = [t for t in tree_leaves(fn()) if isinstance(t, torch.Tensor)]
        read = x.numel() if name == "transpose_fp8" else x.nbytes  # it reads the FP8 cast of x
        if name.startswith("experts"):  # x's rows down to a multiple of the expert count
            read = experts_rows * x.shape[1] * x.element_size()
        moved = read + sum(t.numel() * t.element_size() for t in outs)
        slack = 8 * bench_cast.MOE_GROUPS if name in MOE else 8  # (+ the float32 scales read)
        assert 0 <= nbytes - moved <= slack, (name, nbytes, moved)
        assert (unfused is not None) == (name in FUSED + MOE), name


def test_bench_cast_smoke(tmp_path, capsys):
    stdout = run_smoke(capsys, "bench_cast", tmp_path)
    table = (tmp_path / "cast.md").read_text()
    assert table in stdout and "not a measurement" in table
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| 1 ")]
    names = [r[1].strip() for r in rows]
    assert names[0] == "d2d copy" and set(FUSED + MOE) <= set(names) and len(names) == 18, names
    for r in rows:
        assert float(r[2]) > 0, r  # every op ran and was timed
        assert bool(r[6].strip()) == (r[1].strip() in FUSED + MOE), r  # what it stands for
