"""The weight caches of the FP8 layers: which cache casts which parameter, every live module that
has one (so that an optimizer given only parameters finds the layers that cast a weight:
CPUOffloadOptimizer), and fp8ops.invalidate(model), every cached cast of a model dropped at once.

The caches: FP8Linear / FP8Conv1D (`fp8_state.weight_cache`), FP8GroupedLinear (`weight_cache`)
and converted transformers experts (`fp8_weight_caches`, by parameter name). The writes a
weight cache cannot see (docs/numerics.md, "Weight cache"): a `p.data` update between two steps
of the optimizer that holds the weight, and under delayed scaling a hand-written loop's `p.data`
update where the weight's gradient is a view of a shared buffer zeroed in place between forward
and backward (warned once per layer); after one, invalidate() recasts every weight at its next
forward.
"""
from __future__ import annotations

import weakref

from torch import nn

from ..scaling.weight_cache import WeightCache

# every live module with a weight cache, weakly held (the layers add themselves when made,
# copied or unpickled; convert_to_fp8 adds the transformers experts modules it converts)
_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def track(module: nn.Module) -> None:
    """Let readers_by_weight find `module`'s weight caches."""
    _MODULES.add(module)


def caches_by_name(mod: nn.Module) -> dict:
    """{name of the parameter: the WeightCache that casts it} for mod's own parameters."""
    named = dict(mod.__dict__.get("fp8_weight_caches", {}))
    cache = mod.__dict__.get("weight_cache")
    if cache is None:
        cache = getattr(mod._modules.get("fp8_state"), "weight_cache", None)
    if isinstance(cache, WeightCache):
        named.setdefault("weight", cache)
    return named


def readers_by_weight(params) -> dict:
    """{id(param): [(module, name)]}: the live FP8 modules whose parameter `name` is one of
    `params` and has a weight cache (the layers that cast it)."""
    wanted = {id(p) for p in params}
    found: dict = {}
    for mod in list(_MODULES):
        for name in caches_by_name(mod):
            p = mod._parameters.get(name)
            if p is not None and id(p) in wanted:
                found.setdefault(id(p), []).append((mod, name))
    return found


def weight_caches(model: nn.Module) -> list:
    """The WeightCache objects of `model`'s FP8 layers, each once."""
    found, seen = [], set()
    for mod in model.modules():
        for cache in caches_by_name(mod).values():
            if id(cache) not in seen:
                seen.add(id(cache))
                found.append(cache)
    return found


def invalidate(model: nn.Module) -> int:
    """Drop every cached weight cast of `model` (the next forwards cast anew, and delayed
    scaling steps its weight roles there); returns how many caches it reached.

    Call it after a change to the weights that no version counter shows and the caches cannot
    tell otherwise: a write in place through `p.data` (`add_`, `copy_`) between two steps of
    the optimizer that holds the weights, inside an accumulation window; or, under
    DelayedScaling, a hand-written loop's `p.data` update where a weight's gradient is a view of
    a buffer other gradients share (DDP's gradient_as_bucket_view) and is zeroed in place
    between the forward and the backward (the cache warns once per layer). Hand-written loops
    otherwise need no call: in either loop order, through `p.data` or a no_grad in-place op,
    every forward casts the weights anew and delayed scaling steps as in an optimizer's loop."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8ops.invalidate takes an nn.Module, got {type(model).__name__}")
    caches = weight_caches(model)
    for cache in caches:
        cache.invalidate()
    return len(caches)
