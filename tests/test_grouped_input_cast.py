"""grouped_linear(..., input_cast=RowsCast(...)): X's forward cast made before the call (as
expert parallelism sends it) gives the very output and gradients of the call that casts X
itself, and a cast of the wrong shape or recipe is refused."""
from __future__ import annotations

import pytest
import torch

import fp8ops
from fp8ops.nn.grouped_quantizers import RowsCast

_ops = torch.ops.fp8ops
SIZES = [5, 0, 130, 7]  # an empty expert; a group over one 128-row block


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SIZES), 200, generator=g)  # K = 200: a partial 1x128 block
    w = torch.randn(len(SIZES), 48, 200, generator=g) * 0.1
    offsets = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    return x, w, offsets, torch.randn(sum(SIZES), 48, generator=g)


def _own_cast(recipe, x, offsets):
    if isinstance(recipe, fp8ops.BlockwiseScaling):
        data, scale_inv, _, _ = _ops.quantize_blockwise_grouped(x, offsets, torch.float8_e4m3fn,
                                                                recipe.power_of_two)
        return RowsCast(data, scale_inv)
    data, _, _, scale_inv = _ops.quantize_current_grouped(x, offsets, torch.float8_e4m3fn,
                                                           recipe.margin, recipe.power_of_two)
    return RowsCast(data, scale_inv)


@pytest.mark.parametrize("recipe", [fp8ops.CurrentScaling(), fp8ops.BlockwiseScaling()],
                         ids=["current", "blockwise"])
def test_given_cast_is_the_own_cast(recipe):
    x, w, offsets, dy = _operands()
    runs = []
    for given in (False, True):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        cast = _own_cast(recipe, x, offsets) if given else None
        y = fp8ops.grouped_linear(xi, wi, offsets, recipe=recipe, input_cast=cast)
        y.backward(dy)
        runs.append((y, xi.grad, wi.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", [fp8ops.CurrentScaling(), fp8ops.BlockwiseScaling()],
                         ids=["current", "blockwise"])
def test_forward_reads_the_given_bytes(recipe):
    """The cast of 2x given with x: the forward is the call on 2x, not on x (the given bytes,
    not a cast of x made anew)."""
    x, w, offsets, _ = _operands()
    with torch.no_grad():
        given = fp8ops.grouped_linear(x, w, offsets, recipe=recipe,
                                      input_cast=_own_cast(recipe, 2 * x, offsets))
        assert torch.equal(given, fp8ops.grouped_linear(2 * x, w, offsets, recipe=recipe))
        assert not torch.equal(given, fp8ops.grouped_linear(x, w, offsets, recipe=recipe))


def test_bad_cast_is_refused():
    x, w, offsets, _ = _operands()
    cast = _own_cast(fp8ops.BlockwiseScaling(), x, offsets)
    with pytest.raises(ValueError, match="scale_inv must have shape"):
        fp8ops.grouped_linear(x, w, offsets, recipe=fp8ops.CurrentScaling(), input_cast=cast)
    with pytest.raises(ValueError, match="input_cast.data must be"):
        fp8ops.grouped_linear(x[:-1], w, offsets, recipe=fp8ops.BlockwiseScaling(),
                              input_cast=cast)
    with pytest.raises(TypeError, match="RowsCast"):
        fp8ops.grouped_linear(x, w, offsets, input_cast=(cast.data, cast.scale_inv))
    state = fp8ops.nn.grouped.ExpertScalingState(fp8ops.DelayedScaling(), len(SIZES))
    current = _own_cast(fp8ops.CurrentScaling(), x, offsets)
    with pytest.raises(NotImplementedError, match="not DelayedScaling"):
        fp8ops.grouped_linear(x, w, offsets, state=state, input_cast=current)
