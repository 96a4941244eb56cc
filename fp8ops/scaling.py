"""Scaling recipes (frozen dataclasses) and ScalingState (delayed-scaling buffers, on device).

Delayed scaling, per scaled tensor ("role": input, weight, grad):
  update()  once before each cast: step += 1; every `interval` steps the pending amax enters the
            history (slot 0), the representative amax is computed by `amax_compute_algo` and
            scale = max / (amax * margin). One op, no host sync (ops.delayed_scale_update).
  record()  after the cast: pending = max(pending, amax of the cast input); a non-finite amax is
            counted in `nonfinite_count` and never enters the history.
Under torch.distributed the casts of a training step record their amaxes locally, and one MAX
all-reduce over the recipe's process group at the end of the backward pass folds every rank's
records of every layer in (amax_reduction), so every buffer is identical on every rank between
steps: DDP's buffer broadcast and a checkpoint written by rank 0 lose nothing. A role
that steps with records of its own not yet reduced reduces first. record() itself, used where a
cast cannot record locally (a warm start under torch.distributed), all-reduces at once. A tensor
sharded by tensor parallelism (ScalingState.shard_over) has its amax all-reduced over the shards
too, for every recipe, so that each shard is cast with the scale of the whole tensor.
"""
from __future__ import annotations

import contextlib
import functools
import math
import numbers
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_leaves

from . import amax_reduction
from ._checks import check_int, check_int64
from .formats import get_format
from .nn import weight_cache
from .ops.emulation import scale_from_amax
from .ops.fused import record_amax, step_role

AMAX_ALGOS = ("max", "most_recent", "ema", "percentile")
MAX_HISTORY = 1024  # the CUDA scale-update kernel sorts the history in one block


def _check_fmt(name, value):
    try:
        get_format(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _check_rounding(value):
    if value not in ("nearest", "stochastic"):
        raise ValueError(f"grad_rounding must be 'nearest' or 'stochastic', got {value!r}")


def _check_in_range(name, value, high):
    """value in (0, high], a real number: a bool (True would pass as 1) or a string is not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number in (0, {high}], got {value!r}")
    if not 0 < value <= high:
        raise ValueError(f"{name} must be in (0, {high}], got {value!r}")


def as_float32(value) -> float:
    """value rounded to float32 (inf when it overflows, 0 when it underflows), as the ops see it."""
    # on the CPU whatever the default device (a meta one has no value to read)
    return torch.tensor(float(value), dtype=torch.float32, device="cpu").item()


def check_margin(margin, name="margin"):
    """margin multiplies amax in float32: it must be positive and finite there (0 would saturate
    every value, a negative one flip signs)."""
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real):
        raise TypeError(f"{name} must be a number, got {margin!r}")
    if not 0 < as_float32(margin) < math.inf:
        raise ValueError(f"{name} must be a positive finite factor in float32 (1.0 = none), "
                         f"got {margin}")


def grad_margin(recipe) -> float:
    """The margin of the gradient casts: the recipe's grad_margin, else its margin (gradients
    can spike between steps: a larger margin leaves them headroom)."""
    margin = getattr(recipe, "grad_margin", None)
    return recipe.margin if margin is None else margin


@dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scales from an amax history (Transformer Engine style), updated on device."""

    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: float = 1.0
    interval: int = 1
    fwd_fmt: str = "e4m3"
    bwd_fmt: str = "e5m2"
    power_of_two: bool = False
    ema_alpha: float = 0.1
    percentile: float = 99.0
    grad_rounding: str = "nearest"
    seed: int = 0
    process_group: Any = field(default=None, compare=False)
    grad_margin: Optional[float] = None  # margin of the gradient casts (None: `margin`)

    def __post_init__(self):
        check_int("amax_history_len", self.amax_history_len, 1, MAX_HISTORY)
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo must be one of {AMAX_ALGOS}, "
                             f"got {self.amax_compute_algo!r}")
        check_int("interval", self.interval, 1)
        check_int64("seed", self.seed)
        _check_in_range("ema_alpha", self.ema_alpha, 1)
        _check_in_range("percentile", self.percentile, 100)
        check_margin(self.margin)
        if self.grad_margin is not None:
            check_margin(self.grad_margin, "grad_margin")
        _check_fmt("fwd_fmt", self.fwd_fmt)
        _check_fmt("bwd_fmt", self.bwd_fmt)
        _check_rounding(self.grad_rounding)


@dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor scales from the tensor being cast (one amax pass, then the cast).

    amax_percentile (None or a number in (0, 100]): take the amax as that percentile of |x|
    (nearest rank) rather than its max. A tensor with fewer non-zeros than the ranks above the
    percentile (e.g. at most 1% non-zeros at 99) has percentile 0: its plain max |x| is used then,
    as a scale of 1 would flush its small values to zero."""

    margin: float = 1.0
    fwd_fmt: str = "e4m3"
    bwd_fmt: str = "e5m2"
    power_of_two: bool = False
    grad_rounding: str = "nearest"
    seed: int = 0
    grad_margin: Optional[float] = None  # margin of the gradient casts (None: `margin`)
    # None: amax = max |x|. A percentile (e.g. 99.99): the amax is that percentile of |x| within
    # the tensor (nearest rank), so a few outliers saturate instead of stretching the scale
    # (max |x| where that percentile is 0 but x is not all zero; see above).
    amax_percentile: Optional[float] = None

    def __post_init__(self):
        check_margin(self.margin)
        if self.grad_margin is not None:
            check_margin(self.grad_margin, "grad_margin")
        if self.amax_percentile is not None:
            _check_in_range("amax_percentile", self.amax_percentile, 100)
        _check_fmt("fwd_fmt", self.fwd_fmt)
        _check_fmt("bwd_fmt", self.bwd_fmt)
        _check_rounding(self.grad_rounding)
        check_int64("seed", self.seed)


@dataclass(frozen=True)
class MXFP8Scaling:
    """MXFP8: E8M0 scale per 32 elements along K, row-wise and column-wise copies.
    Block scales cover the range, so gradients default to E4M3 too (as Transformer Engine)."""

    fwd_fmt: str = "e4m3"
    bwd_fmt: str = "e4m3"
    block_size: int = 32
    scale_mode: str = "floor"

    def __post_init__(self):
        _check_fmt("fwd_fmt", self.fwd_fmt)
        _check_fmt("bwd_fmt", self.bwd_fmt)
        check_int("block_size", self.block_size, 1)
        if self.scale_mode not in ("floor", "rceil"):
            raise ValueError(f"scale_mode must be 'floor' or 'rceil', got {self.scale_mode!r}")


@dataclass(frozen=True)
class BlockwiseScaling:
    """DeepSeek-V3 style: activations and gradients 1x128, weights 128x128, float32 scales."""

    fwd_fmt: str = "e4m3"
    bwd_fmt: str = "e4m3"
    power_of_two: bool = False

    def __post_init__(self):
        _check_fmt("fwd_fmt", self.fwd_fmt)
        _check_fmt("bwd_fmt", self.bwd_fmt)


Recipe = (DelayedScaling, CurrentScaling, MXFP8Scaling, BlockwiseScaling)


def check_recipe(recipe):
    if recipe is None:
        return CurrentScaling()
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be one of DelayedScaling, CurrentScaling, MXFP8Scaling, "
                        f"BlockwiseScaling or None, got {type(recipe).__name__}")
    return recipe


def current_scale(amax: torch.Tensor, fmt, margin: float = 1.0,
                  power_of_two: bool = False) -> torch.Tensor:
    """scale = max / (amax * margin), 1.0 when amax is 0 or not finite (on device, no sync)."""
    fmt = get_format(fmt)
    return scale_from_amax(amax, torch.ones_like(amax), fmt.max, margin, power_of_two)


class _Generation:
    """A counter outside nn.Module's attribute machinery (an optimizer step bumps many)."""

    def __init__(self):
        self.value = 0
        # the optimizer step that last moved it (a process-wide serial number; None: none yet):
        # layers stepped by the same call train together (FSDP2's batched amax all-reduce)
        self.step_serial = None


