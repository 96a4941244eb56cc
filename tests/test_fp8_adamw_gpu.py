"""FP8AdamW on a GPU: the fused step (csrc/adamw.cu, torch.ops.fp8ops.adamw_step on CUDA) writes
the bytes of the emulation on the CPU (fp8ops/ops/adamw.py), for every second-moment format and
parameter dtype, ragged sizes, zero blocks, huge and tiny values; adamw_step_multi (a list of
parameters in one launch) writes the bytes of adamw_step on each; and an optimizer on CUDA trains
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


def test_non_contiguous_parameters_train_as_on_the_cpu():
    """A transposed parameter (its gradient has its strides): stepped in a contiguous copy,
    with a contiguous copy of its gradient, as on the CPU."""
    def run(device):
        p = torch.nn.Parameter(torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
                               .to(device).t())  # [256, 512], 4096+ values: FP8 moments
        opt = fp8ops.FP8AdamW([p], lr=1e-2, seed=3)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            p.grad = (torch.randn(512, 256, generator=g) * 1e-2).to(device).t()
            assert not p.grad.is_contiguous()
            opt.step()
        return p.detach().cpu()
    assert torch.equal(run("cpu"), run("cuda"))


# -- adamw_step_multi: a list of parameters in one launch ------------------------------------
GUARD = 256  # poisoned bytes around each tensor: a write past a tensor's end changes them
SIZES = [1000, 0, 1, 128, 127, 4096 + 3, 129, 1 << 16]


def _guarded(t):
    """t copied to the middle of a CUDA buffer poisoned around it: (the copy, the buffer)."""
    nbytes = t.numel() * t.element_size()
    raw = torch.full((nbytes + 2 * GUARD,), 0xA5, dtype=torch.uint8, device="cuda")
    inner = raw[GUARD:GUARD + nbytes].view(t.dtype).view(t.shape)
    inner.copy_(t.cuda())
    return inner, raw


def _guards_intact(raw):
    return bool((raw[:GUARD] == 0xA5).all() and (raw[-GUARD:] == 0xA5).all())


def _poison_padding(state, n):
    """NaN bytes in the moments' padding past n values: the step must rewrite them (as zeros)."""
    for t in (state[2], state[4]):
        if t.element_size() == 1 and t.numel() > n:
            t.view(torch.uint8).view(-1)[n:] = 0x7F


def _multi_states(dtype, form):
    states = [_state(n, dtype, form, seed=i) for i, n in enumerate(SIZES)]
    for s, n in zip(states, SIZES):
        _poison_padding(s, n)
    return states


def _multi_tables(count):
    """Each parameter its own step size, bias correction and random stream."""
    scalars = torch.tensor([SCALARS[:9]] * count, dtype=torch.float32)
    scalars[:, 5] *= torch.arange(1, count + 1)
    scalars[:, 6] += torch.arange(count) / 8
    rng = torch.tensor([[11 + i, (i << 32) | (i + 3)] for i in range(count)], dtype=torch.int64)
    return scalars, rng


@pytest.mark.parametrize("form", ["sqrt_e4m3", "e5m2", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tables_on", ["cpu", "cuda"])
def test_multi_step_equals_single_steps(form, dtype, tables_on):
    """adamw_step_multi on CUDA writes each parameter's bytes as adamw_step on CUDA and as the
    emulation on the CPU, and nothing outside its tensors."""
    states = _multi_states(dtype, form)
    scalars, rng = _multi_tables(len(states))
    singles = [[t.cuda() for t in s] for s in states]
    for i, s in enumerate(singles):
        torch.ops.fp8ops.adamw_step(*s, *scalars[i].tolist(), *rng[i].tolist())
    emulated = [[t.clone() for t in s] for s in states]
    adamw.adamw_step_multi(*map(list, zip(*emulated)), scalars, rng)
    guarded = [[_guarded(t) for t in s] for s in states]
    lists = [[g[k][0] for g in guarded] for k in range(6)]
    torch.ops.fp8ops.adamw_step_multi(*lists, scalars.to(tables_on), rng.to(tables_on))
    torch.cuda.synchronize()
    for i, n in enumerate(SIZES):
        for k, name in enumerate(("param", "grad", "m", "m_scale_inv", "v", "v_scale_inv")):
            got, raw = guarded[i][k]
            assert _guards_intact(raw), (n, name)
            assert torch.equal(_bytes(got.cpu()), _bytes(singles[i][k].cpu())), (n, name)
            assert torch.equal(_bytes(got.cpu()), _bytes(emulated[i][k])), (n, name)


def test_multi_step_is_one_kernel_on_the_current_stream():
    states = _multi_states(torch.bfloat16, "sqrt_e4m3")
    scalars, rng = _multi_tables(len(states))
    want = [[t.clone() for t in s] for s in states]
    adamw.adamw_step_multi(*map(list, zip(*want)), scalars, rng)
    side = torch.cuda.Stream()
    gpu = [[t.cuda() for t in s] for s in states]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.ops.fp8ops.adamw_step_multi(*map(list, zip(*gpu)), scalars, rng)
            torch.cuda.synchronize()
    # the table's host-to-device copy is a memcpy, not a kernel
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower()]
    assert kernels == [k for k in kernels if "multi" in k] and len(kernels) == 1, kernels
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(want, gpu):
        for x, y in zip(a, b):
            assert torch.equal(_bytes(x), _bytes(y.cpu()))


def test_multi_step_refuses_bad_arguments():
    f32 = [[t.cuda() for t in _state(n, torch.float32, "e5m2", n)] for n in (300, 5)]
    bf16 = [[t.cuda() for t in _state(200, torch.bfloat16, "e5m2", 1)]]
    scalars, rng = _multi_tables(2)
    lists = [list(x) for x in zip(*f32)]
    multi = torch.ops.fp8ops.adamw_step_multi
    with pytest.raises(RuntimeError, match="one length"):
        multi(lists[0], lists[1][:1], *lists[2:], scalars, rng)
    with pytest.raises(RuntimeError, match="scalars must be float32"):
        multi(*lists, scalars[:1], rng)
    with pytest.raises(RuntimeError, match="rng must be int64"):
        multi(*lists, scalars, rng.float())
    with pytest.raises(RuntimeError, match="tensor 1: grad must be"):
        multi(*lists[:1], [lists[1][0], lists[1][1][:2]], *lists[2:], scalars, rng)
    with pytest.raises(RuntimeError, match="tensor 1: grad must be a CUDA tensor"):
        multi(*lists[:1], [lists[1][0], lists[1][1].cpu()], *lists[2:], scalars, rng)
    mixed = [a + b for a, b in zip(lists, ([x] for x in bf16[0]))]
    scalars3, rng3 = _multi_tables(3)
    with pytest.raises(RuntimeError, match="one dtype"):
        multi(*mixed, scalars3, rng3)


def test_optimizer_on_cuda_makes_one_multi_call_per_bucket():
    from test_fp8_adamw import _CountOps as Count

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).cuda()
    opt = fp8ops.FP8AdamW(model.parameters(), lr=1e-2, min_fp8_numel=1024)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    with Count() as count:
        opt.step()
    assert count.calls.count(torch.ops.fp8ops.adamw_step_multi.default) == 1
    assert torch.ops.fp8ops.adamw_step.default not in count.calls
