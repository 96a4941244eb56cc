"""CPUOffloadOptimizer on the CPU (the device is the host): bit for bit the same training as the
torch optimizer on the same converted model, FP8 weights kept only in FP8, clipping, the
non-finite skip, checkpoints, LR schedulers, the errors, and the exact device byte count."""
import copy
import io
import math

import pytest
import torch
from torch import nn

import fp8ops
from fp8ops.memory import device_state_bytes, fp8_weight_bytes

RECIPES = [fp8ops.CurrentScaling(), fp8ops.DelayedScaling(amax_history_len=4),
           fp8ops.MXFP8Scaling(), fp8ops.BlockwiseScaling()]
IDS = ["current", "delayed", "mxfp8", "blockwise"]
D = 64


class Net(nn.Module):
    """FP8 candidates (up, down) among parameters that stay as they are (embedding, norm, head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, D)
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 10)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.down(torch.relu(self.up(self.ln(x)))))


def _model(recipe, seed=0):
    torch.manual_seed(seed)
    return fp8ops.convert_to_fp8(Net(), recipe, filter_fn=lambda mod, fqn: fqn != "head")


def _batches(seed, steps, micro):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 32, (4, 8), generator=gen) for _ in range(micro)]
            for _ in range(steps)]


def _train(model, opt, batches, clip=None, eval_batch=None, sched=None):
    """Losses (the sum over micro-batches of each step) and, with eval_batch, eval losses."""
    losses, evals = [], []
    for micro in batches:
        total = 0.0
        for idx in micro:
            loss = model(idx).float().pow(2).mean() / len(micro)
            loss.backward()
            total += loss.item()
        if clip is not None:
            if isinstance(opt, fp8ops.CPUOffloadOptimizer):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(total)
        if eval_batch is not None:
            model.eval()
            with torch.no_grad():
                evals.append(model(eval_batch).pow(2).mean().item())
            model.train()
    return losses, evals


def _weights(model):
    """The model's weights from its state_dict (for an offloaded FP8 weight: the master)."""
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
            and "fp8_state" not in k}


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _fp8_layers(model):
    return [m for m in model.modules() if isinstance(m, fp8ops.FP8Linear)]


@pytest.mark.parametrize("micro", [1, 3], ids=["one_batch", "accumulate3"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_same_training_as_adamw_bit_for_bit(recipe, micro):
    ref = _model(recipe)
    off = copy.deepcopy(ref)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **kw)  # the step offload runs
    off_opt = fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW, **kw)
    batches, probe = _batches(1, 4, micro), _batches(2, 1, 1)[0][0]
    ref_losses, ref_evals = _train(ref, ref_opt, batches, eval_batch=probe)
    off_losses, off_evals = _train(off, off_opt, batches, eval_batch=probe)
    assert off_losses == ref_losses and off_evals == ref_evals
    _assert_same(_weights(off), _weights(ref))
    ref_state, off_state = ref_opt.state_dict(), off_opt.state_dict()
    assert off_state["param_groups"] == ref_state["param_groups"]
    for i, s in ref_state["state"].items():
        _assert_same(off_state["state"][i], s)
    for layer in _fp8_layers(off):  # FP8 weights: a one-element placeholder, no gradient
        assert layer.weight.untyped_storage().nbytes() == 4 and layer.weight.grad is None


def test_any_optimizer_and_its_own_kwargs_give_torchs_step():
    for cls, kw in ((torch.optim.AdamW, dict(lr=1e-2, fused=False)),
                    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                    (torch.optim.RMSprop, dict(lr=1e-3))):
        ref = _model(RECIPES[0])
        off = copy.deepcopy(ref)
        expect = dict(kw, fused=True) if cls is torch.optim.SGD else kw
        ref_losses, _ = _train(ref, cls(ref.parameters(), **expect), _batches(3, 3, 2))
        off_losses, _ = _train(off, fp8ops.CPUOffloadOptimizer(off.parameters(), cls, **kw),
                               _batches(3, 3, 2))
        assert off_losses == ref_losses, cls
        _assert_same(_weights(off), _weights(ref))