class RoleState(nn.Module):
    """Delayed-scaling buffers of one scaled tensor. All updates are in place, on device."""

    # the 1-D DeviceMesh this role's tensor is sharded over (tensor parallelism), or None
    shard_mesh = None

    def __setattr__(self, name: str, value) -> None:
        if name == "started":  # set by every live forward: a plain bool, without Module's checks
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    def __init__(self, history_len: int, device=None):
        super().__init__()
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.register_buffer("amax_history", torch.empty(history_len, **f32))
        self.register_buffer("scale", torch.empty((), **f32))
        self.register_buffer("scale_inv", torch.empty((), **f32))
        self.register_buffer("amax_rep", torch.empty((), **f32))
        self.register_buffer("pending_amax", torch.empty((), **f32))
        self.register_buffer("step", torch.empty((), **i64))
        self.register_buffer("nonfinite_count", torch.empty((), **i64))
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """The initial state, in place (after to_empty() the buffers hold garbage)."""
        for buf in (self.amax_history, self.amax_rep, self.pending_amax, self.step,
                    self.nonfinite_count):
            buf.zero_()
        self.scale.fill_(1.0)
        self.scale_inv.fill_(1.0)
        # no amax recorded yet: casts take a warm scale (warm_scale). Set by the forward code
        # (outside autograd Functions, where torch.compile allows the mutation)
        self.started = False

    def extra_repr(self) -> str:
        if self.scale.device.type == "meta":
            return "meta"
        hist = self.amax_history.tolist()
        shown = ", ".join(f"{v:.4g}" for v in hist[:4]) + (", ..." if len(hist) > 4 else "")
        return (f"scale={self.scale.item():.6g}, amax={self.amax_rep.item():.6g}, "
                f"pending_amax={self.pending_amax.item():.6g}, step={self.step.item()}, "
                f"nonfinite={self.nonfinite_count.item()}, history=[{shown}]")

    @torch.no_grad()
    def update(self, recipe: DelayedScaling, fmt, margin: Optional[float] = None) -> None:
        """One step of the state machine; margin defaults to the recipe's (the grad role passes
        grad_margin). (ops.quantize_delayed does the same inside a cast.)"""
        step_role(self.amax_history, self.scale, self.scale_inv, self.amax_rep,
                  self.pending_amax, self.step, get_format(fmt).max,
                  recipe.margin if margin is None else margin, recipe.interval,
                  recipe.amax_compute_algo, recipe.ema_alpha, recipe.percentile,
                  recipe.power_of_two)

    @torch.no_grad()
    def record(self, amax: torch.Tensor, process_group=None) -> None:
        self.record_reduced(*_all_reduce_amax(amax, process_group, self.shard_mesh))

    @torch.no_grad()
    def record_reduced(self, amax: torch.Tensor, finite: torch.Tensor) -> None:
        """record() of an amax already reduced over the ranks (finite: whether every rank's was)."""
        record_amax(self.pending_amax, self.nonfinite_count, amax, finite)

    @torch.no_grad()
    def warm_scale(self, x: torch.Tensor, fmt, margin: float, recipe) -> torch.Tensor:
        """The scale of a cast before the role has recorded anything: from x's own amax (over
        the process group), as current scaling would, instead of the initial 1.0."""
        amax, finite = _all_reduce_amax(torch.ops.fp8ops.amax(x), recipe.process_group,
                                        self.shard_mesh)
        amax = torch.where(finite, amax, float("nan"))  # not finite: current_scale keeps 1.0
        return current_scale(amax, fmt, margin, recipe.power_of_two)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.started = bool(self.step.item() > 0)  # one host read per load


def _all_reduce_amax(amax: torch.Tensor, process_group, shard_mesh=None):
    """(amax, finite): under torch.distributed one MAX all-reduce of (amax or 0, any
    non-finite), so NaN never meets the reduction. shard_mesh: the tensor is sharded over this
    1-D DeviceMesh too (tensor parallelism); a second all-reduce covers it unless the process
    group is the world (None), which holds every shard already."""
    finite = torch.isfinite(amax)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        packed = torch.stack([torch.where(finite, amax, 0.0), (~finite).to(amax.dtype)])
        torch.distributed.all_reduce(packed, torch.distributed.ReduceOp.MAX, group=process_group)
        shard_group = None if shard_mesh is None else shard_mesh.get_group()
        if process_group is not None and shard_group not in (None, process_group):
            torch.distributed.all_reduce(packed, torch.distributed.ReduceOp.MAX,
                                         group=shard_group)
        amax, finite = packed[0], packed[1] == 0
    return amax, finite


