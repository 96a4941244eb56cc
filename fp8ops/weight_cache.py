"""The cached FP8 weight of one layer: cast once per optimizer step, however many microbatches.

An entry is reused while the weight is the same tensor view with the same values: same memory
(data_ptr, storage offset) and the same values key (version counter, the process's count of
optimizer steps, dtype, shape, strides, device). The optimizer-step count is in the key because
FSDP2 writes the updated weight under _unsafe_preserve_version_counter.

A recast of the same values (new memory: FSDP2 re-gathers the weight per microbatch at addresses
that differ by rank; or a cast made under inference mode, whose inference tensors autograd cannot
save) reuses the scale the entry was cast with and does not step the delayed-scaling weight role,
so every rank steps, and all-reduces, the same number of times.

Checkpoints, copies and pickles carry no FP8 payload, only the scale of a cast the next forward
would reuse (`saved`); restored (`restored`), it stands in for the cast until the next optimizer
step, so training continues exactly as it would have.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_OPTIMIZER_STEPS = [0]  # torch.optim steps taken in this process (invalidates every entry)


def _count_optimizer_step(optimizer, args, kwargs):
    _OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def weight_key(w: torch.Tensor):
    """(where the weight lives, what identifies its values)."""
    where = (w.data_ptr(), w.storage_offset())
    values = (w._version, _OPTIMIZER_STEPS[0], w.dtype, tuple(w.shape), w.stride(), w.device)
    return where, values


class CachedCast(NamedTuple):
    key: Optional[tuple]  # weight_key of the weight cast; None once restored
    payload: Any  # what the cast returned; None once restored
    scale: Optional[torch.Tensor]  # the per-tensor scale it was cast with (None: block scales)
    stepped: bool  # the delayed-scaling weight role stepped and recorded amax for these values
    inference: bool = False  # cast under inference mode (its tensors are inference tensors)
    weight: Any = None  # weakref to the weight (to tell at save time whether it still matches)
    restored_at: int = -1  # restored: the optimizer-step count when it was restored

    @property
    def where(self):
        return self.key[0]

    @property
    def values(self):
        return self.key[1]


# cast(weight, step, scale) -> (payload, scale used). step: step the delayed-scaling weight role
# and record the weight's amax; scale: cast with this scale instead (no step).
Cast = Callable[[torch.Tensor, bool, Optional[torch.Tensor]], tuple]


def lookup(entry: Optional[CachedCast], weight: torch.Tensor, cast: Cast, live: bool):
    """(the entry to keep, the FP8 weight). live: this forward steps delayed scaling; a live
    forward recasts (and steps) a cast that did not step, such as one made in eval mode."""
    where, values = weight_key(weight)
    inference = torch.is_inference_mode_enabled()
    same = entry is not None and (entry.stepped or not live) and (
        entry.restored_at == _OPTIMIZER_STEPS[0] if entry.payload is None
        else entry.values == values)
    if (same and entry.payload is not None and entry.where == where
            and (inference or not entry.inference)):
        return entry, entry.payload
    if same:
        scale = None if entry.scale is None else entry.scale.clone()
        payload, scale = cast(weight, False, scale)
        stepped = entry.stepped
    else:
        payload, scale = cast(weight, live, None)
        stepped = live
    new = CachedCast((where, values), payload, scale, stepped, inference, weakref.ref(weight))
    return new, payload


def saved(entry: Optional[CachedCast]) -> Optional[torch.Tensor]:
    """The scale of a stepped cast that the next forward would reuse, or None. Only a stepped cast
    needs saving: any other one is recast from the weight and the state's buffers alike."""
    if entry is None or not entry.stepped:
        return None
    if entry.payload is None:
        return entry.scale if entry.restored_at == _OPTIMIZER_STEPS[0] else None
    weight = entry.weight()
    if weight is None or weight_key(weight)[1] != entry.values:
        return None
    return entry.scale


def restored(scale: Optional[torch.Tensor]) -> Optional[CachedCast]:
    """A saved cast restored: used in place of the weight's cast until the next optimizer step."""
    if scale is None:
        return None
    return CachedCast(None, None, scale, True, restored_at=_OPTIMIZER_STEPS[0])
