"""CPUOffloadOptimizer over mixture-of-experts weights, on the CPU (the device is the host):
FP8GroupedLinear's weight and a converted transformers experts module's 3-D weights are kept on
the device only as their FP8 casts, as FP8Linear weights are, and training is bit for bit that of
the torch optimizer on the same model; checkpoints (state_dict, save_pretrained) hold the
masters, and a loaded checkpoint is what the next forward casts."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import fp8ops
from fp8ops.memory import expert_cast_tensors
from fp8ops.optim.host_weight import OffloadedWeight

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_moe import _batch, _experts, _model as _hf_model, _train_mixtral  # noqa: E402

RECIPES = [fp8ops.CurrentScaling(), fp8ops.DelayedScaling(amax_history_len=4),
           fp8ops.BlockwiseScaling()]
IDS = ["current", "delayed", "blockwise"]
E, K, N = 4, 32, 16
OFFSETS = torch.tensor([5, 5, 12, 20], dtype=torch.int32)  # expert 1 gets no tokens


def _layer(recipe, seed=0):
    torch.manual_seed(seed)
    return fp8ops.FP8GroupedLinear(E, K, N, bias=True, recipe=recipe)


def _inputs(seed, steps, micro):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(20, K, generator=gen) for _ in range(micro)] for _ in range(steps)]


def _train(layer, opt, batches):
    losses = []
    for micro in batches:
        total = 0.0
        for x in micro:
            loss = layer(x, OFFSETS).float().pow(2).mean() / len(micro)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _offload(model, **kw):
    return fp8ops.CPUOffloadOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2, **kw)


@pytest.mark.parametrize("micro", [1, 3], ids=["one_batch", "accumulate3"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_grouped_layer_trains_as_adamw_bit_for_bit(recipe, micro):
    ref = _layer(recipe)
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)  # the step offload runs
    off_opt = _offload(off)
    batches = _inputs(1, 4, micro)
    assert _train(off, off_opt, batches) == _train(ref, ref_opt, batches)
    _assert_same(off.state_dict(), ref.state_dict())
    probe = _inputs(2, 1, 1)[0][0]
    with torch.no_grad():
        assert torch.equal(off(probe, OFFSETS), ref(probe, OFFSETS))
    # the weight on the device: a one-element placeholder and the experts' FP8 cast, no gradient
    assert type(off.weight) is OffloadedWeight and off.weight.grad is None
    assert off.weight.untyped_storage().nbytes() == 4
    fp8_bytes = sum(t.untyped_storage().nbytes() for t in expert_cast_tensors(off)
                    if t.dtype == torch.float8_e4m3fn)
    assert fp8_bytes == 2 * E * N * K  # the data and its transposed copy, one byte a value


def test_each_step_casts_the_new_master_once(monkeypatch):
    """The experts are cast from the master once per step, for all the micro-batches of its
    accumulation window, and the cast is that of the master's values."""
    import fp8ops.nn.quantizers as quantizers
    layer = _layer(RECIPES[0])
    opt = _offload(layer)
    cast, masters = quantizers.quantize_experts_current, []

    def recording(w, *args, **kwargs):
        masters.append(w.clone())
        return cast(w, *args, **kwargs)

    monkeypatch.setattr(quantizers, "quantize_experts_current", recording)
    counts = []
    for micro in _inputs(3, 3, 3):
        before, weight = len(masters), opt.master_of(layer.weight).clone()
        _train(layer, opt, [micro])
        counts.append(len(masters) - before)
        assert all(torch.equal(w, weight) for w in masters[before:])
    # before the first step no optimizer step has been seen to hold the weight: every forward
    # casts (the weight cache's rule, as for a dense layer); then one cast per step
    assert counts == [3, 1, 1]


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_grouped_layer_resumes_exactly(recipe):
    layer = _layer(recipe)
    opt = _offload(layer)
    _train(layer, opt, _inputs(4, 2, 2))
    ckpt = copy.deepcopy({"model": layer.state_dict(), "opt": opt.state_dict()})
    expected = _train(layer, opt, _inputs(5, 2, 2))

    fresh = _layer(recipe, seed=9)  # another init: everything must come from the checkpoint
    fresh_opt = _offload(fresh)
    fresh.load_state_dict(ckpt["model"])  # strict: the offloaded weight is loaded, not missing
    fresh_opt.load_state_dict(ckpt["opt"])
    assert torch.equal(fresh_opt.master_of(fresh.weight), ckpt["model"]["weight"])
    assert _train(fresh, fresh_opt, _inputs(5, 2, 2)) == expected