def shard_amax(amax: torch.Tensor, shard_mesh) -> torch.Tensor:
    """The amax of a tensor sharded over the 1-D DeviceMesh shard_mesh, from one shard's amax:
    the MAX over the shards, NaN when any shard's is not finite (the whole tensor's would not be
    either: current_scale then keeps 1.0)."""
    amax, finite = _all_reduce_amax(amax, shard_mesh.get_group())
    return torch.where(finite, amax, float("nan"))


class ScalingState(nn.Module):
    """The FP8 state of one linear layer, for any recipe: delayed-scaling buffers (a RoleState for
    input, weight and grad; DelayedScaling only), the Philox seed/offset for stochastic gradient
    rounding, and the cached FP8 weight (cast once per optimizer step; see weight_cache). The
    buffers and the offset round-trip through state_dict, copy.deepcopy and pickle; of the cached
    weight only the scale of a delayed-scaling cast that the next forward would reuse is saved
    (the FP8 payload is rebuilt from the weight), so a resumed or copied layer continues exactly
    as the original, mid-accumulation too.

    The state_dict holds tensors only (safetensors, save_pretrained), with the same two keys for
    every recipe besides the delayed-scaling roles' buffers: `rng` (int64 [seed, offset], on the
    device: a stochastic cast reads it and advances the offset there, so a CUDA graph replays
    fresh random numbers) and `weight_cast_scale` (float32; 0 when there is no cast to reuse: a
    scale is never 0), written when the state_dict is made."""

    ROLES = ("input", "weight", "grad")

    def __init__(self, recipe=None, device=None):
        super().__init__()
        self.recipe = check_recipe(recipe)
        if isinstance(self.recipe, DelayedScaling):
            n = self.recipe.amax_history_len
            self.input = RoleState(n, device)
            self.weight = RoleState(n, device)
            self.grad = RoleState(n, device)
        # False: casts use the scales as they are and record nothing (FP8Linear in eval mode)
        self.recording = True
        self.monitor = None  # (fp8ops.monitor.Monitor, layer name) while monitored
        # set by CPUOffloadOptimizer: the weight's values live on the host (optim/host_weight.py)
        self.host_weight = None
        # moves whenever the weight's values may have changed unseen (weight_generation)
        self._generation = _Generation()
        self._hooked = None  # (weakref to the parameter, hook handle) of the gradient voucher
        self.source = None  # () -> the tensor the weight is gathered from (FSDP2)
        # FP8 all-gather under FSDP2: (id, version) of the sharded weight the decided cast scale
        # is for (None: any, once: a restored scale; distributed/fsdp.py)
        self._gathered_key = None
        self._gathered_amax = None  # (weight key, amax, finite, scales made) for the next decision
        self._decisions = 0  # FP8 all-gather scales decided so far (numbers them)
        self._gathered_shard = None  # (key, FP8 bytes) of the forward's gather, for backward's
        # under torch.distributed: the roles with amaxes recorded on this rank only, since the
        # last reduce_records()
        self._unreduced = set()
        # role -> the 1-D DeviceMesh its tensor is sharded over (tensor parallelism; shard_over)
        self.shard_meshes = {}
        self._stream = None  # the CUDA stream that used the state last (follow_stream)
        self._watched = None  # weakref to the parameter cached_weight last watched
        # the layer's parameter is the transpose of the [out, in] weight the casts read (the
        # layout of transformers' Conv1D): a host master, in the parameter's layout, is read
        # transposed
        self.weight_transposed = False
        # the random stream of stochastic rounding, [seed, offset] (rng_seed, rng_offset)
        self.register_buffer("rng", torch.zeros(2, dtype=torch.int64, device=device))
        # checkpoint copy of the cast scale (_save_to_state_dict)
        self.register_buffer("weight_cast_scale",
                             torch.zeros((), dtype=torch.float32, device=device))
        self.reset()

    def reset(self) -> None:
        """The initial state: fresh scaling buffers, RNG offset 0, no cached weight."""
        for role in self.ROLES:
            if role in self._modules:
                self._modules[role].reset()
        with torch.no_grad():
            self.rng.copy_(torch.tensor([int(getattr(self.recipe, "seed", 0)), 0]))
        self.high_precision_calls = 0  # calls its layer's fallback ran in high precision
        # DelayedScaling: whether the last live forward's casts took a warm scale, per role
        self.warm = {"input": True, "grad": True}
        self._weight_cache = None  # a weight_cache.CachedCast
        self._generation.value += 1  # nothing cast before the reset may be reused
        self._unreduced = set()

    def shard_over(self, role: str, mesh) -> None:
        """The tensor of `role` ("input", "weight" or "grad") is sharded over the 1-D DeviceMesh
        `mesh` (tensor parallelism): every amax that feeds its scale is all-reduced (MAX) over
        the mesh first, so that each shard is cast with the scale the whole tensor gets in one
        process. Set by fp8ops' tensor-parallel styles."""
        if role not in self.ROLES:
            raise ValueError(f"role must be one of {self.ROLES}, got {role!r}")
        if getattr(self.recipe, "amax_percentile", None) is not None:
            raise ValueError("CurrentScaling(amax_percentile=...) cannot shard: a percentile "
                             "of the whole tensor is not one of its shards' percentiles")
        self.shard_meshes[role] = mesh
        if self.delayed:
            getattr(self, role).shard_mesh = mesh

    def record_locally(self, role: str) -> None:
        """A cast of `role` recorded its amax on this rank only (reduce_records folds the others
        in)."""
        self._unreduced.add(role)

    def needs_reduce(self, role: Optional[str] = None) -> bool:
        """Whether `role` (any role: None) holds records not yet reduced over the ranks."""
        return bool(self._unreduced) if role is None else role in self._unreduced

    def reduce_records(self) -> None:
        """Fold every rank's records of this layer in now: one MAX all-reduce over the recipe's
        process group (amax_reduction.reduce_states)."""
        amax_reduction.reduce_states([self])

    @property
    def weight_generation(self) -> int:
        return self._generation.value

    @property
    def delayed(self) -> bool:
        return isinstance(self.recipe, DelayedScaling)

    @property
    def rng_seed(self) -> int:
        """The Philox seed of stochastic rounding (a host read of the `rng` buffer)."""
        return int(self.rng[0])

    @rng_seed.setter
    def rng_seed(self, value: int) -> None:
        with torch.no_grad():
            self.rng[0] = check_int64("rng_seed", value)

    @property
    def rng_offset(self) -> int:
        """The Philox offset of the next stochastic cast; each cast advances it by one on the
        device (the element index fills the low counter words, so streams never overlap)."""
        return int(self.rng[1])

    @rng_offset.setter
    def rng_offset(self, value: int) -> None:
        with torch.no_grad():
            self.rng[1] = check_int64("rng_offset", value)

    def cached_weight(self, weight: torch.Tensor, cast: weight_cache.Cast, live: bool = False,
                      recompute: bool = False):
        """The FP8 weight, reused only while the values are vouched for (weight_cache). live:
        this forward steps delayed scaling (training mode, not a checkpoint recompute). Under
        torch.compile or CUDA-graph capture every call casts (nothing on the host may decide
        what a replay reads). With a host_weight the parameter is a placeholder and every cast
        reads the host master's values."""
        trust = weight_cache.KEY if recompute else weight_cache.GRADIENT
        if self.host_weight is not None:
            cast = _reading(self, cast)
            trust = max(trust, weight_cache.BACKWARD)
        if torch.compiler.is_compiling() or _capturing(weight):
            return cast(weight, live, None)[0]
        source = None if self.source is None else self.source()
        if source is not None and source is not weight:
            trust = max(trust, weight_cache.BACKWARD)  # FSDP2: values change with the source
        else:
            source = None
        param = weight_cache.leaf(weight)
        entry, payload = weight_cache.lookup(
            self._weight_cache, weight, cast, live, self.weight_generation, trust, source,
            self.weight_held(param))
        self.__dict__["_weight_cache"] = entry  # (a plain attribute: see set_recording)
        # the steps of an optimizer over what this cast reads end it
        target = param if self.host_weight is None else self.host_weight.master
        if self._watched is None or self._watched() is not target:
            self.watch(target)
            self._watched = weakref.ref(target)
        self._hook_gradient(param)
        return payload

    def watch(self, param: torch.Tensor) -> None:
        """An optimizer step over `param` moves this state's weight generation (the parameter
        the layer registers, the one it casts, an offloaded master, FSDP2's sharded one)."""
        item = _watched(param)
        if self._generation not in item.generations:
            item.generations.append(self._generation)

    def weight_held(self, param: torch.Tensor) -> bool:
        """Whether an optimizer steps what this state's weight cast reads (`param`, the leaf it
        casts; an offloaded master or FSDP2's sharded parameter in its place): the condition
        for reusing a cast between two of its steps (weight_cache)."""
        if self.host_weight is not None:
            param = self.host_weight.master
        elif self.source is not None:
            source = self.source()
            param = param if source is None else source
        item = _WATCHERS.get(id(param))  # (held(param), inlined: a call per forward fewer)
        return (item is not None and item.holder is not None and item.ref() is param
                and item.holder() is not None)

    @contextlib.contextmanager
    def unreferenced(self, tensor: Optional[torch.Tensor]):
        """No weak reference to `tensor` (the layer's weight) while the block runs; the same
        object is referenced again after. torch.utils.swap_tensors, which Module._apply uses
        for a parameter it cannot change in place (FSDP2's DTensor parameters: to_empty() or
        .to() after fully_shard), refuses a tensor that has weak references; it keeps the Python
        object (its values and __dict__ change), so every state watching it watches it again.
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
        source = self.source() if self.source is not None else None
        if source is tensor:
            self.source = None
        if self._watched is not None and self._watched() is tensor:
            self._watched = None  # the next forward watches again
        hooked = self._hooked is not None and self._hooked[0]() is tensor
        if hooked:
            self._hooked[1].remove()
            self._hooked = None  # the next forward hooks again
        self._restore_cast(self._saved_cast_scale())  # the entry's weak reference goes
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

    # Plain attributes a layer's forward or backward sets on every call are written straight
    # into __dict__ here and in cached_weight: nn.Module.__setattr__'s checks for parameters,
    # buffers and submodules cost more than the update (none of these names is ever one of them)
    def set_recording(self, on: bool) -> None:
        self.__dict__["recording"] = on

    def count_high_precision_call(self) -> None:
        self.__dict__["high_precision_calls"] += 1

    def release_gathered_shard(self) -> None:
        """Drop the FP8 shard bytes a forward's FSDP2 gather kept for its backward's re-gather
        (distributed/fsdp.py): the backward has them, or never re-gathers."""
        self.__dict__["_gathered_shard"] = None

    def follow_stream(self, device: torch.device) -> None:
        """Order this state's device work (role buffers updated in place, the cached weight)
        after the stream that used it last: a forward on a side stream, its backward or the next
        forward on another, must not race. Also keeps a reused cast's memory from being handed
        out while the new stream still reads it. CUDA only; nothing under torch.compile.

        Under CUDA-graph capture a wait on a stream outside the capture is an error: there the
        capture's caller orders the streams (torch.cuda.graph synchronizes the device first).
        (Runs twice per layer step: the same stream as last time costs one raw lookup.)"""
        if device.type != "cuda" or torch.compiler.is_compiling():
            return
        key = _stream_key(device)
        last = self._stream  # (key, torch.cuda.Stream) of the last use
        if last is not None and last[0] == key:
            return
        stream = torch.cuda.current_stream(device)
        if last is not None and not _outside_capture(last[1], stream):
            stream.wait_stream(last[1])
            entry = self._weight_cache
            for t in tree_leaves(None if entry is None else entry.payload):
                if isinstance(t, torch.Tensor):
                    t.record_stream(stream)
        self._stream = (key, stream)

    def _hook_gradient(self, param: torch.Tensor) -> None:
        """Let param's gradient vouch for the cast once backward has accumulated it."""
        if not param.requires_grad or not param.is_leaf:
            return
        if self._hooked is not None and self._hooked[0]() is param:
            return
        if self._hooked is not None:
            self._hooked[1].remove()
        me = weakref.ref(self)

        def accumulated(p):
            state = me()
            if state is not None:
                state.weight_grad_accumulated(p)

        self._hooked = (weakref.ref(param), param.register_post_accumulate_grad_hook(accumulated))

    def expect_weight_grad(self) -> None:
        """Called by an FP8 backward that computed the weight's gradient from the cached cast:
        the gradient accumulation that follows vouches for that cast (eager mode only)."""
        self.__dict__["_grad_from_cast"] = True

    def weight_grad_accumulated(self, param: torch.Tensor) -> None:
        """param's gradient was accumulated: if from the FP8 backward of the cached cast, that
        gradient now vouches for the cast; from anywhere else (a call that fell back to the
        high-precision layer, another user of a tied weight) it vouches for nothing."""
        if self.__dict__.get("_grad_from_cast"):
            self.__dict__["_grad_from_cast"] = False
            self.__dict__["_weight_cache"] = weight_cache.accumulated(self._weight_cache, param)

    def host_values(self) -> torch.Tensor:
        """The host master's values on the device, in the [out, in] layout the casts read."""
        values = self.host_weight.device_values()
        return values.t() if self.weight_transposed else values

    def weight_values_changed(self) -> None:
        """The weight's values moved where no version counter shows it, unchanged (into a host
        master, or reloaded from a checkpoint of the same values): no cast from before is reused;
        a cast the next forward would have reused leaves its scale for the recast."""
        self._restore_cast(self._saved_cast_scale())

    def _saved_cast_scale(self) -> Optional[torch.Tensor]:
        """The scale of the cast the next forward would reuse (None: it recasts)."""
        gathered = self.source is not None and self.source() is not None  # FSDP2
        trust = (weight_cache.BACKWARD if self.host_weight is not None or gathered
                 else weight_cache.GRADIENT)
        return weight_cache.saved(self._weight_cache, self.weight_generation, trust)

    def _restore_cast(self, scale: Optional[torch.Tensor]) -> None:
        """Stand a saved cast's scale in for the weight's cast (a loaded or copied state)."""
        self._generation.value += 1
        self._weight_cache = weight_cache.restored(scale, self.weight_generation)
        self._gathered_key = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        with torch.no_grad():
            scale = self._saved_cast_scale()
            if scale is None:  # no cast the next forward would reuse
                self.weight_cast_scale.zero_()
            else:  # mid-accumulation: the scale of the cast the next forward reuses
                self.weight_cast_scale.copy_(scale)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        extra = state_dict.pop(prefix + "_extra_state", None)
        if extra is not None:  # a checkpoint from before the state was kept in tensors
            _upgrade_extra_state(extra, state_dict, prefix)
        self._restore_cast(None)
        self._unreduced = set()  # the checkpoint's buffers replace the local records
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # read back from the checkpoint's tensor (a host read, once per load), not the buffer: a
        # key that is absent (strict=False) or did not fit leaves the cast to reuse as it is
        scale = _readable(state_dict, prefix + "weight_cast_scale", ())
        if scale is not None and self.delayed and scale != 0:
            self._restore_cast(scale.to(self.weight.scale.device, torch.float32, copy=True))

    def __getstate__(self):
        # float8 payloads, weakrefs and hook handles do not pickle or copy; the scale is what
        # exactness needs
        state = super().__getstate__()
        state["_weight_cache"] = weight_cache.restored(self._saved_cast_scale(),
                                                       self.weight_generation)
        state["_hooked"] = state["source"] = state["_stream"] = state["_watched"] = None
        state["_gathered_key"] = state["_gathered_amax"] = state["_gathered_shard"] = None
        state["_unreduced"] = set()  # (a copy outside the process group reduces nothing)
        return state

    def __setstate__(self, state):
        state.setdefault("host_weight", None)  # older pickles have none
        state.setdefault("_generation", _Generation())
        for name in ("_hooked", "source", "_stream", "_watched", "_gathered_key",
                     "_gathered_amax", "_gathered_shard"):
            state.setdefault(name, None)
        state.setdefault("weight_transposed", False)
        state.setdefault("_decisions", 0)
        state.setdefault("high_precision_calls", 0)
        # older pickles kept the random stream in Python ints (and the buffer as a copy)
        seed, offset = state.pop("rng_seed", None), state.pop("rng_offset", None)
        state.setdefault("shard_meshes", {})
        state.setdefault("_unreduced", set())
        super().__setstate__(state)
        if seed is not None:
            if "rng" not in self._buffers:
                self.register_buffer("rng", torch.zeros(2, dtype=torch.int64))
            self.rng_seed, self.rng_offset = seed, offset
        entry = self._weight_cache  # valid when pickled; counted from now on (a new process too)
        self._restore_cast(None if entry is None else entry.scale)

    def _apply(self, fn, recurse=True):
        # Module.half() / .to(dtype) must not touch the float32 scales (an fp16 scale overflows
        # to inf); device moves still apply. A dtype-changing fn gets the original values moved.
        def keep_dtype(t):
            new = fn(t)
            return new if new.dtype == t.dtype else t.to(new.device)

        # called before the owner's weight moves: the cast it would reuse keeps its scale
        scale = self._saved_cast_scale()
        self._restore_cast(None if scale is None else keep_dtype(scale))
        return super()._apply(keep_dtype, recurse)

    def extra_repr(self) -> str:
        return type(self.recipe).__name__  # the owning FP8Linear prints the whole recipe


