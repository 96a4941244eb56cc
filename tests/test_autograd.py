"""Training semantics of the FP8 linear autograd (docs/design.md, "Training: the FP8 linear")."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import fp8ops


class OpLog(TorchDispatchMode):
    """Records every fp8ops op call with its arguments, and every per-tensor cast (unfused or
    fused with its scale math) as (input, FP8 dtype, the scale it used)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "fp8ops":
            name = func._opname
            self.calls.append((name, args))
            if name == "quantize":
                self.casts.append((args[0], args[2], args[1]))
            elif name == "quantize_current":
                self.casts.append((args[0], args[1], out[2]))
            elif name == "quantize_delayed":
                self.casts.append((args[0], args[8], out[2]))
        return out


def test_hybrid_formats_and_three_fp8_gemms():
    w = torch.nn.Parameter(torch.randn(16, 32))
    x = torch.randn(8, 32, requires_grad=True)
    with OpLog() as log:
        fp8ops.linear(x, w).sum().backward()
    casts = [dtype for _, dtype, _ in log.casts]
    assert casts == [torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2]  # W, X, dY
    gemms = [(args[0].dtype, args[1].dtype, args[5]) for name, args in log.calls if name == "gemm"]
    assert gemms == [(torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32),  # fwd
                     (torch.float8_e5m2, torch.float8_e4m3fn, torch.float32),  # dgrad
                     (torch.float8_e5m2, torch.float8_e4m3fn, torch.float32)]  # wgrad (fp32 out)


def test_wgrad_gemm_writes_the_parameter_dtype():
    """No float32 temporary and conversion pass for a bf16 weight's gradient."""
    w = torch.nn.Parameter(torch.randn(16, 32, dtype=torch.bfloat16))
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    with OpLog() as log:
        fp8ops.linear(x, w).sum().backward()
    outs = [args[5] for name, args in log.calls if name == "gemm"]
    assert outs == [torch.bfloat16] * 3
    assert w.grad.dtype == torch.bfloat16


