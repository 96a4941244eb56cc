"""FP8 weight all-gather under FSDP2 (fp8ops/distributed/fsdp/), on gloo with 1, 2 and 4 CPU
processes.

Exactness: with the same batch on every rank, the data-parallel gradient average of identical
gradients is exact (2 and 4 equal addends, a power-of-two divide), so any difference between the
sharded run and the single-process run is the FP8 gather's: a shard cast with another scale, a
delayed-scaling role stepped twice, a lost amax. Those runs must agree bit for bit, losses, weights
and FP8 state. With different batches per rank, the FP8 gather must equal FSDP2's
high-precision gather bit for bit (the same casts, only fewer bytes on the wire)."""
from __future__ import annotations

import gc
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

RECIPES = {
    "current": fp8ops.CurrentScaling(),
    "delayed": fp8ops.DelayedScaling(amax_history_len=4),
    "blockwise": fp8ops.BlockwiseScaling(),
    "mxfp8": fp8ops.MXFP8Scaling(),
}
STEPS, MICRO = 3, 2


def make_model(recipe, fp8_all_gather=True, dtype=torch.float32):
    torch.manual_seed(0)
    # 512 output rows: whole 128-row blocks on each of 4 ranks; 198: uneven shards at world 4
    # (50, 50, 50, 48 rows: the last one padded for the gather)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 198), nn.GELU(),
                          nn.Linear(198, 64)).to(dtype)
    return fp8ops.convert_to_fp8(model, recipe, fp8_all_gather=fp8_all_gather)


def shard(model, reshard_after_forward=True, mp_policy=None, offload_policy=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
    kw = {"mp_policy": mp_policy or MixedPrecisionPolicy(),
          "offload_policy": offload_policy or OffloadPolicy()}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, **kw)
    return model


def batch(step, micro, rank=0):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(8, 256, generator=g) * (1 + rank), torch.randn(8, 64, generator=g)


def train(model, rank=0, eval_every_step=False):
    """STEPS optimizer steps of MICRO microbatches; the losses (and an eval forward's output
    sum per step, which must not step delayed scaling)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = batch(step, micro, rank)
            loss = F.mse_loss(model(x), y) / MICRO
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if eval_every_step:
            model.eval()
            with torch.no_grad():
                losses.append(model(batch(step, 9, rank)[0]).sum().item())
            model.train()
    return losses


def full_state(model):
    """Weights (whole, from the shards) and FP8 state, as plain tensors."""
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().clone()
    return out


def conv1d_model(recipe, fp8_all_gather):
    torch.manual_seed(0)
    model = nn.Sequential(fp8ops.FP8Conv1D(128, 256, recipe=recipe,
                                           fp8_all_gather=fp8_all_gather),
                          nn.GELU(), nn.Linear(128, 64))  # the input of batch(): 256 features
    return fp8ops.convert_to_fp8(model, recipe, fp8_all_gather=fp8_all_gather)


def mixed_model(fp8_all_gather):
    """Current scaling with two margins and delayed scaling in one model."""
    model = make_model(fp8ops.CurrentScaling(margin=1.5), fp8_all_gather)
    for name, recipe in (("2", RECIPES["current"]), ("4", RECIPES["delayed"])):
        fp8ops.convert_to_fp8(model, recipe, lambda m, fqn, name=name: fqn == name,
                              fp8_all_gather=fp8_all_gather)
    assert [type(model[i].recipe).__name__ for i in (0, 2, 4)] == [
        "CurrentScaling", "CurrentScaling", "DelayedScaling"] and model[0].recipe.margin == 1.5
    return model


def gathered_kinds(model):
    return [type(model[i].weight._local_tensor).__name__ for i in (0, 2, 4)]


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------
def _same_data_worker(rank, out_dir):
    """Every recipe, with and without reshard_after_forward, the same batches on every rank."""
    res = {}
    for name, recipe in RECIPES.items():
        for reshard in (True, False):
            model = shard(make_model(recipe), reshard)
            kinds = gathered_kinds(model)
            losses = train(model, eval_every_step=name == "delayed")
            res[name, reshard] = {"losses": losses, "state": full_state(model), "kinds": kinds}
    return res


def _rank_data_worker(rank, out_dir):
    """Different batches per rank: FP8 gather vs FSDP2's high-precision gather; bytes and
    all-reduces of one step; the checkpoint holds plain tensors."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    res = {}
    for name in ("current", "delayed", "blockwise"):
        for fp8 in (True, False):
            model = shard(make_model(RECIPES[name], fp8_all_gather=fp8))
            res[name, fp8] = {"losses": train(model, rank), "state": full_state(model)}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for fp8 in (True, False):
        model = shard(make_model(RECIPES["current"], fp8_all_gather=fp8), mp_policy=bf16)
        res["bf16", fp8] = {"losses": train(model, rank), "state": full_state(model)}
        with CommCount() as count:  # one more step, counted
            x, y = batch(7, 0, rank)
            F.mse_loss(model(x), y).backward()
        res["bytes", fp8] = count.bytes["all_gather"]
        res["all_reduces", fp8] = count.calls["all_reduce"]
    for fp8 in (True, False):  # delayed scaling: the weights' amaxes join the end of backward's
        model = shard(make_model(RECIPES["delayed"], fp8_all_gather=fp8))
        train(model, rank)
        with CommCount() as count:  # a step after the warm start, counted
            x, y = batch(7, 0, rank)
            F.mse_loss(model(x), y).backward()
        res["delayed_all_reduces", fp8] = count.calls["all_reduce"]
    for fp8 in (True, False):  # recipes whose scales differ: the batched scale math splits
        model = shard(mixed_model(fp8))
        res["mixed", fp8] = {"losses": train(model, rank), "state": full_state(model)}
    for name in ("current", "delayed"):  # FP8Conv1D: the parameter is the [in, out] transpose
        for fp8 in (True, False):
            model = shard(conv1d_model(RECIPES[name], fp8))
            res["conv1d", name, fp8] = {"losses": train(model, rank), "state": full_state(model)}
    for fp8 in (True, False):  # a frozen first layer; the monitor attached
        model = make_model(RECIPES["delayed"], fp8_all_gather=fp8)
        model[0].weight.requires_grad_(False)
        monitor = fp8ops.monitor(model, every=1)
        model = shard(model)
        res["frozen", fp8] = {"losses": train(model, rank), "state": full_state(model)}
        res["stats", fp8] = fp8ops.stats(model)
        del monitor
    from torch.distributed.fsdp import CPUOffloadPolicy
    for name in ("current", "delayed"):  # shards and optimizer step on the host (FSDP2's own)
        model = shard(make_model(RECIPES[name]), offload_policy=CPUOffloadPolicy(pin_memory=False))
        res["offload", name] = {"losses": train(model, rank), "state": full_state(model)}
    try:
        fp8ops.CPUOffloadOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    except ValueError as e:
        res["offload_error"] = str(e)
    # a trained model left behind, alive on one rank only (as a garbage collector may leave it):
    # the next model's batched amax all-reduce must not count its layers on that rank
    old = shard(make_model(RECIPES["current"]))
    train(old, rank)
    kept = [old] if rank == 1 else []
    del old
    gc.collect()
    res["after_left_model"] = train(shard(make_model(RECIPES["current"])), rank)
    del kept
    sd = shard(make_model(RECIPES["current"])).state_dict()
    res["checkpoint_local_types"] = sorted({type(v.to_local()).__name__ for v in sd.values()
                                            if hasattr(v, "to_local")})
    return res


