"""GPU tests of the per-group casts of rows sorted by expert (csrc/cast_grouped.cu) behind
fp8ops::quantize_current_grouped and fp8ops::quantize_scaled_grouped: bit for bit the
emulation (fp8ops/ops/emulation_grouped.py, which tests/test_grouped.py holds to the dense ops
per group) on the same CUDA tensors, with empty groups, rows past the last group, NaN, and rows
that are not 16-byte multiples. Outputs land in memory last filled with 0xFF bytes. Needs a
CUDA GPU and the built extension; skipped otherwise."""
from __future__ import annotations

import pytest
import torch

from fp8ops.ops import emulation_grouped
# (the same GPU and extension needed: that module's skip skips this one too)
from test_expert_casts_gpu import _poison, _same

pytestmark = pytest.mark.gpu
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
_ops = torch.ops.fp8ops

SIZES = {
    "balanced": [256, 256, 256, 256],
    "skewed": [64, 1024, 64, 128],
    "empty": [0, 300, 0, 77],
    "tiny": [1, 2, 3, 5, 7, 11, 13, 17],
    "tail": [100, 50, 30],  # and 9 rows past the last group
}
COLS = {"aligned": 512, "ragged": 141}


def _problem(case, cols, dtype, seed=0):
    sizes = SIZES[case]
    rows = sum(sizes) + (9 if case == "tail" else 0)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, device="cuda", generator=g)
    groups = torch.repeat_interleave(torch.arange(len(sizes), device="cuda"),
                                     torch.tensor(sizes, device="cuda"))
    spread = torch.logspace(-3, 3, len(sizes), device="cuda")
    x[:groups.shape[0]] *= spread[groups].unsqueeze(1)  # each group its own range
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    return x.to(dtype), offsets


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("cols", sorted(COLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", [E4, E5], ids=str)
@pytest.mark.parametrize("transpose", [True, False], ids=["t", "no_t"])
def test_kernels_are_the_emulation(case, cols, dtype, fmt, transpose):
    x, offsets = _problem(case, COLS[cols], dtype)
    E = offsets.shape[0]
    _poison()
    got = _ops.quantize_current_grouped(x, offsets, fmt, 2.0, False, transpose)
    want = emulation_grouped.quantize_current_grouped(x, offsets, fmt, 2.0, False, transpose)
    for g, w, what in zip(got, want, ("data", "data_t", "scale", "scale_inv")):
        _same(g, w, f"current {what}")
    scale = torch.logspace(2, -2, E, device="cuda")
    _poison()
    got = _ops.quantize_scaled_grouped(x, offsets, scale, fmt, transpose)
    want = emulation_grouped.quantize_scaled_grouped(x, offsets, scale, fmt, transpose)
    for g, w, what in zip(got, want, ("data", "data_t", "amax")):
        _same(g, w, f"scaled {what}")


def test_power_of_two_nan_and_the_dense_cast_per_group():
    x, offsets = _problem("empty", 256, torch.bfloat16)
    x[5, 3] = float("nan")  # in group 1 (rows 0-299)
    data, data_t, scale, _ = _ops.quantize_current_grouped(x, offsets, E4, 1.0, True, True)
    d, d_t, s, _, _ = _ops.quantize_current(x[0:300], E4, 1.0, True, True)
    _same(data[0:300], d, "data")
    _same(data_t[:, 0:300], d_t, "data_t")
    _same(scale[1], s, "scale")
    assert scale[0] == 1 and scale[2] == 1  # empty groups


def test_nan_amax_bytes_and_no_groups():
    """A NaN's amax is recorded as the emulation's NaN whatever its payload (a CUDA 0 * inf
    gives 0x7fffffff); with no groups every row is zeros and the scales are empty."""
    x, offsets = _problem("empty", 256, torch.float32)
    x[5, 3] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32).cuda()
    scale = torch.ones(4, device="cuda")
    got = _ops.quantize_scaled_grouped(x, offsets, scale, E4, True)
    want = emulation_grouped.quantize_scaled_grouped(x, offsets, scale, E4, True)
    for g, w, what in zip(got, want, ("data", "data_t", "amax")):
        _same(g, w, f"scaled {what}")
    none = torch.zeros(0, dtype=torch.int32, device="cuda")
    for got, want in (
            (_ops.quantize_current_grouped(x, none, E4, 1.0, False, True),
             emulation_grouped.quantize_current_grouped(x, none, E4, 1.0, False, True)),
            (_ops.quantize_scaled_grouped(x, none, torch.ones(0, device="cuda"), E4, True),
             emulation_grouped.quantize_scaled_grouped(x, none, torch.ones(0, device="cuda"),
                                                       E4, True))):
        for g, w in zip(got, want):
            _same(g, w, "no groups")


def test_no_host_sync_replays_in_a_cuda_graph_with_new_offsets():
    x, offsets = _problem("balanced", 512, torch.bfloat16)
    _ops.quantize_current_grouped(x, offsets, E4, 1.0, False, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _ops.quantize_current_grouped(x, offsets, E4, 1.0, False, True)
    offsets.copy_(torch.tensor([100, 100, 700, 1000], device="cuda", dtype=torch.int32))
    graph.replay()
    want = emulation_grouped.quantize_current_grouped(x, offsets, E4, 1.0, False, True)
    for g, w in zip(out, want):
        _same(g, w, "replay")


@pytest.mark.parametrize("name", ["quantize_current_grouped", "quantize_scaled_grouped"])
def test_opcheck(name):
    x, offsets = _problem("tail", 256, torch.bfloat16)
    args = ((x, offsets, E4, 1.0, False, True) if name == "quantize_current_grouped"
            else (x, offsets, torch.full((3,), 2.0, device="cuda"), E5, False))
    torch.library.opcheck(getattr(_ops, name).default, args)
