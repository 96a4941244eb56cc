"""The cached FP8 weight: reused inside an accumulation window, never stale, never shared.

Every way a user can change a weight must reach the next forward: torch.optim, a manual
`p.data.add_()`, `p.copy_()` under no_grad, another model's optimizer (must NOT matter), threads.
A forward whose cast is fresh gives the same bytes as a forward through a copy of the layer's
state with no cached cast at all: that is the check used throughout.
"""
import contextlib
import copy
import gc
import threading

import pytest
import torch
from torch import nn

import fp8ops
from fp8ops.scaling import WeightCache
from fp8ops.scaling import state as scaling_state

RECIPES = [fp8ops.CurrentScaling(), fp8ops.DelayedScaling(amax_history_len=4),
           fp8ops.CurrentScaling(grad_rounding="stochastic"), fp8ops.MXFP8Scaling(),
           fp8ops.BlockwiseScaling()]
IDS = ["current", "delayed", "stochastic", "mxfp8", "blockwise"]


def _mlp(recipe, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    return fp8ops.convert_to_fp8(model, recipe)


def _fresh_output(layer, x):
    """layer(x) as a layer with the same state but no cached weight cast computes it."""
    state = copy.deepcopy(layer.fp8_state)
    state.weight_cache.invalidate()
    state.recording = layer.training
    return fp8ops.linear(x, layer.weight, layer.bias, state=state)


def _assert_fresh(layer, x):
    expect = _fresh_output(layer, x)
    assert torch.equal(layer(x), expect)


def _assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def _data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return x, torch.sin(x[:, :1] * 2) + x[:, 1:2] * 0.5


@pytest.mark.parametrize("zero", ["set_to_none", "zero_"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_manual_sgd_through_p_data_trains(recipe, zero):
    x, y = _data()
    losses = {}
    for name, model in (("fp8", _mlp(recipe)), ("fp32", _mlp(recipe))):
        if name == "fp32":
            model = fp8ops.convert_from_fp8(model)
        out = []
        for _ in range(30):
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)  # no version bump
                if zero == "zero_":
                    p.grad.zero_()
                else:
                    p.grad = None
            out.append(loss.item())
        losses[name] = out
    fp8, fp32 = losses["fp8"], losses["fp32"]
    assert fp32[-1] < 0.5 * fp32[0]
    assert abs(fp8[-1] - fp32[-1]) < 0.1 * fp32[0], (fp8[-1], fp32[-1])


@pytest.mark.parametrize("how", ["p.data.add_", "p.data.copy_", "no_grad copy_",
                                 "no_grad mul_", "set p.data"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_every_way_of_writing_the_weight_reaches_the_next_forward(recipe, how):
    layer = fp8ops.FP8Linear(32, 16, recipe=recipe)
    x = torch.randn(8, 32)
    layer(x).sum().backward()  # the gradient now vouches for the cast ...
    new = torch.randn(16, 32)
    w = layer.weight
    if how == "p.data.add_":
        w.data.add_(new)
    elif how == "p.data.copy_":
        w.data.copy_(new)
    elif how == "set p.data":
        w.data = new
    else:
        with torch.no_grad():
            w.copy_(new) if how == "no_grad copy_" else w.mul_(2)
    layer.weight.grad = None  # ... until the update's loop zeroes it
    _assert_fresh(layer, x)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_accumulation_casts_the_weight_once_per_window(recipe):
    """Inside a window the cached cast is reused: the same FP8 weight tensor object. Before the
    optimizer's first step nothing says one holds the weight: every micro-batch casts (with the
    window's scale: delayed scaling steps its weight role once per window either way)."""
    layer = fp8ops.FP8Linear(32, 16, recipe=recipe)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    for window in range(3):
        payloads = []
        for _ in range(3):
            layer(x).sum().backward()
            payloads.append(layer.fp8_state.weight_cache.entry.payload)
        if window == 0:
            assert payloads[1] is not payloads[0] and payloads[2] is not payloads[1]
        else:
            assert payloads[1] is payloads[0] and payloads[2] is payloads[0]
        opt.step()
        opt.zero_grad()
    if isinstance(recipe, fp8ops.DelayedScaling):
        assert int(layer.fp8_state.weight.step) == 3  # once per window


def test_eval_after_a_weight_swap_is_fresh():
    """The EMA pattern: swap weights in through p.data for evaluation, then back."""
    layer = fp8ops.FP8Linear(32, 16, recipe=fp8ops.DelayedScaling())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    layer(x).sum().backward()
    opt.step()
    ema = layer.weight.detach() * 0.5
    saved = layer.weight.detach().clone()
    layer.eval()
    layer(x)
    layer.weight.data.copy_(ema)
    _assert_fresh(layer, x)
    layer.weight.data.copy_(saved)
    _assert_fresh(layer, x)
    layer.train()
    _assert_fresh(layer, x)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_another_models_optimizer_does_not_touch_this_model(recipe):
    """Model B accumulates microbatches while model A steps its own optimizer."""
    xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def run_b(with_a):
        a, b = _mlp(recipe, 1), _mlp(recipe, 2)
        opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (a, b))
        outs = []
        for i, x in enumerate(xs):
            if with_a:
                a(x).pow(2).mean().backward()
                opt_a.step()
                opt_a.zero_grad()
            out = b(x)
            out.pow(2).mean().backward()
            outs.append(out.detach())
            if i % 3 == 2:
                opt_b.step()
                opt_b.zero_grad()
        return outs, b.state_dict()

    alone, alone_state = run_b(False)
    beside, beside_state = run_b(True)
    for u, v in zip(alone, beside):
        assert torch.equal(u, v)
    _assert_same(alone_state, beside_state)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_frozen_model_beside_a_training_one(recipe):
    xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def frozen_outputs(with_other):
        frozen, other = _mlp(recipe, 3), _mlp(recipe, 4)
        frozen.requires_grad_(False)
        opt = torch.optim.SGD(other.parameters(), lr=0.1)
        outs = []
        for x in xs:
            outs.append(frozen(x))
            if with_other:
                other(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return outs

    for u, v in zip(frozen_outputs(False), frozen_outputs(True)):
        assert torch.equal(u, v)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_threads_training_their_own_models_match_sequential_runs(recipe):
    # built here: the global RNG of torch.manual_seed must not be shared by running threads
    models = {(kind, seed): _mlp(recipe, seed) for kind in ("seq", "thr") for seed in (5, 6)}

    def train(kind, seed, out):
        model = models[kind, seed]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = _data(seed=seed)
        losses = []
        for _ in range(8):
            for half in (x[:32], x[32:]):
                loss = (model(half) - y[:len(half)]).pow(2).mean()
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[seed] = losses

    sequential, threaded = {}, {}
    for seed in (5, 6):
        train("seq", seed, sequential)
    threads = [threading.Thread(target=train, args=("thr", seed, threaded)) for seed in (5, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert threaded == sequential


def test_cuda_graph_capture_never_reuses_a_cast_from_the_host(monkeypatch):
    """Under capture the cast is recorded into the graph (replays read the weight's memory).
    Capture is simulated on the CPU through the Python path's check; the C++ step asks CUDA
    itself, and tests/test_step_gpu.py captures it for real."""
    layer = fp8ops.FP8Linear(32, 16)
    layer.cpp_step = False
    x = torch.randn(8, 32)
    layer(x).sum().backward()
    cached = layer.fp8_state.weight_cache.entry
    monkeypatch.setattr(scaling_state, "_capturing", lambda w: True)
    layer(x).sum().backward()
    assert layer.fp8_state.weight_cache.entry.payload is cached.payload  # captured casts: not kept
    calls = []
    monkeypatch.setattr(WeightCache, "lookup", lambda *a, **k: calls.append(a))
    layer(x)
    assert not calls


class _FakeStream:
    def __init__(self, name, capturing=False):
        self.name, self.waited, self.capturing = name, [], capturing

    def wait_stream(self, other):
        self.waited.append(other.name)


def test_follow_stream_orders_a_state_after_its_last_stream(monkeypatch):
    """The host-side logic of ScalingState.follow_stream (the GPU test runs it for real): a
    state used on a new stream makes that stream wait for the last one, and marks the cached
    cast's tensors as used by it; the same stream again waits for nothing. A stream capturing a
    CUDA graph waits only for a stream in the same capture (a wait on one outside it is an
    error; torch.cuda.graph synchronized the device before capturing)."""
    layer = fp8ops.FP8Linear(32, 16)
    layer(torch.randn(4, 32)).sum().backward()
    state = layer.fp8_state
    current = {"s": _FakeStream("a")}
    recorded = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["s"])
    monkeypatch.setattr(scaling_state, "_stream_key", lambda device: current["s"].name)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current["s"].capturing)

    @contextlib.contextmanager
    def on(stream):
        saved, current["s"] = current["s"], stream
        try:
            yield
        finally:
            current["s"] = saved
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: recorded.append((t.data_ptr(), s.name)))
    cuda = torch.device("cuda")
    state.follow_stream(cuda)
    assert current["s"].waited == [] and recorded == []  # the first use: nothing to wait for
    state.follow_stream(cuda)
    assert current["s"].waited == []
    a, current["s"] = current["s"], _FakeStream("b")
    state.follow_stream(cuda)
    assert current["s"].waited == ["a"]
    payload = state.weight_cache.payload_tensors()
    assert sorted(recorded) == sorted((t.data_ptr(), "b") for t in payload)
    state.follow_stream(torch.device("cpu"))  # no streams on the CPU
    assert current["s"].waited == ["a"]
    current["s"] = _FakeStream("capture", capturing=True)  # b is not part of the capture
    state.follow_stream(cuda)
    assert current["s"].waited == []
    current["s"] = _FakeStream("capture side", capturing=True)  # forked inside the capture
    state.follow_stream(cuda)
    assert current["s"].waited == ["capture"]


# ---------------------------------------------------------------------------------------------
# Every way a training loop can change a weight, in both loop orders: every forward after the
# change computes what the same layer with no cached cast computes.
# ---------------------------------------------------------------------------------------------
ORDERS = ["zero_grad before forward", "zero_grad before backward"]
LR = 0.05


def _fp8_layers(model):
    return [m for m in model.modules() if isinstance(m, fp8ops.FP8Linear)]


@contextlib.contextmanager
def _every_forward_fresh(model):
    """Each FP8 layer's output must equal the one computed from a copy of its state with no
    cached cast (nn.Linear's where the call falls back), taken right before the forward."""
    expected = {}

    def before(layer, args):
        x = args[0]
        with torch.no_grad():
            if layer._runs_fp8(x, layer.weight):
                expected[layer] = _fresh_output(layer, x)
            else:
                expected[layer] = torch.nn.functional.linear(x, layer.weight, layer.bias)

    def after(layer, args, out):
        assert torch.equal(out, expected.pop(layer)), "a stale FP8 weight cast was reused"

    handles = [h for layer in _fp8_layers(model)
               for h in (layer.register_forward_pre_hook(before),
                         layer.register_forward_hook(after))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _sgd_step(params):
    return [p.detach() - LR * p.grad for p in params]


def _p_data_add(model, step):
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-LR)


def _p_data_assign(model, step):
    for p in model.parameters():
        p.data = p.data - LR * p.grad


def _no_grad_in_place(model, step):
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(LR * p.grad)


def _no_grad_copy(model, step):
    with torch.no_grad():
        for p, new in zip(model.parameters(), _sgd_step(model.parameters())):
            p.copy_(new)


def _vector_to_parameters(model, step):
    params = list(model.parameters())
    vec = torch.nn.utils.parameters_to_vector(_sgd_step(params))
    torch.nn.utils.vector_to_parameters(vec, params)


def _new_parameter(model, step):
    for layer in _fp8_layers(model):
        layer.weight = nn.Parameter(layer.weight.detach() - LR * layer.weight.grad)


UPDATES = {"p.data.add_": _p_data_add, "p.data = ...": _p_data_assign,
           "no_grad in-place": _no_grad_in_place, "no_grad copy_": _no_grad_copy,
           "vector_to_parameters": _vector_to_parameters, "new Parameter": _new_parameter}


def _loop(model, update, order, steps=3, micro=1, between=None):
    """A hand-written training loop: `micro` micro-batches per step, `update(model, step)` after
    them, between(model, step, i) after each micro-batch's backward but the last."""
    x, y = _data()
    for step in range(steps):
        if order == ORDERS[0]:
            model.zero_grad()
        for i in range(micro):
            out = model(x)
            if order == ORDERS[1] and i == 0:
                model.zero_grad()
            (out - y).pow(2).mean().backward()
            if between is not None and i < micro - 1:
                between(model, step, i)
        update(model, step)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("how", list(UPDATES))
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_every_update_of_a_hand_written_loop_reaches_the_next_forward(recipe, how, order):
    model = _mlp(recipe)
    with _every_forward_fresh(model):
        _loop(model, UPDATES[how], order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_manual_loop_in_either_order_trains_as_float32_does(recipe, order):
    """Forward, zero_grad (before the forward or before the backward), backward, p.data update:
    the loss falls as float32's does."""
    x, y = _data()
    final = {}
    for name in ("fp8", "fp32"):
        model = _mlp(recipe)
        if name == "fp32":
            model = fp8ops.convert_from_fp8(model)
        for _ in range(30):
            if order == ORDERS[0]:
                model.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            if order == ORDERS[1]:
                model.zero_grad()
            loss.backward()
            _p_data_add(model, 0)
        final[name] = loss.item()
    assert final["fp32"] < 0.5 * (y.pow(2).mean().item())
    assert final["fp8"] < 1.5 * final["fp32"], final


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_optimizer_over_some_layers_only(recipe, order):
    """The optimizer steps the first layer; the second is updated by hand through p.data."""
    model = _mlp(recipe)
    first, second = _fp8_layers(model)
    opt = torch.optim.SGD(first.parameters(), lr=LR)

    def update(model, step):
        opt.step()
        for p in second.parameters():
            p.data.add_(p.grad, alpha=-LR)

    with _every_forward_fresh(model):
        _loop(model, update, order, steps=4)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_tied_weights_updated_by_hand(recipe, order):
    """Two FP8 layers share one Parameter (tied weights), updated through p.data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 1))
    model[2].weight = model[0].weight
    fp8ops.convert_to_fp8(model, recipe)
    assert model[0].weight is model[2].weight
    with _every_forward_fresh(model):
        _loop(model, _p_data_add, order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_ema_swap_for_evaluation(recipe, order):
    """An optimizer trains; after each step the EMA weights are copied in through p.data for an
    evaluation forward, and the trained weights copied back (diffusers' EMAModel does so)."""
    model = _mlp(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ema = [p.detach().clone() for p in model.parameters()]
    x, _ = _data()

    def update(model, step):
        opt.step()
        for e, p in zip(ema, model.parameters()):
            e.mul_(0.5).add_(p.detach(), alpha=0.5)
        trained = [p.detach().clone() for p in model.parameters()]
        for p, e in zip(model.parameters(), ema):
            p.data.copy_(e)
        model.eval()
        model(x)
        model.train()
        for p, t in zip(model.parameters(), trained):
            p.data.copy_(t)

    with _every_forward_fresh(model):
        _loop(model, update, order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_load_state_dict_mid_accumulation(recipe, order):
    """Another model's weights loaded between two micro-batches of one step."""
    model, other = _mlp(recipe), _mlp(recipe, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    source = {k: v for k, v in other.state_dict().items() if "fp8_state" not in k}

    def load(model, step, i):
        model.load_state_dict(source, strict=False)

    with _every_forward_fresh(model):
        _loop(model, lambda m, s: opt.step(), order, micro=2, between=load)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_fallback_micro_batch_does_not_revive_a_stale_cast(recipe, order):
    """p.data update and p.grad = None (a window's end), then a micro-batch small enough to
    fall back to F.linear (its backward writes weight.grad), then an FP8 micro-batch."""
    model = fp8ops.convert_to_fp8(_mlp(recipe), recipe,
                                  fallback=fp8ops.Crossover(min_tokens=16))
    x, y = _data()
    with _every_forward_fresh(model):
        for step in range(3):
            if order == ORDERS[0]:
                model.zero_grad(set_to_none=True)
            out = model(x)
            if order == ORDERS[1]:
                model.zero_grad(set_to_none=True)
            (out - y).pow(2).mean().backward()
            _p_data_add(model, step)
            model.zero_grad(set_to_none=True)
            (model(x[:4]) - y[:4]).pow(2).mean().backward()  # falls back


@pytest.mark.parametrize("recipe", [fp8ops.CurrentScaling()], ids=["current"])
def test_a_new_storage_is_cast_with_its_own_amax(recipe):
    """Current scaling: p.data = 3 * W is cast from its own amax, not the last cast's scale."""
    layer = fp8ops.FP8Linear(32, 16, recipe=recipe)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    x = torch.randn(8, 32)
    for _ in range(2):  # the optimizer holds the weight: its casts may be reused
        layer(x).sum().backward()
        opt.step()
    layer(x).sum().backward()
    layer.weight.data = 3 * layer.weight.data
    _assert_fresh(layer, x)


@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[1], RECIPES[4]],
                         ids=["current", "delayed", "blockwise"])
def test_a_new_storage_at_the_old_address_is_not_taken_for_the_old_one(recipe):
    """`p.data = new` keeps the version counter: were the old storage freed, the allocator
    could hand its address to the new one and the key would match. Mid-window, with an
    optimizer holding the weight, over many trials (the allocator reused the address in about
    half of them before the cache kept the storage its cast was made from)."""
    x = torch.randn(8, 32)
    for trial in range(10):
        torch.manual_seed(trial)
        layer = fp8ops.FP8Linear(32, 48, recipe=recipe)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        for i in range(3):
            layer(x).square().mean().backward()
            if i < 2:  # two steps, then one micro-batch of the next window
                opt.step()
                opt.zero_grad()
        layer.weight.data = layer.weight.data * 0.3  # new storages, the old ones dropped
        layer.weight.data = layer.weight.data * 0.3
        _assert_fresh(layer, x)
        if recipe is RECIPES[1]:  # a checkpoint taken now continues as the layer does
            copied = copy.deepcopy(layer)
            assert torch.equal(copied(x), layer(x)), trial


# ---------------------------------------------------------------------------------------------
# WeightCache's own API
# ---------------------------------------------------------------------------------------------
def test_vouch_reuses_the_cast_of_a_weight_no_optimizer_holds():
    """A frozen weight is cast every forward, unless the caller vouches for it; a write the
    version counter shows, or invalidate(), ends the voucher."""
    layer = fp8ops.FP8Linear(32, 16).requires_grad_(False)
    x = torch.randn(8, 32)
    cache = layer.fp8_state.weight_cache
    layer(x)
    first = cache.entry.payload
    layer(x)
    assert cache.entry.payload is not first  # no optimizer, no backward: cast again
    cache.vouch()
    kept = cache.entry.payload
    for _ in range(2):
        layer(x)
        assert cache.entry.payload is kept
    with torch.no_grad():
        layer.weight.mul_(2)  # seen by the version counter
    _assert_fresh(layer, x)
    cache.vouch()
    kept = cache.entry.payload
    layer.weight.data.mul_(2)  # not seen: the caller's word was wrong until it says so
    cache.invalidate()
    _assert_fresh(layer, x)
    assert cache.entry.payload is not kept


def test_invalidate_ends_a_window_an_optimizer_would_have_continued():
    layer = fp8ops.FP8Linear(32, 16)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    layer(x).sum().backward()
    opt.step()  # the optimizer holds the weight now
    layer(x).sum().backward()
    cached = layer.fp8_state.weight_cache.entry.payload
    layer(x).sum().backward()
    assert layer.fp8_state.weight_cache.entry.payload is cached  # inside the window: reused
    layer.weight.data.add_(1.0)  # unseen, mid-window
    layer.fp8_state.weight_cache.invalidate()
    _assert_fresh(layer, x)


def test_a_dead_optimizer_holds_nothing():
    layer = fp8ops.FP8Linear(32, 16)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    layer(x).sum().backward()
    opt.step()
    cache = layer.fp8_state.weight_cache
    assert cache.is_held(layer.weight)
    del opt
    gc.collect()  # (an optimizer may sit in a reference cycle)
    assert not cache.is_held(layer.weight)
    layer(x).sum().backward()
    first = cache.entry.payload
    layer(x).sum().backward()
    assert cache.entry.payload is not first
