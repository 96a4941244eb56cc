"""FP8Linear training step against bf16 nn.Linear, side by side in one run, on a GPU.

One training step of one layer: y = layer(x), y.backward(dy), then an optimizer step
(torch.optim.SGD, foreach) on the layer's parameters, for x [M, K] bf16 (requires grad) and a
weight [N, K] (bf16 parameters for both). FP8Linear runs its three GEMMs (forward, dgrad, wgrad)
in FP8 with its casts, and recasts its weight after every optimizer step, which this step
therefore counts; nn.Linear runs them in bf16. Per shape, bf16 and every recipe are timed in
interleaved rounds (each variant --iters steps per round, CUDA events, the L2 flushed before
each step); reported: the median per variant over all rounds and the speed-up bf16 time / FP8
time, with its geometric mean over the shapes. Random inputs, the same for every variant.

    python bench/bench_linear.py [--rounds R] [--iters N] [--recipes current,delayed,...]
    python bench/bench_linear.py --with-auto   # also each recipe with fallback="auto"
    python bench/bench_linear.py --shapes 16384x8192x1280,4096x4096x4096   # these shapes only
    python bench/bench_linear.py --graph       # forward + backward replayed: no launch work
    python bench/bench_linear.py --device cpu --smoke     # runs end to end; not a measurement

Writes bench/results/linear.md (linear_graph.md with --graph; a smoke run only to --out) and prints
it.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import (add_smoke_options, captured_step, device_info, error_text,  # noqa: E402
                     interleaved, results_dir, write_table)

SHAPES = [  # (M, K, N): tokens, in_features, out_features
    (16384, 8192, 7168), (16384, 8192, 1280), (16384, 4096, 14336), (8192, 4096, 4096),
    (4096, 4096, 4096), (2048, 4096, 4096), (1024, 4096, 4096), (512, 4096, 4096),
    (256, 4096, 4096), (4096, 1024, 1024), (4096, 512, 512),
]
SMOKE_SHAPES = [(64, 128, 96), (32, 64, 64)]
RECIPES = ("current", "delayed", "mxfp8", "blockwise")
# The weight gradient x^T dy does not depend on the weight: with the same dy every step the weights
# drift linearly, by about lr * sqrt(M) per step and element; small, they stay near their start.
LR = 1e-6


def recipes():
    import fp8ops
    return {"current": fp8ops.CurrentScaling(), "delayed": fp8ops.DelayedScaling(),
            "mxfp8": fp8ops.MXFP8Scaling(), "blockwise": fp8ops.BlockwiseScaling()}


def fp8_copy(base, recipe, fallback="never"):
    import fp8ops
    # "never": FP8 at every shape, the speed-ups the fallback's crossover table
    # (fp8ops/nn/fallback.py) is read from; "auto": what a user gets, that table applied
    layer = fp8ops.FP8Linear(base.in_features, base.out_features, bias=False, recipe=recipe,
                             device=base.weight.device, dtype=base.weight.dtype,
                             fallback=fallback)
    layer.weight.data.copy_(base.weight.data)
    return layer


def train_step(layer, x, dy, graph=False):
    """One training step of `layer` on its own optimizer (its own copy of x, so no two variants
    share a gradient). graph: forward and backward replayed from a CUDA graph, the optimizer
    step eager (the host's launch work leaves the forward and backward)."""
    x = x.detach().clone().requires_grad_()
    opt = torch.optim.SGD(layer.parameters(), lr=LR, foreach=True)

    def zero_grad():
        opt.zero_grad(set_to_none=True)
        x.grad = None

    def forward_backward():
        layer(x).backward(dy)

    if graph:
        return captured_step(forward_backward, zero_grad, opt.step)

    def step():
        zero_grad()
        forward_backward()
        opt.step()
    return step


def geomean_cell(values) -> str:
    """Geometric mean of the ratios that exist, with how many when some variant raised."""
    ok = [v for v in values if v is not None]
    if not ok:
        return "-"
    g = f"{math.exp(sum(map(math.log, ok)) / len(ok)):.2f}"
    return g if len(ok) == len(values) else f"{g} ({len(ok)} of {len(values)} shapes)"


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds per shape")
    ap.add_argument("--iters", type=int, default=10, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--shapes", default=None,
                    help="MxKxN,... (default: the 11 shapes of SHAPES)")
    ap.add_argument("--with-auto", action="store_true",
                    help='also time each recipe with fallback="auto" (columns "<recipe> auto")')
    ap.add_argument("--graph", action="store_true",
                    help="every variant's forward and backward replayed from a CUDA graph (the "
                         "optimizer step eager): the step without the host's launch work")
    add_smoke_options(ap, "tiny shapes, 1 round of 2 steps: checks that it runs, measures nothing")
    args = ap.parse_args(argv)
    if args.graph and args.device != "cuda":
        ap.error("--graph needs a CUDA device (CUDA graphs)")
    if args.smoke:
        args.rounds, args.iters, args.warmup = 1, 2, 1
    out_dir = results_dir(args, os.path.join(HERE, "results"))

    dev = args.device
    info = device_info(dev)
    recipe_names = [r for r in args.recipes.split(",") if r]
    names = recipe_names + ([f"{r} auto" for r in recipe_names] if args.with_auto else [])
    rows = []
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes and not args.smoke:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    for m, k, n in shapes:
        torch.manual_seed(0)
        base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        steps, row = {"bf16": train_step(base, x, dy, args.graph)}, {}
        for name in names:
            recipe, _, auto = name.partition(" ")
            try:
                steps[name] = train_step(fp8_copy(base, recipes()[recipe], auto or "never"),
                                         x, dy, args.graph)
            except Exception as exc:  # noqa: BLE001 - recorded in the table instead
                row[name] = error_text(exc)
        row.update(interleaved(steps, dev, args.rounds, args.iters, args.warmup))
        rows.append(((m, k, n), row))
        print(f"M={m:6d} K={k:5d} N={n:6d}  bf16 {cell_ms(row['bf16'])} ms  " +
              "  ".join(f"{r} {cell_ratio(row, r)}" for r in names), flush=True)
        del base, x, dy, steps
        if dev == "cuda":
            torch.cuda.empty_cache()

    table = render(rows, names, info, args)
    write_table(out_dir, "linear_graph.md" if args.graph else "linear.md", table)
    return rows


def ratio(row, name):
    """bf16 time / FP8 time, or None when either raised."""
    t, t_bf16 = row.get(name), row.get("bf16")
    if isinstance(t, float) and isinstance(t_bf16, float):
        return t_bf16 / t
    return None


def cell_ratio(row, name):
    """The speed-up, else the variant's error text, else "-" (bf16 raised)."""
    r, t = ratio(row, name), row.get(name)
    return f"{r:.2f}" if r is not None else (t if isinstance(t, str) else "-")


def cell_ms(t):
    return f"{t:.3f}" if isinstance(t, float) else str(t)


def render(rows, names, info, args) -> str:
    timing = (f"median over {args.rounds} interleaved rounds of {args.iters} CUDA-event-timed "
              "steps per variant, L2 flushed before each step")
    if args.graph:
        timing += ("; forward and backward replayed from a CUDA graph (bf16 too), the SGD step "
                   "eager")
    if args.smoke:
        timing = (f"SMOKE RUN on {args.device}: wall clock, {args.rounds} round of {args.iters} "
                  "steps, tiny shapes; checks that the script runs, NOT a measurement")
    lines = ["# FP8Linear training step (forward + backward + SGD step) vs bf16 nn.Linear "
             "(speed-up = bf16 time / FP8 time)", "",
             ", ".join(f"{k}: {v}" for k, v in info.items()), "", timing, "",
             "| M | K | N | bf16 ms | " + " | ".join(f"{r} speed-up" for r in names) + " |",
             "|---:|---:|---:|---:|" + "---:|" * len(names)]
    for (m, k, n), row in rows:
        lines.append(f"| {m} | {k} | {n} | {cell_ms(row['bf16'])} | " +
                     " | ".join(cell_ratio(row, r) for r in names) + " |")
    lines.append("| geomean | | | | " +
                 " | ".join(geomean_cell([ratio(row, r) for _, row in rows]) for r in names) + " |")
    if args.graph:  # the fallback decides eager calls: its rows come from eager runs
        return "\n".join(lines) + "\n"
    lines += ["", "Crossovers that keep every measured shape of a recipe at >= 1.0x bf16 (the "
              "measured shapes only), as rows of fp8ops.nn.fallback.MEASURED:", ""]
    kinds = recipes()
    for recipe in (n for n in names if " " not in n):  # read from the FP8-everywhere columns
        rule = crossover([(shape, ratio(row, recipe)) for shape, row in rows])
        key = (info["device"], type(kinds[recipe]).__name__)
        lines.append(f"    {key!r}: {rule},")
    return "\n".join(lines) + "\n"


def crossover(measured):
    """The high-precision fallback's rule read from measured (shape, speed-up) pairs: of the
    thresholds (min_tokens, min_in_features, min_out_features) taken from the measured shapes'
    own dimensions (or one past the largest: nothing in FP8), the one that runs the most shapes
    in FP8 while every shape it runs in FP8 was measured at >= 1.0x (a shape that falls back
    runs as bf16 does); ties go to the larger speed-up sum, then to the larger thresholds (what
    was not measured runs bf16). A shape whose speed-up is unknown (an error) must fall back."""
    dims = [sorted({0, *(shape[d] for shape, _ in measured),
                    max(shape[d] for shape, _ in measured) + 1}) for d in range(3)]
    best, best_key = None, None
    for m in dims[0]:
        for k in dims[1]:
            for n in dims[2]:
                fp8 = [r for (sm, sk, sn), r in measured if sm >= m and sk >= k and sn >= n]
                if any(r is None or r < 1.0 for r in fp8):
                    continue
                key = (len(fp8), sum(fp8), m, k, n)
                if best_key is None or key > best_key:
                    best, best_key = (m, k, n), key
    m, k, n = best
    return f"Crossover(min_tokens={m}, min_in_features={k}, min_out_features={n})"


if __name__ == "__main__":
    main()
