"""The fused casts' CUDA kernels (csrc/bindings/casts.cpp, scaling.cu) against their definition
(fp8ops/ops/fused.py run on the same CUDA tensors, i.e. the unfused ops' kernels), bit for bit: data,
scales, column sums, and every buffer a delayed-scaling cast changes in place."""
import itertools

import pytest
import torch

from conftest import skip_without_fp8_kernels

import fp8ops  # noqa: F401
from fp8ops.ops import fused

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]

OPS = torch.ops.fp8ops
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
BUFFERS = ("amax_history", "scale", "scale_inv", "amax_rep", "pending_amax", "step",
           "nonfinite_count")


@pytest.fixture(autouse=True)
def _need_kernels():
    skip_without_fp8_kernels()
    for name in ("quantize_current", "quantize_delayed", "quantize_blockwise_pair",
                 "quantize_mx_pair"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8ops::{name}", "CUDA")


def _equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    same = torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))
    assert same, what


NAMES = ["random", "bf16", "fp16", "huge", "tiny", "special", "zeros", "empty", "ragged",
         "ragged_bf16"]


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(300, 264, device="cuda", generator=g) * 3
    special = x.clone()
    special[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0], device="cuda")
    # ragged: rows and columns off every vector and word (the kernels' scalar paths)
    ragged = torch.randn(301, 133, device="cuda", generator=g) * 5
    return {"random": x, "bf16": (x * 40).bfloat16(), "fp16": x.half(), "huge": x * 1e30,
            "tiny": x * 1e-20, "special": special, "zeros": torch.zeros(64, 32, device="cuda"),
            "empty": torch.empty(0, 48, device="cuda"), "ragged": ragged,
            "ragged_bf16": ragged[:, :131].bfloat16()}


def _buffers(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    f32 = dict(device="cuda", dtype=torch.float32)
    return {"amax_history": torch.rand(16, generator=g, **f32) * 10,
            "scale": torch.rand((), generator=g, **f32) * 20 + 0.1,
            "scale_inv": torch.full((), float("nan"), **f32),  # poisoned: the update writes it
            "amax_rep": torch.rand((), generator=g, **f32),
            "pending_amax": torch.rand((), generator=g, **f32) * 4,
            "step": torch.tensor(seed % 5, device="cuda"),
            "nonfinite_count": torch.tensor(1, device="cuda")}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("algo, interval", [("max", 1), ("most_recent", 2), ("ema", 1),
                                            ("percentile", 3)])
def test_quantize_delayed_kernel_is_its_definition(name, algo, interval):
    x = _inputs()[name]
    for i, (update, warm, record) in enumerate(itertools.product((False, True), repeat=3)):
        dtype = E5 if i % 2 else E4
        sum_dtype = (None, torch.float32, torch.bfloat16)[i % 3]
        stochastic = i % 4 == 1
        ref_bufs, bufs = _buffers(i), _buffers(i)
        tail = (dtype, 1.25, interval, algo, 0.1, 90.0, i % 3 == 0, update, warm, record, True,
                sum_dtype, stochastic, 11, i)
        ref = fused.quantize_delayed(x, *ref_bufs.values(), *tail)
        got = OPS.quantize_delayed(x, *bufs.values(), *tail)
        case = (name, algo, update, warm, record)
        for k, (a, b) in enumerate(zip(got, ref)):
            _equal(a, b, case + (k,))
        for buf in BUFFERS:
            if buf == "scale_inv" and not update:
                continue  # untouched: both poisoned
            _equal(bufs[buf], ref_bufs[buf], case + (buf,))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype, margin, p2, stochastic", [(E4, 1.0, False, False),
                                                           (E5, 2.0, True, True)])
def test_quantize_current_kernel_is_its_definition(name, dtype, margin, p2, stochastic):
    x = _inputs()[name]
    args = (x, dtype, margin, p2, True, torch.bfloat16, stochastic, 3, 9)
    for k, (a, b) in enumerate(zip(OPS.quantize_current(*args), fused.quantize_current(*args))):
        _equal(a, b, (name, k))


@pytest.mark.parametrize("name", NAMES)
def test_block_pairs_are_their_definition(name):
    x = _inputs()[name]
    for dtype, flag in ((E4, False), (E5, True)):
        got = OPS.quantize_blockwise_pair(x, dtype, flag, torch.float32)
        ref = fused.quantize_blockwise_pair(x, dtype, flag, torch.float32)
        for k, (a, b) in enumerate(zip(got, ref)):
            _equal(a, b, ("blockwise", name, k))
        for block in (32, 16):  # 32: one kernel; another block: the quantizers on a padded copy
            got = OPS.quantize_mx_pair(x, dtype, block, flag, torch.bfloat16)
            ref = fused.quantize_mx_pair(x, dtype, block, flag, torch.bfloat16)
            for k, (a, b) in enumerate(zip(got, ref)):
                _equal(a, b, ("mx", name, block, k))


def test_fused_casts_replay_in_a_cuda_graph():
    """Nothing on the host decides what a replay reads: a captured delayed-scaling cast steps
    the role's buffers at every replay, as eager calls do."""
    x = _inputs()["random"]
    eager, graphed = _buffers(3), _buffers(3)
    tail = (E4, 1.0, 1, "max", 0.1, 99.0, False, True, False, True, True, None, False, 0, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        OPS.quantize_delayed(x, *_buffers(9).values(), *tail)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OPS.quantize_delayed(x, *graphed.values(), *tail)
    for i in range(3):
        x.mul_(1.5)
        ref = OPS.quantize_delayed(x, *eager.values(), *tail)
        graph.replay()
        torch.cuda.synchronize()
        for k, (a, b) in enumerate(zip(out, ref)):
            if b.numel():
                _equal(a, b, (i, k))
        for buf in BUFFERS:
            _equal(graphed[buf], eager[buf], (i, buf))


def test_the_random_stream_from_a_device_buffer_is_the_one_given_as_ints():
    x = _inputs()["random"] * 7.3
    s = torch.tensor(3.0, device="cuda")
    rng = torch.tensor([-9, 2 ** 40 + 1], device="cuda")
    for tr in (False, True):
        a = OPS.quantize(x, s, E5, tr, True, 0, 0, rng)
        b = OPS.quantize(x, s, E5, tr, True, -9, 2 ** 40 + 1)
        for k, (u, v) in enumerate(zip(a, b)):
            _equal(u, v, (tr, k))
    got = OPS.quantize_current(x, E5, 1.0, False, True, None, True, 0, 0, rng)
    ref = fused.quantize_current(x, E5, 1.0, False, True, None, True, -9, 2 ** 40 + 1)
    for k in range(4):
        _equal(got[k], ref[k], k)
    assert rng.tolist() == [-9, 2 ** 40 + 2]
