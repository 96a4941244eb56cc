"""FP8Linear, convert_to_fp8, state_dict round trips and torch.compile."""
import copy
import io
import logging
import pickle

import pytest
import torch
from torch import nn

import fp8ops
from fp8ops.ops import emulation, scratch

RECIPES = [None, fp8ops.DelayedScaling(amax_history_len=4), fp8ops.MXFP8Scaling(),
           fp8ops.BlockwiseScaling()]
IDS = ["current", "delayed", "mxfp8", "blockwise"]
STOCHASTIC = fp8ops.CurrentScaling(grad_rounding="stochastic", seed=3)


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


def test_fp8linear_is_an_nn_linear_with_its_init_and_keys():
    torch.manual_seed(0)
    ref = nn.Linear(48, 24)
    torch.manual_seed(0)
    lin = fp8ops.FP8Linear(48, 24, recipe=fp8ops.DelayedScaling())
    assert isinstance(lin, nn.Linear) and torch.equal(lin.weight, ref.weight)
    keys = set(lin.state_dict())
    assert {"weight", "bias", "fp8_state.input.amax_history", "fp8_state.grad.scale"} <= keys
    assert "DelayedScaling" in repr(lin)


def test_convert_to_fp8_shares_parameters_and_filters():
    model = Block()
    up_w = model.up.weight
    out = fp8ops.convert_to_fp8(model, fp8ops.CurrentScaling(),
                                filter_fn=lambda mod, fqn: fqn != "head")
    assert out is model
    assert isinstance(model.up, fp8ops.FP8Linear) and isinstance(model.down, fp8ops.FP8Linear)
    assert type(model.head) is nn.Linear
    assert model.up.weight is up_w
    assert fp8ops.convert_to_fp8(model) is model  # already converted layers stay as they are
    single = fp8ops.convert_to_fp8(nn.Linear(4, 4))
    assert isinstance(single, fp8ops.FP8Linear)
    with pytest.raises(TypeError, match="recipe must be"):
        fp8ops.convert_to_fp8(Block(), recipe="delayed")
    with pytest.raises(TypeError, match=r"pass an instance: DelayedScaling\(\)"):
        fp8ops.convert_to_fp8(Block(), fp8ops.DelayedScaling)


def test_print_shows_the_recipe_once_and_each_layer_its_name():
    recipe = fp8ops.DelayedScaling(amax_history_len=4)
    model = fp8ops.convert_to_fp8(Block(), recipe)
    text = repr(model)
    assert text.count(repr(recipe)) == 1
    assert "fp8ops: 3 FP8 layers, recipe=" + repr(recipe) in text
    assert text.count("recipe=DelayedScaling\n") == 3
    copied = copy.deepcopy(model)
    assert repr(copied) == text and copied.extra_repr.module is copied
    fp8ops.convert_from_fp8(model)
    assert "fp8ops" not in repr(model)


