"""The FP8 reduction's casts on a GPU against a copy of the same gradient: what each rank does
around the all-to-all of fp8ops.distributed.fp8_reduce_scatter, without the network.

    python bench/bench_wire_casts.py [--sizes-mb 64,256] [--world 8] [--iters 20]
    python bench/bench_wire_casts.py --device cpu --sizes-mb 1     # a smoke run

For a float32 gradient of each size (what FSDP2's reduce-scatter takes), split in --world chunks:
  - copy: a device-to-device copy of the gradient (the bandwidth reference);
  - encode: its cast to FP8 blocks of 128 with their scales, packed for the all-to-all
    (fp8ops.distributed.wire.blocks.encode: quantize_blockwise, then the pack);
  - decode_sum: the receiving rank's sum of --world chunks of FP8 blocks (dequantize_sum) into
    its float32 shard.
Median CUDA-event times with the L2 flushed before each call (bench/_timing.py), and each
time's ratio to the copy's, measured side by side in one run. Writes bench/results/wire_casts.md.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import fp8ops  # noqa: E402,F401
from _timing import device_info, require_gpu, time_cuda, time_step, write_table  # noqa: E402
from fp8ops.distributed.wire import blocks  # noqa: E402

E4M3 = torch.float8_e4m3fn


def measure(size_mb: float, world: int, device: str, iters: int) -> dict:
    n = int(size_mb * 2**20) // 4 // world * world
    grad = torch.randn(n, device=device)  # never zeros: the casts' cost depends on the values
    packed = blocks.encode(grad.view(world, -1), E4M3, 128)

    ops = {"copy": lambda: grad.clone(),
           "encode": lambda: blocks.encode(grad.view(world, -1), E4M3, 128),
           "decode_sum": lambda: blocks.decode_sum(packed, n // world, E4M3, 128, float(world),
                                                   torch.float32)}
    if device == "cuda":
        ms = {k: time_cuda(f, iters=iters) for k, f in ops.items()}
    else:
        ms = {k: time_step(f, device) for k, f in ops.items()}
    return dict(size_mb=size_mb, values=n, ms=ms)


def table(rows, world, info) -> str:
    lines = [f"FP8 reduction casts, world {world} chunks, blocks of 128, E4M3, {info}; median "
             f"ms with the L2 flushed, ratios to a copy of the float32 gradient in the same run.", "",
             "| gradient MiB | copy ms | encode ms | encode / copy | decode_sum ms | "
             "decode_sum / copy |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['size_mb']:g} | {ms['copy']:.4f} | {ms['encode']:.4f} | "
                     f"{ms['encode'] / ms['copy']:.2f} | {ms['decode_sum']:.4f} | "
                     f"{ms['decode_sum'] / ms['copy']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="64,256",
                    help="float32 gradient sizes in MiB (2^20 bytes)")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=None, help="results folder (default bench/results; a CPU "
                    "smoke run writes only here)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        require_gpu()
    rows = [measure(float(s), args.world, args.device, args.iters)
            for s in args.sizes_mb.split(",") if s]
    info = device_info(args.device)
    text = table(rows, args.world, f"{info['device']}, torch {torch.__version__}")
    out = args.out or (os.path.join(HERE, "results") if args.device == "cuda" else None)
    write_table(out, "wire_casts.md", text)
    return rows


if __name__ == "__main__":
    main()
