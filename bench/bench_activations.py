"""What fp8ops.fp8_activations saves: bytes saved for backward, peak memory and step time of a
training step of the example GPT and Llama (bf16, FP8Linear blocks), with and without it.

    python bench/bench_activations.py                        # GPU: the "gpu" sizes
    python bench/bench_activations.py --device cpu --smoke   # the examples' small sizes

Saved bytes: the distinct storages that autograd saves in one forward (saved_tensors_hooks;
parameters left out), exact on any device. Peak: torch.cuda.max_memory_allocated on a GPU,
torch's MemTracker on the CPU. Step time: forward + backward + SGD step, both variants timed
side by side (bench/_timing.interleaved); the ratio is with / without. On the CPU the casts are
the emulation's and the mode's Python overhead weighs more: its times are indicative only.
Writes bench/results/activations.md (a smoke run only to --out) and prints it.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(1, os.path.dirname(HERE))
import fp8ops  # noqa: E402
from _timing import (add_smoke_options, device_info, interleaved, results_dir,  # noqa: E402
                     write_table)
from gpt import GPT, GPTConfig  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402

MODELS = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}
SIZES = {"smoke": dict(d_model=128, n_layer=2, n_head=4, seq_len=64),
         "gpu": dict(d_model=1024, n_layer=8, n_head=16, seq_len=1024)}
BATCH = {"smoke": 4, "gpu": 8}


def build(name, size, device):
    model_cls, cfg_cls = MODELS[name]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**SIZES[size])).to(device=device, dtype=torch.bfloat16)
    fp8ops.convert_to_fp8(model, fp8ops.CurrentScaling(),
                          filter_fn=lambda module, fqn: fqn.startswith("blocks."))
    idx = torch.randint(0, model.cfg.vocab_size, (BATCH[size], model.cfg.seq_len), device=device)
    return model, idx


def context(on):
    return fp8ops.fp8_activations() if on else contextlib.nullcontext()


def saved_bytes(model, idx, on) -> int:
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context(on):
        model(idx, idx)
    return sum(storages.values())


def train_step(model, idx, on):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        with context(on):
            loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def peak_bytes(model, idx, on, device) -> int:
    step = train_step(model, idx, on)
    step()  # the first step allocates what later steps reuse
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(model, idx)
    with tracker:
        step()
    (snap,) = tracker.get_tracker_snapshot("peak").values()
    return snap["Total"]


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per round (default 5)")
    add_smoke_options(ap, "the examples' small sizes, 1 round of 2 steps unless told more")
    args = ap.parse_args(argv)
    out_dir = results_dir(args, os.path.join(HERE, "results"))
    size = "smoke" if args.smoke else "gpu"
    rounds = args.rounds or (1 if args.smoke else 5)
    iters = args.iters or (2 if args.smoke else 5)
    rows = []
    for name in MODELS:
        model, idx = build(name, size, args.device)
        saved = [saved_bytes(model, idx, on) for on in (False, True)]
        peak = [peak_bytes(model, idx, on, args.device) for on in (False, True)]
        ms = interleaved({on: train_step(model, idx, on) for on in (False, True)}, args.device,
                         rounds, iters, warmup=1)
        rows.append(dict(model=name, saved=saved, peak=peak, ms=[ms[False], ms[True]]))
    info = device_info(args.device)
    lines = [f"# fp8_activations: {info['device']}, torch {info['torch']}, sizes {size} "
             f"{SIZES[size]}, batch {BATCH[size]}, bf16, FP8Linear blocks (current scaling)",
             "", f"rounds {rounds} x iters {iters}"
             + (" (CPU: emulated casts, times indicative only)" if args.device == "cpu" else ""),
             "", "| model | saved MB without | with | ratio | peak MB without | with | ratio "
             "| step ms without | with | ratio |", "|---" * 10 + "|"]
    for r in rows:
        cells = [r["model"]]
        for key in ("saved", "peak"):
            a, b = r[key]
            cells += [f"{a / 1e6:.2f}", f"{b / 1e6:.2f}", f"{b / a:.3f}"]
        a, b = r["ms"]
        ok = all(isinstance(v, float) for v in (a, b))
        cells += [f"{a:.1f}", f"{b:.1f}", f"{b / a:.3f}"] if ok else [str(a), str(b), "-"]
        lines.append("| " + " | ".join(cells) + " |")
    write_table(out_dir, "activations.md", "\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
