"""Delayed scaling of FP8GroupedLinear's experts under torch.distributed, on gloo with 2 CPU
processes: plain data parallel (gradients all-reduced by hand), DDP and FSDP2 (fully_shard, which
gathers delayed-scaling experts in high precision).

Each rank routes different tokens to the experts (rank r's scaled by 1 + 3r, so the ranks' amaxes
differ), an expert getting no tokens on one rank while the other routes some to it. The model is
a dense FP8Linear before two grouped layers, all with DelayedScaling. After every step every
rank's FP8 state must be the same, and the state of one process that ran the same layers on both
ranks' tokens together (sorted by expert); each rank's outputs must be that process's outputs for
its rows, bit for bit (the casts are per row with per-expert scales: rows are independent). That
process replays the weights the ranks trained with (their float32 gradient sums are not the one
process's). The records of the dense and the grouped layers are folded by one all-reduce per
backward pass."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fp8ops
from dist_spawn import spawn

WORLD = 2
EXPERTS = 4
STEPS = 4
# tokens per expert on each rank, rotated by one expert each step: each expert is empty on one
# rank only while the other routes tokens to it, and empty on both at some step
SIZES = ([3, 0, 5, 0], [4, 6, 0, 0])
MODES = ("data_parallel", "ddp", "fsdp2")


class Model(nn.Module):
    def __init__(self, recipe):
        super().__init__()
        self.proj = fp8ops.FP8Linear(32, 32, recipe=recipe)
        self.up = fp8ops.FP8GroupedLinear(EXPERTS, 32, 24, bias=True, recipe=recipe)
        self.down = fp8ops.FP8GroupedLinear(EXPERTS, 24, 16, recipe=recipe)

    def forward(self, x, offsets):
        return self.down(F.gelu(self.up(self.proj(x), offsets)), offsets)


def make_model(process_group=None):
    torch.manual_seed(0)
    return Model(fp8ops.DelayedScaling(amax_history_len=4, process_group=process_group))


def sizes(step, rank):
    return torch.tensor(SIZES[rank]).roll(step)


def local_batch(step, rank):
    """(x, offsets, dY) of rank's tokens, sorted by expert."""
    g = torch.Generator().manual_seed(100 * step + rank)
    rows = int(sizes(step, rank).sum())
    x = torch.randn(rows, 32, generator=g) * (1 + 3 * rank)
    return x, sizes(step, rank).cumsum(0).to(torch.int32), torch.randn(rows, 16, generator=g)


def union_batch(step):
    """Both ranks' tokens sorted by expert (an expert's rank-0 rows, then its rank-1 rows), and
    where each rank's rows went."""
    parts = [local_batch(step, r) for r in range(WORLD)]
    expert = torch.cat([torch.arange(EXPERTS).repeat_interleave(sizes(step, r))
                        for r in range(WORLD)])
    order = torch.argsort(expert, stable=True)
    where = torch.argsort(order).split([p[0].shape[0] for p in parts])
    x = torch.cat([p[0] for p in parts])[order]
    dy = torch.cat([p[2] for p in parts])[order]
    total = sum(sizes(step, r) for r in range(WORLD))
    return x, total.cumsum(0).to(torch.int32), dy, where


def fp8_states(model):
    """The FP8 state's buffers (weight_cast_scale left out: whether a cast waits for reuse depends
    on the optimizer, which the replay has none of)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if ".fp8_state." in k and not k.endswith("weight_cast_scale")}


def full_weights(model):
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in model.named_parameters()}


def _step(model, x, offsets, dy):
    y = model(x, offsets)
    (y * dy).sum().backward()  # the gradient of y is dy exactly
    return y.detach().clone()


# ---------------------------------------------------------------------------------------------
# the ranks
# ---------------------------------------------------------------------------------------------
def _shard(model):
    from torch.distributed.fsdp import fully_shard
    for layer in (model.proj, model.up, model.down):
        fully_shard(layer)
    return fully_shard(model)


def _train(mode, rank, counts):
    model = make_model()
    inner = model
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp2":
        model = _shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    res = {"weights": [], "outputs": [], "states": []}
    for step in range(STEPS + 1):
        res["weights"].append(full_weights(inner))
        x, offsets, dy = local_batch(step, rank)
        if step == STEPS and rank == 1:
            x[0, 0] = float("nan")  # expert 0 of rank 1 only: a non-finite amax
        before = len(counts)
        res["outputs"].append(_step(model, x, offsets, dy))
        res.setdefault("all_reduces", []).append(len(counts) - before)
        if mode == "data_parallel":
            for p in model.parameters():
                _real_all_reduce(p.grad)
                p.grad.div_(WORLD)
        opt.step()
        opt.zero_grad()
        res["states"].append(fp8_states(inner))
    return res


_real_all_reduce = dist.all_reduce


def _accumulate(model, steps=3, micro=2):
    """Two micro-batches a step, the same on every rank, no no_sync(): the states after it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        for m in range(micro):
            x, offsets, dy = local_batch(10 * step + m, 0)
            _step(model, x, offsets, dy / micro)
        opt.step()
        opt.zero_grad()


def _ddp_accum_worker(rank, out_dir):
    model = make_model()
    _accumulate(nn.parallel.DistributedDataParallel(model))
    return fp8_states(model)


