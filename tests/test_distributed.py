"""Data-parallel FP8 training on 2 CPU processes (gloo): DDP, FSDP2 (fully_shard), checkpoint
resume, and the FP8 weight cache under FSDP2. Workers run under torch.multiprocessing.spawn and
write their results to files; the assertions run here, in the pytest process.

The model is Linear(32, 64) -> GELU -> Linear(64, 16), both FP8Linear with DelayedScaling. Rank r
scales its inputs by (1 + 3r), so the ranks see different amax and only the all-reduce (MAX) of
the recorded amaxes (one per backward pass for every layer: fp8ops.scaling.amax_reduction) can make their
scales agree. DDP runs with its defaults (buffers broadcast from rank 0 before every forward):
that is harmless only because every fp8 buffer is identical on every rank between steps."""
from __future__ import annotations

import gc
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fp8ops
from dist_spawn import spawn

WORLD = 2
STEPS = 6
CKPT_AT = 3
LOCAL_BATCH = 8


# ---------------------------------------------------------------------------------------------
# the model, the data and the training loop (shared by every worker and the reference run)
# ---------------------------------------------------------------------------------------------
def make_model(process_group=None, fp8_all_gather=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    recipe = fp8ops.DelayedScaling(amax_history_len=8, process_group=process_group)
    return fp8ops.convert_to_fp8(model, recipe, fp8_all_gather=fp8_all_gather)


def make_opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def local_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(LOCAL_BATCH, 32, generator=g) * (1.0 + 3.0 * rank)
    return x, torch.randn(LOCAL_BATCH, 16, generator=g)


def global_batch(step):
    xs, ys = zip(*(local_batch(step, r) for r in range(WORLD)))
    return torch.cat(xs), torch.cat(ys)


def train(model, opt, steps, rank=None, start=0, check=None, device="cpu"):
    """rank=None: the single-process run on the global batch. Returns the per-step losses and
    the input amax each step's first layer saw."""
    losses, amaxes = [], []
    for s in range(start, start + steps):
        x, y = global_batch(s) if rank is None else local_batch(s, rank)
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x), y)
        if check is not None:
            check()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        amaxes.append(x.abs().max().item())
    return losses, amaxes


def fp8_states(module):
    """Every fp8_state entry of the state_dict (the buffers, RNG seed and offset too), cloned."""
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in module.state_dict().items()
            if ".fp8_state." in k}


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------
def _ddp_worker(rank, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    res = {}
    # (a, b) uninterrupted training, DDP defaults
    ddp = DDP(make_model())
    opt = make_opt(ddp)
    res["losses"], res["amax"] = train(ddp, opt, STEPS, rank)
    res["state"] = fp8_states(ddp.module)
    # (d) checkpoint at CKPT_AT, resume in fresh models on both ranks
    ddp = DDP(make_model())
    opt = make_opt(ddp)
    first, _ = train(ddp, opt, CKPT_AT, rank)
    path = os.path.join(out_dir, "ckpt.pt")
    if rank == 0:
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, path)
    dist.barrier()
    torch.manual_seed(1234 + rank)  # fresh, different weights: everything must come from the file
    fresh = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    fresh = DDP(fp8ops.convert_to_fp8(fresh, fp8ops.DelayedScaling(amax_history_len=8)))
    opt = make_opt(fresh)
    ckpt = torch.load(path, weights_only=False)
    fresh.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    rest, _ = train(fresh, opt, STEPS - CKPT_AT, rank, start=CKPT_AT)
    res["resumed_losses"] = first + rest
    # a deliberately broken run: each rank reduces its amax over a group of itself only, so the
    # other rank's amax is lost (what a missing all-reduce would do); DDP's buffer broadcast is
    # off so that rank 0's buffers do not mask it
    own = [dist.new_group([r]) for r in range(WORLD)][rank]
    ddp = DDP(make_model(process_group=own), broadcast_buffers=False)
    res["lost_losses"], _ = train(ddp, make_opt(ddp), STEPS, rank)
    res["lost_state"] = fp8_states(ddp.module)
    return res


