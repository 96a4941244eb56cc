"""An FP8Linear's weight under FSDP2's FP8 all-gather: each rank casts its shard with the scale
the whole weight gets, so the gathered bytes are the single-process cast's.
  - per-tensor (CurrentScaling, DelayedScaling): the cast is elementwise with one scale; the
    scale's amax is the MAX over the shards (weight_amax.py: one all-reduce per step for all
    such layers). A delayed-scaling layer decides its cast once per accumulation window
    (window_scale: it steps and records the weight role once, as a single process does); every
    gather in the window (microbatches, backward re-gathers) reuses that scale, and a forward's
    bytes serve its backward's re-gather (shard_bytes);
  - BlockwiseScaling: 128x128 blocks are row-local when every shard has whole blocks (rows a
    multiple of 128, even shards): cast locally, gather data and block scales, no all-reduce.
Not in FP8: MXFP8 (its dgrad copy is blocked along N, across shards; gathering both FP8 copies
moves as many bytes as bf16), a blockwise shard boundary inside a block, CurrentScaling with
amax_percentile (a percentile is not a MAX of shard percentiles), meshes other than one
Shard(0) dimension (FSDP2 over tensor parallelism: 2-D).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from ...nn.autograd import in_recompute
from ...nn.quantizers import quantizer_for
from ...scaling import recipe_formats, weight_cache
from .weight_amax import gather_state, global_amax, own_scale, values_key

_ops = torch.ops.fp8ops


def gathers_fp8(layer, dtensor: DTensor) -> bool:
    """Whether FSDP2 can gather this FP8Linear's weight, sharded as dtensor, in FP8 (module
    doc); FP8 gathering is on for it (fsdp.gathers_fp8 asks)."""
    if tuple(dtensor.placements) != (Shard(0),) or dtensor.device_mesh.ndim != 1:
        return False
    quantizer = quantizer_for(layer.recipe)
    if not quantizer.gathers_fp8:
        return False
    if quantizer.scale_block is None:  # one scale per tensor: any rows
        return True
    rows, world = dtensor.shape[0], dtensor.device_mesh.size()
    return not layer.weight_transposed and rows % (quantizer.scale_block * world) == 0


def shard_bytes(state, local: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor,
                decision: int, fp8_dtype: torch.dtype, rows: int,
                record: bool = False) -> torch.Tensor:
    """This rank's shard, in `dtype`, cast with the window's scale and padded to FSDP2's `rows`.
    A forward's gather keeps its bytes for the backward's re-gather (FSDP2 resharded after
    forward), which takes them instead of casting again: the same decision of the same values
    (nothing may change a weight between a forward and its backward) gives the same bytes.
    FSDP2 only reads them (it copies them into its all-gather buffer). The backward releases
    them (WeightCache.release), re-gathered or not."""
    cache = state.weight_cache
    key = (decision, values_key(cache), dtype)
    backward = torch._C._current_graph_task_id() != -1
    if backward:
        kept = cache.take(key)
        if kept is not None:
            return kept
    # rounded to the gather's dtype inside the cast: no converted copy of the shard first
    via = None if local.dtype == dtype else dtype
    data, _, amax = _ops.quantize(local, scale, fp8_dtype, via=via)
    if record:  # the shard's amax, as the cast read it, recorded on this rank only: the
        # all-reduce at the end of the backward pass folds every rank's in with the other roles'
        # records (amax_reduction), so a step makes one amax all-reduce, not one more for these
        amax = amax.to(state.weight.pending_amax.device, torch.float32)  # (a host shard too)
        state.weight.record_reduced(amax, torch.isfinite(amax))
        state.record_locally("weight")
    if data.shape[0] != rows:  # an uneven shard: FSDP2 gathers equal pieces
        padded = data.new_zeros((rows, *data.shape[1:]))
        padded[:data.shape[0]] = data
        data = padded
    # kept only for a backward that may follow (none under no_grad, eval or inference)
    keep = not backward and torch.is_grad_enabled()
    cache.keep(key, data if keep else None)
    return data


def fits(entry, decision: int, cache, live: bool) -> bool:
    """Whether the gathered cast with this decision number serves this forward."""
    if entry is None or entry.gathered != decision or entry.generation != cache.value:
        return False
    return not live or (entry.stepped and (not entry.consumed or
                                           entry.mark is not weight_cache.NO_MARK))


def _reusable(entry, cache, live: bool, key) -> bool:
    """Whether a gather may cast with entry's scale instead of deciding a new one. A training
    forward steps delayed scaling once per accumulation window, as a single process does: it
    reuses a stepped scale that is fresh or vouched for by a backward since (frozen weights
    step every forward), or one restored from a checkpoint (whatever values it was decided
    for: the restored generation's)."""
    if entry is None or entry.scale is None or entry.generation != cache.value:
        return False
    decided = gather_state(cache).key  # (a key of an older generation: restored since)
    if not cache.restored and decided is not None and decided[0] == cache.value \
            and decided != key:
        return False
    if not live or cache.restored:
        return True
    vouched = entry.mark is not weight_cache.NO_MARK
    return entry.stepped and (vouched or (entry.gathered and not entry.consumed))


def window_scale(layer, dtype: torch.dtype, device: torch.device):
    """(scale, decision number, record) of this gather's per-tensor cast: decided once per
    accumulation window (a delayed-scaling layer steps its weight role then) and reused by every
    gather until the weight changes (an optimizer step over it, an in-place write, a checkpoint
    load). record: the cast records its shard's amax in the stepped weight role."""
    state, recipe = layer.fp8_state, layer.recipe
    cache = state.weight_cache
    gather = gather_state(cache)
    live = layer.training and state.delayed and not in_recompute()
    key = values_key(cache)
    entry = cache.entry
    if _reusable(entry, cache, live, key):
        gather.key = key
        if not entry.gathered:  # a restored or fallback cast's scale: number it
            gather.decisions += 1
            cache.number_decision(gather.decisions)
        return entry.scale, cache.entry.gathered, False
    fwd, _ = recipe_formats(recipe)
    role = state.weight if state.delayed else None
    record = False
    if role is not None and role.started:
        if live:
            if state.needs_reduce("weight"):  # a local record (a recast) must count first
                state.reduce_records()
            role.update(recipe, fwd, recipe.margin)
            record = True  # by the cast (shard_bytes)
        scale = role.scale.clone()  # the history's: no amax needed before the cast
    else:  # current scaling, or a delayed-scaling warm start: the weight's own amax
        amax, finite, made = global_amax(layer, key, dtype, device)
        if role is not None and live:
            if state.needs_reduce("weight"):
                state.reduce_records()
            role.update(recipe, fwd, recipe.margin)
        scale = made if made is not None else own_scale(recipe, amax, finite)
        if role is not None and live:
            role.record_reduced(amax, finite)
            role.started = True
    gather.decisions += 1
    cache.store_decision(scale, stepped=live, number=gather.decisions)
    gather.key = key
    return scale, gather.decisions, record
