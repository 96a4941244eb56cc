"""Recipes and the delayed-scaling state machine (docs/design.md, "Scaling recipes";
docs/numerics.md, "Delayed scaling state machine")."""
import math

import numpy as np
import pytest
import torch

import fp8ops
from fp8ops.scaling import RoleState, current_scale

FLT_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("make, match", [
    (lambda: fp8ops.DelayedScaling(amax_history_len=0), "amax_history_len"),
    (lambda: fp8ops.DelayedScaling(amax_history_len=4096), "amax_history_len"),
    (lambda: fp8ops.DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
    (lambda: fp8ops.DelayedScaling(interval=0), "interval"),
    (lambda: fp8ops.DelayedScaling(margin=0.0), "margin"),
    (lambda: fp8ops.DelayedScaling(fwd_fmt="e3m4"), "unknown FP8 format"),
    (lambda: fp8ops.DelayedScaling(percentile=0), "percentile"),
    (lambda: fp8ops.CurrentScaling(grad_rounding="up"), "grad_rounding"),
    (lambda: fp8ops.MXFP8Scaling(scale_mode="round"), "scale_mode"),
    (lambda: fp8ops.BlockwiseScaling(bwd_fmt="int8"), "unknown FP8 format"),
])
def test_recipe_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make, err, match", [
    (lambda: fp8ops.DelayedScaling(amax_history_len=2.5), TypeError, "amax_history_len"),
    (lambda: fp8ops.DelayedScaling(interval=1.5), TypeError, "interval"),
    (lambda: fp8ops.DelayedScaling(interval=True), TypeError, "interval"),
    (lambda: fp8ops.DelayedScaling(seed=0.5), TypeError, "seed"),
    (lambda: fp8ops.CurrentScaling(seed=2**64), ValueError, "seed"),
    (lambda: fp8ops.MXFP8Scaling(block_size=32.0), TypeError, "block_size"),
    (lambda: fp8ops.DelayedScaling(margin=1e-50), ValueError, "margin"),  # 0 in float32
    (lambda: fp8ops.CurrentScaling(margin=1e39), ValueError, "margin"),  # inf in float32
    (lambda: fp8ops.CurrentScaling(margin=float("nan")), ValueError, "margin"),
    (lambda: fp8ops.CurrentScaling(margin="2"), TypeError, "margin"),
    (lambda: fp8ops.CurrentScaling(amax_percentile=True), TypeError, "amax_percentile"),
    (lambda: fp8ops.CurrentScaling(amax_percentile="99"), TypeError, "amax_percentile"),
    (lambda: fp8ops.CurrentScaling(amax_percentile=float("nan")), ValueError, "amax_percentile"),
    (lambda: fp8ops.DelayedScaling(percentile=True), TypeError, "percentile"),
    (lambda: fp8ops.DelayedScaling(ema_alpha=True), TypeError, "ema_alpha"),
    (lambda: fp8ops.DelayedScaling(ema_alpha="0.1"), TypeError, "ema_alpha"),
])
def test_recipe_fields_of_the_wrong_kind_are_named(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_recipes_are_frozen_and_comparable():
    r = fp8ops.DelayedScaling(margin=2.0)
    with pytest.raises(Exception):
        r.margin = 3.0
    assert r == fp8ops.DelayedScaling(margin=2.0) and hash(r) == hash(fp8ops.DelayedScaling(margin=2.0))


@pytest.mark.parametrize("amax, margin, p2, expected", [
    (2.0, 1.0, False, 224.0),
    (3.0, 2.0, False, np.float32(448.0) / np.float32(6.0)),
    (3.0, 1.0, True, 128.0),  # 149.33 rounds down to a power of two
    (0.0, 1.0, False, 1.0),
    (float("inf"), 1.0, False, 1.0),
    (float("nan"), 1.0, False, 1.0),
    (1e-45, 1.0, False, FLT_MAX),  # 448 / subnormal overflows: float32 max
    (3e38, 4.0, False, float(np.finfo(np.float32).tiny)),  # amax * margin overflows
])
def test_current_scale_rules(amax, margin, p2, expected):
    got = current_scale(torch.tensor(amax), "e4m3", margin, p2)
    assert got.dtype == torch.float32 and got.item() == float(np.float32(expected))


def _ref_rep(history, algo, n_updates, ema_prev, alpha=0.1, pct=90.0):
    if algo == "max":
        return max(history)
    if algo == "most_recent":
        return history[0]
    if algo == "ema":
        if n_updates <= 1:
            return history[0]
        return float(np.float32(alpha) * np.float32(history[0])
                     + np.float32(1 - alpha) * np.float32(ema_prev))
    n = max(1, min(n_updates, len(history)))
    filled = sorted(history)[len(history) - n:]
    return filled[max(1, min(len(history), math.ceil(pct / 100 * n))) - 1]


@pytest.mark.parametrize("algo", ["max", "most_recent", "ema", "percentile"])
@pytest.mark.parametrize("interval", [1, 3])
def test_delayed_update_against_python_model(algo, interval):
    recipe = fp8ops.DelayedScaling(amax_history_len=4, amax_compute_algo=algo, interval=interval,
                                   margin=1.5, percentile=90.0)
    role = RoleState(4)
    hist, rep, pending, scale = [0.0] * 4, 0.0, 0.0, 1.0
    rng = np.random.default_rng(0)
    for step in range(1, 15):
        role.update(recipe, "e4m3")
        if step % interval == 0:
            hist = [pending] + hist[:-1]
            rep = _ref_rep(hist, algo, step // interval, rep)
            pending = 0.0
            if rep > 0:
                scale = float(np.float32(448.0) / (np.float32(rep) * np.float32(1.5)))
        assert role.amax_history.tolist() == pytest.approx(hist, abs=0), step
        assert role.amax_rep.item() == pytest.approx(rep, rel=1e-6)
        assert role.scale.item() == pytest.approx(scale, rel=1e-6)
        assert role.scale_inv.item() == float(np.float32(1) / np.float32(role.scale.item()))
        amax = float(np.float32(rng.uniform(0.5, 20)))
        role.record(torch.tensor(amax))
        pending = max(pending, amax)
        assert role.pending_amax.item() == pending


def test_nonfinite_amax_never_enters_history_and_is_counted():
    recipe = fp8ops.DelayedScaling(amax_history_len=3)
    role = RoleState(3)
    role.record(torch.tensor(5.0))
    role.record(torch.tensor(float("inf")))
    role.record(torch.tensor(float("nan")))
    assert role.nonfinite_count.item() == 2 and role.pending_amax.item() == 5.0
    role.update(recipe, "e4m3")
    assert role.amax_history.tolist() == [5.0, 0.0, 0.0]
    assert role.scale.item() == float(np.float32(448) / np.float32(5))


def test_zero_amax_keeps_the_scale():
    recipe = fp8ops.DelayedScaling(amax_history_len=1)
    role = RoleState(1)
    role.record(torch.tensor(2.0))
    role.update(recipe, "e5m2")
    before = role.scale.clone()
    role.record(torch.tensor(0.0))
    role.update(recipe, "e5m2")
    assert torch.equal(role.scale, before) and role.amax_history.item() == 0.0


def test_update_needs_no_host_sync():
    recipe = fp8ops.DelayedScaling(amax_history_len=8, amax_compute_algo="percentile")
    role = RoleState(8)
    # torch.compile with fullgraph fails on any .item() / data-dependent branch
    step = torch.compile(lambda r: r.update(recipe, "e4m3"), fullgraph=True, backend="eager")
    role.record(torch.tensor(3.0))
    step(role)
    assert role.amax_history[0].item() == 3.0


def test_scaling_state_state_dict_roundtrip():
    recipe = fp8ops.DelayedScaling(amax_history_len=5, grad_rounding="stochastic", seed=7)
    st = fp8ops.ScalingState(recipe)
    for v in (1.0, 4.0, 2.0):
        st.input.record(torch.tensor(v))
        st.input.update(recipe, "e4m3")
    st.rng_offset += 1  # as one stochastic cast advances it
    sd = st.state_dict()
    fresh = fp8ops.ScalingState(recipe)
    fresh.load_state_dict(sd)
    for (k, a), (k2, b) in zip(st.state_dict().items(), fresh.state_dict().items()):
        assert k == k2
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), k
    assert (fresh.rng_seed, fresh.rng_offset) == (7, 1)


def test_the_random_stream_lives_in_the_rng_buffer():
    """seed and offset are the `rng` buffer itself (a stochastic cast advances it on the
    device); the Python names read and write it, and refuse what an int64 cannot hold."""
    st = fp8ops.ScalingState(fp8ops.CurrentScaling(grad_rounding="stochastic", seed=-3))
    assert st.rng.tolist() == [-3, 0] and (st.rng_seed, st.rng_offset) == (-3, 0)
    st.rng_offset = 2 ** 40
    assert st.rng.tolist() == [-3, 2 ** 40]
    with pytest.raises(ValueError, match="int64"):
        st.rng_offset = 2 ** 63
    with pytest.raises(TypeError, match="rng_seed"):
        st.rng_seed = 1.5
    st.reset()
    assert st.rng.tolist() == [-3, 0]


def _pair(seed=0):
    torch.manual_seed(seed)
    delayed = fp8ops.FP8Linear(64, 32, recipe=fp8ops.DelayedScaling())
    current = fp8ops.FP8Linear(64, 32, recipe=fp8ops.CurrentScaling())
    current.load_state_dict(fp8ops.plain_state_dict(delayed))
    return delayed, current


def test_delayed_scaling_warm_start_in_eval_casts_as_current_scaling():
    """Right after conversion, before any training forward, every cast takes the tensor's own
    amax: not the initial scale 1.0."""
    delayed, current = _pair()
    delayed.eval(), current.eval()
    for i in range(3):
        x = torch.randn(8, 64) * 10.0 ** (i - 1)
        assert torch.equal(delayed(x), current(x)), i
    assert int(delayed.fp8_state.input.step) == 0  # eval records nothing


def test_delayed_scaling_first_training_step_is_current_scaling():
    """The first cast of each role (input, weight, and the gradient in backward) is warm."""
    delayed, current = _pair(1)
    x = torch.randn(16, 64) * 100
    dy = torch.randn(16, 32) * 1e-4  # small gradients: the initial scale 1 would flush them
    outs = []
    for layer in (delayed, current):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        outs.append((y, xi.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert (outs[0][1] != 0).float().mean() > 0.99  # the input gradient was not flushed
    assert delayed.fp8_state.input.started and delayed.fp8_state.grad.started


def test_an_older_pickle_with_python_rng_ints_loads_into_the_buffer():
    """States pickled when seed and offset were Python attributes (the buffer a copy made at
    save) unpickle with those values in the buffer."""
    st = fp8ops.ScalingState(fp8ops.CurrentScaling(grad_rounding="stochastic", seed=5))
    old = dict(st.__getstate__())
    old["_buffers"] = {k: v for k, v in old["_buffers"].items() if k != "rng"}
    old["rng_seed"], old["rng_offset"] = 5, 9
    new = fp8ops.ScalingState.__new__(fp8ops.ScalingState)
    new.__setstate__(old)
    assert new.rng.tolist() == [5, 9] and "rng" in new.state_dict()
