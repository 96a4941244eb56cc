"""Tensor parallelism of FP8Linear (FP8ColwiseParallel, FP8RowwiseParallel,
PrepareFP8ModuleInput) against single-process training, on gloo/CPU: one world of 2 runs every
recipe, sequence parallelism and the error checks; one world of 4 runs a 2-D (dp x tp) mesh with
FSDP2 over dp. Workers return their results; the assertions run here.

The model: FP8Linear(64, 256) -> GELU -> FP8Linear(256, 64), colwise then rowwise (256 splits
into 128-element blocks over 2 ranks, as the blockwise recipe's 128x128 weight blocks need),
trained 3 SGD steps of 2 microbatches. The loss is sum(y * g) with g fixed per microbatch, so no
gradient reads y: the training runs only through what TP computes exactly.

Exact (asserted bit for bit): the colwise output (each element is a whole dot product over K,
and the weight shard is cast with the whole weight's scale after the amax all-reduce), the
colwise weight and bias gradients (sums over rows of the rank's own dY columns, cast with the
whole dY's scale), the rowwise weight and input gradients (dY is replicated: sums over the whole
of N), the replicated bias gradient; hence every parameter after training, and DelayedScaling's
whole state.
Bounded: what sums partial results of the ranks in an all-reduce, in another float32 order than
one process: the rowwise output y (K split over the ranks), the colwise input gradient dX (N
split), and under sequence parallelism the rowwise bias gradient (rows split). For c = a @ b^T +
bias with the contraction (length K) split over w ranks, float32 error analysis (u = 2^-24,
gamma_n = n u / (1 - n u)) puts both the one-process and the TP result within
gamma_{K+w+2} (sum_k |a_k b_k| + |bias|) of the exact value, a and b the dequantized FP8
operands. An FP8 cast at most doubles a magnitude (the nearest value is at most half a spacing
away, and the smallest non-zero one is reached only from above half of it), so

    |c_tp - c_one| <= 2 gamma_{K+w+2} (4 |A| @ |B|^T + |bias|)        A, B: the operands as given

(tp_bound). test_bound_catches_missing_amax_all_reduce shows it fails when each rank scales its
shards with its own amax.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8ops

# a spawned worker imports this module in a fresh process: importing fp8ops must not have
# loaded DTensor (the tensor-parallel names are exported lazily)
DTENSOR_AFTER_IMPORT = "torch.distributed.tensor" in sys.modules

from dist_spawn import spawn  # noqa: E402

WORLD, STEPS, MICRO = 2, 3, 2
D, H = 64, 256
B, S = 4, 8  # x is [B, S, D]; sequence parallelism shards S
LR = 2.0 ** -5  # a power of two: SGD's lr * grad is exact, one rounding per update
RECIPES = {
    "current": fp8ops.CurrentScaling(),
    "delayed": fp8ops.DelayedScaling(amax_history_len=4),
    # the recipe's group is each rank alone: only the TP shard all-reduce makes scales agree
    "delayed_own_group": fp8ops.DelayedScaling(amax_history_len=4),
    "mxfp8": fp8ops.MXFP8Scaling(),
    "blockwise": fp8ops.BlockwiseScaling(),
}
U = 2.0 ** -24


# ---------------------------------------------------------------------------------------------
# model, data, training (shared by the workers and the single-process reference)
# ---------------------------------------------------------------------------------------------
def make_model(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
    return fp8ops.convert_to_fp8(model, recipe)


def batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(B, S, D, generator=g) * 3, torch.randn(B, S, D, generator=g)


def seq_shard(t, rank, world=WORLD):
    return t.chunk(world, 1)[rank]


def full(t):
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _manual_sgd(params):
    """A training loop's own update through p.data, which no version counter of a DTensor
    shows, then the gradients dropped (torch.optim.SGD's step and zero_grad, by hand)."""
    class Step:
        def step(self):
            for p in params:
                p.data.add_(p.grad, alpha=-LR)

        def zero_grad(self):
            for p in params:
                p.grad = None
    return Step()


def train(model, rank=None, probe=False, manual=False):
    """rank: run on that rank's sequence shard of every batch (sequence parallelism). probe:
    keep the operands of the two bounded GEMMs (the reference run). manual: update the
    parameters by hand (_manual_sgd)."""
    params = list(model.parameters())
    opt = _manual_sgd(params) if manual else torch.optim.SGD(params, lr=LR)
    out = {"y": [], "dx": [], "b2": [], "ops": []}
    if probe:
        ops = {}

        def keep_dy1(mod, args, y1):
            y1.register_hook(lambda g: ops.update(dy1=g.detach()))

        model[2].register_forward_hook(lambda m, a, o: ops.update(h=a[0].detach()))
        model[0].register_forward_hook(keep_dy1)
    for step in range(STEPS):
        for micro in range(MICRO):
            x, g = batch(step, micro)
            if rank is not None:
                x, g = seq_shard(x, rank), seq_shard(g, rank)
            x.requires_grad_()
            out["b2"].append(full(model[2].bias))
            y = model(x)
            (y * g).sum().backward()
            out["y"].append(y.detach().clone())
            out["dx"].append(x.grad.clone())
            if probe:
                out["ops"].append(dict(ops, w1=full(model[0].weight), w2=full(model[2].weight)))
        opt.step()
        opt.zero_grad()
    out["params"] = {k: full(v) for k, v in model.named_parameters()}
    out["state"] = {k: v.clone() for k, v in model.state_dict().items() if ".fp8_state." in k}
    return out


def tp_plan(sequence=False, local_input=False):
    """sequence: x is sharded along S; local_input: the module's input goes to the layers as a
    plain tensor (use_local_output), not a DTensor."""
    from torch.distributed.tensor import Replicate, Shard
    if not sequence:
        return {"0": fp8ops.FP8ColwiseParallel(), "2": fp8ops.FP8RowwiseParallel()}
    return {"": fp8ops.PrepareFP8ModuleInput(input_layouts=Shard(1),
                                             desired_input_layouts=Replicate(),
                                             use_local_output=local_input),
            "0": fp8ops.FP8ColwiseParallel(),
            "2": fp8ops.FP8RowwiseParallel(output_layouts=Shard(1))}


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------
def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the type and message are asserted in pytest)
        return type(e).__name__, str(e)
    return None