def accumulate(model, opt, steps=3, micro=2):
    """Gradient accumulation over `micro` batches a step, the same batches on every rank (so that
    the data-parallel mean of the gradients is each rank's own, exactly), with no no_sync():
    every micro-batch's backward all-reduces. Returns the losses."""
    losses = []
    for s in range(steps):
        for m in range(micro):
            x, y = local_batch(100 + micro * s + m, 0)
            loss = F.mse_loss(model(x), y) / micro
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _ddp_accum_worker(rank, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = make_model()
    ddp = DDP(model)
    return accumulate(ddp, make_opt(ddp)), fp8_states(model)


def _compiled_worker(rank, out_dir):
    """torch.compile over DDP (delayed scaling) and over tensor-parallel layers (current and
    delayed), each compiled before any eager step: the first amax all-reduce, with the recipe
    agreement check before it, happens inside the compiled region."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    torch._dynamo.reset()
    out = {}
    for name in ("ddp_delayed", "tp_current", "tp_delayed"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        recipe = fp8ops.CurrentScaling() if name == "tp_current" else fp8ops.DelayedScaling()
        model = fp8ops.convert_to_fp8(model, recipe)
        if name == "ddp_delayed":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            parallelize_module(model, init_device_mesh("cpu", (WORLD,)),
                               {"0": fp8ops.FP8ColwiseParallel(), "2": fp8ops.FP8RowwiseParallel()})
        compiled = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
        for step in range(2):  # the same batch: the loss falls
            loss = compiled(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = losses
    return out


def _compiled_tp_recompiles_worker(rank, out_dir):
    """A compiled tensor-parallel model (delayed scaling) trained 6 steps, another one trained
    eagerly and dropped before the fourth: the graphs compiled so far after each step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def tensor_parallel_model():
        torch.manual_seed(0)
        model = fp8ops.convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(),
                                                    nn.Linear(64, 32)), fp8ops.DelayedScaling())
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)),
                           {"0": fp8ops.FP8ColwiseParallel(), "2": fp8ops.FP8RowwiseParallel()})
        return model

    model = tensor_parallel_model()
    compiled = torch.compile(model, backend=counting_backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    counts = []
    for step in range(6):
        if step == 3:
            other = tensor_parallel_model()
            other(x).square().mean().backward()
            del other
            gc.collect()
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        counts.append(len(graphs))
    return counts


def stale_weight_casts(model):
    """Per FP8 layer of the sharded model: whether the FP8 weight its forward used differs from
    the cast of the weight it was given (a stale cache). For FSDP2's high-precision gather
    (fp8_all_gather=False), where each rank casts the gathered weight; the FP8 all-gather is
    tested in test_fsdp_fp8.py."""
    out = []
    for layer in (model[0], model[2]):
        st = layer.fp8_state
        w = layer.weight.full_tensor()
        # the scale the cast used (the first cast's is a warm start, not the role's scale)
        scale = st.weight_cache.entry.scale
        data = torch.ops.fp8ops.quantize(w, scale, torch.float8_e4m3fn, False)[0]
        out.append(not torch.equal(st.weight_cache.entry.payload[0].view(torch.uint8),
                                   data.view(torch.uint8)))
    return out


def _fsdp_worker(rank, out_dir):
    from torch.distributed.fsdp import fully_shard
    model = make_model(fp8_all_gather=False)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    stale = []
    losses, amax = train(model, make_opt(model), STEPS, rank,
                         check=lambda: stale.extend(stale_weight_casts(model)))
    return {"losses": losses, "amax": amax, "state": fp8_states(model), "stale": stale}


def _fsdp_accum_worker(rank, out_dir):
    """FSDP2 + DelayedScaling + gradient accumulation: FSDP2 re-gathers the weight into new
    storage per microbatch at addresses that differ by rank; the ranks must still step (and
    all-reduce) the weight scaling state the same number of times, or the collectives mismatch."""
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = make_opt(model)
    for step in range(3):
        for micro in range(3):
            x, y = local_batch(10 * step + micro, rank)
            F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"state": fp8_states(model)}


