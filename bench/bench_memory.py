"""Device memory of FP8 training with CPUOffloadOptimizer, and the speed of its host step.

    python bench/bench_memory.py            # the CPU parts anywhere; the GPU part on a CUDA GPU

1. Exact device bytes (fp8ops.memory, runs on the CPU too): per FP8Linear weight parameter, for
   each recipe, offloaded vs trained by AdamW on the device, and for a small GPT: float32
   parameters + AdamW (the memory of BF16 mixed precision with an FP32 master), FP8Linear +
   AdamW, FP8Linear + CPUOffloadOptimizer. Counted just before the optimizer step (gradients of a
   whole backward included), in steady state (second step).
2. The host optimizer step in parameters per second: CPUOffloadOptimizer(AdamW).step() (the
   gradients already delivered by backward) against torch.optim.AdamW(fused=True) on host
   tensors of the same sizes, median of timed steps taken in turns.
3. GPU only: peak device memory (torch.cuda.max_memory_allocated) of a GPT of about 1B
   parameters, bf16 autocast baseline vs FP8Linear vs FP8Linear + offload, and the step time of
   offload vs no offload (median of timed steps, each ending in a synchronize).
Writes bench/results/memory.md and prints it.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(1, os.path.dirname(HERE))
import fp8ops  # noqa: E402
from fp8ops.memory import device_state_bytes, fp8_weight_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

RECIPES = {"current": fp8ops.CurrentScaling, "delayed": fp8ops.DelayedScaling,
           "mxfp8": fp8ops.MXFP8Scaling, "blockwise": fp8ops.BlockwiseScaling}


def _blocks_only(module, fqn):
    return fqn.startswith("blocks.")


def _adamw(params, offload):
    kw = dict(lr=1e-4, weight_decay=0.1)
    if offload:
        return fp8ops.CPUOffloadOptimizer(params, torch.optim.AdamW, **kw)
    return torch.optim.AdamW(params, fused=True, **kw)


# -- 1. exact device bytes ---------------------------------------------------------------------
def layer_bytes(name, n, k, device):
    """(offloaded, AdamW on the device) bytes per weight parameter of one FP8Linear."""
    out = []
    for offload in (True, False):
        torch.manual_seed(0)
        layer = fp8ops.FP8Linear(k, n, bias=False, recipe=RECIPES[name](), device=device)
        opt = _adamw(layer.parameters(), offload)
        for _ in range(2):
            layer(torch.randn(256, k, device=device)).float().sum().backward()
            count = fp8_weight_bytes(layer) + device_state_bytes(layer, opt)["optimizer_state"]
            opt.step()
            opt.zero_grad()
        out.append(count / layer.weight.numel())
    return out


def gpt_bytes(d_model, n_layer, device):
    """{setup: device_state_bytes} for a GPT, counted before its second step."""
    cfg = GPTConfig(seq_len=64, d_model=d_model, n_layer=n_layer, n_head=max(1, d_model // 64))
    x = torch.randint(0, 256, (4, 64), device=device)
    out = {}
    for setup in ("fp32 params + AdamW", "FP8Linear + AdamW", "FP8Linear + offload"):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        if setup != "fp32 params + AdamW":
            fp8ops.convert_to_fp8(model, fp8ops.DelayedScaling(), filter_fn=_blocks_only)
        opt = _adamw(model.parameters(), setup.endswith("offload"))
        for _ in range(2):
            model(x, x).backward()
            count = device_state_bytes(model, opt)
            opt.step()
            opt.zero_grad()
        out[setup] = count
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    return n_params, out


# -- 2. host optimizer step --------------------------------------------------------------------
def host_step_rate(n_params, tensor_numel, steps, device):
    """params/s of torch AdamW(fused=True) on host tensors and of CPUOffloadOptimizer's step for
    parameters on `device` (skip_nonfinite off; on, with its own norm or after clip_grad_norm_).
    The steps take turns, so that a change in the machine's load falls on all of them alike."""
    sizes = [tensor_numel] * max(1, n_params // tensor_numel)
    total = sum(sizes)
    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(s, generator=gen) for s in sizes]
    for p in host:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    runs = {"torch.optim.AdamW(fused=True), host tensors": (_adamw(host, False), None)}
    for skip, clip in ((True, False), (True, True), (False, False)):
        params = [nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in sizes]
        opt = fp8ops.CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-4, weight_decay=0.1,
                                         skip_nonfinite=skip)
        scale = [torch.randn(s, generator=gen).to(device) * 1e-3 for s in sizes]

        def backward(opt=opt, params=params, scale=scale, clip=clip):
            # gradients arrive as in training (hooks, copies to the host)
            opt.zero_grad()
            sum((p * c).sum() for p, c in zip(params, scale)).backward()
            if clip:  # not timed: the step reuses its norm for the check
                opt.clip_grad_norm_(1e9)

        label = f"CPUOffloadOptimizer(AdamW).step(), params on {device.type}, " + (
            "skip_nonfinite=False" if not skip else
            "skip_nonfinite=True, after clip_grad_norm_" if clip else "skip_nonfinite=True")
        runs[label] = (opt, backward)
    times = {label: [] for label in runs}
    for i in range(steps + 1):
        for label, (opt, before) in runs.items():
            if before is not None:
                before()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first step allocates the state
                times[label].append(time.perf_counter() - t0)
    return total, {label: total / statistics.median(t) for label, t in times.items()}


