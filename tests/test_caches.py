"""fp8ops/nn/caches.py: fp8ops.invalidate(model) reaches every FP8 layer's weight cache."""
import pytest
import torch

import fp8ops
from fp8ops.nn.caches import weight_caches


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(fp8ops.FP8Linear(64, 64), torch.nn.GELU(),
                               fp8ops.FP8Linear(64, 64))


def test_invalidate_recasts_after_a_write_the_cache_cannot_see():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64)
    for _ in range(2):  # the optimizer's step vouches for the next window
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()  # the window's first micro-batch: cast, FP8 gradient
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.data.mul_(0.5)  # through .data: no version bump the cache sees
    assert fp8ops.invalidate(model) == 2
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(model(x), fresh(x))  # the next micro-batch sees the written weights


def test_every_kind_of_cache_once():
    model = torch.nn.ModuleDict({"dense": fp8ops.FP8Linear(16, 16),
                                 "experts": fp8ops.FP8GroupedLinear(2, 16, 16)})
    model["tied"] = model["dense"]  # the same layer twice: one cache
    caches = weight_caches(model)
    assert len(caches) == 2
    assert caches[0] is model["dense"].fp8_state.weight_cache
    assert fp8ops.invalidate(torch.nn.Linear(4, 4)) == 0
    with pytest.raises(TypeError, match="nn.Module"):
        fp8ops.invalidate([model])
