"""The values of an FP8 weight kept on the host (FP8 primary weights).

When a CPUOffloadOptimizer owns a weight that FP8 layers cast (an FP8Linear weight, an
FP8GroupedLinear's or a converted transformers experts module's 3-D weight), the FP32 master copy
on the host is the only high-precision copy of that weight: the parameter on the device becomes a
placeholder (one element broadcast to the weight's shape) and the layer's weight cache reads the
values to cast from here, once per optimizer step (weight_cache). On a CPU-only machine the
device is the host and the cast reads the master itself.

The placeholder keeps the Parameter object (its identity, hooks, requires_grad, shape, dtype and
device: what modules, autograd, optimizers and references held by the user rely on) and becomes
an OffloadedWeight: any torch function that would read or write its values raises an error that
says where the values are, instead of computing on the placeholder. Copies and pickles of it are
ordinary parameters holding the master's values.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves


class HostWeight:
    """The FP32 master of one FP8 weight, the device and dtype of its parameter, and the name
    the optimizer gave it (for errors)."""

    def __init__(self, master: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 name: str):
        self.master = master
        self.device = torch.device(device)
        self.dtype = dtype
        self.name = name

    def __reduce__(self):
        # the optimizer's ownership is not copied: a copied or unpickled layer casts its own
        # weight (OffloadedWeight copies to an ordinary parameter), and no master is duplicated
        return _unowned, ()

    def device_values(self) -> torch.Tensor:
        """The values to cast to FP8, on the device: the master itself when the device is the
        host, else a transient copy (non-blocking from pinned memory, on the current stream)."""
        if self.master.device == self.device:
            return self.master
        return self.master.to(self.device, non_blocking=True)

    def values_for(self, weight: torch.Tensor) -> torch.Tensor:
        """device_values() in the layout of `weight`: the placeholder parameter, or an alias of
        it that a layer casts (its transpose: experts stored [E, in, out])."""
        values = self.device_values()
        for func, args, kwargs in getattr(weight, "_layout", ()):
            values = func(values, *args, **kwargs)
        return values

    def param_value(self) -> torch.Tensor:
        """The weight as an ordinary parameter would hold it: a new tensor with the master's
        values in the parameter's dtype, on the device."""
        return self.master.detach().to(self.device, self.dtype, copy=True)

    def state_value(self) -> torch.Tensor:
        """The weight as the model's state_dict gives it: the master in the parameter's dtype, on
        the host (the master itself for a float32 parameter)."""
        return self.master.detach().to(self.dtype)

    @torch.no_grad()
    def load_(self, value: torch.Tensor) -> bool:
        """Take the weight from a checkpoint; whether the master changed. A value equal to the
        master rounded to the parameter's dtype leaves the master as it is, so loading the model
        after the optimizer keeps the optimizer's exact FP32 master."""
        value = value.detach().to("cpu")
        if value.dtype == self.dtype and torch.equal(value, self.master.to(self.dtype)):
            return False
        if self.master.is_pinned():  # a copy of the old values may still be in flight
            torch.cuda.synchronize(self.device)
        self.master.copy_(value)
        return True


def _unowned() -> None:
    """What a HostWeight copies and unpickles to: none (see HostWeight.__reduce__)."""
    return None


# What may be done with an OffloadedWeight: everything that reads only what the placeholder has
# right (shape, dtype, device, autograd state, storage identity) or acts on the gradient.
_METADATA = (
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
    torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage, torch.Tensor.element_size, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.is_signed, torch.Tensor.is_contiguous,
    torch.Tensor.get_device, torch.Tensor.is_pinned, torch.Tensor.is_inference,
    torch.Tensor.is_shared, torch.Tensor.__len__, torch.Tensor.__dir__, torch.Tensor.__format__,
    torch.Tensor.requires_grad_, torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.retain_grad,
    torch.Tensor._is_view, torch._has_compatible_shallow_copy_type, torch.Tensor.is_conj,
    torch.Tensor.is_neg, torch.Tensor._is_zerotensor,
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
)
# views that keep the guard: the alias knows its layout (HostWeight.values_for)
_ALIASES = (torch.Tensor.detach, torch.Tensor.t, torch.Tensor.transpose)
# conversions, allowed when they change nothing (model.to(its own device), model.float())
_CONVERSIONS = (
    torch.Tensor.to, torch.Tensor.type, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.half,
    torch.Tensor.float, torch.Tensor.double, torch.Tensor.bfloat16,
)
# attributes whose getter returns a view of the values
_VALUE_VIEWS = ("data", "T", "mT", "H", "mH", "real", "imag")
# the type of an attribute's getter or setter as __torch_function__ receives it
_ACCESSOR = type(torch.Tensor.shape.__get__)


def _what(func: Callable) -> str:
    """The name of what func does, for errors: "norm", ".T", ".data = ..."."""
    if type(func) is _ACCESSOR:
        name = func.__self__.__name__
        return f".{name} = ..." if func.__name__ == "__set__" else f".{name}"
    return getattr(func, "__name__", repr(func))


