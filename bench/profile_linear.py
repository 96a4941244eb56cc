"""Host time of one FP8Linear training step (forward, backward, SGD step), bf16 nn.Linear beside
it, and a profiler table of the FP8 step: where a step that is faster on the GPU than its launches
spends its host time (allocations, launches, the ops' own C++, the backward's Python).

Per variant: "host" is the time to enqueue 50 steps without a sync (the host's cost of a step
while the GPU keeps up), "wall" the same with the closing sync. Then a torch.profiler table of 5
FP8 steps, sorted by self CPU time. With --timeline, the GPU timeline of one step per variant:
every kernel in start order with its gap to the one before, and how much of the step's span no
kernel covers. Then (--ops) the host cost of each op of the step called
alone on tiny operands (the GPU never limits it), and (--python) the Python functions the FP8
step spends its host time in (cProfile). A diagnosis, not a ratio claim.

    python bench/profile_linear.py [--shapes 1024x4096x4096,4096x4096x1280] [--rows 25]
    python bench/profile_linear.py --ops --python [--shapes none]
    python bench/profile_linear.py --shapes none --timeline 16384x8192x1280   # one step's kernels
    python bench/profile_linear.py --device cpu --smoke   # runs end to end; measures nothing
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ops

RECIPES = {"current": fp8ops.CurrentScaling, "delayed": fp8ops.DelayedScaling}


def _step(layer, x, dy, opt):
    def step():
        opt.zero_grad(set_to_none=True)
        x.grad = None  # no accumulation into x's gradient: one step's work, as in bench_linear
        layer(x).backward(dy)
        opt.step()
    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, calls: int, warmup: int):
    """(host, wall) seconds per call of fn, enqueued `calls` times without a sync after a
    warm-up: host before the closing sync, wall after it."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls
    _sync(device)
    return host, (time.perf_counter() - t) / calls


# "<recipe>:python": the same layer on the Python path (FP8Linear.cpp_step = False), beside
# the C++ step it takes by default
VARIANTS = ["bf16", *RECIPES, *(f"{r}:python" for r in RECIPES)]


def profile_shape(m, k, n, device, rows, steps=50):
    lines = []
    for name in VARIANTS:
        step = _variant_step(name, m, k, n, device)
        host, wall = _timed(step, device, steps, warmup=10)
        lines.append(f"== {name} M={m} K={k} N={n}: host {host * 1e6:.0f} us/step, "
                     f"wall {wall * 1e6:.0f} us/step")
        if name in RECIPES:
            with profile(activities=_activities(device)) as prof:
                for _ in range(5):
                    step()
                _sync(device)
            lines.append(prof.key_averages().table(sort_by="self_cpu_time_total",
                                                   row_limit=rows, max_name_column_width=60))
    return lines


def _variant_step(name, m, k, n, device):
    """One training step of a bf16 layer [n, k] ("bf16": nn.Linear; else an FP8Linear of that
    recipe, "<recipe>:python" on the Python path) on m tokens, on fresh random data."""
    torch.manual_seed(0)
    if name == "bf16":
        layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    else:
        recipe, _, path = name.partition(":")
        layer = fp8ops.FP8Linear(k, n, bias=False, recipe=RECIPES[recipe](), fallback="never",
                                 device=device, dtype=torch.bfloat16)
        layer.cpp_step = path != "python"
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    return _step(layer, x, dy, torch.optim.SGD(layer.parameters(), lr=1e-4))


def _activities(device):
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def timeline(m, k, n, device, width=64):
    """The GPU activity of one warm training step per variant, in start order: each kernel's start
    (from the step's first kernel), its duration and the idle gap before it, then the step's span,
    the time in kernels and the time in none (launch gaps and host waits the GPU sees)."""
    lines = []
    for name in ["bf16", *RECIPES]:
        step = _variant_step(name, m, k, n, device)
        for _ in range(5):
            step()
        _sync(device)
        with profile(activities=_activities(device)) as prof:
            step()
            _sync(device)
        gpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        lines.append(f"== timeline {name} M={m} K={k} N={n}: {len(gpu)} GPU activities")
        if not gpu:
            continue
        t0, prev_end, busy = gpu[0].time_range.start, gpu[0].time_range.start, 0.0
        lines.append(f"   {'start us':>9} {'gap us':>8} {'dur us':>8}  kernel")
        for e in gpu:
            start, end = e.time_range.start, e.time_range.end
            gap = max(0.0, start - prev_end)
            busy += max(0.0, end - max(start, prev_end))  # overlapping kernels counted once
            lines.append(f"   {start - t0:9.1f} {gap:8.1f} {end - start:8.1f}  {e.name[:width]}")
            prev_end = max(prev_end, end)
        span = prev_end - t0
        lines.append(f"   span {span:.1f} us, in kernels {busy:.1f} us, in none {span - busy:.1f} us "
                     f"({(span - busy) / span:.0%})")
    return lines