class _Watched:
    """A parameter some ScalingState casts: a weak reference to it, the generation counters an
    optimizer step over it moves, and a weak reference to the last optimizer that stepped it
    (its holder: while it lives, a cast may be reused between its steps)."""

    __slots__ = ("ref", "generations", "holder")

    def __init__(self, ref):
        self.ref, self.generations, self.holder = ref, [], None


# id(parameter) -> _Watched. Looked up by id (a tensor's == is elementwise, and a weak key
# dictionary pays a new reference per lookup); an entry is a few bytes. Another model's optimizer
# never finds this model's states.
_WATCHERS: dict = {}


def _watched(param: torch.Tensor) -> _Watched:
    key = id(param)
    item = _WATCHERS.get(key)
    if item is None or item.ref() is not param:
        item = _WATCHERS[key] = _Watched(weakref.ref(param, functools.partial(_forget, key)))
    return item


def held(param: torch.Tensor) -> bool:
    """Whether a live optimizer has stepped `param`: it holds the parameter, and its steps are
    seen (weight generations). Until its first step, nothing says one does."""
    item = _WATCHERS.get(id(param))
    return (item is not None and item.holder is not None and item.ref() is param
            and item.holder() is not None)


def _forget(key: int, ref) -> None:
    """A watched parameter was collected: drop its entry (unless its id was taken again)."""
    item = _WATCHERS.get(key)
    if item is not None and item.ref is ref:
        del _WATCHERS[key]


