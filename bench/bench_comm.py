"""Bytes on the wire of one training step: FSDP2's FP8 weight all-gather against bf16 FSDP2, and
the gradient reductions of FSDP2 and DDP in bf16, float32 and FP8.

    python bench/bench_comm.py                       # CPU, gloo, 2 processes
    python bench/bench_comm.py --world 4
    python bench/bench_comm.py --backend nccl        # one process per GPU

Runs one training step (forward, backward, AdamW step; no gradient clipping) under FSDP2
(`fully_shard` per transformer block and at the root, MixedPrecisionPolicy(param_dtype=bf16)) and
counts the collectives the step sends (bench/_comm_count.py: the c10d ops as the backend gets
them, with their tensors): all-gather bytes, reduce-scatter bytes, all-reduce calls and bytes.
A first, uncounted step comes before (lazy initialisation, delayed scaling's warm start): the
counted step is the steady state. Setups per model:
  - bf16: the plain model (nn.Linear), FSDP2 gathers every parameter in bf16: the reference;
  - <recipe>, fp8_all_gather=False: FP8Linear layers, weights gathered in bf16 (both FP8 setups
    compute in FP8 at every shape: fallback="never");
  - <recipe>, fp8_all_gather=True: FP8Linear weights gathered in FP8 where the recipe allows it
    (fp8ops/distributed/fsdp/: per-tensor recipes always, blockwise when each shard holds whole
    128-row blocks, MXFP8 never).
Models: the demo GPT (examples/gpt.py, the "cpu" preset of examples/train_gpt.py; its blocks'
Linears in FP8, embeddings and LM head in bf16), one Llama-3-8B-shaped block (d_model 4096, FFN
14336, 32 query / 8 KV heads; q, k, v, o, gate, up, down as Linear without bias, two RMSNorms, no
rotary embedding: it has no parameters; 218M parameters, real weights, batch 1 x --seq-len
tokens; sharded as one block of many: its own fully_shard under a parameterless root), and
"tiny" (the demo GPT's tiny preset, for the tests). Bytes do not depend on the values: random
tokens / activations.

"FP8Linear weights" counts what the converted layers' weights put into FSDP2's all-gathers (from
FSDP2's per-parameter all-gather inputs; they add up with the other parameters to the
collectives' bytes, which the run checks), the same parameters in the bf16 row. All-gather bytes
are output bytes (the whole gathered buffer, each rank's own shard included), reduce-scatter
bytes input bytes (the unsharded gradient), as counted on rank 0 (every rank sends the same).
The gradient reductions (`--reductions`, bench/_comm_reductions.py): FSDP2's reduce-scatter in
bf16, in float32 and in FP8 blocks (fp8ops.distributed.fp8_reduce_scatter), and DDP with torch's
allreduce_hook (float32), bf16_compress_hook and fp8ops.distributed.fp8_compress_hook, each
counted on the same step as a second table.
Writes bench/results/comm.md (and comm.json) and prints the tables. No timing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, os.path.join(ROOT, "examples"), ROOT):
    if _p not in sys.path:
        sys.path.append(_p)
import fp8ops  # noqa: E402
import _comm_reductions  # noqa: E402
from _comm_count import CommCount  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

RECIPES = {"current": fp8ops.CurrentScaling, "delayed": fp8ops.DelayedScaling,
           "mxfp8": fp8ops.MXFP8Scaling, "blockwise": fp8ops.BlockwiseScaling}
MODELS = ("gpt", "llama8b_block", "tiny")
GPT_PRESETS = {  # examples/train_gpt.py's presets: (batch, seq_len, d_model, n_layer, n_head)
    "gpt": (16, 64, 128, 2, 4), "tiny": (4, 32, 64, 1, 2)}


class LlamaBlock(nn.Module):
    """One Llama-3-8B decoder block: RMSNorm, grouped-query attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, d_model=4096, ffn=14336, n_head=32, n_kv_head=8):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, d_model // n_head
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.q = nn.Linear(d_model, n_head * self.head_dim, bias=False)
        self.k = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(n_head * self.head_dim, d_model, bias=False)
        self.gate = nn.Linear(d_model, ffn, bias=False)
        self.up = nn.Linear(d_model, ffn, bias=False)
        self.down = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(h).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(h).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def build(model_name, setup, device, world, seq_len, fresh_batches=True):
    """(model sharded by FSDP2, a function giving this rank's batch loss, converted fqns).
    fresh_batches=False: every call reuses one batch made on the device (timing: no host-side
    random numbers in the step)."""
    torch.manual_seed(0)
    reduction = _comm_reductions.parse(setup)
    recipe_name, _, gather = ("current:fp8" if reduction else setup).partition(":")
    if model_name == "llama8b_block":
        # a block as FSDP2 shards it inside a model of many: its own fully_shard under a root,
        # resharded after forward (gathered again for backward)
        model = nn.Sequential(LlamaBlock()).to(device)
        blocks, filter_fn = [model[0]], None
        tokens = 1
    else:
        batch, seq, d_model, n_layer, n_head = GPT_PRESETS[model_name]
        model = GPT(GPTConfig(seq_len=seq, d_model=d_model, n_layer=n_layer,
                              n_head=n_head)).to(device)
        blocks = list(model.blocks)

        def filter_fn(module, fqn):  # examples/train_gpt.py: the blocks' Linears only
            return fqn.startswith("blocks.")
        if batch % world:
            raise SystemExit(f"the GPT's batch {batch} does not divide by --world {world}")
        tokens = batch // world
    converted = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)
                 and (filter_fn is None or filter_fn(m, n))]
    if recipe_name != "bf16":
        # FP8 at every shape (no measured fallback): the two gathers feed the same FP8 GEMMs
        fp8ops.convert_to_fp8(model, RECIPES[recipe_name](), filter_fn=filter_fn,
                              fp8_all_gather=gather == "fp8", fallback="never")
    # (the weight-gather setups: FSDP2 with bf16 parameters, its own bf16 reduce-scatter)
    model = _comm_reductions.distribute(model, blocks, *(reduction or ("fsdp", "bf16")))
    gen = torch.Generator().manual_seed(1 + dist.get_rank())

    if model_name == "llama8b_block":
        def make():
            return torch.randn(1, seq_len, 4096, generator=gen).to(device)

        def loss_fn():
            x = make() if fresh_batches else fixed
            return model(x).float().square().mean()
    else:
        def make():
            return torch.randint(0, 256, (tokens, seq + 1), generator=gen).to(device)

        def loss_fn():
            idx = make() if fresh_batches else fixed
            return model(idx[:, :-1], idx[:, 1:])
    fixed = None if fresh_batches else make()
    return model, loss_fn, converted


