"""FP8Linear training on a GPU (the CUDA kernels) against the same training on the CPU (the
emulation), and an FP8Linear step captured in a CUDA graph. Skipped without an FP8 GPU."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fp8ops
from fp8ops.ops import backend

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm_89+)", allow_module_level=True)
if not backend.extension_loaded():
    pytest.skip(f"fp8ops._C not loaded: {backend._state['why_not']}", allow_module_level=True)

RECIPES = {
    "current": fp8ops.CurrentScaling(),
    "current_sr": fp8ops.CurrentScaling(grad_rounding="stochastic"),
    "delayed": fp8ops.DelayedScaling(amax_history_len=4),
    "mxfp8": fp8ops.MXFP8Scaling(),
    "blockwise": fp8ops.BlockwiseScaling(),
}


def _model(recipe):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 256), nn.GELU(),
                      nn.Linear(256, 136))
    return fp8ops.convert_to_fp8(m, recipe)


def _train(model, device, steps=6):
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 256, generator=g).to(device)  # one batch, fitted: the loss must fall
    y = torch.randint(0, 136, (96,), generator=g).to(device)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_gpu_training_matches_cpu_emulation(name):
    """Same model, data and recipe: the loss curves agree to accumulation-order noise (the GEMMs
    sum in another order; a cast may then round one element the other way)."""
    base = _model(RECIPES[name])
    cpu = _train(copy.deepcopy(base), "cpu")
    gpu = _train(copy.deepcopy(base), "cuda")
    for step, (c, g) in enumerate(zip(cpu, gpu)):
        assert abs(c - g) <= 2e-3 * abs(c), f"{name}: step {step}: cpu {c:.6f} vs gpu {g:.6f}"
    assert gpu[-1] < gpu[0], f"{name}: loss did not fall on the GPU: {gpu}"


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_fp8linear_step_in_a_cuda_graph(name):
    """Forward and backward of an FP8Linear captured once and replayed: same outputs and gradients
    as eager steps (no host synchronisation inside the step)."""
    torch.manual_seed(0)
    layer = fp8ops.FP8Linear(512, 1000, recipe=RECIPES[name], device="cuda")
    eager = copy.deepcopy(layer)
    xs = [torch.randn(256, 512, device="cuda") for _ in range(4)]
    static_x = torch.empty_like(xs[0])

    def step(mod, x):
        out = mod(x)
        out.float().square().mean().backward()
        return out

    # warm up on a side stream, as torch.cuda.graphs requires
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static_x.copy_(xs[0])
        step(layer, static_x)
        step(eager, xs[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    layer.weight.grad = None
    with torch.cuda.graph(graph):
        static_out = step(layer, static_x)
    for x in xs[1:]:
        static_x.copy_(x)
        layer.weight.grad = None if layer.weight.grad is None else layer.weight.grad.zero_()
        graph.replay()
        eager.weight.grad = None
        ref = step(eager, x)
        torch.cuda.synchronize()
        assert torch.equal(static_out, ref), f"{name}: graph replay output differs from eager"
        assert torch.equal(layer.weight.grad, eager.weight.grad), f"{name}: weight grad differs"


def test_mx_gemm_uses_bf16_tensor_cores_and_matches_the_emulation():
    """On an FP8 GPU the MXFP8 GEMM dequantizes to bf16 (exact for MXFP8 values) and accumulates
    in float32 on the tensor cores: within float32 accumulation error of the emulation."""
    from fp8ops.ops import emulation, gemm_mx_cuda
    assert gemm_mx_cuda.BF16_MM, "this torch has no bf16 x bf16 -> float32 mm on CUDA"
    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(300, 512, device="cuda", generator=g) * 4
    b = torch.randn(200, 512, device="cuda", generator=g)
    qa, sa = torch.ops.fp8ops.quantize_mx(a, torch.float8_e4m3fn, 32, 1, False)
    qb, sb = torch.ops.fp8ops.quantize_mx(b, torch.float8_e4m3fn, 32, 1, False)
    out = torch.ops.fp8ops.gemm_mx(qa, sa, qb, sb, None, torch.float32, 32)
    ref = emulation.gemm_mx(qa, sa, qb, sb, None, torch.float32, 32)
    ad = emulation.dequantize_mx(qa, sa, 32, -1, torch.float32).double()  # exact
    bd = emulation.dequantize_mx(qb, sb, 32, -1, torch.float32).double()
    mag = ad.abs() @ bd.abs().t()
    assert ((out.double() - ref.double()).abs() <= mag * 2.0 ** -20).all()


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_cuda_graph_replay_after_an_optimizer_step_reads_the_new_weight(name):
    """The weight cast is captured into the graph (never reused from the host's cache), so a
    replay after an optimizer step casts the updated weight."""
    torch.manual_seed(0)
    layer = fp8ops.FP8Linear(256, 512, recipe=RECIPES[name], device="cuda")
    eager = copy.deepcopy(layer)
    opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (layer, eager))
    static_x = torch.randn(128, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graphs requires
        layer(static_x).float().square().mean().backward()
        eager(static_x).float().square().mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad()  # the captured backward writes the gradients into the graph's memory
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
        static_out.float().square().mean().backward()
    for step in range(3):
        graph.replay()
        eager.zero_grad()
        ref = eager(static_x)
        ref.float().square().mean().backward()
        torch.cuda.synchronize()
        assert torch.equal(static_out, ref), (name, step)
        assert torch.equal(layer.weight.grad, eager.weight.grad), (name, step)
        opt.step()  # in place: the next replay's cast reads the new values
        eager_opt.step()


@pytest.mark.parametrize("name", ["current_sr", "delayed_sr"])
def test_stochastic_rounding_replays_fresh_random_numbers_in_a_cuda_graph(name):
    """The random stream is read from the state's device buffer and advanced there: every
    replay of a captured stochastic step rounds as the eager step with the same offset does,
    and consecutive replays differ."""
    recipe = {"current_sr": fp8ops.CurrentScaling(grad_rounding="stochastic", seed=5),
              "delayed_sr": fp8ops.DelayedScaling(grad_rounding="stochastic", seed=5)}[name]
    torch.manual_seed(0)
    layer = fp8ops.FP8Linear(256, 384, recipe=recipe, device="cuda")
    eager = copy.deepcopy(layer)
    x = torch.randn(128, 256, device="cuda")
    dy = torch.randn(128, 384, device="cuda") * 7.3  # between FP8 neighbours: rounding shows
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graphs requires
        layer(x).backward(dy)
        eager(x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x).backward(dy)
    grads = []
    for step in range(3):
        graph.replay()
        eager.zero_grad()
        eager(x).backward(dy)
        torch.cuda.synchronize()
        assert torch.equal(layer.weight.grad, eager.weight.grad), (name, step)
        assert layer.fp8_state.rng_offset == eager.fp8_state.rng_offset
        grads.append(layer.weight.grad.clone())
    assert not torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("name", ["current", "delayed", "blockwise"])
def test_forward_on_a_side_stream_backward_on_another(name):
    """Role buffers and the cached cast used across streams give the single-stream result."""
    torch.manual_seed(0)
    layer = fp8ops.FP8Linear(1024, 1024, recipe=RECIPES[name], device="cuda")
    ref = copy.deepcopy(layer)
    xs = [torch.randn(2048, 1024, device="cuda") for _ in range(4)]
    side = torch.cuda.Stream()
    for i, x in enumerate(xs):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = layer(x)
        torch.cuda.current_stream().wait_stream(side)
        out.float().square().mean().backward()  # autograd runs it on the side stream
        if i % 2:  # and the next microbatch's forward on the default stream
            layer(x).float().sum().backward()
        ref_out = ref(x)
        ref_out.float().square().mean().backward()
        if i % 2:
            ref(x).float().sum().backward()
        torch.cuda.synchronize()
        assert torch.equal(out, ref_out), (name, i)
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    for k, v in ref.state_dict().items():
        assert torch.equal(layer.state_dict()[k], v), k


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_training_step_never_syncs_with_the_host(name):
    """A bf16 FP8Linear step (forward, backward, optimizer step: the weight cast again) makes
    no device-to-host synchronisation: torch raises on any under sync debug mode "error"."""
    torch.manual_seed(0)
    layer = fp8ops.FP8Linear(512, 384, recipe=RECIPES[name], device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # warm up: allocations, the first casts
        layer(x).backward(dy)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            layer(x).backward(dy)
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert layer.weight.grad is None and torch.isfinite(x.grad.float()).all()


@pytest.mark.parametrize("name", ["current", "current_sr", "delayed", "blockwise"])
def test_compiled_with_cuda_graphs_trains_as_eager(name):
    """torch.compile(mode="reduce-overhead") (CUDA graphs where the compiler can use them) trains
    an FP8 model as eager mode does: the same losses up to the compiler's own rounding of the
    GELUs between the layers (which an FP8 cast may then round one step the other way)."""
    base = _model(RECIPES[name])
    eager = _train(copy.deepcopy(base), "cuda")
    compiled_model = copy.deepcopy(base).cuda()
    compiled = _train(torch.compile(compiled_model, mode="reduce-overhead"), "cuda")
    for step, (e, c) in enumerate(zip(eager, compiled)):
        assert abs(e - c) <= 1e-2 * abs(e), f"{name}: step {step}: eager {e:.6f} vs compiled {c:.6f}"
    assert compiled[-1] < compiled[0]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_autocast_returns_bf16_with_the_float32_steps_gradients(name):
    """Under CUDA bf16 autocast the layer returns bf16, as nn.Linear does; the output is the
    float32 step's rounded to bf16 (to one bf16 ulp: the GEMM may pick another tile for another
    output dtype) and the gradients are the float32 step's, bit for bit."""
    def step(autocast):
        torch.manual_seed(0)
        layer = fp8ops.FP8Linear(256, 384, recipe=RECIPES[name], fallback="never", device="cuda")
        x = (torch.randn(4, 64, 256, device="cuda") * 2).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        dy = torch.randn(y.shape, device="cuda").to(torch.bfloat16)
        y.backward(dy if autocast else dy.float())
        return y, x.grad, layer.weight.grad, layer.bias.grad

    y, dx, dw, db = step(True)
    y32, dx32, dw32, db32 = step(False)
    assert y.dtype == torch.bfloat16 and (dx.dtype, dw.dtype) == (torch.float32,) * 2
    torch.testing.assert_close(y.float(), y32.to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)
    for got, want in ((dx, dx32), (dw, dw32), (db, db32)):
        assert torch.equal(got, want)
