"""The layer step as two C++ calls (fp8ops/nn/step.py, csrc/step/): which calls take it, and the
same bytes as the Python path (FP8Linear.cpp_step = False) in every case it serves: outputs,
gradients, parameters after optimizer steps, and the FP8 state."""
from __future__ import annotations

import contextlib
import copy
import glob
import os
import subprocess
import sys

import pytest
import torch

import fp8ops
from fp8ops.nn import step
from fp8ops.scaling import weight_cache
from saved_tensors import Saved

pytestmark = pytest.mark.skipif(not step.available(), reason="fp8ops._step is not built")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pair(recipe=None, bias=True, dtype=torch.float32, k=96, n=80, **kw):
    torch.manual_seed(0)
    fast = fp8ops.FP8Linear(k, n, bias=bias, recipe=recipe or fp8ops.CurrentScaling(),
                            fallback="never", **kw).to(dtype)
    ref = copy.deepcopy(fast)
    ref.cpp_step = False
    return fast, ref


def _took_step(layer) -> bool:
    plans = layer.__dict__.get("_plans", {})
    return any(p.path is step.CPP for p in plans.values())


def _train(layer, xs, dy_scale=1.0, steps=3, micro=2, autocast=None):
    """Steps of SGD over micro-batches; everything each produces, in order."""
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    out = []
    for s in range(steps):
        for m in range(micro):
            x = xs[(s * micro + m) % len(xs)].clone().requires_grad_(True)
            if autocast is None:
                y = layer(x)
            else:
                with torch.autocast("cpu", dtype=autocast):
                    y = layer(x)
            torch.manual_seed(100 + s * micro + m)
            dy = torch.randn(y.shape, dtype=y.dtype) * dy_scale
            y.backward(dy)
            out += [y.detach(), x.grad]
        out += [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _same(a, b):
    assert len(a) == len(b)
    for i, (p, q) in enumerate(zip(a, b)):
        assert p.dtype == q.dtype and p.shape == q.shape, i
        assert torch.equal(p, q), f"item {i} differs: max {(p.float() - q.float()).abs().max()}"


RECIPES = {
    "current": fp8ops.CurrentScaling,
    "delayed": fp8ops.DelayedScaling,
    "delayed_most_recent": lambda: fp8ops.DelayedScaling(amax_compute_algo="most_recent",
                                                         interval=2, amax_history_len=4),
    "blockwise": fp8ops.BlockwiseScaling,
    "blockwise_e5m2_pow2": lambda: fp8ops.BlockwiseScaling(bwd_fmt="e5m2", power_of_two=True),
    "mxfp8": fp8ops.MXFP8Scaling,
    "mxfp8_rceil_16": lambda: fp8ops.MXFP8Scaling(block_size=16, scale_mode="rceil",
                                                  bwd_fmt="e5m2"),
}


def _same_state(fast, ref):
    """Parameters and FP8 state (the delayed roles' buffers, the cast scale to reuse) alike."""
    _same([p.detach() for p in fast.parameters()], [p.detach() for p in ref.parameters()])
    a, b = fast.fp8_state.state_dict(), ref.fp8_state.state_dict()
    assert a.keys() == b.keys()
    _same(list(a.values()), list(b.values()))
    assert fast.fp8_state.warm == ref.fp8_state.warm
    if fast.fp8_state.delayed:
        assert ([r.started for r in fast.fp8_state.delayed_roles]
                == [r.started for r in ref.fp8_state.delayed_roles])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_training_steps_equal_the_python_path(recipe, dtype, bias):
    fast, ref = _pair(RECIPES[recipe](), bias=bias, dtype=dtype)
    torch.manual_seed(1)
    # (ranges that move the scales, and a first window of micro-batches before any optimizer
    # step: the weight is cast again in it, with the window's scale under delayed scaling)
    xs = [torch.randn(3, 40, 96, dtype=dtype) * s for s in (1, 8, 0.1)]
    _same(_train(fast, xs, steps=4), _train(ref, xs, steps=4))
    assert _took_step(fast) and not _took_step(ref)
    _same_state(fast, ref)


@pytest.mark.parametrize("recipe", ["current", "delayed", "blockwise", "mxfp8"])
def test_eval_and_mode_changes_equal_the_python_path(recipe):
    """Eval forwards record nothing; a backward after model.eval() steps no role (the mode at
    backward time counts, as on the Python path); a no_grad training forward under delayed
    scaling takes the Python path."""
    fast, ref = _pair(RECIPES[recipe]())
    x = torch.randn(16, 96)
    outs = []
    for layer in (fast, ref):
        out = _train(layer, [x], steps=1, micro=1)
        layer.eval()
        with torch.no_grad():
            out.append(layer(x * 3))
        out.append(layer(x * 2))  # eval with grad: a backward follows
        out[-1].sum().backward()
        layer.train()
        y = layer(x)
        layer.eval()  # between the forward and its backward
        y.sum().backward()
        layer.train()
        with torch.no_grad():
            out.append(layer(x * 5))
        out += _train(layer, [x], steps=2, micro=1)
        outs.append(out)
    _same(*outs)
    _same_state(fast, ref)
    assert _took_step(fast)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("recipe", ["current", "delayed", "blockwise", "mxfp8"])
def test_activation_checkpointing_equals_the_python_path(recipe, reentrant):
    """Two layers in one checkpointed region: a non-reentrant checkpoint compares every tensor
    the recompute saves with the forward's (their paths must agree); reentrant checkpointing
    runs the forward under no_grad."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    fast = fp8ops.convert_to_fp8(torch.nn.Sequential(
        torch.nn.Linear(96, 64), torch.nn.GELU(), torch.nn.Linear(64, 48)), RECIPES[recipe](),
        fallback="never")
    ref = copy.deepcopy(fast)
    for m in (ref[0], ref[2]):
        m.cpp_step = False
    outs = []
    for model in (fast, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        for step in range(3):
            x = (torch.randn(24, 96, generator=torch.Generator().manual_seed(step)) * (step + 1)
                 ).requires_grad_(True)
            y = checkpoint(model, x, use_reentrant=reentrant)
            y.pow(2).sum().backward()
            out += [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        outs.append(out)
    _same(*outs)
    for a, b in ((fast[0], ref[0]), (fast[2], ref[2])):
        _same_state(a, b)
    assert _took_step(fast[0]) and _took_step(fast[2])


@pytest.mark.parametrize("recipe", [
    fp8ops.CurrentScaling(margin=2.0, grad_margin=4.0),
    fp8ops.CurrentScaling(power_of_two=True),
    fp8ops.CurrentScaling(fwd_fmt="e5m2", bwd_fmt="e4m3"),
], ids=["margins", "power_of_two", "formats"])
def test_recipe_options_equal_the_python_path(recipe):
    fast, ref = _pair(recipe)
    xs = [torch.randn(64, 96) * 30 for _ in range(2)]
    _same(_train(fast, xs, dy_scale=1e-3), _train(ref, xs, dy_scale=1e-3))
    assert _took_step(fast)


def test_autocast_equals_the_python_path():
    fast, ref = _pair()
    xs = [torch.randn(32, 96) for _ in range(2)]
    a, b = _train(fast, xs, autocast=torch.bfloat16), _train(ref, xs, autocast=torch.bfloat16)
    _same(a, b)
    assert a[0].dtype == torch.bfloat16 and a[1].dtype == torch.float32  # y, then x.grad
    assert _took_step(fast)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_inputs_and_parameters_without_grad(recipe):
    """Only the gradients autograd asks for: a frozen weight, a frozen bias, an input without
    grad; and no_grad / inference-mode forwards."""
    for frozen in ("weight", "bias", "input"):
        fast, ref = _pair(RECIPES[recipe]())
        outs = []
        x0 = torch.randn(16, 96)
        for layer in (fast, ref):
            if frozen != "input":
                getattr(layer, frozen).requires_grad_(False)
            x = x0.clone().requires_grad_(frozen != "input")
            y = layer(x)
            y.backward(torch.ones_like(y))
            outs.append([y.detach()] + [t.grad for t in (x, layer.weight, layer.bias)
                                        if t.grad is not None])
        _same(*outs)
        assert len(outs[0]) == 3 and _took_step(fast), frozen
    fast, ref = _pair(RECIPES[recipe]())
    x = torch.randn(16, 96)
    with torch.no_grad():
        _same([fast(x)], [ref(x)])
    with torch.inference_mode():
        _same([fast(x)], [ref(x)])
    # (delayed scaling leaves forwards without grad to the Python path: step.py says why)
    assert _took_step(fast) == (not recipe.startswith("delayed"))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_no_tokens_and_many_dims(recipe):
    fast, ref = _pair(RECIPES[recipe]())
    for shape in [(0, 96), (2, 0, 96), (2, 3, 4, 96)]:
        x = torch.randn(shape, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        y, y2 = fast(x), ref(x2)
        assert y.shape == y2.shape == (*shape[:-1], 80)
        y.sum().backward()
        y2.sum().backward()
        _same([y.detach(), x.grad], [y2.detach(), x2.grad])


def test_bad_input_takes_the_python_path_and_its_error():
    layer, _ = _pair()
    with pytest.raises(ValueError, match="in_features=96"):
        layer(torch.randn(4, 95))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        layer(torch.ones(4, 96, dtype=torch.int32))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_double_backward_raises(recipe):
    """On both paths: the first-order gradients (alike), then the error differentiating them."""
    fast, ref = _pair(RECIPES[recipe]())
    firsts = []
    for layer in (fast, ref):
        torch.manual_seed(1)
        x = torch.randn(8, 96, requires_grad=True)
        gx, gw = torch.autograd.grad(layer(x).pow(2).sum(), (x, layer.weight),
                                     create_graph=True)
        firsts.append([gx.detach(), gw.detach()])
        with pytest.raises(RuntimeError, match="does not support double backward"):
            (gx.sum() + gw.sum()).backward()
    _same(*firsts)
    assert _took_step(fast)


# -- autograd's contract, alike on both paths and as nn.Linear keeps it ---------------------------
def _outcome(run, layer):
    """(what run(layer) returned, None), or (None, the error it raised), from a fixed random
    stream."""
    torch.manual_seed(1)
    try:
        return run(layer), None
    except RuntimeError as e:
        return None, e


def _alike(run, fast, ref):
    """run on both paths: the same bytes, or the same kind of error; (result, error)."""
    (a, err_a), (b, err_b) = _outcome(run, fast), _outcome(run, ref)
    assert (err_a is None) == (err_b is None), (err_a, err_b)
    if err_a is None:
        _same(a, b)
    else:
        assert type(err_a) is type(err_b)
        assert str(err_a).split(":")[0] == str(err_b).split(":")[0], (err_a, err_b)
    assert _took_step(fast) and not _took_step(ref)
    return a, err_a


def _grads(*tensors):
    return [t.grad for t in tensors if t is not None and t.grad is not None]


def _plain_twin(layer) -> torch.nn.Linear:
    """An nn.Linear with layer's parameters (copies): the behaviour both paths keep."""
    plain = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k in ("weight", "bias")})
    return plain