def _train(model, steps, seed, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_state_dict_roundtrip_mid_training(recipe):
    torch.manual_seed(0)
    model = fp8ops.convert_to_fp8(Block(), recipe)
    _, opt = _train(model, 3, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    cont, _ = _train(model, 3, seed=2, opt=opt)

    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    fresh = fp8ops.convert_to_fp8(Block(), recipe)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    resumed, _ = _train(fresh, 3, seed=2, opt=fresh_opt)
    assert resumed == cont
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, k


@pytest.mark.parametrize("recipe, backend", [(None, "inductor"),
                                             (fp8ops.DelayedScaling(amax_history_len=4), "inductor"),
                                             (fp8ops.MXFP8Scaling(), "aot_eager"),
                                             (fp8ops.BlockwiseScaling(), "aot_eager")],
                         ids=IDS)
def test_torch_compile_fullgraph_matches_eager(recipe, backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = fp8ops.convert_to_fp8(Block(), recipe)
    torch.manual_seed(0)
    compiled_model = fp8ops.convert_to_fp8(Block(), recipe)
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)  # no graph break
    le, _ = _train(eager, 3, seed=5, opt=torch.optim.SGD(eager.parameters(), lr=0.1))
    lc, _ = _train(compiled, 3, seed=5, opt=torch.optim.SGD(compiled_model.parameters(), lr=0.1))
    # The first step is bit-identical (same FP8 kernels, same inputs). Inductor may sum the bias
    # gradient in another order (a float32 ulp), so later steps are compared with a tolerance.
    assert le[0] == lc[0]
    assert le == pytest.approx(lc, rel=1e-4)
    for (k, a), (_, b) in zip(eager.state_dict().items(), compiled_model.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-6), k
        else:
            assert a == b, k


def test_eval_mode_uses_the_scales_and_records_nothing():
    lin = fp8ops.FP8Linear(32, 16, recipe=fp8ops.DelayedScaling(amax_history_len=4))
    lin(torch.randn(4, 32)).sum().backward()
    before = {k: v.clone() for k, v in lin.fp8_state.state_dict().items() if torch.is_tensor(v)}
    lin.eval()
    with torch.no_grad():
        lin(torch.randn(4, 32) * 100)
    for k, v in lin.fp8_state.state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, before[k]), k
    lin.train()
    lin(torch.randn(4, 32))
    assert lin.fp8_state.input.step.item() == 2


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_the_modules_mode_decides_recording_not_grad_mode(grad_mode):
    """As BatchNorm's running statistics: a no_grad / inference_mode forward in training mode
    records and steps (docs/numerics.md, "Eval mode"); validate in eval()."""
    lin = fp8ops.FP8Linear(32, 16, recipe=fp8ops.DelayedScaling(amax_history_len=4))
    lin(torch.randn(4, 32)).sum().backward()
    with grad_mode():
        lin(torch.randn(4, 32) * 100)
    assert lin.fp8_state.input.step.item() == 2
    assert lin.fp8_state.input.pending_amax.item() > 50  # recorded, for the next step


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to(torch.bfloat16),
                                     lambda m: m.to("meta", torch.float16)],
                         ids=["half", "to_bf16", "to_meta_fp16"])
def test_dtype_conversion_keeps_the_fp8_state_float32(convert):
    lin = fp8ops.FP8Linear(32, 16, recipe=fp8ops.DelayedScaling(amax_history_len=4))
    with torch.no_grad():
        lin.fp8_state.input.scale.fill_(1e6)  # beyond float16's range
    before = {k: v.clone() for k, v in lin.fp8_state.named_buffers()}
    convert(lin)
    assert lin.weight.dtype in (torch.float16, torch.bfloat16)
    for k, v in lin.fp8_state.named_buffers():
        assert v.dtype == before[k].dtype and v.device == lin.weight.device, k
        if v.device.type == "cpu":
            assert torch.equal(v, before[k]), k


def test_half_module_trains_with_float32_scales():
    lin = fp8ops.FP8Linear(32, 16, recipe=fp8ops.DelayedScaling(amax_history_len=4)).half()
    for _ in range(3):
        lin(torch.randn(4, 32, dtype=torch.float16) * 1e3).float().sum().backward()
    assert lin.fp8_state.input.scale.dtype == torch.float32
    assert torch.isfinite(lin.fp8_state.input.scale) and torch.isfinite(lin.weight.grad).all()


