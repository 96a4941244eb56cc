"""FSDP2's FP8 all-gather of FP8GroupedLinear's expert weights (fp8ops/distributed/fsdp/experts.py), on
gloo with 1 and 2 CPU processes.

With the same batches on every rank the sharded run must be the single-process run bit for bit
(losses and weights): FSDP2 shards the experts (dim 0), each rank casts its whole experts with
their own scales and the gathered bytes are the single-process cast. With different batches per
rank the FP8 gather must equal FSDP2's high-precision gather bit for bit, with a quarter of the
float32 bytes on the wire. Configurations that split an expert's scale across ranks gather in
high precision, and say why. DelayedScaling experts gather in FP8 too: each rank casts its
experts with their slice of the weight role's scales, and the ExpertScalingState buffers must be
the single process's as well (the weight role stepping once per accumulation window)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8ops
from dist_spawn import spawn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
from _comm_count import CommCount  # noqa: E402

RECIPES = {"current": fp8ops.CurrentScaling(), "blockwise": fp8ops.BlockwiseScaling()}
DELAYED = fp8ops.DelayedScaling(amax_history_len=4)
STEPS, MICRO = 3, 2
# tokens per expert (an empty expert among them); 3 experts: uneven over 2 ranks
SIZES = {4: [5, 0, 12, 7], 3: [5, 12, 7]}


class Experts(nn.Module):
    """Two grouped layers: up [E, 128, 256] with a bias, down [E, 64, 128] (partial 128-row
    blocks per expert)."""

    def __init__(self, recipe, experts):
        super().__init__()
        self.up = fp8ops.FP8GroupedLinear(experts, 256, 128, bias=True, recipe=recipe)
        self.down = fp8ops.FP8GroupedLinear(experts, 128, 64, recipe=recipe)

    def forward(self, x, offsets):
        return self.down(F.gelu(self.up(x, offsets)), offsets)


def make_model(recipe, experts=4, fp8_all_gather=True, seed=0):
    torch.manual_seed(seed)
    model = Experts(recipe, experts)
    model.up.fp8_all_gather = model.down.fp8_all_gather = fp8_all_gather
    return model


def shard(model, reshard_after_forward=True, shard_placement_fn=None):
    from torch.distributed.fsdp import fully_shard
    for layer in (model.up, model.down):
        fully_shard(layer, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=shard_placement_fn)
    fully_shard(model, shard_placement_fn=shard_placement_fn)
    return model


def batch(step, micro, rank=0, experts=4):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    tokens = sum(SIZES[experts])
    offsets = torch.tensor(SIZES[experts]).cumsum(0).to(torch.int32)
    return (torch.randn(tokens, 256, generator=g) * (1 + rank), offsets,
            torch.randn(tokens, 64, generator=g))


def train(model, rank=0, experts=4, steps=STEPS, on_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        for micro in range(MICRO):
            x, offsets, y = batch(step, micro, rank, experts)
            loss = F.mse_loss(model(x, offsets), y) / MICRO
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(step)
    return losses


def mid_window(model, rank=0):
    """One optimizer step, then the next step's first micro-batch: the state a checkpoint taken
    inside an accumulation window holds (the experts' cast the next micro-batch reuses, whose
    scales `weight_cast_scale` keeps)."""
    train(model, rank, steps=1)
    x, offsets, y = batch(1, 0, rank)
    (F.mse_loss(model(x, offsets), y) / MICRO).backward()
    return full_state(model)


def evaluate(model):
    """A forward in eval mode (casts with the trained scales, records nothing)."""
    model.eval()
    with torch.no_grad():
        x, offsets, _ = batch(9, 0)
        model(x, offsets)
    model.train()


def full_state(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def run(model, rank=0, experts=4):
    kinds = [type(layer.weight._local_tensor).__name__ for layer in (model.up, model.down)]
    return {"losses": train(model, rank, experts), "state": full_state(model), "kinds": kinds}


def _refusals(model):
    from fp8ops.distributed.fsdp import experts_gather_refusal
    return [experts_gather_refusal(layer, layer.weight) for layer in (model.up, model.down)]


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------
def _same_data_worker(rank, out_dir):
    from torch.distributed.tensor import Shard
    res = {}
    for name, recipe in RECIPES.items():
        for reshard in (True, False):
            res[name, reshard] = run(shard(make_model(recipe), reshard))
    # configurations gathered in high precision: uneven experts, experts split on dim 1
    uneven = shard(make_model(RECIPES["current"], experts=3))
    res["uneven_refusals"] = _refusals(uneven)
    res["uneven"] = run(uneven, experts=3)
    split = shard(make_model(RECIPES["current"]), shard_placement_fn=lambda p: Shard(1))
    res["split_refusals"] = _refusals(split)
    res["split"] = run(split)
    return res


def _rank_data_worker(rank, out_dir):
    import torch.distributed.checkpoint as dcp
    from fp8ops.distributed.fsdp import experts as fsdp_experts
    res = {}
    for name, recipe in RECIPES.items():
        for fp8 in (True, False):
            model = shard(make_model(recipe, fp8_all_gather=fp8))
            res[name, fp8] = run(model, rank)
            with CommCount() as count:  # one more forward and backward, counted
                x, offsets, y = batch(7, 0, rank)
                F.mse_loss(model(x, offsets), y).backward()
            res["bytes", name, fp8] = count.bytes["all_gather"]
    # what the layers compute with: the gathered FP8 bytes
    model = shard(make_model(RECIPES["current"]), reshard_after_forward=False)
    x, offsets, _ = batch(0, 0, rank)
    model(x, offsets)
    res["gathered"] = [(type(layer.weight).__name__, layer.weight.expert_payload()[0].dtype)
                       for layer in (model.up, model.down)]
    # the experts' casts: one per optimizer step once an optimizer holds the weights
    casts, per_step = [0], []
    counted = fsdp_experts._cast_expert_values

    def counting(*args):
        casts[0] += 1
        return counted(*args)

    fsdp_experts._cast_expert_values = counting
    try:
        train(shard(make_model(RECIPES["current"])), rank,
              on_step=lambda step: per_step.append(casts[0] - sum(per_step)))
    finally:
        fsdp_experts._cast_expert_values = counted
    res["casts_per_step"] = per_step
    # checkpoints hold plain tensors; a checkpoint loaded into another model trains on alike
    model = shard(make_model(RECIPES["current"]))
    train(model, rank, steps=1)
    sd = model.state_dict()
    res["checkpoint_local_types"] = sorted({type(v.to_local()).__name__ for v in sd.values()
                                            if hasattr(v, "to_local")})
    path = os.path.join(out_dir, "dcp")
    dcp.save(sd, checkpoint_id=path)
    other = shard(make_model(RECIPES["current"], seed=1))
    train(other, rank, steps=1)  # casts of other values, cached
    loaded = other.state_dict()
    dcp.load(loaded, checkpoint_id=path)
    other.load_state_dict(loaded)
    res["loaded_state"] = (full_state(other), full_state(model))
    res["after_load"] = (train(other, rank), train(model, rank))
    return res


def _delayed_worker(rank, out_dir):
    recipe = DELAYED
    res = {}
    for reshard in (True, False):
        res["same", reshard] = run(shard(make_model(recipe), reshard))
    res["ranks"] = run(shard(make_model(recipe)), rank)  # each rank its own batches
    for reshard in (True, False):  # the high-precision gather
        res["hp", reshard] = run(shard(make_model(recipe, fp8_all_gather=False), reshard))
    for reshard in (True, False):  # an eval forward before each step's first micro-batch
        model = shard(make_model(recipe), reshard)
        res["eval", reshard] = {"losses": train(model, on_step=lambda step: evaluate(model)),
                                "state": full_state(model)}
    for reshard in (True, False):
        for fp8 in (True, False):
            res["mid", reshard, fp8] = mid_window(shard(make_model(recipe, fp8_all_gather=fp8),
                                                        reshard))
    model = shard(make_model(recipe), reshard_after_forward=False)
    x, offsets, _ = batch(0, 0, rank)
    model(x, offsets)
    res["gathered"] = [(type(layer.weight).__name__, layer.weight._data.dtype)
                       for layer in (model.up, model.down)]
    return res


def _world1_worker(rank, out_dir):
    return {name: run(shard(make_model(recipe))) for name, recipe in RECIPES.items()}


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single():
    """The single-process runs (no FSDP2), on one thread as the spawned ranks run (the float32
    sums of the blockwise weight gradient's emulation depend on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {name: run_single(make_model(recipe)) for name, recipe in RECIPES.items()}
        out["delayed"] = run_single(make_model(DELAYED))
        model = make_model(DELAYED)
        out["delayed_eval"] = {"losses": train(model, on_step=lambda step: evaluate(model)),
                               "state": full_state(model)}
        out["uneven"] = run_single(make_model(RECIPES["current"], experts=3), experts=3)
        out["delayed_mid"] = mid_window(make_model(DELAYED))
    finally:
        torch.set_num_threads(threads)
    return out


def run_single(model, experts=4):
    return {"losses": train(model, experts=experts), "state": full_state(model)}


def _assert_same(got, want, what):
    assert got["losses"] == want["losses"], (what, got["losses"], want["losses"])
    assert got["state"].keys() == want["state"].keys()
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), (what, k)


