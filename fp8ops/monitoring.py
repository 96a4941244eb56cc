"""Scaling health you can watch: opt-in, sampled statistics of the FP8 casts of a model.

    mon = fp8ops.monitor(model, every=100)     # sample every 100th training forward (+ backward)
    ...train...
    logger.log(fp8ops.stats(model))            # {"blocks.0.attn.qkv.input.underflow_frac": ...}

Per FP8 layer and role (input, weight, grad), at the last sampled cast:
  amax              max |x| of the tensor cast
  scale             the per-tensor scale the cast used (per-tensor recipes)
  amax_history_max  max of the amax history (DelayedScaling)
  saturated_frac    finite elements the cast clamped to the format's max (more than half an
                    ulp above it: a clamp, not a rounding)
  underflow_frac    non-zero finite elements the cast flushed to zero
  nonfinite         inf/NaN elements in the tensor cast
  nonfinite_casts   casts that met inf/NaN so far (DelayedScaling counts every cast; the others
                    count the sampled ones)
  block_scale_log2_min / _max / _spread   range of the block scales, in binades (MXFP8, blockwise)
and per FP8 layer, counted on every call (not sampled):
  high_precision_calls   calls its fallback ran in high precision (fp8ops.nn.fallback)
With no monitor attached nothing is computed (one `is None` test per cast). On a sampled step
each cast adds one read of its tensor and its FP8 data, on the device (ops.cast_stats: on CUDA
one kernel, csrc/stats.cu; on the CPU one pass of the CPU kernels; the emulation, where neither
is built, reads pieces of a bounded size), and no full-size temporary;
only stats() reads the values back (one host sync per call). raise_on_nonfinite=True checks each sampled cast on
the host and raises FloatingPointError naming the layer and role.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from .nn.cast_stats import STATS, Monitor
from .nn.modules import FP8Linear


def monitor(model: nn.Module, every: int = 100, raise_on_nonfinite: bool = False) -> Monitor:
    """Attach a Monitor to every FP8 layer of `model` (replacing an earlier one). Returns it;
    detach with unmonitor(model)."""
    unmonitor(model)
    mon = Monitor(every, raise_on_nonfinite)
    layers = [(name or type(model).__name__, m) for name, m in model.named_modules()
              if isinstance(m, FP8Linear)]
    if not layers:
        raise ValueError("monitor: the model has no FP8 layers (convert it with "
                         "fp8ops.convert_to_fp8 first)")
    for name, layer in layers:
        layer.fp8_state.monitor = (mon, name)
    model._fp8ops_monitor_hook = model.register_forward_pre_hook(mon.tick)
    model._fp8ops_monitor = mon
    return mon


def unmonitor(model: nn.Module) -> None:
    """Detach the monitor: the casts compute nothing extra again."""
    hook = getattr(model, "_fp8ops_monitor_hook", None)
    if hook is not None:
        hook.remove()
        del model._fp8ops_monitor_hook, model._fp8ops_monitor
    for m in model.modules():
        state = getattr(m, "fp8_state", None)
        if state is not None and getattr(state, "monitor", None) is not None:
            state.monitor = None


def stats(model: nn.Module, prefix: str = "") -> Dict[str, float]:
    """The latest sampled statistics of every FP8 layer of `model`, flat:
    "<layer>.<role>.<stat>" -> float, ready for any logger (no role statistics until a sampled
    forward ran), and "<layer>.high_precision_calls". Raises if no monitor is attached."""
    mon: Optional[Monitor] = getattr(model, "_fp8ops_monitor", None)
    if mon is None:
        raise ValueError("stats: no monitor on this model; call fp8ops.monitor(model, every=N) "
                         "first")
    out = {}
    for name, layer in model.named_modules():
        attached = getattr(getattr(layer, "fp8_state", None), "monitor", None)
        if attached is not None and attached[0] is mon:
            out[f"{prefix}{attached[1]}.high_precision_calls"] = float(
                layer.fp8_state.high_precision_calls)
    keys, values = [], []
    for (layer, role), s in sorted(mon.latest.items()):
        for stat in STATS:
            if stat in s:
                keys.append(f"{prefix}{layer}.{role}.{stat}")
                values.append(s[stat].float().reshape(()))
    if values:
        flat = torch.stack([v.to(values[0].device) for v in values]).tolist()  # one sync
        out.update(zip(keys, flat))
    return out