def test_loading_new_weights_recasts_and_bad_shapes_are_reported():
    layer = _layer(RECIPES[0])
    opt = _offload(layer)
    _train(layer, opt, _inputs(6, 1, 1))
    x = _inputs(7, 1, 1)[0][0]
    layer(x, OFFSETS)  # a cast the next forward would reuse
    other = _layer(RECIPES[0], seed=3)
    layer.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(layer(x, OFFSETS), other(x, OFFSETS))
    assert torch.equal(opt.master_of(layer.weight), other.weight)
    bad = dict(layer.state_dict(), weight=torch.zeros(E, N, K + 1))
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        layer.load_state_dict(bad)
    missing = layer.load_state_dict({"bias": other.bias.detach()}, strict=False)
    assert missing.missing_keys == ["weight"]  # a key the checkpoint lacks is still missing


def test_reading_an_offloaded_experts_weight_raises():
    layer = _layer(RECIPES[0])
    opt = _offload(layer)
    _train(layer, opt, _inputs(8, 1, 1))
    with pytest.raises(RuntimeError, match="parameter 'weight' is an FP8 weight owned by a "
                                           "CPUOffloadOptimizer"):
        layer.weight.sum()
    with pytest.raises(RuntimeError, match="FP8 weight owned by a CPUOffloadOptimizer"):
        layer.weight.transpose(1, 2).contiguous()  # the alias keeps the guard
    plain = copy.deepcopy(layer)  # a copy is an ordinary layer with the master's values
    assert type(plain.weight) is torch.nn.Parameter
    assert torch.equal(plain.weight, opt.master_of(layer.weight))


# -- transformers experts modules --------------------------------------------------------------
@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[1]], ids=IDS[:2])
@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])  # gpt_oss: experts stored [E, in, out]
def test_hf_experts_train_as_adamw_bit_for_bit(name, recipe):
    ref = fp8ops.convert_to_fp8(_hf_model(name), recipe)
    off = copy.deepcopy(ref)  # (a copy of a converted model: its experts are found too)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    off_opt = _offload(off)
    (experts,) = _experts(off)
    offloaded = [n for n, p in experts.named_parameters() if type(p) is OffloadedWeight]
    assert sorted(offloaded) == sorted(experts.fp8_weight_caches)
    assert _train_mixtral(off, off_opt) == _train_mixtral(ref, ref_opt)
    _assert_same(off.state_dict(), ref.state_dict())


def test_hf_experts_save_pretrained_and_load_the_masters(tmp_path):
    model = fp8ops.convert_to_fp8(_hf_model("mixtral").to(torch.bfloat16))
    opt = _offload(model)
    gen = torch.Generator().manual_seed(4)
    model(**_batch(gen)).loss.backward()
    opt.step()
    (experts,) = _experts(model)
    master = opt.master_of(experts.down_proj)
    assert master.dtype == torch.float32
    assert not torch.equal(master, master.to(torch.bfloat16).float())  # finer than bf16
    model.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(back.model.layers[0].mlp.experts.down_proj, master.to(torch.bfloat16))
    # loading the bf16 checkpoint into the offloaded model keeps the exact FP32 masters
    model.load_state_dict(back.state_dict())
    assert torch.equal(opt.master_of(experts.down_proj), master)
    with pytest.raises(ValueError, match="owned by a CPUOffloadOptimizer"):
        fp8ops.convert_from_fp8(model)


