"""Where FP8 cannot beat the high-precision layer: small GEMMs run in the layer's own dtype.

A layer call multiplies [M, K] by [N, K] (M tokens, K in_features, N out_features). FP8 saves GEMM
time in proportion to M*K*N and pays for its casts and their launches in proportion to M*K + M*N
and per call; below some size it is slower than bf16. A Crossover says from which size a layer
runs FP8; `MEASURED` holds the one measured on each GPU model for each recipe (they differ: a
block recipe casts more per call, and MXFP8 on Hopper multiplies on bf16 tensor cores).
bench/bench_linear.py prints the speed-up of every recipe per shape and, per recipe, the
Crossover that keeps every measured shape at >= 1.0x bf16: the rows here.

FP8Linear(fallback=...) / convert_to_fp8(fallback=...):
  "auto"     the crossover measured on the layer's GPU for its recipe (none measured: FP8
             always; the CPU emulation is the numerics reference, never a speed path: FP8
             always)
  "never"    FP8 always
  Crossover  this rule, on any device (a CPU test can exercise the fallback)
A call that falls back is nn.Linear's: no cast, no amax recorded, delayed scaling does not step,
the cached FP8 weight is kept. Layers whose weight is not a plain local tensor (FSDP2's FP8
gather, tensor parallelism, a host-offloaded weight) always run FP8. fp8ops.stats counts the
calls that fell back per layer (`<layer>.high_precision_calls`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

import torch

from .._checks import check_int


@dataclass(frozen=True)
class Crossover:
    """A call runs FP8 when it has at least min_tokens rows (M), min_in_features (K) and
    min_out_features (N); otherwise the high-precision GEMMs."""

    min_tokens: int = 0
    min_in_features: int = 0
    min_out_features: int = 0

    def __post_init__(self):
        for name in ("min_tokens", "min_in_features", "min_out_features"):
            check_int(name, getattr(self, name), 0)

    def runs_fp8(self, m: int, k: int, n: int) -> bool:
        return m >= self.min_tokens and k >= self.min_in_features and n >= self.min_out_features


# (GPU model as torch.cuda.get_device_name gives it, recipe class name) -> the crossover measured
# there by bench/bench_linear.py (bench/RESULTS.md, 2026-11-26). A model without rows (the H100
# has none yet with the fused casts) runs FP8 everywhere. On the H200 only the largest measured
# shapes won; MXFP8 won at none (its row lies past every measured size: bf16 wherever measured).
# Crossover(min_tokens, min_in_features, min_out_features).
MEASURED: "dict[tuple[str, str], Crossover]" = {
    ("NVIDIA H200", "CurrentScaling"): Crossover(16384, 4096, 7168),
    ("NVIDIA H200", "DelayedScaling"): Crossover(16384, 4096, 7168),
    ("NVIDIA H200", "BlockwiseScaling"): Crossover(16384, 4096, 7168),
    ("NVIDIA H200", "MXFP8Scaling"): Crossover(16385, 8193, 14337),
}

Fallback = Union[str, Crossover]


def check_fallback(fallback) -> Fallback:
    if isinstance(fallback, Crossover) or fallback in ("auto", "never"):
        return fallback
    raise ValueError(f"fallback must be 'auto', 'never' or an fp8ops.Crossover, got {fallback!r}")


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def crossover(fallback: Fallback, device: torch.device, recipe):
    """The Crossover that applies to a layer of `recipe` on `device` (None: FP8 always)."""
    if isinstance(fallback, Crossover):
        return fallback
    if fallback == "never" or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return MEASURED.get((_device_name(index), type(recipe).__name__))


def runs_fp8(fallback: Fallback, recipe, input: torch.Tensor, in_features: int,
             out_features: int) -> bool:
    rule = crossover(fallback, input.device, recipe)
    if rule is None:
        return True
    tokens = input.numel() // in_features if in_features else 0
    return rule.runs_fp8(tokens, in_features, out_features)