def _mismatch(rank):
    """Ranks whose grouped layers have different recipes: the first collective raises."""
    group = dist.new_group(list(range(WORLD)))  # not yet checked by the runs before
    recipe = fp8ops.DelayedScaling(amax_history_len=4 if rank == 0 else 8, process_group=group)
    layer = fp8ops.FP8GroupedLinear(EXPERTS, 32, 16, recipe=recipe)
    x, offsets, dy = local_batch(0, rank)
    try:
        _step(layer, x, offsets, dy)
    except RuntimeError as e:
        return str(e)
    return None


def _worker(rank, out_dir):
    counts = []

    def counting(*args, **kwargs):  # fp8ops calls torch.distributed.all_reduce
        counts.append(kwargs.get("group"))
        return _real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    try:
        res = {mode: _train(mode, rank, counts) for mode in MODES}
    finally:
        dist.all_reduce = _real_all_reduce
    res["mismatch"] = _mismatch(rank)
    return res


# ---------------------------------------------------------------------------------------------
# one process on both ranks' tokens, with the weights the ranks had at each step
# ---------------------------------------------------------------------------------------------
def replay(weights):
    model = make_model()
    res = {"outputs": [], "states": [], "where": []}
    for step in range(STEPS):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[step][name])
        x, offsets, dy, where = union_batch(step)
        res["outputs"].append(_step(model, x, offsets, dy))
        res["where"].append(where)
        model.zero_grad()
        res["states"].append(fp8_states(model))
    return res


@pytest.fixture(scope="module")
def ranks():
    return spawn(_worker, world=WORLD)


@pytest.fixture(scope="module")
def single(ranks):
    """The replay on one thread, as the spawned ranks run, with FP8 at every shape."""
    from fp8ops.nn import fallback
    threads, measured = torch.get_num_threads(), fallback.MEASURED
    torch.set_num_threads(1)
    fallback.MEASURED = {}
    try:
        return {mode: replay(ranks[0][mode]["weights"]) for mode in MODES}
    finally:
        torch.set_num_threads(threads)
        fallback.MEASURED = measured


def _assert_states_equal(got, want, what):
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        assert torch.equal(got[k], v), (what, k, got[k], v)


def test_ddp_gradient_accumulation_steps_each_experts_weight_once_per_step():
    """DDP's in-place write of the all-reduced gradient at the end of each backward must not
    end the experts' cast's accumulation window (tests/test_distributed.py: the dense layer)."""
    model = make_model()
    _accumulate(model)
    want = fp8_states(model)
    for got in spawn(_ddp_accum_worker):
        assert torch.equal(got["up.fp8_state.weight.step"], torch.full((EXPERTS,), 3))
        _assert_states_equal(got, want, "DDP with accumulation")


def test_the_setup_routes_differently_on_each_rank():
    zero = [(sizes(s, 0) == 0) & (sizes(s, 1) > 0) for s in range(STEPS)]
    assert any(z.any() for z in zero)
    assert any(((sizes(s, 0) == 0) & (sizes(s, 1) == 0)).any() for s in range(STEPS))
    x0, x1 = local_batch(0, 0)[0], local_batch(0, 1)[0]
    assert x0.abs().max() < x1.abs().max()


@pytest.mark.parametrize("mode", MODES)
def test_ranks_keep_identical_expert_states(ranks, mode):
    a, b = (res[mode] for res in ranks)
    for step, (sa, sb) in enumerate(zip(a["states"], b["states"])):
        _assert_states_equal(sa, sb, (mode, step))
        assert any(k.startswith("up.fp8_state.input.") for k in sa)
    for k in a["weights"][0]:
        assert torch.equal(a["weights"][-1][k], b["weights"][-1][k]), k


@pytest.mark.parametrize("mode", MODES)
def test_expert_states_are_those_of_one_process_on_all_tokens(ranks, single, mode):
    for step in range(STEPS):
        for rank, res in enumerate(ranks):
            _assert_states_equal(res[mode]["states"][step], single[mode]["states"][step],
                                 (mode, rank, step))
    # the states moved: every expert that saw tokens stepped, with a non-trivial scale
    last = single[mode]["states"][-1]
    assert torch.equal(last["up.fp8_state.input.step"], torch.full((EXPERTS,), STEPS))
    assert (last["up.fp8_state.input.scale"] != 1).all()


@pytest.mark.parametrize("mode", MODES)
def test_each_rank_outputs_its_rows_of_the_one_process_bit_for_bit(ranks, single, mode):
    for step in range(STEPS):
        want, where = single[mode]["outputs"][step], single[mode]["where"][step]
        for rank, res in enumerate(ranks):
            got = res[mode]["outputs"][step]
            assert torch.equal(got, want[where[rank]]), (mode, rank, step)


@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_amax_on_one_rank_is_counted_on_every_rank(ranks, mode):
    a, b = (res[mode]["states"][STEPS] for res in ranks)
    _assert_states_equal(a, b, (mode, "nan"))
    assert a["up.fp8_state.input.nonfinite_count"].tolist() == [1, 0, 0, 0]


def test_one_all_reduce_per_backward_for_dense_and_grouped_layers(ranks):
    for res in ranks:
        counts = res["data_parallel"]["all_reduces"]
        assert counts[0] > 1  # the warm start: each role's first amaxes, over the ranks
        assert counts[1:] == [1] * STEPS, counts


def test_different_recipes_raise_naming_both(ranks):
    for rank, res in enumerate(ranks):
        text = res["mismatch"]
        assert text is not None and "different FP8 recipes" in text, text
        assert "amax_history_len=4" in text and "amax_history_len=8" in text