def test_delayed_scaling_weight_amax_comes_from_the_new_master():
    model = _model(fp8ops.DelayedScaling(amax_history_len=4))
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    _train(model, opt, _batches(4, 2, 1))
    model(_batches(5, 1, 1)[0][0])  # the forward after the step casts the new weights
    up = model.up
    master = opt.master_of(up.weight)
    assert master is up.fp8_state.host_weight.master
    assert up.fp8_state.weight.pending_amax == master.abs().max()


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_optimizer_built_after_a_forward_continues_the_cached_cast(recipe):
    ref = _model(recipe)
    off = copy.deepcopy(ref)
    probe = _batches(20, 1, 1)[0][0]
    # the weight is cast (delayed: its role stepped) before the optimizer exists; each model in
    # turn, as any optimizer step in the process ends every cached cast
    ref(probe)
    ref_losses, _ = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True),
                           _batches(21, 3, 1))
    off(probe)
    off_losses, _ = _train(off, fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW,
                                                           lr=1e-2), _batches(21, 3, 1))
    assert off_losses == ref_losses
    _assert_same(_weights(off), _weights(ref))


@pytest.mark.parametrize("sched_fn", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=6),
], ids=["step", "onecycle"])
def test_lr_schedulers_drive_the_host_step(sched_fn):
    ref = _model(RECIPES[0])
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    off_opt = fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW, lr=1e-2)
    assert isinstance(off_opt, torch.optim.Optimizer)
    ref_sched, off_sched = sched_fn(ref_opt), sched_fn(off_opt)
    ref_losses, _ = _train(ref, ref_opt, _batches(6, 6, 1), sched=ref_sched)
    off_losses, _ = _train(off, off_opt, _batches(6, 6, 1), sched=off_sched)
    assert off_sched.get_last_lr() == ref_sched.get_last_lr() != [1e-2]
    assert off_opt.param_groups is off_opt.optimizer.param_groups
    assert off_losses == ref_losses


def test_clip_grad_norm_matches_torch():
    ref = _model(RECIPES[1])
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    off_opt = fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW, lr=1e-2)
    for micro in _batches(7, 3, 2):
        for model in (ref, off):
            for idx in micro:
                model(idx).pow(2).mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        off_norm = off_opt.clip_grad_norm_(0.05)
        assert torch.equal(off_norm, ref_norm) and ref_norm > 0.05  # it did clip
        ref_opt.step()
        off_opt.step()
        ref_opt.zero_grad()
        off_opt.zero_grad()
    _assert_same(_weights(off), _weights(ref))


def _snapshot(opt):
    return {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no_clip", "clip"])
def test_nonfinite_gradient_skips_the_step(clip):
    ref = _model(RECIPES[0])
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    off_opt = fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW, lr=1e-2,
                                         skip_nonfinite=True)
    _train(ref, ref_opt, _batches(8, 2, 1))
    _train(off, off_opt, _batches(8, 2, 1))
    weights, state = {k: v.clone() for k, v in _weights(off).items()}, _snapshot(off_opt)

    # one bad batch: an inf in the embedding's output poisons every gradient
    for model in (ref, off):
        handle = model.emb.register_forward_hook(lambda m, i, out: out * math.inf)
        model(_batches(9, 1, 1)[0][0]).pow(2).mean().backward()
        handle.remove()
    if clip is not None:
        assert not torch.isfinite(off_opt.clip_grad_norm_(clip))
    off_opt.step()
    assert off_opt.last_step_skipped and off_opt.skipped_steps == 1
    _assert_same(_weights(off), weights)
    for i, s in state.items():
        _assert_same(_snapshot(off_opt)[i], s)
    off_opt.zero_grad()
    ref_opt.zero_grad()  # the reference never steps on the bad batch

    ref_losses, _ = _train(ref, ref_opt, _batches(10, 2, 1))
    off_losses, _ = _train(off, off_opt, _batches(10, 2, 1))
    assert off_losses == ref_losses and not off_opt.last_step_skipped
    _assert_same(_weights(off), _weights(ref))


def test_by_default_a_nonfinite_gradient_is_stepped_as_torch_does():
    model = _model(RECIPES[0])
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    model.emb.register_forward_hook(lambda m, i, out: out * math.inf)
    model(_batches(9, 1, 1)[0][0]).pow(2).mean().backward()
    opt.step()
    assert not opt.last_step_skipped and torch.isnan(model.ln.weight).any()


