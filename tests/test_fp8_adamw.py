"""fp8ops/optim/fp8_adamw.py and moments.py: FP8AdamW / FP8Adam against a reference of the
documented arithmetic (numpy float32 + ml_dtypes), against torch's AdamW, its checkpoints,
its interchange with torch's state, and its errors."""
import io
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ops
from fp8ops.ops import philox
from fp8ops.optim import moments

F32 = np.float32


# -- an independent reference of docs/numerics.md, "FP8AdamW" ----------------------------------
def _blocks_encode(x: np.ndarray, fp8):
    """x float32 flat -> (decoded float32 values of the stored blocks, numel of x)."""
    n = x.size
    pad = np.zeros(-(-n // 128) * 128, dtype=F32)
    pad[:n] = x
    b = pad.reshape(-1, 128)
    amax = np.abs(b).max(axis=1, keepdims=True)
    fmax = F32(float(ml_dtypes.finfo(fp8).max))
    safe = np.where(amax == 0, fmax, amax).astype(F32)
    mult, scale_inv = (fmax / safe).astype(F32), (safe / fmax).astype(F32)
    q = (b * mult).astype(F32).astype(fp8).astype(F32)
    return (q * scale_inv).astype(F32).reshape(-1)[:n]


def _reference_steps(p0, grads, lr, betas, eps, weight_decay, second_moment, bf16, seed=0,
                     index=0, decoupled=True):
    """The parameter after each step (float32 values; bf16 ones on the bf16 grid)."""
    b1, b2 = betas
    wd = weight_decay
    p = p0.astype(F32).reshape(-1)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    out = []
    for t, g in enumerate(grads, start=1):
        g = g.astype(F32).reshape(-1)
        if wd and not decoupled:
            g = (g + (p * F32(wd)).astype(F32)).astype(F32)
        m = ((m * F32(b1)).astype(F32) + (g * F32(1 - b1)).astype(F32)).astype(F32)
        v = ((v * F32(b2)).astype(F32) + ((g * g).astype(F32) * F32(1 - b2))).astype(F32)
        s = np.sqrt(v).astype(F32)
        denom = ((s * F32(1 / math.sqrt(1 - b2 ** t))).astype(F32) + F32(eps)).astype(F32)
        upd = np.where(s == 0, F32(0), (m / denom).astype(F32)).astype(F32)
        upd = (upd * F32(lr / (1 - b1 ** t))).astype(F32)
        if wd and decoupled:
            p = (p * F32(1 - lr * wd)).astype(F32)
        p = (p - upd).astype(F32)
        if bf16:
            bits = p.view(np.uint32).astype(np.uint64)
            words = philox.random_words(p.size, seed, (index << 32) | t, "cpu").numpy()
            up = ((bits & 0xFFFF) + (words.astype(np.uint64) >> 16)) >= 0x10000
            p = (((bits >> 16) + up) << 16).astype(np.uint32).view(F32)
        # the stored moments, as the next step reads them
        m = _blocks_encode(m, ml_dtypes.float8_e4m3fn)
        if second_moment == "sqrt_e4m3":
            d = _blocks_encode(s, ml_dtypes.float8_e4m3fn)
            v = (d * d).astype(F32)
        elif second_moment == "e5m2":
            v = _blocks_encode(v, ml_dtypes.float8_e5m2)
        else:
            v = v.astype(ml_dtypes.bfloat16).astype(F32)
        out.append(p.copy())
    return out


def _param(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter((torch.randn(shape, generator=g) * 0.1).to(dtype))


def _grads(shape, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    # rows of very different sizes: the blocks keep their own range
    rows = torch.logspace(-6, 0, shape[0]).unsqueeze(1)
    return [torch.randn(shape, generator=g) * rows for _ in range(steps)]


@pytest.mark.parametrize("second_moment", moments.SECOND_MOMENTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_documented_arithmetic(second_moment, dtype):
    shape, hyper = (48, 100), dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    p = _param(shape, dtype)
    p0 = p.detach().float().numpy().copy()
    grads = _grads(shape, 4)
    opt = fp8ops.FP8AdamW([p], second_moment=second_moment, min_fp8_numel=0, seed=9, **hyper)
    ref = _reference_steps(p0, [g.to(dtype).float().numpy() for g in grads],
                           second_moment=second_moment, bf16=dtype == torch.bfloat16, seed=9,
                           **hyper)
    for g, want in zip(grads, ref):
        p.grad = g.to(dtype)
        opt.step()
        got = p.detach().float().reshape(-1).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fp8adam_adds_weight_decay_to_the_gradient():
    shape, hyper = (16, 128), dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    p = _param(shape)
    p0 = p.detach().numpy().copy()
    grads = _grads(shape, 3)
    opt = fp8ops.FP8Adam([p], min_fp8_numel=0, **hyper)
    ref = _reference_steps(p0, [g.numpy() for g in grads], second_moment="sqrt_e4m3",
                           bf16=False, decoupled=False, **hyper)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert np.array_equal(p.detach().reshape(-1).numpy(), ref[-1])


def test_small_parameters_keep_float32_moments_and_track_torch_adamw():
    p, q = _param((64,)), _param((64,))
    opt = fp8ops.FP8AdamW([p], lr=1e-2)  # 64 < min_fp8_numel
    ref = torch.optim.AdamW([q], lr=1e-2)
    for g in _grads((64, 1), 10):
        p.grad, q.grad = g.reshape(64).clone(), g.reshape(64).clone()
        opt.step()
        ref.step()
    assert opt.state[p]["m"].dtype == torch.float32
    # torch's step orders its float32 operations differently (lerp, addcdiv)
    assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("second_moment", moments.SECOND_MOMENTS)
def test_trains_a_model_close_to_torch_adamw(second_moment):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 8))
    twin.load_state_dict(model.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    opt = fp8ops.FP8AdamW(model.parameters(), lr=3e-3, second_moment=second_moment)
    ref = torch.optim.AdamW(twin.parameters(), lr=3e-3)
    x = torch.randn(256, 64)
    y = torch.nn.Linear(64, 8)(x).detach()  # a teacher the student can learn
    for _ in range(60):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y).item()
        base = torch.nn.functional.mse_loss(twin(x), y).item()
        start_loss = torch.nn.functional.mse_loss(
            torch.func.functional_call(twin, dict(zip(
                [n for n, _ in twin.named_parameters()], start)), (x,)), y).item()
    assert base < 0.1 * start_loss
    assert abs(loss - base) < 0.2 * base
    # the two runs' parameters part by a small fraction of the distance they travelled (about
    # 7-10% after 60 steps: the moments' FP8 rounding)
    with torch.no_grad():
        apart = sum((a - b).square().sum() for a, b in zip(model.parameters(),
                                                              twin.parameters()))
        moved = sum((a - b).square().sum() for a, b in zip(twin.parameters(), start))
    assert float(apart.sqrt()) < 0.2 * float(moved.sqrt())
    # the FP8 state is 2 bytes a value (plus 8 bytes of scales a block) for the big weight
    big = opt.state[model[0].weight]
    assert big["m"].dtype == torch.float8_e4m3fn
    assert moments.state_bytes(big) <= (2.07 if second_moment != "bf16" else 3.07) * 64 * 128


def test_bf16_parameters_have_no_float32_copy_and_a_seeded_rounding():
    shape = (32, 256)
    grads = _grads(shape, 3)
    results = []
    for seed in (0, 0, 1):
        p = _param(shape, torch.bfloat16)
        opt = fp8ops.FP8AdamW([p], lr=1e-2, seed=seed)
        for g in grads:
            p.grad = g.bfloat16()
            opt.step()
        assert p.dtype == torch.bfloat16
        assert all(t.dtype != torch.float32 or t.numel() <= 1024
                   for t in opt.state[p].values())
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])


def _trained(opt_cls=fp8ops.FP8AdamW, steps=3, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)).to(dtype)
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    _run(model, opt, steps, seed=5)
    return model, opt


