"""Exact byte counts of the tensors a model keeps on its device between optimizer steps.

Bytes are those of the storages kept alive, each counted once (a transposed view shares its
storage). On a CPU-only machine the device is the host: the counts are what a GPU would hold
for the same model and optimizer (a CPUOffloadOptimizer's masters, host gradients and state are
host memory wherever they run, and are not counted). Of a DTensor (FSDP2's sharded parameters,
their gradients and optimizer state) the local shard is counted: what this rank holds.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn


def _tensors(obj) -> Iterable[torch.Tensor]:
    """Every tensor in obj (a tensor, or nested tuples, lists and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (FSDP2's sharded parameters, gradients and optimizer state): the
    bytes this rank holds."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def _count(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        t = _local(t)
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def fp8_weight_tensors(layer) -> list:
    """What an FP8Linear keeps on its device for its weight: the weight parameter (a one-element
    placeholder when a CPUOffloadOptimizer owns it), its gradient, and the cached FP8 cast (data,
    transposed copy, scales) that forwards reuse until the next optimizer step."""
    return [layer.weight, layer.weight.grad, *layer.fp8_state.weight_cache.payload_tensors()]


def expert_cast_tensors(module) -> list:
    """The cached FP8 casts of a mixture-of-experts module's 3-D weights: an FP8GroupedLinear's,
    or those of a transformers experts module convert_to_fp8 converted (fp8_weight_caches)."""
    from .nn.caches import caches_by_name
    return [t for c in caches_by_name(module).values() for t in c.payload_tensors()]


def fp8_weight_bytes(layer) -> int:
    """Bytes of fp8_weight_tensors(layer), each storage once."""
    return _count(fp8_weight_tensors(layer), set())


def device_state_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None
                       ) -> dict:
    """{"parameters", "gradients", "fp8_weights", "buffers", "optimizer_state", "total"}: bytes
    on the model's device of its parameters, their gradients, the FP8Linear layers' cached FP8
    weights (and the grouped layers' cached expert casts: expert_cast_tensors), the model's
    buffers (FP8 scaling state included) and the optimizer's state (a torch optimizer's; a
    CPUOffloadOptimizer keeps its state on the host). Count just before optimizer.step() to
    include the gradients of a whole backward."""
    from .nn.modules import FP8Linear
    from .optim.offload import CPUOffloadOptimizer

    seen: set = set()
    params = list(model.parameters())
    host_grads = set()
    if isinstance(optimizer, CPUOffloadOptimizer):
        # on a CPU-only machine a float32 parameter's gradient is its master's: host memory
        host_grads = {id(e.master.grad) for e in optimizer._params if e.master.grad is not None}
    counts = {
        "parameters": _count(params, seen),
        "gradients": _count((p.grad for p in params if id(p.grad) not in host_grads), seen),
        "fp8_weights": _count((t for m in model.modules()
                               for t in (fp8_weight_tensors(m) if isinstance(m, FP8Linear)
                                         else expert_cast_tensors(m))), seen),
        "buffers": _count(model.buffers(), seen),
        "optimizer_state": 0,
    }
    if optimizer is not None and not isinstance(optimizer, CPUOffloadOptimizer):
        counts["optimizer_state"] = _count(_tensors(list(optimizer.state.values())), seen)
    counts["total"] = sum(counts.values())
    return counts
