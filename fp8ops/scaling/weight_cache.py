"""The cached FP8 cast of one layer's weight (WeightCache), and the rule for reusing it.

A weight's values can change where no counter shows it: `p.data.add_()`, `p.data.copy_()` and
`vector_to_parameters` move no version counter, and FSDP2 writes its gathered weight under
`_unsafe_preserve_version_counter`. So a cast is reused only while something that cannot be
fooled vouches that the values are those it was cast from:
  - the key: the same tensor view (data_ptr, storage offset, dtype, shape, strides, device; the
    cache holds the cast's storage, so no new storage can be given its address) at the same
    version counter, and the same generation of the layer's weight. The generation
    moves when an optimizer that holds the weight steps (a `torch.optim` step post-hook that
    looks at that optimizer's own parameters: another model's optimizer never touches this
    layer), when a checkpoint is loaded, an offloaded master changes or invalidate() is called;
  - the holder: an optimizer has stepped the weight (or what its cast reads: an offloaded
    master, FSDP2's sharded parameter) and is alive, so that its steps are seen. A weight no
    optimizer is seen to hold (before the first step, a frozen weight, a hand-written loop's
    `p.data` update) is cast every forward; and
  - a backward since the cast: the weight's gradient is still the one the FP8 backward of that
    cast accumulated (the `mark`, taken by a post-accumulate-grad hook only after that backward:
    a call that fell back to nn.Linear's GEMMs writes the gradient without vouching; under
    torch.distributed the mark follows DDP's in-place write of the all-reduced gradient at the
    end of the same backward pass). So eval forwards and forwards no backward followed recast
    too. Other vouchers: activation checkpointing's recompute (the forward's own cast: the key
    alone, wherever a weight gathered from a source lives, as FSDP2 gathers it again for the
    recompute; selective checkpointing replays the recompute's ops against the forward's, so
    the recompute must reuse the cast and cast nothing), a weight whose values only the
    generation can change (an offloaded host master; FSDP2's gathered copy of its sharded
    parameter: a backward since the cast), and vouch()
    (the caller's word, as Transformer Engine's is_first_microbatch=False: the key alone, until
    the generation moves).
A gradient alone never vouches: it cannot tell a micro-batch of an accumulation window from a
hand-written loop's next step after a `p.data` update.

The key, the generation and the gradient also delimit the accumulation window, in which a
delayed-scaling weight role steps once, whether an optimizer holds the weight or not: a recast
inside the window (no holder seen yet, FSDP2's re-gathered copy of the same values, a cast made
under inference mode, whose tensors autograd cannot save) takes the window's scale and does not
step, so the scales never depend on whether a cast was reused, and every rank steps and
all-reduces alike. Any other new storage (`p.data = ...`) is a new weight, cast from its own
values, and current scaling always takes the weight's own amax.

A window is one gradient accumulated into: where no optimizer holds the weight, a gradient
zeroed or replaced between a cast's forward and its backward (a hand-written loop that runs
zero_grad() after its forward, then updates through `p.data`) shows that the window ended
before that forward, whose values the update may have changed: its backward vouches for
nothing, and the next forward starts a window of its own (casts anew; delayed scaling steps).
The backward compares the gradient it accumulated into with the one the forward saw (`seen`):
the same tensor, one version on (autograd adds in place). A gradient that is a view of a buffer
other gradients share (DDP's gradient_as_bucket_view) shares their version counter, so a zero_()
there cannot be told: the window goes on, warned once per layer, and fp8ops.invalidate() after
each `p.data` update is the remedy.

Checkpoints, copies and pickles carry no FP8 payload, only the scale of a delayed-scaling cast
the next forward would reuse (saved_scale); restored, it stands in for the cast until the
weight's generation moves, so training continues exactly as it would have.

Under FSDP2's FP8 all-gather (distributed/fsdp/) the cache holds no payload but the scale
decided for the window (store_decision): every gather casts its shard with it.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_leaves

from .world import WORLD, initialized as distributed_initialized

NO_MARK = None  # no gradient vouches for the entry

# What vouches for an entry's values besides its key, generation and holder (strongest last):
GRADIENT = 0  # the weight's gradient is still the one the cast's backward accumulated
BACKWARD = 1  # a backward ran since the cast (values change only with the generation: an
#               offloaded host master, FSDP2's gathered copy of its sharded parameter)
KEY = 2  # nothing more is needed (activation checkpointing's recompute of the same forward)


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
    key: Optional[tuple]  # (where, values) of the weight cast (lookup); None once restored
    payload: Any  # what the cast returned; None once restored
    scale: Optional[torch.Tensor]  # the per-tensor scale it was cast with (None: block scales)
    stepped: bool  # the delayed-scaling weight role stepped and recorded amax for these values
    generation: int  # the cache's weight generation when cast (or restored)
    inference: bool = False  # cast under inference mode (its tensors are inference tensors)
    param: Any = None  # weakref to the parameter the weight is (or is a view of): leaf(weight)
    mark: Any = NO_MARK  # the gradient state that vouches for the values (grad_mark)
    # > 0: the number of a scale decided for FSDP2's FP8 all-gather (no payload: every gather
    # casts its shard with the scale); consumed: a training forward used it
    gathered: int = 0
    consumed: bool = False
    # the gradient state the cast's forward saw (grad_mark; NO_MARK: unknown): with no mark yet,
    # the cast's backward must accumulate into it for its gradient to vouch (grad_accumulated)
    seen: Any = NO_MARK

    @property
    def where(self):
        return self.key[0]

    @property
    def values(self):
        return self.key[1]


# cast(weight, step, scale) -> (payload, scale used). step: step the delayed-scaling weight role
# and record the weight's amax; scale: cast with this scale instead (no step).
Cast = Callable[[torch.Tensor, bool, Optional[torch.Tensor]], tuple]


# ---------------------------------------------------------------------------------------------
# the holders: which optimizers step which parameters
# ---------------------------------------------------------------------------------------------
class Generation:
    """A counter of a layer's weight values: an optimizer step over the weight moves it."""

    def __init__(self):
        self.value = 0
        # the optimizer step that last moved it (a process-wide serial number; None: none yet):
        # layers stepped by the same call train together (FSDP2's batched amax all-reduce)
        self.step_serial = None


