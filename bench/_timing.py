"""Shared timing helpers for the fp8ops benchmarks (docs/design.md, "Measuring"): L2 flush,
median of CUDA-event timings, interleaved rounds, and the facts about the device and software
that every result records."""
from __future__ import annotations

import os
import platform
import random
import statistics
import time

import torch

_FLUSH = {}


def require_gpu() -> None:
    """Exit with a clear message when there is no CUDA GPU."""
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: these benchmarks need one (torch.cuda.is_available() is False)")


def add_smoke_options(ap, smoke_help: str) -> None:
    """--device (cuda, or cpu for a smoke run), --smoke and --out, as every training benchmark
    takes them."""
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    ap.add_argument("--out", default=None,
                    help="results folder (default bench/results; a smoke run writes only here)")


def results_dir(args, default: str):
    """Check --device against --smoke (CPU timings of the emulation say nothing about the GPU
    path: the CPU runs only smoke runs) and return where results go: `default`, --out, or
    nowhere (None) for a smoke run without --out."""
    if args.device == "cuda":
        require_gpu()
    elif not args.smoke:
        raise SystemExit("--device cpu only with --smoke: CPU timings of the emulation say "
                         "nothing about the GPU path")
    return args.out or (None if args.smoke else default)


def flush_l2(nbytes: int = 256 << 20) -> None:
    """Evict the L2 cache by writing a 256 MB buffer (larger than any current L2)."""
    dev = torch.cuda.current_device()
    buf = _FLUSH.get(dev)
    if buf is None or buf.numel() != nbytes:
        buf = _FLUSH[dev] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    buf.fill_(1)


def time_cuda(fn, iters: int = 50, warmup: int = 5, flush: bool = True) -> float:
    """Median milliseconds of fn() over `iters` runs, each timed with CUDA events around fn alone,
    the L2 flushed before each run."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_step(fn, "cuda", flush) for _ in range(iters))


def time_step(fn, device: str = "cuda", flush: bool = True) -> float:
    """Milliseconds of one fn() call: on a GPU, CUDA events around fn alone with the L2 flushed
    before; elsewhere wall clock (a smoke run, not a measurement)."""
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if flush:
        flush_l2()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def write_table(out_dir, filename: str, table: str) -> None:
    """Print a result table and, with an out_dir, write it there."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, filename), "w") as f:
            f.write(table)
    print(table)


def error_text(exc: BaseException, limit: int = 160) -> str:
    """One line for a table cell: the exception's type and the first line of its message."""
    msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    msg = msg.replace("|", "/")  # a pipe would split the markdown cell
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def captured_step(forward_backward, zero_grad, after, warmup: int = 3):
    """A training step on a GPU whose forward_backward() is captured once in a CUDA graph and
    replayed; after() (the optimizer step, in place on the parameters) runs eagerly after each
    replay, so the next replay reads the new values. zero_grad() clears the gradients."""
    # warm up on a side stream, as torch.cuda.graphs requires (lazy state, kernels' setup)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            zero_grad()
            forward_backward()
    torch.cuda.current_stream().wait_stream(side)
    # no gradients at capture: the captured backward writes them (not adds) into the graph's
    # memory, and every replay then overwrites them, as a zero_grad would
    zero_grad()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward_backward()

    def step():
        graph.replay()
        after()
    # the graph reads and writes the tensors those closures hold (the input, the target): they
    # must live as long as the step, or the replays read memory the allocator has handed out again
    step.captured = (forward_backward, zero_grad)
    return step


def interleaved(steps: dict, device: str = "cuda", rounds: int = 10, iters: int = 5,
                warmup: int = 3) -> dict:
    """Time the step functions side by side: after `warmup` untimed calls each, `rounds` rounds
    in which every step runs `iters` timed calls in turn, so that a drifting clock or a warming
    device affects every variant alike. The first round runs them in the given order, the
    others in a shuffled one (fixed seed), so no variant always follows the same one: what one
    leaves behind, in the caches or on the host, is paid by different variants in turn.
    Returns {name: median ms over all timed calls}, or {name: error text} for a step that
    raised (the others go on)."""
    out, live = {}, {}
    for name, fn in steps.items():
        try:
            for _ in range(warmup):
                fn()
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()  # an asynchronous error belongs to this step
            live[name] = fn
        except Exception as exc:  # noqa: BLE001 - recorded in the table instead
            out[name] = error_text(exc)
    times = {name: [] for name in live}
    order, shuffle = list(live), random.Random(0).shuffle
    for r in range(rounds):
        if r:
            shuffle(order)
        for name in order:
            if name not in live:  # raised in an earlier round
                continue
            try:
                times[name] += [time_step(live[name], device) for _ in range(iters)]
            except Exception as exc:  # noqa: BLE001
                out[name] = error_text(exc)
                del live[name]
    for name in live:
        out[name] = statistics.median(times[name])
    return {name: out[name] for name in steps}


def device_info(device: str = "cuda") -> dict:
    """Device name, capability, memory and the software versions a result must record."""
    if torch.device(device).type != "cuda":
        return {"device": cpu_name(), "torch": torch.__version__,
                "python": platform.python_version()}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2 ** 30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def cpu_name() -> str:
    """The CPU's model name, for the header of a CPU result."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
