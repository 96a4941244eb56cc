"""The mixture-of-experts models of Hugging Face transformers converted by convert_to_fp8: the
experts modules run fp8ops.grouped_linear, train, and save / load exactly. Tiny models built from
configs: nothing is downloaded."""
import copy
import io
import logging
import pickle

import pytest
import torch
import transformers
from transformers import (AutoModelForCausalLM, DeepseekV3Config, GptOssConfig, MixtralConfig,
                          Qwen2MoeConfig, Qwen3MoeConfig)

import fp8ops
from fp8ops.nn.hf_moe import is_hf_experts

VOCAB, SEQ = 64, 16
transformers.logging.set_verbosity_error()

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               max_position_embeddings=SEQ, tie_word_embeddings=False, bos_token_id=0,
               eos_token_id=1, pad_token_id=None)
CONFIGS = {
    "mixtral": lambda: MixtralConfig(intermediate_size=48, num_key_value_heads=1,
                                     num_local_experts=4, num_experts_per_tok=2, **_COMMON),
    "qwen2_moe": lambda: Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                        shared_expert_intermediate_size=32, num_experts=4,
                                        num_experts_per_tok=2, num_key_value_heads=1, **_COMMON),
    "qwen3_moe": lambda: Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                        num_experts=4, num_experts_per_tok=2,
                                        num_key_value_heads=1, head_dim=16, **_COMMON),
    "deepseek_v3": lambda: DeepseekV3Config(
        intermediate_size=48, moe_intermediate_size=24, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, n_group=1, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=0, **_COMMON),
    # experts stored [E, in, out], gate and up interleaved, with biases
    "gpt_oss": lambda: GptOssConfig(intermediate_size=48, num_local_experts=4,
                                    num_experts_per_tok=2, num_key_value_heads=1, head_dim=16,
                                    **_COMMON),
}


def _model(name, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIGS[name]()).to(dtype)


def _experts(model):
    return [m for m in model.modules() if is_hf_experts(m)]


def _batch(gen):
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_experts_module_runs_fp8_grouped_gemms_close_to_its_own_forward(name):
    """The converted experts module against its class's forward on the same routing: within FP8
    error (a token sent to the wrong expert, or a result put back on the wrong row, would be far
    off)."""
    model = _model(name)
    (experts,) = _experts(model)
    ref = copy.deepcopy(experts)
    ref.config._experts_implementation = "eager"  # the class's own loop over the experts
    fp8ops.convert_to_fp8(model)
    assert "fp8_recipe" in experts.__dict__
    g = torch.Generator().manual_seed(1)
    tokens, k = 40, 2
    x = torch.randn(tokens, 32, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(tokens)])
    index[:10] = torch.tensor([0, 3])  # many tokens on two experts; expert 1 or 2 may be empty
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    y = experts(x, index, weights)
    xr = x.detach().clone().requires_grad_()
    yr = ref(xr, index, weights)
    assert y.shape == yr.shape and y.dtype == yr.dtype
    assert _rel_err(y, yr) < 0.1
    y.square().sum().backward()
    yr.square().sum().backward()
    assert _rel_err(x.grad, xr.grad) < 0.15
    for (pname, p), (_, pr) in zip(experts.named_parameters(), ref.named_parameters()):
        assert _rel_err(p.grad, pr.grad) < 0.15, pname


@pytest.mark.parametrize("recipe", [None, fp8ops.BlockwiseScaling(), fp8ops.DelayedScaling()],
                         ids=["current", "blockwise", "delayed"])
def test_mixtral_trains_close_to_bf16(recipe):
    fp8, ref = _model("mixtral", dtype=torch.bfloat16), _model("mixtral", dtype=torch.bfloat16)
    fp8ops.convert_to_fp8(fp8, recipe)
    assert len(_experts(fp8)) == 1 and "fp8_recipe" in _experts(fp8)[0].__dict__
    losses = {}
    for key, model in (("fp8", fp8), ("bf16", ref)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(3)
        losses[key] = []
        for _ in range(3):
            loss = model(**_batch(gen)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses["fp8"])))
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=0.02)
    # the experts' parameters were trained: they changed
    assert not torch.equal(fp8.model.layers[0].mlp.experts.down_proj,
                           _model("mixtral", dtype=torch.bfloat16).model.layers[0].mlp.experts
                           .down_proj)


@pytest.mark.parametrize("recipe", [None, fp8ops.BlockwiseScaling(), fp8ops.DelayedScaling()],
                         ids=["current", "blockwise", "delayed"])
