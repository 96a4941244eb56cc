"""Training step of one Llama-3-8B-shaped transformer block: FP8 recipes against bf16, side by
side in one run, eagerly and under CUDA graphs, on a GPU.

The block is bench/bench_comm.py's LlamaBlock (hidden 4096, SwiGLU FFN 14336 with gate, up and
down projections, 32 query and 8 KV heads through F.scaled_dot_product_attention, causal, two
RMSNorms; no rotary embedding: it has no parameters), bf16 parameters, batch --batch x --seq
tokens. One step: y = block(x), y.backward(y - target) (the gradient of 0.5 |y - target|^2),
then torch.optim.SGD (foreach) over the block's parameters, so FP8Linear's per-step weight
recast counts. Variants: the bf16 block (nn.Linear) and the block converted by
fp8ops.convert_to_fp8(block, recipe, fallback=--fallback) for each recipe (default "never": FP8
at every shape, the recipe's own speed), each on its own copy, in two modes: eager,
and graph (forward and backward captured once with torch.cuda.graph and replayed; the optimizer
step runs eagerly after each replay). A variant that raises is recorded in the table with its
error; the others go on. All variants are timed in interleaved rounds (--iters steps each per
round, CUDA events, the L2 flushed before each step); reported: the median per variant over all
rounds and the speed-up bf16 time / FP8 time against bf16 in the same mode. Random inputs and
target, the same for every variant.

    python bench/bench_block.py [--batch 2] [--rounds R] [--iters N] [--modes eager,graph]
    python bench/bench_block.py --modes graph --recipes current --sdpa flash  # one attention
    python bench/bench_block.py --device cpu --smoke     # runs end to end; not a measurement

A graph-mode variant whose weights are not finite after the timed steps is reported as such
(its time is no result).

Writes bench/results/block.md (a smoke run only to --out) and prints it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import (add_smoke_options, captured_step, device_info, error_text,  # noqa: E402
                     interleaved, results_dir, write_table)
from bench_comm import LlamaBlock  # noqa: E402

RECIPES = ("current", "delayed", "mxfp8", "blockwise")
MODES = ("eager", "graph")
LLAMA3_8B = dict(d_model=4096, ffn=14336, n_head=32, n_kv_head=8)
SMOKE = dict(d_model=64, ffn=128, n_head=4, n_kv_head=2)
LR = 1e-7  # the loss sums over tokens: small enough for a stable descent at batch 2 x 8192


def recipe(name):
    import fp8ops
    return {"current": fp8ops.CurrentScaling, "delayed": fp8ops.DelayedScaling,
            "mxfp8": fp8ops.MXFP8Scaling, "blockwise": fp8ops.BlockwiseScaling}[name]()


SDPA = {"auto": None, "math": "MATH", "flash": "FLASH_ATTENTION",
        "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def _attention(sdpa: str):
    """The context that pins scaled_dot_product_attention to one backend ("auto": torch's)."""
    if SDPA[sdpa] is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, SDPA[sdpa]))


