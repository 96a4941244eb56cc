"""CPUOffloadOptimizer on a CUDA GPU: pinned FP32 masters, gradients copied to the host on a side
stream and accumulated there bit for bit as the device would, the host step equal to torch's
fused CPU AdamW, FP8 weights on the device only in FP8, exact resume, and training that follows
the CPU run. Skipped without a GPU."""
from __future__ import annotations

import copy
import gc
import io

import pytest
import torch
from torch import nn

import fp8ops
from fp8ops.memory import device_state_bytes

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

RECIPES = {
    "current": fp8ops.CurrentScaling(),
    "delayed": fp8ops.DelayedScaling(amax_history_len=4),
    "mxfp8": fp8ops.MXFP8Scaling(),
    "blockwise": fp8ops.BlockwiseScaling(),
}


class Net(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 16)

    def forward(self, x):
        return self.head(x + self.down(torch.relu(self.up(self.ln(x)))))


def _model(recipe, device, seed=0):
    torch.manual_seed(seed)
    model = Net().to(device)
    return fp8ops.convert_to_fp8(model, recipe, filter_fn=lambda mod, fqn: fqn != "head")


def _inputs(seed, n, device):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 256, generator=gen).to(device) for _ in range(n)]


def _backward(model, xs):
    for x in xs:
        (model(x).float().pow(2).mean() / len(xs)).backward()


@pytest.mark.parametrize("name", list(RECIPES))
def test_gradients_reach_the_host_exactly_and_the_device_keeps_fp8_only(name):
    ref = _model(RECIPES[name], "cuda")
    off = copy.deepcopy(ref)
    opt = fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW, lr=1e-3)
    xs = _inputs(1, 3, "cuda")
    _backward(ref, xs)
    _backward(off, xs)
    opt._gather()
    for entry, p in zip(opt._params, ref.parameters()):
        assert entry.master.is_pinned() and entry.master.dtype == torch.float32
        assert entry.param.grad is None  # nothing stays on the device
        assert torch.equal(entry.master.grad, p.grad.cpu()), entry.name
    for layer in (off.up, off.down):
        assert layer.weight.untyped_storage().nbytes() == 4

    # the host step is torch's fused CPU AdamW on the same gradients
    host = [p.detach().cpu().clone() for p in ref.parameters()]
    for h, p in zip(host, ref.parameters()):
        h.grad = p.grad.cpu()
    torch.optim.AdamW(host, lr=1e-3, fused=True).step()
    opt.step()
    torch.cuda.synchronize()
    for entry, h in zip(opt._params, host):
        assert torch.equal(entry.master, h), entry.name
    assert torch.equal(off.ln.weight.cpu(), opt._params[0].master)  # the device copy


@pytest.mark.parametrize("name", list(RECIPES))
def test_training_follows_the_cpu_run(name):
    losses = {}
    for device in ("cpu", "cuda"):
        model = _model(RECIPES[name], device)
        opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        losses[device] = []
        for step in range(6):
            xs = _inputs(100 + step, 2, device)
            total = 0.0
            for x in xs:
                loss = model(x).float().pow(2).mean() / len(xs)
                loss.backward()
                total += loss.item()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses[device].append(total)
    for step, (c, g) in enumerate(zip(losses["cpu"], losses["cuda"])):
        assert abs(c - g) <= 2e-3 * abs(c), f"{name}: step {step}: cpu {c:.6f} vs gpu {g:.6f}"
    assert losses["cuda"][-1] < losses["cuda"][0]


def test_bf16_resume_on_the_gpu_is_exact():
    def run(model, opt, seed):
        out = []
        for step in range(3):
            xs = [x.to(torch.bfloat16) for x in _inputs(seed + step, 2, "cuda")]
            for x in xs:
                loss = model(x).float().pow(2).mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    model = _model(RECIPES["delayed"], "cuda").to(torch.bfloat16)
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    run(model, opt, 10)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    expected = run(model, opt, 20)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    fresh = _model(RECIPES["delayed"], "cuda", seed=5).to(torch.bfloat16)
    fresh_opt = fp8ops.CPUOffloadOptimizer(fresh.parameters(), torch.optim.AdamW, lr=1e-3)
    fresh_opt.load_state_dict(ckpt["opt"])
    fresh.load_state_dict(ckpt["model"])
    assert run(fresh, fresh_opt, 20) == expected


def _offloaded_steps(steps=2):
    model = _model(RECIPES["current"], "cuda")
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    for step in range(steps):
        _backward(model, _inputs(step, 2, "cuda"))
        opt.step()
        opt.zero_grad()
    model(_inputs(9, 1, "cuda")[0])  # the new weights cast: steady state
    torch.cuda.synchronize()
    return model, opt


def test_device_memory_is_the_counted_state():
    # the same steps once before measuring: the GEMM libraries allocate their workspaces (tens
    # of MB, through the caching allocator) on their first call in a process, which is this
    # test's in a worker that ran no GEMM before
    _offloaded_steps()
    gc.collect()  # what earlier tests in this process left behind is not this model's
    before = torch.cuda.memory_allocated()
    model, opt = _offloaded_steps()
    counted = device_state_bytes(model, opt)
    assert counted["gradients"] == 0 and counted["optimizer_state"] == 0
    fp8_params = model.up.weight.numel() + model.down.weight.numel()
    assert counted["fp8_weights"] / fp8_params <= 2.01
    # the allocator holds the counted tensors (rounded up to its blocks), nothing of the size
    # of a float32 weight more
    grown = torch.cuda.memory_allocated() - before
    assert grown < counted["total"] + 4 * model.up.weight.numel()
