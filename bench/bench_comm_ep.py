"""Bytes on the wire of one expert-parallel training step: FP8 token dispatch against bf16.

    python bench/bench_comm_ep.py                    # CPU, gloo, 2 and 4 processes
    python bench/bench_comm_ep.py --world 4 --recipes blockwise

Each rank holds E / world experts of an FP8GroupedLinear MoE MLP (up [E, 4d, d], GELU, down
[E, d, 4d]; fp8ops.FP8ExpertParallel) and routes --tokens bf16 tokens of its own (d_model wide,
each to one expert drawn uniformly, the same draws in every setup). One step, forward and
backward, split into its collectives (bench/_comm_count.py), each counted around the library's
own piece (fp8ops/distributed/expert_parallel/):
  counts         the all_to_all_single of the tokens per expert (int64 [E]);
  dispatch       the tokens to their experts: bf16, or the FP8 bytes (+ 1x128 float32 scales for
                 blockwise) of the first grouped GEMM's cast;
  amax           CurrentScaling's MAX all-reduce of the experts' amaxes (forward and backward);
  combine        the experts' outputs back, bf16 both ways (its forward);
  combine grad   the gradient of the outputs to the experts: bf16, or FP8 (its backward);
  dispatch grad  the tokens' gradient back, bf16 both ways.
Bytes are what each rank sends (an all-to-all's input, its own part included; an all-reduce's
tensor), summed over the ranks. The same step through the parallelized module's forward and
backward is counted too and must add up to the pieces. Writes bench/results/comm_ep.md (and
.json) and prints the table. No timing.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.append(_p)
import fp8ops  # noqa: E402
import bench_comm  # noqa: E402  (its ranks' entry and exit)
from _comm_count import CommCount  # noqa: E402

RECIPES = {"current": fp8ops.CurrentScaling, "blockwise": fp8ops.BlockwiseScaling}
PHASES = ("counts", "dispatch", "amax", "combine", "combine_grad", "dispatch_grad")


class MoEMLP(nn.Module):
    def __init__(self, experts, d_model, recipe):
        super().__init__()
        self.up = fp8ops.FP8GroupedLinear(experts, d_model, 4 * d_model, recipe=recipe)
        self.down = fp8ops.FP8GroupedLinear(experts, 4 * d_model, d_model, recipe=recipe)

    def forward(self, x, offsets):
        return self.down(F.gelu(self.up(x, offsets)), offsets)


def tokens(rank, args):
    g = torch.Generator().manual_seed(rank)
    expert = torch.randint(0, args.experts, (args.tokens,), generator=g).sort().values
    offsets = torch.bincount(expert, minlength=args.experts).cumsum(0).to(torch.int32)
    x = torch.randn(args.tokens, args.d_model, generator=g).to(torch.bfloat16)
    return x, offsets, torch.randn(args.tokens, args.d_model, generator=g).to(torch.bfloat16)


def _count(counts, phase, fn):
    with CommCount() as c:
        out = fn()
    counts[phase] = c.bytes["all_to_all"]  # (an all-reduce inside is the amax row's)
    return out


def measure(rank, recipe_name, fp8, args) -> dict:
    """{phase: bytes this rank sent} for one step, and the whole step through the module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from fp8ops.distributed.expert_parallel.dispatch import combine, dispatch
    from fp8ops.distributed.expert_parallel.routing import exchange
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = MoEMLP(args.experts, args.d_model, RECIPES[recipe_name]())
    model = parallelize_module(model, mesh, fp8ops.FP8ExpertParallel(fp8_dispatch=fp8))
    recipe = model.up.recipe
    x, offsets, target = tokens(rank, args)
    x.requires_grad_(True)
    counts: dict = {}
    with CommCount() as amax:  # the pieces, each counted on its own
        routing = _count(counts, "counts", lambda: exchange(offsets, mesh.get_group()))
        got = _count(counts, "dispatch", lambda: dispatch(x, offsets, routing, recipe, fp8))
        inner = model.down(F.gelu(model.up(got, routing.local_offsets)), routing.local_offsets)
        y = _count(counts, "combine", lambda: combine(inner, offsets, routing, recipe, fp8))
        dy = 2 * (y.float() - target.float()).to(y.dtype) / y.numel()
        d_inner = _count(counts, "combine_grad",
                         lambda: torch.autograd.grad(y, inner, dy)[0])
        d_got = torch.autograd.grad(inner, got, d_inner)[0]
        _count(counts, "dispatch_grad", lambda: torch.autograd.grad(got, x, d_got))
    counts["amax"] = amax.bytes["all_reduce"]
    with CommCount() as whole:
        loss = F.mse_loss(model(x, offsets).float(), target.float())
        loss.backward()
    counts["step"] = whole.bytes["all_to_all"] + whole.bytes["all_reduce"]
    if counts["step"] != sum(counts[p] for p in PHASES):
        raise RuntimeError(f"the pieces {counts} do not add up to the module's step")
    return counts