def fp8_gathered(model):
    """Names of the FP8Linear weights FSDP2 gathers in FP8."""
    from fp8ops.distributed.fsdp import FP8WeightShard
    return [n for n, p in model.named_parameters()
            if isinstance(getattr(p, "_local_tensor", None), FP8WeightShard)]


def measure(model_name, setup, device, world, seq_len):
    """Counts of the second training step of one setup (this rank)."""
    model, loss_fn, converted = build(model_name, setup, device, world, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    for step in range(2):
        count = CommCount()
        with count if step == 1 else nullcontext():
            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    res = count.summary()
    res["weight_bytes"] = sum(v for k, v in res["by_param"].items() if k in converted)
    res["converted"] = converted
    res["fp8_gathered"] = fp8_gathered(model)
    res["seconds"] = time.perf_counter() - t0
    res["engine"] = (_comm_reductions.parse(setup) or ("fsdp",))[0]
    if res["by_param"]:  # the per-parameter inputs add up to the collectives' bytes
        assert sum(res["by_param"].values()) == res["bytes"]["all_gather"], res
    del model, opt
    return res


def setups(recipes, gathers):
    out = ["bf16"]
    for r in recipes:
        out += [f"{r}:{g}" for g in gathers]
    return out


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def init_rank(rank, world, backend, out_dir, threads) -> torch.device:
    """Join the run's process group (a FileStore in out_dir: no port to pick) with this rank's
    device: GPU `rank` on NCCL, else the CPU."""
    torch.set_num_threads(threads)
    kwargs = {}
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method="file://" + os.path.join(out_dir, "store"),
                            rank=rank, world_size=world, timeout=timedelta(seconds=600),
                            **kwargs)
    return device


