"""Hugging Face transformers as a client: save_pretrained (safetensors) and from_pretrained,
Trainer checkpoints and resume, GPT-2's Conv1D layers. Tiny models built from configs: nothing
is downloaded."""
import copy
import io
import logging
import os
import pickle

import pytest
import safetensors.torch
import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Trainer, TrainingArguments
from transformers.pytorch_utils import Conv1D

import fp8ops
from fp8ops.memory import device_state_bytes

RECIPES = {
    "delayed": fp8ops.DelayedScaling(amax_history_len=4),
    "current": fp8ops.CurrentScaling(),
    "stochastic": fp8ops.CurrentScaling(grad_rounding="stochastic", seed=7),
    "mxfp8": fp8ops.MXFP8Scaling(),
    "blockwise": fp8ops.BlockwiseScaling(),
}
VOCAB, SEQ = 64, 16

transformers.logging.set_verbosity_error()  # config remarks about the tiny vocabulary


def _llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=SEQ, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return AutoModelForCausalLM.from_config(config)


def _gpt2(seed=0):
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(config)


def _batch(gen):
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _step(model, opt, gen) -> float:
    """One training step on a fresh batch; returns its loss."""
    loss = model(**_batch(gen)).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _lockstep(a, b, steps, micro=1, seed=2):
    """Train (model, optimizer) pairs a and b side by side, each microbatch and each optimizer
    step on both before the next; asserts identical losses."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for _ in range(micro):
            batch = _batch(gen)
            losses = []
            for model, _ in (a, b):
                loss = model(**batch).loss
                loss.backward()
                losses.append(loss.item())
            assert losses[0] == losses[1]
        for model, opt in (a, b):
            opt.step()
            opt.zero_grad()


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5)  # stateless: no optimizer checkpoint


def _fp8_state(model):
    """Everything FP8 of the model: the state_dict's FP8 tensors and each layer's Python RNG."""
    state = {k: v for k, v in model.state_dict().items() if "fp8_state" in k.split(".")}
    rng = {n: (m.fp8_state.rng_seed, m.fp8_state.rng_offset) for n, m in model.named_modules()
           if isinstance(m, fp8ops.FP8Linear)}
    return state, rng


def _assert_same_fp8_state(a, b):
    (sa, ra), (sb, rb) = _fp8_state(a), _fp8_state(b)
    assert ra == rb
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _saved_file(folder):
    return safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))


# ------------------------------------------------------------------------------------------------
# save_pretrained / safetensors
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(RECIPES))
def test_save_pretrained_round_trips_the_fp8_state(name, tmp_path):
    recipe = RECIPES[name]
    model = fp8ops.convert_to_fp8(_llama(), recipe)
    opt, gen = _sgd(model), torch.Generator().manual_seed(1)
    for _ in range(2):
        _step(model, opt, gen)
    model.save_pretrained(tmp_path)

    fresh = fp8ops.convert_to_fp8(_llama(seed=123), recipe)  # all must come from the file
    fresh.load_state_dict(_saved_file(tmp_path))  # strict
    _assert_same_fp8_state(model, fresh)
    assert _same_params(model, fresh)
    if name == "stochastic":  # the RNG offset is in the file, not just the seed
        assert fresh.model.layers[0].mlp.up_proj.fp8_state.rng_offset == 2
    if name == "delayed":
        assert fresh.model.layers[0].mlp.up_proj.fp8_state.input.step.item() == 2
    _lockstep((model, opt), (fresh, _sgd(fresh)), steps=2)
    _assert_same_fp8_state(model, fresh)


def test_save_pretrained_mid_accumulation_keeps_the_cast_to_reuse(tmp_path):
    """A checkpoint between two microbatches carries the scale of the weight cast the next
    microbatch reuses (delayed scaling), through safetensors too."""
    recipe = RECIPES["delayed"]
    model = fp8ops.convert_to_fp8(_gpt2(), recipe)  # Conv1D layers and an nn.Linear head
    opt, gen = _sgd(model), torch.Generator().manual_seed(1)
    _step(model, opt, gen)
    model(**_batch(gen)).loss.backward()  # the first microbatch of the next step
    model.save_pretrained(tmp_path)
    saved = _saved_file(tmp_path)
    assert saved["transformer.h.0.attn.c_attn.fp8_state.weight_cast_scale"].item() != 0

    fresh = fp8ops.convert_to_fp8(_gpt2(seed=123), recipe)
    result = fresh.load_state_dict(saved, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied: wte
    for p, q in zip(model.parameters(), fresh.parameters()):
        q.grad = p.grad.clone()  # gradients are not in a checkpoint
    _lockstep((model, opt), (fresh, _sgd(fresh)), steps=2, micro=2)
    _assert_same_fp8_state(model, fresh)
    assert _same_params(model, fresh)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_from_pretrained_gives_the_plain_model(make, tmp_path):
    model = fp8ops.convert_to_fp8(make(), RECIPES["delayed"])
    _step(model, _sgd(model), torch.Generator().manual_seed(1))
    model.save_pretrained(tmp_path)
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(isinstance(m, fp8ops.FP8Linear) for m in plain.modules())
    fp8_keys = set(_fp8_state(model)[0])
    assert set(info["unexpected_keys"]) == fp8_keys and not info["missing_keys"]
    params = dict(plain.named_parameters())
    assert params.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p), name


# ------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------
class _LossRecorder(Trainer):
    """Trainer that keeps every training loss unrounded (its logs round to 4 digits)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        out = super().compute_loss(model, inputs, *args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        self.losses.append(loss.item())
        return out


def _train(output_dir, resume=None, seed=0):
    model = fp8ops.convert_to_fp8(_llama(seed), fp8ops.DelayedScaling(
        amax_history_len=4, grad_rounding="stochastic"))
    gen = torch.Generator().manual_seed(5)
    # 16 samples: one epoch of 4 steps, so the checkpoint at step 2 is mid-epoch and the resumed
    # run must skip the batches already seen, in the shuffled order
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (16, SEQ),
                                                                       generator=gen)]
    args = TrainingArguments(output_dir=str(output_dir), use_cpu=True, report_to=[], seed=0,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=4, save_steps=2, learning_rate=1e-2, logging_steps=1,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = _LossRecorder(model=model, args=args, train_dataset=data)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer.losses


def test_trainer_resume_from_a_checkpoint_is_exact(tmp_path):
    full, losses = _train(tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert sorted(os.listdir(tmp_path / "full")) == ["checkpoint-2", "checkpoint-4"]
    resumed, resumed_losses = _train(tmp_path / "resumed", resume=str(checkpoint), seed=123)
    assert len(losses) == 8 and resumed_losses == losses[4:]  # microbatches of steps 3 and 4
    _assert_same_fp8_state(full, resumed)
    assert full.model.layers[0].mlp.up_proj.fp8_state.rng_offset == 8
    assert _same_params(full, resumed)


# ------------------------------------------------------------------------------------------------
# GPT-2: transformers' Conv1D
# ------------------------------------------------------------------------------------------------
def _conv1d_names(model):
    return [n for n, m in model.named_modules() if type(m) is Conv1D]


def test_gpt2_converts_every_conv1d_keeping_parameters_and_keys(caplog):
    model = _gpt2()
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    names = _conv1d_names(model)
    assert len(names) == 8  # c_attn, attn.c_proj, c_fc, mlp.c_proj in each of 2 blocks
    params = dict(model.named_parameters())
    with caplog.at_level(logging.INFO, logger="fp8ops"):
        fp8ops.convert_to_fp8(model, RECIPES["delayed"])
    assert "converted 9 layers of GPT2LMHeadModel to DelayedScaling (8 Conv1D, 1 Linear)" in \
        caplog.text
    modules = dict(model.named_modules())
    for name in names:
        layer = modules[name]
        assert type(layer) is fp8ops.FP8Conv1D and isinstance(layer, fp8ops.FP8Linear)
        assert (layer.nf, layer.nx) == tuple(reversed(layer.weight.shape))
    for name, p in model.named_parameters():
        assert p is params[name], name  # the same Parameter objects
    plain = fp8ops.plain_state_dict(model)
    assert list(plain) == list(ref_state)
    assert all(plain[k].shape == v.shape for k, v in ref_state.items())
    fresh = fp8ops.convert_to_fp8(_gpt2(seed=9), RECIPES["delayed"])
    fresh.load_state_dict(ref_state)  # a Conv1D checkpoint loads strictly
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in ref_state.items())


def test_fp8conv1d_computes_the_fp8_linear_of_the_transposed_weight():
    torch.manual_seed(0)
    conv = Conv1D(48, 32)  # nf=48 outputs, nx=32 inputs: weight [32, 48]
    torch.nn.init.normal_(conv.bias)
    x = torch.randn(2, 5, 32, requires_grad=True)
    recipe = RECIPES["current"]
    layer = fp8ops.convert_to_fp8(copy.deepcopy(conv), recipe)
    assert type(layer) is fp8ops.FP8Conv1D
    y = layer(x)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = conv.weight.detach().t().clone().requires_grad_()
    b_ref = conv.bias.detach().clone().requires_grad_()
    y_ref = fp8ops.linear(x_ref, w_ref, b_ref, recipe=recipe)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(layer.bias.grad, b_ref.grad)
    assert layer.weight.grad.shape == conv.weight.shape
    assert torch.equal(layer.weight.grad, w_ref.grad.t())
    # and it is close to Conv1D's own full-precision result
    assert torch.allclose(y, conv(x), rtol=0.1, atol=0.1)
    layer.half()
    assert layer.weight.dtype == torch.float16


def test_gpt2_trains_in_fp8_close_to_full_precision():
    ref = _gpt2()
    model = fp8ops.convert_to_fp8(copy.deepcopy(ref), RECIPES["delayed"])
    batch = _batch(torch.Generator().manual_seed(0))
    ref.eval(), model.eval()  # an evaluation forward: it steps no scaling state
    with torch.no_grad():
        want, got = ref(**batch).logits, model(**batch).logits
    model.train()
    assert not torch.equal(got, want)  # FP8 ran
    assert (got - want).norm() / want.norm() < 0.05
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):  # one batch, learnt by heart
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    assert model.transformer.h[0].attn.c_attn.fp8_state.weight.step.item() == 6


