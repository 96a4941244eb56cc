"""Amax all-reduces: the MAX of an amax over processes, with NaN kept out of the reduction."""
from __future__ import annotations

import torch

from .agreement import check_recipes


def all_reduce_amax(amax: torch.Tensor, process_group, shard_mesh=None, recipe=None):
    """(amax, finite): under torch.distributed one MAX all-reduce of (amax or 0, any
    non-finite), so NaN never meets the reduction. shard_mesh: the tensor is sharded over this
    1-D DeviceMesh too (tensor parallelism); a second all-reduce covers it unless the process
    group is the world (None), which holds every shard already. recipe: the caller's, checked
    against the other ranks' before a group's first collective (agreement)."""
    finite = torch.isfinite(amax)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        shard_group = None if shard_mesh is None else shard_mesh.get_group()
        second = process_group is not None and shard_group not in (None, process_group)
        if recipe is not None:
            check_recipes(recipe, process_group)
            if second:
                check_recipes(recipe, shard_group)
        packed = torch.stack([torch.where(finite, amax, 0.0), (~finite).to(amax.dtype)])
        torch.distributed.all_reduce(packed, torch.distributed.ReduceOp.MAX, group=process_group)
        if second:
            torch.distributed.all_reduce(packed, torch.distributed.ReduceOp.MAX,
                                         group=shard_group)
        amax, finite = packed[0], packed[1] == 0
    return amax, finite


def shard_amax(amax: torch.Tensor, shard_mesh, recipe=None) -> torch.Tensor:
    """The amax of a tensor sharded over the 1-D DeviceMesh shard_mesh, from one shard's amax:
    the MAX over the shards, NaN when any shard's is not finite (the whole tensor's would not be
    either: current_scale then keeps 1.0)."""
    amax, finite = all_reduce_amax(amax, shard_mesh.get_group(), recipe=recipe)
    return torch.where(finite, amax, float("nan"))
