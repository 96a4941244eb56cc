"""The cached FP8 weight of one layer: cast once per accumulation window, never stale.

A weight's values can change in ways no counter sees (`p.data.add_()` does not bump the version
counter; FSDP2 writes the gathered weight under _unsafe_preserve_version_counter), so a cast is
reused only while something vouches that the values are those it was cast from:
  - the same tensor view (data_ptr, storage offset, dtype, shape, strides, device) at the same
    version counter, and the same generation of the layer's weight (ScalingState bumps it when an
    optimizer that holds the weight steps, when a checkpoint is loaded, when an offloaded master
    changes), and
  - a voucher: the weight's gradient is still the one its backward left after the cast (the
    `mark`, taken by a post-accumulate-grad hook): between the microbatches of one accumulation
    window nothing has zeroed, replaced or stepped it. Any update of a training loop ends the
    window: an optimizer step and zero_grad, a manual `p.data.add_(p.grad)` followed by zeroing
    the gradient. Without a backward since the cast (eval forwards, frozen weights) there is no
    voucher and every forward recasts. Other vouchers: activation checkpointing's recompute (the
    forward's own cast), a weight whose values only the generation can change (an offloaded host
    master; FSDP2's gathered copy of its sharded parameter).

A recast of vouched values (new memory: FSDP2 re-gathers per microbatch; or a cast made under
inference mode, whose inference tensors autograd cannot save) reuses the scale the entry was cast
with and does not step the delayed-scaling weight role, so every rank steps, and all-reduces, the
same number of times.

Checkpoints, copies and pickles carry no FP8 payload, only the scale of a cast the next forward
would reuse (`saved`); restored (`restored`), it stands in for the cast until the weight's
generation moves, so training continues exactly as it would have.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch

NO_MARK = None  # no gradient vouches for the entry


def weight_key(w: torch.Tensor, source: Optional[torch.Tensor] = None):
    """(where the weight lives, what identifies its values). source: the tensor the weight's
    values are copied from (FSDP2's sharded parameter), whose version counts too."""
    where = (w.data_ptr(), w.storage_offset())
    src = None if source is None else (id(source), source._version)
    values = (w._version, src, w.dtype, tuple(w.shape), w.stride(), w.device)
    return where, values


def leaf(w: torch.Tensor) -> torch.Tensor:
    """The parameter a weight view (e.g. a transposed Conv1D weight) accumulates its gradient in."""
    base = w._base
    return w if base is None else base


def grad_mark(param: torch.Tensor):
    """The state of param.grad: (weak reference to it or None, its version)."""
    g = param.grad
    return (None, -1) if g is None else (weakref.ref(g), g._version)


def mark_matches(mark, param: torch.Tensor) -> bool:
    if mark is NO_MARK:
        return False
    ref, version = mark
    g = param.grad
    if ref is None:
        return g is None
    return g is not None and ref() is g and g._version == version


class CachedCast(NamedTuple):
    key: Optional[tuple]  # weight_key of the weight cast; None once restored
    payload: Any  # what the cast returned; None once restored
    scale: Optional[torch.Tensor]  # the per-tensor scale it was cast with (None: block scales)
    stepped: bool  # the delayed-scaling weight role stepped and recorded amax for these values
    generation: int  # the state's weight generation when cast (or restored)
    inference: bool = False  # cast under inference mode (its tensors are inference tensors)
    param: Any = None  # weakref to the parameter the weight is (or is a view of): leaf(weight)
    mark: Any = NO_MARK  # the gradient state that vouches for the values (grad_mark)
    # > 0: the number of a scale decided for FSDP2's FP8 all-gather (distributed/fsdp.py; no
    # payload: every gather casts its shard with the scale); consumed: a training forward used it
    gathered: int = 0
    consumed: bool = False

    @property
    def where(self):
        return self.key[0]

    @property
    def values(self):
        return self.key[1]


# cast(weight, step, scale) -> (payload, scale used). step: step the delayed-scaling weight role
# and record the weight's amax; scale: cast with this scale instead (no step).
Cast = Callable[[torch.Tensor, bool, Optional[torch.Tensor]], tuple]


# How much vouches for an entry's values besides its key and generation (strongest last):
GRADIENT = 0  # the weight's gradient is still the one backward left after the cast
BACKWARD = 1  # a backward ran since the cast (values change only with the generation: an
#               offloaded host master, FSDP2's gathered copy of its sharded parameter)
KEY = 2  # nothing more is needed (activation checkpointing's recompute of the same forward)


def _same_window(entry: CachedCast, weight: torch.Tensor, values, generation: int,
                 trust: int) -> bool:
    """Whether this forward belongs to the accumulation window of entry's cast, by what the
    cache sees of the weight and its gradient (the key, the generation, the gradient voucher).
    Inside a window a delayed-scaling weight role does not step again. This decides when the
    scale moves, never whether a payload may be reused: that also needs a voucher nothing can
    fool (lookup)."""
    if entry.generation != generation:
        return False
    if entry.payload is None:  # restored: stands for the weight until the generation moves
        return True
    if entry.values != values:
        return False
    if trust == KEY:
        return True
    if trust == BACKWARD:
        return entry.mark is not NO_MARK
    return mark_matches(entry.mark, leaf(weight))


def lookup(entry: Optional[CachedCast], weight: torch.Tensor, cast: Cast, live: bool,
           generation: int, trust: int = GRADIENT, source: Optional[torch.Tensor] = None,
           held: bool = False):
    """(the entry to keep, the FP8 weight). live: this forward steps delayed scaling; a live
    forward recasts (and steps) a cast that did not step, such as one made in eval mode.
    trust: what vouches for the values besides the key and the generation (module doc).
    held: an optimizer's steps over the weight are seen (ScalingState.weight_held); without
    that, no payload is reused: a gradient cannot tell a micro-batch from a hand-written loop's
    next step after a `p.data` update."""
    where, values = weight_key(weight, source)
    inference = torch.is_inference_mode_enabled()
    window = (entry is not None and (entry.stepped or not live)
              and _same_window(entry, weight, values, generation, trust))
    if (window and (held or trust == KEY) and entry.payload is not None
            and entry.where == where and (inference or not entry.inference)):
        return entry, entry.payload
    # Cast again with the entry's scale: a restored cast's; the same values elsewhere while an
    # optimizer holds the weight (FSDP2's re-gathered copy of an unchanged sharded weight, a cast
    # made under inference mode); or a delayed-scaling weight inside its window (the role steps
    # once per window, held or not, so that the scales do not depend on it). Any other new
    # storage is a new weight (p.data = ..., vector_to_parameters), and current scaling always
    # takes the weight's own amax: cast from the values below.
    if window and (entry.payload is None or ((held or entry.stepped) and (
            source is not None or entry.where == where))):
        scale = None if entry.scale is None else entry.scale.clone()
        payload, scale = cast(weight, False, scale)
        # a restored entry is bound to the gradient as it is now (copied with the checkpoint)
        mark = grad_mark(leaf(weight)) if entry.payload is None else entry.mark
        new = CachedCast((where, values), payload, scale, entry.stepped, generation, inference,
                         weakref.ref(leaf(weight)), mark)
        return new, payload
    payload, scale = cast(weight, live, None)
    new = CachedCast((where, values), payload, scale, live, generation, inference,
                     weakref.ref(leaf(weight)))
    return new, payload


def accumulated(entry: Optional[CachedCast], param: torch.Tensor) -> Optional[CachedCast]:
    """entry after backward accumulated param's gradient: that gradient now vouches for it."""
    if entry is None or entry.param is None or entry.param() is not param:
        return entry
    return entry._replace(mark=grad_mark(param))


def saved(entry: Optional[CachedCast], generation: int, trust: int = GRADIENT
          ) -> Optional[torch.Tensor]:
    """The scale of a stepped cast that the next forward would reuse, or None. Only a stepped cast
    needs saving: any other one is recast from the weight and the state's buffers alike."""
    if entry is None or not entry.stepped or entry.generation != generation:
        return None
    if entry.gathered:  # reused by the next training forward once a backward vouched for it
        return entry.scale if entry.mark is not NO_MARK else None
    if entry.payload is None:
        return entry.scale
    param = entry.param()
    if param is None or param._version != entry.values[0]:  # a view shares its base's counter
        return None
    reused = entry.mark is not NO_MARK if trust == BACKWARD else mark_matches(entry.mark, param)
    return entry.scale if reused else None


def is_restored(entry: Optional[CachedCast]) -> bool:
    return entry is not None and entry.payload is None and not entry.gathered


def restored(scale: Optional[torch.Tensor], generation: int) -> Optional[CachedCast]:
    """A saved cast restored: used in place of the weight's cast until the generation moves."""
    if scale is None:
        return None
    return CachedCast(None, None, scale, True, generation)
