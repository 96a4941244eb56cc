"""FSDP2's FP8 all-gather of converted transformers experts modules (fp8ops/nn/hf_moe.py,
fp8ops/distributed/fsdp/experts.py), on gloo with 2 CPU processes: a tiny Mixtral built from its config
(nothing downloaded), converted, then fully_shard per decoder layer and at the root.

With the same batches on every rank the sharded run must be the single-process run bit for bit
(losses and parameters): FSDP2 shards the experts (dim 0), each rank casts its whole experts and
the gathered bytes are the single-process cast (with DelayedScaling, the experts' delayed-scaling
states too). The experts' 3-D parameters must really travel
in FP8, and checkpoints must hold plain tensors."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, MixtralConfig

import fp8ops
from dist_spawn import spawn
from fp8ops.nn.hf_moe import is_hf_experts

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
from _comm_count import CommCount  # noqa: E402

transformers.logging.set_verbosity_error()
RECIPES = {"current": fp8ops.CurrentScaling(), "blockwise": fp8ops.BlockwiseScaling(),
           "delayed": fp8ops.DelayedScaling(amax_history_len=4)}
VOCAB, SEQ, STEPS, MICRO = 64, 16, 3, 2
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def make_model(recipe, fp8_all_gather=True):
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=SEQ, tie_word_embeddings=False,
                           bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = fp8ops.convert_to_fp8(AutoModelForCausalLM.from_config(config), recipe)
    for mod in experts_modules(model):
        mod.fp8_all_gather = fp8_all_gather
    return model


def experts_modules(model):
    return [m for m in model.modules() if is_hf_experts(m)]


def shard(model, reshard_after_forward=True):
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    return model


def batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def train(model, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        for micro in range(MICRO):
            loss = model(**batch(step, micro)).loss / MICRO
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def mid_window(model):
    """One optimizer step, then the next step's first micro-batch: what a checkpoint taken
    inside an accumulation window holds."""
    train(model, steps=1)
    (model(**batch(1, 0)).loss / MICRO).backward()
    return full_state(model)


def full_state(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def local_kinds(model):
    return [type(getattr(mod, name)._local_tensor).__name__
            for mod in experts_modules(model) for name in EXPERT_PARAMS]


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------
def _worker(rank, out_dir):
    res = {}
    for name, recipe in RECIPES.items():
        model = shard(make_model(recipe))
        res[name] = {"losses": train(model), "state": full_state(model),
                     "kinds": local_kinds(model)}
    # a checkpoint between two micro-batches keeps the scales of the cast the next one reuses
    for reshard in (True, False):
        res["mid", reshard] = mid_window(shard(make_model(RECIPES["delayed"]), reshard))
    # what the experts compute with: the gathered FP8 bytes
    for name in ("current", "delayed"):
        model = shard(make_model(RECIPES[name]), reshard_after_forward=False)
        model(**batch(0, 0))
        res["gathered", name] = [(type(getattr(mod, p)).__name__,
                                  getattr(mod, p).expert_payload()[0].dtype)
                                 for mod in experts_modules(model) for p in EXPERT_PARAMS]
    # the bytes of one more step's gathers, FP8 and high precision
    for fp8 in (True, False):
        model = shard(make_model(RECIPES["current"], fp8_all_gather=fp8))
        train(model, steps=1)
        res["kinds", fp8] = local_kinds(model)
        with CommCount() as count:
            model(**batch(7, 0)).loss.backward()
        res["bytes", fp8] = count.bytes["all_gather"]
    # checkpoints (save_pretrained's state_dict) hold plain tensors
    res["checkpoint_local_types"] = sorted({type(v.to_local()).__name__
                                            for v in model.state_dict().values()
                                            if hasattr(v, "to_local")})
    return res


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single():
    """The single-process runs (no FSDP2), on one thread as the spawned ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, recipe in RECIPES.items():
            model = make_model(recipe)
            out[name] = {"losses": train(model), "state": full_state(model)}
        out["mid"] = mid_window(make_model(RECIPES["delayed"]))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def sharded():
    return spawn(_worker, world=2)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_hf_experts_fp8_all_gather_trains_as_one_process(sharded, single, name):
    want = single[name]
    for rank, res in enumerate(sharded):
        got = res[name]
        assert got["kinds"] == ["FP8WeightShard"] * 4, (rank, name, got["kinds"])
        assert got["losses"] == want["losses"], (rank, name, got["losses"], want["losses"])
        assert got["state"].keys() == want["state"].keys()
        if name == "delayed":  # the experts' delayed-scaling states are compared too
            assert any(".experts.fp8_state.gate_up_proj.weight.amax_history" in k
                       for k in want["state"]), list(want["state"])
        for k, v in want["state"].items():
            assert torch.equal(got["state"][k], v), (rank, name, k)


def test_hf_experts_all_gather_carries_fp8(sharded):
    for res in sharded:
        for name in ("current", "delayed"):
            assert res["gathered", name] == [("FP8GatheredWeight", torch.float8_e4m3fn)] * 4
        assert res["kinds", True] == ["FP8WeightShard"] * 4
        assert res["kinds", False] == ["Tensor"] * 4
        # float32 experts: a quarter of their bytes (the dense layers gather in FP8 either way)
        assert res["bytes", True] < res["bytes", False]


def test_hf_experts_checkpoint_holds_plain_tensors(sharded):
    for res in sharded:
        assert res["checkpoint_local_types"] == ["Tensor"]


def test_hf_experts_checkpoint_inside_a_window_keeps_the_cast_scales(sharded, single):
    want = single["mid"]
    scales = [k for k in want if k.endswith("weight_cast_scale") and ".experts." in k]
    assert scales and all(torch.count_nonzero(want[k]) == 4 for k in scales), scales
    for rank, res in enumerate(sharded):
        for reshard in (True, False):
            got = res["mid", reshard]
            assert got.keys() == want.keys()
            for k, v in want.items():
                assert torch.equal(got[k], v), (rank, reshard, k, got[k], v)