@pytest.fixture(scope="module")
def same_data():
    return spawn(_same_data_worker, world=2)


@pytest.fixture(scope="module")
def delayed():
    return spawn(_delayed_worker, world=2)


@pytest.fixture(scope="module")
def rank_data():
    return spawn(_rank_data_worker, world=2)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_grouped_fp8_all_gather_trains_as_one_process(same_data, single, name):
    for rank, res in enumerate(same_data):
        for reshard in (True, False):
            got = res[name, reshard]
            assert got["kinds"] == ["FP8WeightShard"] * 2, (name, got["kinds"])
            _assert_same(got, single[name], (rank, name, reshard))


def test_grouped_fp8_all_gather_world_size_one(single):
    (res,) = spawn(_world1_worker, world=1)
    for name in RECIPES:  # scales packed with the bytes (FSDP2 copies one input at world 1)
        assert res[name]["kinds"] == ["FP8WeightShard"] * 2
        _assert_same(res[name], single[name], name)


def test_uneven_experts_gather_in_high_precision(same_data, single):
    for res in same_data:
        assert res["uneven"]["kinds"] == ["Tensor"] * 2
        assert all("3 experts do not split evenly over 2 ranks" in r
                   for r in res["uneven_refusals"])
        _assert_same(res["uneven"], single["uneven"], "uneven")


