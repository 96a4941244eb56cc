"""Step time of FSDP2 training with the FP8 weight all-gather against the high-precision gather,
measured side by side in one run.

    python bench/bench_fsdp_step.py --backend nccl --world 8      # one process per GPU
    python bench/bench_fsdp_step.py --world 2 --models tiny       # CPU, gloo: a smoke run only
    python bench/bench_fsdp_step.py --backend nccl --world 1 --profile 20  # where the time goes

The models and their sharding are bench/bench_comm.py's (fully_shard per block and at the root,
MixedPrecisionPolicy(param_dtype=bf16)). Every setup is built once; then, for each of --rounds
rounds, each setup in turn runs --steps training steps (forward, backward, AdamW step), timed
on the host around the steps with the device synchronized: interleaved rounds, so a drifting
clock or a warming device affects every setup alike. Reported per setup: the median over rounds
of the mean step time, and the ratio of each FP8-gather setup to the same recipe's
high-precision gather (the goal: <= 1.0) and to the bf16 model. CPU timings of the emulation
say nothing about a GPU; run on CUDA with NCCL for figures (record them in bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_comm  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_setups(model_name, setups, device, world, seq_len, steps, rounds, profile=0):
    """({setup: [mean step seconds of each round]}, {setup: profile table}) on this rank; the
    tables (profile > 0: that many rows of one profiled step per setup, after the timing) say
    where an FP8-gather step spends the time its ratio shows."""
    built = {}
    for setup in setups:
        model, loss_fn, _ = bench_comm.build(model_name, setup, device, world, seq_len,
                                             fresh_batches=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        built[setup] = (model, loss_fn, opt)

    def step(setup):
        model, loss_fn, opt = built[setup]
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for setup in setups:  # warm up: lazy init, delayed scaling's warm start, allocator
        step(setup)
        step(setup)
    times = {s: [] for s in setups}
    for _ in range(rounds):
        for setup in setups:
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(setup)
            _sync(device)
            times[setup].append((time.perf_counter() - t0) / steps)
    tables = {s: profile_step(lambda s=s: step(s), device, profile) for s in setups} \
        if profile else {}
    return times, tables


def profile_step(step, device, rows: int) -> str:
    """torch.profiler's table of one step: operators by self time on the device (CUDA) or the
    host, with the number of calls and of kernels launched."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    head = f"host operators: {sum(e.count for e in events if e.device_type.name == 'CPU')}"
    head += f", device kernels: {kernels}" if device.type == "cuda" else ""
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return head + "\n" + events.table(sort_by=key, row_limit=rows)


def _entry(rank, world, backend, args, out_dir):
    device = bench_comm.init_rank(rank, world, backend, out_dir, args.threads)
    setups = bench_comm.setups(args.recipes.split(","), ("bf16", "fp8"))
    results = {m: time_setups(m, setups, device, world, args.seq_len, args.steps, args.rounds,
                              args.profile) for m in args.models.split(",")}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "rank0.pt"))
    bench_comm.leave_rank()


def table(results) -> str:
    lines = ["| model | setup | step ms (median of rounds) | vs same recipe, bf16 gather | "
             "vs bf16 model |", "|---|---|---:|---:|---:|"]
    for model, times in results.items():
        med = {s: statistics.median(t) for s, t in times.items()}
        for setup, t in med.items():
            recipe, _, gather = setup.partition(":")
            same = med.get(f"{recipe}:bf16") if gather == "fp8" else None
            vs_same = f"{t / same:.3f}" if same else "-"
            lines.append(f"| {model} | {setup} | {1e3 * t:.2f} | {vs_same} | "
                         f"{t / med['bf16']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--models", default="gpt", help="comma-separated: gpt, llama8b_block, tiny")
    p.add_argument("--recipes", default="current,delayed,blockwise")
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens of the Llama block's batch")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="also print a profiler table of one step per setup (this many rows)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(args.world, args.backend, args, out_dir), nprocs=args.world,
                 join=True)
        both = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
    results = {m: times for m, (times, _) in both.items()}
    print(table(results))
    for model, (_, tables) in both.items():
        for setup, text in tables.items():
            print(f"\n## profile: {model} {setup} (rank 0, one step)\n{text}")
    return results


if __name__ == "__main__":
    main()