def _save(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("order", ["model_then_opt", "opt_then_model", "model_before_opt"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_resume_is_bit_exact(recipe, order):
    model = _model(recipe)
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(model, opt, _batches(11, 3, 2))
    ckpt = _save(model, opt)
    expected, _ = _train(model, opt, _batches(12, 3, 2))

    fresh = _model(recipe, seed=99)  # another init: everything must come from the checkpoint
    if order == "model_before_opt":
        fresh.load_state_dict(ckpt["model"])
    fresh_opt = fp8ops.CPUOffloadOptimizer(fresh.parameters(), torch.optim.AdamW, lr=1e-2)
    if order == "model_then_opt":
        fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    if order == "opt_then_model":
        fresh.load_state_dict(ckpt["model"])
    _assert_same(_weights(fresh), {k: v for k, v in ckpt["model"].items()
                                   if isinstance(v, torch.Tensor) and "fp8_state" not in k})
    assert _train(fresh, fresh_opt, _batches(12, 3, 2))[0] == expected


def test_optimizer_state_dict_round_trips_exactly():
    model = _model(RECIPES[1])
    opt = fp8ops.CPUOffloadOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2)
    _train(model, opt, _batches(13, 2, 1))
    saved = _save(model, opt)["opt"]
    other = _model(RECIPES[1], seed=5)
    other_opt = fp8ops.CPUOffloadOptimizer(other.named_parameters(), torch.optim.AdamW, lr=1e-2)
    other_opt.load_state_dict(saved)
    again = other_opt.state_dict()
    assert again["param_groups"] == saved["param_groups"]
    assert saved["param_groups"][0]["param_names"][0] == "emb.weight"
    assert again["state"].keys() == saved["state"].keys()
    for i in saved["state"]:
        _assert_same(again["state"][i], saved["state"][i])
    # torch's own format: a plain AdamW loads it
    plain = torch.optim.AdamW(_model(RECIPES[1]).named_parameters(), lr=1e-2, fused=True)
    plain.load_state_dict(saved)


@pytest.mark.parametrize("order", ["model_then_opt", "opt_then_model"])
def test_bf16_parameters_have_fp32_masters_and_resume_exactly(order):
    model = _model(RECIPES[1]).to(torch.bfloat16)
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(model, opt, _batches(14, 2, 2))
    masters = opt.state_dict()["masters"]
    assert len(masters) == len(list(model.parameters()))  # every copy is rounded to bf16
    assert all(m.dtype == torch.float32 for m in masters.values())
    assert torch.equal(model.ln.weight, masters[1].to(torch.bfloat16))  # the device copy
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values())
    ckpt = _save(model, opt)
    expected, _ = _train(model, opt, _batches(15, 2, 2))

    fresh = _model(RECIPES[1], seed=7).to(torch.bfloat16)
    fresh_opt = fp8ops.CPUOffloadOptimizer(fresh.parameters(), torch.optim.AdamW, lr=1e-2)
    if order == "model_then_opt":
        fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    if order == "opt_then_model":  # bf16 copies of the masters: the exact masters stay
        fresh.load_state_dict(ckpt["model"])
    assert _train(fresh, fresh_opt, _batches(15, 2, 2))[0] == expected


def test_a_model_checkpoint_loaded_after_the_optimizer_becomes_the_masters():
    ckpt = _model(RECIPES[0], seed=3).to(torch.bfloat16).state_dict()
    model = _model(RECIPES[0]).to(torch.bfloat16)
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=0.0)
    model.load_state_dict(ckpt)  # e.g. fine-tuning: new weights, a fresh optimizer
    _train(model, opt, _batches(22, 1, 1))  # lr 0: the step writes the masters back unchanged
    _assert_same(_weights(model), {k: v for k, v in ckpt.items() if "fp8_state" not in k})


def test_offload_gradients_false_keeps_the_other_gradients_on_the_device():
    ref = _model(RECIPES[0]).to(torch.bfloat16)
    off = copy.deepcopy(ref)
    ref_opt = fp8ops.CPUOffloadOptimizer(ref.parameters(), torch.optim.AdamW, lr=1e-2)
    off_opt = fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW, lr=1e-2,
                                         offload_gradients=False)
    idx = _batches(16, 1, 1)[0][0]
    for model in (ref, off):
        model(idx).float().pow(2).mean().backward()
    assert off.ln.weight.grad is not None and ref.ln.weight.grad is None
    assert off.up.weight.grad is None  # FP8 weights never keep one
    ref_opt.step()
    off_opt.step()
    _assert_same(_weights(off), _weights(ref))


