"""Training quality with the gradients reduced in FP8 against the engine's own reduction, over
several seeds: the demo GPT (examples/train_gpt.py --size cpu) trained under torchrun twice per
seed, with and without FP8 gradients (--fsdp with and without --fp8-reduce-scatter, or --ddp with
and without --fp8-compress-hook), each recipe from the same initialization and batches. The
question is whether the FP8 gradients' gap is inside the seed noise: the spread (max - min)
over the seeds of the runs without them.

    python bench/bench_wire_quality.py [--engine fsdp|ddp] [--seeds 0,1,2,3,4] [--steps 200]
                                       [--world 2] [--recipes baseline,current]

Writes bench/results/wire_quality_<engine>.md (and .json, and .png: the per-seed gaps against
the seed spread) and prints the table. Defaults take about 6 minutes on 2 CPU cores."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


ENGINES = {"fsdp": ("--fsdp", "--fp8-reduce-scatter", "FSDP2's reduce-scatter"),
           "ddp": ("--ddp", "--fp8-compress-hook", "DDP's all-reduce")}


def train(engine, seed, steps, world, recipes, fp8_grads, out_dir):
    """{recipe: final validation loss} of one torchrun of the demo."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = ([torchrun] if os.path.exists(torchrun) else [sys.executable, "-m",
                                                          "torch.distributed.run"])
    cmd += ["--standalone", f"--nproc_per_node={world}", os.path.join(ROOT, "examples",
                                                                       "train_gpt.py"),
            "--size", "cpu", ENGINES[engine][0], "--seed", str(seed), "--steps", str(steps), "--recipes",
            ",".join(recipes), "--no-progress", "--monitor-every", "0", "--out-dir", out_dir]
    if fp8_grads:
        cmd.append(ENGINES[engine][1])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(os.path.join(out_dir, f"results_{engine}.json")) as f:
        return {r["name"]: r["final_val_loss"] for r in json.load(f)["results"]}


def rows(val, recipes):
    """Per recipe: the mean validation loss without and with FP8 gradients, the mean of the
    per-seed gaps (%), their spread, and the seed spread of the runs without (%)."""
    out = []
    for name in recipes:
        off, on = val[name, False], val[name, True]
        gaps = [100 * (b - a) / a for a, b in zip(off, on)]
        spread = 100 * (max(off) - min(off)) / statistics.mean(off)
        out.append(dict(recipe=name, off=statistics.mean(off), on=statistics.mean(on),
                        gap=statistics.mean(gaps), gaps=gaps, spread=spread,
                        inside=abs(statistics.mean(gaps)) <= spread))
    return out


def table(result_rows, args, seconds) -> str:
    flag, fp8_flag, own = ENGINES[args.engine]
    lines = [f"# Gradients in FP8 against {own}, over seeds", "",
             f"The demo GPT (`--size cpu`), {args.steps} steps, `{flag}` over {args.world} gloo "
             f"processes, seeds {args.seeds}; {seconds:.0f} s in all. Gap: the validation loss "
             f"with `{fp8_flag}` over the same seed's without it; seed spread: max - "
             f"min over the seeds without it.", "",
             f"| recipe | mean val loss, {own} | mean val loss, FP8 | mean gap "
             "(paired by seed) | per-seed gaps | seed spread | gap inside the spread |",
             "|---|---:|---:|---:|---|---:|---|"]
    for r in result_rows:
        lines.append(f"| {r['recipe']} | {r['off']:.4f} | {r['on']:.4f} | {r['gap']:+.3f}% | "
                     f"{', '.join(f'{g:+.3f}' for g in r['gaps'])} | {r['spread']:.3f}% | "
                     f"{'yes' if r['inside'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(result_rows, path, own) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, r in enumerate(result_rows):
        ax.add_patch(plt.Rectangle((i - 0.3, -r["spread"]), 0.6, 2 * r["spread"], color="grey",
                                   alpha=0.25, label="seed spread" if i == 0 else None))
        ax.scatter([i] * len(r["gaps"]), r["gaps"], s=12, color="k")
        ax.plot([i - 0.25, i + 0.25], [r["gap"]] * 2, color="C3",
                label="mean gap" if i == 0 else None)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(result_rows)))
    ax.set_xticklabels([r["recipe"] for r in result_rows])
    ax.set_xlim(-0.6, len(result_rows) - 0.4)
    ax.set_ylabel("val loss gap, FP8 gradients (%)")
    ax.set_title(f"FP8 gradients vs {own}, per seed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=tuple(ENGINES), default="fsdp")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--recipes", default="baseline,current")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.recipes = [r for r in args.recipes.split(",") if r]
    if len(args.seeds) < 2:
        p.error("--seeds: at least two, for a spread")
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    val = {(name, fp8): [] for name in args.recipes for fp8 in (False, True)}
    work = tempfile.mkdtemp()
    try:
        for seed in args.seeds:
            for fp8 in (False, True):
                got = train(args.engine, seed, args.steps, args.world, args.recipes, fp8,
                            os.path.join(work, f"{seed}-{fp8}"))
                for name in args.recipes:
                    val[name, fp8].append(got[name])
                print(f"seed {seed} fp8 gradients {'on ' if fp8 else 'off'}: "
                      + ", ".join(f"{n} {got[n]:.4f}" for n in args.recipes)
                      + f"  ({time.time() - start:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result_rows = rows(val, args.recipes)
    text = table(result_rows, args, time.time() - start)
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    name = os.path.join(args.out, f"wire_quality_{args.engine}")
    with open(name + ".md", "w") as f:
        f.write(text)
    with open(name + ".json", "w") as f:
        json.dump(dict(engine=args.engine, seeds=args.seeds, steps=args.steps, world=args.world,
                       rows=result_rows), f, indent=1)
    plot(result_rows, name + ".png", ENGINES[args.engine][2])
    return result_rows


if __name__ == "__main__":
    main()
