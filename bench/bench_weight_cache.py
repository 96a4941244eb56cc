"""What never reusing a stale weight cast costs, measured side by side in one run.

The weight cache reuses a cast only inside an accumulation window of a weight an optimizer is
seen to hold (docs/numerics.md, "Weight cache"); every other forward casts the weight again: one
no backward follows (eval, a frozen model), every micro-batch of the first window (before the
optimizer's first step), every forward of a weight no optimizer steps (a hand-written loop).
Each optimizer step runs a post-hook over the live FP8 states. This times, interleaved:
  cached   a training forward inside a window of a held weight (the cast reused)
  recast   the same forward with its voucher gone (p.grad = None: the cast redone)
and reports recast / cached per shape and recipe, and the optimizer post-hook against the
optimizer step itself for a model of many layers.

    python bench/bench_weight_cache.py [--device cpu|cuda] [--repeats 30]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8ops  # noqa: E402
from fp8ops.scaling import weight_cache  # noqa: E402
from _timing import cpu_name  # noqa: E402

RECIPES = {"current": fp8ops.CurrentScaling(), "delayed": fp8ops.DelayedScaling(),
           "mxfp8": fp8ops.MXFP8Scaling(), "blockwise": fp8ops.BlockwiseScaling()}
SHAPES = [(64, 1024, 1024), (512, 1024, 1024), (64, 4096, 4096)]  # (M, K, N)


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _forward_times(recipe, shape, device, repeats):
    M, K, N = shape
    layer = fp8ops.FP8Linear(K, N, recipe=recipe, device=device)
    x = torch.randn(M, K, device=device)
    layer(x).float().sum().backward()
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    opt.step()  # it holds the weight from now on, while it lives (to the end of this function)
    cached, recast = [], []

    def timed(into):
        layer(x)  # untimed, the same kind: neither timed forward follows a backward
        t = _now(device)
        layer(x)
        into.append(_now(device) - t)

    # interleaved, so that the machine's load hits both alike, and each first in every other
    # pair, so that neither always pays for what the other leaves behind
    for i in range(repeats):
        if i % 2:
            layer.weight.grad = None  # no voucher: every forward casts again
            timed(recast)
        layer(x).float().sum().backward()  # untimed: the gradient now vouches for the cast
        timed(cached)
        if not i % 2:
            layer.weight.grad = None
            timed(recast)
    return statistics.median(cached), statistics.median(recast)


def _hook_times(device, layers, repeats):
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)]).to(device)
    fp8ops.convert_to_fp8(model)
    model(torch.randn(8, 64, device=device)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    hook, step = [], []
    for _ in range(repeats):
        t = _now(device)
        weight_cache.after_optimizer_step(opt, (), {})
        hook.append(_now(device) - t)
        t = _now(device)
        opt.step()  # includes one run of the hook itself
        step.append(_now(device) - t)
    return statistics.median(hook), statistics.median(step)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    where = torch.cuda.get_device_name() if device.type == "cuda" else cpu_name()
    print(f"# {where}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"backend {fp8ops.backend(device)}")
    print(f"`python bench/bench_weight_cache.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
          .replace(" `", "`"))
    print("\n| M | K | N | " + " | ".join(RECIPES) + " |")
    print("|---:|---:|---:|" + "---:|" * len(RECIPES))
    for shape in SHAPES:
        ratios = []
        for recipe in RECIPES.values():
            cached, recast = _forward_times(recipe, shape, device, args.repeats)
            ratios.append(f"{recast / cached:.2f}x")
        print(f"| {shape[0]} | {shape[1]} | {shape[2]} | " + " | ".join(ratios) + " |")
    print("\nForward time with the cast redone, over the forward with the cast reused.")
    for layers in (10, 200):
        hook, step = _hook_times(device, layers, args.repeats)
        print(f"\nOptimizer post-hook, {layers} FP8Linear(64, 64): {hook * 1e6:.0f} us, "
              f"{hook / step:.1%} of the SGD step that runs it")


if __name__ == "__main__":
    main()