def test_hf_experts_converted_again_cast_from_the_master():
    """A new recipe after the optimizer was built: the new weight caches cast from the host
    master as well (the parameters stay placeholders)."""
    ref = fp8ops.convert_to_fp8(_hf_model("mixtral"))
    off = copy.deepcopy(ref)
    ref_opt, off_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), _offload(off)
    batch = _batch(torch.Generator().manual_seed(5))
    for model, opt in ((ref, ref_opt), (off, off_opt)):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        fp8ops.convert_to_fp8(model, fp8ops.BlockwiseScaling())
    with torch.no_grad():
        assert torch.equal(off(**batch).logits, ref(**batch).logits)


# -- what the weight cache and the checkpoint hooks must still see -----------------------------
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_compiled_layer_casts_the_master(recipe):
    ref = _layer(recipe)
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    off_opt = _offload(off)
    batches = _inputs(10, 2, 1)
    compiled = torch.compile(off, backend="aot_eager", fullgraph=True)
    for (x,), opt, layer in ((b, off_opt, compiled) for b in batches):
        layer(x, OFFSETS).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for (x,) in batches:
        ref(x, OFFSETS).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_same(off.state_dict(), ref.state_dict())


def test_a_checkpoint_loaded_into_a_tied_weight_recasts_every_layer():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = fp8ops.FP8GroupedLinear(E, K, K)
            self.b = fp8ops.FP8GroupedLinear(E, K, K)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x, OFFSETS), OFFSETS)

    torch.manual_seed(0)
    model, other = Tied(), Tied()
    opt = _offload(model)
    x = _inputs(11, 1, 1)[0][0]
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model(x).pow(2).mean().backward()  # casts the next forwards would reuse
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x), other(x))


def test_a_state_dict_tensor_edited_in_place_is_seen():
    """float32: the state_dict gives the master itself (no copy), as torch gives a parameter;
    writing into it changes the weight, and the next forward casts the new values."""
    layer = _layer(RECIPES[0])
    opt = _offload(layer)
    x = _inputs(12, 1, 1)[0][0]
    for _ in range(2):
        layer(x, OFFSETS).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    layer(x, OFFSETS).pow(2).mean().backward()  # a cast the next forward would reuse
    state = layer.state_dict()
    state["weight"].mul_(0.5)
    plain = _layer(RECIPES[0])
    plain.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(layer(x, OFFSETS), plain(x, OFFSETS))


def test_a_failed_load_leaves_no_key_counted_as_loaded():
    layer = _layer(RECIPES[0])
    _offload(layer)
    state = layer.state_dict()
    with pytest.raises(NotImplementedError):  # torch cannot copy out of a meta tensor
        layer.load_state_dict(dict(state, weight=torch.empty(E, N, K, device="meta")))
    with pytest.raises(RuntimeError, match='Missing key.*"weight"'):
        layer.load_state_dict({"bias": state["bias"]})


def test_the_users_state_dict_hooks_see_the_weights_values():
    layer = _layer(RECIPES[0])
    layer.register_state_dict_post_hook(  # registered before the optimizer
        lambda module, state, prefix, meta: state.update(weight=state["weight"] * 2))
    opt = _offload(layer)
    assert torch.equal(layer.state_dict()["weight"], opt.master_of(layer.weight) * 2)


@pytest.mark.parametrize("kind", ["grouped", "dense"])
def test_a_model_and_its_optimizer_dropped_are_freed(kind):
    """Nothing the optimizer installs keeps a dropped model alive: torch's gradient hooks are
    not seen by the garbage collector, so what they hold must not lead back to the model."""
    import gc
    import weakref
    if kind == "grouped":
        layer = _layer(RECIPES[0])
        opt = _offload(layer)
        _train(layer, opt, _inputs(13, 1, 1))
    else:
        layer = fp8ops.FP8Linear(K, N)
        opt = _offload(layer)
        layer(torch.randn(4, K)).sum().backward()
        opt.step()
    refs = [weakref.ref(t) for t in (layer, layer.weight, opt.master_of(layer.weight))]
    del layer, opt
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