def test_add_param_group_and_named_parameters():
    model = _model(RECIPES[0])
    body = [(n, p) for n, p in model.named_parameters() if not n.startswith("head")]
    opt = fp8ops.CPUOffloadOptimizer(body, torch.optim.AdamW, lr=1e-2)
    opt.add_param_group({"params": list(model.head.named_parameters()), "lr": 0.0})
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 0.0]
    head = model.head.weight.detach().clone()
    up = model.up.fp8_state.host_weight.master.clone()
    _train(model, opt, _batches(17, 2, 1))
    assert torch.equal(model.head.weight, head)  # lr 0
    assert not torch.equal(model.up.fp8_state.host_weight.master, up)


def test_model_state_dict_has_the_weights_and_loads_into_a_plain_model():
    model = _model(RECIPES[0])
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(model, opt, _batches(18, 2, 1))
    plain = Net()
    plain.load_state_dict(fp8ops.plain_state_dict(model), strict=True)
    assert torch.equal(plain.up.weight, model.up.fp8_state.host_weight.master)
    assert torch.equal(plain(_batches(19, 1, 1)[0][0]), plain(_batches(19, 1, 1)[0][0]))
    with pytest.raises(ValueError, match="CPUOffloadOptimizer"):
        fp8ops.convert_from_fp8(model)
    with pytest.raises(RuntimeError, match="size mismatch for up.weight"):
        bad = dict(model.state_dict(), **{"up.weight": torch.zeros(3, 3)})
        model.load_state_dict(bad)


# -- the parameter of an offloaded FP8Linear weight, as user code touches it -------------------
_OWNED_MSG = (r"parameter 'up\.weight' is an FP8 weight owned by a CPUOffloadOptimizer; its "
              r"values are the optimizer's FP32 master on the host")
_READS = {
    "norm": lambda w: w.norm(),
    "arithmetic": lambda w: w * 2,
    "item": lambda w: float(w[0, 0]),
    "equal": lambda w: torch.equal(w, w),
    "stack": lambda w: torch.stack([w, w]),
    "data": lambda w: w.data.abs().max(),
    "detach": lambda w: w.detach().sum(),
    "transpose": lambda w: w.T.sum(),
    "to_vector": lambda w: torch.nn.utils.parameters_to_vector([w]),
    "tied_module": lambda w: nn.functional.embedding(torch.tensor([0]), w),
    "write": lambda w: w.data.mul_(2),
    "init": lambda w: nn.init.normal_(w),
    "assign": lambda w: setattr(w, "data", torch.zeros(w.shape)),
}