def _fsdp_single_worker(rank, out_dir):
    """World size 1: FSDP2 re-gathers the updated weight into the same storage (same data_ptr
    here, often) under _unsafe_preserve_version_counter, so the version does not change."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    fp8ops.convert_to_fp8(model, fp8ops.CurrentScaling(), fp8_all_gather=False)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stale = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(8):
            # 2-D inputs, then 3-D ones (FSDP2 warns if a module's output is a view)
            x = torch.randn(8, 256) if step < 4 else torch.randn(2, 4, 256)
            loss = model(x).square().mean()
            for layer in (model[0], model[2]):
                cache = layer.fp8_state.weight_cache.entry.payload
                fresh = fp8ops.quantize(layer.weight.full_tensor(), "e4m3")  # current scaling
                stale.append(not torch.equal(cache[0].view(torch.uint8),
                                             fresh.data.view(torch.uint8)))
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"stale": stale, "warnings": [str(w.message) for w in caught]}


def _reduce_once_worker(rank, out_dir):
    """DelayedScaling layers trained with ranks on different data (no DDP): the all-reduces
    fp8ops makes per step, the states after each, and the edge cases: a training-mode forward
    with no backward before the next step, a NaN on one rank only, two models over two process
    groups in one backward, a backward that raises halfway, and activation checkpointing."""
    model = make_model()
    opt = make_opt(model)
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return real(*args, **kwargs)

    def step(s, *models, scale=1.0):
        before = len(calls)
        x, y = local_batch(s, rank)
        sum(F.mse_loss(m(x * scale), y) for m in models).backward()
        return calls[before:]

    dist.all_reduce = counting  # fp8ops calls torch.distributed.all_reduce
    res = {"counts": [], "states": []}
    try:
        for s in range(4):
            res["counts"].append(len(step(s, model)))
            opt.step()
            opt.zero_grad()
            res["states"].append(fp8_states(model))
        x, _ = local_batch(10, rank)
        with torch.no_grad():
            model(x)  # records the input amax; no backward reduces it
        res["no_backward_amax"] = x.abs().max().item()
        step(11, model, scale=0.01)  # its input update must see both ranks'
        opt.zero_grad()
        res["after_no_backward"] = fp8_states(model)
        x, y = local_batch(12, rank)
        if rank == 1:
            x[0, 0] = float("nan")
        F.mse_loss(model(x), y).backward()
        res["after_nan"] = fp8_states(model)
        opt.zero_grad()
        # a second model over its own process group (same ranks), in the same backward
        other = make_model(process_group=dist.new_group([0, 1]))
        step(13, model, other)  # its warm start
        groups = step(14, model, other)
        res["two_groups"] = [len(groups), len({id(g) for g in groups})]
        res["two_groups_states"] = fp8_states(model), fp8_states(other)
        # a backward that raises after the last layer's ran, on every rank
        x, y = local_batch(15, rank)
        h = model[1].register_forward_hook(_raise_in_backward)
        try:
            F.mse_loss(model(x), y).backward()
            res["raised"] = False
        except RuntimeError as e:
            res["raised"] = "halfway" in str(e)
        h.remove()
        before = len(calls)
        step(16, model)
        res["after_raise"] = [len(calls) - before, fp8_states(model)]
        # activation checkpointing (the re-entrant kind runs an inner backward)
        from torch.utils.checkpoint import checkpoint
        before = len(calls)
        x, y = local_batch(17, rank)
        F.mse_loss(checkpoint(model, x.requires_grad_(), use_reentrant=True), y).backward()
        res["reentrant"] = [len(calls) - before, fp8_states(model)]
    finally:
        dist.all_reduce = real
    return res


def _raise_in_backward(module, inputs, out):
    def fail(grad):
        raise RuntimeError("halfway")
    out.register_hook(fail)


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp():
    return spawn(_ddp_worker)


@pytest.fixture(scope="module")
def single():
    model = make_model()
    return train(model, make_opt(model), STEPS)


def _assert_same_state(states):
    a, b = states
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), f"{k} differs across ranks: {a[k]} vs {b[k]}"
        else:
            assert a[k] == b[k], k


def test_ddp_scaling_state_identical_across_ranks(ddp):
    r0, r1 = ddp
    # the ranks really saw different amax (rank 1's inputs are 4x larger) ...
    assert all(a1 > 1.5 * a0 for a0, a1 in zip(r0["amax"], r1["amax"]))
    # ... and every buffer of every ScalingState agrees, pending amax included
    _assert_same_state([r0["state"], r1["state"]])
    # the history holds the MAX over ranks: forward s pushes the amax of step s-1 into slot 0
    hist = r0["state"]["0.fp8_state.input.amax_history"]
    expect = torch.tensor([max(a, b) for a, b in zip(r0["amax"], r1["amax"])][STEPS - 2::-1])
    assert torch.equal(hist[:STEPS - 1], expect), (hist, expect)
    assert int(r0["state"]["0.fp8_state.input.step"]) == STEPS
    for role in ("input", "weight", "grad"):
        assert r0["state"][f"2.fp8_state.{role}.amax_history"][:STEPS - 1].min() > 0, role


@pytest.fixture(scope="module")
def reduce_once():
    return spawn(_reduce_once_worker)


def test_one_amax_all_reduce_per_step_for_all_layers(reduce_once):
    """The casts record on their rank; one all-reduce at the end of each backward pass (after
    the warm start, whose casts all-reduce their own amax) folds every layer's records in, and
    every buffer agrees across ranks after each step."""
    r0, r1 = reduce_once
    assert r0["counts"][1:] == [1, 1, 1] == r1["counts"][1:], r0["counts"]  # two layers, one
    assert r0["counts"][0] > 2  # the warm start
    for a, b in zip(r0["states"], r1["states"]):
        _assert_same_state([a, b])


def test_reduction_edge_cases(reduce_once):
    """A forward with no backward is reduced before its role steps again; a NaN on one rank is
    counted on both; two process groups make one all-reduce each; a backward that raised
    leaves its records to the roles' next steps; re-entrant checkpointing stays in step."""
    r0, r1 = reduce_once
    _assert_same_state([r0["after_no_backward"], r1["after_no_backward"]])
    slot0 = r0["after_no_backward"]["0.fp8_state.input.amax_history"][0].item()
    assert slot0 == max(r0["no_backward_amax"], r1["no_backward_amax"])
    _assert_same_state([r0["after_nan"], r1["after_nan"]])
    key = "0.fp8_state.input.nonfinite_count"
    assert int(r0["after_nan"][key]) == int(r0["after_no_backward"][key]) + 1
    assert r0["two_groups"] == [2, 2] == r1["two_groups"]
    for i in range(2):
        _assert_same_state([r0["two_groups_states"][i], r1["two_groups_states"][i]])
    assert r0["raised"] and r1["raised"]
    _assert_same_state([r0["after_raise"][1], r1["after_raise"][1]])
    _assert_same_state([r0["reentrant"][1], r1["reentrant"][1]])
    assert r0["reentrant"][0] == r1["reentrant"][0] >= 1