def _run(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("second_moment", moments.SECOND_MOMENTS)
def test_state_dict_resumes_exactly(dtype, second_moment):
    model, opt = _trained(dtype=dtype, second_moment=second_moment, min_fp8_numel=1000)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    twin, twin_opt = _trained(steps=0, dtype=dtype, second_moment=second_moment,
                              min_fp8_numel=1000)
    twin.load_state_dict(saved["model"])
    twin_opt.load_state_dict(saved["opt"])
    for key, t in opt.state[model[0].weight].items():  # bytes and dtypes as they were
        got = twin_opt.state[twin[0].weight][key]
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8) if got.dim() else got,
                                                    t.view(torch.uint8) if t.dim() else t)
    _run(model, opt, 3, seed=6)
    _run(twin, twin_opt, 3, seed=6)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_loads_torch_adamw_state_and_gives_it_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8))
    twin.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.05)
    _run(twin, ref, 3, seed=5)
    model.load_state_dict(twin.state_dict())
    opt = fp8ops.FP8AdamW(model.parameters(), lr=1.0)
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.05
    assert opt.param_groups[0]["second_moment"] == "sqrt_e4m3"  # kept: not in torch's state
    w = model[0].weight
    m, v = moments.read(opt.state[w], w.numel())
    exp_avg, exp_avg_sq = (ref.state[twin[0].weight][k].reshape(-1) for k in
                           ("exp_avg", "exp_avg_sq"))
    # E4M3 rounding: within 2^-4 of each value relative to its block's largest, 2^-9 of it below
    assert torch.allclose(m, exp_avg, rtol=2 ** -4, atol=exp_avg.abs().max() * 2 ** -9)
    assert torch.allclose(v.sqrt(), exp_avg_sq.sqrt(), rtol=2 ** -3,
                          atol=exp_avg_sq.sqrt().max() * 2 ** -9)
    assert int(opt.state[w]["step"]) == 3
    _run(model, opt, 3, seed=6)
    _run(twin, ref, 3, seed=6)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=3e-3)
    back = torch.optim.AdamW(model.parameters())
    back.load_state_dict(opt.to_torch_state_dict())
    m, v = moments.read(opt.state[w], w.numel())
    assert torch.equal(back.state[w]["exp_avg"].reshape(-1), m)
    assert torch.equal(back.state[w]["exp_avg_sq"].reshape(-1), v)
    assert back.param_groups[0]["lr"] == 1e-2
    back.step()  # a usable torch state


