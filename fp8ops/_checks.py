"""Argument checks shared by the public functions and the recipes: errors that name the
argument, raised where the bad value is given rather than deep inside an op."""
from __future__ import annotations

import numbers
from typing import Optional


def check_int(name: str, value, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """An int argument. A bool, float or string (True, 2.5, "32") is refused here: later it would
    fail far from where it was given, or pass as another number (True as 1, 2.7 as 2)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = (f"in [{low}, {high}]" if low is not None and high is not None
                  else f">= {low}" if low is not None else f"<= {high}")
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return int(value)


def check_int64(name: str, value) -> int:
    """An int the ops take as an int64 (a Philox seed or offset)."""
    value = check_int(name, value)
    if not -2 ** 63 <= value < 2 ** 63:
        raise ValueError(f"{name} must fit in an int64, got {value}")
    return value
