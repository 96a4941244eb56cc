"""Reusable temporaries for the emulation's CPU kernels.

An op's intermediate tensors of a few MB cost more in page faults (the allocator hands freed
memory back to the OS and takes fresh pages next time) than the pass that fills them. A buffer
per (thread, slot, dtype) is kept and handed out again. Only an op's internals use these: no
output is ever a scratch tensor, and each slot has one live user at a time.
"""
from __future__ import annotations

import math
import threading

import torch

_KEEP_BYTES = 64 << 20  # larger temporaries are allocated each time, not kept


class _Buffers(threading.local):
    def __init__(self):
        self.by_slot = {}


_BUFFERS = _Buffers()


def scratch(slot: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized contiguous tensor of `shape` for temporary use under the name `slot`."""
    device = torch.device(device)
    n = math.prod(shape)
    if device.type != "cpu" or n * dtype.itemsize > _KEEP_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    shape = tuple(shape)
    entry = _BUFFERS.by_slot.get((slot, dtype))
    if entry is None or entry[0].numel() < n:
        entry = (torch.empty(n, dtype=dtype), {})  # the buffer and its views by shape
        _BUFFERS.by_slot[(slot, dtype)] = entry
    view = entry[1].get(shape)
    if view is None:  # shapes repeat step after step: keep the view, saving two op calls
        view = entry[1][shape] = entry[0][:n].view(shape)
    return view


def scratch_like(slot: str, t: torch.Tensor, dtype: torch.dtype = None) -> torch.Tensor:
    return scratch(slot, tuple(t.shape), dtype or t.dtype, t.device)