class _Watched:
    """A parameter some cache casts (or reads through): a weak reference to it, the generations
    an optimizer step over it moves, and a weak reference to the last optimizer that stepped it
    (its holder: while it lives, casts may be reused between its steps)."""

    __slots__ = ("ref", "generations", "holder")

    def __init__(self, ref):
        self.ref, self.generations, self.holder = ref, [], None


# id(parameter) -> _Watched. Looked up by id (a tensor's == is elementwise, and a weak key
# dictionary pays a new reference per lookup); an entry is a few bytes. Another model's optimizer
# never finds this model's caches.
_WATCHERS: dict = {}
_STEP_SERIAL = [0]


def _watched(param: torch.Tensor) -> _Watched:
    key = id(param)
    item = _WATCHERS.get(key)
    if item is None or item.ref() is not param:
        item = _WATCHERS[key] = _Watched(weakref.ref(param, functools.partial(_forget, key)))
    return item


def _forget(key: int, ref) -> None:
    """A watched parameter was collected: drop its entry (unless its id was taken again)."""
    item = _WATCHERS.get(key)
    if item is not None and item.ref is ref:
        del _WATCHERS[key]


def held(param: Optional[torch.Tensor]) -> bool:
    """Whether a live optimizer has stepped `param`: it holds it, and its steps are seen."""
    item = _WATCHERS.get(id(param))
    return (item is not None and item.holder is not None and item.ref() is param
            and item.holder() is not None)


def after_optimizer_step(optimizer, args, kwargs) -> None:
    """torch.optim's global step post-hook: the weights the step updated move their
    generations, and the optimizer becomes their holder."""
    _STEP_SERIAL[0] += 1
    holder = None
    for group in optimizer.param_groups:
        for p in group["params"]:
            item = _WATCHERS.get(id(p))
            if item is not None and item.ref() is p:
                if holder is None:
                    holder = weakref.ref(optimizer)
                item.holder = holder
                for generation in item.generations:
                    generation.value += 1  # new values: the next forward recasts
                    generation.step_serial = _STEP_SERIAL[0]