def test_saves_fp8_input_not_high_precision():
    w = torch.nn.Parameter(torch.randn(64, 256))
    x = torch.randn(128, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fp8ops.linear(x, w)
    big = [t for t in saved if t.numel() == x.numel()]
    assert big and all(t.dtype == torch.float8_e4m3fn for t in big)
    assert not any(t is x for t in saved)


def test_weight_cast_once_per_optimizer_step():
    """Once the optimizer has stepped the weight (it holds it), one cast per step; before,
    one per micro-batch (a weight no optimizer is seen to hold is cast every forward, with the
    scale of the window: the weight role steps once per step either way)."""
    lin = fp8ops.FP8Linear(32, 16, recipe=fp8ops.DelayedScaling())
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for step in range(3):
        with OpLog() as log:
            for _ in range(4):  # four microbatches, one optimizer step
                lin(torch.randn(8, 32)).sum().backward()
        weight_casts = [c for c in log.casts if c[0] is lin.weight]
        assert len(weight_casts) == (4 if step == 0 else 1), step
        assert lin.fp8_state.weight.step.item() == step + 1
        assert lin.fp8_state.input.step.item() == 4 * (step + 1)
        opt.step()
        opt.zero_grad()


def test_activation_checkpointing_records_amax_once():
    def run(use_ckpt):
        torch.manual_seed(0)
        lin = fp8ops.FP8Linear(32, 32, recipe=fp8ops.DelayedScaling(amax_history_len=4))
        for i in range(3):
            x = torch.randn(8, 32, requires_grad=True) * (i + 1)
            y = checkpoint(lin, x, use_reentrant=False) if use_ckpt else lin(x)
            y.pow(2).sum().backward()
        return lin

    plain, ckpt = run(False), run(True)
    for (k, a), (_, b) in zip(plain.state_dict().items(), ckpt.state_dict().items()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, k
    assert torch.equal(plain.weight.grad, ckpt.weight.grad)
    assert ckpt.fp8_state.input.step.item() == 3


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_trains_as_without_it(use_reentrant):
    """Delayed scaling through activation checkpointing, reentrant (its forward runs under
    no_grad) or not: the same losses, states and weights as the plain model, step for step."""
    def run(ckpt):
        torch.manual_seed(0)
        model = fp8ops.convert_to_fp8(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)),
            fp8ops.DelayedScaling(amax_history_len=4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randn(16, 32, generator=g, requires_grad=True)
            y = checkpoint(model, x, use_reentrant=use_reentrant) if ckpt else model(x)
            loss = y.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, model.state_dict()

    (plain, plain_state), (ckpt, ckpt_state) = run(False), run(True)
    assert ckpt == plain
    for key, value in plain_state.items():
        assert torch.equal(value, ckpt_state[key]), key


def test_main_grad_accumulation():
    w = torch.nn.Parameter(torch.randn(16, 32, dtype=torch.bfloat16))
    w.main_grad = torch.zeros(16, 32, dtype=torch.float32)
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    fp8ops.linear(x, w).float().sum().backward()
    first = w.main_grad.clone()
    fp8ops.linear(x, w).float().sum().backward()
    assert w.grad is None
    assert first.abs().sum() > 0 and torch.equal(w.main_grad, 2 * first)


def test_grad_of_input_only_and_weight_only():
    w = torch.nn.Parameter(torch.randn(16, 32))
    x = torch.randn(8, 32, requires_grad=True)
    with torch.no_grad():
        assert not fp8ops.linear(x, w).requires_grad
    w.requires_grad_(False)
    fp8ops.linear(x, w).sum().backward()
    assert x.grad is not None and w.grad is None
    w.requires_grad_(True)
    x2 = torch.randn(8, 32)
    fp8ops.linear(x2, w).sum().backward()
    assert w.grad is not None


def test_stochastic_grad_rounding_advances_offset():
    lin = fp8ops.FP8Linear(32, 16, recipe=fp8ops.CurrentScaling(grad_rounding="stochastic", seed=3))
    x, dy = torch.randn(8, 32), torch.randn(8, 16)  # dy not exactly representable: rounding shows
    lin(x).backward(dy)
    g1 = lin.weight.grad.clone()
    lin.zero_grad()
    lin(x).backward(dy)
    assert lin.fp8_state.rng_offset == 2
    assert not torch.equal(g1, lin.weight.grad)  # a new random stream for the second step


def test_power_of_two_scales_for_every_cast():
    w = torch.nn.Parameter(torch.randn(16, 32))
    x = torch.randn(8, 32, requires_grad=True) * 3.3
    with OpLog() as log:
        fp8ops.linear(x, w, recipe=fp8ops.CurrentScaling(power_of_two=True)).backward(
            torch.randn(8, 16))
    scales = [scale.item() for _, _, scale in log.casts]
    assert len(scales) == 3  # weight, input, grad_output
    assert all(math.log2(s).is_integer() for s in scales), scales


@pytest.mark.parametrize("recipe", [fp8ops.CurrentScaling(), fp8ops.DelayedScaling(),
                                    fp8ops.MXFP8Scaling(), fp8ops.BlockwiseScaling()],
                         ids=["current", "delayed", "mxfp8", "blockwise"])
@pytest.mark.parametrize("loss", [lambda y: y.sum(), lambda y: y.pow(2).sum()],
                         ids=["constant_dy", "dy_requires_grad"])
def test_double_backward_raises_naming_fp8ops(recipe, loss):
    """A gradient penalty through an FP8 layer must fail loudly, not lose its second-order term."""
    lin = fp8ops.FP8Linear(64, 32, recipe=recipe)
    x = torch.randn(8, 64, requires_grad=True)
    out = loss(lin(x))
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    with pytest.raises(RuntimeError, match="fp8ops.*double backward"):
        (out.detach() + gx.pow(2).sum()).backward()


@pytest.mark.parametrize("recipe", [fp8ops.CurrentScaling(), fp8ops.DelayedScaling(),
                                    fp8ops.MXFP8Scaling(), fp8ops.BlockwiseScaling()],
                         ids=["current", "delayed", "mxfp8", "blockwise"])
@pytest.mark.parametrize("trained", ["bias", "bias+weight", "bias+input", "all"])
def test_bias_gradient_is_dy_column_sums_whatever_else_trains(recipe, trained):
    """The bias gradient comes out of dY's cast (its column sums) when the cast is made, and
    on its own when only the bias trains; sampled statistics included (they observe dY's cast
    only when there is one)."""
    lin = fp8ops.FP8Linear(96, 40, recipe=recipe)
    fp8ops.monitor(torch.nn.Sequential(lin), every=1)
    lin.weight.requires_grad_("weight" in trained or trained == "all")
    x = torch.randn(70, 96, requires_grad="input" in trained or trained == "all")
    dy = torch.randn(70, 40)
    lin(x).backward(dy)
    assert torch.equal(lin.bias.grad, dy.sum(0))
    assert (lin.weight.grad is not None) == lin.weight.requires_grad
    assert (x.grad is not None) == x.requires_grad
