"""CPU training speed of the emulation: tokens/s of each FP8 recipe against the float32 baseline,
measured side by side in one process, on either or both of two models (--model):

gpt: the training demo's GPT (same seed and batches as examples/train_gpt.py; its blocks'
  Linears in FP8), the demo's step: forward, backward, clip, AdamW step.
mlp: 4 blocks Linear(256, 1024) - GELU - Linear(1024, 256) in sequence, every Linear in FP8
  (fallback="never"), 1024 tokens a step (random inputs and targets, mean squared error), SGD.

Each configuration builds the model once per recipe (the recipes of examples/train_gpt.py),
runs warm-up steps, then rounds in which every recipe runs one untimed step (caches are cold
after another model ran; the demo runs each recipe alone) and times a few more, in a rotating
order so that no recipe always runs after the same neighbour. A recipe's step time is the
median over all rounds; its ratio is baseline step time / its step time (>= 1 would be as
fast as float32).

    python bench/bench_emulation.py                      # the demo's config and d_model 256
    python bench/bench_emulation.py --model mlp          # the MLP
    python bench/bench_emulation.py --model gpt,mlp      # both, in one table
    python bench/bench_emulation.py --before HEAD~3      # the same run on another commit too

--before REV exports that commit's tree (git archive), builds its CPU extensions there
(fp8ops._cpu and fp8ops._step; setup.py build_ext --inplace without CUDA, about a minute) and
measures it in a subprocess, its own baseline included, alternating with this tree: both
columns of ratios come from one run, each with its own C++ kernels.
Prints a markdown table and writes it to bench/results/emulation.md.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from _timing import cpu_name

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPES = ["baseline", "delayed", "current", "current_stochastic", "mxfp8", "blockwise"]
BATCH, SEQ = 16, 64  # the GPT's batch, as the demo's cpu size
MODELS = {  # --model -> {config name: its size}
    "gpt": {
        "demo (d_model 128)": dict(model="gpt", d_model=128, n_layer=2, n_head=4),
        "d_model 256": dict(model="gpt", d_model=256, n_layer=2, n_head=4),
    },
    "mlp": {
        "mlp (d_model 256)": dict(model="mlp", d_model=256, hidden=1024, n_block=4,
                                  tokens=1024),
    },
}
DESCRIBE = {  # --model -> what the table's head says about the model and its step
    "gpt": f"GPT n_layer 2, batch {BATCH} x {SEQ} tokens, AdamW",
    "mlp": "MLP of 4 blocks Linear(256, 1024) - GELU - Linear(1024, 256), 1024 tokens, SGD",
}


def tokens_per_step(config: dict) -> int:
    return config["tokens"] if config["model"] == "mlp" else BATCH * SEQ


def measure(tree: str, config: dict, rounds: int, steps: int, warmup: int, threads: int):
    """Median step seconds per recipe, with fp8ops and the demo imported from `tree`."""
    sys.path[:0] = [os.path.join(tree, "examples"), tree]
    import torch

    import fp8ops
    assert os.path.dirname(os.path.dirname(os.path.abspath(fp8ops.__file__))) == \
        os.path.abspath(tree), fp8ops.__file__
    import train_gpt

    if threads:
        torch.set_num_threads(threads)
    if config["model"] == "mlp":
        make = _mlp_maker(torch, fp8ops, train_gpt, config)
    else:
        make = _gpt_maker(torch, fp8ops, train_gpt, config)
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
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "extensions": _extensions_loaded(fp8ops)}


def _extensions_loaded(fp8ops) -> str:
    """Which of the CPU extensions the measured steps loaded (an unbuilt tree runs the
    emulation's tensor code and the Python layer step), and any that did not come from the
    measured tree (an editable install of another checkout can supply one the tree lacks)."""
    here = os.path.dirname(os.path.abspath(fp8ops.__file__))
    names = []
    for name in ("fp8ops._cpu", "fp8ops._step"):
        module = sys.modules.get(name)
        if module is not None:
            where = os.path.dirname(os.path.abspath(module.__file__))
            names.append(name if where == here else f"{name} from {where}")
    return ", ".join(names) or "none"


def _gpt_maker(torch, fp8ops, train_gpt, config):
    """make(recipe name) -> one step of the demo's GPT in that recipe."""
    from data import VOCAB_SIZE, Batches, load_tokens
    from gpt import GPT, GPTConfig
    train_tokens, _ = load_tokens()
    size = {k: v for k, v in config.items() if k != "model"}

    def make(name):
        recipe = train_gpt.RECIPES[name]()
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, seq_len=SEQ, **size))
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
    return make