class _Offloaded:
    """The behaviour shared by an OffloadedWeight and its detached aliases."""

    _host: HostWeight

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args and isinstance(args[0], _Offloaded) else next(
            a for a in tree_leaves((args, kwargs)) if isinstance(a, _Offloaded))
        if type(func) is _ACCESSOR:  # an attribute's getter or setter
            name, setter = func.__self__.__name__, func.__name__ == "__set__"
            if name == "data" and not setter:  # p.data: an alias that keeps the guard
                return _alias(self, func, args, {})
            if name == "data" and args[1] is self:  # Module._apply after a no-op conversion
                return None
            if name not in _VALUE_VIEWS:
                return _call(func, args, kwargs)
        elif func in _METADATA:
            return _call(func, args, kwargs)
        elif func in _ALIASES:
            # an alias that keeps the guard (FP8Conv1D passes weight.t() to the FP8 linear,
            # transformers experts stored [E, in, out] their transpose to the grouped one)
            return _alias(self, func, args, kwargs)
        elif func in _CONVERSIONS:
            return _convert(self, func, args, kwargs)
        raise RuntimeError(
            f"{_owned(self._host)} It cannot be read or written here ({_what(func)}): the "
            f"device keeps only its FP8 cast. Read the weight with opt.master_of(param) (the "
            f"FP32 master) or model.state_dict() (in the parameter's dtype), load new values "
            f"with model.load_state_dict(), or train an independent copy.deepcopy(model).")

    def __repr__(self) -> str:
        host = self._host
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}): {host.name}, owned by a CPUOffloadOptimizer; its values "
                f"are the optimizer's FP32 master on the host (opt.master_of(param))")

    def __deepcopy__(self, memo):
        # a copy is the weight itself, an ordinary tensor or parameter owned by no optimizer
        if id(self) not in memo:
            memo[id(self)] = _real(self)
        return memo[id(self)]

    def __reduce_ex__(self, proto):
        return _real(self).__reduce_ex__(proto)


class OffloadedWeight(_Offloaded, nn.Parameter):
    """An FP8 weight parameter owned by a CPUOffloadOptimizer: its shape, dtype, device,
    gradient and hooks are the parameter's, its values are the host master's. A torch function
    that reads or writes values raises (saying where they are), as does moving or converting
    it; metadata, gradients, detach() (a guarded alias) and no-op conversions work; a copy or a
    pickle is an ordinary nn.Parameter with the master's values in the parameter's dtype, on
    its device. Made by offload() (the class of the existing Parameter object changes, as
    torch's lazy modules' UninitializedParameter does the other way), never constructed."""


class OffloadedWeightAlias(_Offloaded, torch.Tensor):
    """param.detach() or param.data of an OffloadedWeight: guarded as the parameter is."""


def offload(param: nn.Parameter, host: HostWeight) -> None:
    """Make `param` (an nn.Parameter, kept as the same object) the placeholder of the weight
    whose values `host` holds: one element on the device (NaN, should anything reach it past
    the guard) broadcast to the parameter's shape."""
    with torch.no_grad():
        param.data = torch.full((), float("nan"), dtype=param.dtype,
                                device=param.device).expand(param.shape)
    param._host = host
    param.__class__ = OffloadedWeight


def _call(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _alias(self: _Offloaded, func, args, kwargs) -> OffloadedWeightAlias:
    alias = _call(func, args, kwargs).as_subclass(OffloadedWeightAlias)
    alias._host = self._host
    layout = getattr(self, "_layout", ())
    if func is torch.Tensor.t or func is torch.Tensor.transpose:
        layout = (*layout, (func, args[1:], kwargs))
    alias._layout = layout
    return alias


def _convert(self: _Offloaded, func, args, kwargs):
    """func(self, ...) for a conversion that changes nothing (it returns self) or a query
    (p.type()); an error for any other. Tried on a 0-dim stand-in with the same dtype and
    device, so that nothing of the weight's size is allocated."""
    stand_in = torch.empty((), dtype=self.dtype, device=self.device)
    out = func(stand_in, *args[1:], **kwargs)
    if out is stand_in:
        return self
    if not isinstance(out, torch.Tensor):
        return out
    raise RuntimeError(f"{_owned(self._host)} It cannot be moved or converted ({_what(func)}) "
                       f"while the optimizer owns it: move or convert the model before building "
                       f"the CPUOffloadOptimizer.")


def _real(self: _Offloaded) -> torch.Tensor:
    value = self._host.param_value()
    if isinstance(self, nn.Parameter):
        return nn.Parameter(value, requires_grad=self.requires_grad)
    return value


def _owned(host: HostWeight) -> str:
    return (f"fp8ops: {host.name} is an FP8 weight owned by a CPUOffloadOptimizer; its "
            f"values are the optimizer's FP32 master on the host.")