def test_convert_from_fp8_gives_conv1d_back():
    ref = _gpt2()
    model = fp8ops.convert_to_fp8(copy.deepcopy(ref), RECIPES["current"])
    params = dict(model.named_parameters())
    fp8ops.convert_from_fp8(model)
    assert _conv1d_names(model) == _conv1d_names(ref)
    assert not any(isinstance(m, fp8ops.FP8Linear) for m in model.modules())
    for name, p in model.named_parameters():
        assert p is params[name], name
    ref.load_state_dict(model.state_dict())  # strict: Conv1D's keys and shapes, no FP8 state
    batch = _batch(torch.Generator().manual_seed(0))
    assert torch.equal(model(**batch).logits, ref(**batch).logits)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "state_dict"])
def test_gpt2_copied_mid_accumulation_continues_exactly(how):
    model = fp8ops.convert_to_fp8(_gpt2(), RECIPES["delayed"])
    opt, gen = _sgd(model), torch.Generator().manual_seed(1)
    _step(model, opt, gen)
    model(**_batch(gen)).loss.backward()  # the first microbatch of the next step
    if how == "deepcopy":
        dup = copy.deepcopy(model)
    elif how == "pickle":
        dup = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        dup = fp8ops.convert_to_fp8(_gpt2(seed=5), RECIPES["delayed"])
        dup.load_state_dict(torch.load(buf))
    for p, q in zip(model.parameters(), dup.parameters()):
        q.grad = p.grad.clone()
    _lockstep((model, opt), (dup, _sgd(dup)), steps=1, micro=2)
    _assert_same_fp8_state(model, dup)


