"""Gradient reductions in FP8 (fp8ops/distributed/wire/) on gloo with CPU processes: the
reduce-scatter itself against the exact sum, FSDP2 with fp8_reduce_scatter against FSDP2's own
reduce-scatter, DDP with fp8_compress_hook against DDP's default; bytes on the wire, determinism,
errors.

The error bound of one reduction: each rank's contribution is rounded to E4M3 in blocks whose
scale maps the block's amax to 448, so it moves by at most 2^-4 of itself (3 mantissa bits, half
an ulp) or 2^-10 of the block's amax / 448 (subnormals); the sum is float32. The references are
float64 sums of the unquantized contributions."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fp8ops
from dist_spawn import spawn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
from _comm_count import CommCount  # noqa: E402

REL, SUB = 2.0 ** -4, 2.0 ** -10 / 448


def _bound(contributions, divisor):
    """Per element: the sum over ranks of each contribution's largest E4M3 rounding error (the
    block amax taken as the rank's whole amax: a looser bound), over the divisor, plus float32
    sums' slack."""
    stack = torch.stack([c.double() for c in contributions])
    amax = stack.abs().amax(dim=1, keepdim=True)
    per_rank = torch.maximum(REL * stack.abs(), SUB * amax.expand_as(stack))
    exact = stack.sum(0) / divisor
    return per_rank.sum(0) / divisor + 1e-6 * exact.abs() + 1e-30, exact


# ---------------------------------------------------------------------------------------------
# the reduce-scatter
# ---------------------------------------------------------------------------------------------
CASES = [  # (values per rank's chunk, dtype, reduce op, block size)
    (300, torch.float32, "avg", 128),
    (77, torch.bfloat16, "sum", 32),
    (1024, torch.float32, "premul", 128),
    (0, torch.float32, "avg", 128),
]


def _rs_input(rank, world, n, dtype, seed):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    # each rank and chunk at its own scale: blocks with very different amaxes
    x = torch.randn(world, n, generator=g) * torch.logspace(-4, 1, world).unsqueeze(1) * (rank + 1)
    return x.reshape(-1).to(dtype)


def _op(kind, world):
    from torch.distributed import ReduceOp
    return {"avg": ReduceOp.AVG, "sum": ReduceOp.SUM,
            "premul": ReduceOp.PREMUL_SUM(1.0 / (world + 1))}[kind]


def _reduce_scatter_worker(rank, out_dir):
    from fp8ops.distributed import FP8ReduceScatter
    world = dist.get_world_size()
    res = {}
    for i, (n, dtype, kind, block) in enumerate(CASES):
        comm = FP8ReduceScatter(block_size=block)
        x = _rs_input(rank, world, n, dtype, i)
        outs = []
        for _ in range(2):  # twice: the same bits
            out = comm.allocate((n,), dtype=dtype, device=x.device).fill_(float("nan"))
            assert comm(out, x.clone(), dist.group.WORLD, _op(kind, world)) is None
            outs.append(out)
        res[i] = outs
    # inf on one rank: its block of the chunk is NaN on the receiving rank, never finite
    comm = FP8ReduceScatter(block_size=128)
    x = _rs_input(rank, world, 256, torch.float32, 9)
    if rank == 0:
        x[1 * 256 + 3] = float("inf")  # rank 1's chunk, first block
    out = torch.empty(256)
    comm(out, x, dist.group.WORLD, _op("sum", world))
    res["inf"] = out
    return res


@pytest.fixture(scope="module")
def rs_results():
    return spawn(_reduce_scatter_worker, world=3)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reduce_scatter_is_the_sum_within_the_e4m3_bound(rs_results, case):
    n, dtype, kind, block = CASES[case]
    world = len(rs_results)
    divisor = {"avg": world, "sum": 1, "premul": world + 1}[kind]
    inputs = [_rs_input(r, world, n, dtype, case).float().reshape(world, n) for r in range(world)]
    for rank, res in enumerate(rs_results):
        first, second = res[case]
        assert first.dtype == dtype and first.shape == (n,)
        assert torch.equal(first, second)  # deterministic
        if n == 0:
            continue
        bound, exact = _bound([inputs[r][rank] for r in range(world)], divisor)
        if dtype == torch.bfloat16:
            bound = bound + 2.0 ** -8 * exact.abs()  # the result's own rounding to bf16
        err = (first.double() - exact).abs()
        assert (err <= bound).all(), (rank, (err - bound).max())
        assert err.max() > 0  # it did travel in FP8


