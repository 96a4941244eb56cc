"""FP8Linear forward + backward against bf16 nn.Linear, side by side in one run, on a GPU.

One training step of one layer: y = layer(x), y.backward(dy), for x [M, K] bf16 (requires grad)
and a weight [N, K] (bf16 parameters for both). FP8Linear runs its three GEMMs (forward, dgrad,
wgrad) in FP8 with its casts; nn.Linear runs them in bf16. Median of CUDA-event-timed steps with
the L2 flushed before each, fresh random inputs per shape.

    python bench/bench_linear.py [--iters N] [--recipes current,delayed,mxfp8,blockwise]

Writes bench/results/linear.md and prints it.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import device_info, require_gpu, time_cuda  # noqa: E402

SHAPES = [  # (M, K, N): tokens, in_features, out_features
    (16384, 8192, 7168), (16384, 8192, 1280), (16384, 4096, 14336), (8192, 4096, 4096),
    (4096, 4096, 4096), (2048, 4096, 4096), (1024, 4096, 4096), (512, 4096, 4096),
    (256, 4096, 4096), (4096, 1024, 1024), (4096, 512, 512),
]


def recipes():
    import fp8ops
    return {"current": fp8ops.CurrentScaling(), "delayed": fp8ops.DelayedScaling(),
            "mxfp8": fp8ops.MXFP8Scaling(), "blockwise": fp8ops.BlockwiseScaling()}


def step_fn(layer, x, dy):
    def step():
        layer.weight.grad = None
        x.grad = None
        layer(x).backward(dy)
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--recipes", default="current,delayed")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    require_gpu()
    import fp8ops

    info = device_info()
    names = [r for r in args.recipes.split(",") if r]
    all_recipes = recipes()
    rows = []
    for m, k, n in SHAPES:
        torch.manual_seed(0)
        base = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        t_bf16 = time_cuda(step_fn(base, x, dy), args.iters, args.warmup)
        row = {"bf16": t_bf16}
        for name in names:
            layer = fp8ops.FP8Linear(k, n, bias=False, recipe=all_recipes[name], device="cuda",
                                     dtype=torch.bfloat16)
            layer.weight.data.copy_(base.weight.data)
            row[name] = time_cuda(step_fn(layer, x, dy), args.iters, args.warmup)
        rows.append(((m, k, n), row))
        print(f"M={m:6d} K={k:5d} N={n:6d}  bf16 {t_bf16:8.3f} ms  " +
              "  ".join(f"{r} {t_bf16 / row[r]:5.2f}x" for r in names), flush=True)
        del base, x, dy
        torch.cuda.empty_cache()

    lines = ["# FP8Linear forward + backward vs bf16 nn.Linear (speed-up = bf16 time / FP8 time)", "",
             ", ".join(f"{k}: {v}" for k, v in info.items()), "",
             f"median of {args.iters} CUDA-event-timed steps, L2 flushed before each", "",
             "| M | K | N | bf16 ms | " + " | ".join(f"{r} speed-up" for r in names) + " |",
             "|---:|---:|---:|---:|" + "---:|" * len(names)]
    for (m, k, n), row in rows:
        lines.append(f"| {m} | {k} | {n} | {row['bf16']:.3f} | " +
                     " | ".join(f"{row['bf16'] / row[r]:.2f}" for r in names) + " |")
    table = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "linear.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
