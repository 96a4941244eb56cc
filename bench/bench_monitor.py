"""Cost of fp8ops.monitor: training steps of the demo GPT with the monitor off, sampling every
100 steps, and sampling every step, side by side in one run (same model, batches and recipe).

    python bench/bench_monitor.py [--steps 100] [--device cpu|cuda] [--recipe delayed]

Prints a markdown table and writes it to bench/results/monitor.md. The goal: sampling every 100
steps costs <= 2% of step time. Each configuration is timed over the same steps, interleaved
(off, every-100, every-1, off, ...) so that drift of the machine hits all three alike.
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
import fp8ops  # noqa: E402
from data import VOCAB_SIZE, Batches, load_tokens  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

RECIPES = {"delayed": fp8ops.DelayedScaling, "current": fp8ops.CurrentScaling,
           "mxfp8": fp8ops.MXFP8Scaling, "blockwise": fp8ops.BlockwiseScaling}


def make(recipe, every, device, args):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, d_model=args.d_model,
                          n_layer=args.n_layer, n_head=args.n_head)).to(device)
    fp8ops.convert_to_fp8(model, RECIPES[recipe](), filter_fn=lambda m, n: "blocks" in n)
    if every:
        fp8ops.monitor(model, every=every)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, opt, x, y, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    model(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipe", default="delayed", choices=RECIPES)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    tokens, _ = load_tokens()
    configs = {"off": 0, "every 100": 100, "every 1": 1}
    runs = {name: make(args.recipe, every, device, args) for name, every in configs.items()}
    batches = Batches(tokens, args.batch_size, args.seq_len, seed=1)
    times = {name: [] for name in configs}
    for i in range(args.steps + 2):
        x, y = (t.to(device) for t in batches.next())
        for name, (model, opt) in runs.items():
            t = step(model, opt, x, y, device)
            if i >= 2:  # warm-up steps are not timed
                times[name].append(t)
    total = {name: sum(ts) for name, ts in times.items()}
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = [f"# fp8ops.monitor cost ({args.recipe}, {device}, torch {torch.__version__})", "",
            f"GPT d_model={args.d_model} n_layer={args.n_layer}, batch {args.batch_size}x"
            f"{args.seq_len}, {args.steps} timed steps per configuration, interleaved", "",
            "| monitor | total time / off | median step / off |", "|---|---:|---:|"]
    for name in configs:
        rows.append(f"| {name} | {total[name] / total['off']:.3f} | {med[name] / med['off']:.3f} |")
    extra = (med["every 1"] - med["off"]) / med["off"]  # a sampled step's extra time
    rows += ["", f"A sampled step costs {100 * extra:.1f}% more than an unsampled one (medians); "
             f"sampling every 100 steps therefore adds {extra:.2f}% on average. Totals include "
             "any step the machine disturbed; medians do not."]
    table = "\n".join(rows) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "monitor.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