# a write to a parameter between a forward and its backward: (input shape, whether the input
# takes a gradient, the write, whether nn.Linear's backward raises autograd's version error:
# it saves the weight where the input gradient needs it, never the bias)
WRITES = {
    "optimizer step": ((8, 96), True, "step", True),
    "3-D input": ((2, 4, 96), True, "step", True),
    "no tokens": ((0, 96), True, "step", True),
    "input without grad": ((8, 96), False, "step", False),
    "frozen weight": ((8, 96), True, "weight", True),
    "write under no_grad": ((8, 96), True, "weight", True),
    "bias only": ((8, 96), True, "bias", False),
    "through .data": ((8, 96), True, "data", False),  # (no version moves: nothing can tell)
}


def _write_between(case):
    shape, input_grad, write, _ = WRITES[case]

    def run(layer):
        if case == "frozen weight":
            layer.weight.requires_grad_(False)
        x = torch.randn(shape, requires_grad=input_grad)
        opt = torch.optim.SGD([p for p in layer.parameters() if p.requires_grad], lr=0.1)
        layer(x).sum().backward()  # (gradients for the step)
        y = layer(x)
        if write == "step":
            opt.step()
        elif write == "data":
            layer.weight.data.mul_(0.5)
        else:
            with torch.no_grad():
                getattr(layer, write).mul_(0.5)
        y.sum().backward()
        return [y.detach(), *_grads(x, layer.weight, layer.bias)]
    return run