@pytest.mark.parametrize("read", list(_READS))
def test_reading_an_offloaded_weight_raises_and_says_where_the_values_are(read):
    model = _model(RECIPES[0])
    opt = fp8ops.CPUOffloadOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2)
    _train(model, opt, _batches(30, 1, 1))
    master = opt.master_of(model.up.weight).clone()
    with pytest.raises(RuntimeError, match=_OWNED_MSG + r".*opt\.master_of\(param\).*"
                                           r"model\.state_dict\(\)"):
        _READS[read](model.up.weight)
    assert torch.equal(opt.master_of(model.up.weight), master)
    assert model.up.weight.untyped_storage().nbytes() == 4


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_an_offloaded_model_is_used_as_any_model(recipe):
    ref = _model(recipe)
    model = copy.deepcopy(ref)
    count = sum(p.numel() for p in model.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = fp8ops.CPUOffloadOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2)
    for m in (ref, model):
        fp8ops.monitor(m, every=1)
    w = model.up.weight
    assert sum(p.numel() for p in model.parameters()) == count  # the real count
    assert isinstance(w, nn.Parameter) and w.requires_grad and w.is_leaf
    assert (w.shape, w.dtype, w.device) == (ref.up.weight.shape, torch.float32,
                                            ref.up.weight.device)
    text = [repr(model), repr(w), str(w), f"{w}", "%s" % (w,)]
    assert all("nan" not in t.lower() for t in text)
    assert all("parameter 'up.weight'" in t and "master_of" in t for t in text[1:])
    model.to("cpu").float().to(torch.float32).cpu().requires_grad_(True)  # these change nothing

    for step, micro in enumerate(_batches(33, 3, 2)):
        for m in (ref, model):
            for idx in micro:
                m(idx).pow(2).mean().backward()
        # over the model, torch's clipping sees the gradients left on the device: none of an
        # offloaded FP8Linear weight (opt.clip_grad_norm_ clips the host ones); it reads no value
        device_grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert w.grad is None and len(device_grads) == len(list(model.parameters())) - 2
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        assert torch.isfinite(norm) and torch.equal(norm, torch.nn.utils.get_total_norm(
            device_grads))
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    _assert_same(_weights(model), _weights(ref))
    kept = model.state_dict(keep_vars=True)
    assert type(kept["up.weight"]) is torch.Tensor
    assert torch.equal(kept["up.weight"], opt.master_of(w))
    stats, ref_stats = fp8ops.stats(model), fp8ops.stats(ref)
    assert stats == ref_stats and all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_copy_of_an_offloaded_model_trains_on_its_own(recipe, dtype):
    """copy.deepcopy of an offloaded model: ordinary parameters with the masters' values, owned
    by no optimizer, trained by any optimizer as a model loaded from the same checkpoint."""
    model = _model(recipe).to(dtype)
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(model, opt, _batches(31, 2, 2))
    master = opt.master_of(model.up.weight).clone()
    ckpt = copy.deepcopy(model.state_dict())
    batches = _batches(32, 3, 2)
    for make_opt in (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
                     lambda p: fp8ops.CPUOffloadOptimizer(p, torch.optim.AdamW, lr=1e-2)):
        twin = copy.deepcopy(model)
        for layer in _fp8_layers(twin):
            assert type(layer.weight) is nn.Parameter and layer.fp8_state.host_weight is None
        assert twin.up.weight.dtype == dtype and torch.equal(twin.up.weight, master.to(dtype))
        ref = _model(recipe, seed=99).to(dtype)
        ref.load_state_dict(ckpt)
        expected, _ = _train(ref, make_opt(ref.parameters()), batches)
        assert _train(twin, make_opt(twin.parameters()), batches)[0] == expected
        _assert_same(_weights(twin), _weights(ref))
    assert torch.equal(opt.master_of(model.up.weight), master)  # the original is untouched


def test_a_saved_offloaded_model_loads_as_a_plain_model():
    model = _model(RECIPES[1])
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(model, opt, _batches(34, 2, 1))
    saved = {}
    for name, m in (("offloaded", model), ("copy", copy.deepcopy(model))):
        buf = io.BytesIO()
        torch.save(m, buf)
        saved[name] = buf.getvalue()
    # the masters are saved once, as the parameters' values, not a second time as host weights
    assert len(saved["offloaded"]) < len(saved["copy"]) + 1024
    loaded = torch.load(io.BytesIO(saved["offloaded"]), weights_only=False)
    for layer in _fp8_layers(loaded):
        assert type(layer.weight) is nn.Parameter and layer.fp8_state.host_weight is None
    _assert_same(_weights(loaded), _weights(model))
    ref = _model(RECIPES[1], seed=99)
    ref.load_state_dict(model.state_dict())
    batches = _batches(35, 2, 1)
    expected, _ = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), batches)
    assert _train(loaded, torch.optim.AdamW(loaded.parameters(), lr=1e-2, fused=True),
                  batches)[0] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_second_optimizer_over_owned_parameters_raises_naming_one(dtype):
    model = _model(RECIPES[0]).to(dtype)
    twin = copy.deepcopy(model)
    opt = fp8ops.CPUOffloadOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2)
    twin_opt = fp8ops.CPUOffloadOptimizer(twin.parameters(), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="master_of: .* not one of this optimizer's param"):
        opt.master_of(twin.up.weight)
    owned = [list(model.named_parameters()), [("up.weight", model.up.weight)],
             list(model.ln.named_parameters(prefix="ln"))]
    for params in owned:  # the first of them is named
        name = params[0][0]
        with pytest.raises(ValueError, match=rf"parameter '{name}' is already owned by another "
                                             r"CPUOffloadOptimizer.*copy\.deepcopy\(model\)"):
            fp8ops.CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-2)
    batches = _batches(36, 2, 2)  # the failed builds changed nothing
    assert _train(model, opt, batches)[0] == _train(twin, twin_opt, batches)[0]
    # the model stays offloaded (placeholder, hooks) without its optimizer: still owned
    del opt
    with pytest.raises(ValueError, match="parameter 'up.weight' is already owned"):
        fp8ops.CPUOffloadOptimizer([("up.weight", model.up.weight)], torch.optim.AdamW)


