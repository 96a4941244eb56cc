"""The demo's --ep: each MoE block's experts split over the ranks of torchrun by
fp8ops.FP8ExpertParallel, the tokens dispatched to them as FP8 bytes and scales.

Every rank holds E / world experts of each block and a replica of everything else (embeddings,
attention, routers, norms, LM head), and trains on its slice of each global batch, as --fsdp
does. After backward:
  - a replicated parameter's gradient is its rank's alone: all-reduced and divided by the world
    size (the mean of the ranks' losses, as DDP averages);
  - an expert's gradient already holds every rank's tokens (their gradients travelled to the
    expert's rank in the dispatch's backward): divided by the world size, for the same mean.
Gradient clipping takes the norm over both (the experts' shards summed over the ranks). The
optimizer keeps experts and replicated parameters in separate parameter groups (its foreach
steps do not mix DTensors with plain tensors). The baseline's experts are not converted to FP8,
and FP8ExpertParallel takes FP8 experts only: its run keeps them replicated (no expert
parallelism), which the table's head says."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fp8ops

# the recipes whose experts FP8ExpertParallel takes (it refuses delayed scaling and MXFP8), and
# the baseline (experts replicated)
RECIPES = ("baseline", "current", "current_stochastic", "blockwise")


def parallelize(model, device: torch.device, world: int):
    """Split every block's experts over a 1-D mesh of all ranks; returns the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    for block in model.blocks:
        parallelize_module(block.mlp.experts, mesh, fp8ops.FP8ExpertParallel())
    return model


def param_groups(model) -> list:
    """The replicated parameters and the experts' shards as two parameter groups."""
    params = list(model.parameters())
    experts = [p for p in params if isinstance(p, DTensor)]
    replicated = [p for p in params if not isinstance(p, DTensor)]
    return [dict(params=replicated)] + ([dict(params=experts)] if experts else [])


def _grads(model) -> tuple:
    """(the replicated parameters' gradients, the local parts of the experts' gradients)."""
    replicated, shards = [], []
    for p in model.parameters():
        if p.grad is not None:
            if isinstance(p.grad, DTensor):
                shards.append(p.grad.to_local())
            else:
                replicated.append(p.grad)
    return replicated, shards


def reduce_gradients(model, world: int) -> None:
    """The mean over the ranks' losses of every gradient (module doc): the replicated ones
    summed in one all-reduce per dtype (gloo has no AVG), then every gradient divided."""
    if world == 1:
        return
    replicated, shards = _grads(model)
    # (dtypes in the parameters' order, the same on every rank: a set's order follows
    # torch.dtype's hash, its address, which differs between processes)
    for dtype in dict.fromkeys(g.dtype for g in replicated):
        grads = [g for g in replicated if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        torch._foreach_copy_(grads, [t.view_as(g) for t, g in
                                     zip(flat.split([g.numel() for g in grads]), grads)])
    torch._foreach_div_(replicated + shards, world)


def clip_grad_norm_(model, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ over replicated gradients and the experts' shards: the
    norm of all of them, the same on every rank."""
    replicated, shards = _grads(model)
    if not replicated and not shards:
        return 0.0
    device = (replicated or shards)[0].device
    # (on the gradients' device: NCCL all-reduces device tensors)
    shards_sq = torch.nn.utils.get_total_norm(shards).square() if shards else \
        torch.zeros((), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(shards_sq)  # each rank holds other experts
    replicated_sq = torch.nn.utils.get_total_norm(replicated).square() if replicated else 0.0
    total = math.sqrt(float(replicated_sq + shards_sq))
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(replicated + shards, coef)
    return total
