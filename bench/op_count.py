"""Operator calls of one FP8Linear training step (forward + backward, the weight cast cached), per
recipe, counted on the CPU along the Python path a CUDA device takes: the launches a GPU step pays
for in host time, measurable without a GPU.

    python bench/op_count.py            # the table; tests/test_op_budget.py holds the budget

Counted with a TorchDispatchMode: each call reaching the dispatcher once (an fp8ops op is one
call, whatever its kernel does inside). "launches" leaves out the calls that only make views or
metadata (no kernel on a GPU); "host syncs" are device-to-host reads (.item(), a tensor used as a
Python bool); "activation copies" are copies or pads of a tensor as large as the input or the
output gradient (for aligned shapes there should be none)."""
from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp8ops  # noqa: E402
from fp8ops import _emulation  # noqa: E402

_aten = torch.ops.aten
NO_KERNEL = {_aten.view.default, _aten._unsafe_view.default, _aten.t.default,
             _aten.transpose.int, _aten.alias.default, _aten.slice.Tensor,
             _aten.as_strided.default, _aten.detach.default, _aten.expand.default,
             _aten.unsqueeze.default, _aten.squeeze.dim, _aten.select.int,
             _aten.lift_fresh.default, _aten.permute.default, _aten.reshape.default}
HOST_SYNC = {_aten._local_scalar_dense.default, _aten.is_nonzero.default,
             _aten.equal.default}
COPIES = {_aten.clone.default, _aten.copy_.default, _aten.constant_pad_nd.default,
          _aten._to_copy.default, _aten.contiguous.default}

RECIPES = {
    "delayed": lambda: fp8ops.DelayedScaling(),
    "current": lambda: fp8ops.CurrentScaling(),
    "mxfp8": lambda: fp8ops.MXFP8Scaling(),
    "blockwise": lambda: fp8ops.BlockwiseScaling(),
}


class _Counter(TorchDispatchMode):
    def __init__(self, large: int):
        super().__init__()
        self.calls: Counter = Counter()
        self.large = large  # numel from which a copy is an activation copy
        self.activation_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls[func] += 1
        if func in COPIES and isinstance(out, torch.Tensor) and out.numel() >= self.large:
            self.activation_copies += 1
        return out


@contextmanager
def _device_path():
    """The emulation's Python takes the branch a GPU tensor takes (no host fast path)."""
    saved = _emulation._on_host
    _emulation._on_host = lambda t: False
    try:
        yield
    finally:
        _emulation._on_host = saved


def count_step(layer: torch.nn.Module, m: int = 256, warmup: int = 3) -> dict:
    """The counts of one forward + backward of `layer` on an [m, in_features] batch, after
    `warmup` steps (the weight cast is cached by then)."""
    k, n = layer.in_features, layer.out_features
    x = torch.randn(m, k, requires_grad=True)
    dy = torch.randn(m, n)
    with _device_path():
        for _ in range(warmup):
            layer(x).backward(dy)
        with _Counter(large=min(m * k, m * n)) as counter:
            layer(x).backward(dy)
    calls = counter.calls
    return {
        "calls": sum(calls.values()),
        "launches": sum(c for f, c in calls.items() if f not in NO_KERNEL),
        "host_syncs": sum(c for f, c in calls.items() if f in HOST_SYNC),
        "activation_copies": counter.activation_copies,
        "by_op": {str(f): c for f, c in calls.most_common()},
    }


def table(k: int = 256, n: int = 256) -> dict:
    out = {"nn.Linear": count_step(torch.nn.Linear(k, n))}
    for name, recipe in RECIPES.items():
        out[name] = count_step(fp8ops.FP8Linear(k, n, recipe=recipe()))
    return out


def main() -> None:
    rows = table()
    print("| layer | calls | launches | host syncs | activation copies |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['calls']} | {r['launches']} | {r['host_syncs']} | "
              f"{r['activation_copies']} |")
    for name, r in rows.items():
        print(f"\n{name}: " + ", ".join(f"{op} x{c}" for op, c in r["by_op"].items()))


if __name__ == "__main__":
    main()