def _errors(mesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module as par
    colwise, rowwise = fp8ops.FP8ColwiseParallel, fp8ops.FP8RowwiseParallel
    lin = fp8ops.FP8Linear
    mixed = nn.Sequential(lin(8, 8), lin(8, 8, recipe=fp8ops.MXFP8Scaling()))
    prepare = fp8ops.PrepareFP8ModuleInput(input_layouts=Shard(1),
                                           desired_input_layouts=Replicate())
    twice = par(lin(64, 64), mesh, colwise())
    from fp8ops.distributed.tensor_parallel import shard_scales
    marked = {dim: lin(64, 64) for dim in (0, 1)}
    for dim, layer in marked.items():
        shard_scales(layer, mesh, dim, "a framework's sharding")
    return {
        # shard_scales, for weights a framework shards by itself: the roles it marks
        "shard_scales_roles": {dim: sorted(layer.fp8_state.shard_meshes)
                               for dim, layer in marked.items()},
        "shard_scales_block": _catch(lambda: shard_scales(
            lin(64, 96, recipe=fp8ops.MXFP8Scaling()), mesh, 0, "a framework's sharding")),
        "nn_linear": _catch(lambda: par(nn.Linear(64, 256), mesh, colwise())),
        # 96 over 2 ranks: shards of 48, not a multiple of MXFP8's 32
        "mx_colwise": _catch(lambda: par(lin(64, 96, recipe=fp8ops.MXFP8Scaling()), mesh,
                                         colwise())),
        # 128 over 2 ranks: shards of 64, a 128-block would span both
        "blockwise_rowwise": _catch(lambda: par(lin(128, 64, recipe=fp8ops.BlockwiseScaling()),
                                                mesh, rowwise())),
        "per_tensor_any_cut": _catch(lambda: par(lin(96, 96), mesh, rowwise())),
        "percentile": _catch(lambda: par(lin(64, 64, recipe=fp8ops.CurrentScaling(
            amax_percentile=99.0)), mesh, colwise())),
        "mesh_2d": _catch(lambda: par(lin(64, 64), init_device_mesh("cpu", (1, WORLD)),
                                      rowwise())),
        "twice": _catch(lambda: par(twice, mesh, colwise())),
        "recipe_changed": _catch(lambda: fp8ops.convert_to_fp8(
            par(lin(64, 64), mesh, colwise()), fp8ops.CurrentScaling(margin=2.0))(
                torch.randn(2, 64))),
        "prepare_no_fp8": _catch(lambda: par(nn.Sequential(nn.Linear(8, 8)), mesh, prepare)),
        "prepare_mixed": _catch(lambda: par(mixed, mesh, fp8ops.PrepareFP8ModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate()))),
    }


