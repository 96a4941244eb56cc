"""The emulation's C++ CPU kernels (fp8ops._cpu) against its own PyTorch tensor code, op by op,
in one process: median time of each op with the kernels on and off, and their ratio.

    python bench/bench_cpu_kernels.py                # sizes of the demo's layers and larger
    python bench/bench_cpu_kernels.py --iters 100

The two columns run alternately on the same inputs (interleaved calls, so that a slow moment of
a shared machine hits both). Writes a markdown table to bench/results/cpu_kernels.md.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from fp8ops.ops import cpu_kernels  # noqa: E402
from fp8ops.ops import emulation as E  # noqa: E402
from _timing import cpu_name  # noqa: E402

E4M3 = torch.float8_e4m3fn
SHAPES = [(1024, 512), (4096, 2048)]


def cases(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3.0
    s = torch.tensor(11.0)
    return [
        ("quantize, stochastic (E5M2, + transpose)",
         lambda: E.quantize(x, s, torch.float8_e5m2, True, True, 7, 3)),
        ("quantize_mx, blocks along rows", lambda: E.quantize_mx(x, E4M3, 32, -1, False)),
        ("quantize_mx, blocks along columns", lambda: E.quantize_mx(x, E4M3, 32, 0, False)),
        ("quantize_blockwise 1x128", lambda: E.quantize_blockwise(x, E4M3, 1, 128, False)),
        ("quantize_blockwise 128x128", lambda: E.quantize_blockwise(x, E4M3, 128, 128, False)),
        ("quantize_blockwise 1x128 of the transpose (tiles 128x1)",
         lambda: E.quantize_blockwise(x.t(), E4M3, 1, 128, False)),
    ]


def measure(fn, iters):
    """Median seconds with the kernels off and on, calls interleaved."""
    times = {False: [], True: []}
    for on in (False, True) * 2:  # warm-up: scratch buffers, first-call costs
        cpu_kernels._state["loaded"] = on
        fn()
    for _ in range(iters):
        for on in (False, True):
            cpu_kernels._state["loaded"] = on
            t0 = time.perf_counter()
            fn()
            times[on].append(time.perf_counter() - t0)
    return statistics.median(times[False]), statistics.median(times[True])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_kernels.md"))
    args = ap.parse_args()
    if not cpu_kernels.loaded():
        raise SystemExit(f"the CPU kernels are not available: {cpu_kernels.why_not()}")
    gc.disable()  # no collector pauses inside a timed call
    rows = ["| op | shape | tensor code (ms) | C++ kernel (ms) | speed-up |", "|---|---|---:|---:|---:|"]
    try:
        for shape in SHAPES:
            for name, fn in cases(shape):
                off, on = measure(fn, args.iters)
                rows.append(f"| {name} | {list(shape)} | {off * 1e3:.3f} | {on * 1e3:.3f} | "
                            f"{off / on:.2f}x |")
                print(rows[-1], flush=True)
    finally:
        cpu_kernels._state["loaded"] = True
    text = (f"# The emulation's CPU kernels against its tensor code\n\n{datetime.date.today()}, "
            f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; median of {args.iters} interleaved calls each\n\n"
            f"`python bench/bench_cpu_kernels.py{''.join(' ' + a for a in sys.argv[1:])}`\n\n"
            + "\n".join(rows) + "\n")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