def _assert_same_state_dict(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k


def test_meta_init_then_to_empty_and_reset_parameters():
    recipe = fp8ops.DelayedScaling(amax_history_len=4, seed=5)
    lin = fp8ops.FP8Linear(32, 16, recipe=recipe, device="meta")
    assert all(b.device.type == "meta" for b in lin.fp8_state.buffers())
    lin.to_empty(device="cpu")
    with torch.no_grad():
        for b in lin.fp8_state.buffers():
            b.fill_(7)  # what to_empty() may leave there
    lin.fp8_state.rng_offset = 9
    lin.reset_parameters()
    _assert_same_state_dict(lin.fp8_state.state_dict(), fp8ops.ScalingState(recipe).state_dict())


def test_meta_model_converted_then_materialized_trains_like_a_cpu_one():
    recipe = fp8ops.DelayedScaling(amax_history_len=4)
    with torch.device("meta"):
        meta = fp8ops.convert_to_fp8(Block(), recipe)
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for b in meta.buffers():
            b.fill_(7)
    torch.manual_seed(0)
    for mod in meta.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    torch.manual_seed(0)
    ref = fp8ops.convert_to_fp8(Block(), recipe)
    _assert_same_state_dict(meta.state_dict(), ref.state_dict())
    assert _train(meta, 3, seed=4)[0] == _train(ref, 3, seed=4)[0]


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_inference_mode_forward_then_training_step(recipe, mode):
    """Validation under torch.inference_mode must leave nothing behind that autograd cannot save,
    and must act exactly as it does under no_grad."""
    torch.manual_seed(0)
    model = fp8ops.convert_to_fp8(Block(), recipe)
    torch.manual_seed(0)
    ref = fp8ops.convert_to_fp8(Block(), recipe)
    x = torch.randn(16, 64)
    model.train(mode == "train")
    ref.train(mode == "train")
    with torch.inference_mode():
        model(x)
    with torch.no_grad():
        ref(x)
    model.train()
    ref.train()
    out, ref_out = model(x), ref(x)
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    assert torch.equal(out, ref_out)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


INFERENCE_RECIPES = [fp8ops.DelayedScaling(), fp8ops.CurrentScaling(),
                     fp8ops.CurrentScaling(grad_rounding="stochastic"), fp8ops.MXFP8Scaling(),
                     fp8ops.BlockwiseScaling()]


@pytest.mark.parametrize("recipe", INFERENCE_RECIPES,
                         ids=["delayed", "current", "stochastic", "mxfp8", "blockwise"])
def test_inference_mode_first_leaves_nothing_training_cannot_write(recipe, monkeypatch):
    """An inference-mode forward that is the process's first (so the emulation's reusable
    buffers are made under inference mode), then a training step, then inference again: each
    output and gradient is the one of a layer that runs the same steps under no_grad."""
    monkeypatch.setattr(scratch, "_BUFFERS", scratch._Buffers())  # none made yet
    monkeypatch.setattr(emulation, "_E8M0_TABLES", {})
    torch.manual_seed(0)
    layer = fp8ops.FP8Linear(64, 64, recipe=recipe)
    ref = copy.deepcopy(layer)
    x = torch.randn(8, 64)
    results = []
    for lin, no_autograd in ((layer, torch.inference_mode), (ref, torch.no_grad)):
        with no_autograd():
            first = lin(x)
        out = lin(x)
        out.square().sum().backward()
        with no_autograd():
            last = lin(x)
        results.append((first, out.detach(), last, lin.weight.grad, lin.bias.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def _train_with_validation(model, steps, seed, validate):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    val = torch.Generator().manual_seed(seed + 1)
    outs = []
    for _ in range(steps):
        if validate:
            model.eval()
            with torch.no_grad():
                model(torch.randn(16, 64, generator=val) * 10)
            with torch.inference_mode():
                model(torch.randn(16, 64, generator=val))
            model.train()
        x = torch.randn(16, 64, generator=gen)
        for _ in range(2):  # two microbatches
            out = model(x)
            out.pow(2).mean().backward()
            outs.append(out.detach())
        opt.step()
        opt.zero_grad()
    return outs


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_eval_forwards_have_no_effect_on_training(recipe):
    torch.manual_seed(0)
    plain = fp8ops.convert_to_fp8(Block(), recipe)
    torch.manual_seed(0)
    validated = fp8ops.convert_to_fp8(Block(), recipe)
    a = _train_with_validation(plain, 4, seed=3, validate=False)
    b = _train_with_validation(validated, 4, seed=3, validate=True)
    for step, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), step
    _assert_same_state_dict(plain.state_dict(), validated.state_dict())


def _lockstep(a, b, plan, seed):
    """Runs the plan ("micro": forward + backward, "step": optimizer step, "eval": an eval
    forward) on two (model, optimizer) pairs side by side: every optimizer step in the process
    starts a new weight version for every layer, so the pairs must not run ahead of each other.
    Asserts bit-identical outputs and gradients throughout."""
    gen = torch.Generator().manual_seed(seed)
    for i, kind in enumerate(plan):
        if kind == "step":
            for _, opt in (a, b):
                opt.step()
                opt.zero_grad()
            continue
        x = torch.randn(16, 64, generator=gen) * (1 + i % 3)
        outs = []
        for model, _ in (a, b):
            model.train(kind == "micro")
            with torch.set_grad_enabled(kind == "micro"):
                out = model(x)
            if kind == "micro":
                out.pow(2).mean().backward()
            outs.append(out)
            model.train()
        assert torch.equal(outs[0], outs[1]), (i, kind)
        for p, q in zip(a[0].parameters(), b[0].parameters()):
            assert (p.grad is None) == (q.grad is None) and (
                p.grad is None or torch.equal(p.grad, q.grad)), (i, kind)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _copy_grads(src, dst):
    for p, q in zip(src.parameters(), dst.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()


CONTINUE = ["micro", "eval", "micro", "step", "micro", "micro", "step", "micro"]


@pytest.mark.parametrize("recipe", [RECIPES[1], STOCHASTIC], ids=["delayed", "stochastic"])
def test_parameters_swapped_by_module_apply_train_on_exactly(recipe):
    """Module._apply swaps the parameters it cannot change in place (FSDP2's DTensor ones, as in
    to_empty() after fully_shard; here torch.__future__'s swap flag): swap_tensors refuses a
    tensor with weak references, so the FP8 state lets go of its own and takes them again. The
    swapped model, mid-accumulation, trains on exactly as the one that was not swapped (its
    optimizer steps still end the cast, its gradients still vouch for it)."""
    torch.manual_seed(0)
    model = fp8ops.convert_to_fp8(Block(), recipe)
    twin = copy.deepcopy(model)
    pairs = ((model, _sgd(model)), (twin, _sgd(twin)))
    _lockstep(*pairs, ["micro", "step", "micro"], seed=1)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        weight = twin.up.weight
        twin.float()  # float32 already: the values stay, the tensors are swapped
        assert twin.up.weight is weight  # the same Python object, swapped contents
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    _lockstep(*pairs, CONTINUE, seed=3)
    _assert_same_state_dict(model.state_dict(), twin.state_dict())


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("when", ["mid_accumulation", "after_step", "eval_after_load"])
def test_resume_from_state_dict_is_exact(recipe, when):
    torch.manual_seed(0)
    model = fp8ops.convert_to_fp8(Block(), recipe)
    opt = _sgd(model)
    _train(model, 2, seed=1, opt=opt)
    if when != "after_step":
        gen = torch.Generator().manual_seed(2)
        model(torch.randn(16, 64, generator=gen)).pow(2).mean().backward()  # first microbatch
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    fresh = fp8ops.convert_to_fp8(Block(), recipe)
    fresh_opt = _sgd(fresh)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    _copy_grads(model, fresh)  # gradients are not in a checkpoint
    plan = (["eval"] if when == "eval_after_load" else []) + CONTINUE
    _lockstep((model, opt), (fresh, fresh_opt), plan, seed=3)
    _assert_same_state_dict(model.state_dict(), fresh.state_dict())


@pytest.mark.parametrize("recipe", RECIPES + [STOCHASTIC], ids=IDS + ["stochastic"])
def test_state_dict_is_tensors_only_with_the_same_state_keys_for_every_recipe(recipe):
    """safetensors (save_pretrained, Trainer checkpoints) takes tensors only."""
    model = fp8ops.convert_to_fp8(Block(), recipe)
    _train(model, 2, seed=1)
    state = model.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    common = {k for k in state if k.startswith("up.fp8_state.") and k.count(".") == 2}
    assert common == {"up.fp8_state.rng", "up.fp8_state.weight_cast_scale"}
    seed = getattr(recipe, "seed", 0)
    offset = 2 if recipe is STOCHASTIC else 0  # one stochastic cast per backward
    assert state["up.fp8_state.rng"].tolist() == [seed, offset]
    assert state["up.fp8_state.rng"].dtype == torch.int64


def _old_format(state: dict) -> dict:
    """A state_dict as checkpoints made before the FP8 state was kept in tensors hold it: the
    seed, the offset and the scale of a cast to reuse in one `_extra_state` dict per layer."""
    old = {}
    for key, value in state.items():
        prefix, _, name = key.rpartition(".")
        if name == "rng":
            old[prefix + "._extra_state"] = {"rng_seed": int(value[0]),
                                             "rng_offset": int(value[1])}
        elif name != "weight_cast_scale":
            old[key] = value
    for key, value in state.items():
        prefix, _, name = key.rpartition(".")
        if name == "weight_cast_scale" and value.item() != 0:
            old[prefix + "._extra_state"]["weight_cast_scale"] = value
    return old


@pytest.mark.parametrize("recipe", [RECIPES[1], STOCHASTIC], ids=["delayed", "stochastic"])
def test_checkpoint_with_the_old_extra_state_still_loads_exactly(recipe):
    torch.manual_seed(0)
    model = fp8ops.convert_to_fp8(Block(), recipe)
    opt = _sgd(model)
    _train(model, 2, seed=1, opt=opt)
    model(torch.randn(16, 64)).pow(2).mean().backward()  # mid-accumulation: a cast to reuse
    old = _old_format(model.state_dict())
    if recipe.__class__ is fp8ops.DelayedScaling:
        assert "weight_cast_scale" in old["up.fp8_state._extra_state"]
    torch.manual_seed(123)
    fresh = fp8ops.convert_to_fp8(Block(), recipe)
    fresh_opt = _sgd(fresh)
    fresh.load_state_dict(old)  # strict
    fresh_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # not sharing momentum
    assert fresh.up.fp8_state.rng_offset == model.up.fp8_state.rng_offset
    _copy_grads(model, fresh)
    _lockstep((model, opt), (fresh, fresh_opt), CONTINUE, seed=3)
    _assert_same_state_dict(model.state_dict(), fresh.state_dict())


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copy_mid_accumulation_continues_exactly(recipe, how):
    torch.manual_seed(0)
    model = fp8ops.convert_to_fp8(Block(), recipe)
    opt = _sgd(model)
    _train(model, 2, seed=1, opt=opt)
    model(torch.randn(16, 64)).pow(2).mean().backward()  # first microbatch
    if how == "deepcopy":
        dup = copy.deepcopy(model)
    elif how == "pickle":
        dup = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        dup = torch.load(buf, weights_only=False)
    dup_opt = _sgd(dup)
    dup_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # not sharing momentum buffers
    _copy_grads(model, dup)
    _lockstep((model, opt), (dup, dup_opt), CONTINUE, seed=3)


def test_convert_again_applies_the_new_recipe():
    delayed = fp8ops.DelayedScaling(amax_history_len=4)
    model = fp8ops.convert_to_fp8(Block(), delayed)
    _train(model, 1, seed=0)
    kept = model.up.fp8_state
    fp8ops.convert_to_fp8(model, fp8ops.DelayedScaling(amax_history_len=4))  # the same recipe
    assert model.up.fp8_state is kept and kept.input.step.item() == 1
    mx = fp8ops.MXFP8Scaling()
    up = model.up
    assert fp8ops.convert_to_fp8(model, mx, filter_fn=lambda mod, fqn: fqn != "head") is model
    assert model.up is up and model.up.recipe == mx and model.down.recipe == mx
    assert model.up.fp8_state.recipe == mx and model.head.recipe == delayed
    x = torch.randn(4, 64)
    assert torch.equal(model.up(x), fp8ops.linear(x, up.weight, up.bias, recipe=mx))
    single = fp8ops.FP8Linear(64, 32)
    assert fp8ops.convert_to_fp8(single, mx) is single and single.recipe == mx


def test_convert_again_with_another_process_group_applies_it():
    first, second = object(), object()  # stand-ins: no collective runs outside torch.distributed
    lin = fp8ops.convert_to_fp8(nn.Linear(8, 8), fp8ops.DelayedScaling(process_group=first))
    fp8ops.convert_to_fp8(lin, fp8ops.DelayedScaling(process_group=second))
    assert lin.recipe.process_group is second and lin.fp8_state.recipe.process_group is second


def _head_stays(mod, fqn):
    return fqn != "head"


def test_plain_checkpoint_loads_strictly_into_a_converted_model(caplog):
    torch.manual_seed(0)
    plain = Block()
    recipe = fp8ops.DelayedScaling(amax_history_len=4)
    model = fp8ops.convert_to_fp8(Block(), recipe, filter_fn=_head_stays)
    _train(model, 2, seed=0)  # an FP8 state that is not fresh
    with caplog.at_level(logging.INFO, logger="fp8ops"):
        model.load_state_dict(plain.state_dict())  # strict
    assert [r.name for r in caplog.records] == ["fp8ops.modules"] * 2  # one line per layer
    assert "up" in caplog.records[0].getMessage()
    for layer in (model.up, model.down):
        _assert_same_state_dict(layer.fp8_state.state_dict(),
                                fp8ops.ScalingState(recipe).state_dict())
    ref = fp8ops.convert_to_fp8(copy.deepcopy(plain), recipe, filter_fn=_head_stays)
    assert _train(model, 2, seed=1)[0] == _train(ref, 2, seed=1)[0]
    single = fp8ops.FP8Linear(64, 128)
    single.load_state_dict(plain.up.state_dict())
    assert torch.equal(single.weight, plain.up.weight)


def test_converted_checkpoint_loads_strictly_into_the_plain_model():
    model = fp8ops.convert_to_fp8(Block(), fp8ops.DelayedScaling(amax_history_len=4))
    _train(model, 1, seed=0)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        Block().load_state_dict(model.state_dict())
    for plain_sd in (fp8ops.plain_state_dict(model), fp8ops.plain_state_dict(model.state_dict())):
        plain = Block()
        plain.load_state_dict(plain_sd)  # strict
        for p, q in zip(plain.parameters(), model.parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_convert_from_fp8_gives_nn_linear_with_the_same_weights(recipe):
    model = fp8ops.convert_to_fp8(Block(), recipe).to(torch.bfloat16).eval()
    params = dict(model.named_parameters())
    assert fp8ops.convert_from_fp8(model) is model
    assert all(type(m) is nn.Linear and not m.training for m in (model.up, model.down, model.head))
    for name, p in model.named_parameters():
        assert p is params[name], name  # the same Parameters: same device and dtype
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    ref = Block().to(torch.bfloat16)
    ref.load_state_dict(model.state_dict())  # strict: no FP8 state left
    assert torch.equal(model(x), ref(x))
    single = fp8ops.FP8Linear(8, 4, bias=False, recipe=recipe, device="meta")
    lin = fp8ops.convert_from_fp8(single)
    assert type(lin) is nn.Linear and lin.weight is single.weight and lin.bias is None


def test_converting_a_model_in_eval_mode_keeps_it_in_eval_mode():
    model = fp8ops.convert_to_fp8(Block().eval(), fp8ops.DelayedScaling(amax_history_len=4))
    assert not any(m.training for m in model.modules())
    model(torch.randn(4, 64))
    assert model.up.fp8_state.input.step.item() == 0  # eval records nothing
