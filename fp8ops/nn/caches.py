"""fp8ops.invalidate(model): every cached FP8 weight cast of a model, dropped at once.

The one write a weight cache cannot see is a `p.data` update between two steps of the optimizer
that holds the weight (docs/numerics.md, "Weight cache"); after one, this recasts every weight
at its next forward, whichever layers hold it: FP8Linear / FP8Conv1D (`fp8_state.weight_cache`),
FP8GroupedLinear (`weight_cache`) and converted transformers experts (`fp8_weight_caches`).
"""
from __future__ import annotations

from torch import nn

from ..scaling.weight_cache import WeightCache


def weight_caches(model: nn.Module) -> list:
    """The WeightCache objects of `model`'s FP8 layers, each once."""
    found, seen = [], set()
    for mod in model.modules():
        state = getattr(mod, "fp8_state", None)
        held = [getattr(state, "weight_cache", None), mod.__dict__.get("weight_cache")]
        held += list(mod.__dict__.get("fp8_weight_caches", {}).values())
        for cache in held:
            if isinstance(cache, WeightCache) and id(cache) not in seen:
                seen.add(id(cache))
                found.append(cache)
    return found


def invalidate(model: nn.Module) -> int:
    """Drop every cached weight cast of `model` (the next forwards cast anew); returns how many
    caches it reached."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8ops.invalidate takes an nn.Module, got {type(model).__name__}")
    caches = weight_caches(model)
    for cache in caches:
        cache.invalidate()
    return len(caches)
