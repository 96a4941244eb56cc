"""Shared timing helpers for the fp8ops benchmarks (DESIGN.md section 9): L2 flush, median of
CUDA-event timings, and the facts about the device and software that every result records."""
from __future__ import annotations

import platform
import statistics

import torch

_FLUSH = {}


def require_gpu() -> None:
    """Exit with a clear message when there is no CUDA GPU."""
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: these benchmarks need one (torch.cuda.is_available() is False)")


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
    times = []
    for _ in range(iters):
        if flush:
            flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_info() -> dict:
    """Device name, capability, memory and the software versions a result must record."""
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
