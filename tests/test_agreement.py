"""Ranks that converted their models with different recipes raise an error naming both at the
first collective (fp8ops/scaling/agreement.py), instead of waiting on each other until the
process group's timeout. On gloo with 2 CPU processes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8ops
from dist_spawn import spawn


def _attempt(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def _mismatch_worker(rank, out_dir):
    from torch.distributed.fsdp import fully_shard
    res = {}
    # FSDP2: caught when fully_shard hands the layers their sharded weights
    torch.manual_seed(0)
    recipe = fp8ops.DelayedScaling() if rank == 0 else fp8ops.CurrentScaling()
    model = fp8ops.convert_to_fp8(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)), recipe)
    res["fsdp"] = _attempt(lambda: fully_shard(model))
    # data parallel without FSDP2: at the first amax all-reduce (the delayed-scaling warm start)
    recipe = fp8ops.DelayedScaling(amax_history_len=4 if rank == 0 else 8)
    model = fp8ops.convert_to_fp8(nn.Sequential(nn.Linear(16, 8)), recipe)
    res["data_parallel"] = _attempt(lambda: model(torch.randn(4, 16)).sum().backward())
    # the same recipes on both ranks: nothing raised, for FSDP2 and without it
    same = fp8ops.convert_to_fp8(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)),
                                 fp8ops.DelayedScaling(amax_history_len=4))
    res["same"] = _attempt(lambda: fully_shard(same)(torch.randn(4, 16)).sum().backward())
    return res


@pytest.fixture(scope="module")
def mismatch():
    return spawn(_mismatch_worker, world=2)


def test_different_recipes_under_fsdp2_raise_naming_both(mismatch):
    for rank, res in enumerate(mismatch):
        text = res["fsdp"]
        assert text is not None and "different FP8 recipes" in text, text
        assert "DelayedScaling(" in text and "CurrentScaling(" in text
        assert f"rank {rank} has" in text and f"rank {1 - rank} has" in text


def test_different_recipes_without_fsdp2_raise_at_the_first_all_reduce(mismatch):
    for res in mismatch:
        text = res["data_parallel"]
        assert text is not None and "amax_history_len=4" in text and "amax_history_len=8" in text


def test_the_same_recipes_train(mismatch):
    assert [res["same"] for res in mismatch] == [None, None]