_STEP_SERIAL = [0]


def _after_optimizer_step(optimizer, args, kwargs) -> None:
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


register_optimizer_step_post_hook(_after_optimizer_step)


def _stream_key(device: torch.device):
    """The current stream on a CUDA device as torch's raw (id, device, type) triple: a cheap
    identity (torch.cuda.current_stream builds a Stream object per call)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch._C._cuda_getCurrentStream(index)


def _capturing(weight: torch.Tensor) -> bool:
    return weight.is_cuda and torch.cuda.is_current_stream_capturing()


def _outside_capture(last: torch.cuda.Stream, stream: torch.cuda.Stream) -> bool:
    """Whether stream is capturing a CUDA graph that last takes no part in."""
    if not torch.cuda.is_current_stream_capturing():
        return False
    with torch.cuda.stream(last):
        return not torch.cuda.is_current_stream_capturing()


def _readable(state_dict, key: str, shape: tuple) -> Optional[torch.Tensor]:
    """The checkpoint's tensor under key if it has this shape and values to read (not meta)."""
    value = state_dict.get(key)
    if isinstance(value, torch.Tensor) and tuple(value.shape) == shape and not value.is_meta:
        return value
    return None


def _upgrade_extra_state(extra: dict, state_dict, prefix: str) -> None:
    """The tensors of an older checkpoint's extra state ({"rng_seed", "rng_offset", and
    "weight_cast_scale" when there was a cast to reuse}), put under the keys that replace it."""
    state_dict.setdefault(prefix + "rng", torch.tensor(
        [int(extra["rng_seed"]), int(extra["rng_offset"])], dtype=torch.int64))
    scale = extra.get("weight_cast_scale")  # absent from older checkpoints
    state_dict.setdefault(prefix + "weight_cast_scale", torch.zeros((), dtype=torch.float32)
                          if scale is None else scale.reshape(()))


def _reading(state: ScalingState, cast: weight_cache.Cast) -> weight_cache.Cast:
    """cast, applied to the host master's values instead of the (placeholder) parameter."""
    def from_host(weight, step, scale):
        return cast(state.host_values(), step, scale)
    return from_host


def recipe_formats(recipe):
    return get_format(recipe.fwd_fmt), get_format(recipe.bwd_fmt)

