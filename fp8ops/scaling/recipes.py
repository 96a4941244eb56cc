"""The scaling recipes: frozen dataclasses of settings, checked when made, and the scale math
they share (current_scale, recipe_formats, grad_margin)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .._checks import check_int, check_int64
from ..formats import get_format
from ..ops.emulation import scale_from_amax

AMAX_ALGOS = ("max", "most_recent", "ema", "percentile")
MAX_HISTORY = 1024  # the CUDA scale-update kernel sorts the history in one block


def _check_fmt(name, value):
    try:
        get_format(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _check_rounding(value):
    if value not in ("nearest", "stochastic"):
        raise ValueError(f"grad_rounding must be 'nearest' or 'stochastic', got {value!r}")


def _check_in_range(name, value, high):
    """value in (0, high], a real number: a bool (True would pass as 1) or a string is not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number in (0, {high}], got {value!r}")
    if not 0 < value <= high:
        raise ValueError(f"{name} must be in (0, {high}], got {value!r}")


def as_float32(value) -> float:
    """value rounded to float32 (inf when it overflows, 0 when it underflows), as the ops see it."""
    # on the CPU whatever the default device (a meta one has no value to read)
    return torch.tensor(float(value), dtype=torch.float32, device="cpu").item()


def check_margin(margin, name="margin"):
    """margin multiplies amax in float32: it must be positive and finite there (0 would saturate
    every value, a negative one flip signs)."""
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real):
        raise TypeError(f"{name} must be a number, got {margin!r}")
    if not 0 < as_float32(margin) < math.inf:
        raise ValueError(f"{name} must be a positive finite factor in float32 (1.0 = none), "
                         f"got {margin}")


def grad_margin(recipe) -> float:
    """The margin of the gradient casts: the recipe's grad_margin, else its margin (gradients
    can spike between steps: a larger margin leaves them headroom)."""
    margin = getattr(recipe, "grad_margin", None)
    return recipe.margin if margin is None else margin


@dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scales from an amax history (Transformer Engine style), updated on device."""

    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: float = 1.0
    interval: int = 1
    fwd_fmt: str = "e4m3"
    bwd_fmt: str = "e5m2"
    power_of_two: bool = False
    ema_alpha: float = 0.1
    percentile: float = 99.0
    grad_rounding: str = "nearest"
    seed: int = 0
    process_group: Any = field(default=None, compare=False)
    grad_margin: Optional[float] = None  # margin of the gradient casts (None: `margin`)

    def __post_init__(self):
        check_int("amax_history_len", self.amax_history_len, 1, MAX_HISTORY)
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo must be one of {AMAX_ALGOS}, "
                             f"got {self.amax_compute_algo!r}")
        check_int("interval", self.interval, 1)
        check_int64("seed", self.seed)
        _check_in_range("ema_alpha", self.ema_alpha, 1)
        _check_in_range("percentile", self.percentile, 100)
        check_margin(self.margin)
        if self.grad_margin is not None:
            check_margin(self.grad_margin, "grad_margin")
        _check_fmt("fwd_fmt", self.fwd_fmt)
        _check_fmt("bwd_fmt", self.bwd_fmt)
        _check_rounding(self.grad_rounding)


@dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor scales from the tensor being cast (one amax pass, then the cast).

    amax_percentile (None or a number in (0, 100]): take the amax as that percentile of |x|
    (nearest rank) rather than its max. A tensor with fewer non-zeros than the ranks above the
    percentile (e.g. at most 1% non-zeros at 99) has percentile 0: its plain max |x| is used then,
    as a scale of 1 would flush its small values to zero."""

    margin: float = 1.0
    fwd_fmt: str = "e4m3"
    bwd_fmt: str = "e5m2"
    power_of_two: bool = False
    grad_rounding: str = "nearest"
    seed: int = 0
    grad_margin: Optional[float] = None  # margin of the gradient casts (None: `margin`)
    # None: amax = max |x|. A percentile (e.g. 99.99): the amax is that percentile of |x| within
    # the tensor (nearest rank), so a few outliers saturate instead of stretching the scale
    # (max |x| where that percentile is 0 but x is not all zero; see above).
    amax_percentile: Optional[float] = None

    def __post_init__(self):
        check_margin(self.margin)
        if self.grad_margin is not None:
            check_margin(self.grad_margin, "grad_margin")
        if self.amax_percentile is not None:
            _check_in_range("amax_percentile", self.amax_percentile, 100)
        _check_fmt("fwd_fmt", self.fwd_fmt)
        _check_fmt("bwd_fmt", self.bwd_fmt)
        _check_rounding(self.grad_rounding)
        check_int64("seed", self.seed)


@dataclass(frozen=True)
class MXFP8Scaling:
    """MXFP8: E8M0 scale per 32 elements along K, row-wise and column-wise copies.
    Block scales cover the range, so gradients default to E4M3 too (as Transformer Engine)."""

    fwd_fmt: str = "e4m3"
    bwd_fmt: str = "e4m3"
    block_size: int = 32
    scale_mode: str = "floor"

    def __post_init__(self):
        _check_fmt("fwd_fmt", self.fwd_fmt)
        _check_fmt("bwd_fmt", self.bwd_fmt)
        check_int("block_size", self.block_size, 1)
        if self.scale_mode not in ("floor", "rceil"):
            raise ValueError(f"scale_mode must be 'floor' or 'rceil', got {self.scale_mode!r}")


@dataclass(frozen=True)
class BlockwiseScaling:
    """DeepSeek-V3 style: activations and gradients 1x128, weights 128x128, float32 scales."""

    fwd_fmt: str = "e4m3"
    bwd_fmt: str = "e4m3"
    power_of_two: bool = False

    def __post_init__(self):
        _check_fmt("fwd_fmt", self.fwd_fmt)
        _check_fmt("bwd_fmt", self.bwd_fmt)


Recipe = (DelayedScaling, CurrentScaling, MXFP8Scaling, BlockwiseScaling)


def check_recipe(recipe):
    if recipe is None:
        return CurrentScaling()
    if isinstance(recipe, type) and issubclass(recipe, Recipe):
        raise TypeError(f"recipe must be a recipe instance, got the class {recipe.__name__}: "
                        f"pass an instance: {recipe.__name__}()")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be one of DelayedScaling, CurrentScaling, MXFP8Scaling, "
                        f"BlockwiseScaling or None, got {type(recipe).__name__}")
    return recipe


def current_scale(amax: torch.Tensor, fmt, margin: float = 1.0,
                  power_of_two: bool = False) -> torch.Tensor:
    """scale = max / (amax * margin), 1.0 when amax is 0 or not finite (on device, no sync)."""
    fmt = get_format(fmt)
    return scale_from_amax(amax, torch.ones_like(amax), fmt.max, margin, power_of_two)


def recipe_formats(recipe):
    return get_format(recipe.fwd_fmt), get_format(recipe.bwd_fmt)

