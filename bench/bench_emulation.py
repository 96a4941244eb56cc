"""CPU training speed of the emulation: tokens/s of each FP8 recipe against the float32 baseline,
on the training demo's model, measured side by side in one process.

Each configuration builds the demo's GPT once per recipe (same seed and batches as
examples/train_gpt.py), runs warm-up steps, then rounds in which every recipe runs one
untimed step (caches are cold after another model ran; the demo runs each recipe alone) and
times a few more (forward, backward, clip, AdamW step; the demo's step), in a rotating order so
that no recipe always runs after the same neighbour. A recipe's step time is the median over
all rounds; its ratio is baseline step time / its step time (>= 1 would be as fast as float32).

    python bench/bench_emulation.py                      # the demo's config and d_model 256
    python bench/bench_emulation.py --before HEAD~3      # the same run on another commit too

--before REV exports that commit's tree (git archive) and measures it in a subprocess, its own
baseline included, alternating with this tree: both columns of ratios come from one run.
Prints a markdown table and writes it to bench/results/emulation.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _timing import cpu_name

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPES = ["baseline", "delayed", "current", "current_stochastic", "mxfp8", "blockwise"]
CONFIGS = {  # name -> GPT size; every one trains on batch 16 x 64 tokens, as the demo's cpu size
    "demo (d_model 128)": dict(d_model=128, n_layer=2, n_head=4),
    "d_model 256": dict(d_model=256, n_layer=2, n_head=4),
}
BATCH, SEQ = 16, 64


def measure(tree: str, config: dict, rounds: int, steps: int, warmup: int, threads: int):
    """Median step seconds per recipe, with fp8ops and the demo imported from `tree`."""
    sys.path[:0] = [os.path.join(tree, "examples"), tree]
    import torch

    import fp8ops
    assert os.path.dirname(os.path.dirname(os.path.abspath(fp8ops.__file__))) == \
        os.path.abspath(tree), fp8ops.__file__
    import train_gpt
    from data import VOCAB_SIZE, Batches, load_tokens
    from gpt import GPT, GPTConfig

    if threads:
        torch.set_num_threads(threads)
    train_tokens, _ = load_tokens()

    def make(name):
        recipe = train_gpt.RECIPES[name]()
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, seq_len=SEQ, **config))
        if recipe is not None:
            fp8ops.convert_to_fp8(model, recipe, filter_fn=train_gpt.keep_high_precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        batches = Batches(train_tokens, BATCH, SEQ, seed=1)

        def step():
            x, y = batches.next()
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        return step

    runs = {name: make(name) for name in RECIPES}
    for step in runs.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in RECIPES}
    for r in range(rounds):
        order = RECIPES[r % len(RECIPES):] + RECIPES[:r % len(RECIPES)]
        for name in order:
            runs[name]()  # untimed: the first step after another model's runs on cold caches
            for _ in range(steps):
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
    return {"median_s": {n: statistics.median(t) for n, t in times.items()},
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def worker_main(args):
    out = measure(args.tree, json.loads(args.config), args.rounds, args.steps, args.warmup,
                  args.threads)
    with open(args.json, "w") as f:
        json.dump(out, f)


def run_worker(tree, config, args):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree,
               "--config", json.dumps(config), "--json", f.name, "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--threads", str(args.threads)]
        env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run(cmd, check=True, env=env)
        with open(f.name) as g:
            return json.load(g)


def export_tree(rev, dest):
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], check=True,
                          capture_output=True, text=True).stdout.strip()


def table(results, before_rev):
    head = "| config | recipe | tokens/s | ratio to float32 |"
    sep = "|---|---|---:|---:|"
    if before_rev:
        head += f" ratio before ({before_rev}) |"
        sep += "---:|"
    rows = [head, sep]
    for cfg, res in results.items():
        after = res["after"]
        for name in RECIPES:
            t = statistics.median(r["median_s"][name] for r in after)
            ratio = statistics.median(r["median_s"]["baseline"] / r["median_s"][name]
                                      for r in after)
            row = f"| {cfg} | {name} | {BATCH * SEQ / t:.0f} | " + \
                  ("-" if name == "baseline" else f"{ratio:.2f}") + " |"
            if before_rev:
                b = statistics.median(r["median_s"]["baseline"] / r["median_s"][name]
                                      for r in res["before"])
                row += (" - |" if name == "baseline" else f" {b:.2f} |")
            rows.append(row)
    return "\n".join(rows) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of steps per recipe")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per recipe and round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2,
                    help="measurements per tree and config (alternating with --before)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--before", default=None, help="a git revision to measure alongside")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "emulation.md"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        before_rev = export_tree(args.before, tmp) if args.before else None
        results = {}
        for cfg in names:
            res = results[cfg] = {"after": [], "before": []}
            for _ in range(args.repeats):
                res["after"].append(run_worker(ROOT, CONFIGS[cfg], args))
                if before_rev:
                    res["before"].append(run_worker(tmp, CONFIGS[cfg], args))
                print(f"{cfg}: measured", flush=True)
    info = results[names[0]]["after"][0]
    text = (f"# CPU emulation: training tokens/s against the float32 baseline\n\n"
            f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores, "
            f"torch {info['torch']}, {info['threads']} threads; GPT n_layer 2, batch {BATCH} x "
            f"{SEQ} tokens; median step of {args.rounds} rounds x {args.steps} steps (each block "
            f"after one untimed step) after {args.warmup} warm-up steps, {args.repeats} "
            f"measurement(s) per tree (ratios: "
            f"their median)\n\n"
            f"`python bench/bench_emulation.py{''.join(' ' + a for a in sys.argv[1:])}`\n\n"
            + table(results, before_rev))
    print("\n" + text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