def test_loading_another_second_moment_format_converts():
    model, opt = _trained(second_moment="e5m2", min_fp8_numel=0)
    twin, twin_opt = _trained(steps=0, second_moment="bf16", min_fp8_numel=0)
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(opt.state_dict())
    # the group's settings are the saved ones, the state follows them
    assert twin_opt.param_groups[0]["second_moment"] == "e5m2"
    assert twin_opt.state[twin[0].weight]["v"].dtype == torch.float8_e5m2


def test_skip_nonfinite_and_clip_grad_norm():
    model, opt = _trained(skip_nonfinite=True)
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: t.clone() for k, t in opt.state[model[0].weight].items()}
    opt.zero_grad()
    model(torch.randn(4, 64)).sum().backward()
    model[0].weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(state[k].float(), t.float())
               for k, t in opt.state[model[0].weight].items())
    model[0].weight.grad[0, 0] = 0.0
    norm = opt.clip_grad_norm_(1e-3)
    assert float(norm) > 1e-3
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(total) <= 1.01e-3
    opt.step()
    assert not opt.last_step_skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_zero_gradients_and_empty_parameters():
    p, e = _param((32, 128)), torch.nn.Parameter(torch.empty(0, 7))
    opt = fp8ops.FP8AdamW([p, e], lr=1e-2, weight_decay=0.0, min_fp8_numel=0)
    before = p.detach().clone()
    for _ in range(3):
        p.grad, e.grad = torch.zeros_like(p), torch.zeros_like(e)
        opt.step()
    assert torch.equal(p, before)
    assert e.shape == (0, 7)