def test_moving_or_converting_an_offloaded_weight_raises_and_no_op_conversions_pass():
    layer = fp8ops.FP8Linear(D, D, recipe=RECIPES[0])
    opt = fp8ops.CPUOffloadOptimizer(layer.named_parameters(), torch.optim.AdamW)
    layer.to("cpu").float().to(torch.float32).cpu()
    assert layer.weight.type() == "torch.FloatTensor"
    for convert in (layer.half, layer.double, lambda: layer.to(torch.bfloat16)):
        with pytest.raises(RuntimeError, match="parameter 'weight' is an FP8 weight .* "
                                               "move or convert the model before building"):
            convert()
    assert layer.weight.dtype == torch.float32 and layer.weight.untyped_storage().nbytes() == 4
    assert opt.master_of(layer.weight).dtype == torch.float32


# -- errors ------------------------------------------------------------------------------------
def test_error_for_a_non_leaf_parameter_names_it():
    model = _model(RECIPES[0])
    scaled = model.ln.weight * 2
    with pytest.raises(ValueError, match="parameter 'ln.scaled' is not a leaf"):
        fp8ops.CPUOffloadOptimizer([("ln.scaled", scaled)], torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 \(shape \(64,\)\) is not"):
        fp8ops.CPUOffloadOptimizer([model.emb.weight, scaled], torch.optim.AdamW)
    assert model.up.weight.untyped_storage().nbytes() > 4  # nothing was offloaded


@pytest.mark.parametrize("cls", [object, torch.optim.AdamW([nn.Parameter(torch.ones(1))]),
                                 "AdamW", torch.optim.LBFGS], ids=["object", "instance", "str",
                                                                   "lbfgs"])
def test_error_for_an_optimizer_class_that_is_not_an_optimizer(cls):
    model = _model(RECIPES[0])
    with pytest.raises(TypeError, match="optimizer_class|LBFGS"):
        fp8ops.CPUOffloadOptimizer(model.parameters(), cls)
    assert model.up.weight.untyped_storage().nbytes() > 4


def test_error_for_sparse_gradients_names_the_parameter():
    for dtype in (torch.float32, torch.bfloat16):  # stepped in place / with a master copy
        emb = nn.Embedding(10, 4, sparse=True, dtype=dtype)
        opt = fp8ops.CPUOffloadOptimizer(nn.ModuleDict({"emb": emb}).named_parameters(),
                                         torch.optim.SGD, lr=0.1)
        with pytest.raises(RuntimeError, match="parameter 'emb.weight' got a sparse gradient"):
            emb(torch.tensor([1, 2])).float().sum().backward()
            opt.step()


def test_other_errors():
    model = _model(RECIPES[0])
    with pytest.raises(ValueError, match="empty parameter list"):
        fp8ops.CPUOffloadOptimizer([], torch.optim.AdamW)
    with pytest.raises(ValueError, match="appears more than once"):
        fp8ops.CPUOffloadOptimizer([{"params": [model.ln.weight]}, {"params": [model.ln.weight]}],
                                   torch.optim.AdamW)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, nonsense=1)

    class Tagged(nn.Parameter):
        pass

    model.up.weight = Tagged(model.up.weight.detach())
    with pytest.raises(TypeError, match="parameter 'up.weight' is an FP8 weight of type .*"
                                        "Tagged; only a plain nn.Parameter"):
        fp8ops.CPUOffloadOptimizer(model.named_parameters(), torch.optim.AdamW)
    assert model.up.weight.untyped_storage().nbytes() > 4  # a failed build changes nothing