def test_experts_split_across_ranks_gather_in_high_precision(same_data, single):
    for res in same_data:
        assert res["split"]["kinds"] == ["Tensor"] * 2
        assert all("Shard(dim=1)" in r for r in res["split_refusals"]), res["split_refusals"]
        _assert_same(res["split"], single["current"], "Shard(1)")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_grouped_fp8_all_gather_equals_high_precision_gather(rank_data, name):
    for rank, res in enumerate(rank_data):
        assert res[name, True]["kinds"] == ["FP8WeightShard"] * 2
        assert res[name, False]["kinds"] == ["Tensor"] * 2
        _assert_same(res[name, True], res[name, False], (rank, name))
    a, b = rank_data  # the ranks saw different data (else this test proves little)
    assert a[name, True]["losses"] != b[name, True]["losses"]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_grouped_all_gather_carries_fp8(rank_data, name):
    res = rank_data[0]
    # float32 weights: 1 byte per value against 4, plus the scales and the float32 bias
    ratio = res["bytes", name, True] / res["bytes", name, False]
    assert 0.25 < ratio < 0.27, ratio
    assert res["gathered"] == [("FP8GatheredWeight", torch.float8_e4m3fn)] * 2


def test_grouped_experts_cast_once_per_optimizer_step(rank_data):
    # two layers; the first step casts every forward (no optimizer holds the weights yet) and
    # its backward re-gathers reuse the forward's cast
    for res in rank_data:
        assert res["casts_per_step"] == [2 * MICRO, 2, 2], res["casts_per_step"]


def test_grouped_checkpoint_holds_plain_tensors_and_loads(rank_data):
    for res in rank_data:
        assert res["checkpoint_local_types"] == ["Tensor"]
        got, want = res["loaded_state"]
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        assert res["after_load"][0] == res["after_load"][1]


def test_delayed_grouped_fp8_all_gather_trains_as_one_process(delayed, single):
    # the weight role steps once per accumulation window, each rank casting its experts with
    # their slice of the scales; the states (every buffer) are the single process's
    for rank, res in enumerate(delayed):
        for reshard in (True, False):
            got = res["same", reshard]
            assert got["kinds"] == ["FP8WeightShard"] * 2, got["kinds"]
            assert any(".fp8_state.weight.amax_history" in k for k in got["state"])
            _assert_same(got, single["delayed"], (rank, "delayed", reshard))


def test_delayed_grouped_high_precision_gather_trains_as_one_process(delayed, single):
    # the gathered full weight is a new tensor every forward: the cache follows FSDP2's sharded
    # parameter (what the optimizer holds), so the weight role still steps once per window
    for rank, res in enumerate(delayed):
        for reshard in (True, False):
            got = res["hp", reshard]
            assert got["kinds"] == ["Tensor"] * 2, got["kinds"]
            _assert_same(got, single["delayed"], (rank, "delayed, high precision", reshard))


def test_delayed_grouped_fp8_all_gather_with_eval_forwards(delayed, single):
    # an eval forward's gather does not step; the next training forward steps as one process
    for rank, res in enumerate(delayed):
        for reshard in (True, False):
            _assert_same(res["eval", reshard], single["delayed_eval"], (rank, "eval", reshard))


def test_delayed_grouped_states_agree_across_ranks(delayed):
    # each rank its own batches: every rank's experts' amaxes are folded in on every rank
    a, b = (res["ranks"]["state"] for res in delayed)
    states = [k for k in a if ".fp8_state." in k]
    assert states and all(torch.equal(a[k], b[k]) for k in states)
    assert a["up.fp8_state.weight.step"].tolist() == [STEPS] * 4
    assert delayed[0]["ranks"]["losses"] != delayed[1]["ranks"]["losses"]


def test_delayed_grouped_all_gather_carries_fp8(delayed):
    for res in delayed:
        assert res["gathered"] == [("FP8GatheredWeight", torch.float8_e4m3fn)] * 2


def test_delayed_grouped_checkpoint_inside_a_window_keeps_the_cast_scales(delayed, single):
    # saved between two micro-batches: the scales of the experts' cast the next micro-batch
    # reuses, as one process saves them (a resumed run casts with them, not with new ones)
    want = single["delayed_mid"]
    assert all(torch.count_nonzero(want[f"{layer}.fp8_state.weight_cast_scale"]) == 4
               for layer in ("up", "down"))
    for rank, res in enumerate(delayed):
        for reshard in (True, False):
            for fp8 in (True, False):  # the FP8 and the high-precision gather
                got = res["mid", reshard, fp8]
                assert got.keys() == want.keys()
                for k, v in want.items():
                    assert torch.equal(got[k], v), (rank, reshard, fp8, k, got[k], v)