# Tolerance for DP vs single-process losses. Both runs cast bit-identical FP8 operands at first:
# the input scale is that of the global amax (the all-reduced MAX), and each rank's dY is exactly
# 2x the single-process dY with an exactly 2x smaller scale. What differs is float32 summation
# order (wgrad over 8 + 8 rows plus the gradient all-reduce, vs over 16 rows): ~1e-7 relative on
# the weights after a step. The FP8 casts then amplify this: a weight amax that moved by one
# float32 ulp moves the delayed scale, and every element near a rounding tie flips by one FP8 ulp
# (2^-3 / 2^-4 relative), so from step ~3 on the losses can differ by up to ~1e-3 (measured: 6e-4
# with the initial scale 1.0; about 1e-7 since the delayed-scaling warm start). Hence: step 0 (no
# update yet) to 1e-5; all steps to 2e-3, 3x the noise seen, and below what a real scaling bug
# gives (losing rank 1's amax moves the loss by 7e-3: checked in
# test_dp_tolerance_catches_lost_amax).
STEP0_RTOL, RTOL = 1e-5, 2e-3


def _mean_losses(r0, r1, key="losses"):
    return torch.tensor([(a + b) / 2 for a, b in zip(r0[key], r1[key])], dtype=torch.float64)


def test_ddp_loss_matches_single_process(ddp, single):
    """The DDP loss of a step is the mean of the ranks' losses (equal shards, mean reduction)."""
    r0, r1 = ddp
    ddp_loss = _mean_losses(r0, r1)
    ref, ref_amax = single
    ref = torch.tensor(ref, dtype=torch.float64)
    assert ref_amax == [max(a, b) for a, b in zip(r0["amax"], r1["amax"])]
    torch.testing.assert_close(ddp_loss[0], ref[0], rtol=STEP0_RTOL, atol=0)
    torch.testing.assert_close(ddp_loss, ref, rtol=RTOL, atol=0)
    assert ddp_loss[-1] < ddp_loss[0]  # it trains


def test_dp_tolerance_catches_lost_amax(ddp, single):
    """RTOL is tight enough to see the scales go wrong (rank 1's amax dropped)."""
    r0, r1 = ddp
    bad = _mean_losses(r0, r1, "lost_losses")
    ref = torch.tensor(single[0], dtype=torch.float64)
    assert ((bad - ref).abs() / ref).max() > 3 * RTOL
    hist = "0.fp8_state.input.amax_history"  # and the ranks' scaling states did diverge
    assert not torch.equal(r0["lost_state"][hist], r1["lost_state"][hist])


