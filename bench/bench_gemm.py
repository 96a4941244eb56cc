"""FP8 GEMM throughput, side by side in one run: fp8ops (CUTLASS sm_90a, via torch.ops.fp8ops.gemm)
vs torch._scaled_mm (cuBLASLt) vs bf16 torch.mm, plus the blockwise-scaled fp8ops GEMM.

All GEMMs are forward shapes: out[M, N] = x[M, K] @ W[N, K]^T (E4M3 x E4M3 -> bf16). Squares
2048..16384, and the linear layers of Llama-3 8B (hidden 4096, intermediate 14336, qkv 6144) and
70B (hidden 8192, intermediate 28672, qkv 10240) for M (tokens) in {1024, 4096, 16384}:
qkv (N=qkv, K=hidden), o (N=hidden, K=hidden), gate+up fused (N=2*inter, K=hidden),
down (N=hidden, K=inter). Timing: bench/_timing.py (L2 flushed, median of CUDA-event-timed runs),
fresh random (never zero) inputs per shape.

    python bench/bench_gemm.py [--quick] [--iters N]

Writes bench/results/gemm.md (table + summary) and bench/results/gemm.png; prints the summary.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import device_info, time_cuda  # noqa: E402  (flush_l2 is used inside time_cuda)

E4M3 = torch.float8_e4m3fn
MODELS = {  # name: (hidden, intermediate, qkv out)
    "llama3-8b": (4096, 14336, 6144),
    "llama3-70b": (8192, 28672, 10240),
}


def shapes(quick: bool):
    out = [(f"square {s}", s, s, s) for s in ((2048, 4096) if quick else (2048, 4096, 8192, 16384))]
    for model, (h, inter, qkv) in MODELS.items():
        for m in ((4096,) if quick else (1024, 4096, 16384)):
            out += [(f"{model} qkv M={m}", m, qkv, h), (f"{model} o M={m}", m, h, h),
                    (f"{model} gate_up M={m}", m, 2 * inter, h),
                    (f"{model} down M={m}", m, h, inter)]
    return out


def _fp8(rows, cols, gen):
    # Normal data scaled into E4M3's range, as a per-tensor current-scaling cast would produce.
    x = torch.randn(rows, cols, device="cuda", generator=gen)
    scale = 448.0 / x.abs().amax()
    return (x * scale).clamp(-448, 448).to(E4M3), (1.0 / scale).float().reshape(())


def _blockwise(x8, s, block_rows):
    """Blockwise scales for already-quantized data: random positive per-block values (the GEMM
    cost does not depend on them)."""
    rows, cols = x8.shape
    return (torch.rand(-(-rows // block_rows), -(-cols // 128), device="cuda") + 0.5) * s


def bench_shape(m, n, k, iters, warmup, gen, configs=()):
    a, sa = _fp8(m, k, gen)
    b, sb = _fp8(n, k, gen)
    a16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    sa_blk, sb_blk = _blockwise(a, sa, 1), _blockwise(b, sb, 128)
    fns = {
        "fp8ops": lambda: torch.ops.fp8ops.gemm(a, b, sa, sb, None, torch.bfloat16, True),
        "fp8ops promoted": lambda: torch.ops.fp8ops.gemm(a, b, sa, sb, None, torch.bfloat16, False),
        "_scaled_mm": lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                               out_dtype=torch.bfloat16, use_fast_accum=True),
        "bf16 mm": lambda: torch.mm(a16, b16.t()),
        "fp8ops blockwise": lambda: torch.ops.fp8ops.gemm_blockwise(a, b, sa_blk, sb_blk, None,
                                                                    torch.bfloat16),
    }
    for config in configs:  # the same fast-accumulation GEMM, each CUTLASS configuration forced
        fns[f"fp8ops {config}"] = _forced(config, fns["fp8ops"])
    # Sanity before timing: fp8ops agrees with _scaled_mm on the same inputs.
    ref = fns["_scaled_mm"]().float()
    got = fns["fp8ops"]().float()
    rel = ((got - ref).norm() / ref.norm()).item()
    if not rel < 1e-2:
        raise SystemExit(f"bench_gemm: fp8ops and _scaled_mm disagree at {m}x{n}x{k} (rel {rel:.3g})")
    flops = 2.0 * m * n * k
    return {name: flops / (time_cuda(fn, iters, warmup) * 1e-3) / 1e12 for name, fn in fns.items()}


def _forced(config, fn):
    """fn with a CUTLASS configuration forced: "name" or "name/sN" (N: rasterization swizzle)."""
    name, _, swz = config.partition("/s")
    env = {"FP8OPS_SM90_GEMM_CONFIG": name, **({"FP8OPS_SM90_SWIZZLE": swz} if swz else {})}

    def run():
        os.environ.update(env)
        try:
            return fn()
        finally:
            for key in env:
                del os.environ[key]
    return run


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--configs", default="",
                    help="comma-separated CUTLASS configurations to time as extra columns "
                         "(coop128, pingpong64, fast_pingpong128, fast_coop256; '/s4' appended "
                         "forces a rasterization swizzle of 4)")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm: needs a CUDA GPU (none visible)")
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        raise SystemExit(f"bench_gemm: needs an sm_90 (Hopper) GPU for the CUTLASS GEMM, got sm_{cc[0]}{cc[1]}")
    import fp8ops
    from fp8ops.ops import backend
    if not backend.extension_loaded() or not torch.ops.fp8ops_C.has_cutlass_sm90():
        raise SystemExit(f"bench_gemm: fp8ops CUTLASS GEMM not available ({fp8ops.backend().reason})")

    info = device_info()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, m, n, k in shapes(args.quick):
        r = bench_shape(m, n, k, args.iters, args.warmup, gen, [c for c in args.configs.split(",") if c])
        rows.append((name, m, n, k, r))
        print(f"{name:28s} {m:6d} {n:6d} {k:6d}  " +
              "  ".join(f"{key} {val:7.1f}" for key, val in r.items()), flush=True)
        torch.cuda.empty_cache()

    ratios = [r["fp8ops"] / r["_scaled_mm"] for *_, r in rows]
    blk = [r["fp8ops blockwise"] / r["fp8ops"] for *_, r in rows]
    sq8192 = next((r for name, *_, r in rows if name == "square 8192"), None)
    summary = [
        f"- fp8ops / torch._scaled_mm (both fast accumulation, bf16 out): geomean "
        f"{geomean(ratios):.3f}, min {min(ratios):.3f} ({rows[ratios.index(min(ratios))][0]})",
        f"- fp8ops promoted / fast accumulation: geomean "
        f"{geomean([r['fp8ops promoted'] / r['fp8ops'] for *_, r in rows]):.3f}",
        f"- fp8ops blockwise / fp8ops per-tensor: geomean {geomean(blk):.3f}, min {min(blk):.3f}",
    ]
    for col in [c for c in rows[0][4] if c.startswith("fp8ops ") and c not in ("fp8ops promoted", "fp8ops blockwise")]:
        rs = [r[col] / r["_scaled_mm"] for *_, r in rows]
        summary.append(f"- {col} / torch._scaled_mm: geomean {geomean(rs):.3f}, min {min(rs):.3f} "
                       f"({rows[rs.index(min(rs))][0]})")
    if sq8192:
        summary.append(f"- fp8ops / bf16 torch.mm at 8192^3: {sq8192['fp8ops'] / sq8192['bf16 mm']:.2f}x "
                       f"({sq8192['fp8ops']:.0f} vs {sq8192['bf16 mm']:.0f} TFLOP/s)")

    os.makedirs(args.out, exist_ok=True)
    cols = list(rows[0][4].keys())
    with open(os.path.join(args.out, "gemm.md"), "w") as f:
        f.write("# FP8 GEMM throughput (TFLOP/s)\n\n")
        f.write(", ".join(f"{k}: {v}" for k, v in info.items()) + "\n\n")
        f.write("Forward shapes out[M,N] = x[M,K] @ W[N,K]^T, E4M3 x E4M3 -> bf16 (bf16 mm: bf16 "
                "inputs). fp8ops and _scaled_mm use fast accumulation; 'promoted' is "
                "fp8ops.gemm(fast_accum=False): cuBLASLt without fast accumulation on Hopper "
                "(tables before that change measured the CUTLASS mainloop promoting to FP32 "
                "every 128 of K); "
                "blockwise: 1x128 x 128x128 scales. L2 flushed, median of "
                f"{args.iters} CUDA-event-timed runs.\n\n")
        f.write("| shape | M | N | K | " + " | ".join(cols) + " | fp8ops/_scaled_mm |\n")
        f.write("|---|---:|---:|---:|" + "---:|" * (len(cols) + 1) + "\n")
        for (name, m, n, k, r), ratio in zip(rows, ratios):
            f.write(f"| {name} | {m} | {n} | {k} | " + " | ".join(f"{r[c]:.1f}" for c in cols) +
                    f" | {ratio:.3f} |\n")
        f.write("\n## Summary\n\n" + "\n".join(summary) + "\n")
    _plot(rows, cols, info, os.path.join(args.out, "gemm.png"))
    print("\n".join(summary))
    print(f"wrote {os.path.join(args.out, 'gemm.md')} and gemm.png")


def _plot(rows, cols, info, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.55), 5))
    width = 0.8 / len(cols)
    for i, c in enumerate(cols):
        ax.bar([j + i * width for j in range(len(rows))], [r[c] for *_, r in rows], width, label=c)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([name for name, *_ in rows], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"FP8 GEMM, {info.get('name', info.get('device', ''))}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
