"""FSDP2's gradient reduce-scatter in FP8 blocks, installed through FSDPModule's own
set_custom_reduce_scatter.

    fully_shard(block) for each block; fully_shard(model)
    fp8ops.distributed.fp8_reduce_scatter(model)          # every FSDPModule inside model

Each rank casts its reduce-scatter input (the unsharded gradients FSDP2 laid out in world
chunks) in blocks (blocks.py) and sends chunk r's bytes and scales to rank r in one all-to-all;
rank r decodes the world's contributions to its chunk, adds them in rank order in float32,
applies the reduction FSDP2 asked for (SUM, AVG, or PREMUL_SUM with FSDP2's gradient divide
factor) and writes its shard in the reduce dtype. The result is the same on every run (no
order depends on timing). The error is each contribution's rounding to FP8 before the sum: with
E4M3, at most 2^-4 of the value, or 2^-10 of its block's scale_inv (amax / 448) where the value
is that small (FP8's subnormals); then the float32 sum and one rounding to the reduce dtype."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule

from . import blocks

try:  # the extension point's interface (torch >= 2.10)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - an older torch: fp8_reduce_scatter refuses below
    _ReduceScatter = object


def divisor_of(op, world: int) -> float:
    """What the sum is divided by for a reduce op FSDP2 passes: SUM 1, AVG the world size,
    PREMUL_SUM(f) 1 / f (FSDP2's gradient divide factor, the multiplication applied once to the
    sum rather than to each term)."""
    kind = getattr(op, "op", op)
    if kind == ReduceOp.SUM:
        return 1.0
    if kind == ReduceOp.AVG:
        return float(world)
    if kind == ReduceOp.PREMUL_SUM:
        factor = op.factor
        factor = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
        if factor <= 0:
            raise ValueError(f"fp8ops: FP8 reduce-scatter: a PREMUL_SUM factor must be positive, "
                             f"got {factor}")
        return 1.0 / factor
    raise ValueError(f"fp8ops: FP8 reduce-scatter sums gradients (SUM, AVG or PREMUL_SUM); "
                     f"got {kind}")


def reduce_scatter_fp8(output: torch.Tensor, input: torch.Tensor, group, divisor: float,
                       dtype: torch.dtype, block_size: int) -> None:
    """output [n] = (sum over ranks of input[rank * n:(rank + 1) * n] of this rank's chunk) /
    divisor, every contribution sent as FP8 blocks of its own chunk (no block spans two chunks)."""
    world = dist.get_world_size(group)
    n = output.numel()
    if input.numel() != world * n:
        raise ValueError(f"fp8ops: FP8 reduce-scatter: the input holds {input.numel()} values, "
                         f"not {world} x the output's {n}")
    if input.dtype != output.dtype:
        raise TypeError(f"fp8ops: FP8 reduce-scatter: input {input.dtype} and output "
                        f"{output.dtype} must have one dtype")
    send = blocks.encode(input.reshape(world, n), dtype, block_size)
    recv = torch.empty_like(send)
    if send.numel():
        dist.all_to_all_single(recv, send, group=group)
    output.copy_(blocks.decode_sum(recv, n, dtype, block_size, divisor, output.dtype))


class FP8ReduceScatter(_ReduceScatter):
    """An FSDP2 reduce-scatter (torch.distributed.fsdp's ReduceScatter) that sends FP8 blocks:
    `fsdp_module.set_custom_reduce_scatter(FP8ReduceScatter())`. block_size: values per float32
    scale; fmt: the FP8 format (fp8ops.E4M3 or E5M2, a name or a float8 dtype)."""

    def __init__(self, *, block_size: int = blocks.DEFAULT_BLOCK, fmt="e4m3"):
        self.dtype = blocks.check_settings(block_size, fmt)
        self.block_size = block_size

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False) -> Optional[dist.Work]:
        if async_op:  # FSDP2 calls it synchronously on its reduce-scatter stream
            raise ValueError("fp8ops: FP8ReduceScatter runs synchronously (async_op=False)")
        divisor = divisor_of(op, dist.get_world_size(group))
        reduce_scatter_fp8(output_tensor, input_tensor, group, divisor, self.dtype,
                           self.block_size)
        return None

    def __repr__(self) -> str:
        return f"FP8ReduceScatter(block_size={self.block_size}, dtype={self.dtype})"


def fp8_reduce_scatter(module: torch.nn.Module, *, block_size: int = blocks.DEFAULT_BLOCK,
                       fmt="e4m3") -> torch.nn.Module:
    """Have FSDP2 reduce-scatter the gradients of every FSDPModule in `module` (itself
    included) in FP8 blocks; returns `module`. Call it after fully_shard. Installing again
    replaces the earlier one (harmless); a module with no FSDPModule is an error."""
    if _ReduceScatter is object or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(f"fp8ops: fp8_reduce_scatter needs FSDP2's "
                           f"set_custom_reduce_scatter (torch {torch.__version__} has none)")
    comm = FP8ReduceScatter(block_size=block_size, fmt=fmt)
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError(f"fp8ops: fp8_reduce_scatter: no FSDPModule in {type(module).__name__}: "
                         f"call it after torch.distributed.fsdp.fully_shard")
    for m in sharded:
        m.set_custom_reduce_scatter(comm)
    return module