register_optimizer_step_post_hook(after_optimizer_step)


_ENGINE = torch.autograd.Variable._execution_engine


def _after_backward(cache_ref, param: torch.Tensor, *, queued: bool = False) -> None:
    """At the end of the backward pass in which the FP8 backward of a cached cast accumulated
    param's gradient (a callback of the autograd engine): queued once more, so that it runs
    after the callbacks queued during the pass (DDP's reducer, which writes the all-reduced
    gradient into the same tensor), then the gradient's mark takes that write in. Only the same
    gradient tensor, written in place since, is followed, or a view of a buffer that replaced
    it in this pass (DDP's gradient_as_bucket_view puts a view of its bucket, holding the
    all-reduced gradient, in place of the gradient autograd made for a parameter whose .grad
    was None): a gradient replaced otherwise or taken away vouches for nothing, as before."""
    if not queued:
        _ENGINE.queue_callback(functools.partial(_after_backward, cache_ref, param, queued=True))
        return
    cache = cache_ref()
    entry = None if cache is None else cache.entry
    if entry is None or entry.mark is NO_MARK or entry.param is None or entry.param() is not param:
        return
    ref, version = entry.mark
    g = param.grad
    if ref is None or g is None:
        return
    if ref() is g:
        if g._version != version:
            cache.entry = tuple.__new__(CachedCast, (*entry[:7], (ref, g._version), *entry[8:]))
    elif g._base is not None:  # DDP's bucket view, put in place during this pass
        cache.entry = tuple.__new__(CachedCast, (*entry[:7], (weakref.ref(g), g._version),
                                                 *entry[8:]))


_UNSEEN_RESET = (
    "fp8ops: the gradient of an FP8 layer's weight that no optimizer steps is a view of a buffer "
    "other gradients share (e.g. DDP's gradient_as_bucket_view), so its version counter cannot "
    "show whether it was zeroed in place between a forward and its backward. If a hand-written "
    "loop updates this weight through p.data, call fp8ops.invalidate(model) after each update: "
    "otherwise DelayedScaling may keep the weight's scale of an earlier step.")


