"""Where the tokens of an expert-parallel step go: the exchange of token counts and the layout
of the rows each rank receives.

Experts are split in equal runs over the ranks of the expert-parallel group (rank r holds
experts r * E_local ... (r + 1) * E_local - 1). Each rank's tokens come sorted by expert, so the
rows for one rank are one contiguous run. One all_to_all_single of the counts per expert tells
every rank how many rows it receives from each rank for each of its experts; the split sizes
are read on the host once (the step's only host sync: all_to_all_single takes them as ints).
Received rows arrive by source rank, then by expert; `order` sorts them by local expert, the
sources of one expert in rank order, which is how a single process that ran all ranks' tokens,
rank 0's first, would sort them (a stable sort by expert)."""
from __future__ import annotations

from typing import List, NamedTuple

import torch
import torch.distributed as dist


class Routing(NamedTuple):
    group: dist.ProcessGroup
    send_splits: List[int]  # rows sent to each rank
    recv_splits: List[int]  # rows received from each rank
    order: torch.Tensor  # received rows (by source, then expert) -> rows sorted by local expert
    local_offsets: torch.Tensor  # int32 [E_local]: cumulative end row of each local expert
    first_expert: int  # the global index of this rank's first expert


def counts_of(offsets: torch.Tensor) -> torch.Tensor:
    """Rows per expert (int64 [E]) from the cumulative end rows."""
    ends = offsets.to(torch.int64)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def exchange(offsets: torch.Tensor, group: dist.ProcessGroup) -> Routing:
    """The routing of rows sorted by expert with `offsets` (int32 [E], every rank's the same E)
    over `group`: one all_to_all_single of the counts, one host read of the split sizes."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    experts = offsets.shape[0]
    local = experts // world
    counts = counts_of(offsets)
    received = torch.empty_like(counts)  # [world * local]: each source's rows per local expert
    dist.all_to_all_single(received, counts, group=group)
    per_source = received.view(world, local)
    splits = torch.cat([counts.view(world, local).sum(1), per_source.sum(1)]).tolist()
    send_splits, recv_splits = splits[:world], splits[world:]
    total = sum(recv_splits)
    block = torch.repeat_interleave(torch.arange(world * local, device=offsets.device),
                                    per_source.reshape(-1), output_size=total)
    source, expert = block // local, block % local
    order = torch.argsort(expert * world + source, stable=True)
    local_offsets = per_source.sum(0).cumsum(0).to(torch.int32)
    return Routing(group, send_splits, recv_splits, order, local_offsets, rank * local)


def unsort(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows sorted by local expert back in arrival order (by source): the inverse of [order]."""
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def all_to_all_rows(rows: torch.Tensor, out_splits: List[int], in_splits: List[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """rows [sum(in_splits), ...] sent in runs of in_splits to each rank; what each rank sends
    this one, concatenated in rank order."""
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out
