"""The per-tensor cast of the dense layer (current or delayed scaling), with its transposed copy:
one op call when nothing crosses processes, else the amax, the scale and the cast apart."""
from __future__ import annotations

from typing import Optional

import torch

from ..scaling.amax_all_reduce import shard_amax
from ..ops import fused
from ..scaling import ScalingState, current_scale

_ops = torch.ops.fp8ops


def shards(state: Optional[ScalingState], role: str):
    """The mesh the tensor of `role` is sharded over (tensor parallelism), or None."""
    return None if state is None else state.shard_meshes.get(role)


def _scale_before_cast(role, x, fmt, recipe, step: bool, margin: float, warm: bool,
                       shards) -> torch.Tensor:
    """The scale for casting x: from the delayed-scaling role (stepped first when `step`), or,
    with no role (current scaling), from x's own amax. warm: use x's own amax, not the role's
    scale (the role has recorded nothing yet). shards: x is one shard of a tensor sharded over
    this mesh, whose amax is the MAX over the shards (a role all-reduces over its own
    shard_mesh)."""
    if role is not None:
        if step:
            role.update(recipe, fmt, margin)
        if warm:
            return role.warm_scale(x, fmt, margin, recipe)
        return role.scale.clone()  # a copy: the buffer changes before backward uses it
    pct = getattr(recipe, "amax_percentile", None)
    amax = _ops.amax(x) if pct is None else _ops.amax_percentile(x, pct)
    if shards is not None:
        amax = shard_amax(amax, shards, recipe)
    return current_scale(amax, fmt, margin, recipe.power_of_two)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _fusable(role, recipe, shards, warm: bool) -> bool:
    """Whether a cast's scale math and amax bookkeeping can run inside its op: not when an amax
    must cross processes before the cast (current scaling of a tensor sharded by tensor
    parallelism, a delayed-scaling warm start under torch.distributed) or is a percentile.
    (Under torch.distributed a delayed-scaling role records on its rank, sharded or not, and
    one all-reduce at the end of the backward pass folds every layer's records:
    amax_reduction.)"""
    if role is None:
        return shards is None and getattr(recipe, "amax_percentile", None) is None
    return not (warm and _distributed())


def cast_per_tensor(x, role, fmt, recipe, margin: float, *, update: bool = False,
                    warm: bool = False, record: bool = False, sum_dtype=None, rng=None,
                    shards=None, state: Optional[ScalingState] = None, name: str = ""):
    """One per-tensor cast with its transposed copy: (data, data_t, scale, scale_inv, column
    sums of x or None). role: the delayed-scaling RoleState (None: current scaling), stepped
    first when `update`, cast with x's own amax when `warm`, x's amax recorded when `record`.
    sum_dtype: also the sums over x's rows in that dtype (a bias gradient). rng: round
    stochastically with this random stream (ScalingState.rng), advanced on the device. One op
    call when nothing crosses processes (ops.quantize_current / quantize_delayed), else the
    unfused ops. state, name: the ScalingState and the role's name in it (delayed scaling).
    (No autograd here: the ops' outputs carry none, and the column sums are taken in backward.)"""
    stochastic = rng is not None
    if _fusable(role, recipe, shards, warm):
        if role is not None and _distributed():
            if update and state.needs_reduce(name):  # its scale must see every rank's records
                state.reduce_records()
            if record:
                state.record_locally(name)
        if role is None:
            outs = _ops.quantize_current(x, fmt.dtype, margin, recipe.power_of_two, True,
                                         sum_dtype, stochastic, 0, 0, rng)
        else:
            b = role._buffers  # (seven module attribute lookups each cost a Python call)
            outs = _ops.quantize_delayed(
                x, b["amax_history"], b["scale"], b["scale_inv"], b["amax_rep"],
                b["pending_amax"], b["step"], b["nonfinite_count"], fmt.dtype, margin,
                recipe.interval, recipe.amax_compute_algo, recipe.ema_alpha, recipe.percentile,
                recipe.power_of_two, update, warm, record, True, sum_dtype, stochastic, 0, 0,
                rng)
        data, data_t, scale, scale_inv, sums = outs
        return data, data_t, scale, scale_inv, None if sum_dtype is None else sums
    scale = _scale_before_cast(role, x, fmt, recipe, update, margin, warm, shards)
    data, data_t, amax = fused.cast(x, scale, fmt.dtype, True, stochastic, 0, 0, rng)
    if record:
        role.record(amax, recipe.process_group, recipe)
    sums = None if sum_dtype is None else fused.column_sums(x, sum_dtype)
    return data, data_t, scale, torch.reciprocal(scale), sums