# -- 3. GPU: peak memory and step time of a ~1B GPT --------------------------------------------
def gpu_runs(args):
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layer=args.n_layer,
                    n_head=args.d_model // 128)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=gen)
               for _ in range(args.gpu_steps + 2)]
    rows = {}
    for setup in ("bf16 autocast + AdamW", "FP8Linear + AdamW", "FP8Linear + offload"):
        torch.manual_seed(0)
        model = GPT(cfg).cuda()
        if setup != "bf16 autocast + AdamW":
            fp8ops.convert_to_fp8(model, fp8ops.DelayedScaling(), filter_fn=_blocks_only)
        opt = _adamw(model.parameters(), setup.endswith("offload"))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for i, b in enumerate(batches):
            b = b.cuda()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(b[:, :-1], b[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        rows[setup] = dict(peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                           step_s=statistics.median(times), loss=loss.item())
        del model, opt, loss
        torch.cuda.empty_cache()
    return cfg, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", type=int, default=1024, help="N = K of the counted FP8Linear")
    ap.add_argument("--gpt-d-model", type=int, default=256)
    ap.add_argument("--gpt-layers", type=int, default=2)
    ap.add_argument("--host-params", type=int, default=32 << 20)
    ap.add_argument("--host-tensor", type=int, default=4 << 20)
    ap.add_argument("--host-steps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=2048, help="GPU GPT (20 x 2048: 1.0B)")
    ap.add_argument("--n-layer", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gpu-steps", type=int, default=5)
    ap.add_argument("--no-gpu", action="store_true", help="skip the GPU part")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.no_gpu
    device = torch.device("cuda" if gpu else "cpu")
    where = (torch.cuda.get_device_name() if gpu else f"CPU ({platform.processor() or 'x86_64'}"
             f", {torch.get_num_threads()} threads)")
    lines = ["# Device memory and host step of CPUOffloadOptimizer", "",
             f"device: {where}; torch {torch.__version__}; fp8ops backend "
             f"{fp8ops.backend(device)}", ""]

    lines += [f"## Exact device bytes per FP8Linear weight parameter ({args.layer}x{args.layer},"
              f" before the second step)", "",
              "| recipe | offloaded | AdamW on the device (weight, grad, FP8 cast, state) |",
              "|---|---:|---:|"]
    for name in RECIPES:
        off, dev = layer_bytes(name, args.layer, args.layer, device)
        lines.append(f"| {name} | {off:.4f} | {dev:.4f} |")
        print(lines[-1], flush=True)

    n_params, counts = gpt_bytes(args.gpt_d_model, args.gpt_layers, device)
    lines += ["", f"## Exact device bytes of a GPT (d_model {args.gpt_d_model}, {args.gpt_layers}"
              f" layers, {n_params} parameters; FP8: the blocks' Linears, DelayedScaling)", "",
              "| setup | parameters | gradients | FP8 weights | buffers | optimizer state | "
              "total | bytes / parameter |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for setup, c in counts.items():
        lines.append(f"| {setup} | {c['parameters']} | {c['gradients']} | {c['fp8_weights']} | "
                     f"{c['buffers']} | {c['optimizer_state']} | {c['total']} | "
                     f"{c['total'] / n_params:.2f} |")
        print(lines[-1], flush=True)

    total, rates = host_step_rate(args.host_params, args.host_tensor, args.host_steps, device)
    base = rates["torch.optim.AdamW(fused=True), host tensors"]
    lines += ["", f"## Host optimizer step ({total} parameters in tensors of "
              f"{args.host_tensor}, median of {args.host_steps} steps)", "",
              "| step | Mparams/s | vs torch fused AdamW |", "|---|---:|---:|"]
    for label, rate in rates.items():
        lines.append(f"| {label} | {rate / 1e6:.1f} | {rate / base:.3f}x |")
        print(lines[-1], flush=True)

    if gpu:
        cfg, rows = gpu_runs(args)
        n = sum(p.numel() for p in GPT(cfg).parameters())
        fp8 = rows["FP8Linear + AdamW"]["step_s"]
        lines += ["", f"## GPU: GPT d_model {cfg.d_model}, {cfg.n_layer} layers ({n / 1e9:.2f}B "
                  f"parameters), batch {args.batch} x {cfg.seq_len}, median of "
                  f"{args.gpu_steps} steps", "",
                  "| setup | peak GiB | step s | vs FP8Linear + AdamW |", "|---|---:|---:|---:|"]
        for setup, r in rows.items():
            lines.append(f"| {setup} | {r['peak_gib']:.2f} | {r['step_s']:.3f} | "
                         f"{r['step_s'] / fp8:.3f}x |")
    else:
        lines += ["", "## GPU", "", "No CUDA GPU here: peak device memory of the ~1B GPT and the "
                  "step-time overhead of offload were not measured."]
    table = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
