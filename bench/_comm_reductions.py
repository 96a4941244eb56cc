"""The gradient reductions that bench_comm.py compares: how a setup shards or replicates the model
and which reduction it installs, and the table of what the gradients put on the wire.

Setups (engine:gradients sent as):
  - fsdp:bf16, fsdp:float32: FSDP2's own reduce-scatter, MixedPrecisionPolicy(reduce_dtype=...);
  - fsdp:fp8: float32 gradients sent as FP8 blocks (fp8ops.distributed.fp8_reduce_scatter);
  - ddp:float32: DDP with torch's allreduce_hook (what DDP does by default, as a Python hook so
    that the count sees its all-reduce; DDP's built-in one runs in C++ below the dispatcher);
  - ddp:bf16: torch's bf16_compress_hook; ddp:fp8: fp8ops.distributed.fp8_compress_hook.
Every setup trains the same model with CurrentScaling's FP8 Linears (FSDP2 gathers their weights
in FP8): the weights' traffic is the other table's, and is left out here.

Gradient bytes: a reduce-scatter's and an all-to-all's input, an all-gather's output, and an
all-reduce's buffer twice (its reduce-scatter and all-gather phases), as counted on rank 0; under
FSDP2 only its reduce-scatters and all-to-alls (its all-gathers carry weights, its all-reduces
FP8 scaling's amaxes)."""
from __future__ import annotations

import torch

SETUPS = ("fsdp:bf16", "fsdp:float32", "fsdp:fp8", "ddp:float32", "ddp:bf16", "ddp:fp8")
PREFIX = "grads:"


def parse(setup: str):
    """'grads:fsdp:fp8' -> ('fsdp', 'fp8'); None for the weight-gather setups."""
    if not setup.startswith(PREFIX):
        return None
    engine, _, sent = setup[len(PREFIX):].partition(":")
    if f"{engine}:{sent}" not in SETUPS:
        raise ValueError(f"unknown reduction setup {setup!r}; choose from {list(SETUPS)}")
    return engine, sent


def distribute(model, blocks, engine: str, sent: str):
    """The model sharded (FSDP2, per block and at the root) or replicated (DDP) as the setup
    says, with its reduction installed."""
    if engine == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                      reduce_dtype=torch.bfloat16 if sent == "bf16" else torch.float32)
        for block in blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if sent == "fp8":
            import fp8ops.distributed
            fp8ops.distributed.fp8_reduce_scatter(model)
        return model
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    import fp8ops.distributed
    ddp = DistributedDataParallel(model)
    hook = {"float32": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook,
            "fp8": fp8ops.distributed.fp8_compress_hook}[sent]
    ddp.register_comm_hook(None, hook)
    return ddp


def gradient_bytes(res: dict) -> int:
    """Under FSDP2 the all-gathers carry weights and the all-reduces FP8 scaling's amaxes: only
    its reduce-scatters and all-to-alls carry gradients. Under DDP every collective does."""
    b = res["bytes"]
    if res.get("engine") == "fsdp":
        return b["reduce_scatter"] + b["all_to_all"]
    return b["reduce_scatter"] + b["all_to_all"] + 2 * b["all_reduce"] + b["all_gather"]


def rows(results: dict) -> list:
    """One dict per (model, reduction setup), with the ratio to the same engine's bf16 row."""
    out = []
    for (model_name, setup), r in results.items():
        parsed = parse(setup)
        if parsed is None:
            continue
        engine, sent = parsed
        base = results.get((model_name, f"{PREFIX}{engine}:bf16"))
        b = r["bytes"]
        ddp = engine == "ddp"
        out.append(dict(model=model_name, engine=engine, sent=sent,
                        reduce_scatter_bytes=b["reduce_scatter"],
                        all_reduce_bytes=b["all_reduce"] if ddp else 0,
                        all_to_all_bytes=b["all_to_all"],
                        all_gather_bytes=b["all_gather"] if ddp else 0,
                        gradient_bytes=gradient_bytes(r),
                        # (one process sends nothing: no ratio to give)
                        ratio=gradient_bytes(r) / gradient_bytes(base)
                        if base and gradient_bytes(base) else float("nan")))
    return out


def table(results: dict) -> str:
    """The reductions' table, MB = 10^6 bytes."""
    lines = ["| model | engine | gradients sent as | reduce-scatter MB | all-reduce MB (x2) | "
             "all-to-all MB | all-gather MB | gradient MB on the wire | ratio to bf16 |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows(results):
        lines.append(f"| {r['model']} | {r['engine'].upper()} | {r['sent']} | "
                     f"{r['reduce_scatter_bytes'] / 1e6:.4f} | {2 * r['all_reduce_bytes'] / 1e6:.4f} | "
                     f"{r['all_to_all_bytes'] / 1e6:.4f} | {r['all_gather_bytes'] / 1e6:.4f} | "
                     f"{r['gradient_bytes'] / 1e6:.4f} | {r['ratio']:.4f} |")
    return "\n".join(lines) + "\n"
