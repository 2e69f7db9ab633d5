"""`_exact.round_ratio`, the exact rounding every grid's tables are built with (a
number given as an integer ratio, rounded into a dtype in integer arithmetic),
against an independent reference: a search of every value of the format."""

from __future__ import annotations

import functools
from fractions import Fraction

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eqxrules._rules._exact import round_ratio

DTYPES = {
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
MODES = ("nearest", "down", "up")


@functools.cache
def _values(dtype) -> tuple[np.ndarray, np.ndarray]:
    """Every finite value of `dtype` (from its bit patterns), sorted, as float64,
    with its bit pattern."""
    bits = 8 * np.dtype(dtype).itemsize
    patterns = np.arange(2**bits)
    with np.errstate(invalid="ignore"):  # NaN patterns
        values = patterns.astype(f"uint{bits}").view(dtype).astype(np.float64)
    finite = np.isfinite(values)
    order = np.argsort(values[finite], kind="stable")
    return values[finite][order], patterns[finite][order]


def searched(v: Fraction, dtype, mode: str) -> float:
    """`v` rounded into `dtype` by search: the nearest value, ties to the even bit
    pattern, inf beyond the largest value plus half its spacing; or, directed, the
    nearest normal number or zero on the side asked (none there: inf)."""
    values, patterns = _values(dtype)
    tiny = float(ml_dtypes.finfo(dtype).tiny)
    if mode != "nearest":
        keep = (values == 0) | (np.abs(values) >= tiny)
        values, patterns = values[keep], patterns[keep]
    top, below_top = Fraction(values[-1]), Fraction(values[-2])
    if mode == "nearest" and abs(v) >= top + (top - below_top) / 2:
        return float("inf") if v > 0 else float("-inf")
    i = int(np.searchsorted(values, float(v)))
    lo, hi = max(i - 3, 0), i + 3
    near = [(Fraction(c), int(p)) for c, p in zip(values[lo:hi], patterns[lo:hi])]
    if mode == "nearest":
        return float(min(near, key=lambda cp: (abs(cp[0] - v), cp[1] & 1))[0])
    side = [c for c, _ in near if (c <= v if mode == "down" else c >= v)]
    if not side:  # beyond the largest value
        return float("inf") if mode == "up" else float("-inf")
    return float(max(side) if mode == "down" else min(side))


def _numbers(dtype) -> list[Fraction]:
    """Values of the format, their midpoints, a third and a hair beyond each, at
    the least normal number, the subnormals, 1, the largest value and beyond, and
    at random powers of two; both signs; and random ratios."""
    values, _ = _values(dtype)
    fi = ml_dtypes.finfo(dtype)
    rng = np.random.default_rng(0)
    tiny = float(fi.tiny)
    at = [tiny, tiny / 2, 1.0, float(fi.max)]
    at += [2.0 ** int(e) for e in rng.integers(int(fi.minexp) - 3, int(fi.maxexp), 6)]
    numbers = []
    for a in at:
        i = int(np.searchsorted(values, a))
        for c, d in zip(values[i - 1 : i + 1], values[i : i + 2]):
            c, d = Fraction(c), Fraction(d)
            for t in (0, Fraction(1, 2), Fraction(1, 3), Fraction(1, 2**40)):
                numbers += [s * (c + t * (d - c)) for s in (1, -1)]
        top = Fraction(float(fi.max))
        numbers += [top * (1 + Fraction(k, 64)) for k in (1, 2, 4)]
    numbers += [Fraction(int(n), int(d)) for n, d in rng.integers(1, 2**20, (40, 2))]
    return numbers


def mismatches(rounding, dtype) -> list[tuple[Fraction, str]]:
    return [
        (v, mode)
        for v in _numbers(dtype)
        for mode in MODES
        if rounding(v, dtype, mode) != searched(v, dtype, mode)
    ]


def _round(v: Fraction, dtype, mode: str) -> float:
    return round_ratio(v.numerator, v.denominator, dtype, mode)


@pytest.mark.parametrize("name", DTYPES)
def test_round_ratio_is_the_searched_value(name):
    assert mismatches(_round, DTYPES[name]) == []


def test_the_search_catches_ties_away_from_zero():
    """The planted defect: halfway cases rounded away from zero, not to even."""

    def away(v, dtype, mode):
        r = _round(v, dtype, mode)
        out = _round(v, dtype, "up" if v > 0 else "down")
        tie = np.isfinite(out) and abs(Fraction(out) - v) == abs(Fraction(r) - v)
        if mode == "nearest" and tie:
            return out
        return r

    assert mismatches(away, jnp.bfloat16) != []


def test_the_search_catches_subnormals_kept_in_directed_modes():
    """The planted defect: rounding down into the subnormals, which XLA flushes."""

    def kept(v, dtype, mode):
        return _round(v, dtype, "nearest" if mode == "down" and 0 < v else mode)

    assert mismatches(kept, jnp.float16) != []