def op_costs(device, calls=300):
    """Host microseconds per call of each op an FP8 step makes, on operands small enough that
    the GPU never makes the host wait; torch's own calls beside them for scale."""
    ops, e4m3, e5m2, bf16 = torch.ops.fp8ops, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    m = k = n = 256
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, bf16)
    w = torch.randn(n, k, generator=g).to(device, bf16)
    one = torch.ones((), device=device)
    xq, xq_t, _ = ops.quantize(x, one, e4m3, True)
    wq, wq_t, _ = ops.quantize(w, one, e4m3, True)
    gq = ops.quantize(x, one, e5m2, False)[0]
    st = fp8ops.ScalingState(fp8ops.DelayedScaling(), device=device)
    r = st.input
    rec = fp8ops.DelayedScaling()

    def delayed(update, record):
        return lambda: ops.quantize_delayed(
            x, r.amax_history, r.scale, r.scale_inv, r.amax_rep, r.pending_amax, r.step,
            r.nonfinite_count, e4m3, 1.0, rec.interval, rec.amax_compute_algo, rec.ema_alpha,
            rec.percentile, False, update, False, record, True, None, False, 0, 0, None)

    cases = {
        "torch.empty (256x256 bf16)": lambda: torch.empty(m, k, device=device, dtype=bf16),
        "torch.mm bf16": lambda: torch.mm(x, w.t()),
        "torch.abs().max() (an amax in torch)": lambda: x.abs().max(),
        "fp8ops amax": lambda: ops.amax(x),
        "fp8ops quantize (scale given, transpose)": lambda: ops.quantize(x, one, e4m3, True),
        "fp8ops quantize_current (transpose)": lambda: ops.quantize_current(
            x, e4m3, 1.0, False, True, None, False, 0, 0, None),
        "fp8ops quantize_delayed (record)": delayed(False, True),
        "fp8ops quantize_delayed (update, record)": delayed(True, True),
        "fp8ops transpose_fp8": lambda: ops.transpose_fp8(xq),
        "fp8ops gemm fast accumulation (forward)": lambda: ops.gemm(xq, wq, one, one, None, bf16,
                                                                    True),
        "fp8ops gemm promoted (dgrad, wgrad)": lambda: ops.gemm(gq, wq_t, one, one, None, bf16,
                                                                False),
        "torch._scaled_mm": lambda: torch._scaled_mm(xq, wq.t(), one, one, out_dtype=bf16),
    }
    lines = [f"== host us per call, {m}x{k} operands ({calls} calls, no sync between)"]
    for name, fn in cases.items():
        lines.append(f"   {name:<48} {_timed(fn, device, calls, warmup=5)[0] * 1e6:8.1f}")
    return lines


def python_profile(device, recipe: str, rows: int, steps=200):
    """cProfile of `steps` FP8 steps on a tiny layer: the Python around the ops."""
    torch.manual_seed(0)
    layer = fp8ops.FP8Linear(256, 256, bias=False, recipe=RECIPES[recipe](), fallback="never",
                             device=device, dtype=torch.bfloat16)
    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    step = _step(layer, x, dy, torch.optim.SGD(layer.parameters(), lr=1e-4))
    for _ in range(10):
        step()
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    _sync(device)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    out.write(f"== cProfile {recipe}: fp8ops's own functions, by cumulative time\n")
    stats.sort_stats("cumtime").print_stats("fp8ops", rows)
    return [f"== cProfile {recipe}, {steps} steps of 256x256x256, by own time", out.getvalue()]


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1024x4096x4096,4096x4096x1280", help="MxKxN,...")
    ap.add_argument("--rows", type=int, default=25, help="profiler table rows")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU: checks it runs")
    ap.add_argument("--ops", action="store_true", help="host cost of each op called alone")
    ap.add_argument("--python", action="store_true", help="cProfile of the FP8 steps' Python")
    ap.add_argument("--timeline", default=None, metavar="MxKxN",
                    help="GPU timeline of one step per variant at this shape")
    args = ap.parse_args(argv)
    if args.device == "cpu" and not args.smoke:
        ap.error("--device cpu only with --smoke: CPU timings say nothing about the GPU path")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA GPU visible")
    shapes = ["64x128x96"] if args.smoke else [s for s in args.shapes.split(",") if s != "none"]
    device = torch.device(args.device)
    lines = []
    for shape in shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        lines += profile_shape(m, k, n, device, args.rows, steps=3 if args.smoke else 50)
    if args.timeline:
        m, k, n = (int(v) for v in ("64x128x96" if args.smoke else args.timeline).split("x"))
        lines += timeline(m, k, n, device)
    if args.ops:
        lines += op_costs(device, calls=3 if args.smoke else 300)
    if args.python:
        for recipe in RECIPES:
            lines += python_profile(device, recipe, args.rows, steps=3 if args.smoke else 200)
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