def _mlp_maker(torch, fp8ops, train_gpt, config):
    """make(recipe name) -> one SGD step of the MLP in that recipe, every Linear in FP8."""
    nn = torch.nn
    d, hidden, tokens = config["d_model"], config["hidden"], config["tokens"]
    # every layer in FP8 (a revision older than the fallback rule has none to turn off)
    never = {"fallback": "never"} if "fallback" in \
        inspect.signature(fp8ops.convert_to_fp8).parameters else {}
    gen = torch.Generator().manual_seed(1)
    # a few fixed batches, taken in turn (the same for every recipe)
    batches = [(torch.randn(tokens, d, generator=gen), torch.randn(tokens, d, generator=gen))
               for _ in range(4)]

    def make(name):
        recipe = train_gpt.RECIPES[name]()
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(d, hidden), nn.GELU(),
                                              nn.Linear(hidden, d))
                                for _ in range(config["n_block"])))
        if recipe is not None:
            fp8ops.convert_to_fp8(model, recipe, **never)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        count = [0]

        def step():
            x, y = batches[count[0] % len(batches)]
            count[0] += 1
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        return step
    return make


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
    """rev's files in dest, its CPU extensions built in place; returns rev's short name."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    print(f"building {rev}'s CPU extensions", flush=True)
    build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest,
                           env=dict(os.environ, FP8OPS_SKIP_CUDA_BUILD="1"),
                           capture_output=True, text=True)
    if build.returncode:
        raise SystemExit(f"building {rev}'s CPU extensions failed:\n{build.stdout[-3000:]}"
                         f"{build.stderr[-3000:]}")
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], check=True,
                          capture_output=True, text=True).stdout.strip()


def _ratios(runs, name):
    """(median, low, high) over the measurements of baseline time / the recipe's time."""
    r = [run["median_s"]["baseline"] / run["median_s"][name] for run in runs]
    return statistics.median(r), min(r), max(r)


def table(results, configs, before_rev):
    """One row per config and recipe: tokens/s (median over the measurements), the ratio (their
    median) and its range over them, for this tree and with --before for that one."""
    head = "| config | recipe | tokens/s | ratio to float32 | range |"
    sep = "|---|---|---:|---:|---:|"
    if before_rev:
        head += f" ratio before ({before_rev}) | range before |"
        sep += "---:|---:|"
    rows = [head, sep]
    for cfg, res in results.items():
        for name in RECIPES:
            t = statistics.median(r["median_s"][name] for r in res["after"])
            row = f"| {cfg} | {name} | {tokens_per_step(configs[cfg]) / t:.0f} |"
            for runs in [res["after"]] + ([res["before"]] if before_rev else []):
                if name == "baseline":
                    row += " - | - |"
                else:
                    mid, lo, hi = _ratios(runs, name)
                    row += f" {mid:.2f} | {lo:.2f}-{hi:.2f} |"
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
    ap.add_argument("--model", default="gpt",
                    help="the model(s), comma-separated: gpt (the demo's GPT), mlp (module doc)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated subset of the model's configs (default: all): " +
                    "; ".join(f"{m}: " + ", ".join(c) for m, c in MODELS.items()))
    ap.add_argument("--before", default=None, help="a git revision to measure alongside")
    ap.add_argument("--before-tree", default=None,
                    help="with --before: that revision's tree, exported and built already (its "
                         "CPU extensions in place), measured instead of a fresh export")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "emulation.md"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)

    models = [m.strip() for m in args.model.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        raise SystemExit(f"--model takes one or more of {', '.join(MODELS)}, got {args.model!r}")
    configs = {name: cfg for m in models for name, cfg in MODELS[m].items()}
    names = [c.strip() for c in (args.configs or ",".join(configs)).split(",") if c.strip()]
    unknown = [c for c in names if c not in configs]
    if unknown:
        raise SystemExit(f"unknown config(s) for --model {args.model}: {', '.join(unknown)}; "
                         f"choose from: {', '.join(configs)}")
    if args.before_tree and not args.before:
        raise SystemExit("--before-tree names the tree of --before REV: give both")
    with tempfile.TemporaryDirectory() as tmp:
        if args.before_tree:
            tmp = os.path.abspath(args.before_tree)
            before_rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.before],
                                        check=True, capture_output=True, text=True).stdout.strip()
        else:
            before_rev = export_tree(args.before, tmp) if args.before else None
        results = {}
        for cfg in names:
            res = results[cfg] = {"after": [], "before": []}
            for _ in range(args.repeats):
                res["after"].append(run_worker(ROOT, configs[cfg], args))
                if before_rev:
                    res["before"].append(run_worker(tmp, configs[cfg], args))
                print(f"{cfg}: measured", flush=True)
    info = results[names[0]]["after"][0]
    ext = f"extensions: {info['extensions']}"
    if before_rev:
        ext += f" ({before_rev}: {results[names[0]]['before'][0]['extensions']})"
    text = (f"# CPU emulation: training tokens/s against the float32 baseline\n\n"
            f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores, "
            f"torch {info['torch']}, {info['threads']} threads, {ext}; "
            f"{'; '.join(DESCRIBE[m] for m in models)}; "
            f"median step of {args.rounds} rounds x {args.steps} steps (each block after one "
            f"untimed step) after {args.warmup} warm-up steps, {args.repeats} measurement(s) per "
            f"tree (ratios: their median, and their range)\n\n"
            f"`python bench/bench_emulation.py{''.join(' ' + shlex.quote(a) for a in sys.argv[1:])}`\n\n"
            + table(results, configs, before_rev))
    print("\n" + text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