def test_ddp_gradient_accumulation_steps_the_weight_once_per_step():
    """DDP writes the all-reduced gradient into param.grad in place at the end of each backward:
    the weight cache's gradient voucher must follow that write, or the next micro-batch recasts
    the weight and steps its delayed scaling again. Bit for bit one process."""
    model = make_model()
    want = accumulate(model, make_opt(model)), fp8_states(model)
    for losses, state in spawn(_ddp_accum_worker):
        assert losses == want[0]
        assert state["0.fp8_state.weight.step"].item() == 3
        _assert_same_state([state, want[1]])


def test_compiled_ddp_and_tensor_parallel_layers_train():
    """The recipe agreement check is an object collective, which cannot be traced: under
    torch.compile it waits for an eager collective instead of failing the first step."""
    r0, r1 = spawn(_compiled_worker)
    for name, losses in r0.items():
        assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0], (name, losses)
        assert r1[name] == losses, name  # the same data on both ranks


def test_compiled_tensor_parallel_layers_do_not_recompile():
    """After the first two steps (the second leaves the warm start) a compiled tensor-parallel
    layer compiles nothing more: nothing it traces depends on a step's weight-cache state, nor
    on other models' layers coming and going."""
    for counts in spawn(_compiled_tp_recompiles_worker):
        assert counts[1] >= counts[0] > 0, counts
        assert counts[2:] == [counts[1]] * 4, counts


def test_fsdp2_matches_ddp(ddp):
    f0, f1 = spawn(_fsdp_worker)
    assert not any(f0["stale"] + f1["stale"]), "a forward used a stale cached FP8 weight"
    _assert_same_state([f0["state"], f1["state"]])
    d0, d1 = ddp
    _assert_same_state([f0["state"], d0["state"]])  # FSDP2 and DDP scale identically
    fsdp_loss, ddp_loss = _mean_losses(f0, f1), _mean_losses(d0, d1)
    # same math; reduce-scatter vs all-reduce summation order only (see RTOL)
    torch.testing.assert_close(fsdp_loss[0], ddp_loss[0], rtol=STEP0_RTOL, atol=0)
    torch.testing.assert_close(fsdp_loss, ddp_loss, rtol=RTOL, atol=0)


def test_checkpoint_resume_identical(ddp):
    r0, r1 = ddp
    for r in (r0, r1):
        assert r["resumed_losses"] == r["losses"], (r["resumed_losses"], r["losses"])


@pytest.fixture(scope="module")
def fsdp_single():
    (r,) = spawn(_fsdp_single_worker, world=1)
    return r


def test_fsdp2_weight_cache_not_stale(fsdp_single):
    """Without the optimizer-step count in ScalingState.cached_weight's key, this finds forwards
    that used the FP8 weight of an earlier step (FSDP2 keeps data_ptr and _version)."""
    r = fsdp_single
    assert not any(r["stale"]), f"stale FP8 weight in {sum(r['stale'])} of {len(r['stale'])}"


def test_fsdp2_module_output_is_not_a_view(fsdp_single):
    """FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip the
    pre-backward hook); FP8Linear returns a tensor of its own, as nn.Linear does for 2-D inputs
    (and for 3-D ones here too)."""
    views = [w for w in fsdp_single["warnings"] if "view tensor" in w]
    assert not views, views[0]


def test_weight_cache_sees_write_that_keeps_version():
    """FSDP2's mechanism without FSDP2: the optimizer updates a separate (sharded) tensor, and the
    new values are copied into the same unsharded storage without bumping _version."""
    shard = nn.Parameter(torch.randn(16, 32))
    weight = nn.Parameter(shard.detach().clone())
    state = fp8ops.ScalingState(fp8ops.CurrentScaling())
    x = torch.randn(4, 32)
    fp8ops.linear(x, weight, state=state)
    shard.grad = torch.randn_like(shard)
    torch.optim.SGD([shard], lr=1.0).step()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(weight):
        weight.copy_(shard)
    assert weight._version == 0
    y = fp8ops.linear(x, weight, state=state)
    torch.testing.assert_close(y, fp8ops.linear(x, weight), rtol=0, atol=0)


def test_fsdp2_gradient_accumulation_keeps_ranks_in_step():
    a, b = spawn(_fsdp_accum_worker)  # a collective mismatch fails on the 45 s gloo timeout
    _assert_same_state([a["state"], b["state"]])
    assert int(a["state"]["0.fp8_state.weight.step"]) == 3  # once per optimizer step
    assert int(a["state"]["0.fp8_state.input.step"]) == 9  # once per microbatch