# ---------------------------------------------------------------------------------------------
# the cache
# ---------------------------------------------------------------------------------------------
class WeightCache:
    """One layer's cached FP8 weight cast: lookup() a cast, store() a new one, invalidate() when
    the weight's values change where nothing above can see it, vouch() to reuse a cast no
    optimizer vouches for (module doc). ScalingState holds one per layer; FSDP2's and tensor
    parallelism's code reach the cast through it alone."""

    def __init__(self):
        self.entry: Optional[CachedCast] = None
        self.generation = Generation()
        # () -> the tensor the weight's values are gathered from (FSDP2's or a tensor-parallel
        # style's DTensor parameter), set by the layer; its optimizer holds the weight
        self.source = None
        # the values live on the host (an optim.host_weight.HostWeight, set by
        # CPUOffloadOptimizer): its master is what an optimizer holds
        self.host = None
        self._hooked = None  # (weakref to the parameter, hook handle) of the gradient voucher
        self._watched = None  # weakref to the parameter the last cast watched
        # the backward pass whose gradient accumulation vouches (expect_grad): its autograd
        # graph task id + 1, 0 for none
        self._grad_from_cast = 0
        # the same, set by a backward in C++ (csrc/step): a host word, read through numpy
        self.grad_word = torch.zeros(1, dtype=torch.int64, device="cpu")
        self._grad_word = self.grad_word.numpy()
        self._vouched = None  # the generation vouch() vouched for
        self._miss = None  # what lookup() found for store(): (where, values, entry or None)
        self._kept = None  # (key, tensor): bytes a gather kept for its backward (keep)
        # the storage the cached cast was made from, held so that no other storage can take its
        # address while the cast may be reused: `p.data = new` keeps the version counter, and a
        # new storage at the old address would match the key
        self._storage = None
        self._warned = False  # the warning of _reset_since was given

    # -- the rule ------------------------------------------------------------------------------
    @property
    def value(self) -> int:
        """The weight's generation (moves whenever its values may have changed)."""
        return self.generation.value

    def source_tensor(self) -> Optional[torch.Tensor]:
        return None if self.source is None else self.source()

    def holder_target(self, param: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """What an optimizer must hold for a cast of `param` (the leaf the cast reads) to be
        reused: an offloaded master, FSDP2's sharded parameter, or param itself."""
        if self.host is not None:
            return self.host.master
        source = self.source_tensor()
        return param if source is None else source

    def is_held(self, param: Optional[torch.Tensor]) -> bool:
        return held(self.holder_target(param))

    def lookup(self, weight: torch.Tensor, *, live: bool, trust: int = GRADIENT,
               source: Optional[torch.Tensor] = None):
        """(payload, None) when the cached cast serves this forward; else (None, scale): cast
        the weight with `scale` without stepping (the accumulation window's scale), or, when
        scale is None, from its own values (stepping delayed scaling when `live`), then store()
        it. live: this forward steps delayed scaling (a live forward recasts, and steps, a cast
        that did not step, such as one made in eval mode). trust: what vouches for the values
        besides the key, the generation and the holder (module doc). source: the tensor the
        weight's values are gathered from, whose version counts too.
        (One Python call: the key, mark_matches, leaf, is_held and _follow are inlined, since
        this runs every forward, also on the layer's C++ step.)"""
        # the key: where the weight lives, what identifies its values (source: the tensor they
        # are copied from, FSDP2's sharded parameter, whose version counts too)
        where = (weight.data_ptr(), weight.storage_offset())
        values = (weight._version, None if source is None else (id(source), source._version),
                  weight.dtype, tuple(weight.shape), weight.stride(), weight.device)
        entry = self.entry
        generation = self.generation.value
        self._grad_from_cast = 0  # (a backward whose gradient was never accumulated)
        self._grad_word[0] = 0
        if self._vouched == generation:
            trust = KEY
        inference = torch.is_inference_mode_enabled()
        param = weight if weight._base is None else weight._base  # leaf(weight)
        # whether this forward belongs to the accumulation window of entry's cast, by the key,
        # the generation and the gradient voucher (or, with `trust`, less). Inside a window a
        # delayed-scaling weight role does not step again. This decides when the scale moves,
        # never alone whether a payload may be reused.
        window = False
        if entry is not None and (entry.stepped or not live) and entry.generation == generation:
            if entry.payload is None:  # restored: stands for the weight until the generation moves
                window = True
            elif entry.values == values:
                if trust == KEY:
                    window = True
                elif trust == BACKWARD:
                    window = entry.mark is not NO_MARK
                elif entry.mark is not NO_MARK:  # mark_matches(entry.mark, param)
                    ref, version = entry.mark
                    g = param.grad
                    window = (g is None if ref is None else
                              g is not None and ref() is g and g._version == version)
        # self.is_held(param), inlined
        if trust == KEY:
            held = True
        else:
            target = (self.host.master if self.host is not None else
                      None if self.source is None else self.source())
            if target is None:
                target = param
            item = _WATCHERS.get(id(target))
            held = (item is not None and item.holder is not None and item.ref() is target
                    and item.holder() is not None)
        self._miss = (where, values, None)
        # (a copy gathered again from the same source under the key alone, such as FSDP2's
        # re-gather for an activation checkpoint's recompute, holds the same values wherever it
        # lives: the recompute must reuse the forward's cast, as the forward did no other cast)
        if (window and held and entry.payload is not None
                and (entry.where == where or (trust == KEY and source is not None))
                and (inference or not entry.inference)):
            hooked, watched = self._hooked, self._watched
            if (hooked is None or hooked[0]() is not param or watched is None
                    or watched() is not (param if self.host is None else self.host.master)):
                self._follow(param)
            return entry.payload, None
        # Cast again with the entry's scale: a restored cast's; the same values elsewhere
        # while an optimizer holds the weight (FSDP2's re-gathered copy, a cast made under
        # inference mode); or a delayed-scaling weight inside its window. Any other new storage
        # is a new weight (p.data = ...), and current scaling always takes the weight's own amax.
        if window and (entry.payload is None or ((held or entry.stepped) and (
                source is not None or entry.where == where))):
            self._miss = (where, values, entry)
            return None, (None if entry.scale is None else entry.scale.clone())
        return None, None

    def store(self, weight: torch.Tensor, payload, scale: Optional[torch.Tensor], *,
              stepped: bool) -> None:
        """Keep the cast the last lookup() missed: payload, cast with `scale`; stepped: the
        delayed-scaling weight role stepped for it (a recast inside a window keeps the window's)."""
        where, values, window = self._miss
        param = weight if weight._base is None else weight._base  # leaf(weight)
        ref = weakref.ref(param)
        inference = torch.is_inference_mode_enabled()
        generation = self.generation.value
        # (tuple.__new__: CachedCast(...) without the Python call of its __new__)
        if window is None:
            g = param.grad  # grad_mark(param): the gradient as this forward sees it
            seen = (None, -1) if g is None else (weakref.ref(g), g._version)
            self.entry = tuple.__new__(CachedCast, ((where, values), payload, scale, stepped,
                                                    generation, inference, ref, NO_MARK, 0,
                                                    False, seen))
        else:  # a recast inside the window keeps its stepping and its voucher
            # (a restored entry is bound to the gradient as it is now: copied with the checkpoint)
            mark = grad_mark(param) if window.payload is None else window.mark
            self.entry = tuple.__new__(CachedCast, ((where, values), payload, scale,
                                                    window.stepped, generation, inference, ref,
                                                    mark, 0, False, window.seen))
        self._miss = None
        self._storage = weight.untyped_storage()
        hooked, watched = self._hooked, self._watched
        if (hooked is None or hooked[0]() is not param or watched is None
                or watched() is not (param if self.host is None else self.host.master)):
            self._follow(param)

    def _follow(self, param: torch.Tensor) -> None:
        """The steps of an optimizer over what a cast of param reads end it (watch), and param's
        gradient may vouch for it (hook_gradient): set once per parameter."""
        target = param if self.host is None else self.host.master
        if self._watched is None or self._watched() is not target:
            self.watch(target)
            self._watched = weakref.ref(target)
        if self._hooked is None or self._hooked[0]() is not param:
            self.hook_gradient(param)

    def get(self, weight: torch.Tensor, cast: Cast, *, live: bool, trust: int = GRADIENT,
            source: Optional[torch.Tensor] = None):
        """The FP8 weight: the cached cast, or cast(weight, ...) stored (lookup, then store)."""
        payload, scale = self.lookup(weight, live=live, trust=trust, source=source)
        if payload is None:
            step = live and scale is None
            payload, scale = cast(weight, step, scale)
            self.store(weight, payload, scale, stepped=step)
        return payload

    def peek(self, weight: torch.Tensor, cast: Cast, *, trust: int = GRADIENT,
             source: Optional[torch.Tensor] = None):
        """The FP8 weight an eval forward would use now (get() with live=False: the cached cast,
        or a cast with the window's scale, or one from the weight's own values without a step),
        changing nothing: nothing is stored, nothing steps, the cache is as it was (an export
        between the micro-batches of an accumulation window leaves the next step unchanged)."""
        kept = (self._miss, self._grad_from_cast, int(self._grad_word[0]))
        try:
            payload, scale = self.lookup(weight, live=False, trust=trust, source=source)
        finally:
            self._miss, self._grad_from_cast = kept[0], kept[1]
            self._grad_word[0] = kept[2]
        if payload is None:
            payload, _ = cast(weight, False, scale)
        return payload

    def invalidate(self, keep_scale: bool = False) -> None:
        """The weight's values may have changed where nothing shows it: the next forward casts
        them anew. keep_scale: the values did not change (moved to a host master, reloaded, the
        tensor swapped by Module._apply): a delayed-scaling cast the next forward would have
        reused leaves its scale for the recast, so training continues exactly."""
        self.restore(self.saved_scale() if keep_scale else None)

    def vouch(self) -> None:
        """The caller's word that the weight's values are those of the cached cast and stay so
        until the generation moves (an optimizer step over it, a checkpoint load, invalidate()):
        until then every forward reuses the cast, the key alone checked (a write the version
        counter shows still recasts). For weights no optimizer steps: a frozen base model,
        inference. Transformer Engine's is_first_microbatch=False."""
        self._vouched = self.generation.value

    # -- the voucher's plumbing ----------------------------------------------------------------
    def watch(self, param: torch.Tensor) -> None:
        """An optimizer step over `param` moves this cache's generation (the parameter the layer
        registers, the one it casts, an offloaded master, FSDP2's sharded one)."""
        item = _watched(param)
        if self.generation not in item.generations:
            item.generations.append(self.generation)

    def hook_gradient(self, param: torch.Tensor) -> None:
        """Let param's gradient vouch for the cast once its FP8 backward has accumulated it."""
        if not param.requires_grad or not param.is_leaf:
            return
        if self._hooked is not None and self._hooked[0]() is param:
            return
        if self._hooked is not None:
            self._hooked[1].remove()
        me = weakref.ref(self)

        def accumulated(p):
            cache = me()
            if cache is not None:
                cache.grad_accumulated(p)

        self._hooked = (weakref.ref(param), param.register_post_accumulate_grad_hook(accumulated))

    def expect_grad(self) -> None:
        """Called by an FP8 backward that computed the weight's gradient from the cached cast:
        the accumulation that follows in the same backward pass vouches for that cast (eager
        mode only). A pass that accumulates none (torch.autograd.grad, backward(inputs=...)
        without the weight) leaves nothing for a later one. A backward in C++ sets grad_word[0]
        instead (a CPU int64 tensor it is given), to the same value: the pass's autograd graph
        task id + 1."""
        self._grad_from_cast = torch._C._current_graph_task_id() + 1

    def grad_accumulated(self, param: torch.Tensor) -> None:
        """param's gradient was accumulated: from the FP8 backward of the cached cast, that
        gradient now vouches for the cast; from anywhere else (a call that fell back to the
        high-precision layer, an FP8 backward of an earlier pass) it vouches for nothing. Nor
        does it when the gradient the cast's forward saw was zeroed or replaced before this
        backward accumulated into it while no optimizer holds the weight (_reset_since: a
        hand-written loop's zero_grad() between its forward and backward, its update through
        p.data unseen)."""
        task = torch._C._current_graph_task_id() + 1  # (0: outside a backward pass)
        if task == 0 or task not in (self._grad_from_cast, self._grad_word[0]):
            return
        self._grad_from_cast = 0
        self._grad_word[0] = 0
        entry = self.entry
        if entry is not None and entry.param is not None and entry.param() is param:
            g = param.grad  # grad_mark(param); the tuple built as _replace would, without its calls
            # the gradient as the cast's forward saw it, or as its last backward left it; an
            # accumulation adds into it in place (autograd's +=: one version)
            before = entry.mark if entry.mark is not NO_MARK else entry.seen
            if (g is not None and before is not NO_MARK and before[0] is not None
                    and not (before[0]() is g and g._version == before[1] + 1)):
                # held(param), inlined (an optimizer's loop that zeroes after its forward comes
                # here): the optimizer's step ends the window
                item = _WATCHERS.get(id(param))
                if not (item is not None and item.holder is not None and item.ref() is param
                        and item.holder() is not None) and self._reset_since(before, g, entry):
                    self.entry = tuple.__new__(CachedCast, (*entry[:7], NO_MARK, *entry[8:]))
                    return
            mark = (None, -1) if g is None else (weakref.ref(g), g._version)
            self.entry = tuple.__new__(CachedCast, (*entry[:7], mark, *entry[8:]))
            if g is not None and (WORLD._default_pg is not None if WORLD is not None
                                  else distributed_initialized()):
                # data parallelism (DDP) writes the reduced gradient into it, in place, at the
                # end of this backward pass: the mark follows that write (_after_backward)
                _ENGINE.queue_callback(functools.partial(_after_backward, weakref.ref(self),
                                                         param))

    def _reset_since(self, before, g: torch.Tensor, entry: CachedCast) -> bool:
        """Whether the gradient `before` (a grad_mark) was zeroed or replaced before the
        accumulation that made g, where that ends the cast's window (no optimizer holds the
        weight): the zero_grad() of a hand-written loop that runs it between the forward and the
        backward (its next forward must start a window of its own, or delayed scaling would
        never step the weight role again). Not where the values change with the generation
        alone (an offloaded master, a gathered weight).
        A gradient that is a view of a buffer other gradients share (DDP's
        gradient_as_bucket_view) shares their version counter: no count tells an in-place
        zero_() there, and the same tensor is taken to continue (warned once where that may
        leave a p.data update unseen: a delayed-scaling weight in one process; under
        torch.distributed the buffer is DDP's, whose runs step an optimizer)."""
        if self.host is not None or (self.source is not None and self.source() is not None):
            return False
        if before[0]() is not g:
            return True  # set to None, or replaced (zero_grad(), p.grad = ...)
        if g._base is None:
            return True  # written in place since (zero_grad(set_to_none=False), grad.zero_())
        # Under torch.distributed the view is DDP's bucket, and a training loop there steps an
        # optimizer (whose first step ends this ambiguity): no warning for every DDP run's
        # first window; docs/numerics.md asks hand loops under DDP to call invalidate().
        if entry.stepped and not self._warned and not (
                WORLD._default_pg is not None if WORLD is not None
                else distributed_initialized()):
            self._warned = True  # (once per layer)
            warnings.warn(_UNSEEN_RESET, stacklevel=2)
        return False

    @property
    def trust(self) -> int:
        """What vouches, besides the key, for a cast of a weight whose values change only with the
        generation (an offloaded master, FSDP2's gathered copy): a backward since the cast."""
        return BACKWARD if self.host is not None or self.source_tensor() is not None \
            else GRADIENT

    def saved_scale(self) -> Optional[torch.Tensor]:
        """The scale of a delayed-scaling cast the next forward would reuse (None: it casts
        anew and steps). Only a stepped cast needs saving: any other one is recast from the
        weight and the state's buffers alike."""
        entry = self.entry
        if entry is None or not entry.stepped or entry.generation != self.generation.value:
            return None
        if entry.gathered:  # reused by the next training forward once a backward vouched for it
            return entry.scale if entry.mark is not NO_MARK else None
        if entry.payload is None:
            return entry.scale
        param = entry.param()
        if param is None or param._version != entry.values[0]:  # a view shares its base's counter
            return None
        # what lookup also sees: another storage (`p.data = ...`), the source's writes. (A
        # weight gathered from a source, FSDP2's, has its storage freed between forwards: its
        # source's version tells instead.)
        storage = self._storage
        if (storage is not None and self.source is None
                and param.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        source = self.host.master if self.host is not None else self.source_tensor()
        if entry.values[1] is not None and (
                source is None or entry.values[1] != (id(source), source._version)):
            return None
        reused = (entry.mark is not NO_MARK if self.trust == BACKWARD
                  else mark_matches(entry.mark, param))
        return entry.scale if reused else None

    def restore(self, scale: Optional[torch.Tensor]) -> None:
        """A new generation, whose cast is the saved `scale` (None: none): used in place of the
        weight's cast until the generation moves."""
        self.generation.value += 1
        self.entry = None if scale is None else CachedCast(None, None, scale, True,
                                                           self.generation.value)
        self._kept = None
        self._storage = None  # (no payload to reuse: nothing to tell apart)

    @property
    def restored(self) -> bool:
        """The entry is a restored scale not yet cast with."""
        entry = self.entry
        return entry is not None and entry.payload is None and not entry.gathered

    def payload_tensors(self) -> list:
        """The tensors of the cached cast (what a new stream must not see freed)."""
        entry = self.entry
        if entry is None or entry.payload is None:
            return []
        return [t for t in tree_leaves(entry.payload) if isinstance(t, torch.Tensor)]

    @contextlib.contextmanager
    def unreferenced(self, tensor: Optional[torch.Tensor]):
        """No weak reference to `tensor` (the layer's weight) while the block runs; the same
        object is referenced again after. torch.utils.swap_tensors, which Module._apply uses
        for a parameter it cannot change in place (FSDP2's DTensor parameters: to_empty() or
        .to() after fully_shard), refuses a tensor that has weak references; it keeps the Python
        object (its values and __dict__ change), so every cache watching it watches it again.
        The gradient hook does not survive a swap: it is dropped, and set again by the next
        forward; a cast to reuse keeps only its scale (as in _apply)."""
        if tensor is None:
            yield
            return
        key = id(tensor)
        watchers = None
        if key in _WATCHERS and _WATCHERS[key].ref() is tensor:
            item = _WATCHERS.pop(key)
            watchers = (item.generations, item.holder)
            del item  # no name may keep the weak reference
        source = self.source_tensor()
        if source is tensor:
            self.source = None
        if self._watched is not None and self._watched() is tensor:
            self._watched = None  # the next forward watches again
        hooked = self._hooked is not None and self._hooked[0]() is tensor
        if hooked:
            self._hooked[1].remove()
            self._hooked = None  # the next forward hooks again
        self.invalidate(keep_scale=True)  # the entry's weak reference goes
        try:
            yield
        finally:
            if watchers is not None:
                again = _watched(tensor)
                again.generations.extend(g for g in watchers[0] if g not in again.generations)
                if again.holder is None:
                    again.holder = watchers[1]
            if source is tensor and self.source is None:
                self.source = weakref.ref(tensor)
            if hooked and not getattr(tensor, "_post_accumulate_grad_hooks", True):
                # a swapped tensor keeps its (now empty) hook dict but not the autograd hook
                # that calls it: without this, the next forward's hook would never run
                tensor._post_accumulate_grad_hooks = None

    # -- FSDP2's FP8 all-gather (distributed/fsdp/) ------------------------------------------
    def store_decision(self, scale: torch.Tensor, *, stepped: bool, number: int) -> None:
        """A per-tensor scale decided for the window's gathers (number > 0 identifies it)."""
        self.entry = CachedCast(None, None, scale, stepped, self.generation.value,
                                gathered=number)

    def number_decision(self, number: int) -> None:
        """The entry's scale (restored, or a recast's) serves the gathers as decision `number`."""
        self.entry = self.entry._replace(gathered=number)

    def consume(self, param: torch.Tensor, live: bool, number: Optional[int] = None) -> None:
        """A forward used the gathered weight `param` (a training forward, when live): its
        backward vouches for the decision. number: the decision it used, when the entry is a
        recast that now serves the gathers."""
        changes = {"param": weakref.ref(param), "consumed": live}
        if number is not None:
            changes["gathered"] = number
        self.entry = self.entry._replace(**changes)
        self.hook_gradient(param)

    def keep(self, key, data: Optional[torch.Tensor]) -> None:
        """Keep bytes a forward's gather made for its backward's re-gather (None: keep none)."""
        self._kept = None if data is None else (key, data)

    def take(self, key) -> Optional[torch.Tensor]:
        """The kept bytes if they are for `key`; nothing is kept after."""
        kept, self._kept = self._kept, None
        return kept[1] if kept is not None and kept[0] == key else None

    @property
    def kept(self) -> Optional[torch.Tensor]:
        """The bytes kept for the backward's re-gather, if any."""
        return None if self._kept is None else self._kept[1]

    def release(self) -> None:
        """Drop the kept bytes: the backward has them, or never re-gathers."""
        self._kept = None

    # -- copies --------------------------------------------------------------------------------
    def __getstate__(self):
        # float8 payloads, weak references and hook handles do not pickle or copy: a copy holds
        # the scale of the cast the next forward would reuse, as a checkpoint does
        return {"scale": self.saved_scale(), "host": self.host}

    def __setstate__(self, state):
        self.__init__()
        self.host = state.get("host")
        self.restore(state.get("scale"))
