"""fp8ops.export_fp8: tiny Llama and Mixtral models (built from configs, nothing downloaded),
trained a step in FP8, exported in both formats and reloaded with transformers on the CPU
(dequantized): no missing or unexpected keys, every FP8 weight the exported bytes times their
scale, the bytes those of the model's own eval forward, logits close to the FP8 model's."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

import fp8ops
from fp8ops.export.weights import FP8Weight, dequantize

transformers.logging.set_verbosity_error()
VOCAB, SEQ = 64, 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               max_position_embeddings=SEQ, tie_word_embeddings=False, bos_token_id=0,
               eos_token_id=1, pad_token_id=None, num_key_value_heads=1)
CONFIGS = {
    "llama": lambda **kw: LlamaConfig(**{"intermediate_size": 64, **_COMMON, **kw}),
    "mixtral": lambda **kw: MixtralConfig(**{"intermediate_size": 48, "num_local_experts": 4,
                                             "num_experts_per_tok": 2, **_COMMON, **kw}),
}
RECIPES = {"current": fp8ops.CurrentScaling, "delayed": fp8ops.DelayedScaling,
           "blockwise": fp8ops.BlockwiseScaling, "mxfp8": fp8ops.MXFP8Scaling}
CASES = [(m, r) for m in CONFIGS for r in RECIPES if not (m == "mixtral" and r == "mxfp8")]


def _model(name, recipe, seed=0, **kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](**kw))
    return fp8ops.convert_to_fp8(model, RECIPES[recipe](), fallback="never",
                                 filter_fn=lambda mod, fqn: "lm_head" not in fqn)


def _batch(seed):
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _train_step(model, opt, seed):
    model(**_batch(seed)).loss.backward()
    opt.step()
    opt.zero_grad()


def _scale_key(fmt):
    return "weight_scale" if fmt == "compressed-tensors" else "weight_scale_inv"


def _dequantized(saved, key, fmt):
    """The exported weight times its scale, blocks expanded as the format says."""
    data, scale = saved[key], saved[key[:-len("weight")] + _scale_key(fmt)]
    if scale.numel() == 1:
        return dequantize(FP8Weight(data, scale.reshape(()), "tensor"))
    if scale.shape[0] == data.shape[0] != -(-data.shape[0] // 128):  # a scale per row: MXFP8
        return _mx_values(data, scale)
    return dequantize(FP8Weight(data, scale, "block"))


def _mx_values(data, scale):
    """MXFP8 bytes times their 1x32 blocks' scales: float32 values, or E8M0 bytes (uint8,
    2^(byte - 127)), decoded here on their own."""
    if scale.dtype == torch.uint8:
        scale = torch.ldexp(torch.ones(scale.shape), scale.to(torch.int32) - 127)
    return data.float() * scale.repeat_interleave(32, 1)[:, :data.shape[1]]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
@pytest.mark.parametrize("name,recipe", CASES)
def test_export_reloads_in_transformers_with_the_training_casts(tmp_path, name, recipe, fmt):
    model = _model(name, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 1)
    ids = _batch(2)["input_ids"]
    model.eval()
    with torch.no_grad():
        want = model(ids).logits
    model.train()
    if fmt == "fp8" and recipe == "mxfp8":
        with pytest.warns(UserWarning, match="cast again in 128x128 blocks"):
            fp8ops.export_fp8(model, tmp_path, format=fmt)
    else:
        fp8ops.export_fp8(model, tmp_path, format=fmt)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "float32"
    saved = load_file(tmp_path / "model.safetensors")
    reloaded, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    # (compressed-tensors decompresses the weights on the first forward)
    with torch.no_grad():
        got = reloaded(ids).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.05, rel  # the FP8 model casts its activations too: FP8 error, no more
    fp8_keys = [k for k, v in saved.items() if v.dtype == torch.float8_e4m3fn]
    assert fp8_keys
    reloaded_sd = reloaded.state_dict()
    for key in fp8_keys:
        want_w = _dequantized(saved, key, fmt)
        if ".experts." in key:  # merged back into the 3-D parameters: compare the expert's rows
            prefix, rest = key.split(".experts.")
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            inter = want_w.shape[0] if proj in ("w1", "w3") else None
            if proj == "w2":
                got = reloaded_sd[f"{prefix}.experts.down_proj"][e]
            else:
                up = reloaded_sd[f"{prefix}.experts.gate_up_proj"][e]
                got = up[:inter] if proj == "w1" else up[inter:]
        else:
            got = reloaded_sd[key]
        assert torch.equal(got.float(), want_w), key
    # the plain tensors come back as they were
    for key, value in fp8ops.plain_state_dict(model).items():
        if key.endswith("norm.weight") or "embed" in key or "lm_head" in key:
            assert torch.equal(reloaded_sd[key], value), key


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_exported_bytes_are_the_eval_forwards_casts(tmp_path, recipe):
    """The dense layers' exported bytes and scales against the cast their eval forward keeps."""
    model = _model("llama", recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 1)
    fp8ops.export_fp8(model, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    model.eval()
    with torch.no_grad():
        model(_batch(2)["input_ids"])
    for name, mod in model.named_modules():
        if isinstance(mod, fp8ops.FP8Linear):
            payload = mod.fp8_state.weight_cache.entry.payload
            data = payload[0][0] if recipe == "mxfp8" else payload[0]
            got = saved[f"{name}.weight"]
            assert torch.equal(got.view(torch.uint8),
                               data[:got.shape[0], :got.shape[1]].view(torch.uint8)), name
            if recipe in ("current", "delayed"):
                assert torch.equal(saved[f"{name}.weight_scale"], payload[2].reshape(1).float())
            elif recipe == "blockwise":
                assert torch.equal(saved[f"{name}.weight_scale"], payload[1].float())


def test_bf16_mxfp8_exports_in_compressed_tensors_mx_format(tmp_path):
    """A bfloat16 MXFP8 model: compressed-tensors' "mxfp8-quantized" format, the training
    scales as E8M0 exponents (uint8), reloaded by transformers with every weight the exported
    bytes times their power-of-two scales; a float32 model keeps float32 group scales
    (compressed-tensors decompresses MX weights to bfloat16 only)."""
    model = _model("llama", "mxfp8").to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 1)
    ids = _batch(2)["input_ids"]
    fp8ops.export_fp8(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    quant = config["quantization_config"]
    assert config["dtype"] == "bfloat16"
    assert quant["format"] == quant["config_groups"]["group_0"]["format"] == "mxfp8-quantized"
    assert quant["config_groups"]["group_0"]["weights"]["scale_dtype"] == "torch.uint8"
    saved = load_file(tmp_path / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with torch.no_grad():
        reloaded(ids)  # (compressed-tensors decompresses on the first forward)
    reloaded_sd = reloaded.state_dict()
    model.eval()
    with torch.no_grad():
        model(ids)
    fp8_keys = [k for k, v in saved.items() if v.dtype == torch.float8_e4m3fn]
    assert fp8_keys
    for key in fp8_keys:
        scale = saved[key[:-len("weight")] + "weight_scale"]
        assert scale.dtype == torch.uint8
        # the eval forward's own E8M0 scales and bytes, as they are
        name = key[:-len(".weight")]
        (data, scales), _ = model.get_submodule(name).fp8_state.weight_cache.entry.payload
        out, k = saved[key].shape
        assert torch.equal(scale, scales[:out, :k // 32].view(torch.uint8))
        assert torch.equal(saved[key].view(torch.uint8), data[:out, :k].view(torch.uint8))
        want = _mx_values(saved[key], scale)
        assert torch.equal(reloaded_sd[key].float(), want), key
    fp8ops.export_fp8(_model("llama", "mxfp8"), tmp_path / "f32")  # float32: float32 groups
    quant = json.loads((tmp_path / "f32" / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "float-quantized"
    assert load_file(tmp_path / "f32" / "model.safetensors")[
        "model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.float32


def test_quantization_config_passes_compressed_tensors_parser(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    for recipe in ("current", "blockwise", "mxfp8"):
        fp8ops.export_fp8(_model("llama", recipe), tmp_path / recipe)
        config = json.loads((tmp_path / recipe / "config.json").read_text())
        parsed = QuantizationConfig.model_validate(config["quantization_config"])
        assert parsed.ignore == ["lm_head"]
        assert parsed.config_groups["group_0"].weights.type == "float"


@pytest.mark.parametrize("steps_before", [0, 1])
@pytest.mark.parametrize("name,recipe", [("llama", "delayed"), ("llama", "current"),
                                         ("mixtral", "delayed"), ("mixtral", "blockwise")])
def test_export_changes_nothing_mid_accumulation(tmp_path, name, recipe, steps_before):
    """A twin that was not exported takes the same next step, bit for bit: exported between two
    micro-batches of an accumulation window, in training mode; in the first window (no optimizer
    holds the weights yet: the export casts anew) and in a later one (it reads the cached cast)."""
    models = [_model(name, recipe), _model(name, recipe)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for m, opt in zip(models, opts):
        for step in range(steps_before):
            _train_step(m, opt, 1 + step)
        m(**_batch(2)).loss.backward()  # the window's first micro-batch
    fp8ops.export_fp8(models[0], tmp_path, format="fp8")
    assert models[0].training
    for m, opt in zip(models, opts):
        m(**_batch(3)).loss.backward()
        opt.step()
    for (key, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        assert torch.equal(a, b), key
    losses = [m(**_batch(4)).loss for m in models]
    assert torch.equal(losses[0], losses[1])


def test_errors(tmp_path):
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    with pytest.raises(ValueError, match="convert it with fp8ops.convert_to_fp8"):
        fp8ops.export_fp8(plain, tmp_path)
    model = _model("llama", "current")
    with pytest.raises(ValueError, match="unknown format 'gguf'"):
        fp8ops.export_fp8(model, tmp_path, format="gguf")
    with pytest.raises(TypeError, match="transformers model"):
        fp8ops.export_fp8(fp8ops.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(4, 4))),
                          tmp_path)
    # 160 = 128 + 32: two blocks, the second partial, which transformers' fp8 loader misreads
    wide = _model("llama", "blockwise", intermediate_size=160)
    with pytest.raises(ValueError, match="partial 128-blocks"):
        fp8ops.export_fp8(wide, tmp_path, format="fp8")
    assert not (tmp_path / "config.json").exists()


def test_bf16_model_exports_its_dtype(tmp_path):
    model = _model("mixtral", "blockwise").to(torch.bfloat16)
    fp8ops.export_fp8(model, tmp_path, format="fp8")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    saved = load_file(tmp_path / "model.safetensors")
    assert saved["model.embed_tokens.weight"].dtype == torch.bfloat16
    reloaded, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16


def test_offloaded_model_is_refused(tmp_path):
    model = _model("llama", "current")
    opt = fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _train_step(model, opt, 1)
    with pytest.raises(NotImplementedError, match="offloaded to the CPU"):
        fp8ops.export_fp8(model, tmp_path)


@pytest.mark.parametrize("recipe,fmt", [("blockwise", "compressed-tensors"),
                                        ("current", "compressed-tensors"), ("current", "fp8")])
def test_partial_blocks_reload_exactly_where_accepted(tmp_path, recipe, fmt):
    """160 = 128 + 32 features: a partial second block (compressed-tensors reads a ceil grid; a
    per-tensor scale fills every block of transformers' fp8 grid alike)."""
    model = _model("llama", recipe, intermediate_size=160)
    fp8ops.export_fp8(model, tmp_path, format=fmt)
    saved = load_file(tmp_path / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with torch.no_grad():
        reloaded(_batch(1)["input_ids"])  # (compressed-tensors decompresses here)
    for key in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert torch.equal(reloaded.state_dict()[key].float(), _dequantized(saved, key, fmt)), key
