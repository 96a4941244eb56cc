"""Every rank of a process group must train its FP8 layers with the same recipe: ranks that differ
make different collectives (a delayed-scaling layer all-reduces amaxes that a current-scaling one
does not; FSDP2 gathers FP8 bytes for one and high-precision values for the other), and wait on
each other until the group's timeout. So before a group's first fp8ops collective every rank's
recipe is gathered once, and a mismatch raises an error that names both recipes. FSDP2 checks
each layer when fully_shard hands it its sharded weight (every rank shards the same layers in the
same order), so that a mismatch anywhere in the model is caught there, before training. Under
torch.compile an object collective cannot be traced: a group is checked by its first fp8ops
collective outside a compiled region (or by sharding), none if every one is compiled."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

# the process groups already checked, by id (WORLD as None)
_CHECKED: set = set()


def describe(recipe) -> str:
    """The recipe as every rank can compare it: its class and fields, its process group left out
    (a handle of this process only)."""
    fields = ", ".join(f"{f.name}={getattr(recipe, f.name)!r}" for f in dataclasses.fields(recipe)
                       if f.name != "process_group")
    return f"{type(recipe).__name__}({fields})"


def check_recipes(recipe, group=None, *, once: bool = True, what: str = "") -> None:
    """Raise on every rank of `group` (None: the world) whose recipe differs from another rank's
    (one all_gather_object; with once=True only before the group's first fp8ops collective).
    what: the layer checked, for the message."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if torch.compiler.is_compiling():
        # an object collective cannot be traced: the group is checked by its first collective
        # outside a compiled region (FSDP2 and the tensor-parallel styles check their layers
        # eagerly, when sharding)
        return
    key = None if group is None else id(group)
    if once:
        if key in _CHECKED:
            return
        _CHECKED.add(key)
    mine = describe(recipe)
    theirs: "list[Optional[str]]" = [None] * dist.get_world_size(group)
    dist.all_gather_object(theirs, mine, group=group)
    rank = dist.get_rank(group)
    for other, text in enumerate(theirs):
        if text != mine:
            where = f" for {what}" if what else ""
            raise RuntimeError(
                f"fp8ops: the ranks of one process group train with different FP8 recipes{where}: "
                f"rank {rank} has {mine}, rank {other} has {text}. Every rank must convert its "
                f"model with the same recipe (their collectives would not match)")
