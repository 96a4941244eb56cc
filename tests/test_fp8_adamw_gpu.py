"""FP8AdamW on a GPU: the fused step (csrc/adamw.cu, torch.ops.fp8ops.adamw_step on CUDA) writes
the bytes of the emulation on the CPU (fp8ops/ops/adamw.py), for every second-moment format and
parameter dtype, ragged sizes, zero blocks, huge and tiny values; and an optimizer on CUDA trains
as the same optimizer on the CPU, bit for bit. Skipped without an FP8 GPU."""
from __future__ import annotations

import pytest
import torch

import fp8ops
from fp8ops.ops import adamw

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm_89+)", allow_module_level=True)

# beta1, 1 - beta1, beta2, 1 - beta2, eps, step size, 1 / sqrt(1 - beta2^t), decay, l2, seed, offset
SCALARS = (0.8999999761581421, 0.10000000149011612, 0.949999988079071, 0.05000000074505806,
           9.99999993922529e-09, 0.0031622776, 3.2025630474090576, 0.9997000098228455, 0.0,
           11, (3 << 32) | 7)


def _state(n, dtype, form, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-30, 10, n, dtype=torch.float64).float()[torch.randperm(n, generator=g)]
    param = (torch.randn(n, generator=g) * 0.1).to(dtype)
    grad = (torch.randn(n, generator=g) * rows).to(dtype)
    grad[: min(n, 256)] = 0  # whole zero blocks (for n >= 256)
    if n > 300:
        grad[300] = 3e38  # overflows g * g
    m, m_si = adamw.encode(torch.randn(n, generator=g) * 1e-3, adamw.E4M3)
    v32 = torch.rand(n, generator=g) * 1e-6
    if form == "bf16":
        v, v_si = v32.bfloat16(), torch.empty(0)
    else:
        v, v_si = adamw.encode(v32.sqrt() if form == "sqrt_e4m3" else v32,
                               adamw.E4M3 if form == "sqrt_e4m3" else adamw.E5M2)
    return [param, grad, m, m_si, v, v_si]


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) \
        if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("n", [1, 127, 128, 1000, 4096 + 3, 1 << 20])
@pytest.mark.parametrize("form", ["sqrt_e4m3", "e5m2", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("l2", [0.0, 0.01])
def test_fused_step_equals_the_emulation(n, form, dtype, l2):
    scalars = SCALARS[:8] + (l2,) + SCALARS[9:]
    cpu = _state(n, dtype, form, seed=n)
    gpu = [t.cuda() for t in cpu]
    for t in gpu[:5]:  # poison nothing silently: the kernel must write every byte it owns
        assert t.is_contiguous()
    adamw.adamw_step(*cpu, *scalars)
    torch.ops.fp8ops.adamw_step(*gpu, *scalars)
    torch.cuda.synchronize()
    for name, a, b in zip(("param", "grad", "m", "m_scale_inv", "v", "v_scale_inv"), cpu, gpu):
        assert torch.equal(_bytes(a), _bytes(b.cpu())), name


def test_fused_step_is_one_launch_on_the_current_stream():
    cpu = _state(5000, torch.bfloat16, "sqrt_e4m3", seed=1)
    want = [t.clone() for t in cpu]
    adamw.adamw_step(*want, *SCALARS)
    side = torch.cuda.Stream()
    gpu = [t.cuda() for t in cpu]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.ops.fp8ops.adamw_step(*gpu, *SCALARS)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(want, gpu):
        assert torch.equal(_bytes(a), _bytes(b.cpu()))


def test_fused_step_refuses_bad_arguments():
    param, grad, m, m_si, v, v_si = (t.cuda() for t in _state(300, torch.float32, "e5m2", 0))
    with pytest.raises(RuntimeError, match="grad must be"):
        torch.ops.fp8ops.adamw_step(param, grad[:10], m, m_si, v, v_si, *SCALARS)
    with pytest.raises(RuntimeError, match="m must be E4M3"):
        torch.ops.fp8ops.adamw_step(param, grad, m[:1], m_si, v, v_si, *SCALARS)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        torch.ops.fp8ops.adamw_step(param, grad.cpu(), m, m_si, v, v_si, *SCALARS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("second_moment", ["sqrt_e4m3", "e5m2", "bf16"])
def test_optimizer_on_cuda_trains_as_on_the_cpu(dtype, second_moment):
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                    torch.nn.Linear(512, 64)).to(device, dtype)
        opt = fp8ops.FP8AdamW(model.parameters(), lr=1e-2, second_moment=second_moment, seed=3)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(32, 256, generator=g).to(device, dtype)
            opt.zero_grad()
            # the gradients must be equal bytes on both devices: give them directly
            for p in model.parameters():
                p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(device, dtype)
            opt.step()
        del x
        return [p.detach().cpu() for p in model.parameters()]
    for a, b in zip(run("cpu"), run("cuda")):
        assert torch.equal(_bytes(a), _bytes(b))
