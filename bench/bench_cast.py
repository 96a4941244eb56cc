"""Cast-kernel bandwidth: fp8ops CUDA kernels vs a device-to-device copy of the same bytes and vs
torch.compile of the emulation, side by side in one run, on bf16 inputs from 1 MB to 1 GB.

GB/s counts bytes read + written. Each figure is the median of many CUDA-event-timed runs with
the L2 flushed before each, on fresh random inputs. Prints a markdown table and writes it to
bench/results/cast.md, with a plot in bench/results/cast.png.

    python bench/bench_cast.py [--max-mb 1024] [--iters 30] [--no-compile]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_info, require_gpu, time_cuda  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
E4M3 = torch.float8_e4m3fn


def _cases(x, scale):
    """name -> (fp8ops fn, emulation fn, bytes moved). x is bf16 [rows, cols]."""
    import fp8ops  # noqa: F401
    from fp8ops.ops import emulation as emu

    ops = torch.ops.fp8ops
    n = x.numel()
    rows, cols = x.shape
    rb_c = (cols + 127) // 128
    return {
        "amax": (lambda: ops.amax(x), lambda: emu.amax(x), 2 * n + 4),
        "quantize": (lambda: ops.quantize(x, scale, E4M3), lambda: emu.quantize(x, scale, E4M3),
                     3 * n + 8),
        "quantize stochastic": (lambda: ops.quantize(x, scale, E4M3, False, True, 1, 2),
                                lambda: emu.quantize(x, scale, E4M3, False, True, 1, 2), 3 * n + 8),
        "quantize+transpose+amax": (lambda: ops.quantize(x, scale, E4M3, True),
                                    lambda: emu.quantize(x, scale, E4M3, True), 4 * n + 8),
        "quantize_mx (1x32)": (lambda: ops.quantize_mx(x, E4M3, 32, -1, False),
                               lambda: emu.quantize_mx(x, E4M3, 32, -1, False), 3 * n + n // 32),
        "quantize_blockwise 1x128": (lambda: ops.quantize_blockwise(x, E4M3, 1, 128, False),
                                     lambda: emu.quantize_blockwise(x, E4M3, 1, 128, False),
                                     3 * n + 4 * rows * rb_c),
        "quantize_blockwise 128x128": (lambda: ops.quantize_blockwise(x, E4M3, 128, 128, False),
                                       lambda: emu.quantize_blockwise(x, E4M3, 128, 128, False),
                                       3 * n + 4 * ((rows + 127) // 128) * rb_c),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=int, default=1024, help="largest input in MB of bf16")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the emulation")
    ap.add_argument("--compile-mb", default="1,16,256",
                    help="input sizes (MB) at which torch.compile of the emulation is timed too "
                         "(each size compiles anew)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    require_gpu()
    from fp8ops.ops import backend

    import fp8ops  # noqa: F401
    if not backend.extension_loaded():
        raise SystemExit("fp8ops._C is not loaded (" + backend._state["why_not"] + "): build it first")

    info = device_info()
    cols = 4096
    sizes_mb = [mb for mb in (1, 4, 16, 64, 256, 1024) if mb <= args.max_mb]
    compile_mb = {int(v) for v in args.compile_mb.split(",") if v}
    rows_out, plot = [], {}
    for mb in sizes_mb:
        n = mb * (1 << 20) // 2
        x = torch.randn(n // cols, cols, device="cuda", dtype=torch.bfloat16) * 3 + 0.5  # never zeros
        scale = torch.tensor(448.0 / float(x.float().abs().max()), device="cuda")
        dst = torch.empty_like(x)
        t_copy = time_cuda(lambda: dst.copy_(x), args.iters)
        copy_gbs = 2 * x.numel() * 2 / t_copy / 1e6
        rows_out.append((mb, "d2d copy", t_copy, copy_gbs, 1.0, float("nan")))
        plot.setdefault("d2d copy", []).append((mb, copy_gbs))
        for name, (fn, emu_fn, nbytes) in _cases(x, scale).items():
            t = time_cuda(fn, args.iters)
            gbs = nbytes / t / 1e6
            t_emu = float("nan")
            if not args.no_compile and mb in compile_mb:
                try:
                    cfn = torch.compile(emu_fn, dynamic=False)
                    t_emu = time_cuda(cfn, max(5, args.iters // 3))
                except Exception as e:  # compile may not handle every emulation op
                    print(f"torch.compile failed for {name}: {type(e).__name__}: {e}", file=sys.stderr)
            rows_out.append((mb, name, t, gbs, gbs / copy_gbs, nbytes / t_emu / 1e6))
            print(f"{mb:5d} MB  {name:28s} {gbs:7.0f} GB/s  {gbs / copy_gbs:5.2f} x copy  "
                  f"compiled emulation {nbytes / t_emu / 1e6:7.0f} GB/s", flush=True)
            plot.setdefault(name, []).append((mb, gbs))
        del x, dst
        torch.cuda.empty_cache()

    lines = [
        "# Cast kernels: GB/s (bytes read + written), bf16 input [n / 4096, 4096] -> E4M3",
        "",
        "device: {device} (cc {capability}, {sms} SMs), torch {torch}, CUDA {cuda}".format(**info),
        f"median of {args.iters} CUDA-event timings, L2 flushed (256 MB write) before each run",
        "",
        "| input MB | op | ms | GB/s | vs copy | torch.compile(emulation) GB/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for mb, name, t, gbs, ratio, emu in rows_out:
        emu_s = "" if emu != emu else f"{emu:.0f}"
        lines.append(f"| {mb} | {name} | {t:.4f} | {gbs:.0f} | {ratio:.2f} | {emu_s} |")
    table = "\n".join(lines) + "\n"
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cast.md"), "w") as f:
        f.write(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for name, pts in plot.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                    linestyle="--" if name == "d2d copy" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bf16 input (MB)")
        ax.set_ylabel("GB/s (read + write)")
        ax.set_title(f"fp8ops cast kernels on {info['device']}")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "cast.png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot written", file=sys.stderr)


if __name__ == "__main__":
    main()