def _tp_worker(rank, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from fp8ops.distributed import tensor_parallel
    mesh = init_device_mesh("cpu", (WORLD,))
    own_group = [dist.new_group([r]) for r in range(WORLD)][rank]
    # count the FP8 all-gathers, and the GEMMs that read their result
    counts = {"gathers": 0, "reads": 0}
    all_gather_bytes, read = tensor_parallel._all_gather_bytes, tensor_parallel._Gathered.linear

    def counting_gather(*args):
        counts["gathers"] += 1
        return all_gather_bytes(*args)

    def counting_read(*args):
        counts["reads"] += 1
        return read(*args)

    tensor_parallel._all_gather_bytes = counting_gather
    tensor_parallel._Gathered.linear = counting_read
    res = {"tp": {}, "sp": {}, "fp8_gathers": {}, "all_reduces": {},
           "dtensor_after_import": DTENSOR_AFTER_IMPORT}
    for name, recipe in RECIPES.items():
        if name == "delayed_own_group":
            recipe = fp8ops.DelayedScaling(amax_history_len=4, process_group=own_group)
        model = parallelize_module(make_model(recipe), mesh, tp_plan())
        res["tp"][name] = train(model)
        res["all_reduces"][name] = _all_reduces_of_a_step(model)
        counts.update(gathers=0, reads=0)
        model = parallelize_module(make_model(recipe), mesh, tp_plan(sequence=True))
        res["sp"][name] = train(model, rank=rank)
        res["fp8_gathers"][name] = dict(counts)
    counts.update(gathers=0, reads=0)
    model = parallelize_module(make_model(RECIPES["current"]), mesh,
                               tp_plan(sequence=True, local_input=True))
    res["sp"]["current_local_input"] = train(model, rank=rank)
    res["fp8_gathers"]["current_local_input"] = dict(counts)
    # a broken run: each rank casts its shards with its own amax (the all-reduce left out)
    model = parallelize_module(make_model(RECIPES["current"]), mesh, tp_plan())
    shard_amax = fp8ops.nn.per_tensor_cast.shard_amax
    fp8ops.nn.per_tensor_cast.shard_amax = lambda amax, mesh, recipe=None: amax
    try:
        res["lost_amax"] = train(model)
    finally:
        fp8ops.nn.per_tensor_cast.shard_amax = shard_amax
    model = parallelize_module(make_model(RECIPES["delayed"]), mesh, tp_plan())
    res["manual"] = train(model, manual=True)
    res["errors"] = _errors(mesh)
    return res


def _all_reduces_of_a_step(model):
    """The torch.distributed.all_reduce calls fp8ops makes in one more training step (forward,
    backward) of a trained model (DTensor's own collectives are functional ones, not these),
    and whether the FP8 state is then the same on every rank."""
    calls, real = [], dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        x, g = batch(STEPS, 0)
        (model(x) * g).sum().backward()
    finally:
        dist.all_reduce = real
    state = torch.cat([v.double().flatten() for k, v in model.state_dict().items()
                       if ".fp8_state." in k])
    states = [torch.empty_like(state) for _ in range(WORLD)]
    dist.all_gather(states, state)
    return len(calls), all(torch.equal(states[0], t) for t in states)


def _fsdp_tp_worker(rank, out_dir):
    """2-D mesh: TP over 'tp', FSDP2 over 'dp'; both dp ranks get the same batches, so their
    mean gradient is each one's exactly and the run must equal one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    res = {}
    for name in ("current", "delayed", "mxfp8", "blockwise"):
        model = parallelize_module(make_model(RECIPES[name]), mesh["tp"], tp_plan())
        fully_shard(model, mesh=mesh["dp"])
        res[name] = train(model)
    return res


# ---------------------------------------------------------------------------------------------
# fixtures and the bound
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_runs():
    return spawn(_tp_worker, world=WORLD)


@pytest.fixture(scope="module")
def reference_manual():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(make_model(RECIPES["delayed"]), manual=True)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    """Single-process training of every recipe (one thread, as the workers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: train(make_model(r), probe=True) for name, r in RECIPES.items()}
    finally:
        torch.set_num_threads(threads)


def gamma(n):
    return n * U / (1 - n * U)


def tp_bound(a, b, bias=None, world=WORLD):
    """Elementwise bound on |a @ b^T + bias| computed by TP (contraction split over `world`
    ranks) minus the same computed by one process (module doc)."""
    k = a.shape[-1]
    mag = 4 * (a.abs().double() @ b.abs().double().t())
    if bias is not None:
        mag = mag + bias.abs().double()
    return 2 * gamma(k + world + 2) * mag


def _assert_within(got, ref, bound, what):
    err = (got.double() - ref.double()).abs()
    worst = (err / bound).max().item()
    assert (err <= bound).all(), f"{what}: error {err.max().item():.3g} exceeds the bound " \
                                 f"(worst ratio {worst:.3g})"
    return worst


def _assert_params_exact(params, ref_params, names, what=""):
    for k in names:
        assert torch.equal(params[k], ref_params[k]), \
            f"{what}{k} differs from one process's by {(params[k] - ref_params[k]).abs().max()}"


ALL_PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(RECIPES))
def test_tp_training_matches_one_process(tp_runs, reference, name):
    ref = reference[name]
    for rank_res in tp_runs:
        run = rank_res["tp"][name]
        _assert_params_exact(run["params"], ref["params"], ALL_PARAMS)
        assert run["state"].keys() == ref["state"].keys()
        for k, v in ref["state"].items():  # DelayedScaling: every buffer, amax history included
            assert torch.equal(run["state"][k], v), k
        for i, ops in enumerate(ref["ops"]):
            _assert_within(run["y"][i], ref["y"][i],
                           tp_bound(ops["h"], ops["w2"], ref["b2"][i]), f"y[{i}]")
            _assert_within(run["dx"][i], ref["dx"][i], tp_bound(ops["dy1"], ops["w1"].t()),
                           f"dx[{i}]")
    if name.startswith("delayed"):  # the weight is cast once per step, not per microbatch
        assert int(ref["state"]["0.fp8_state.weight.step"]) == STEPS


