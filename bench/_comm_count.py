"""Count the collectives a piece of torch.distributed code sends: calls and bytes of all-gathers,
reduce-scatters, all-reduces and all-to-alls, as the c10d backend gets them.

    with CommCount() as count:
        loss = model(x).sum(); loss.backward(); opt.step()
    count.bytes["all_gather"], count.calls["all_reduce"], ...

It is a TorchDispatchMode that sees the c10d ops (`torch.ops.c10d._allgather_base_`,
`_reduce_scatter_base_`, `allreduce_`, ...) the torch.distributed functions issue, with their
tensors. torch's own CommDebugMode sees the same ops but keeps only call counts. Bytes are those
of the full buffer: an all-gather's output (what every rank holds afterwards, its own shard
included), a reduce-scatter's input (the unsharded gradient every rank contributes), an
all-reduce's tensors, an all-to-all's input (what this rank sends, its own part included).
Collectives issued from inside another tensor's __torch_dispatch__ (DTensor
redistributions, e.g. clip_grad_norm_ over sharded gradients) are not seen: a dispatch mode is
off while it handles an op. Functional collectives (`_c10d_functional`) called directly are.

`by_param` (FSDP2 only, from its private all-gather input hook; empty where that hook is not
there): bytes each parameter contributed to all-gathers, by FQN, times the world size, so that
they add up to `bytes["all_gather"]`.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_KINDS = {  # c10d op name (without overload) -> kind
    "c10d._allgather_base_": "all_gather", "c10d.allgather_": "all_gather",
    "c10d.allgather_coalesced_": "all_gather",
    "c10d.allgather_into_tensor_coalesced_": "all_gather",
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "_c10d_functional.all_gather_into_tensor_coalesced": "all_gather",
    "c10d._reduce_scatter_base_": "reduce_scatter", "c10d.reduce_scatter_": "reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional.reduce_scatter_tensor_coalesced": "reduce_scatter",
    "c10d.allreduce_": "all_reduce", "c10d.allreduce_coalesced_": "all_reduce",
    "_c10d_functional.all_reduce": "all_reduce",
    "_c10d_functional.all_reduce_coalesced": "all_reduce",
    "c10d.alltoall_base_": "all_to_all", "c10d.alltoall_": "all_to_all",
    "_c10d_functional.all_to_all_single": "all_to_all",
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "other")


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommCount(TorchDispatchMode):
    """Calls and bytes of each kind of collective issued while active (see the module doc)."""

    def __init__(self):
        super().__init__()
        self.calls = dict.fromkeys(KINDS, 0)
        self.bytes = dict.fromkeys(KINDS, 0)
        self.by_param: "dict[str, int]" = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            name = f"{ns}.{func._opname}"
            kind = _KINDS.get(name)
            if kind is None:
                if name.startswith("c10d.barrier") or name.startswith("_c10d_functional.wait"):
                    return func(*args, **kwargs)
                kind = "other"
            self.calls[kind] += 1
            if kind == "all_gather":  # the output: the first argument (c10d) or the result
                self.bytes[kind] += _nbytes(args[0]) if ns == "c10d" else 0
            elif kind in ("reduce_scatter", "all_to_all"):  # the input: the second argument
                self.bytes[kind] += _nbytes(args[1] if ns == "c10d" else args[0])  # (c10d) or first
            elif kind == "all_reduce":
                self.bytes[kind] += _nbytes(args[0])
            out = func(*args, **kwargs)
            if kind == "all_gather" and ns == "_c10d_functional":
                self.bytes[kind] += _nbytes(out)
            return out
        return func(*args, **kwargs)

    # FSDP2's per-parameter all-gather inputs --------------------------------------------------
    def __enter__(self):
        self._patched = None
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
        except ImportError:
            coll = None
        if coll is not None and hasattr(coll, "_get_param_all_gather_inputs"):
            original = coll._get_param_all_gather_inputs

            def recorded(fsdp_params):
                inputs = original(fsdp_params)
                for fsdp_param, ts in zip(fsdp_params, inputs):
                    world = fsdp_param.mesh_info.shard_mesh_size
                    fqn = fsdp_param._param_fqn or fsdp_param._module_info.param_name
                    self.by_param[fqn] += world * sum(_nbytes(t) for t in ts)
                return inputs

            coll._get_param_all_gather_inputs = recorded
            self._patched = (coll, original)
        return super().__enter__()

    def __exit__(self, *exc):
        if self._patched is not None:
            coll, original = self._patched
            coll._get_param_all_gather_inputs = original
        return super().__exit__(*exc)

    def summary(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes),
                "by_param": dict(self.by_param)}
