"""Training quality of each FP8 recipe against seed noise: the demo GPT (examples/train_gpt.py)
trained in the baseline precision and with every recipe, over several seeds (each seed changes
the initialization and the batch order, the same for every recipe). The baseline's spread over
the seeds is the noise that an FP8 gap has to be compared with.

    python bench/bench_quality.py [--seeds 0,1,2,3,4] [--steps 600] [--recipes ...] [--device cpu]
    python bench/bench_quality.py --optimizer fp8adamw --param-dtype bfloat16 --fp8-activations on

Writes bench/results/quality.md (mean validation gap per recipe and its spread) and
bench/results/quality.png, and prints the table. Defaults take about 20 minutes on 2 CPU cores.
Goals: every recipe's mean gap < 1% and inside the baseline's seed spread; MXFP8 and
blockwise < 0.5%.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import train_gpt  # noqa: E402

RECIPES = "baseline,delayed,current,current_stochastic,mxfp8,blockwise,current_p99.99"
GOAL = {"mxfp8": 0.5, "blockwise": 0.5}  # % of the baseline's validation loss; others 1.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--recipes", default=RECIPES)
    ap.add_argument("--device", default="cpu")
    # the memory configurations (examples/train_gpt.py's flags of the same names)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--param-dtype", default="float32")
    ap.add_argument("--fp8-activations", default="off")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    recipes = args.recipes.split(",")
    val = {r: [] for r in recipes}
    start = time.time()
    for seed in seeds:
        targs = train_gpt.parse_args(["--size", "cpu", "--steps", str(args.steps), "--seed",
                                      str(seed), "--device", args.device, "--no-progress",
                                      "--monitor-every", "0", "--recipes", ",".join(recipes),
                                      "--optimizer", args.optimizer, "--param-dtype",
                                      args.param_dtype, "--fp8-activations",
                                      args.fp8_activations])
        train_tokens, val_tokens = train_gpt.load_tokens()
        val_batches = train_gpt.fixed_batches(val_tokens, targs.eval_batches, targs.batch_size,
                                              targs.seq_len, seed=12345)  # one validation set
        ranks = train_gpt.Ranks(targs)  # one process
        for name in recipes:
            r = train_gpt.run(name, targs, train_tokens, val_batches, ranks)
            val[name].append(r["final_val_loss"])
            print(f"seed {seed} {name:20s} val {r['final_val_loss']:.4f}  "
                  f"({time.time() - start:.0f} s)", flush=True)

    base = val["baseline"]
    base_mean = statistics.mean(base)
    # per seed, the gap to that seed's baseline (pairs share initialization and batches)
    rows = []
    for name in recipes:
        gaps = [100 * (v - b) / b for v, b in zip(val[name], base)]
        rows.append((name, statistics.mean(val[name]), statistics.mean(gaps),
                     statistics.stdev(gaps) if len(gaps) > 1 else 0.0, gaps))
    spread = 100 * (max(base) - min(base)) / base_mean  # the baseline's seed-to-seed range
    lines = ["# FP8 training quality against seed noise", "",
             f"GPT of the demo (d_model {targs.d_model}, {targs.n_layer} layers), {args.steps} "
             f"steps, seeds {seeds}, device {args.device}, optimizer {args.optimizer}, parameters "
             f"{args.param_dtype}, fp8_activations {args.fp8_activations}, "
             f"{time.time() - start:.0f} s in all. "
             f"Baseline seed spread (max - min of its validation loss): {spread:.2f}%.", "",
             "| recipe | mean val loss | mean gap vs baseline (paired by seed) | gap std | "
             "inside baseline spread | goal |", "|---|---:|---:|---:|---|---|"]
    for name, mean_v, g, sd, _ in rows:
        if name == "baseline":
            lines.append(f"| baseline | {mean_v:.4f} | - | - | - | - |")
            continue
        goal = GOAL.get(name, 1.0)
        lines.append(f"| {name} | {mean_v:.4f} | {g:+.2f}% | {sd:.2f}% | "
                     f"{'yes' if abs(g) <= spread else 'no'} | "
                     f"{'met' if abs(g) < goal else 'missed'} (< {goal}%) |")
    table = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quality.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "quality.json"), "w") as f:
        json.dump({"seeds": seeds, "steps": args.steps, "val": val}, f, indent=1)
    _plot(rows, spread, os.path.join(args.out, "quality.png"))
    print(table)


def _plot(rows, spread, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r[0] != "baseline"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.axhspan(-spread, spread, color="grey", alpha=0.2, label="baseline seed spread")
    for i, (name, _, g, sd, gaps) in enumerate(rows):
        ax.errorbar(i, g, yerr=sd, fmt="o", capsize=4)
        ax.scatter([i] * len(gaps), gaps, s=8, color="k", alpha=0.5)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r[0] for r in rows], rotation=20)
    ax.set_ylabel("validation loss gap vs baseline (%)")
    ax.set_title("FP8 recipes vs baseline, per-seed gaps (dots), mean +- std")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
