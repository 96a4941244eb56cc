"""fp8ops/nn/quantizers.py: one quantizer per recipe, what it says a recipe allows, and the one
autograd Function every recipe runs through."""
from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

import fp8ops
from fp8ops.nn import quantizers
from fp8ops.nn.autograd import FP8LinearFunction
from fp8ops.nn.quantizers import quantizer_for, quantizer_type

# recipe -> (kind, delayed, scales_from_max, gathers_fp8, grouped, scale_block)
TABLE = [
    (fp8ops.CurrentScaling(), ("current", False, True, True, True, None)),
    (fp8ops.CurrentScaling(amax_percentile=99.9), ("current", False, False, False, False, None)),
    (fp8ops.CurrentScaling(grad_rounding="stochastic"),
     ("current", False, True, True, False, None)),
    (fp8ops.DelayedScaling(), ("delayed", True, False, True, True, None)),
    (fp8ops.DelayedScaling(grad_rounding="stochastic"),
     ("delayed", True, False, True, False, None)),
    (fp8ops.MXFP8Scaling(), ("mxfp8", False, False, False, False, 32)),
    (fp8ops.MXFP8Scaling(block_size=16), ("mxfp8", False, False, False, False, 16)),
    (fp8ops.BlockwiseScaling(), ("blockwise", False, False, True, True, 128)),
]


@pytest.mark.parametrize("recipe, expected", TABLE, ids=[repr(r) for r, _ in TABLE])
def test_what_each_recipe_allows(recipe, expected):
    q = quantizer_for(recipe)
    got = (q.kind, q.delayed, q.scales_from_max, q.gathers_fp8, q.grouped, q.scale_block)
    assert got == expected
    assert q.recipe is recipe
    assert (q.fwd.name, q.bwd.name) == (recipe.fwd_fmt, recipe.bwd_fmt)
    # the class alone answers kind and delayed (layers ask it without making a quantizer)
    cls, checked = quantizer_type(recipe)
    assert cls is type(q) and checked is recipe and (cls.kind, cls.delayed) == expected[:2]


def test_the_layers_agree_with_the_table():
    """The grouped layer takes exactly the recipes whose quantizer says `grouped`."""
    for recipe, expected in TABLE:
        if expected[4]:
            fp8ops.nn.FP8GroupedLinear(2, 8, 8, recipe=recipe)
        else:
            with pytest.raises(NotImplementedError, match="grouped_linear takes"):
                fp8ops.nn.FP8GroupedLinear(2, 8, 8, recipe=recipe)


def test_a_quantizer_holds_the_recipe_it_was_made_for():
    recipe = fp8ops.DelayedScaling(amax_history_len=4)
    assert quantizer_for(recipe).recipe is recipe
    assert quantizer_for(None).recipe == fp8ops.CurrentScaling()
    # equal recipes that differ in a field equality leaves out (the process group) keep their own
    group = object()
    other = dataclasses.replace(recipe, process_group=group)
    assert other == recipe and quantizer_for(other).recipe.process_group is group
    assert quantizer_for(recipe).recipe.process_group is None


def test_quantizers_hold_no_recipe_alive():
    """Nothing keeps a recipe (and its process group) once its layers are gone."""
    class Group:
        pass

    group = Group()
    ref = weakref.ref(group)
    state = fp8ops.ScalingState(fp8ops.DelayedScaling(process_group=group))
    fp8ops.linear(torch.randn(4, 64), torch.randn(32, 64), state=state)
    del state, group
    gc.collect()
    assert ref() is None


