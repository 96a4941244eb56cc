"""Host time of one FP8Linear training step (forward, backward, SGD step), bf16 nn.Linear beside
it, and a profiler table of the FP8 step: where a step that is faster on the GPU than its launches
spends its host time (allocations, launches, the ops' own C++, the backward's Python).

Per variant: "host" is the time to enqueue 50 steps without a sync (the host's cost of a step
while the GPU keeps up), "wall" the same with the closing sync. Then a torch.profiler table of 5
FP8 steps, sorted by self CPU time. A diagnosis, not a ratio claim.

    python bench/profile_linear.py [--shapes 1024x4096x4096,4096x4096x1280] [--rows 25]
    python bench/profile_linear.py --device cpu --smoke   # runs end to end; measures nothing
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ops

RECIPES = {"current": fp8ops.CurrentScaling, "delayed": fp8ops.DelayedScaling}


def _step(layer, x, dy, opt):
    def step():
        opt.zero_grad(set_to_none=True)
        layer(x).backward(dy)
        opt.step()
    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_shape(m, k, n, device, rows, steps=50):
    lines = []
    for name in ["bf16", *RECIPES]:
        torch.manual_seed(0)
        if name == "bf16":
            layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        else:
            layer = fp8ops.FP8Linear(k, n, bias=False, recipe=RECIPES[name](), fallback="never",
                                     device=device, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        step = _step(layer, x, dy, torch.optim.SGD(layer.parameters(), lr=1e-4))
        for _ in range(10):
            step()
        _sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            step()
        host = (time.perf_counter() - t) / steps
        _sync(device)
        wall = (time.perf_counter() - t) / steps
        lines.append(f"== {name} M={m} K={k} N={n}: host {host * 1e6:.0f} us/step, "
                     f"wall {wall * 1e6:.0f} us/step")
        if name != "bf16":
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                             else [])
            with profile(activities=acts) as prof:
                for _ in range(5):
                    step()
                _sync(device)
            lines.append(prof.key_averages().table(sort_by="self_cpu_time_total",
                                                   row_limit=rows, max_name_column_width=60))
    return lines


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1024x4096x4096,4096x4096x1280", help="MxKxN,...")
    ap.add_argument("--rows", type=int, default=25, help="profiler table rows")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU: checks it runs")
    args = ap.parse_args(argv)
    if args.device == "cpu" and not args.smoke:
        ap.error("--device cpu only with --smoke: CPU timings say nothing about the GPU path")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA GPU visible")
    shapes = ["64x128x96"] if args.smoke else args.shapes.split(",")
    lines = []
    for shape in shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        lines += profile_shape(m, k, n, torch.device(args.device), args.rows,
                               steps=3 if args.smoke else 50)
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
