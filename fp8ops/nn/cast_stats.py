"""Statistics of one FP8 cast, kept for a model's monitor (monitoring.py, the layer above).

The autograd code calls these on sampled casts only: `sampling(state)` says whether the current
forward is sampled, the *_stats functions compute a cast's statistics on the device, and
`observe` keeps them in the Monitor attached to the layer's ScalingState. What each statistic
means: monitoring.py.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn


STATS = ("amax", "scale", "amax_history_max", "saturated_frac", "underflow_frac", "nonfinite",
         "nonfinite_casts", "block_scale_log2_min", "block_scale_log2_max",
         "block_scale_log2_spread")


class Monitor:
    """Shared by the FP8 layers of one model: the sampling clock and the latest statistics."""

    def __init__(self, every: int = 100, raise_on_nonfinite: bool = False):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.every = every
        self.raise_on_nonfinite = bool(raise_on_nonfinite)
        self.forwards = 0  # training-mode forward calls of the monitored model
        self.latest: Dict[Tuple[str, str], Dict[str, torch.Tensor]] = {}
        self.sampled_nonfinite: Dict[Tuple[str, str], torch.Tensor] = {}

    @property
    def sampling(self) -> bool:
        """Whether the current forward (and its backward) is sampled: the 1st, then every
        `every`-th."""
        return (self.forwards - 1) % self.every == 0

    def tick(self, module: nn.Module, _args) -> None:
        if module.training:  # evaluation forwards are not training steps
            self.forwards += 1


def _fractions(x: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor, block_rows: int = 0,
               block_cols: int = 0) -> Dict[str, torch.Tensor]:
    """Saturation, underflow and non-finite counts of a cast and its input's amax, read in one
    op (ops.cast_stats: no full-size temporary, so that a sampled step takes no more memory than
    another; on CUDA one kernel, csrc/stats.cu). Saturated: cast to the format's max although
    more than half an ulp of max above it (a clamp, not a rounding); underflow: non-zero, cast
    to zero."""
    counts, amax = torch.ops.fp8ops.cast_stats(x, data, scale_inv, block_rows, block_cols)
    n = max(x.numel(), 1)
    return {"saturated_frac": counts[0] / n, "underflow_frac": counts[1] / n,
            "nonfinite": counts[2], "amax": amax}


def per_tensor_stats(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor):
    """Statistics of a per-tensor cast: data (float8) = cast(x * scale). `scale` is the one the
    cast used and is reported as is (the reciprocal of its reciprocal can differ in the last
    bit); the values are read back with its reciprocal, as the GEMMs read them."""
    scale = scale.float().reshape(()).clone()
    out = _fractions(x, data, torch.reciprocal(scale))
    out["scale"] = scale
    return out


def mx_stats(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, block_size: int, axis: int):
    """Statistics of an MXFP8 cast (E8M0 scale bytes per block of block_size along axis). data
    may be zero-padded beyond x's shape; the padding is not counted."""
    blocks = (1, block_size) if axis % max(data.dim(), 1) == data.dim() - 1 else (block_size, 1)
    out = _fractions(x, data, scales, *blocks)
    exps = scales.to(torch.int32) - 127
    valid = scales != 0xFF
    out.update(_log2_range(exps[valid].float()))
    return out


def blockwise_stats(x: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor, block_rows: int,
                    block_cols: int):
    """Statistics of a blockwise cast (float32 scale_inv per block_rows x block_cols tile)."""
    out = _fractions(x, data, scale_inv, block_rows, block_cols)
    s = scale_inv.float()
    out.update(_log2_range(torch.log2(s[(s > 0) & torch.isfinite(s)])))
    return out


def _log2_range(v: torch.Tensor) -> Dict[str, torch.Tensor]:
    if v.numel() == 0:
        z = torch.zeros((), device=v.device)
        return {"block_scale_log2_min": z, "block_scale_log2_max": z, "block_scale_log2_spread": z}
    lo, hi = v.min(), v.max()
    return {"block_scale_log2_min": lo, "block_scale_log2_max": hi,
            "block_scale_log2_spread": hi - lo}


def weight_values(state, weight: torch.Tensor) -> torch.Tensor:
    """The weight's values: under a CPUOffloadOptimizer the parameter is a placeholder and the
    values are the host master's, in the layout the casts read (a transient device copy, on
    sampled steps only)."""
    return weight if getattr(state, "host_weight", None) is None else state.host_values()


def sampling(state) -> bool:
    """Whether a cast under this ScalingState should be observed now: a monitor is attached,
    this training forward is sampled, and the layer is training (not evaluating)."""
    attached = getattr(state, "monitor", None)
    return attached is not None and state.recording and attached[0].sampling


def observe(state, role: str, stats: Dict[str, torch.Tensor]) -> None:
    """Keep the statistics of one sampled cast of `role` under `state` (a ScalingState), made
    after the cast (a delayed-scaling role's nonfinite_count includes it)."""
    mon, layer = state.monitor
    stats = {k: v.detach() for k, v in stats.items()}
    role_state = getattr(state, role, None) if state.delayed else None
    if role_state is not None:
        stats["amax_history_max"] = role_state.amax_history.max()
        stats["nonfinite_casts"] = role_state.nonfinite_count.clone()
    else:
        key = (layer, role)
        count = mon.sampled_nonfinite.get(key)
        hit = (stats["nonfinite"] > 0).to(torch.int64)
        mon.sampled_nonfinite[key] = hit if count is None else count + hit
        stats["nonfinite_casts"] = mon.sampled_nonfinite[key]
    mon.latest[(layer, role)] = stats
    if mon.raise_on_nonfinite and int(stats["nonfinite"]) > 0:
        raise FloatingPointError(f"fp8ops: {int(stats['nonfinite'])} non-finite values in the "
                                 f"{role} of FP8 layer '{layer}' (forward {mon.forwards})")