def build_step(base, name, mode, x, target, warmup=3, sdpa="auto", fallback="never"):
    """(step function, block) of one variant, on its own copy of the block, optimizer and
    input."""
    import fp8ops
    block = copy.deepcopy(base)
    if name != "bf16":
        fp8ops.convert_to_fp8(block, recipe(name), fallback=fallback)
    x = x.detach().clone().requires_grad_()
    opt = torch.optim.SGD(block.parameters(), lr=LR, foreach=True)

    def forward_backward():
        # a loss bounded below: small SGD steps keep the weights finite however many steps run
        # (a fixed dy, a loss linear in y, drives them to infinity through the block)
        with _attention(sdpa):
            y = block(x)
            y.backward(y.detach() - target)

    def zero_grad():
        opt.zero_grad(set_to_none=True)
        x.grad = None

    if mode == "eager":
        def step():
            zero_grad()
            forward_backward()
            opt.step()
        return step, block
    # the optimizer step runs eagerly after each replay: the next replay casts the new weights
    return captured_step(forward_backward, zero_grad, opt.step, warmup), block


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--modes", default=",".join(MODES), help="eager, graph (CUDA only)")
    ap.add_argument("--sdpa", choices=sorted(SDPA), default="auto",
                    help="pin the attention to one backend (default: torch's choice)")
    ap.add_argument("--fallback", choices=("never", "auto"), default="never",
                    help="the FP8 layers' fallback: never (FP8 at every shape: the recipes' speed) "
                         "or auto (the GPU's measured crossover: what a user gets)")
    add_smoke_options(ap, "tiny block (hidden 64, ffn 128, 4 heads, 2 KV heads, seq 32), 1 "
                          "round of 2 steps: checks the script runs, measures nothing")
    args = ap.parse_args(argv)
    dims = LLAMA3_8B
    if args.smoke:
        dims, args.seq, args.rounds, args.iters, args.warmup = SMOKE, 32, 1, 2, 1
    modes = [m for m in args.modes.split(",") if m]
    out_dir = results_dir(args, os.path.join(HERE, "results"))
    if args.device != "cuda":
        modes = [m for m in modes if m != "graph"]  # CUDA graphs need a GPU

    dev = args.device
    torch.manual_seed(0)
    base = LlamaBlock(**dims).to(dev, torch.bfloat16)
    x = torch.randn(args.batch, args.seq, dims["d_model"], device=dev, dtype=torch.bfloat16)
    target = torch.randn_like(x)
    names = ["bf16"] + [r for r in args.recipes.split(",") if r]
    steps, blocks, results = {}, {}, {}
    for mode in modes:
        for name in names:
            try:
                steps[mode, name], blocks[mode, name] = build_step(base, name, mode, x,
                                                                   target, args.warmup,
                                                                   args.sdpa, args.fallback)
            except Exception as exc:  # noqa: BLE001 - recorded in the table instead
                results[mode, name] = error_text(exc)
            print(f"built {mode} {name}: {results.get((mode, name), 'ok')}", flush=True)
    results.update(interleaved(steps, dev, args.rounds, args.iters, args.warmup))
    for key, block in blocks.items():  # a time over inf or NaN weights is no result
        bad = [n for n, p in block.named_parameters() if not p.isfinite().all()]
        if isinstance(results[key], float) and bad:  # (which ones: a lead to the cause)
            results[key] = (f"{results[key]:.3f} ms, but the weights were not finite after it "
                            f"({len(bad)} of {len(list(block.parameters()))}: "
                            f"{', '.join(bad[:3])})")

    table = render(results, modes, names, dims, device_info(dev), args)
    write_table(out_dir, "block.md", table)
    return results


def render(results, modes, names, dims, info, args) -> str:
    timing = (f"median over {args.rounds} interleaved rounds of {args.iters} CUDA-event-timed "
              "steps per variant, L2 flushed before each step")
    if args.smoke:
        timing = (f"SMOKE RUN on {args.device}: wall clock, {args.rounds} round of {args.iters} "
                  "steps, tiny block; checks that the script runs, NOT a measurement")
    shape = (f"hidden {dims['d_model']}, ffn {dims['ffn']}, {dims['n_head']} heads, "
             f"{dims['n_kv_head']} KV heads, batch {args.batch} x seq {args.seq}, bf16 parameters, "
             f"attention backend: {args.sdpa}, FP8 layers' fallback: {args.fallback}")
    lines = ["# Llama-3-8B-shaped block, training step (forward + backward + SGD step): FP8 "
             "recipes vs bf16 (speed-up = bf16 time / FP8 time, same mode)", "",
             ", ".join(f"{k}: {v}" for k, v in info.items()), "", shape, "", timing, "",
             "| mode | variant | step ms | speed-up vs bf16 |", "|---|---|---:|---:|"]
    for mode in modes:
        t_bf16 = results[mode, "bf16"]
        for name in names:
            t = results[mode, name]
            if not isinstance(t, float):
                lines.append(f"| {mode} | {name} | {t} | - |")
                continue
            speed_up = f"{t_bf16 / t:.2f}" if isinstance(t_bf16, float) else "-"
            lines.append(f"| {mode} | {name} | {t:.3f} | {speed_up} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