def _world1_worker(rank, out_dir):
    res = {}
    for fp8 in (True, False):  # compiled: the FP8-gathered layers run eagerly inside the graph
        model = torch.compile(shard(make_model(RECIPES["current"], fp8_all_gather=fp8)))
        res["compiled", fp8] = {"losses": train(model), "state": full_state(model)}
    for name in ("current", "delayed", "blockwise"):
        model = shard(make_model(RECIPES[name]))
        res[name] = {"losses": train(model), "state": full_state(model),
                     "kinds": gathered_kinds(model)}
    for reshard in (True, False):  # the shard bytes a forward kept for its backward's re-gather
        model = shard(make_model(RECIPES["current"]), reshard)
        x, y = batch(0, 0)
        loss = F.mse_loss(model(x), y)
        kept = [model[i].fp8_state.weight_cache.kept is not None for i in (0, 2, 4)]
        loss.backward()
        res["kept", reshard] = (kept, [model[i].fp8_state.weight_cache.kept is None
                                       for i in (0, 2, 4)])
        with torch.no_grad():  # no backward follows: nothing kept
            model(x)
        res["kept_no_grad", reshard] = [model[i].fp8_state.weight_cache.kept is None
                                        for i in (0, 2, 4)]
    return res


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single():
    """The single-process run of every recipe (no FSDP2)."""
    out = {}
    for name, recipe in RECIPES.items():
        model = make_model(recipe)
        losses = train(model, eval_every_step=name == "delayed")
        out[name] = {"losses": losses, "state": full_state(model)}
    return out


def _assert_same(got, want, what):
    assert got["losses"] == want["losses"], (what, got["losses"], want["losses"])
    assert got["state"].keys() == want["state"].keys()
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), (what, k)


