"""The per-tensor weights FSDP2 gathers in FP8 (an FP8Linear's, current or delayed scaling):
what each weight's gather keeps between calls (GatherState), and the amax of the whole weight,
the MAX over the shards, made by one all-reduce per step for all of them (global_amax): the
first layer of a step that needs one reduces every per-tensor layer of its mesh whose weight
changed. Blockwise layers need none (their block scales are the shard's own), and neither do
experts (whole experts on every rank).
"""
from __future__ import annotations

import weakref

import torch

from ...nn.quantizers import quantizer_type
from ...scaling import current_scale, recipe_formats
from ...scaling.amax_all_reduce import all_reduce_amax

_ops = torch.ops.fp8ops

# the layers whose weights FSDP2 gathers in FP8, in the order fully_shard reached them (the same
# on every rank, so every rank reduces the same layers in the same order)
_GATHERING: "list[weakref.ref]" = []


def register(layer) -> None:
    """layer's weight is gathered in FP8 (install): its amax joins the batched all-reduce."""
    global _GATHERING
    _GATHERING = [r for r in _GATHERING if r() is not None and r() is not layer]
    _GATHERING.append(weakref.ref(layer))


class GatherState:
    """What the FP8 gather of one layer's weight keeps between calls: the values key its decided
    scale is for, the weight's amax as the last batched all-reduce left it (values key, amax,
    finite, (dtype and device, rounded amax, scale)), and how many scales it decided (numbers
    them). Dropped with the cache (a copy's cache starts without one)."""

    __slots__ = ("key", "amax", "decisions", "__weakref__")

    def __init__(self):
        self.key, self.amax, self.decisions = None, None, 0


_GATHER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def gather_state(cache) -> GatherState:
    """The GatherState of the weight whose casts `cache` keeps (made on first use)."""
    gather = _GATHER.get(cache)
    if gather is None:
        gather = _GATHER[cache] = GatherState()
    return gather


def values_key(cache) -> tuple:
    """What identifies the weight's values: the layer's weight generation, the sharded parameter
    (the DTensor the optimizer updates) and its version."""
    source = cache.source_tensor()
    return cache.value, id(source), source._version


def _group(state):
    return state.weight_cache.source_tensor().device_mesh.get_group()


def global_amax(layer, key: tuple, dtype: torch.dtype, device: torch.device):
    """(amax, finite, scale) of the whole weight: the MAX over the shards, in `dtype` (the dtype
    the cast reads: amax commutes with rounding to nearest); finite on every rank; current
    scaling's scale from that amax when it was made with the others' (else None). The first
    layer of a step that needs one all-reduces those of every per-tensor layer of its mesh whose
    weight changed, in one collective: those stepped by the same optimizer step as this one (a
    model's layers; never a model no longer trained, which one rank may have collected and
    another not yet). Before its first optimizer step a layer all-reduces its own."""
    gather = gather_state(layer.fp8_state.weight_cache)
    if gather.amax is None or gather.amax[0] != key:
        _reduce_changed(layer, device, dtype)
    _, amax, finite, made = gather.amax
    if made is not None and made[0] == (dtype, device):
        return made[1], finite, made[2]
    return amax.to(device=device, dtype=dtype).float(), finite.to(device), None


def own_scale(recipe, amax: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Current scaling's scale of the weight (elementwise: amax may hold many layers')."""
    return current_scale(torch.where(finite, amax, float("nan")), recipe_formats(recipe)[0],
                         recipe.margin, recipe.power_of_two)


@torch.no_grad()
def _reduce_changed(layer, device: torch.device, dtype: torch.dtype) -> None:
    """device: where the gather runs (with FSDP2's CPUOffloadPolicy the shards are on the host;
    the collective runs on the device); dtype: the one the calling layer's cast reads. The
    rounding to dtype and the scales are made for all the layers at once (a handful of ops per
    step, not per layer); a layer whose cast reads another dtype makes its own."""
    group = _group(layer.fp8_state)
    serial = layer.fp8_state.weight_cache.generation.step_serial
    layers, keys = [], []
    others = [] if serial is None else [ref() for ref in _GATHERING]
    for other in others + ([] if layer in others else [layer]):
        # (block scales are the shard's own: nothing to reduce; a class attribute, nothing made)
        if other is None or quantizer_type(other.recipe)[0].kind == "blockwise":
            continue
        cache = other.fp8_state.weight_cache
        if cache.source_tensor() is None or _group(other.fp8_state) is not group:
            continue
        if other is not layer and (cache.generation.step_serial != serial or (
                other.fp8_state.delayed and other.fp8_state.weight.started)):
            continue  # (a started delayed-scaling role records its shard's amax: no collective)
        key = values_key(cache)
        amax = gather_state(cache).amax
        if amax is None or amax[0] != key:
            layers.append(other)
            keys.append(key)
    # (the local shard is an FP8WeightShard, its values to every op)
    local = torch.stack([
        _ops.amax(other.fp8_state.weight_cache.source_tensor()._local_tensor).to(device)
        for other in layers])
    amax, finite = all_reduce_amax(local, group, recipe=layer.recipe)
    rounded = amax.to(dtype).float()
    # scales only for the layers that take their own amax's (a started delayed-scaling role
    # takes its history's), and in one go only when they are one function of the amax
    kinds = {(o.recipe.fwd_fmt, o.recipe.margin, o.recipe.power_of_two) for o in layers}
    wanted = any(not (o.fp8_state.delayed and o.fp8_state.weight.started) for o in layers)
    scales = own_scale(layers[0].recipe, rounded, finite) if wanted and len(kinds) == 1 \
        else None
    for i, (other, key) in enumerate(zip(layers, keys)):
        gather_state(other.fp8_state.weight_cache).amax = (key, amax[i], finite[i], (
            (dtype, device), rounded[i], None if scales is None else scales[i]))
