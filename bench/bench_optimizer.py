"""fp8ops.FP8AdamW against torch AdamW: training quality over seeds, state bytes, step time.

    python bench/bench_optimizer.py [--seeds 0,1,2,3,4] [--steps 200] [--recipe baseline]
    python bench/bench_optimizer.py --time-only --device cuda   # the step time alone
    python bench/bench_optimizer.py --smoke      # a tiny run that checks the script works

1. Quality: the demo model (examples/train_gpt.py, its CPU preset unless --size says otherwise)
   trained with torch AdamW and with FP8AdamW for each way of storing the second moment
   (sqrt_e4m3, e5m2, bf16), over several seeds (each seed changes the initialization and the
   batch order, the same for every optimizer). The gap of each FP8AdamW variant's validation
   loss to AdamW's of the same seed, against AdamW's own spread over the seeds.
2. Bytes of optimizer state per parameter of the model, for each optimizer.
3. Step time (--time): FP8AdamW.step() against torch.optim.AdamW (fused=True on CUDA, its
   default on the CPU) on the same parameters and gradients, median of steps taken in turns.
   On the CPU the figure only says the script works (FP8AdamW runs as PyTorch ops, not fused).
Writes bench/results/optimizer.md and prints it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(1, os.path.dirname(HERE))
import fp8ops  # noqa: E402
import train_gpt  # noqa: E402

VARIANTS = ("adamw", "sqrt_e4m3", "e5m2", "bf16")  # adamw: torch's; the rest: FP8AdamW's v


def quality(args, seeds):
    val = {v: [] for v in VARIANTS}
    state = {}
    for seed in seeds:
        train_tokens, val_tokens = train_gpt.load_tokens()
        for variant in VARIANTS:
            argv = ["--size", args.size, "--steps", str(args.steps), "--seed", str(seed),
                    "--device", args.device, "--no-progress", "--monitor-every", "0",
                    "--recipes", args.recipe]
            if variant != "adamw":
                argv += ["--optimizer", "fp8adamw", "--second-moment", variant]
            targs = train_gpt.parse_args(argv)
            val_batches = train_gpt.fixed_batches(val_tokens, targs.eval_batches,
                                                  targs.batch_size, targs.seq_len, seed=12345)
            r = train_gpt.run(args.recipe, targs, train_tokens, val_batches,
                              train_gpt.Ranks(targs))
            val[variant].append(r["final_val_loss"])
            print(f"seed {seed} {variant:10s} val {r['final_val_loss']:.4f}", flush=True)
        state = state or state_bytes_per_param(targs)
    return val, state, targs


def state_bytes_per_param(targs):
    """Optimizer-state bytes per model parameter after one step, per variant."""
    out = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = train_gpt.build_model(targs)
        n = sum(p.numel() for p in model.parameters())
        opt = (torch.optim.AdamW(model.parameters()) if variant == "adamw" else
               fp8ops.FP8AdamW(model.parameters(), second_moment=variant))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        held = sum(t.numel() * t.element_size() for s in opt.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
        out[variant] = held / n
    return out


def step_times(device, rounds: int):
    """Median step time of FP8AdamW (each variant) over AdamW's, steps taken in turns."""
    big = device.type == "cuda"
    shapes = [(2048, 2048)] * 4 + [(5632, 2048)] * 3 if big else [(512, 512)] * 4
    params = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        opt = (torch.optim.AdamW(ps, fused=device.type == "cuda") if variant == "adamw" else
               fp8ops.FP8AdamW(ps, second_moment=variant))
        params[variant] = opt
    times = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant, opt in params.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[variant].append(time.perf_counter() - t0)
    base = statistics.median(times["adamw"])
    return {v: statistics.median(t) / base for v, t in times.items()}, shapes


def _kind(device) -> str:
    return "fused" if device.type == "cuda" else "its CPU default"


def _where(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--size", default="cpu")
    ap.add_argument("--recipe", default="baseline")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--time", action="store_true", help="also time the optimizer step")
    ap.add_argument("--time-only", action="store_true", help="only time the optimizer step")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.seeds, args.steps, args.size = "0", 6, "tiny"
    if args.time_only:
        device = torch.device(args.device)
        ratios, shapes = step_times(device, 5 if args.smoke else 30)
        print(f"FP8AdamW step time over torch AdamW's ({_kind(device)}, {len(shapes)} parameters "
              f"of shapes {sorted(set(shapes))}, {_where(device)}, torch {torch.__version__}): "
              + ", ".join(f"{v} {r:.2f}x" for v, r in ratios.items() if v != "adamw"))
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    start = time.time()
    val, state, targs = quality(args, seeds)
    base = val["adamw"]
    spread = 100 * (max(base) - min(base)) / statistics.mean(base)
    lines = ["# FP8AdamW against torch AdamW", "",
             f"Model: the demo's `--size {args.size}` ({targs.arch}, d_model {targs.d_model}, "
             f"{targs.n_layer} layers), recipe {args.recipe}, {args.steps} steps, seeds {seeds}, "
             f"device {args.device}, torch {torch.__version__}, {time.time() - start:.0f} s. "
             f"AdamW's seed spread (max - min of its validation loss): {spread:.2f}%.", "",
             "| optimizer | v stored as | state bytes / parameter | mean val loss | "
             "mean gap vs AdamW (paired by seed) | gap std | inside AdamW's spread |",
             "|---|---|---:|---:|---:|---:|---|"]
    for variant in VARIANTS:
        vals = val[variant]
        if variant == "adamw":
            lines.append(f"| torch AdamW | float32 | {state[variant]:.2f} | "
                         f"{statistics.mean(vals):.4f} | - | - | - |")
            continue
        gaps = [100 * (v - b) / b for v, b in zip(vals, base)]
        g = statistics.mean(gaps)
        sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        lines.append(f"| FP8AdamW | {variant} | {state[variant]:.2f} | "
                     f"{statistics.mean(vals):.4f} | {g:+.2f}% | {sd:.2f}% | "
                     f"{'yes' if abs(g) <= spread else 'no'} |")
    if args.time:
        device = torch.device(args.device)
        ratios, shapes = step_times(device, 5 if args.smoke else 30)
        lines += ["", f"Step time over torch AdamW's ({_kind(device)}, {len(shapes)} parameters of "
                  f"shapes {sorted(set(shapes))}, {_where(device)}): "
                  + ", ".join(f"{v} {r:.2f}x" for v, r in ratios.items() if v != "adamw")]
    table = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "optimizer.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