def test_compiled_layers_compile_once_whatever_their_recipe_objects():
    """Layers with a recipe object each, compiled one by one, share their graphs (nothing is
    guarded on the recipe object's identity), and a recipe made inside a compiled function
    traces with fullgraph."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layers = [fp8ops.FP8Linear(32, 32, recipe=fp8ops.CurrentScaling(), fallback="never")
              for _ in range(10)]
    for layer in layers:
        layer.compile(fullgraph=True, backend="eager")
    for _ in range(2):
        x = torch.randn(4, 32)
        for layer in layers:
            x = layer(x)
        x.sum().backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])

    def made_inside(x, w):
        return fp8ops.linear(x, w, recipe=fp8ops.MXFP8Scaling())

    compiled = torch.compile(made_inside, fullgraph=True, backend="eager")
    x, w = torch.randn(4, 64), torch.randn(64, 64)
    assert torch.equal(compiled(x, w), made_inside(x, w))
    torch._dynamo.reset()


def test_a_recipe_subclass_takes_its_base_quantizer():
    @dataclasses.dataclass(frozen=True)
    class Tuned(fp8ops.BlockwiseScaling):
        note: str = "mine"

    q = quantizer_for(Tuned())
    assert type(q) is quantizers.BlockwiseQuantizer and q.recipe.note == "mine"
    from fp8ops.nn.grouped_quantizers import GroupedBlockwise, grouped_quantizer_for
    g = grouped_quantizer_for(Tuned())
    assert type(g) is GroupedBlockwise and g.recipe.note == "mine"


@pytest.mark.parametrize("bad", [fp8ops.CurrentScaling, "current", 3])
def test_bad_recipes_are_refused(bad):
    with pytest.raises(TypeError, match="recipe"):
        quantizer_for(bad)


def test_mxfp8_has_no_expert_cast():
    with pytest.raises(NotImplementedError, match="mxfp8"):
        quantizer_for(fp8ops.MXFP8Scaling()).expert_cast(torch.zeros(2, 32, 32))


def test_only_current_scaling_takes_a_precast_input():
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    for recipe in (fp8ops.MXFP8Scaling(), fp8ops.BlockwiseScaling()):
        with pytest.raises(ValueError, match="pre-cast"):
            quantizer_for(recipe).linear(x, w, None, None, x.dtype, x_cast=(x, x, x, x))


@pytest.mark.parametrize("recipe", [r for r, _ in TABLE], ids=repr)
@pytest.mark.parametrize("bias", [False, True])
def test_every_recipe_runs_one_function(recipe, bias):
    """fp8ops.linear's node is the one Function's for every recipe, and its output and gradients
    are those of FP8Linear (the C++ step where it serves the recipe), bit for bit."""
    torch.manual_seed(0)
    layer = fp8ops.FP8Linear(96, 40, bias=bias, recipe=recipe)
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    x = torch.randn(15, 96, requires_grad=True)
    dy = torch.randn(15, 40)
    y = fp8ops.linear(x, *params, recipe=recipe, state=fp8ops.ScalingState(recipe))
    node = y.grad_fn  # (MXFP8's output is a view of its padded result: a view node first)
    while not isinstance(node, FP8LinearFunction._backward_cls) and node.next_functions:
        node = node.next_functions[0][0]
    assert isinstance(node, FP8LinearFunction._backward_cls), y.grad_fn
    y.backward(dy)
    x2 = x.detach().clone().requires_grad_()
    y2 = layer(x2)
    y2.backward(dy)
    assert torch.equal(y, y2)
    for got, want in zip([x.grad] + [p.grad for p in params],
                         [x2.grad] + [p.grad for p in layer.parameters()]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", [r for r, e in TABLE if e[4]], ids=repr)
def test_grouped_recipes_run_one_function(recipe):
    """The grouped quantizer is the dense one's kind with the grouped casts and GEMMs, and the
    grouped layer's node is the one Function's for every recipe it takes."""
    from fp8ops.nn.grouped import GroupedLinearFunction
    from fp8ops.nn.grouped_quantizers import grouped_quantizer_for
    q, dense = grouped_quantizer_for(recipe), quantizer_for(recipe)
    assert q.recipe is recipe
    assert isinstance(q, type(dense)) and q.kind == dense.kind
    torch.manual_seed(0)
    layer = fp8ops.nn.FP8GroupedLinear(3, 64, 48, bias=True, recipe=recipe)
    x = torch.randn(20, 64, requires_grad=True)
    y = layer(x, torch.tensor([5, 5, 20], dtype=torch.int32))
    assert isinstance(y.grad_fn, GroupedLinearFunction._backward_cls), y.grad_fn
    y.sum().backward()
    assert all(t.grad is not None for t in (x, layer.weight, layer.bias))


@pytest.mark.parametrize("recipe", [r for r, e in TABLE if not e[4]], ids=repr)
def test_recipes_the_grouped_layer_refuses(recipe):
    from fp8ops.nn.grouped_quantizers import grouped_quantizer_for
    with pytest.raises(NotImplementedError, match="grouped_linear takes") as refused:
        grouped_quantizer_for(recipe)
    assert repr(recipe) in str(refused.value)