# which layers gather in FP8: per-tensor always; blockwise where each shard has whole 128-row
# blocks (512 rows: up to 4 ranks; 200 and 64 rows: no); MXFP8 never (module doc)
EXPECTED_KINDS = {
    "current": ["FP8WeightShard"] * 3, "delayed": ["FP8WeightShard"] * 3,
    "blockwise": ["FP8WeightShard", "Tensor", "Tensor"], "mxfp8": ["Tensor"] * 3,
}


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_all_gather_trains_as_one_process(world, single):
    results = spawn(_same_data_worker, world=world)
    for name in RECIPES:
        for reshard in (True, False):
            for rank, res in enumerate(results):
                got = res[name, reshard]
                assert got["kinds"] == EXPECTED_KINDS[name], (name, got["kinds"])
                _assert_same(got, single[name], (world, rank, name, reshard))


def test_fp8_all_gather_world_size_one(single):
    (res,) = spawn(_world1_worker, world=1)
    _assert_same(res["compiled", True], res["compiled", False], "torch.compile")
    for name in ("current", "delayed", "blockwise"):
        expect = ["FP8WeightShard"] * 3 if name != "blockwise" else EXPECTED_KINDS[name]
        assert res[name]["kinds"] == expect
        # no eval forwards in this run: compare with a fresh single-process run
        model = make_model(RECIPES[name])
        _assert_same(res[name], {"losses": train(model), "state": full_state(model)}, name)
    for reshard in (True, False):  # held from the forward to the backward only
        assert res["kept", reshard] == ([True] * 3, [True] * 3), reshard
        assert res["kept_no_grad", reshard] == [True] * 3, reshard


@pytest.fixture(scope="module")
def rank_data():
    return spawn(_rank_data_worker, world=2)


@pytest.mark.parametrize("name", ["current", "delayed", "blockwise", "bf16"])
def test_fp8_all_gather_equals_high_precision_gather(rank_data, name):
    for rank, res in enumerate(rank_data):
        _assert_same(res[name, True], res[name, False], (rank, name))
    a, b = rank_data  # the ranks saw different data (else this test proves little)
    assert a[name, True]["losses"] != b[name, True]["losses"]


def test_fp8_all_gather_of_layers_with_different_recipes(rank_data):
    for rank, res in enumerate(rank_data):
        _assert_same(res["mixed", True], res["mixed", False], rank)


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_fp8_all_gather_of_a_transposed_parameter(rank_data, name):
    for rank, res in enumerate(rank_data):
        _assert_same(res["conv1d", name, True], res["conv1d", name, False], (rank, name))


def test_frozen_layer_and_monitor_under_fp8_all_gather(rank_data):
    for rank, res in enumerate(rank_data):
        _assert_same(res["frozen", True], res["frozen", False], rank)
        fp8, hp = res["stats", True], res["stats", False]
        # the gathered layers' weight casts have no high-precision values to compare with: their
        # weight statistics are left out; everything else is the same
        assert {k for k in hp if ".weight." not in k} == set(fp8)
        for k, v in fp8.items():
            assert v == hp[k] or (v != v and hp[k] != hp[k]), k


def test_fp8_all_gather_moves_half_the_bytes_of_bf16(rank_data):
    res = rank_data[0]
    ratio = res["bytes", True] / res["bytes", False]
    # weights 1 byte per element against 2; biases stay bf16; one scale per layer in metadata
    assert ratio <= 0.53, ratio
    assert ratio > 0.45, ratio  # the weights are still all there


def test_one_amax_all_reduce_per_step_for_all_layers(rank_data):
    # CurrentScaling: the three weights' amaxes in one collective; nothing else all-reduces
    assert rank_data[0]["all_reduces", True] == 1
    assert rank_data[0]["all_reduces", False] == 0


def test_delayed_scaling_makes_one_amax_all_reduce_per_step(rank_data):
    """The weights' amaxes are recorded on each rank and folded in by the one all-reduce at the
    end of the backward pass, with the inputs' and gradients', under either gather."""
    for res in rank_data:
        assert res["delayed_all_reduces", True] == 1 == res["delayed_all_reduces", False]


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_fp8_all_gather_with_fsdp2_cpu_offload(rank_data, name):
    for rank, res in enumerate(rank_data):
        _assert_same(res["offload", name], res[name, True], (rank, name))
    assert "CPUOffloadPolicy" in rank_data[0]["offload_error"]  # the way to offload under FSDP2


def test_a_model_left_alive_on_one_rank_changes_nothing(rank_data):
    for res in rank_data:
        assert res["after_left_model"] == res["current", True]["losses"]


def test_checkpoint_holds_plain_tensors(rank_data):
    assert rank_data[0]["checkpoint_local_types"] == ["Tensor"]


def test_fp8_all_gather_can_be_turned_off():
    layer = fp8ops.FP8Linear(8, 8, fp8_all_gather=False)
    assert not layer.fp8_all_gather
    model = fp8ops.convert_to_fp8(nn.Sequential(nn.Linear(8, 8)), fp8_all_gather=False)
    assert not model[0].fp8_all_gather
    assert fp8ops.convert_to_fp8(model)[0].fp8_all_gather  # converting again applies it