def test_reduce_scatter_turns_inf_into_nan_of_its_block(rs_results):
    out = rs_results[1]["inf"]
    assert out[:128].isnan().all() and out[128:].isfinite().all()
    for rank in (0, 2):
        assert rs_results[rank]["inf"].isfinite().all()


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------
def _model(recipes=None):
    """recipes: {layer index: recipe}; default CurrentScaling at 0 and 5, the middle layer
    left nn.Linear."""
    torch.manual_seed(0)
    # 99 and 45 rows: uneven shards at world 2; a LayerNorm and biases
    model = nn.Sequential(nn.Linear(64, 99), nn.LayerNorm(99), nn.GELU(), nn.Linear(99, 45),
                          nn.GELU(), nn.Linear(45, 16))
    recipes = recipes or {0: fp8ops.CurrentScaling(), 5: fp8ops.CurrentScaling()}
    for i, recipe in recipes.items():
        fp8ops.convert_to_fp8(model, recipe, lambda m, fqn, i=i: fqn == str(i))
    return model


# every other recipe, for the training runs
MIXED = {0: fp8ops.MXFP8Scaling(), 3: fp8ops.DelayedScaling(amax_history_len=4),
         5: fp8ops.BlockwiseScaling()}


def _batch(rank, step=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(12, 64, generator=g) * (1 + 3 * rank), torch.randn(12, 16, generator=g)


def _sharded(model, fp8_rs, reduce_dtype, fp8_all_gather=True):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    for m in model.modules():
        if hasattr(m, "fp8_all_gather"):
            m.fp8_all_gather = fp8_all_gather
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for i in (0, 3, 5):
        fully_shard(model[i], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if fp8_rs:
        fp8ops.distributed.fp8_reduce_scatter(model)
        fp8ops.distributed.fp8_reduce_scatter(model)  # installing twice is harmless
    return model


def _grads(model):
    return {k: p.grad.full_tensor().clone() for k, p in model.named_parameters()}


def _fsdp_worker(rank, out_dir):
    res = {"local": {}}
    local = _model()  # this rank's own gradients, unsharded: the bound's contributions
    x, y = _batch(rank)
    F.mse_loss(local(x), y).backward()
    res["local"] = {k: p.grad.clone() for k, p in local.named_parameters()}
    for reduce_dtype in (torch.float32, torch.bfloat16):
        for fp8_ag in (True, False):
            for fp8_rs in (True, False):
                model = _sharded(_model(), fp8_rs, reduce_dtype, fp8_ag)
                F.mse_loss(model(x), y).backward()  # first-use collectives, not counted
                model.zero_grad()
                with CommCount() as count:
                    F.mse_loss(model(x), y).backward()
                res[reduce_dtype, fp8_ag, fp8_rs] = {"grads": _grads(model),
                                                     "count": count.summary()}
    # training steps of the other recipes, twice from scratch: the same bits every time
    runs = []
    for _ in range(2):
        model = _sharded(_model(MIXED), True, torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            xb, yb = _batch(rank, step)
            loss = F.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((torch.stack(losses), {k: v.full_tensor() for k, v in model.state_dict().items()
                                           if hasattr(v, "full_tensor")}))
    res["runs"] = runs
    return res


@pytest.fixture(scope="module")
def fsdp_results():
    return spawn(_fsdp_worker, world=2)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fp8_all_gather", [True, False])
def test_fsdp_fp8_reduce_scatter_is_fsdp2s_average_within_the_bound(fsdp_results, reduce_dtype,
                                                                    fp8_all_gather):
    world = len(fsdp_results)
    got = fsdp_results[0][reduce_dtype, fp8_all_gather, True]["grads"]
    ref = fsdp_results[0][reduce_dtype, fp8_all_gather, False]["grads"]
    for name in ref:
        bound, exact = _bound([fsdp_results[r]["local"][name].reshape(-1) for r in range(world)],
                              world)
        slack = 2 * 2.0 ** -8 * exact.abs() if reduce_dtype == torch.bfloat16 else 0
        err = (got[name].double().reshape(-1) - ref[name].double().reshape(-1)).abs()
        assert (err <= bound + slack + 1e-6 * exact.abs()).all(), name
        assert got[name].dtype == ref[name].dtype


def test_fsdp_fp8_reduce_scatter_sends_half_the_bytes_of_bf16(fsdp_results):
    for fp8_all_gather in (True, False):
        fp8 = fsdp_results[0][torch.float32, fp8_all_gather, True]["count"]
        bf16 = fsdp_results[0][torch.bfloat16, fp8_all_gather, False]["count"]
        assert fp8["calls"]["reduce_scatter"] == 0 and fp8["calls"]["all_to_all"] > 0
        assert fp8["bytes"]["all_to_all"] <= 0.53 * bf16["bytes"]["reduce_scatter"], (fp8, bf16)
        # and the rest of the step's traffic is untouched
        default = fsdp_results[0][torch.float32, fp8_all_gather, False]["count"]
        assert fp8["bytes"]["all_gather"] == default["bytes"]["all_gather"]
        assert fp8["bytes"]["all_to_all"] < 0.27 * default["bytes"]["reduce_scatter"]


def test_fsdp_fp8_reduce_scatter_is_deterministic(fsdp_results):
    for res in fsdp_results:
        (losses_a, state_a), (losses_b, state_b) = res["runs"]
        assert torch.equal(losses_a, losses_b)
        assert state_a.keys() == state_b.keys()
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_fp8_reduce_scatter_refuses_a_module_without_fsdp():
    with pytest.raises(ValueError, match="no FSDPModule in Sequential"):
        fp8ops.distributed.fp8_reduce_scatter(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("kwargs,match", [(dict(block_size=0), "block_size must be a positive"),
                                          (dict(block_size=1.5), "block_size must be a positive"),
                                          (dict(fmt="e3m4"), "unknown FP8 format")])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fp8ops.distributed.FP8ReduceScatter(**kwargs)


def test_other_reductions_are_refused():
    from torch.distributed import ReduceOp

    from fp8ops.distributed.wire.reduce_scatter import divisor_of
    assert divisor_of(ReduceOp.SUM, 4) == 1.0 and divisor_of(ReduceOp.AVG, 4) == 4.0
    assert divisor_of(ReduceOp.PREMUL_SUM(0.25), 4) == 4.0
    with pytest.raises(ValueError, match="sums gradients"):
        divisor_of(ReduceOp.MAX, 4)


# ---------------------------------------------------------------------------------------------
# DDP
# ---------------------------------------------------------------------------------------------
def _ddp_worker(rank, out_dir):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    x, y = _batch(rank)
    local = _model()
    F.mse_loss(local(x), y).backward()
    res = {"local": {k: p.grad.clone() for k, p in local.named_parameters()}}
    for hook in ("default", "bf16", "fp8"):
        # small buckets: several of them, one not a multiple of the world size
        ddp = DDP(_model(), bucket_cap_mb=0.01)
        if hook == "bf16":
            ddp.register_comm_hook(None, bf16_compress_hook)
        elif hook == "fp8":
            ddp.register_comm_hook(None, fp8ops.distributed.fp8_compress_hook)
        F.mse_loss(ddp(x), y).backward()  # the first backward (DDP rebuilds its buckets)
        ddp.zero_grad()
        with CommCount() as count:
            F.mse_loss(ddp(x), y).backward()
        res[hook] = {"grads": {k: p.grad.clone() for k, p in ddp.module.named_parameters()},
                     "count": count.summary()}
    return res


@pytest.fixture(scope="module")
def ddp_results():
    return spawn(_ddp_worker, world=2)


def test_ddp_fp8_hook_averages_within_the_bound_and_replicas_agree(ddp_results):
    world = len(ddp_results)
    for name, ref in ddp_results[0]["default"]["grads"].items():
        got = ddp_results[0]["fp8"]["grads"][name]
        for r in range(1, world):  # every replica decodes the same bytes
            assert torch.equal(ddp_results[r]["fp8"]["grads"][name], got), name
        bound, exact = _bound([ddp_results[r]["local"][name].reshape(-1) for r in range(world)],
                              world)
        # the average is cast to FP8 blocks once more for the all-gather
        bound = bound + torch.maximum(REL * exact.abs(), SUB * exact.abs().max().expand_as(exact))
        err = (got.double().reshape(-1) - ref.double().reshape(-1)).abs()
        assert (err <= bound + 1e-6 * exact.abs()).all(), name
        assert err.max() > 0, name


def test_ddp_fp8_hook_sends_about_half_the_bytes_of_bf16_compress_hook(ddp_results):
    fp8, bf16 = ddp_results[0]["fp8"]["count"], ddp_results[0]["bf16"]["count"]
    sent = fp8["bytes"]["all_to_all"] + fp8["bytes"]["all_gather"]
    # an all-reduce moves its buffer twice (reduce-scatter and all-gather phases)
    assert fp8["calls"]["all_reduce"] == 0 and bf16["calls"]["all_reduce"] > 1
    assert sent <= 0.55 * 2 * bf16["bytes"]["all_reduce"], (fp8, bf16)