def test_bad_arguments():
    p = _param((4, 4))
    with pytest.raises(ValueError, match="second_moment"):
        fp8ops.FP8AdamW([p], second_moment="fp4")
    with pytest.raises(ValueError, match="betas"):
        fp8ops.FP8AdamW([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        fp8ops.FP8AdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="min_fp8_numel"):
        fp8ops.FP8AdamW([p], min_fp8_numel=-3)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        fp8ops.FP8AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    opt = fp8ops.FP8AdamW([p])
    p.grad = torch.zeros(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    amsgrad = torch.optim.AdamW([p], amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad"):
        fp8ops.FP8AdamW([p]).load_state_dict(amsgrad)


def test_a_refused_param_group_is_not_kept():
    """add_param_group checks after torch's (which fills in the defaults): a group it refuses
    must not stay behind for step() to update, and the same parameters may be added again."""
    a, b = _param((4, 4)), _param((4, 4))
    opt = fp8ops.FP8AdamW([a], lr=1e-2)
    with pytest.raises(ValueError, match="lr must be a float >= 0"):
        opt.add_param_group({"params": [b], "lr": -1.0})
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        opt.add_param_group({"params": [b, half]})
    assert len(opt.param_groups) == 1
    before = b.detach().clone()
    a.grad, b.grad, half.grad = torch.randn(4, 4), torch.randn(4, 4), torch.ones(3).half()
    opt.step()
    assert torch.equal(b, before) and not opt.state.get(b) and torch.all(half == 0)
    opt.add_param_group({"params": [b], "lr": 1e-3})  # the same parameters, fixed options
    opt.step()
    assert not torch.equal(b, before)


def test_param_groups_and_lr_scheduler():
    a, b = _param((32, 128)), _param((8,))
    opt = fp8ops.FP8AdamW([{"params": [a], "second_moment": "e5m2"}, {"params": [b]}], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 2.5e-3
    assert opt.state[a]["v"].dtype == torch.float8_e5m2
    assert opt.state[b]["v"].dtype == torch.float32


def test_under_cpu_offload_the_host_state_is_fp8():
    torch.manual_seed(0)
    model = torch.nn.Sequential(fp8ops.FP8Linear(64, 128), torch.nn.Linear(128, 8))
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), fp8ops.FP8AdamW, lr=1e-2,
                                     min_fp8_numel=0)
    x = torch.randn(16, 64)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    dtypes = {t.dtype for s in opt.optimizer.state.values() for k, t in s.items()
              if k in ("m", "v")}
    assert dtypes == {torch.float8_e4m3fn}


# -- one op call per bucket of parameters -------------------------------------------------------
class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops called under it, in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _mixed_params():
    """Two param groups of float32 and bfloat16 parameters, large (FP8 moments, min_fp8_numel
    256) and small (float32 moments), one of them a non-contiguous tensor."""
    shapes = [((48, 100), torch.float32), ((300,), torch.float32), ((64, 128), torch.bfloat16),
              ((7,), torch.bfloat16), ((10,), torch.float32), ((1000,), torch.bfloat16)]
    first = [_param(s, dt, seed=i) for i, (s, dt) in enumerate(shapes)]
    first.append(torch.nn.Parameter(_param((128, 72), seed=9).detach().t()))  # non-contiguous
    second = [_param((40, 33), seed=10), _param((129,), torch.bfloat16, seed=11),
              _param((500,), torch.bfloat16, seed=12)]
    return [first, second]


def _per_param_loop(groups, grads_per_step, hyper, group_moments):
    """The step as one adamw_step (or step_float32) per parameter, with its own scalars."""
    from fp8ops.ops import adamw
    params = [p.detach().clone() for group in groups for p in group]
    second = [group_moments[g] for g, group in enumerate(groups) for _ in group]
    states, steps = [None] * len(params), [0] * len(params)
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is None:
                continue
            if states[i] is None:
                states[i] = moments.empty_state(p.numel(), second[i], p.numel() >= 256, "cpu")
            steps[i] += 1
            scalars = adamw.step_scalars(hyper["lr"], hyper["betas"], hyper["eps"],
                                         hyper["weight_decay"], True, steps[i], hyper["seed"], i)
            target, st = p.contiguous(), states[i]
            if st["m"].dtype == torch.float32:
                adamw.step_float32(target, g, st["m"], st["v"], *scalars)
            else:
                torch.ops.fp8ops.adamw_step(target, g, st["m"], st["m_scale_inv"], st["v"],
                                            st["v_scale_inv"], *scalars)
            p.copy_(target)
    return params


def test_one_multi_call_per_bucket_equals_the_per_parameter_loop():
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, seed=4)
    groups = _mixed_params()
    flat = [p for group in groups for p in group]
    opt = fp8ops.FP8AdamW([{"params": groups[0]}, {"params": groups[1], "second_moment": "e5m2"}],
                          min_fp8_numel=256, **hyper)
    g = torch.Generator().manual_seed(2)
    grads_per_step = [[(torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype) for p in flat]
                      for _ in range(4)]
    grads_per_step[1][0] = grads_per_step[2][2] = None  # their step counts lag from then on
    grads_per_step[2][7] = None  # a whole bucket without gradients: no call for it
    want = _per_param_loop(groups, grads_per_step, hyper, ["sqrt_e4m3", "e5m2"])
    # FP8 buckets: group 0's float32 (3 params) and bfloat16 (2) ones; group 1's float32 and
    # bfloat16 ones (1 each; its bfloat16 param of 129 values keeps float32 moments)
    expected_calls = [4, 4, 3, 4]
    for grads, calls in zip(grads_per_step, expected_calls):
        for p, grad in zip(flat, grads):
            p.grad = grad
        with _CountOps() as ops:
            opt.step()
        assert ops.calls.count(torch.ops.fp8ops.adamw_step_multi.default) == calls
        assert torch.ops.fp8ops.adamw_step.default not in ops.calls
    assert not flat[6].is_contiguous()
    for p, w in zip(flat, want):
        bits = torch.int32 if p.dtype == torch.float32 else torch.int16
        assert torch.equal(p.detach().view(bits), w.view(bits))
    assert [int(opt.state[p]["step"]) for p in flat[:3]] == [3, 4, 3]


# -- FSDP2 (DTensor parameters), on gloo ---------------------------------------------------------
def _fsdp_model():
    torch.manual_seed(0)
    # 512 x 256 weights: each of 2 ranks holds 256 whole rows, whole 128-value blocks
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                               torch.nn.Linear(512, 256))