def leave_rank() -> None:
    """Leave together (no rank tears down while another is still in a collective), then end the
    process without the interpreter's teardown: FSDP2's process group outlives
    destroy_process_group() (DTensor's sharding caches keep its DeviceMesh, and with it the
    gloo/NCCL threads), and tearing the interpreter down concurrently with those threads now and
    then aborts the process. Call it last, once the results are saved."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _entry(rank, world, backend, jobs, out_dir, seq_len, threads):
    device = init_rank(rank, world, backend, out_dir, threads)
    results = {}
    for model_name, setup in jobs:
        results[model_name, setup] = measure(model_name, setup, device, world, seq_len)
        if rank == 0:
            r = results[model_name, setup]
            print(f"  {model_name:>14} {setup:<16} all-gather {r['bytes']['all_gather']:>12} B"
                  f"  ({r['seconds']:.1f} s)", flush=True)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_rank()


def run(jobs, world=2, backend="gloo", seq_len=16, threads=1):
    """{(model, setup): counts of rank 0}; every rank must have counted the same."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, backend, jobs, out_dir, seq_len, threads),
                 nprocs=world, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                 for r in range(world)]
    for other in ranks[1:]:
        for key, res in ranks[0].items():
            assert other[key]["bytes"] == res["bytes"], (key, other[key]["bytes"], res["bytes"])
    return ranks[0]


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def rows(results):
    """One dict per (model, setup), with ratios to the model's bf16 row."""
    out = []
    for (model_name, setup), r in results.items():
        if _comm_reductions.parse(setup):
            continue  # the gradient reductions' table
        base = results[model_name, "bf16"]
        recipe, _, gather = setup.partition(":")
        out.append(dict(
            model=model_name, recipe=recipe,
            gather={"": "bf16", "bf16": "bf16", "fp8": "FP8"}[gather],
            all_gather_bytes=r["bytes"]["all_gather"],
            # one process gathers nothing (FSDP2 at world 1): no ratio to give
            all_gather_ratio=(r["bytes"]["all_gather"] / base["bytes"]["all_gather"])
            if base["bytes"]["all_gather"] else float("nan"),
            weight_bytes=r["weight_bytes"],
            weight_ratio=(r["weight_bytes"] / base["weight_bytes"]) if base["weight_bytes"]
            else float("nan"),
            all_gather_calls=r["calls"]["all_gather"],
            reduce_scatter_bytes=r["bytes"]["reduce_scatter"],
            reduce_scatter_calls=r["calls"]["reduce_scatter"],
            all_reduce_calls=r["calls"]["all_reduce"], all_reduce_bytes=r["bytes"]["all_reduce"],
            other_calls=r["calls"]["other"],
            fp8_layers=f"{len(r['fp8_gathered'])}/{len(r['converted'])}"
            if recipe != "bf16" else "-"))
    return out