def _bias_bound(ref, i_step_end):
    """Bound on |b2_tp - b2_one| after the steps before microbatch i_step_end: per step the
    gradient (a sum over R rows, split over the ranks) is within 2 gamma_{R+w+2} sum|g| of one
    process's, and each update fl(b - lr G) rounds once (u |b|, on either side)."""
    bound = torch.zeros(D, dtype=torch.float64)
    for step in range(i_step_end // MICRO):
        g_abs = sum(batch(step, m)[1].abs().double().sum((0, 1)) for m in range(MICRO))
        b_after = ref["b2"][(step + 1) * MICRO].double().abs() \
            if (step + 1) * MICRO < len(ref["b2"]) else ref["params"]["2.bias"].double().abs()
        bound += LR * 2 * gamma(MICRO * B * S + WORLD + 2) * g_abs + 3 * U * b_after
    return bound


@pytest.mark.parametrize("name", [*RECIPES, "current_local_input"])
def test_sequence_parallel_matches_one_process(tp_runs, reference, name):
    ref = reference[name.replace("_local_input", "")]
    runs = [r["sp"][name] for r in tp_runs]
    # the colwise layer reads the all-gathered input (FP8 with current scaling): exact
    for run in runs:
        _assert_params_exact(run["params"], ref["params"], ("0.weight", "0.bias", "2.weight"))
        for k, v in ref["state"].items():
            assert torch.equal(run["state"][k], v), k
    # the rowwise bias's gradient sums the ranks' sequence shards
    b2 = runs[0]["params"]["2.bias"]
    _assert_within(b2, ref["params"]["2.bias"], _bias_bound(ref, STEPS * MICRO), "bias")
    for i, ops in enumerate(ref["ops"]):
        y = torch.cat([run["y"][i] for run in runs], 1)
        dx = torch.cat([run["dx"][i] for run in runs], 1)
        # y's bias is the TP run's own: its difference is bounded above
        shift = (runs[0]["b2"][i] - ref["b2"][i]).double().abs()
        _assert_within(y, ref["y"][i], tp_bound(ops["h"], ops["w2"], ref["b2"][i]) + shift,
                       f"y[{i}]")
        _assert_within(dx, ref["dx"][i], tp_bound(ops["dy1"], ops["w1"].t()), f"dx[{i}]")


def test_sequence_parallel_gathers_in_fp8_with_current_scaling(tp_runs):
    n = STEPS * MICRO
    for r in tp_runs:
        # one FP8 all-gather per forward with current scaling, read by the colwise layer's GEMMs;
        # high precision with the other recipes
        assert r["fp8_gathers"] == {
            **{name: {"gathers": 0, "reads": 0} for name in RECIPES},
            "current": {"gathers": n, "reads": n},
            "current_local_input": {"gathers": n, "reads": n}}


def test_bound_catches_missing_amax_all_reduce(tp_runs, reference):
    """Ranks scaling their shards with their own amax: the first step's y (same weights and
    inputs as one process) already leaves the bound, and training diverges."""
    ref, run = reference["current"], tp_runs[0]["lost_amax"]
    ops = ref["ops"][0]
    err = (run["y"][0] - ref["y"][0]).double().abs()
    assert (err / tp_bound(ops["h"], ops["w2"], ref["b2"][0])).max() > 10
    assert not torch.equal(run["params"]["0.weight"], ref["params"]["0.weight"])


def test_weight_cast_follows_manual_updates(tp_runs, reference_manual):
    """Updates through p.data change no version counter of a DTensor: the gradient dropped
    after them must still end the cached weight cast, as it does for a plain weight."""
    for r in tp_runs:
        _assert_params_exact(r["manual"]["params"], reference_manual["params"], ALL_PARAMS)
        for k, v in reference_manual["state"].items():
            assert torch.equal(r["manual"]["state"][k], v), k


def test_errors(tp_runs):
    errors = tp_runs[0]["errors"]
    kind, msg = errors["nn_linear"]
    assert kind == "TypeError" and "FP8Linear" in msg and "convert_to_fp8" in msg
    kind, msg = errors["mx_colwise"]
    assert kind == "ValueError" and "out_features = 96" in msg and "multiple of 32" in msg
    kind, msg = errors["blockwise_rowwise"]
    assert kind == "ValueError" and "in_features = 128" in msg and "multiple of 128" in msg
    assert errors["per_tensor_any_cut"] is None  # one scale per tensor: any cut
    assert errors["shard_scales_roles"] == {0: ["grad", "weight"], 1: ["input", "weight"]}
    kind, msg = errors["shard_scales_block"]
    assert kind == "ValueError" and msg.startswith("a framework's sharding") and "32" in msg
    kind, msg = errors["percentile"]
    assert kind == "ValueError" and "percentile" in msg
    kind, msg = errors["mesh_2d"]
    assert kind == "ValueError" and "1-D" in msg
    kind, msg = errors["twice"]
    assert kind == "ValueError" and "DTensor already" in msg
    kind, msg = errors["recipe_changed"]
    assert kind == "RuntimeError" and "before parallelizing" in msg
    kind, msg = errors["prepare_no_fp8"]
    assert kind == "ValueError" and "no FP8Linear" in msg
    kind, msg = errors["prepare_mixed"]
    assert kind == "ValueError" and "fp8_module" in msg


def test_fsdp2_over_tp_matches_one_process(reference):
    runs = spawn(_fsdp_tp_worker, world=4)
    for name in ("current", "delayed", "mxfp8", "blockwise"):
        ref = reference[name]
        for rank_res in runs:
            run = rank_res[name]
            _assert_params_exact(run["params"], ref["params"], ALL_PARAMS, f"{name}: ")
            for k, v in ref["state"].items():
                assert torch.equal(run["state"][k], v), f"{name}: {k}"
            for i, ops in enumerate(ref["ops"]):
                _assert_within(run["y"][i], ref["y"][i],
                               tp_bound(ops["h"], ops["w2"], ref["b2"][i]), f"y[{i}]")


def test_one_amax_all_reduce_per_step(tp_runs):
    """DelayedScaling under TP: every cast records on its rank (sharded tensors too) and one
    all-reduce at the end of the backward pass folds the records of both layers (two when the
    recipe's process group leaves out the other shards: one over it, one over the TP mesh);
    every buffer then agrees across ranks. Current scaling all-reduces each sharded amax before
    its cast: it cannot wait."""
    for rank_res in tp_runs:
        counts = rank_res["all_reduces"]
        assert counts["delayed"] == (1, True), counts
        assert counts["delayed_own_group"] == (2, True), counts
        assert counts["current"][0] > 2, counts


def test_import_does_not_load_dtensor(tp_runs):
    assert not any(r["dtensor_after_import"] for r in tp_runs)
    assert fp8ops.FP8ColwiseParallel.__module__ == "fp8ops.distributed.tensor_parallel"
    assert {"FP8ColwiseParallel", "FP8RowwiseParallel", "PrepareFP8ModuleInput"} <= \
        set(fp8ops.__all__)
