"""FP8ExpertParallel (fp8ops/distributed/expert_parallel/) on gloo with 2 and 4 CPU processes.

Each rank routes tokens of its own to experts held across the ranks. The run must train as one
process would on all ranks' tokens (rank 0's first, sorted by expert) with the same recipe:
losses and weights within FP8 noise (the wgrad's transposed blockwise copy is cast from the
dispatched FP8 values, the combine's gradient arrives as FP8 values: a rounding flip may move
a digit, never a trend). The dispatched bytes and scales are the ones the one-process grouped
GEMM reads for those tokens, bit for bit; the dispatch moves at most 0.55x of a bf16
dispatch's bytes; bad input is refused with a clear error."""
from __future__ import annotations

import functools
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

_ops = torch.ops.fp8ops
RECIPES = {"current": fp8ops.CurrentScaling(), "blockwise": fp8ops.BlockwiseScaling()}
EXPERTS, D_IN, D_HID, D_OUT = 4, 256, 128, 64
STEPS = 3


class Experts(nn.Module):
    """Two grouped layers on tokens sorted by expert (up with a bias, GELU, down)."""

    def __init__(self, recipe, experts=EXPERTS):
        super().__init__()
        self.up = fp8ops.FP8GroupedLinear(experts, D_IN, D_HID, bias=True, recipe=recipe)
        self.down = fp8ops.FP8GroupedLinear(experts, D_HID, D_OUT, recipe=recipe)

    def forward(self, x, offsets):
        return self.down(F.gelu(self.up(x, offsets)), offsets)


def make_model(recipe, experts=EXPERTS):
    torch.manual_seed(0)
    return Experts(recipe, experts)


def batch(step, rank):
    """Rank `rank`'s tokens of a step, sorted by expert (uneven counts; some expert empty on some
    rank), their offsets and targets."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = 24 + 8 * rank
    expert = torch.randint(0, EXPERTS, (tokens,), generator=g)
    expert[expert == (step + rank) % EXPERTS] = (step + rank + 1) % EXPERTS  # one left empty
    expert = expert.sort().values
    offsets = torch.bincount(expert, minlength=EXPERTS).cumsum(0).to(torch.int32)
    x = torch.randn(tokens, D_IN, generator=g) * (1 + rank)
    return x, offsets, torch.randn(tokens, D_OUT, generator=g), expert


def all_tokens(step, world):
    """All ranks' tokens as one process sorts them: rank 0's first, stable by expert."""
    parts = [batch(step, r) for r in range(world)]
    expert = torch.cat([p[3] for p in parts])
    order = torch.argsort(expert, stable=True)
    offsets = torch.bincount(expert, minlength=EXPERTS).cumsum(0).to(torch.int32)
    x = torch.cat([p[0] for p in parts])[order]
    return x, offsets, torch.cat([p[2] for p in parts])[order]


def total_tokens(world):
    return sum(24 + 8 * r for r in range(world))


def train(model, step_batch, world, steps=STEPS, scale=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x, offsets, y = step_batch(step)[:3]
        loss = ((model(x, offsets) - y) ** 2).sum() / (total_tokens(world) * D_OUT)
        (loss * scale).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def ep_worker(rank, out_dir, recipe, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from fp8ops.distributed.expert_parallel.dispatch import DISPATCHED
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(make_model(recipe), mesh, fp8ops.FP8ExpertParallel())
    seen = []
    model.up.register_forward_pre_hook(
        lambda mod, args: seen.append((getattr(args[0], DISPATCHED), args[1].clone())))
    losses = train(model, lambda step: batch(step, rank), world)
    weights = {k: _full(v.detach()) for k, v in model.state_dict().items()}
    local = model.up.weight.to_local().shape[0]
    return {"losses": losses, "weights": weights, "dispatched": seen, "local": local}


class Float32Experts(nn.Module):
    """The same experts in float32 (a loop over the groups): how far FP8 itself moves training."""

    def __init__(self, fp8: Experts):
        super().__init__()
        self.up_w, self.up_b = (nn.Parameter(p.detach().clone()) for p in
                                (fp8.up.weight, fp8.up.bias))
        self.down_w = nn.Parameter(fp8.down.weight.detach().clone())

    def forward(self, x, offsets):
        out, start = [], 0
        for e, end in enumerate(offsets.tolist()):
            h = F.gelu(x[start:end] @ self.up_w[e].t() + self.up_b[e])
            out.append(h @ self.down_w[e].t())
            start = end
        return torch.cat(out)


def float32_distance(recipe, world, ref_weights):
    """|w_float32 - w_fp8| per weight after the same training: FP8's own noise."""
    model = Float32Experts(make_model(recipe))
    train(model, lambda step: all_tokens(step, world), world)
    got = {"up.weight": model.up_w, "up.bias": model.up_b, "down.weight": model.down_w}
    return {k: (v.detach() - ref_weights[k]).norm() for k, v in got.items()}


