"""The backward GEMMs of FP8Linear, side by side in one run: which GEMM should run dgrad and wgrad.

For a layer x [M, K] @ W[N, K]^T the backward multiplies E5M2 gradients by E4M3 operands:
  dgrad  dX [M, K] = dY [M, N] @ (W^T [K, N])^T        out bf16
  wgrad  dW [N, K] = dY^T [N, M] @ (X^T [K, M])^T      out bf16 (the parameter's dtype)
Candidates: fp8ops' CUTLASS GEMM with promoted accumulation (FP8OPS_SM90_PROMOTED_GEMM=cutlass)
and with fast accumulation, torch._scaled_mm (cuBLASLt) without fast accumulation (what
fp8ops.gemm(fast_accum=False), so FP8Linear, runs on Hopper) and with it, and bf16 torch.mm as
the reference. Each row: TFLOP/s of every candidate and the speed-up against the CUTLASS
promoted GEMM, timed in one run (bench/_timing.py: L2 flushed, median of CUDA-event-timed
runs), fresh random inputs per shape. A GEMM that raises is recorded with its error.

    python bench/bench_backward_gemm.py [--iters N] [--quick]

Writes bench/results/backward_gemm.md and prints it. Fast accumulation in dgrad would also need
bench/bench_quality.py to show no quality change (on a GPU) before FP8Linear used it.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import fp8ops  # noqa: E402,F401  (registers torch.ops.fp8ops)
from _timing import device_info, error_text, require_gpu, time_cuda, write_table  # noqa: E402
from bench_linear import SHAPES  # noqa: E402  (the layer shapes bench_linear times)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CANDIDATES = ("CUTLASS promoted", "fp8ops fast", "_scaled_mm", "_scaled_mm fast", "bf16 mm")


def _cast(rows, cols, dtype, gen):
    """Normal data scaled into the format's range, as a per-tensor cast would produce."""
    x = torch.randn(rows, cols, device="cuda", generator=gen)
    top = torch.finfo(dtype).max
    scale = top / x.abs().amax()
    return (x * scale).clamp(-top, top).to(dtype), (1.0 / scale).float().reshape(())


# what a candidate runs under: fp8ops routes promoted GEMMs to cuBLASLt unless asked otherwise
ENV = {"CUTLASS promoted": {"FP8OPS_SM90_PROMOTED_GEMM": "cutlass"}}


@contextlib.contextmanager
def candidate_env(name):
    """ENV[name] set around all of a candidate's calls (outside its timed window), then the
    environment as it was."""
    wanted = ENV.get(name, {})
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def gemms(a, sa, b, sb, a16, b16):
    """out = a @ b^T, a [rows, inner] E5M2, b [cols, inner] E4M3, by every candidate."""
    return {
        "CUTLASS promoted": lambda: torch.ops.fp8ops.gemm(a, b, sa, sb, None, torch.bfloat16,
                                                          False),
        "fp8ops fast": lambda: torch.ops.fp8ops.gemm(a, b, sa, sb, None, torch.bfloat16, True),
        "_scaled_mm": lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                               out_dtype=torch.bfloat16, use_fast_accum=False),
        "_scaled_mm fast": lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                                    out_dtype=torch.bfloat16,
                                                    use_fast_accum=True),
        "bf16 mm": lambda: torch.mm(a16, b16.t()),
    }


def bench(rows, cols, inner, iters, warmup, gen):
    a, sa = _cast(rows, inner, E5M2, gen)
    b, sb = _cast(cols, inner, E4M3, gen)
    a16 = torch.randn(rows, inner, device="cuda", dtype=torch.bfloat16, generator=gen)
    b16 = torch.randn(cols, inner, device="cuda", dtype=torch.bfloat16, generator=gen)
    fns = gemms(a, sa, b, sb, a16, b16)
    with candidate_env("CUTLASS promoted"):  # every FP8 candidate computes the same product
        ref = fns["CUTLASS promoted"]().float()
    out = {}
    flops = 2.0 * rows * cols * inner
    for name, fn in fns.items():
        try:
            with candidate_env(name):
                if name != "bf16 mm":
                    got = fn().float()
                    rel = ((got - ref).norm() / ref.norm()).item()
                    if not rel < 1e-2:
                        raise RuntimeError("disagrees with the CUTLASS promoted GEMM "
                                           f"(rel {rel:.3g})")
                out[name] = flops / (time_cuda(fn, iters, warmup) * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001 - recorded in the table instead
            out[name] = error_text(exc)
    return out


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the first three layer shapes only")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    require_gpu()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, k, n in SHAPES[:3] if args.quick else SHAPES:
        for kind, (r, c, i) in (("dgrad", (m, k, n)), ("wgrad", (n, k, m))):
            res = bench(r, c, i, args.iters, args.warmup, gen)
            rows.append(((m, k, n), kind, res))
            print(f"M={m:6d} K={k:5d} N={n:6d} {kind}: " + "  ".join(
                f"{name} {cell(res[name])}" for name in CANDIDATES), flush=True)
        torch.cuda.empty_cache()
    write_table(args.out, "backward_gemm.md", render(rows, device_info(), args))
    return rows


def cell(v) -> str:
    return f"{v:.0f}" if isinstance(v, float) else str(v)


def speedup(res, name):
    base, t = res.get("CUTLASS promoted"), res.get(name)
    return t / base if isinstance(base, float) and isinstance(t, float) else None


def render(rows, info, args) -> str:
    lines = ["# FP8Linear's backward GEMMs: TFLOP/s, and speed-up against the CUTLASS promoted "
             "GEMM", "", ", ".join(f"{k}: {v}" for k, v in info.items()), "",
             f"median of {args.iters} CUDA-event-timed runs, L2 flushed before each; E5M2 x "
             "E4M3 -> bf16", "",
             "| M | K | N | GEMM | " + " | ".join(CANDIDATES) + " | " +
             " | ".join(f"{c} / promoted" for c in CANDIDATES[1:]) + " |",
             "|---:|---:|---:|---|" + "---:|" * (2 * len(CANDIDATES) - 1)]
    geo = {c: [] for c in CANDIDATES[1:]}
    for (m, k, n), kind, res in rows:
        ratios = []
        for c in CANDIDATES[1:]:
            r = speedup(res, c)
            ratios.append("-" if r is None else f"{r:.2f}")
            if r is not None:
                geo[c].append(r)
        lines.append(f"| {m} | {k} | {n} | {kind} | " + " | ".join(
            cell(res[c]) for c in CANDIDATES) + " | " + " | ".join(ratios) + " |")
    means = [f"{math.exp(sum(map(math.log, v)) / len(v)):.2f}" if v else "-"
             for v in geo.values()]
    lines.append("| | | | geomean | " + " | ".join([""] * len(CANDIDATES)) + " | " +
                 " | ".join(means) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