def test_gpt2_under_cpu_offload_and_monitor_matches_the_plain_run():
    """An offloaded Conv1D weight's host master has Conv1D's layout: the casts and the monitor
    read it transposed."""
    runs = []
    for offload in (False, True):
        # the LM head's weight is the embedding's (tied): an offloaded one is a placeholder
        model = fp8ops.convert_to_fp8(_gpt2(), RECIPES["delayed"],
                                      filter_fn=lambda mod, fqn: fqn != "lm_head")
        params = model.parameters()
        opt = (fp8ops.CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-2) if offload else
               torch.optim.AdamW(params, lr=1e-2, fused=True))
        fp8ops.monitor(model, every=1)
        gen = torch.Generator().manual_seed(3)
        losses = [_step(model, opt, gen) for _ in range(3)]
        runs.append((losses, fp8ops.stats(model), fp8ops.plain_state_dict(model), model))
    (losses, stats, state, plain_model), (o_losses, o_stats, o_state, offloaded) = runs
    c_attn = offloaded.transformer.h[0].attn.c_attn
    assert c_attn.fp8_state.host_weight is not None  # the Conv1D weight was offloaded
    assert "transformer.h.0.attn.c_attn.weight.amax" in stats
    assert losses == o_losses and stats == o_stats
    assert state.keys() == o_state.keys()
    assert all(torch.equal(state[k], o_state[k]) for k in state)
    # the Conv1D layers' cached casts are counted: FP8 data, its transpose, the float32 scale
    # and its inverse
    convs = [m for m in plain_model.modules() if isinstance(m, fp8ops.FP8Conv1D)]
    assert device_state_bytes(plain_model)["fp8_weights"] == sum(2 * m.weight.numel() + 8
                                                                 for m in convs)


def test_convert_to_fp8_warns_when_it_converts_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="fp8ops"):
        fp8ops.convert_to_fp8(torch.nn.Sequential(torch.nn.ReLU()))
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "no nn.Linear or transformers Conv1D" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fp8ops"):
        model = fp8ops.convert_to_fp8(_gpt2(), filter_fn=lambda mod, fqn: False)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "filter_fn rejected all 9" in caplog.text
    assert not any(isinstance(m, fp8ops.FP8Linear) for m in model.modules())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fp8ops"):
        fp8ops.convert_to_fp8(model, filter_fn=lambda mod, fqn: "mlp" in fqn)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "converted 4 layers" in caplog.text and "filter_fn left out 5" in caplog.text