def test_mixtral_trains_under_autocast(recipe):
    """float32 parameters under bf16 autocast, the usual mixed precision: the experts get bf16
    activations from the autocast ops before them and train close to the unconverted model."""
    fp8, ref = _model("mixtral"), _model("mixtral")
    fp8ops.convert_to_fp8(fp8, recipe)
    losses = {}
    for key, model in (("fp8", fp8), ("ref", ref)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(3)
        losses[key] = []
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**_batch(gen)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.item())
    assert losses["fp8"] == pytest.approx(losses["ref"], rel=0.02)
    assert fp8.model.layers[0].mlp.experts.down_proj.dtype == torch.float32


def _train_mixtral(model, opt, steps=3, seed=3):
    """The losses of `steps` optimizer steps on the batches of `seed`."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = model(**_batch(gen)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", [None, fp8ops.DelayedScaling()], ids=["current", "delayed"])
def test_mixtral_in_bf16_trains_with_fp8adamw(recipe):
    """bf16 parameters and FP8AdamW (no float32 copy of any weight): the experts' 3-D weights
    are stepped with stochastic rounding, and their casts follow every step."""
    fp8 = fp8ops.convert_to_fp8(_model("mixtral", dtype=torch.bfloat16), recipe)
    ref = fp8ops.convert_to_fp8(_model("mixtral", dtype=torch.bfloat16), recipe)
    experts = fp8.model.layers[0].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    opt = fp8ops.FP8AdamW(fp8.parameters(), lr=1e-3, min_fp8_numel=16)
    got = _train_mixtral(fp8, opt)
    want = _train_mixtral(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3))
    assert got[0] == want[0]  # the same first step
    assert got == pytest.approx(want, rel=0.02)
    assert experts.gate_up_proj.dtype == torch.bfloat16
    assert not torch.equal(experts.gate_up_proj, before)
    assert opt.state[experts.gate_up_proj]["m"].dtype == torch.float8_e4m3fn  # FP8 moments


def test_state_dict_resume_is_exact():
    """The resume docs/huggingface.md gives for MoE models: torch.save of the model's and the
    optimizer's state_dicts (the experts' delayed-scaling buffers included) continues bit for
    bit."""
    model = fp8ops.convert_to_fp8(_model("mixtral"), fp8ops.DelayedScaling())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_mixtral(model, opt, steps=2, seed=0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert any(".experts.fp8_state." in k for k in ckpt["model"])
    want = _train_mixtral(model, opt, steps=2, seed=1)
    fresh = fp8ops.convert_to_fp8(_model("mixtral", seed=5), fp8ops.DelayedScaling())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    assert _train_mixtral(fresh, fresh_opt, steps=2, seed=1) == want


def test_save_pretrained_round_trip_is_exact(tmp_path):
    model = _model("mixtral")
    names = [n for n, _ in model.named_parameters()]
    fp8ops.convert_to_fp8(model)
    assert [n for n, _ in model.named_parameters()] == names  # the parameters stay as they are
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        model(**_batch(gen)).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    plain = fp8ops.plain_state_dict(model)
    assert set(loaded.state_dict()) == set(plain)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, plain[key]), key
    fp8ops.convert_to_fp8(loaded)
    batch = _batch(torch.Generator().manual_seed(5))
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)


def test_copies_pickles_and_convert_back():
    model = _model("mixtral")
    ref = copy.deepcopy(model)
    fp8ops.convert_to_fp8(model)
    batch = _batch(torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(**batch).logits
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            (experts,) = _experts(other)
            assert experts.forward.mod is experts  # bound to the copy, not the original
            assert torch.equal(other(**batch).logits, want)
        fp8ops.convert_from_fp8(model)
        assert not any("fp8_recipe" in m.__dict__ for m in model.modules())
        assert torch.equal(model(**batch).logits, ref(**batch).logits)


def test_a_recipe_the_grouped_layer_does_not_take_leaves_the_experts(caplog):
    model = _model("mixtral")
    with caplog.at_level(logging.WARNING, logger="fp8ops.modules"):
        fp8ops.convert_to_fp8(model, fp8ops.MXFP8Scaling())
    assert "high precision" in caplog.text
    assert not any("fp8_recipe" in m.__dict__ for m in model.modules())
    assert isinstance(model.model.layers[0].self_attn.q_proj, fp8ops.FP8Linear)


def test_filter_fn_picks_experts_too():
    model = _model("mixtral")
    fp8ops.convert_to_fp8(model, filter_fn=lambda mod, fqn: not fqn.endswith("experts"))
    assert not any("fp8_recipe" in m.__dict__ for m in model.modules())
    fp8ops.convert_to_fp8(model, fp8ops.BlockwiseScaling())  # again: takes the new recipe
    (experts,) = _experts(model)
    assert experts.fp8_recipe == fp8ops.BlockwiseScaling()


@pytest.mark.parametrize("recipe", [None, fp8ops.DelayedScaling()], ids=["current", "delayed"])
def test_converted_experts_compile_with_no_graph_break(recipe):
    torch._dynamo.reset()
    model = _model("mixtral")
    fp8ops.convert_to_fp8(model, recipe)
    (experts,) = _experts(model)
    g = torch.Generator().manual_seed(7)
    x, index = torch.randn(10, 32, generator=g), torch.randint(0, 4, (10, 2), generator=g)
    weights = torch.rand(10, 2, generator=g)
    twin = copy.deepcopy(experts)  # (delayed scaling: the same state before each call)
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, index, weights), twin(x, index, weights))
    assert all(torch.equal(a, b) for a, b in zip(experts.state_dict().values(),
                                                 twin.state_dict().values()))


def test_delayed_scaling_converts_the_experts_with_a_state_per_weight():
    """Each 3-D parameter gets its experts' delayed-scaling state (in the state_dict under
    fp8_state, left out by plain_state_dict); training records, eval does not; converting again
    with the same recipe keeps the state, convert_from_fp8 drops it."""
    model = _model("mixtral")
    recipe = fp8ops.DelayedScaling(amax_history_len=4)
    fp8ops.convert_to_fp8(model, recipe)
    (experts,) = _experts(model)
    assert set(experts.fp8_state) == {"gate_up_proj", "down_proj"}
    for name, state in experts.fp8_state.items():
        assert state.num_experts == 4 and state.weight_cache is experts.fp8_weight_caches[name]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        model(**_batch(gen)).loss.backward()
        opt.step()
        opt.zero_grad()
    for state in experts.fp8_state.values():
        for role in (state.input, state.weight, state.grad):
            assert (role.step == 3).all() and role.amax_history.any()
    keys = [k for k in model.state_dict() if ".experts.fp8_state." in k]
    assert "model.layers.0.mlp.experts.fp8_state.down_proj.grad.amax_history" in keys
    assert not any("fp8_state" in k for k in fp8ops.plain_state_dict(model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        model(**_batch(gen))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    states = dict(experts.fp8_state)
    fp8ops.convert_to_fp8(model, fp8ops.DelayedScaling(amax_history_len=4))
    assert dict(experts.fp8_state) == states
    fp8ops.convert_to_fp8(model, fp8ops.DelayedScaling(amax_history_len=8))
    assert experts.fp8_state["down_proj"].input.amax_history.shape == (4, 8)
    fp8ops.convert_to_fp8(model)  # current scaling: no delayed state left
    assert "fp8_state" not in experts._modules
    fp8ops.convert_to_fp8(model, recipe)
    fp8ops.convert_from_fp8(model)
    assert "fp8_state" not in experts._modules


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])  # gpt-oss: experts stored [E, in, out]
def test_experts_weights_cast_once_per_step_and_train_as_without_the_cache(name, monkeypatch):
    """Two micro-batches per optimizer step: after the first step each 3-D parameter is cast
    once per step (not once per micro-batch), and the losses and weights are those of the same
    model casting every call (no caches), bit for bit."""
    from fp8ops.nn import quantizers
    calls = []
    real = quantizers.quantize_experts_current

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(quantizers, "quantize_experts_current", counted)
    cached, plain = _model(name), _model(name)
    for model in (cached, plain):
        fp8ops.convert_to_fp8(model)
    (experts,) = _experts(cached)
    assert set(experts.fp8_weight_caches) == {"gate_up_proj", "down_proj"}
    _experts(plain)[0].fp8_weight_caches.clear()  # cast every call
    losses, per_step = {}, {}
    for key, model in (("cached", cached), ("plain", plain)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(3)
        losses[key], per_step[key] = [], []
        for _ in range(3):
            before = len(calls)
            for _ in range(2):
                loss = model(**_batch(gen)).loss
                loss.backward()
                losses[key].append(loss.item())
            per_step[key].append(len(calls) - before)
            opt.step()
            opt.zero_grad()
    assert per_step["plain"] == [4, 4, 4]  # two weights, two micro-batches
    assert per_step["cached"] == [4, 2, 2]  # no holder before the first step
    assert losses["cached"] == losses["plain"]
    for (pname, p), (_, q) in zip(cached.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), pname
    fp8ops.convert_from_fp8(cached)
    assert "fp8_weight_caches" not in experts.__dict__


def test_convert_experts_takes_none_as_current_scaling():
    """convert_experts(module, None) converts with CurrentScaling(), as convert_to_fp8 does."""
    from fp8ops.nn.hf_moe import convert_experts
    model = _model("mixtral")
    kinds = convert_experts(model, None)
    assert sum(kinds.values()) == len(_experts(model)) > 0
    assert all(mod.fp8_recipe == fp8ops.CurrentScaling() for mod in _experts(model))
