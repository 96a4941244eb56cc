"""One amax all-reduce per backward pass for every delayed-scaling layer under torch.distributed.

A delayed-scaling cast records its amax on its own rank (ScalingState.record_locally), a shard
of a tensor-parallel tensor too, and so does a grouped layer's cast of its experts
(ExpertScalingState: an amax per expert, every rank's records of expert g folded into expert
g's). The records of every layer whose backward ran are folded across the ranks by one MAX
all-reduce per process group (plus one over the TP mesh where the group leaves out the other
shards), run when the backward pass ends (an autograd engine callback of the running graph
task), instead of one per layer: a transformer of L layers makes 1 small collective per step,
not 7 L, and the step's latency no longer grows with depth.

Every rank runs the same layers' backward in the same order, so every rank packs the same
buffers in the same order (the assumption one all-reduce per layer made too). A record that a
role needs before the backward ends (its next step) is reduced at once by its state
(ScalingState.reduce_records); the callback skips states with nothing left to reduce. Outside an
autograd backward and under torch.compile (the engine's callback cannot be traced) a layer
reduces its own records at the end of its backward, as before.
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch

from .agreement import check_recipes

_lock = threading.Lock()
# graph task id -> weak references to the states whose records its backward left, in order
_pending: "dict[int, list[weakref.ref]]" = {}


def reduce_states(states) -> None:
    """One MAX all-reduce per process group (in the order the groups first appear) of every
    role's pending amax and non-finite count of `states`: each rank's records folded into all.
    Between reductions a role's records on one rank can only raise these, from values equal on
    every rank, so the MAX is the pending amax of all ranks' finite amaxes, and the count grows
    by the most non-finite casts any rank saw."""
    groups: "dict[int, tuple]" = {}
    for state in states:
        group = state.recipe.process_group
        groups.setdefault(id(group), (group, []))[1].append(state)
    for group, members in groups.values():
        check_recipes(members[0].recipe, group)
        _all_reduce_max([_buffers(s) for s in members], group)
        if group is not None:
            # a role sharded by tensor parallelism over ranks outside the process group: a
            # second all-reduce over the shards' group (MAX of MAXes: every rank's records)
            sharded: "dict[int, tuple]" = {}
            for state in members:
                for mesh in state.shard_meshes.values():
                    shard_group = mesh.get_group()
                    if shard_group is not group:
                        entry = sharded.setdefault(id(shard_group), (shard_group, []))
                        if not any(s is state for s in entry[1]):
                            entry[1].append(state)
            for shard_group, sharded_states in sharded.values():
                check_recipes(sharded_states[0].recipe, shard_group)
                _all_reduce_max([_buffers(s) for s in sharded_states], shard_group)
        for state in members:
            state.records_reduced()


def _buffers(state) -> list:
    """The buffers a role's records raise: one value each for a layer's roles, one per expert
    for a grouped layer's (ExpertScalingState)."""
    roles = [getattr(state, r) for r in state.ROLES]
    return [r.pending_amax for r in roles] + [r.nonfinite_count for r in roles]


def _all_reduce_max(buffer_lists, group) -> None:
    bufs = [b for bs in buffer_lists for b in bs]
    # float64 is exact for both: float32 values and counts below 2^53
    packed = torch.cat([b.double().reshape(-1) for b in bufs])
    torch.distributed.all_reduce(packed, torch.distributed.ReduceOp.MAX, group=group)
    parts = packed.split([b.numel() for b in bufs])
    with torch.no_grad():
        torch._foreach_copy_(bufs, [p.view(b.shape) for p, b in zip(parts, bufs)])


def defer(state) -> bool:
    """Leave `state`'s records to the reduction at the end of the running backward pass. False
    when there is none to join (not inside an autograd backward, or compiling): the caller
    reduces now."""
    if torch.compiler.is_compiling():
        return False
    task = torch._C._current_graph_task_id()
    if task < 0:
        return False
    with _lock:
        refs = _pending.get(task)
        if refs is None:
            # a backward that raised never ran its callback: its records are reduced by the
            # roles' next steps, and its entry goes once nothing in it is left to reduce
            for stale in [t for t, rs in _pending.items() if not _unreduced(rs)]:
                del _pending[stale]
            refs = _pending[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_flush, task))
        if not any(r() is state for r in refs):
            refs.append(weakref.ref(state))
    return True


def _unreduced(refs) -> list:
    return [s for s in (r() for r in refs) if s is not None and s.needs_reduce()]


def _flush(task: int) -> None:
    with _lock:
        refs = _pending.pop(task, [])
    states = _unreduced(refs)
    if states:
        reduce_states(states)