def _entry(rank, world, jobs, out_dir, args):
    bench_comm.init_rank(rank, world, "gloo", out_dir, threads=1)
    results = {job: measure(rank, job[0], job[1], args) for job in jobs}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    bench_comm.leave_rank()


def run(world, jobs, args) -> dict:
    """{(recipe, fp8): {phase: bytes summed over the ranks}}."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, jobs, out_dir, args), nprocs=world, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                 for r in range(world)]
    return {job: {k: sum(r[job][k] for r in ranks) for k in ranks[0][job]} for job in jobs}


def rows(results) -> list:
    out = []
    for (world, recipe, fp8), r in results.items():
        base = results[world, recipe, False]
        pieces = {p: r[p] for p in PHASES}
        out.append(dict(world=world, recipe=recipe, wire="FP8" if fp8 else "bf16", **pieces,
                        step=r["step"],
                        dispatch_ratio=r["dispatch"] / base["dispatch"],
                        combine_grad_ratio=r["combine_grad"] / base["combine_grad"],
                        step_ratio=r["step"] / base["step"]))
    return out


def table(results, args) -> str:
    head = (f"One expert-parallel step (forward and backward), gloo on the CPU, {args.experts} "
            f"experts, d_model {args.d_model} (up 4x), {args.tokens} bf16 tokens per rank, "
            f"torch {torch.__version__}. Bytes sent, summed over the ranks; ratios against the "
            f"same recipe with a bf16 wire (fp8_dispatch=False). The amax column is "
            f"CurrentScaling's all-reduces (forward and backward) that the FP8 wire needs.")
    lines = [head, "", "| world | recipe | wire | counts B | dispatch B | amax B | combine B | "
             "combine grad B | dispatch grad B | step B | dispatch ratio | combine grad ratio | "
             "step ratio |", "|---:|---|---|" + "---:|" * 10]
    for r in rows(results):
        lines.append(f"| {r['world']} | {r['recipe']} | {r['wire']} | {r['counts']} | "
                     f"{r['dispatch']} | {r['amax']} | {r['combine']} | {r['combine_grad']} | "
                     f"{r['dispatch_grad']} | {r['step']} | {r['dispatch_ratio']:.4f} | "
                     f"{r['combine_grad_ratio']:.4f} | {r['step_ratio']:.4f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", default="2,4", help="comma-separated process counts (default 2,4)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help="comma-separated subset of " + ", ".join(RECIPES))
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--out", default=os.path.join(HERE, "results", "comm_ep.md"))
    args = p.parse_args(argv)
    args.world = [int(w) for w in args.world.split(",") if w]
    args.recipes = [r for r in args.recipes.split(",") if r]
    bad = [r for r in args.recipes if r not in RECIPES]
    if bad:
        p.error(f"unknown recipe(s) {bad}; choose from {list(RECIPES)}")
    bad = [w for w in args.world if w < 2 or args.experts % w]
    if bad:
        p.error(f"--world {bad}: each must be at least 2 and divide --experts {args.experts}")
    return args


def main(argv=None):
    args = parse_args(argv)
    jobs = [(r, fp8) for r in args.recipes for fp8 in (False, True)]
    results = {}
    for world in args.world:
        for job, counts in run(world, jobs, args).items():
            results[(world, *job)] = counts
    bench_comm.write_results(
        args, "Collective bytes of one expert-parallel step (`python bench/bench_comm_ep.py`)",
        table(results, args), rows=rows(results))
    return results


if __name__ == "__main__":
    main()
