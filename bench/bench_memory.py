"""Device memory of FP8 training with CPUOffloadOptimizer, and the speed of its host step.

    python bench/bench_memory.py            # the CPU parts anywhere; the GPU part on a CUDA GPU
    python bench/bench_memory.py --peak     # only part 4 (--smoke: tiny sizes, writes nothing
                                            # unless --out is given)

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
4. --peak: the peak bytes of one training step (forward, backward, optimizer step) of the example
   Llama (default d_model 256, 4 layers, batch 4 x 256 tokens; --peak-d-model, --peak-n-layer,
   --peak-seq, --peak-batch), per configuration, each adding one feature to the one before:
   float32 parameters under bf16 autocast with torch AdamW (the baseline); FP8 Linears in the
   blocks; FP8AdamW; bf16 parameters; fp8_activations(); fp8_activations(attention=True)
   (attention's q, k, v in FP8 too); CPUOffloadOptimizer(FP8AdamW). The
   SECOND step is measured (the first makes the optimizer state), with torch's MemTracker
   (torch.distributed._tools.mem_tracker) on any device, plus torch.cuda.max_memory_allocated
   on CUDA (flagged when the two differ by more than 5%), and on CUDA the largest batch that
   fits (doubled until torch.cuda.OutOfMemoryError, then bisected; --max-batch caps it). On a
   CPU-only machine the device is the host: the offload row then counts the host's masters and
   state too, and its device state (fp8ops.memory) is given instead; the CPU allocator's own
   count (torch.profiler) checks the tracker's. The default size is for the CPU; on a GPU pass
   a larger one, e.g. --peak-d-model 2048 --peak-n-layer 16 --peak-seq 2048 --peak-batch 4.
   Writes bench/results/memory_peak.md and prints it.
Writes bench/results/memory.md (parts 1-3) and prints it.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import sys
import time
import warnings

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(1, os.path.dirname(HERE))
import fp8ops  # noqa: E402
from fp8ops.memory import device_state_bytes, fp8_weight_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402

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


# -- 4. peak memory of one training step of a Llama, per configuration ------------------------
# each configuration adds one feature to the one before it (the first is the baseline)
PEAK_CONFIGS = {
    "baseline": "fp32 params, bf16 autocast, torch AdamW (fused)",
    "fp8_linear": "+ FP8 Linears (blocks; CurrentScaling)",
    "fp8_adamw": "+ FP8AdamW (fp32 params)",
    "bf16_params": "+ bf16 params (FP8AdamW, stochastic rounding)",
    "fp8_activations": "+ fp8_activations()",
    "fp8_attention": "+ fp8_activations(attention=True)",
    "offload": "+ CPUOffloadOptimizer(FP8AdamW)",
}
PEAK_SIZES = {"default": dict(d_model=256, n_layer=4, seq=256, batch=4),
              "smoke": dict(d_model=128, n_layer=2, seq=64, batch=2)}
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


def llama_config(d_model, n_layer, seq):
    """The example Llama, vocabulary 256 (its embedding and LM head are a few % of it)."""
    return LlamaConfig(vocab_size=256, seq_len=seq, d_model=d_model, n_layer=n_layer,
                       n_head=max(1, d_model // 64))


def build_peak_step(config, cfg, batch, device, seed=0):
    """(model, optimizer, step, batch tensors) of `config`; step(before_step=None) runs one
    training step: forward under bf16 autocast (and fp8_activations where the configuration has
    it), backward, before_step(), optimizer step, zero_grad(set_to_none=True)."""
    level = list(PEAK_CONFIGS).index(config)
    torch.manual_seed(seed)
    model = Llama(cfg).to(device)
    if level >= 3:
        model.to(torch.bfloat16)
    if level >= 1:
        # fallback="never": a GPU's speed crossover would run small layers in bf16
        fp8ops.convert_to_fp8(model, fp8ops.CurrentScaling(), filter_fn=_blocks_only,
                              fallback="never")
    hyper = dict(lr=1e-4, weight_decay=0.1)
    if config == "offload":
        opt = fp8ops.CPUOffloadOptimizer(model.parameters(), fp8ops.FP8AdamW, **hyper)
    elif level >= 2:
        opt = fp8ops.FP8AdamW(model.parameters(), **hyper)
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen).to(device)
    x, y = data[:, :-1], data[:, 1:]
    act, attention = level >= 4, level >= 5

    def step(before_step=None, marks=None):
        with torch.autocast(device.type, dtype=torch.bfloat16), \
                (fp8ops.fp8_activations(attention=attention) if act else
                 contextlib.nullcontext()):
            loss = model(x, y)
        if marks is not None:
            marks("forward")
        loss.backward()
        if marks is not None:
            marks("backward")
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if marks is not None:
            marks("optimizer step")
        return loss.detach()

    return model, opt, step, data


def _alive_before(model, opt, data):
    """What exists before the measured step and is no module parameter or buffer, nor optimizer
    state: the batch, the FP8Linear layers' cached casts (replaced by the step's forward), a
    CPUOffloadOptimizer's host masters, and the CPU emulation's scratch buffers."""
    from fp8ops.ops import scratch
    out = [data]
    out += [t for m in model.modules() if isinstance(m, fp8ops.FP8Linear)
            for t in m.fp8_state.weight_cache.payload_tensors()]
    if isinstance(opt, fp8ops.CPUOffloadOptimizer):
        out += [opt.master_of(p) for p in model.parameters()]
    out += scratch.kept_buffers()
    return out


def scratch_bytes() -> int:
    """Bytes of the CPU emulation's kept scratch buffers (fp8ops.ops.scratch), this thread's."""
    from fp8ops.ops import scratch
    return sum(t.untyped_storage().nbytes() for t in scratch.kept_buffers())


def reset_scratch() -> None:
    """Drop the emulation's kept scratch buffers, so that a configuration counts only its own
    (they live as long as the thread: the buffers of the configurations before would stay)."""
    from fp8ops.ops import scratch
    scratch.release()


def storage_bytes(tensors, device) -> int:
    """Bytes of the distinct storages of the `tensors` on `device` (others and None skipped),
    each rounded up to 512 bytes on CUDA, as MemTracker and the caching allocator count."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device == device:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    if device.type == "cuda":
        return sum(-(-n // 512) * 512 for n in seen.values())
    return sum(seen.values())


def allocator_peak_growth(prof, marker: str) -> int:
    """The CPU allocator's own count: from torch.profiler's memory events (profile_memory=True),
    the most bytes allocated at once during the `marker` record_function, over what was
    allocated when it began. Blocks allocated before the profile started are not seen freed,
    so the profile must begin before the measured step (here: with the step before it)."""
    events = list(prof.profiler.kineto_results.events())
    (mark,) = [e for e in events if e.name() == marker]
    start, end = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    total = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if start <= e.start_ns() <= end and str(e.device_type()) == "DeviceType.CPU":
            total += e.nbytes()
            peak = max(peak, total)
    return peak


def _indexed(device) -> torch.device:
    """cuda -> cuda:<current>: MemTracker keys its counts by the tensors' own device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def measure_peak(config, cfg, batch, device):
    """Peak bytes of the SECOND training step of `config` (the first one creates the optimizer
    state and the kept buffers): torch's MemTracker counts every storage alive at its start
    (parameters, buffers, optimizer state, the batch, cached FP8 casts, offload masters, the
    emulation's scratch buffers) and every one created during the step, each storage once at its
    byte size (FP8 and bf16 alike), and records the largest total with its categories. On CUDA
    torch.cuda.max_memory_allocated (reset at the start of the step) is measured too; on the CPU
    the allocator's own count of the step's peak growth (allocator_peak_growth), which sees the
    temporaries inside C++ ops as well, to compare with the tracker's peak less at_entry.

    Returns a dict: peak (MemTracker, bytes on `device`), categories (at that peak), phase
    (forward / backward / optimizer step where it was reached), cuda_peak (or None), at_entry
    (bytes counted at the start), device_state (fp8ops.memory.device_state_bytes just before the
    optimizer step), scratch (the emulation's scratch bytes), peak_less_scratch, allocator_growth
    (CPU, or None), n_params."""
    from torch.distributed._tools.mem_tracker import MemTracker
    device = _indexed(device)
    reset_scratch()
    model, opt, step, data = build_peak_step(config, cfg, batch, device)
    n_params = sum(p.numel() for p in model.parameters())
    cpu = device.type == "cpu"
    # on the CPU the allocator's own count, from a profile of both steps, checks the tracker's
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  profile_memory=True) if cpu else contextlib.nullcontext()
    with prof:
        out = _tracked_second_step(MemTracker, model, opt, step, data, device)
    out.update(config=config, label=PEAK_CONFIGS[config], n_params=n_params,
               allocator_growth=allocator_peak_growth(prof, _MARKER) if cpu else None)
    return out


_MARKER = "bench_memory: measured step"


def _tracked_second_step(MemTracker, model, opt, step, data, device):
    step()
    gc.collect()
    tracker = MemTracker()
    # first the tensors without a category of their own: a CPU-only offload master that is the
    # parameter itself is then recategorized as a parameter by the model's entry
    alive = _alive_before(model, opt, data)
    tracker.track_external(*alive, model, opt)
    # the same storages counted here, to check that the tracker saw them all at their size
    expected_entry = storage_bytes([*alive, *model.parameters(), *model.buffers(),
                                    *[t for s in opt.state.values() for t in s.values()]],
                                   device)
    del alive  # the step's forward replaces the cached casts: no reference here keeps them
    # on CUDA the emulation keeps nothing (its scratch is for CPU tensors)
    scratch_before = scratch_bytes() if device.type == "cpu" else 0
    counted = {}
    phases = []

    def marks(phase):
        snap = tracker.get_tracker_snapshot("peak").get(device, {})
        phases.append((phase, snap.get("Total", 0)))

    def before_step():
        counted.update(device_state_bytes(model, opt))

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with tracker, warnings.catch_warnings(), torch.profiler.record_function(_MARKER):
        # the tracker's gradient hook finds no gradient on a parameter whose gradient an
        # offload hook has already moved to its host master: nothing to count there
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
        at_entry = tracker.get_tracker_snapshot().get(device, {}).get("Total", 0)
        step(before_step, marks)
    cuda_peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        cuda_peak = torch.cuda.max_memory_allocated()
    snap = tracker.get_tracker_snapshot("peak")[device]
    categories = {c: 0 for c in CATEGORIES}
    for key, value in snap.items():
        name = getattr(key, "value", key)
        if name != "Total":
            categories[name] = value
    peak = snap["Total"]
    phase = next(name for name, total in phases if total == peak)
    scratch = scratch_bytes() if device.type == "cpu" else 0
    if scratch != scratch_before:
        raise RuntimeError(f"the emulation's scratch buffers changed during the measured step "
                           f"({scratch_before} -> {scratch} bytes): peak less scratch is not "
                           "exact")
    return dict(peak=peak, categories=categories, phase=phase, cuda_peak=cuda_peak,
                at_entry=at_entry, expected_entry=expected_entry, device_state=counted,
                scratch=scratch, peak_less_scratch=peak - scratch)


def largest_batch(config, cfg, device, start=1, cap=256, max_tries=16):
    """CUDA only: the largest batch (x cfg.seq_len tokens) with which two training steps of
    `config` run without torch.cuda.OutOfMemoryError: batches doubled from `start` until one
    fails or `cap` is reached, then bisected. Returns (batch, note): note is "" for the exact
    largest, "cap" when `cap` fit (the largest may be more), "none" when even `start` did not
    fit (batch 0), "tries" when max_tries stopped the bisection (the batch fits, a larger may)."""
    tries = 0

    def fits(b):
        nonlocal tries
        tries += 1
        try:
            model, opt, step, data = build_peak_step(config, cfg, b, device)
            step()
            step()
            ok = True
        except torch.cuda.OutOfMemoryError:
            ok = False
        model = opt = step = data = None  # noqa: F841  (the failed step's tensors go first)
        gc.collect()
        torch.cuda.empty_cache()
        return ok

    if not fits(start):
        return 0, "none"
    lo, hi = start, None
    while hi is None:
        if lo * 2 > cap:
            return lo, "cap"
        if tries >= max_tries:
            return lo, "tries"
        if fits(lo * 2):
            lo *= 2
        else:
            hi = lo * 2
    while hi - lo > 1 and tries < max_tries:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, "" if hi - lo == 1 else "tries"


def peak_table(rows, cfg, batch, device, batches=None) -> str:
    base = rows[0]
    gpu = device.type == "cuda"
    lines = [f"# Peak memory of one training step: Llama d_model {cfg.d_model}, {cfg.n_layer} "
             f"layers, {cfg.n_head} heads, vocabulary {cfg.vocab_size}, batch {batch} x "
             f"{cfg.seq_len} tokens ({base['n_params']} parameters)", "",
             f"device: {torch.cuda.get_device_name() if gpu else 'CPU'}; torch "
             f"{torch.__version__}; fp8ops backend {fp8ops.backend(device)}", "",
             "The second step (forward under bf16 autocast, backward, optimizer step) of each "
             "configuration, after a first one made the optimizer state. Peak: torch's "
             "MemTracker, every storage alive during the step counted once at its byte size; "
             "the categories (MB = 1e6 bytes) are its split at the peak (optstate includes the "
             "optimizer step's temporaries, other the batch, the FP8 weight casts of the step "
             "before, offload masters and the emulation's scratch buffers). Each configuration "
             "adds one feature to the row above it.", ""]
    head = ["configuration", "peak bytes", "vs baseline", "bytes / param"]
    if not gpu:
        head += ["less emulation scratch", "vs baseline"]
    head += ["peak in"] + [c.lower() for c in CATEGORIES]
    if gpu:
        head += ["cuda max allocated", "largest batch"]
    lines += ["| " + " | ".join(head) + " |",
              "|---|" + "---:|" * 3 + ("---:|" * 2 if not gpu else "") + "---|"
              + "---:|" * len(CATEGORIES) + ("---:|" * 2 if gpu else "")]
    for r in rows:
        cells = [r["label"], str(r["peak"]), f"{r['peak'] / base['peak']:.3f}x",
                 f"{r['peak'] / r['n_params']:.2f}"]
        if not gpu:
            cells += [str(r["peak_less_scratch"]),
                      f"{r['peak_less_scratch'] / base['peak_less_scratch']:.3f}x"]
        cells += [r["phase"]] + [f"{r['categories'][c] / 1e6:.2f}" for c in CATEGORIES]
        if gpu:
            cp = r["cuda_peak"]
            flag = " (differs > 5%)" if abs(cp - r["peak"]) > 0.05 * r["peak"] else ""
            cells.append(f"{cp}{flag}")
            b = (batches or {}).get(r["config"])
            cells.append("-" if b is None else f"{b[0]} ({b[1]})" if b[1] else str(b[0]))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    bad = [r["config"] for r in rows if r["at_entry"] != r["expected_entry"]]
    lines.append("Bytes the tracker counted at the start of the step vs the same storages "
                 "counted directly: " + ("equal in every row." if not bad else
                                         "DIFFERENT in " + ", ".join(bad) + "."))
    if not gpu:
        diff = [f"{r['config']} {r['peak'] - r['at_entry']} vs {r['allocator_growth']}"
                for r in rows if r["peak"] - r["at_entry"] != r["allocator_growth"]]
        lines += ["", "The step's peak growth over its start, tracker vs the CPU allocator's own "
                  "count (torch.profiler, profile_memory): " + (
                      "equal in every row." if not diff else "; ".join(diff) + ".")]
    if not gpu:
        lines += ["", "CPU: the device is the host, so every figure is host memory. The FP8 rows "
                  "include the emulation's float32 decodes of FP8 operands (temporaries a GPU "
                  "FP8 GEMM does not make) and its kept scratch buffers (in 'other', alive "
                  "through the whole step; 'less emulation scratch' subtracts them): "
                  + ", ".join(f"{r['config']} {r['scratch'] / 1e6:.2f} MB" for r in rows
                              if r["scratch"]) + "."]
        off = next((r for r in rows if r["config"] == "offload"), None)
        if off is not None:
            ds = off["device_state"]
            lines += ["", "Offload on the CPU: its peak is the host's (the masters, host "
                      "gradients and optimizer state together with what a GPU would hold), "
                      "not a device peak. What the device would keep between steps "
                      "(fp8ops.memory.device_state_bytes just before the optimizer step): "
                      f"{ds['total']} bytes ({ds['total'] / off['n_params']:.2f} per parameter: "
                      f"FP8 weights {ds['fp8_weights']}, parameters {ds['parameters']}, "
                      f"gradients {ds['gradients']}, optimizer state "
                      f"{ds['optimizer_state']}), activations and temporaries not included."]
    return "\n".join(lines) + "\n"


def peak_main(args):
    device = _indexed("cuda" if torch.cuda.is_available() and not args.no_gpu else "cpu")
    size = dict(PEAK_SIZES["smoke" if args.smoke else "default"])
    for key in size:
        if getattr(args, f"peak_{key}") is not None:
            size[key] = getattr(args, f"peak_{key}")
    cfg = llama_config(size["d_model"], size["n_layer"], size["seq"])
    if args.threads:
        # memory does not depend on it; many threads on a loaded machine slow the small ops
        torch.set_num_threads(args.threads)
    configs = args.configs.split(",") if args.configs else list(PEAK_CONFIGS)
    rows = []
    for config in configs:
        rows.append(measure_peak(config, cfg, size["batch"], device))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{config}: peak {rows[-1]['peak']} bytes", flush=True)
    batches = None
    if device.type == "cuda" and args.max_batch:
        batches = {c: largest_batch(c, cfg, device, cap=args.max_batch) for c in configs}
    table = peak_table(rows, cfg, size["batch"], device, batches)
    out = args.out if args.out is not None else (None if args.smoke else
                                                 os.path.join(HERE, "results"))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "memory_peak.md"), "w") as f:
            f.write(table)
    print(table)
    return rows


def main(argv=None):
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
    ap.add_argument("--out", default=None, help="results folder (default bench/results; a "
                    "--peak --smoke run writes only here)")
    ap.add_argument("--peak", action="store_true",
                    help="only part 4: the peak memory of a Llama training step per configuration")
    ap.add_argument("--smoke", action="store_true", help="--peak at tiny sizes")
    ap.add_argument("--peak-d-model", type=int, default=None, help="--peak (default 256)")
    ap.add_argument("--peak-n-layer", type=int, default=None, help="--peak (default 4)")
    ap.add_argument("--peak-seq", type=int, default=None, help="--peak (default 256)")
    ap.add_argument("--peak-batch", type=int, default=None, help="--peak (default 4)")
    ap.add_argument("--configs", default=None, help="--peak: a comma-separated subset of "
                    + ", ".join(PEAK_CONFIGS))
    ap.add_argument("--threads", type=int, default=1, help="--peak: torch threads (0: as is)")
    ap.add_argument("--max-batch", type=int, default=256, help="--peak on CUDA: the largest "
                    "batch search stops here (0: no search)")
    args = ap.parse_args(argv)
    if args.peak:
        return peak_main(args)
    if args.out is None:
        args.out = os.path.join(HERE, "results")
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