def table(results, args) -> str:
    device = (torch.cuda.get_device_name(0) if args.backend == "nccl"
              else f"CPU ({args.world} processes)")
    head = (f"One FSDP2 training step (forward, backward, AdamW; the second step), world "
            f"{args.world}, backend {args.backend}, device {device}, "
            f"MixedPrecisionPolicy(param_dtype=bf16), "
            f"torch {torch.__version__}. All-gather: output bytes (the whole gathered buffer); "
            f"reduce-scatter: input bytes; MB = 10^6 bytes. Ratios against the model's bf16 row.")
    lines = [head, "",
             "| model | recipe | weights gathered in | FP8 gathered / FP8Linear | all-gather MB "
             "| ratio to bf16 | FP8Linear weights MB | weights ratio to bf16 | all-gather calls "
             "| reduce-scatter MB | all-reduce calls | all-reduce bytes | all-gather bytes |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows(results):
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['gather']} | {r['fp8_layers']} | "
            f"{r['all_gather_bytes'] / 1e6:.4f} | {r['all_gather_ratio']:.4f} | "
            f"{r['weight_bytes'] / 1e6:.4f} | {r['weight_ratio']:.4f} | {r['all_gather_calls']} | "
            f"{r['reduce_scatter_bytes'] / 1e6:.4f} | {r['all_reduce_calls']} | "
            f"{r['all_reduce_bytes']} | {r['all_gather_bytes']} |")
    text = "\n".join(lines) + "\n"
    if any(_comm_reductions.parse(setup) for _, setup in results):
        text += ("\nGradient reductions of the same step (CurrentScaling's FP8 Linears; FSDP2 "
                 "with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=the gradients' dtype), "
                 "DDP with a communication hook; gradient bytes: a reduce-scatter's and an "
                 "all-to-all's input, an all-gather's output, an all-reduce's buffer twice; ratios "
                 "against the same engine's bf16 row):\n\n" + _comm_reductions.table(results))
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--models", default="gpt,llama8b_block",
                   help="comma-separated: " + ", ".join(MODELS) + " (default: gpt,llama8b_block)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated subset of "
                   + ", ".join(RECIPES))
    p.add_argument("--gathers", default="bf16,fp8",
                   help="fp8_all_gather settings of the FP8 rows: bf16 (False), fp8 (True)")
    p.add_argument("--reductions", default=",".join(_comm_reductions.SETUPS),
                   help="gradient reductions to count, engine:sent-as (default: all of "
                   + ", ".join(_comm_reductions.SETUPS) + "; 'none' for none)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens of the Llama block's batch")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", default=os.path.join(HERE, "results", "comm.md"))
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.recipes = [r for r in args.recipes.split(",") if r]
    args.gathers = [g for g in args.gathers.split(",") if g]
    args.reductions = [r for r in args.reductions.split(",") if r and r != "none"]
    for what, got, allowed in (("model", args.models, MODELS), ("recipe", args.recipes, RECIPES),
                               ("gather", args.gathers, ("bf16", "fp8")),
                               ("reduction", args.reductions, _comm_reductions.SETUPS)):
        bad = [x for x in got if x not in allowed]
        if bad:
            p.error(f"unknown {what}(s) {bad}; choose from {list(allowed)}")
    if args.backend == "nccl" and torch.cuda.device_count() < args.world:
        p.error(f"--backend nccl needs --world ({args.world}) GPUs, "
                f"{torch.cuda.device_count()} visible")
    return args


def main(argv=None):
    args = parse_args(argv)
    jobs = [(m, s) for m in args.models for s in setups(args.recipes, args.gathers)
            + [_comm_reductions.PREFIX + r for r in args.reductions]]
    results = run(jobs, args.world, args.backend, args.seq_len, args.threads)
    write_results(args, "Collective bytes of one training step (`python bench/bench_comm.py`)",
                  table(results, args), rows=rows(results),
                  reductions=_comm_reductions.rows(results))
    return results


def write_results(args, title: str, text: str, **payload) -> None:
    """Print the table `text`; write it under `title` to args.out (markdown) and, beside it, the
    run's arguments, torch's version and `payload` as JSON (nothing is written when args.out is
    empty)."""
    print("\n" + text)
    if not args.out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(f"# {title}\n\n{text}")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(dict(args={k: v for k, v in vars(args).items() if k != "out"},
                       torch=torch.__version__, **payload), f, indent=1)


if __name__ == "__main__":
    main()
