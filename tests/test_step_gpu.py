"""The layer step in C++ on a GPU (fp8ops/nn/step.py, csrc/step/): the same bytes as the Python
path on CUDA (the calls reach fp8ops._C's kernels), under autocast, on a side stream, and
captured in a CUDA graph. Skipped without an FP8 GPU."""
from __future__ import annotations

import copy

import pytest
import torch

import fp8ops
from fp8ops.nn import step
from fp8ops.ops import backend

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm_89+)", allow_module_level=True)
if not backend.extension_loaded():
    pytest.skip(f"fp8ops._C not loaded: {backend._state['why_not']}", allow_module_level=True)
if not step.available():
    pytest.skip("fp8ops._step is not built", allow_module_level=True)

RECIPES = {
    "current": fp8ops.CurrentScaling,
    "delayed": lambda: fp8ops.DelayedScaling(amax_history_len=4),
    "blockwise": fp8ops.BlockwiseScaling,
    "mxfp8": fp8ops.MXFP8Scaling,
}


def _pair(recipe, dtype=torch.bfloat16, k=256, n=384):
    torch.manual_seed(0)
    fast = fp8ops.FP8Linear(k, n, recipe=RECIPES[recipe](), fallback="never", device="cuda",
                            dtype=dtype)
    ref = copy.deepcopy(fast)
    ref.cpp_step = False
    return fast, ref


def _took_step(layer) -> bool:
    return any(p.path is step.CPP for p in layer.__dict__.get("_plans", {}).values())


def _train(layer, steps=3, micro=2, autocast=False, dtype=torch.bfloat16):
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for s in range(steps):
        for m in range(micro):
            x = (torch.randn(4, 128, layer.in_features, device="cuda", generator=g, dtype=dtype)
                 * (s + 1)).requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                y = layer(x)
            y.backward(torch.randn(y.shape, device="cuda", generator=g, dtype=y.dtype))
            out += [y.detach(), x.grad]
        out += [p.grad.clone() for p in layer.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _same(a, b):
    assert len(a) == len(b)
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p, q), f"item {i} differs: max {(p.float() - q.float()).abs().max()}"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_steps_equal_the_python_path(recipe, autocast):
    fast, ref = _pair(recipe, dtype=torch.float32 if autocast else torch.bfloat16)
    dtype = torch.float32 if autocast else torch.bfloat16
    _same(_train(fast, autocast=autocast, dtype=dtype), _train(ref, autocast=autocast, dtype=dtype))
    _same(list(fast.fp8_state.state_dict().values()), list(ref.fp8_state.state_dict().values()))
    assert _took_step(fast) and not _took_step(ref)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_side_stream_equals_the_python_path(recipe):
    fast, ref = _pair(recipe)
    side = torch.cuda.Stream()
    outs = []
    for layer in (fast, ref):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = _train(layer)
        torch.cuda.current_stream().wait_stream(side)
        out += _train(layer, steps=1)  # then on the default stream
        outs.append(out)
    _same(*outs)


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_cuda_graph_replay_equals_the_python_path(recipe):
    """The step captured in a CUDA graph (the weight cast captured too: never reused from the
    host's cache) replays, after an in-place weight update, the bytes of an eager step of the
    Python path on the updated weight: output, input and weight gradients. (Delayed scaling
    replays step its roles, which an eager copy cannot start from: its graph is held by
    tests/test_modules_gpu.py.)"""
    layer, _ = _pair(recipe)
    static_x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graphs requires
        for _ in range(3):
            layer(static_x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=False)  # the replay accumulates into these
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
        static_y.backward(dy)
    assert _took_step(layer)
    with torch.no_grad():
        layer.weight.mul_(0.5)  # an optimizer's in-place update between replays
    eager = copy.deepcopy(layer)
    eager.cpp_step = False
    graph.replay()
    torch.cuda.synchronize()
    x = static_x.detach().clone().requires_grad_(True)
    eager.zero_grad(set_to_none=True)
    y = eager(x)
    y.backward(dy)
    _same([static_y, static_x.grad, layer.weight.grad], [y, x.grad, eager.weight.grad])
