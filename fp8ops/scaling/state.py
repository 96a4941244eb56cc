"""ScalingState: the FP8 state of one linear layer (delayed-scaling roles, the random stream of
stochastic rounding, the weight cache), and how it is saved, copied and moved."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._checks import check_int64
from .local_records import LocalRecords
from .recipes import DelayedScaling, check_recipe
from .role import RoleState
from .weight_cache import BACKWARD, GRADIENT, KEY, Cast, WeightCache


class ScalingState(LocalRecords, nn.Module):
    """The FP8 state of one linear layer, for any recipe: delayed-scaling buffers (a RoleState for
    input, weight and grad; DelayedScaling only), the Philox seed/offset for stochastic gradient
    rounding, and the cached FP8 weight (`weight_cache`, a WeightCache). The buffers and the
    offset round-trip through state_dict, copy.deepcopy and pickle; of the cached weight only the
    scale of a delayed-scaling cast that the next forward would reuse is saved (the FP8 payload
    is rebuilt from the weight), so a resumed or copied layer continues exactly as the original,
    mid-accumulation too.

    The state_dict holds tensors only (safetensors, save_pretrained), with the same two keys for
    every recipe besides the delayed-scaling roles' buffers: `rng` (int64 [seed, offset], on the
    device: a stochastic cast reads it and advances the offset there, so a CUDA graph replays
    fresh random numbers) and `weight_cast_scale` (float32; 0 when there is no cast to reuse: a
    scale is never 0), written when the state_dict is made."""

    ROLES = ("input", "weight", "grad")

    def __init__(self, recipe=None, device=None):
        super().__init__()
        self.recipe = check_recipe(recipe)
        if self.delayed:
            n = self.recipe.amax_history_len
            self.input = RoleState(n, device)
            self.weight = RoleState(n, device)
            self.grad = RoleState(n, device)
        # the roles as a plain tuple (read every step without nn.Module.__getattr__), or None
        self.delayed_roles = ((self.input, self.weight, self.grad)
                              if self.delayed else None)
        # False: casts use the scales as they are and record nothing (FP8Linear in eval mode);
        # recording_word: the same as an int64 a backward in C++ reads (csrc/step)
        self.recording_word = torch.ones(1, dtype=torch.int64, device="cpu")
        self._recording_word = self.recording_word.numpy()
        self.recording = True
        self.monitor = None  # (fp8ops.monitor.Monitor, layer name) while monitored
        self.weight_cache = WeightCache()
        self.forget_local_records()  # (LocalRecords: under torch.distributed)
        # role -> the 1-D DeviceMesh its tensor is sharded over (tensor parallelism; shard_over)
        self.shard_meshes = {}
        self._stream = None  # the CUDA stream that used the state last (follow_stream)
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
        self.weight_cache.invalidate()  # nothing cast before the reset may be reused
        self.forget_local_records()

    @property
    def host_weight(self):
        """The HostWeight whose master holds the weight's values (set by CPUOffloadOptimizer;
        optim/host_weight.py), or None."""
        return self.weight_cache.host

    @host_weight.setter
    def host_weight(self, host) -> None:
        self.weight_cache.host = host

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

    @property
    def weight_generation(self) -> int:
        return self.weight_cache.value

    @property
    def delayed(self) -> bool:
        """Whether the recipe scales from amax histories (the state holds the three roles)."""
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

    def cached_weight(self, weight: torch.Tensor, cast: Cast, live: bool = False,
                      recompute: bool = False):
        """The FP8 weight, reused only while the values are vouched for (weight_cache). live:
        this forward steps delayed scaling (training mode, not a checkpoint recompute). Under
        torch.compile or CUDA-graph capture every call casts (nothing on the host may decide
        what a replay reads). With a host weight the parameter is a placeholder and every cast
        reads the host master's values."""
        cache = self.weight_cache
        trust = KEY if recompute else GRADIENT
        if cache.host is not None:
            cast = _reading(self, cast)
            trust = max(trust, BACKWARD)
        if torch.compiler.is_compiling() or _capturing(weight):
            return cast(weight, live, None)[0]
        source = None if cache.source is None else cache.source()
        if cache.host is not None:
            # the values change with the generation, or with a write to the master in place (a
            # state_dict tensor edited), which its version shows
            source = cache.host.master
        elif source is not None and source is not weight:
            trust = max(trust, BACKWARD)  # FSDP2: values change with the source
        else:
            source = None
        return cache.get(weight, cast, live=live, trust=trust, source=source)

    # Plain attributes a layer's forward or backward sets on every call are written straight
    # into __dict__ here: nn.Module.__setattr__'s checks for parameters, buffers and submodules
    # cost more than the update (none of these names is ever one of them)
    def set_recording(self, on: bool) -> None:
        self.__dict__["recording"] = on
        self._recording_word[0] = on

    def count_high_precision_call(self) -> None:
        self.__dict__["high_precision_calls"] += 1

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
            for t in self.weight_cache.payload_tensors():
                t.record_stream(stream)
        self.__dict__["_stream"] = (key, stream)

    def host_values(self) -> torch.Tensor:
        """The host master's values on the device, in the [out, in] layout the casts read."""
        values = self.host_weight.device_values()
        return values.t() if self.weight_transposed else values

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        with torch.no_grad():
            scale = self.weight_cache.saved_scale()
            if scale is None:  # no cast the next forward would reuse
                self.weight_cast_scale.zero_()
            else:  # mid-accumulation: the scale of the cast the next forward reuses
                self.weight_cast_scale.copy_(scale)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        extra = state_dict.pop(prefix + "_extra_state", None)
        if extra is not None:  # a checkpoint from before the state was kept in tensors
            _upgrade_extra_state(extra, state_dict, prefix)
        self.weight_cache.invalidate()
        self.forget_local_records()  # the checkpoint's buffers replace them
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # read back from the checkpoint's tensor (a host read, once per load), not the buffer: a
        # key that is absent (strict=False) or did not fit leaves the cast to reuse as it is
        scale = _readable(state_dict, prefix + "weight_cast_scale", ())
        if scale is not None and self.delayed and scale != 0:
            self.weight_cache.restore(scale.to(self.weight.scale.device, torch.float32,
                                               copy=True))

    def __getstate__(self):
        state = super().__getstate__()
        state["_stream"] = None
        # the word and its numpy view must stay one memory: made again by __setstate__
        state.pop("recording_word", None)
        state.pop("_recording_word", None)
        return state

    def __setstate__(self, state):
        _upgrade_pickled(state)
        super().__setstate__(state)
        self.recording_word = torch.ones(1, dtype=torch.int64, device="cpu")
        self._recording_word = self.recording_word.numpy()
        self.set_recording(self.recording)
        if "delayed_roles" not in state:  # a pickle from before the tuple
            self.delayed_roles = (tuple(self._modules[r] for r in self.ROLES)
                                  if self.delayed else None)
        seed, offset = state.pop("rng_seed", None), state.pop("rng_offset", None)
        if seed is not None:  # older pickles kept the random stream in Python ints
            if "rng" not in self._buffers:
                self.register_buffer("rng", torch.zeros(2, dtype=torch.int64))
            self.rng_seed, self.rng_offset = seed, offset

    def _apply(self, fn, recurse=True):
        # Module.half() / .to(dtype) must not touch the float32 scales (an fp16 scale overflows
        # to inf); device moves still apply. A dtype-changing fn gets the original values moved.
        def keep_dtype(t):
            new = fn(t)
            return new if new.dtype == t.dtype else t.to(new.device)

        # called before the owner's weight moves: the cast it would reuse keeps its scale
        scale = self.weight_cache.saved_scale()
        self.weight_cache.restore(None if scale is None else keep_dtype(scale))
        return super()._apply(keep_dtype, recurse)

    def extra_repr(self) -> str:
        return type(self.recipe).__name__  # the owning FP8Linear prints the whole recipe


def _upgrade_pickled(state: dict) -> None:
    """A pickle from before the weight cache was an object of its own (and older ones): its
    fields, as they are now."""
    if "weight_cache" not in state:
        cache = WeightCache()
        cache.host = state.pop("host_weight", None)
        entry = state.pop("_weight_cache", None)  # valid when pickled; counted from now on
        cache.restore(None if entry is None else entry.scale)
        state["weight_cache"] = cache
    for name in ("_generation", "_hooked", "source", "_watched", "_gathered_key",
                 "_gathered_amax", "_decisions", "_gathered_shard"):
        state.pop(name, None)
    state.setdefault("_stream", None)
    state.setdefault("weight_transposed", False)
    state.setdefault("high_precision_calls", 0)
    state.setdefault("shard_meshes", {})


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


def _reading(state: ScalingState, cast: Cast) -> Cast:
    """cast, applied to the host master's values instead of the (placeholder) parameter."""
    def from_host(weight, step, scale):
        return cast(state.host_values(), step, scale)
    return from_host
