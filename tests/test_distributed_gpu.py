"""Data-parallel FP8 training on a GPU with NCCL (world size 1, so that one GPU suffices): DDP and
FSDP2 must train exactly as the same model without them, checkpoints must resume exactly, and
FSDP2's re-gathered weights must never meet a stale FP8 weight cast. The same model, data and
loop as the two-process gloo tests (tests/test_distributed.py)."""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

import fp8ops
from dist_spawn import spawn
from test_distributed import (CKPT_AT, STEPS, fp8_states, make_model, make_opt,
                              stale_weight_casts)
from test_distributed import train as gloo_train

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not dist.is_nccl_available():
    pytest.skip("needs a CUDA GPU and NCCL", allow_module_level=True)


def train(model, opt, steps, start=0, check=None):
    """The gloo tests' loop on rank 0's batches, on the GPU; the per-step losses."""
    return gloo_train(model, opt, steps, rank=0, start=start, check=check, device="cuda")[0]


def run(worker):
    """worker(out_dir) on one NCCL process (GPU 0); its result."""
    return spawn(functools.partial(_rank0, worker), world=1, backend="nccl")[0]


def _rank0(worker, rank, out_dir):
    return worker(out_dir)


def _plain_worker(out_dir):
    model = make_model().cuda()
    return {"losses": train(model, make_opt(model), STEPS), "state": fp8_states(model)}


def _ddp_worker(out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(make_model().cuda(), device_ids=[0])
    opt = make_opt(ddp)
    res = {"losses": train(ddp, opt, STEPS), "state": fp8_states(ddp.module)}
    ddp = DDP(make_model().cuda(), device_ids=[0])
    opt = make_opt(ddp)
    first = train(ddp, opt, CKPT_AT)
    path = os.path.join(out_dir, "ckpt.pt")
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, path)
    torch.manual_seed(1234)  # fresh weights: everything must come from the file
    fresh = DDP(fp8ops.convert_to_fp8(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)),
        fp8ops.DelayedScaling(amax_history_len=8)).cuda(), device_ids=[0])
    opt = make_opt(fresh)
    ckpt = torch.load(path, weights_only=False)
    fresh.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    res["resumed_losses"] = first + train(fresh, opt, STEPS - CKPT_AT, start=CKPT_AT)
    return res


def _fsdp_worker(out_dir):
    from torch.distributed.fsdp import fully_shard
    model = make_model(fp8_all_gather=False).cuda()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    stale = []
    losses = train(model, make_opt(model), STEPS,
                   check=lambda: stale.extend(stale_weight_casts(model)))
    return {"losses": losses, "state": fp8_states(model), "stale": stale}


def _fsdp_fp8_worker(out_dir, offload=False):
    """FSDP2 gathering the FP8 weights (each rank casts its shard; world size 1 here); offload:
    the shards and the optimizer step on the host (FSDP2's CPUOffloadPolicy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    model = make_model().cuda()
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    for layer in (model[0], model[2]):
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    kinds = [type(model[i].weight._local_tensor).__name__ for i in (0, 2)]
    losses = train(model, make_opt(model), STEPS)
    return {"losses": losses, "state": fp8_states(model), "kinds": kinds}


@pytest.fixture(scope="module")
def plain():
    return run(_plain_worker)


def _same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        va, vb = a[k], b[k]
        if torch.is_tensor(va):
            assert torch.equal(va.cpu(), vb.cpu()), k
        else:
            assert va == vb, k


def test_ddp_on_nccl_trains_exactly_as_without_it(plain):
    res = run(_ddp_worker)
    assert res["losses"] == plain["losses"]
    _same_state(res["state"], plain["state"])
    assert res["resumed_losses"] == res["losses"]


def test_fsdp2_on_nccl_trains_exactly_as_without_it(plain):
    res = run(_fsdp_worker)
    assert not any(res["stale"]), "a forward used an FP8 weight cast from stale weights"
    assert res["losses"] == plain["losses"]
    _same_state(res["state"], plain["state"])


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_fp8_all_gather_on_nccl_trains_exactly_as_without_it(plain, offload):
    res = run(functools.partial(_fsdp_fp8_worker, offload=offload))
    assert res["kinds"] == ["FP8WeightShard", "FP8WeightShard"]
    assert res["losses"] == plain["losses"]
    _same_state(res["state"], plain["state"])
