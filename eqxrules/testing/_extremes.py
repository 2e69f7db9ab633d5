"""The extremes of a floating-point dtype's range that the checks try: shared by
the Hypothesis strategies and `eqxrules.Domain.extremes` (which imports it: the
checker imports nothing back)."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp


def magnitudes(dtype: Any) -> tuple[float, float, float]:
    """`(big, tiny, top)` for `dtype`: powers of ten about four fifths of the way to
    each end of its exponent range (`1e30` and `1e-30` for float32 and bfloat16,
    `1e4` and `1e-3` for float16, `1e243` and `1e-244` for float64), and a quarter
    of its largest finite value."""
    info = jnp.finfo(dtype)
    big = 10.0 ** round(0.79 * math.log10(float(info.max)))
    tiny = 10.0 ** round(0.79 * math.log10(float(info.tiny)))
    return big, tiny, float(info.max) / 4


def extreme_values(low: float, high: float, dtype: Any) -> list[float]:
    """`big`, `tiny`, `top` and `inf`, with each sign `[low, high]` allows (a range
    that holds no negative number gets no negative one)."""
    positive = [*magnitudes(dtype), math.inf]
    values = positive if high > 0 else []
    return values + ([-v for v in positive] if low < 0 else [])
