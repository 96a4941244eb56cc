"""FSDP2 with selective activation checkpointing (torch.utils.checkpoint's context_fn, as
torchtitan applies it to every block), on 2 gloo CPU processes.

Selective checkpointing replays the ops of a region's recompute against those its forward ran,
op by op: a recompute must cast the weight exactly where its forward did, and reuse the cast
where its forward reused one. FSDP2 gathers the weight again for the recompute (after
reshard_after_forward, into storage of its own): a copy of the same sharded values, whose
forward cast must serve. With the same batches on both ranks the runs must equal the
single-process run without checkpointing bit for bit, for every recipe, the weights gathered
in FP8 or in high precision, on the C++ step and on the Python path."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8ops
from dist_spawn import spawn
from test_fsdp_fp8 import RECIPES, shard

STEPS, MICRO = 3, 2


def _policy(ctx, func, *args, **kwargs):
    """Save the GEMMs' outputs, recompute the rest (the casts included)."""
    from torch.utils.checkpoint import CheckpointPolicy
    if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """`inner` under selective activation checkpointing (non-reentrant)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        return checkpoint(self.inner, x, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts, _policy))


def make_model(recipe, fp8_all_gather=True, cpp_step=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 128), nn.GELU(),
                          nn.Linear(128, 64))
    model = fp8ops.convert_to_fp8(model, recipe, fp8_all_gather=fp8_all_gather)
    for layer in model:
        if isinstance(layer, fp8ops.FP8Linear):
            layer.cpp_step = cpp_step
    return model


def checkpointed(model, sharded: bool):
    """Each layer of `model` in a checkpointed region; with `sharded`, each Linear its own FSDP2
    unit, resharded after forward (so the recompute gathers it again)."""
    if sharded:
        shard(model, reshard_after_forward=True)
    for i in range(len(model)):
        model[i] = Checkpointed(model[i])
    return model


def train(model):
    """STEPS optimizer steps of MICRO micro-batches (the second micro-batch's forward reuses
    the first one's weight cast); the losses and the weights."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        for micro in range(MICRO):
            g = torch.Generator().manual_seed(10 * step + micro)
            x, y = torch.randn(8, 256, generator=g), torch.randn(8, 64, generator=g)
            loss = F.mse_loss(model(x), y) / MICRO
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    weights = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
               for p in model.parameters()]
    return {"losses": losses, "weights": weights}


CASES = [(name, fp8, cpp) for name in RECIPES for fp8 in (True, False) for cpp in (True, False)]


def _sharded_worker(rank, out_dir):
    return {case: train(checkpointed(make_model(RECIPES[case[0]], case[1], case[2]), True))
            for case in CASES}


@pytest.fixture(scope="module")
def sharded():
    return spawn(_sharded_worker, world=2)


@pytest.mark.parametrize("name,fp8_all_gather,cpp_step", CASES)
def test_selective_checkpointing_under_fsdp2_trains_as_one_process(sharded, name,
                                                                   fp8_all_gather, cpp_step):
    want = train(make_model(RECIPES[name], fp8_all_gather, cpp_step))
    # (the single-process run, checkpointed: the recompute changes nothing)
    assert _same(train(checkpointed(make_model(RECIPES[name], cpp_step=cpp_step), False)), want)
    for rank, res in enumerate(sharded):
        got = res[name, fp8_all_gather, cpp_step]
        assert _same(got, want), (rank, got["losses"], want["losses"])


def _same(got, want) -> bool:
    return got["losses"] == want["losses"] and all(
        torch.equal(a, b) for a, b in zip(got["weights"], want["weights"], strict=True))
