"""CPUOffloadOptimizer: FP32 master weights and optimizer state on the host; the FP8 weights it
owns (FP8Linear, FP8GroupedLinear and converted transformers experts weights) live on the device
in FP8 only (offload_param.py says how each parameter moves).

The host step is torch's own optimizer (one instance of `optimizer_class` over the host masters,
so its state_dict is torch's format and its step is torch's arithmetic). It subclasses
torch.optim.Optimizer, without Optimizer.__init__ (as torchao's CPUOffloadOptimizer), so that LR
schedulers accept it; param_groups, defaults and state are the host optimizer's own.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.optim import Optimizer

from .host_weight import OffloadedWeight
from ..nn.caches import readers_by_weight
from ..nn.sharding import is_dtensor
from .offload_param import OffloadedParam, owner

# torch optimizers with a fused CPU step: the host step uses it unless fused/foreach are given
_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _check_optimizer_class(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"CPUOffloadOptimizer: optimizer_class must be a torch.optim.Optimizer "
                        f"subclass (e.g. torch.optim.AdamW), got {cls!r}")
    if issubclass(cls, CPUOffloadOptimizer):
        raise TypeError("CPUOffloadOptimizer: optimizer_class cannot be CPUOffloadOptimizer")
    if issubclass(cls, torch.optim.LBFGS):
        raise TypeError("CPUOffloadOptimizer: LBFGS re-evaluates the model inside its step, "
                        "which needs the new weights on the device at every evaluation; use it "
                        "without offloading")


def _describe(name: Optional[str], group: int, index: int, param) -> str:
    if name is not None:
        return f"parameter '{name}'"
    shape = tuple(param.shape) if isinstance(param, torch.Tensor) else None
    return f"parameter {index} of param group {group} (shape {shape})"


def _check_param(param, what: str) -> None:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"CPUOffloadOptimizer can only optimize Tensors, but {what} is a "
                        f"{torch.typename(param)}")
    if not param.is_leaf:
        raise ValueError(f"CPUOffloadOptimizer: {what} is not a leaf tensor (it is computed "
                         f"from other tensors); pass the model's parameters")
    if param.device.type not in ("cpu", "cuda"):
        raise ValueError(f"CPUOffloadOptimizer: {what} is on {param.device}; only CPU and "
                         f"CUDA parameters are supported")
    if is_dtensor(param):
        raise ValueError(
            f"CPUOffloadOptimizer: {what} is a DTensor (sharded by FSDP2 or tensor parallelism). "
            f"Under FSDP2 keep the sharded FP32 weights and the optimizer state on the host with "
            f"torch's own fully_shard(module, offload_policy=CPUOffloadPolicy()) and a plain "
            f"torch.optim optimizer: FP8 weights are still all-gathered in FP8")
    if not param.is_floating_point():
        raise TypeError(f"CPUOffloadOptimizer: {what} has dtype {param.dtype}; only floating "
                        f"point parameters are supported")


def _check_not_owned(param, what: str) -> None:
    if owner(param) is not None or isinstance(param, OffloadedWeight):
        raise ValueError(
            f"CPUOffloadOptimizer: {what} is already owned by another CPUOffloadOptimizer (built "
            f"earlier over the same model), which keeps its master and takes its gradients; "
            f"one CPUOffloadOptimizer per model. To train a separate copy, build the second "
            f"optimizer over copy.deepcopy(model)")


class CPUOffloadOptimizer(Optimizer):
    """optimizer_class's step on the host, on FP32 master copies of `params`.

    params: model.parameters(), model.named_parameters() (names then appear in errors and in
    param_groups' "param_names", as with torch optimizers) or param groups. kwargs go to
    optimizer_class; Adam, AdamW, SGD and Adagrad get fused=True unless fused or foreach is given.

    - An FP8 weight among `params` (an FP8Linear weight, an FP8GroupedLinear's or a converted
      transformers experts module's 3-D weight) is kept on the device only as its FP8 cast
      (data, the transposed copy backward needs, scales); its parameter becomes a placeholder
      (the same object, an OffloadedWeight: shape, dtype, device and gradient as before, but
      reading or writing its values raises; master_of(param) gives them) and its gradient goes
      to the host as backward produces it. copy.deepcopy(model) and torch.save(model) give ordinary
      parameters with the masters' values.
    - A parameter belongs to one CPUOffloadOptimizer: one already owned by another raises.
    - Any other parameter keeps a device copy in its own dtype, refreshed after each step. Its
      gradient goes to the host too and leaves the device (offload_gradients=True), or stays
      there, accumulated in its dtype, and is copied whole (offload_gradients=False).
    - Gradients are accumulated on the host in FP32 across micro-batches.
    - skip_nonfinite=True: step() skips the update when the gradients' total norm is not
      finite: a gradient holds inf or NaN (or is so large that the norm overflows float32). The
      norm of clip_grad_norm_ since the last step is reused (the check is then free), else one
      pass computes it. `last_step_skipped` and `skipped_steps` record it. Off by default, as in
      torch optimizers: that pass cost a tenth to a third of a fused AdamW step on a CPU.
    On a CPU-only machine the device is the host: float32 parameters that no FP8 layer reads are
    stepped in place, and the results are those of optimizer_class on the same model.
    """

    def __init__(self, params, optimizer_class, *, offload_gradients: bool = True,
                 skip_nonfinite: bool = False, **kwargs):
        _check_optimizer_class(optimizer_class)
        if optimizer_class in _FUSED_ON_CPU and "fused" not in kwargs and "foreach" not in kwargs:
            kwargs["fused"] = True
        if isinstance(params, torch.Tensor) or isinstance(params, dict):
            raise TypeError("CPUOffloadOptimizer: params must be an iterable of Tensors or of "
                            f"param group dicts, got {torch.typename(params)}")
        groups = list(params)
        if not groups:
            raise ValueError("CPUOffloadOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.offload_gradients = offload_gradients
        self.skip_nonfinite = skip_nonfinite
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._params: list[OffloadedParam] = []  # in the host optimizer's order
        self._streams: dict = {}
        self._total_norm: Optional[torch.Tensor] = None  # from clip_grad_norm_ since the step
        taken: set = set()
        offloaded = [self._offload(group, i, taken) for i, group in enumerate(groups)]
        # built before the model changes: a bad kwarg leaves the model as it was
        self.optimizer = optimizer_class([host for host, _ in offloaded], **kwargs)
        for _, entries in offloaded:
            self._install(entries)

    # -- building ----------------------------------------------------------------------------
    def _offload(self, group, index: int, taken: set):
        """(the host param group, its OffloadedParams, not yet installed). taken: ids of the
        parameters of the groups offloaded before this one and not installed yet."""
        if not isinstance(group, dict):
            raise TypeError(f"CPUOffloadOptimizer: param group {index} is a "
                            f"{torch.typename(group)}, not a dict")
        params = group["params"]
        if isinstance(params, set):
            raise TypeError("CPUOffloadOptimizer: parameters must be in an ordered collection "
                            "(a list), not a set")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = [p[0] if isinstance(p, tuple) else None for p in params]
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        installed = {id(e.param) for e in self._params}
        for i, (name, p) in enumerate(zip(names, tensors)):
            what = _describe(name, index, i, p)
            _check_param(p, what)
            if id(p) in installed or id(p) in taken:
                raise ValueError(f"CPUOffloadOptimizer: {what} appears more than once")
            _check_not_owned(p, what)
            taken.add(id(p))
        readers = readers_by_weight(tensors)
        for i, (name, p) in enumerate(zip(names, tensors)):
            if id(p) in readers and type(p) is not torch.nn.Parameter:
                raise TypeError(f"CPUOffloadOptimizer: {_describe(name, index, i, p)} is an "
                                f"FP8 weight of type {type(p).__qualname__}; only a plain "
                                f"nn.Parameter can be offloaded")
        entries = [OffloadedParam(p, _describe(name, index, i, p), readers.get(id(p), []),
                                  self.offload_gradients, self._stream(p.device))
                   for i, (name, p) in enumerate(zip(names, tensors))]
        host = {k: v for k, v in group.items() if k != "params"}
        host["params"] = [(n, e.master) if n is not None else e.master
                          for n, e in zip(names, entries)]
        return host, entries

    def _install(self, entries) -> None:
        for entry in entries:
            entry.install()
            self._params.append(entry)

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def add_param_group(self, param_group: dict) -> None:
        host, entries = self._offload(dict(param_group), len(self.param_groups), set())
        self.optimizer.add_param_group(host)
        self._install(entries)

    # -- the host optimizer's own ------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.optimizer.param_groups = groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    @property
    def state(self):
        return self.optimizer.state

    def __repr__(self) -> str:
        return f"CPUOffloadOptimizer({self.optimizer!r})"

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The FP32 master of `param` (one of this optimizer's parameters), on the host: the
        tensor the step updates, for an FP8 weight the only copy of its values. For
        reading (norms, logging); change weights through model.load_state_dict()."""
        for entry in self._params:
            if entry.param is param:
                return entry.master
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) else None
        raise ValueError(f"CPUOffloadOptimizer.master_of: the {torch.typename(param)} of shape "
                         f"{shape} is not one of this optimizer's parameters")

    # -- the step ----------------------------------------------------------------------------
    def _gather(self) -> None:
        for entry in self._params:
            entry.refresh()
            entry.gather()

    def _grads_finite(self) -> bool:
        if self._total_norm is not None:
            return bool(torch.isfinite(self._total_norm))
        grads = [e.master.grad for e in self._params if e.master.grad is not None]
        # the 2-norm: one fast foreach pass (the inf-norm is many times slower on the CPU);
        # NaN and inf carry through it
        return not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads, 2.0)))

    def _push(self) -> None:
        streams = set(self._streams.values())
        for s in streams:  # the device copies are written once the device is done reading them
            s.wait_stream(torch.cuda.current_stream(s.device))
        for entry in self._params:
            entry.push()
        for s in streams:  # and read by the next forward only once written
            torch.cuda.current_stream(s.device).wait_stream(s)

    @torch.no_grad()
    def step(self, closure=None):
        """One step of the host optimizer on the masters (skipped when a gradient is not finite
        and skip_nonfinite is set). Returns the closure's loss, as torch optimizers do."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._gather()
        self.last_step_skipped = self.skip_nonfinite and not self._grads_finite()
        if self.last_step_skipped:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
            self._push()
        self._total_norm = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for entry in self._params:
            entry.zero_grad(set_to_none)
        self._total_norm = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the host gradients (the ones the step uses), in
        this optimizer's parameter order; returns the total norm (a host tensor)."""
        self._gather()
        masters = [e.master for e in self._params if e.master.grad is not None]
        self._total_norm = torch.nn.utils.clip_grad_norm_(masters, max_norm, norm_type,
                                                          error_if_nonfinite, foreach)
        return self._total_norm

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The host optimizer's state_dict (torch's format), plus "masters": {index: FP32
        master} for parameters whose model copy is rounded (not float32), so a resume is exact."""
        state = self.optimizer.state_dict()
        masters = {i: e.master for i, e in enumerate(self._params) if e.lossy}
        if masters:
            state["masters"] = masters
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("masters", {})
        for device in self._streams:  # copies from the masters may still be in flight
            torch.cuda.synchronize(device)
        self.optimizer.load_state_dict(state_dict)
        for index, value in masters.items():
            if not 0 <= int(index) < len(self._params):
                raise ValueError(f"CPUOffloadOptimizer.load_state_dict: master {index} is out of "
                                 f"range ({len(self._params)} parameters)")
            self._params[int(index)].load_master(value)
