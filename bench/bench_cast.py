"""Cast-kernel bandwidth: fp8ops CUDA kernels vs a device-to-device copy of the same bytes and vs
torch.compile of the emulation, side by side in one run, on bf16 inputs from 1 MB to 1 GB.

GB/s counts bytes read + written (a fused op's every output counted as written). Each figure is
the median of many CUDA-event-timed runs with the L2 flushed before each, on fresh random inputs.
The fused casts a training step calls (ops.quantize_current, quantize_delayed,
quantize_blockwise_pair, quantize_mx_pair, with dY's column sums) are also timed as the unfused
ops they stand for (fp8ops/ops/fused.py), each with its own kernel: what the fusion saves; the
mixture-of-experts casts (8 experts' weights in one launch, 8 groups of sorted tokens) likewise
against what they stand for (a loop of the dense op per expert; the emulation's composition of
torch ops). The byte transpose (transpose_fp8) reads the E4M3 cast of the input. Prints a
markdown table and writes it to bench/results/cast.md, with a plot in bench/results/cast.png.

    python bench/bench_cast.py [--max-mb 1024] [--iters 30] [--no-compile] [--sizes-mb 64,256]
    python bench/bench_cast.py --device cpu --smoke --out /tmp/cast   # runs end to end; not a measurement
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (add_smoke_options, device_info, results_dir, time_cuda,  # noqa: E402
                     time_step, write_table)

HERE = os.path.dirname(os.path.abspath(__file__))
E4M3 = torch.float8_e4m3fn


def _cases(x, scale):
    """name -> (fp8ops fn, emulation fn or None, bytes moved, unfused fn or None); x is bf16
    [rows, cols]."""
    import fp8ops  # noqa: F401
    from fp8ops.ops import emulation as emu
    from fp8ops.ops import fused

    ops = torch.ops.fp8ops
    n = x.numel()
    rows, cols = x.shape
    rb_c = (cols + 127) // 128
    rb_r = (rows + 127) // 128
    q = ops.quantize(x, scale, E4M3)[0]
    return {
        "amax": (lambda: ops.amax(x), lambda: emu.amax(x), 2 * n + 4, None),
        "quantize": (lambda: ops.quantize(x, scale, E4M3), lambda: emu.quantize(x, scale, E4M3),
                     3 * n + 8, None),
        "quantize stochastic": (lambda: ops.quantize(x, scale, E4M3, False, True, 1, 2),
                                lambda: emu.quantize(x, scale, E4M3, False, True, 1, 2), 3 * n + 8,
                                None),
        "quantize+transpose+amax": (lambda: ops.quantize(x, scale, E4M3, True),
                                    lambda: emu.quantize(x, scale, E4M3, True), 4 * n + 8, None),
        "quantize_mx (1x32)": (lambda: ops.quantize_mx(x, E4M3, 32, -1, False),
                               lambda: emu.quantize_mx(x, E4M3, 32, -1, False), 3 * n + n // 32,
                               None),
        "quantize_blockwise 1x128": (lambda: ops.quantize_blockwise(x, E4M3, 1, 128, False),
                                     lambda: emu.quantize_blockwise(x, E4M3, 1, 128, False),
                                     3 * n + 4 * rows * rb_c, None),
        "quantize_blockwise 128x128": (lambda: ops.quantize_blockwise(x, E4M3, 128, 128, False),
                                       lambda: emu.quantize_blockwise(x, E4M3, 128, 128, False),
                                       3 * n + 4 * rb_r * rb_c, None),
        # the dgrad copy of a weight that arrives cast (FSDP2's FP8 gather): bytes in, bytes out
        "transpose_fp8": (lambda: ops.transpose_fp8(q), lambda: emu.transpose_fp8(q), 2 * n, None),
        **_fused_cases(x, ops, fused),
        **_moe_cases(x, ops),
    }


def _fused_cases(x, ops, fused):
    """The training step's one-call casts: (op, None: their emulation is the unfused definition
    (fp8ops/ops/fused.py), timed in its own column, bytes, that definition). Outputs: the data,
    its transposed copy, the scales; with `+ dbias` also the column sums (bf16)."""
    n = x.numel()
    rows, cols = x.shape
    bf16 = torch.bfloat16
    role = _role_buffers(x.device)

    def delayed(impl):  # a training step's input cast: step the role, cast, record
        return lambda: impl(x, *role, E4M3, 1.0, 1, "max", 0.5, 50.0, False, True, False, True,
                            True)

    pair_scales = 4 * rows * ((cols + 127) // 128) + 4 * cols * ((rows + 127) // 128)
    rows_p, cols_p = -(-rows // 32) * 32, -(-cols // 32) * 32
    out = {
        "fused current (+T)": (lambda: ops.quantize_current(x, E4M3, 1.0, False, True),
                               lambda: fused.quantize_current(x, E4M3, 1.0, False, True),
                               4 * n + 8),
        "fused current (+T, + dbias)": (
            lambda: ops.quantize_current(x, E4M3, 1.0, False, True, bf16),
            lambda: fused.quantize_current(x, E4M3, 1.0, False, True, bf16), 4 * n + 8 + 2 * cols),
        "fused delayed (+T)": (delayed(ops.quantize_delayed), delayed(fused.quantize_delayed),
                               4 * n + 8),
        "fused blockwise pair": (lambda: ops.quantize_blockwise_pair(x, E4M3, False),
                                 lambda: fused.quantize_blockwise_pair(x, E4M3, False),
                                 4 * n + pair_scales),
        "fused mx pair (1x32)": (lambda: ops.quantize_mx_pair(x, E4M3, 32, False),
                                 lambda: fused.quantize_mx_pair(x, E4M3, 32, False),
                                 2 * n + rows * cols_p + rows_p * cols_p
                                 + rows * cols_p // 32 + rows_p * cols_p // 32),
    }
    return {name: (fn, None, nbytes, unfused) for name, (fn, unfused, nbytes) in out.items()}


MOE_GROUPS = 8


def _moe_cases(x, ops):
    """The casts of a mixture-of-experts layer with the transposed copies: the experts' weights
    (x as [8, rows / 8, cols]: one launch for all experts) against their meaning, a loop of the
    dense op per expert; and the tokens sorted by expert (x's rows in 8 equal groups, the
    offsets on the device) against the composition of torch ops the emulation runs. Bytes: x
    read once, both copies written, the scales."""
    from fp8ops.ops import emulation_grouped, expert_casts

    rows, cols = x.shape
    e = MOE_GROUPS
    w = x[: rows - rows % e].view(e, -1, cols)
    n = w.numel()
    per = rows // e
    offsets = torch.arange(1, e + 1, device=x.device, dtype=torch.int32) * per
    scales = torch.full((e,), 2.0, device=x.device)
    out = {
        "experts current (+T), 8": (
            lambda: ops.quantize_experts_current(w, E4M3, 1.0, False, True),
            lambda: expert_casts._loop_current(w, E4M3, 1.0, False, True), 4 * n + 8 * e),
        "experts scaled (+T), 8": (
            lambda: ops.quantize_experts_scaled(w, scales, E4M3, True),
            lambda: expert_casts._loop_scaled(w, scales, E4M3, True), 4 * n + 8 * e),
        "grouped current (+T), 8": (
            lambda: ops.quantize_current_grouped(x, offsets, E4M3, 1.0, False, True),
            lambda: emulation_grouped.quantize_current_grouped(x, offsets, E4M3, 1.0, False, True),
            4 * x.numel() + 8 * e),
        "grouped scaled (+T), 8": (
            lambda: ops.quantize_scaled_grouped(x, offsets, scales, E4M3, True),
            lambda: emulation_grouped.quantize_scaled_grouped(x, offsets, scales, E4M3, True),
            4 * x.numel() + 8 * e),
    }
    return {name: (fn, None, nbytes, meaning) for name, (fn, meaning, nbytes) in out.items()}


def _role_buffers(device):
    """A delayed-scaling role's buffers (scaling.RoleState): a 16-slot history, scale 1."""
    f32 = {"device": device, "dtype": torch.float32}
    i64 = {"device": device, "dtype": torch.int64}
    return (torch.zeros(16, **f32), torch.ones((), **f32), torch.ones((), **f32),
            torch.zeros((), **f32), torch.zeros((), **f32), torch.zeros((), **i64),
            torch.zeros((), **i64))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=int, default=1024, help="largest input in MB of bf16")
    ap.add_argument("--sizes-mb", default="1,4,16,64,256,1024",
                    help="input sizes in MB of bf16 (those up to --max-mb)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the emulation")
    ap.add_argument("--compile-mb", default="1,16,256",
                    help="input sizes (MB) at which torch.compile of the emulation is timed too "
                         "(each size compiles anew)")
    add_smoke_options(ap, "one small input, 2 iterations, no torch.compile: the script runs end "
                          "to end (on the CPU: the emulation); not a measurement")
    args = ap.parse_args(argv)
    out_dir = results_dir(args, os.path.join(HERE, "results"))
    from fp8ops.ops import backend

    import fp8ops  # noqa: F401
    if args.device == "cuda" and not backend.extension_loaded():
        raise SystemExit("fp8ops._C is not loaded (" + backend._state["why_not"] + "): build it first")

    info = device_info(args.device)
    cols = 4096
    if args.smoke:
        sizes_mb, args.iters, args.no_compile = [1], 2, True
    else:
        sizes_mb = [int(v) for v in args.sizes_mb.split(",") if v and int(v) <= args.max_mb]
    compile_mb = {int(v) for v in args.compile_mb.split(",") if v}
    rows_out, plot = [], {}
    for mb in sizes_mb:
        n = mb * (1 << 20) // 2
        # never zeros; 3 rows fewer than a multiple of 128: the block copies' ragged edge counts
        x = torch.randn(n // cols - 3, cols, device=args.device, dtype=torch.bfloat16) * 3 + 0.5
        scale = torch.tensor(448.0 / float(x.float().abs().max()), device=args.device)
        dst = torch.empty_like(x)
        t_copy = _time(lambda: dst.copy_(x), args)
        copy_gbs = 2 * x.numel() * 2 / t_copy / 1e6
        rows_out.append((mb, "d2d copy", t_copy, copy_gbs, 1.0, float("nan"), float("nan")))
        plot.setdefault("d2d copy", []).append((mb, copy_gbs))
        for name, (fn, emu_fn, nbytes, unfused_fn) in _cases(x, scale).items():
            t = _time(fn, args)
            gbs = nbytes / t / 1e6
            t_emu = t_unfused = float("nan")
            if unfused_fn is not None:
                t_unfused = _time(unfused_fn, args)
            elif not args.no_compile and mb in compile_mb:
                try:
                    cfn = torch.compile(emu_fn, dynamic=False)
                    t_emu = time_cuda(cfn, max(5, args.iters // 3))
                except Exception as e:  # compile may not handle every emulation op
                    print(f"torch.compile failed for {name}: {type(e).__name__}: {e}", file=sys.stderr)
            rows_out.append((mb, name, t, gbs, gbs / copy_gbs, nbytes / t_emu / 1e6,
                             nbytes / t_unfused / 1e6))
            other = (f"what it stands for {nbytes / t_unfused / 1e6:7.0f} GB/s" if unfused_fn else
                     f"compiled emulation {nbytes / t_emu / 1e6:7.0f} GB/s")
            print(f"{mb:5d} MB  {name:28s} {gbs:7.0f} GB/s  {gbs / copy_gbs:5.2f} x copy  {other}",
                  flush=True)
            plot.setdefault(name, []).append((mb, gbs))
        del x, dst
        if args.device == "cuda":
            torch.cuda.empty_cache()

    head = ("device: {device} (cc {capability}, {sms} SMs), torch {torch}, CUDA {cuda}".format(**info)
            if args.device == "cuda" else
            "device: {device} (CPU smoke run: the emulation; not a measurement), torch {torch}"
            .format(**info))
    lines = [
        "# Cast kernels: GB/s (bytes read + written), bf16 input [n / 4096 - 3, 4096] -> E4M3",
        "",
        head,
        f"median of {args.iters} CUDA-event timings, L2 flushed (256 MB write) before each run"
        if args.device == "cuda" else f"median of {args.iters} wall-clock timings",
        "",
        "| input MB | op | ms | GB/s | vs copy | torch.compile(emulation) GB/s | what it stands for GB/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mb, name, t, gbs, ratio, emu, unfused in rows_out:
        emu_s = "" if emu != emu else f"{emu:.0f}"
        unfused_s = "" if unfused != unfused else f"{unfused:.0f}"
        lines.append(f"| {mb} | {name} | {t:.4f} | {gbs:.0f} | {ratio:.2f} | {emu_s} | {unfused_s} |")
    write_table(out_dir, "cast.md", "\n".join(lines) + "\n")
    if out_dir is None:
        return
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
        fig.savefig(os.path.join(out_dir, "cast.png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot written", file=sys.stderr)


def _time(fn, args) -> float:
    if args.device == "cuda":
        return time_cuda(fn, args.iters)
    fn()  # warm-up
    return statistics.median(time_step(fn, args.device) for _ in range(args.iters))


if __name__ == "__main__":
    main()