@pytest.mark.parametrize("case", sorted(WRITES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_parameter_write_before_backward_as_nn_linear(recipe, case):
    """An optimizer step (or any in-place write) between a forward and its backward raises
    autograd's version error on both paths where nn.Linear raises it (the weight saved, its
    version checked: no copy of it kept), and nowhere else (then the same gradients)."""
    fast, ref = _pair(RECIPES[recipe]())
    run = _write_between(case)
    raises = WRITES[case][3]
    assert (_outcome(run, _plain_twin(fast))[1] is not None) == raises  # nn.Linear's rule
    _, err = _alike(run, fast, ref)
    assert (err is not None) == raises, err
    if raises:
        assert "modified by an inplace operation" in str(err)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_weight_write_inside_a_checkpoint(recipe, reentrant):
    """Under activation checkpointing the recompute in backward reads the weight as it is then
    (autograd checks no version through the checkpoint's saved-tensor hooks, nor for
    nn.Linear): both paths recompute alike and raise nothing."""
    from torch.utils.checkpoint import checkpoint

    def run(layer):
        x = torch.randn(8, 96, requires_grad=True)
        y = checkpoint(layer, x, use_reentrant=reentrant)
        with torch.no_grad():
            layer.weight.mul_(0.5)
        y.pow(2).sum().backward()
        return [y.detach(), *_grads(x, layer.weight, layer.bias)]

    fast, ref = _pair(RECIPES[recipe]())
    assert _outcome(run, _plain_twin(fast))[1] is None
    _, err = _alike(run, fast, ref)
    assert err is None
    _same_state(fast, ref)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_saved_tensor_hooks_see_what_the_python_path_saves(recipe):
    """Saved-tensor hooks see the same tensors on both paths: the FP8 casts and, where the
    input takes a gradient, the weight parameter itself (no cast or copy of it; the bias never),
    inside fp8ops.fp8_activations too. A version check is autograd's to skip under hooks."""
    fast, ref = _pair(RECIPES[recipe]())
    for input_grad in (True, False):
        for context in (contextlib.nullcontext, fp8ops.fp8_activations):
            seen = []
            for layer in (fast, ref):
                x = torch.randn(8, 96, requires_grad=input_grad)
                with Saved() as packed, context():
                    y = layer(x)
                weights = [t for t in packed.tensors if t is layer.weight]
                assert len(weights) == input_grad, (input_grad, context)
                assert not any(t is layer.bias for t in packed.tensors)
                seen.append([(t.dtype, t.shape) for t in packed.tensors])
                y.sum().backward()
            assert seen[0] == seen[1], (input_grad, context)
    assert _took_step(fast)


class _DropGrad(torch.autograd.Function):
    """y unchanged; its backward gives no gradient (None) to what came before."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, dy):
        return None


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_an_undefined_output_gradient_leaves_everything_as_it_was(recipe):
    """The layer's output gets no gradient (None): no gradient for the input, weight or bias,
    as nn.Linear gives none, and the backward changes no FP8 state (no grad-role step under
    delayed scaling; the weight's gradient from elsewhere does not vouch for the layer's
    cast)."""
    def run(layer):
        x = torch.randn(8, 96, requires_grad=True)
        layer(x).sum().backward()  # (the delayed roles have started)
        layer.zero_grad(set_to_none=True)
        x = torch.randn(8, 96, requires_grad=True)
        y = _DropGrad.apply(layer(x))
        before = [t.clone() for t in layer.fp8_state.state_dict().values()]
        # the weight takes a gradient from another use only: accumulated, it vouches for
        # nothing
        (y.sum() + layer.weight.sum()).backward()
        assert x.grad is None and layer.bias.grad is None
        assert torch.equal(layer.weight.grad, torch.ones_like(layer.weight))
        assert layer.fp8_state.weight_cache.entry.mark is weight_cache.NO_MARK
        after = list(layer.fp8_state.state_dict().values())
        _same(after, before)
        return after

    fast, ref = _pair(RECIPES[recipe]())
    plain = _plain_twin(fast)
    x = torch.randn(8, 96, requires_grad=True)
    (_DropGrad.apply(plain(x)).sum() + plain.weight.sum()).backward()
    assert x.grad is None and plain.bias.grad is None
    _alike(run, fast, ref)
    _same_state(fast, ref)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_outputs_are_contiguous_in_every_grad_mode(recipe):
    """Sizes no block divides (out_features 40 pads to MXFP8's 32-blocks, in_features 100 to
    the blockwise 128): the output is a contiguous tensor of its own, not a view of the padded
    GEMM result, with and without grad and under inference mode, on both paths."""
    fast, ref = _pair(RECIPES[recipe](), k=100, n=40)
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        for shape in ((7, 100), (2, 3, 100), (0, 100)):
            outs = []
            for layer in (fast, ref):
                torch.manual_seed(1)
                with mode():
                    y = layer(torch.randn(shape, requires_grad=mode is torch.enable_grad))
                assert y.shape == (*shape[:-1], 40)
                assert y.is_contiguous() and not y._is_view(), (mode, shape, y.stride())
                outs.append(y.detach().clone())
            _same(*outs)
    assert _took_step(fast)


@pytest.mark.parametrize("n", [40, 64])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_an_in_place_op_on_the_output(recipe, n):
    """The output is no view autograd guards (a padded GEMM result's slice included): an
    in-place op on it, then backward, as nn.Linear allows; and in every grad mode."""
    def run(layer):
        out = []
        for shape in ((8, 96), (2, 4, 96)):
            x = torch.randn(shape, requires_grad=True)
            y = layer(x)
            y.mul_(2)
            y.pow(2).sum().backward()
            out += [y.detach(), x.grad]
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                y = layer(torch.randn(8, 96))
                y.add_(1)
            out.append(y.clone())
        return out + _grads(layer.weight, layer.bias)

    fast, ref = _pair(RECIPES[recipe](), n=n)
    _alike(run, fast, ref)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_second_backward_of_one_graph(recipe):
    """retain_graph: a second backward gives the same gradients again (accumulated) and, under
    delayed scaling, steps the grad role again on both paths; once freed, the graph refuses a
    third with autograd's error."""
    def run(layer):
        x = torch.randn(8, 96, requires_grad=True)
        y = layer(x)
        out = []
        for _ in range(2):
            y.pow(2).sum().backward(retain_graph=True)
            out += [g.clone() for g in _grads(x, layer.weight, layer.bias)]
        y.sum().backward()
        out += [g.clone() for g in _grads(x, layer.weight, layer.bias)]
        out += list(layer.fp8_state.state_dict().values())
        y.sum().backward()  # freed
        return out

    fast, ref = _pair(RECIPES[recipe]())
    _, err = _alike(run, fast, ref)
    assert "backward through the graph a second time" in str(err)
    _same_state(fast, ref)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_output_gradients_of_any_layout(recipe):
    """dY expanded (y.sum()), transposed, a strided slice, and under autocast a float32 loss
    over the bfloat16 output: the same gradients on both paths."""
    def run(layer):
        out = []
        x = torch.randn(8, 96, requires_grad=True)
        dys = [torch.ones(1, 80).expand(8, 80), torch.randn(80, 8).t(),
               torch.randn(8, 160)[:, ::2]]
        for dy in dys:
            y = layer(x)
            y.backward(dy)
            out += [y.detach()] + _grads(x, layer.weight, layer.bias)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().pow(2).sum().backward()
        out += [y.detach()] + _grads(x, layer.weight, layer.bias)
        return out

    fast, ref = _pair(RECIPES[recipe]())
    _alike(run, fast, ref)
    _same_state(fast, ref)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_strided_inputs(recipe):
    """Inputs that are no contiguous block: a strided slice, a transposed tensor, a permuted
    3-D one."""
    def run(layer):
        out = []
        for x in (torch.randn(8, 192)[:, ::2], torch.randn(96, 8).t(),
                  torch.randn(4, 96, 3).permute(0, 2, 1)):
            x.requires_grad_(True)
            y = layer(x)
            y.pow(2).sum().backward()
            out += [y.detach(), x.grad]
        return out + _grads(layer.weight, layer.bias)

    fast, ref = _pair(RECIPES[recipe]())
    _alike(run, fast, ref)
    _same_state(fast, ref)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_gradients_for_some_inputs_only(recipe):
    """torch.autograd.grad for the input, the weight or the bias alone, and backward(inputs=):
    the same gradients and FP8 state on both paths. Only a weight gradient the backward pass
    accumulates vouches for the layer's cast: one it computed without accumulating (or did not
    compute) leaves a gradient the weight takes later, from elsewhere, vouching for nothing."""
    def vouched(layer) -> bool:
        return layer.fp8_state.weight_cache.entry.mark is not weight_cache.NO_MARK

    def run(layer):
        out = []
        x = torch.randn(8, 96, requires_grad=True)
        layer(x).pow(2).sum().backward()
        assert vouched(layer)  # (a whole backward: its accumulation vouches)
        out += _grads(x, layer.weight, layer.bias)
        for wrt in ("input", "weight", "bias", "inputs="):
            layer.zero_grad(set_to_none=True)
            x = torch.randn(8, 96, requires_grad=True)
            y = layer(x)
            if wrt == "inputs=":
                y.pow(2).sum().backward(inputs=[x, layer.bias])
                out += _grads(x, layer.weight, layer.bias)
            else:
                target = {"input": x, "weight": layer.weight, "bias": layer.bias}[wrt]
                out += torch.autograd.grad(y.pow(2).sum(), target)
            assert layer.weight.grad is None
            (layer.weight * 2).sum().backward()  # the weight's gradient, from elsewhere
            assert not vouched(layer), wrt
        return out + list(layer.fp8_state.state_dict().values())

    fast, ref = _pair(RECIPES[recipe]())
    _alike(run, fast, ref)
    _same_state(fast, ref)


def test_which_calls_take_it():
    """The Python path keeps what the C++ step does not serve; each still trains."""
    x = torch.randn(8, 96)
    for recipe in (fp8ops.DelayedScaling(grad_rounding="stochastic"),
                   fp8ops.CurrentScaling(grad_rounding="stochastic"),
                   fp8ops.CurrentScaling(amax_percentile=99.9)):
        layer = fp8ops.FP8Linear(96, 128, recipe=recipe, fallback="never")
        layer(x).sum().backward()
        assert not _took_step(layer), recipe
    layer = fp8ops.FP8Linear(96, 80, fallback=fp8ops.Crossover(min_tokens=16))
    layer(x).sum().backward()  # 8 tokens: nn.Linear's GEMMs
    assert not _took_step(layer) and layer.fp8_state.high_precision_calls == 1
    layer(torch.randn(16, 96)).sum().backward()
    assert _took_step(layer) and layer.fp8_state.high_precision_calls == 1
    layer = fp8ops.FP8Linear(96, 80, fallback="never")
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    layer(x).sum().backward()
    assert layer.weight.grad is None and layer.weight.main_grad.abs().sum() > 0


def test_a_sampled_monitor_step_takes_the_python_path():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 80))
    fp8ops.convert_to_fp8(model, fp8ops.CurrentScaling(), fallback="never")
    ref = copy.deepcopy(model)
    ref[0].cpp_step = False
    fp8ops.monitor(model, every=2)
    xs = [torch.randn(16, 96) for _ in range(2)]
    _same(_train(model, xs, steps=2, micro=1), _train(ref, xs, steps=2, micro=1))
    assert _took_step(model[0])  # the unsampled step
    stats = fp8ops.stats(model)  # the sampled step's, from the Python path
    assert stats["0.input.amax"] == xs[0].abs().max().item()
    assert stats["0.weight.scale"] > 0 and "0.grad.amax" in stats


def test_copies_decide_again():
    fast, _ = _pair()
    fast(torch.randn(4, 96))
    assert _took_step(fast)
    clone = copy.deepcopy(fast)
    assert "_plans" not in clone.__dict__
    clone(torch.randn(4, 96)).sum().backward()
    assert _took_step(clone)


@pytest.mark.skipif(not glob.glob(os.path.join(ROOT, "fp8ops", "_C*.so")),
                    reason="fp8ops/_C*.so not built")
def test_the_step_calls_each_op_as_its_cuda_kernel_is_registered():
    """The dispatcher checks a call's C++ signature against that of the op's registered C++
    kernel (fp8ops._C's CUDA kernels), not against the schema alone: with _C's registrations
    loaded (no GPU needed), every C++ step's calls must pass that check."""
    code = (
        "import glob, torch\n"
        "torch.ops.load_library(glob.glob('fp8ops/_C*.so')[0])\n"
        "import fp8ops\n"
        "for r in (fp8ops.CurrentScaling(), fp8ops.DelayedScaling(), fp8ops.BlockwiseScaling(),\n"
        "          fp8ops.MXFP8Scaling()):\n"
        "    layer = fp8ops.FP8Linear(128, 128, recipe=r, fallback='never')\n"
        "    opt = torch.optim.SGD(layer.parameters(), lr=0.1)\n"
        "    for _ in range(2):\n"
        "        layer(torch.randn(8, 128, requires_grad=True)).sum().backward()\n"
        "        opt.step()\n"
        "    assert any(p.path == 'cpp' for p in layer._plans.values()), r\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_the_environment_switch_turns_the_step_off():
    """FP8OPS_DISABLE_STEP=1: every call takes the Python path (and trains the same)."""
    code = (
        "import torch, fp8ops\n"
        "layer = fp8ops.FP8Linear(64, 32, fallback='never')\n"
        "layer(torch.randn(4, 64)).sum().backward()\n"
        "print(sorted(p.path for p in layer._plans.values()))\n")
    for value, path in (("1", "python"), ("0", "cpp")):
        env = {**os.environ, "FP8OPS_DISABLE_STEP": value}
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"['{path}']", proc.stdout
