"""FP8ExpertParallel on converted transformers experts modules (Mixtral: gated; GPT-OSS: stored
[E, in, out], gate and up interleaved, biases), built from configs (no download), on gloo with
2 CPU processes. Each rank routes tokens of its own; the outputs are those of the one-process
converted module on all ranks' tokens to float32 rounding (every row goes through the same
casts; float32 GEMMs over another number of rows may round a last bit apart), and the
gradients are apart from the one-process ones by no more than FP8 moves them from the module's
own float32 forward; the down projection's bias sums the combine's gradient as it arrived in
FP8, so its gradient is bounded by E5M2's rounding of those values instead."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers

import fp8ops
from dist_spawn import spawn

TOKENS, K = 24, 2
_COMMON = dict(vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
               max_position_embeddings=16, tie_word_embeddings=False, bos_token_id=0,
               eos_token_id=1, pad_token_id=None, num_key_value_heads=1)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(intermediate_size=64, num_local_experts=4,
                                                  num_experts_per_tok=K, **_COMMON),
    "gpt_oss": lambda: transformers.GptOssConfig(intermediate_size=64, num_local_experts=4,
                                                 num_experts_per_tok=K, head_dim=64,
                                                 **_COMMON),
}
RECIPES = {"current": fp8ops.CurrentScaling(), "blockwise": fp8ops.BlockwiseScaling()}


def experts_of(name):
    """(the experts module in float32 as its class runs it, its copy converted to FP8)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    (experts,) = [m for m in model.modules() if fp8ops.nn.hf_moe.is_hf_experts(m)]
    plain = copy.deepcopy(experts)
    plain.config._experts_implementation = "eager"
    return plain, experts


def routing(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS + 4 * rank, 128, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(x.shape[0])])
    weights = torch.rand(x.shape[0], K, generator=g).softmax(-1)
    return x, index, weights, torch.randn(x.shape[0], 128, generator=g)


def step(module, x, index, weights, target):
    x = x.clone().requires_grad_()
    out = module(x, index, weights)
    ((out - target) ** 2).sum().backward()
    return out.detach(), x.grad


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def worker(rank, out_dir, name, recipe):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    _, experts = experts_of(name)
    fp8ops.convert_to_fp8(experts, recipe=recipe)
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(experts, mesh, fp8ops.FP8ExpertParallel())
    out, dx = step(experts, *routing(rank))
    grads = {n: _full(p.grad) for n, p in experts.named_parameters()}
    return {"out": out, "dx": dx, "grads": grads}


def one_process(module, world=2):
    """All ranks' tokens in one call (current scaling takes each expert's scale from them all),
    the outputs and input gradients split back by rank."""
    parts = [routing(rank) for rank in range(world)]
    out, dx = step(module, *(torch.cat(t) for t in zip(*parts)))
    sizes = [p[0].shape[0] for p in parts]
    return out.split(sizes), dx.split(sizes), {n: p.grad for n, p in module.named_parameters()}


def dy_abs_sum(outs, world=2, experts=4):
    """sum over the rows of each expert of |dY| (the down projection's output gradient):
    [E, hidden]."""
    total = torch.zeros(experts, 128)
    for rank in range(world):
        _, index, weights, target = routing(rank)
        d_out = 2 * (outs[rank] - target)  # d loss / d output, per token
        for slot in range(index.shape[1]):
            total.index_add_(0, index[:, slot], (weights[:, slot, None] * d_out).abs())
    return total


# each model with one recipe (two processes importing transformers per case are slow)
@pytest.mark.parametrize("name,recipe", [("mixtral", "current"), ("gpt_oss", "blockwise")])
def test_hf_experts(name, recipe):
    results = spawn(functools.partial(worker, name=name, recipe=RECIPES[recipe]), world=2)
    plain, experts = experts_of(name)
    fp8ops.convert_to_fp8(experts, recipe=RECIPES[recipe])
    outs, dxs, grads = one_process(experts)
    _, plain_dxs, plain_grads = one_process(plain)
    for rank, res in enumerate(results):
        assert torch.allclose(res["out"], outs[rank], rtol=1e-5, atol=1e-6)
        noise = (plain_dxs[rank] - dxs[rank]).norm()
        assert (res["dx"] - dxs[rank]).norm() <= 1.5 * noise
    for n, g in grads.items():
        noise = (plain_grads[n] - g).norm()
        err = (results[0]["grads"][n] - g).norm()
        assert torch.equal(results[1]["grads"][n], results[0]["grads"][n])
        if n == "down_proj_bias":
            # summed from the combine's gradient as it arrived: FP8 (E5M2) values, each off by
            # at most 2^-3 of itself (round to nearest, two mantissa bits)
            bound = 2.0 ** -3 * dy_abs_sum(outs) + 1e-6
            assert ((results[0]["grads"][n] - g).abs() <= bound).all(), n
        else:
            assert 0 < noise and err <= 1.5 * noise, (n, err, noise)