def reference(recipe, world):
    model = make_model(recipe)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses = train(model, lambda step: all_tokens(step, world), world)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}, initial


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
@pytest.mark.parametrize("world", [2, 4])
def test_trains_as_one_process(recipe, world):
    results = spawn(functools.partial(ep_worker, recipe=RECIPES[recipe], world=world),
                    world=world)
    ref_losses, ref_weights, initial = reference(RECIPES[recipe], world)
    noise = float32_distance(RECIPES[recipe], world, ref_weights)
    ep_losses = torch.stack(results[0]["losses"]) * 0
    for res in results:  # each rank's loss is its tokens' share of the whole loss
        ep_losses += torch.stack(res["losses"])
    ref = torch.stack(ref_losses)
    assert torch.allclose(ep_losses, ref, rtol=5e-3, atol=0), (ep_losses, ref)
    for name, w in ref_weights.items():
        got = results[0]["weights"][name]
        for res in results[1:]:  # every rank sees the same full weights
            assert torch.equal(res["weights"][name], got)
        # the expert-parallel run is apart from the one-process run by no more than FP8 itself
        # moves that run from float32 (blockwise: about 0.8x, from wgrad's transposed copies
        # cast from FP8 values; current scaling: the same bytes throughout)
        err = (got - w).norm()
        assert 0 < noise[name] and err <= 1.5 * noise[name], (name, err, noise[name])
        assert err < 0.1 * (w - initial[name]).norm(), name  # and a small part of the update
    assert all(res["local"] == EXPERTS // world for res in results)
    # the dispatched FP8 bytes and scales are what the one-process grouped GEMM reads
    local = EXPERTS // world
    fmt = torch.float8_e4m3fn
    for step in range(STEPS):
        x, offsets, _ = all_tokens(step, world)
        if recipe == "blockwise":
            data, scale_inv = _ops.quantize_blockwise_grouped(x, offsets, fmt, False)[:2]
        else:
            data, _, _, scale_inv = _ops.quantize_current_grouped(x, offsets, fmt, 1.0, False)
        ends = [0] + offsets.tolist()
        for rank, res in enumerate(results):
            cast, local_offsets = res["dispatched"][step]
            lo, hi = ends[rank * local], ends[(rank + 1) * local]
            assert torch.equal(cast.data.view(torch.uint8), data[lo:hi].view(torch.uint8))
            if recipe == "blockwise":
                assert torch.equal(cast.scale_inv, scale_inv[lo:hi])
            else:
                assert torch.equal(cast.scale_inv, scale_inv[rank * local:(rank + 1) * local])
            assert torch.equal(local_offsets + lo, offsets[rank * local:(rank + 1) * local])


def fsdp_worker(rank, out_dir, recipe):
    """2 x 2: FSDP2 over 'dp' (each replica's experts sharded once more), experts over 'ep'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = parallelize_module(make_model(recipe), mesh["ep"], fp8ops.FP8ExpertParallel())
    for layer in (model.up, model.down):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    losses = train(model, lambda step: batch(step, rank), 4, scale=2)  # (FSDP2 averages over dp)
    weights = {k: _full(v.detach()) for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights}


@pytest.mark.parametrize("recipe", ["blockwise"])
def test_fsdp2_on_the_data_parallel_dimension(recipe):
    results = spawn(functools.partial(fsdp_worker, recipe=RECIPES[recipe]), world=4)
    ref_losses, ref_weights, initial = reference(RECIPES[recipe], 4)
    noise = float32_distance(RECIPES[recipe], 4, ref_weights)
    ep_losses = sum(torch.stack(res["losses"]) for res in results)
    assert torch.allclose(ep_losses, torch.stack(ref_losses), rtol=5e-3, atol=0)
    for name, w in ref_weights.items():
        got = results[0]["weights"][name]
        assert all(torch.equal(res["weights"][name], got) for res in results[1:])
        err = (got - w).norm()
        assert 0 < noise[name] and err <= 1.5 * noise[name], (name, err, noise[name])


def bytes_worker(rank, out_dir, recipe, fp8):
    """all-to-all bytes this rank sends in the forward and in the backward of one step (bf16
    tokens), with the rows it sends."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(make_model(recipe), mesh,
                               fp8ops.FP8ExpertParallel(fp8_dispatch=fp8))
    x, offsets, y, _ = batch(0, rank)
    x = x.to(torch.bfloat16).requires_grad_()
    with CommCount() as forward:
        out = model(x, offsets)
    with CommCount() as backward:
        ((out.float() - y) ** 2).sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    return {"forward": forward.summary(), "backward": backward.summary(), "rows": x.shape[0]}


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_dispatch_bytes(recipe):
    """The FP8 dispatch and the combine's FP8 gradient move <= 0.55x the bytes of bf16's; the
    counts' all-to-all and the high-precision directions are unchanged."""
    bf16 = spawn(functools.partial(bytes_worker, recipe=RECIPES[recipe], fp8=False), world=2)
    fp8 = spawn(functools.partial(bytes_worker, recipe=RECIPES[recipe], fp8=True), world=2)
    experts = torch.cat([batch(0, r)[3] for r in range(2)])
    for rank in range(2):
        rows, counts = bf16[rank]["rows"], EXPERTS * 8  # int64 counts per expert
        held = (experts // (EXPERTS // 2) == rank).sum().item()  # rows its experts get
        b_fwd, f_fwd = (r[rank]["forward"]["bytes"]["all_to_all"] for r in (bf16, fp8))
        b_bwd, f_bwd = (r[rank]["backward"]["bytes"]["all_to_all"] for r in (bf16, fp8))
        # a rank sends its tokens, and the outputs and input gradients of the rows it holds
        combine, dispatch_grad = held * D_OUT * 2, held * D_IN * 2  # bf16 both setups
        assert b_fwd == counts + rows * D_IN * 2 + combine  # counts, dispatch, combine
        assert b_bwd == rows * D_OUT * 2 + dispatch_grad  # combine's gradient, dispatch's
        dispatch = f_fwd - counts - combine
        combine_grad = f_bwd - dispatch_grad
        assert dispatch <= 0.55 * rows * D_IN * 2, (dispatch, rows)
        assert combine_grad <= 0.55 * rows * D_OUT * 2, (combine_grad, rows)
        assert fp8[rank]["forward"]["calls"]["all_to_all"] == 3  # counts, dispatch, combine
        # current scaling agrees each expert's scale: one MAX all-reduce of [E] amaxes a way
        reduce = 1 if recipe == "current" else 0
        assert fp8[rank]["forward"]["calls"]["all_reduce"] == reduce
        assert fp8[rank]["backward"]["calls"]["all_reduce"] == reduce
        assert bf16[rank]["forward"]["calls"]["all_reduce"] == 0


def errors_worker(rank, out_dir):
    """The style's refusals, each as (type name, message)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (2,))
    style = fp8ops.FP8ExpertParallel()
    cases = {
        "plain": lambda: parallelize_module(nn.Linear(4, 4), mesh, style),
        "uneven": lambda: parallelize_module(make_model(RECIPES["current"], experts=3), mesh,
                                             style),
        "delayed": lambda: parallelize_module(make_model(fp8ops.DelayedScaling()), mesh,
                                              style),
        "2-D mesh": lambda: parallelize_module(
            make_model(RECIPES["current"]),
            init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep")), style),
    }
    twice = parallelize_module(make_model(RECIPES["current"]), mesh, style)
    cases["twice"] = lambda: parallelize_module(twice, mesh, style)
    x, offsets, _, _ = batch(0, rank)
    cases["offsets"] = lambda: twice(x, offsets.to(torch.int64))
    cases["3-D input"] = lambda: twice(x[None], offsets)
    out = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = None
        except Exception as e:  # noqa: BLE001 (the pytest process checks type and message)
            out[name] = (type(e).__name__, str(e))
    return out


def test_public_names():
    from fp8ops.distributed.expert_parallel import FP8ExpertParallel
    assert fp8ops.FP8ExpertParallel is FP8ExpertParallel
    assert "FP8ExpertParallel" in fp8ops.__all__


def test_bad_input_is_refused():
    got = spawn(errors_worker, world=2)[0]
    expected = {
        "plain": ("TypeError", "holds none"),
        "uneven": ("ValueError", "3 experts do not split evenly over the 2 ranks"),
        "delayed": ("NotImplementedError", "CurrentScaling or BlockwiseScaling"),
        "2-D mesh": ("ValueError", "1-D expert-parallel mesh"),
        "twice": ("ValueError", "DTensor already"),
        "offsets": ("ValueError", "int32 tensor of shape (4,)"),
        "3-D input": ("ValueError", "must be 2-D"),
    }
    for name, (kind, words) in expected.items():
        assert got[name] is not None and got[name][0] == kind and words in got[name][1], \
            (name, got[name])


def edge_worker(rank, out_dir, recipe):
    """Rank 1 routes no tokens; rank 0's input has 3 rows past its last expert's; then an
    evaluation forward under no_grad."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(make_model(recipe), mesh, fp8ops.FP8ExpertParallel())
    x, offsets = edge_tokens(rank)
    x.requires_grad_()
    y = model(x, offsets)
    y.sum().backward()
    model.eval()
    with torch.no_grad():
        again = model(x, offsets)
    return {"y": y.detach(), "dx": x.grad, "again": again}


def edge_tokens(rank):
    n = 0 if rank == 1 else 10
    x = torch.randn(n + 3, D_IN, generator=torch.Generator().manual_seed(rank))
    return x, torch.tensor([n // 2, n // 2, n, n], dtype=torch.int32)


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_empty_rank_and_rows_past_the_last_expert(recipe):
    results = spawn(functools.partial(edge_worker, recipe=RECIPES[recipe]), world=2)
    model = make_model(RECIPES[recipe])  # one process: only rank 0 has tokens
    x, offsets = edge_tokens(0)
    # the same casts; float32 GEMMs over another number of rows may round a last bit apart
    ref = model(x, offsets).detach()
    assert torch.allclose(results[0]["y"], ref, rtol=1e-5, atol=1e-6)
    assert (results[0]["y"][10:] == 0).all() and (results[0]["dx"][10:] == 0).all()
    assert results[1]["y"].shape == (3, D_OUT) and (results[1]["y"] == 0).all()
    assert results[1]["dx"].shape == (3, D_IN) and (results[1]["dx"] == 0).all()
    for res in results:
        assert torch.equal(res["again"], res["y"])