def _fsdp_train(model, opt, steps=3, poison_rank=None):
    import torch.distributed as dist
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)  # the same batch on every rank
        x, y = torch.randn(16, 256, generator=g), torch.randn(16, 256, generator=g)
        x, y = (t.to(next(model.parameters()).dtype) for t in (x, y))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if poison_rank is not None and step == 1 and dist.get_rank() == poison_rank:
            model[0].weight.grad.to_local()[0, 0] = float("nan")  # this rank's shard only
        opt.step()
        losses.append(loss.item())
    return losses


def _fsdp_worker(rank, out_dir):
    from torch.distributed.fsdp import fully_shard
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _fsdp_model().to(dtype)
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        opt = fp8ops.FP8AdamW(model.parameters(), lr=1e-2, min_fp8_numel=1024)
        res[dtype] = {"losses": _fsdp_train(model, opt),
                      "weights": [p.full_tensor() for p in model.parameters()],
                      "m_dtype": opt.state[model[0].weight]["m"].dtype}
    model = _fsdp_model()
    fully_shard(model)
    opt = fp8ops.FP8AdamW(model.parameters(), lr=1e-2, skip_nonfinite=True)
    _fsdp_train(model, opt, poison_rank=1)
    res["skipped"] = opt.skipped_steps
    return res


def test_under_fsdp2_trains_as_one_process():
    from dist_spawn import spawn
    results = spawn(_fsdp_worker, world=2)
    model = _fsdp_model()
    opt = fp8ops.FP8AdamW(model.parameters(), lr=1e-2, min_fp8_numel=1024)
    losses = _fsdp_train(model, opt)
    bf16 = _fsdp_model().bfloat16()
    bf16_losses = _fsdp_train(bf16, fp8ops.FP8AdamW(bf16.parameters(), lr=1e-2,
                                                    min_fp8_numel=1024))
    for res in results:
        got = res[torch.float32]
        assert got["m_dtype"] == torch.float8_e4m3fn
        # the same batch on both ranks: the averaged gradient is exact, the blocks are the
        # single process's, so the run is bit for bit the same
        assert got["losses"] == losses
        for a, b in zip(got["weights"], model.parameters()):
            assert torch.equal(a, b)
        # bf16: each rank rounds its own shard with its own part of the stream (the element
        # index is the shard's): not the single process's bytes, the same training
        assert res[torch.bfloat16]["losses"][0] == bf16_losses[0]
        for a, b in zip(res[torch.bfloat16]["losses"], bf16_losses):
            assert abs(a - b) < 0.02 * b, (res[torch.bfloat16]["losses"], bf16_losses)
        assert res["skipped"] == 1  # a NaN on one rank's shard skips the step on both
