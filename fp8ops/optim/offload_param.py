"""One parameter of a CPUOffloadOptimizer: its FP32 master on the host, the gradient accumulated
there, and the copies between the device and the host.

Three kinds of parameter:
  shared  a float32 parameter on the CPU that no FP8 layer casts: the device is the host, so the
          host optimizer steps the parameter itself (no copy, no hook);
  copy    any other parameter that is not an FP8 weight (norms, embeddings, biases): an
          FP32 master on the host, the device keeps the parameter in its own dtype and gets the
          new values after each step;
  fp8     a weight FP8 layers cast (FP8Linear, FP8GroupedLinear, converted transformers experts):
          the FP32 master on the host is its only high-precision copy; the device parameter
          becomes a placeholder that refuses to be read (host_weight.offload), the layers' weight
          caches cast the master once per step (host_weight.HostWeight), and the module's
          state_dict holds the master (offload_state_dict).
Gradients of copy and fp8 parameters go to the host as soon as backward produces each one (a
post-accumulate-grad hook; on CUDA a copy on a side stream, overlapped with the rest of backward)
and are accumulated there in FP32.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import offload_state_dict
from ..nn.caches import caches_by_name
from .host_weight import HostWeight, offload

_F32 = torch.float32

# every parameter a CPUOffloadOptimizer has taken over (held weakly) -> its OffloadedParam,
# which lives as long as the parameter, whether the optimizer does or not (its gradient hook
# finds it here); a shared one's (no hook) as long as its optimizer, by a weak reference. The
# OffloadedParam holds the parameter weakly: torch's gradient hooks are not seen by the garbage
# collector, so a hook holding it would keep a dropped model (and its masters) alive.
_OWNED = WeakIdKeyDictionary()


def owner(param: torch.Tensor) -> Optional["OffloadedParam"]:
    """The OffloadedParam that owns `param`, or None."""
    entry = _OWNED.get(param)
    return entry() if isinstance(entry, weakref.ref) else entry


def _accumulated(param: torch.Tensor) -> None:
    """The gradient hook of an owned parameter."""
    entry = owner(param)
    if entry is not None:
        entry._on_grad(param)


def _pinned_empty(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


class OffloadedParam:
    def __init__(self, param: torch.Tensor, name: str, readers: list, offload_gradients: bool,
                 stream: Optional["torch.cuda.Stream"]):
        """readers: [(module, name)] of the FP8 modules that cast param (caches.readers_by_weight).
        The parameter and the modules are held weakly (_OWNED says why)."""
        self._param, self.name, self.dtype = weakref.ref(param), name, param.dtype
        self.readers = [(weakref.ref(module), attr) for module, attr in readers]
        self.kind = ("fp8" if readers else
                     "shared" if param.device.type == "cpu" and param.dtype == _F32 else "copy")
        self.stream = stream  # CUDA parameters: the side stream of the copies
        # offload_gradients=False keeps a copy parameter's gradient on the device (accumulated
        # there in its dtype) and copies the whole of it at each hook; fp8 ones always move
        self.accumulate = self.kind == "fp8" or offload_gradients
        self.master = param if self.kind == "shared" else self._make_master()
        self.staging: Optional[torch.Tensor] = None  # pinned landing buffer of a CUDA gradient
        self.event: Optional["torch.cuda.Event"] = None  # its copy, not yet added to the master
        self.version = param._version

    @property
    def param(self) -> Optional[torch.Tensor]:
        """The parameter, or None once the model let it go."""
        return self._param()

    @property
    def lossy(self) -> bool:
        """The model's copy of the weight (its state_dict) is rounded: the master must be saved."""
        return self.kind != "shared" and self.dtype != _F32

    def _make_master(self) -> torch.Tensor:
        p = self.param.detach()
        if p.device.type == "cuda":
            return _pinned_empty(p.shape, _F32).copy_(p)
        if self.kind == "fp8" and p.dtype == _F32:
            # the device is the host: the master takes over the parameter's storage (no copy)
            return torch.empty(0, dtype=_F32).set_(p)
        return p.to(_F32, copy=True)

    def install(self) -> None:
        """Make the model use the host copy: hooks, and for fp8 the placeholder parameter."""
        param = self.param
        _OWNED[param] = weakref.ref(self) if self.kind == "shared" else self
        if self.kind == "fp8":
            host = HostWeight(self.master, param.device, param.dtype, self.name)
            for cache in self._caches():
                # a cast made before now is remade from the master, with its scale, unstepped
                cache.invalidate(keep_scale=True)
            offload(param, host)
            for cache in self._caches():
                cache.host = host
            for ref, _ in self.readers:
                offload_state_dict.install(ref())
        if self.kind != "shared" and param.requires_grad:
            param.register_post_accumulate_grad_hook(_accumulated)
        if self.kind != "shared" and param.grad is not None:  # from a backward before now
            self._on_grad(param)

    def _caches(self) -> list:
        """The weight caches that cast this parameter now (a module converted again since has
        new ones)."""
        modules = [(ref(), name) for ref, name in self.readers]
        return [caches_by_name(module)[name] for module, name in modules
                if module is not None and name in caches_by_name(module)]

    # -- gradients ---------------------------------------------------------------------------
    def check_grad(self, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(f"CPUOffloadOptimizer: {self.name} got a sparse gradient; only "
                               f"dense gradients are supported (nn.Embedding(sparse=False))")

    def _on_grad(self, param: torch.Tensor) -> None:
        grad = param.grad
        self.check_grad(grad)
        if self.accumulate:
            param.grad = None  # the device keeps no gradient
        if grad.device.type == "cpu":
            self._add(grad, owned=self.accumulate)
            return
        self._fold()  # the previous micro-batch's copy is long done: add it before reusing
        if self.staging is None:
            self.staging = _pinned_empty(grad.shape, grad.dtype)
        self.stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self.stream):
            self.staging.copy_(grad, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        grad.record_stream(self.stream)  # freed on the device once the copy has run

    def _add(self, grad: torch.Tensor, owned: bool) -> None:
        """Accumulate (copy parameters that keep their device gradient: replace) in FP32."""
        master = self.master
        if master.grad is None or not self.accumulate:
            steal = owned and grad.dtype == _F32 and grad.is_contiguous()
            master.grad = grad if steal else grad.to(_F32, memory_format=torch.contiguous_format,
                                                     copy=True)
        else:
            master.grad.add_(grad)

    def _fold(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
            self._add(self.staging, owned=False)

    def gather(self) -> None:
        """The gradient on the host, complete, before the step or the clipping."""
        param = self.param
        if self.kind == "shared":
            if param.grad is not None:
                self.check_grad(param.grad)
            return
        if self.accumulate and param is not None and param.grad is not None:
            self._on_grad(param)  # a gradient that no hook saw (requires_grad set later)
        self._fold()

    def zero_grad(self, set_to_none: bool) -> None:
        self.event = None  # a copy in flight lands in staging and is dropped
        for t in (self.param,) if self.kind == "shared" else (self.master, self.param):
            if t is not None and t.grad is not None:
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.zero_()

    # -- weights -----------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self) -> None:
        """Before a step: a copy parameter changed on the device since the last step (a model
        checkpoint loaded, an in-place edit) becomes the master, unless it equals the master
        rounded to its dtype (the exact master loaded by the optimizer is kept then)."""
        param = self.param
        if self.kind != "copy" or param is None or param._version == self.version:
            return
        if not torch.equal(param, self.master.to(param.device, param.dtype)):
            if self.stream is not None:
                self.stream.synchronize()  # the last step's copy may still read the master
            self.master.copy_(param)
        self.version = param._version

    @torch.no_grad()
    def push(self) -> None:
        """After a step: a copy parameter's device values from the new master (fp8 ones are cast
        from the master by the next forward; shared ones are the master)."""
        param = self.param
        if self.kind != "copy" or param is None:
            return
        if self.stream is None:
            param.copy_(self.master)
        else:
            with torch.cuda.stream(self.stream):
                param.copy_(self.master, non_blocking=True)
        self.version = param._version

    @torch.no_grad()
    def load_master(self, value: torch.Tensor) -> None:
        """The exact FP32 master from an optimizer checkpoint."""
        self.master.copy_(value)
        if self.kind == "copy":
            self.push()
        for cache in self._caches():
            cache.invalidate(keep_scale=True)
