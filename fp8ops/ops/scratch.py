"""Reusable temporaries for the emulation's CPU kernels.

An op's intermediate tensors of a few MB cost more in page faults (the allocator hands freed
memory back to the OS and takes fresh pages next time) than the pass that fills them. A buffer
per (thread, slot, dtype) is kept and handed out again (at most 16 MiB each: at the training
demo's sizes the process keeps a few tens of MB). Only an op's internals use these: no output
is ever a scratch tensor, and each slot has one live user at a time.

A buffer made under torch.inference_mode() is an inference tensor, which may not be written in
place outside it: inference mode and normal mode keep separate buffers, so an inference forward
never leaves a buffer that a later training step cannot use.
"""
from __future__ import annotations

import math
import threading

import torch

_KEEP_BYTES = 16 << 20  # larger temporaries are allocated each time, not kept


class _Buffers(threading.local):
    def __init__(self):
        self.base = {}  # (inference mode, slot, dtype) -> flat buffer
        # (inference mode, slot, dtype, shape, device) -> view of the buffer (shapes repeat)
        self.views = {}


_BUFFERS = _Buffers()


def scratch(slot: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized contiguous tensor of `shape` for temporary use under the name `slot`."""
    shape = tuple(shape)
    base_key = (torch.is_inference_mode_enabled(), slot, dtype)
    view = _BUFFERS.views.get(base_key + (shape, device))
    if view is not None:
        return view
    n = math.prod(shape)
    if torch.device(device).type != "cpu" or n * dtype.itemsize > _KEEP_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = _BUFFERS.base.get(base_key)
    if buf is None or buf.numel() < n:
        buf = _BUFFERS.base[base_key] = torch.empty(n, dtype=dtype)
        for key in [k for k in _BUFFERS.views if k[:3] == base_key]:
            del _BUFFERS.views[key]  # views of the old, smaller buffer
    if len(_BUFFERS.views) > 4096:  # many distinct shapes: start over rather than grow
        _BUFFERS.views.clear()
    view = _BUFFERS.views[base_key + (shape, device)] = buf[:n].view(shape)
    return view


def scratch_like(slot: str, t: torch.Tensor, dtype: torch.dtype = None) -> torch.Tensor:
    return scratch(slot, t.shape, dtype or t.dtype, t.device)


def kept_buffers() -> list:
    """This thread's kept buffers (for memory accounting: they stay alive between ops)."""
    return list(_BUFFERS.base.values())


def release() -> None:
    """Drop this thread's kept buffers (the next ops allocate afresh)."""
    _BUFFERS.views.clear()
    _BUFFERS.base.clear()