# -- device bytes ------------------------------------------------------------------------------
def _expected_payload(recipe, n, k):
    if isinstance(recipe, fp8ops.MXFP8Scaling):
        return 2 * n * k + 2 * n * k // 32  # row and column copies, one E8M0 byte per 32
    if isinstance(recipe, fp8ops.BlockwiseScaling):
        return 2 * n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)  # fp32 per 128x128
    return 2 * n * k + 8  # data, transposed data, scale_inv and the scale it inverts


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_device_bytes_per_fp8_parameter(recipe):
    n, k = 256, 128
    offloaded = fp8ops.FP8Linear(k, n, recipe=recipe)
    plain = copy.deepcopy(offloaded)
    opt = fp8ops.CPUOffloadOptimizer(offloaded.parameters(), torch.optim.AdamW)
    ref_opt = torch.optim.AdamW(plain.parameters(), fused=True)
    for _ in range(2):  # steady state: the count just before the second step
        for layer, o in ((offloaded, opt), (plain, ref_opt)):
            layer(torch.randn(8, k)).sum().backward()
        before = fp8_weight_bytes(offloaded), fp8_weight_bytes(plain)
        state = device_state_bytes(offloaded, opt), device_state_bytes(plain, ref_opt)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    payload = _expected_payload(recipe, n, k)
    assert before[0] == 4 + payload  # placeholder + the FP8 cast, no gradient
    assert before[0] / (n * k) <= 2.5
    assert before[1] == 4 * n * k * 2 + payload  # float32 weight and gradient + the FP8 cast
    # the whole layer: the bias stays in float32 on the device; gradients and state are on the
    # host (on a CPU-only machine the bias's gradient is its master's)
    assert state[0]["gradients"] == 0 and state[0]["optimizer_state"] == 0
    assert state[0]["total"] == before[0] + 4 * n + state[0]["buffers"]
    assert state[1]["gradients"] == 4 * (n * k + n)
    assert state[1]["optimizer_state"] == 2 * 4 * (n * k + n) + 2 * 4  # exp_avg(_sq), steps


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=IDS[:2])
def test_torch_compile_fullgraph_trains_the_same(recipe):
    """Compiled, the layer casts the host master each call (no weight cache under compile)."""
    ref = _model(recipe)
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    off_opt = fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW, lr=1e-2)
    ref_losses, _ = _train(torch.compile(ref, backend="aot_eager", fullgraph=True), ref_opt,
                           _batches(23, 3, 1))
    off_losses, _ = _train(torch.compile(off, backend="aot_eager", fullgraph=True), off_opt,
                           _batches(23, 3, 1))
    assert off_losses == ref_losses
    _assert_same(_weights(off), _weights(ref))


class Checkpointed(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, idx):
        x = self.net.emb(idx)
        mlp = lambda x: self.net.down(torch.relu(self.net.up(self.net.ln(x))))  # noqa: E731
        return self.net.head(x + torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False))


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=IDS[:2])
def test_activation_checkpointing_and_inference_mode_as_without_offload(recipe):
    ref = Checkpointed(_model(recipe))
    off = copy.deepcopy(ref)
    probe = _batches(24, 1, 1)[0][0]
    out = {}
    for name, model, opt in (
            ("ref", ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)),
            ("off", off, fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW,
                                                    lr=1e-2))):
        losses = []
        for micro in _batches(25, 3, 2):
            with torch.inference_mode():  # a cast under inference mode, then training
                losses.append(model(probe).pow(2).mean().item())
            losses += _train(model, opt, [micro])[0]
        out[name] = losses
    assert out["off"] == out["ref"]
    _assert_same(_weights(off), _weights(ref))


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_state_dict_tensor_edited_in_place_is_seen(recipe):
    """The float32 master is the state_dict's tensor (no copy, as torch gives a parameter): an
    in-place write to it changes the weight, and the next forward casts the new values, as the
    same write does to a model trained without offload."""
    ref = _model(recipe)
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    off_opt = fp8ops.CPUOffloadOptimizer(off.parameters(), torch.optim.AdamW, lr=1e-2)
    idx = _batches(41, 1, 1)[0][0]
    outs = []
    for model, opt in ((ref, ref_opt), (off, off_opt)):
        _train(model, opt, _batches(40, 2, 1))
        model(idx).float().pow(2).mean().backward()  # a cast the next forward would reuse
        model.state_dict()["up.weight"].mul_(0.5)
        with torch.no_grad():
            outs.append(model(idx))
    assert torch.equal(outs[1], outs[0])
