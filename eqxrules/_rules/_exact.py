r"""Exact uniform grids, built at trace time.

A static grid (`bits`, `lo`, `hi` are Python numbers) has exactly known levels
$L_k = \mathrm{lo} + k(\mathrm{hi} - \mathrm{lo})/n$ and decision thresholds
$T_j = (L_j + L_{j+1})/2$. They are computed here in exact rational arithmetic and
rounded, exactly, into the dtype they are compared or returned in: small constant
tables. The table path (`grid_index`) estimates the level index in float32 (one
multiply-add), then corrects it by one comparison with a threshold read from the
table, so that it is the index nearest the exact input, ties to the even index, and
reads the value, the exact level rounded once to the output dtype. `_paths` has the
faster paths, and checks them against these tables.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._elementwise import wide

MAX_BITS = 16
_TINY_BITS = 1100  # 2^-1100 is below every quantum of every dtype up to float64


def _exponent(a: Fraction) -> int:
    """`floor(log2(a))` for `a > 0`, exactly."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    if Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


@functools.cache
def _format(dtype: Any) -> tuple[int, int, float]:
    """`dtype`'s precision (bits of significand), least normal exponent, and
    largest finite value."""
    fi = jnp.finfo(dtype)
    return int(fi.nmant) + 1, int(fi.minexp), float(fi.max)


def round_ratio(num: int, den: int, dtype: Any, mode: str = "nearest") -> float:
    """`num/den` (`den > 0`) rounded into `dtype`, as `round_to`, in integer
    arithmetic alone: a grid's thousands of levels and thresholds are each one
    such rounding, and building `Fraction`s for them cost seconds per grid."""
    if num == 0:
        return 0.0
    p, minexp, largest = _format(dtype)
    negative = num < 0
    a = -num if negative else num
    e = a.bit_length() - den.bit_length()  # floor(log2(a/den)) is e or e - 1
    if (a << max(-e, 0)) < (den << max(e, 0)):
        e -= 1
    if mode != "nearest" and e < minexp:  # |v| below the least normal number
        tiny = math.ldexp(1.0, minexp)
        if negative:
            return 0.0 if mode == "up" else -tiny
        return tiny if mode == "up" else 0.0
    shift = max(e, minexp) - p + 1  # the quantum is 2^shift
    d = den << max(shift, 0)
    lower, rem = divmod(a << max(-shift, 0), d)
    if mode == "nearest":
        up = 2 * rem > d or (2 * rem == d and lower % 2 == 1)
    else:  # directed: away from zero when rounding towards the side `v` is on
        up = rem > 0 and ((mode == "up") != negative)
    m = lower + up
    big, big_den = largest.as_integer_ratio()
    if (m << max(shift, 0)) * big_den > big << max(-shift, 0):
        toward_zero = mode != "nearest" and ((mode == "down") != negative)
        r = largest if toward_zero else math.inf
    else:
        r = math.ldexp(float(m), shift)  # m has at most p <= 53 bits: exact
    return -r if negative else r


def round_to(v: Fraction, dtype: Any, mode: str = "nearest") -> float:
    """`v` rounded into `dtype`: `"nearest"` (ties to even, subnormals kept), or,
    for comparisons, `"down"` (towards -inf) or `"up"` into the normal numbers and
    zero. XLA flushes subnormals to zero on the CPU (inputs and constants alike;
    an H200 does not), so a comparison with a subnormal constant would not be
    the one written there; over the normal numbers and zero, `x > c` is `x > c'` with `c'` the
    rounding down of `c` into them, and `x >= c` is `x >= c'` with the rounding up.
    The result is a Python float holding the rounded value exactly."""
    return round_ratio(v.numerator, v.denominator, dtype, mode)


def below(v: Fraction, dtype: Any) -> float:
    """The largest normal number or zero of `dtype` strictly below `v`."""
    return _below_ratio(v.numerator, v.denominator, dtype)


def _below_ratio(num: int, den: int, dtype: Any) -> float:
    """`below(num/den)`: `num/den - 2^-_TINY_BITS` rounded down."""
    return round_ratio((num << _TINY_BITS) - den, den << _TINY_BITS, dtype, "down")


class Grid(NamedTuple):
    """The constant tables of one grid, for inputs compared in `compute` and
    values returned in `out`."""

    scale: float  # n / (hi - lo), rounded to `compute`
    offset: float  # -lo * n / (hi - lo), rounded to `compute`
    thresholds: np.ndarray  # `compute`: index j + 1 where x > thresholds[j]
    levels: np.ndarray  # `out`: the exact levels, rounded once
    bound: Fraction  # bound on |estimate - exact index| over the grid (< 1/2)


def _fractions(bits: int, lo: float, hi: float):
    n = 2**bits - 1
    flo, fhi = Fraction(lo), Fraction(hi)
    return n, flo, fhi, (fhi - flo) / n


def estimate_bound(
    bits: int, lo: float, hi: float, compute: Any, shift: int = 0
) -> Fraction:
    """An upper bound on `|fl(fl(x·scale) + offset) - ((x - lo)·n/(hi - lo) - shift)|`
    over every `x` of `compute` from just below `lo` to just above `hi`, with each
    operation rounded to nearest (or fused), and flushed subnormals; `offset` is
    `-lo·n/(hi - lo) - shift` rounded."""
    n, flo, fhi, _ = _fractions(bits, lo, hi)
    s = n / (fhi - flo)
    o = -flo * s - shift
    s_f, o_f = Fraction(round_to(s, compute)), Fraction(round_to(o, compute))
    u = Fraction(1, 2 ** (int(jnp.finfo(compute).nmant) + 1))
    flush = Fraction(2) ** int(jnp.finfo(compute).minexp)
    x = max(abs(flo), abs(fhi)) * (1 + 4 * u) + flush
    product = x * s_f
    return (
        x * abs(s_f - s)
        + u * product
        + abs(o_f - o)
        + u * (product * (1 + u) + abs(o_f))
        + 2 * flush
    )


def resolvable(bits: int, lo: float, hi: float) -> bool:
    """Whether float32 resolves the grid well enough for the one-comparison
    correction: the float32 estimate of the index is within 1/2 of the exact one."""
    return estimate_bound(bits, lo, hi, jnp.float32) < Fraction(1, 2)


def _integers(bits: int, lo: float, hi: float) -> tuple[int, int, int, int]:
    """`n`, and integers `a`, `s`, `d` such that level `k` is `(a + k·s)/d` and
    threshold `j` is `(2a + (2j + 1)·s)/(2d)`."""
    n = 2**bits - 1
    flo, fhi = Fraction(lo), Fraction(hi)
    d = flo.denominator * fhi.denominator  # powers of two
    a, b = flo.numerator * fhi.denominator, fhi.numerator * flo.denominator
    return n, a * n, b - a, d * n


def _thresholds(bits: int, lo: float, hi: float) -> list[tuple[int, int]]:
    """Each exact threshold $T_j$ as an integer ratio."""
    n, a, s, d = _integers(bits, lo, hi)
    return [(2 * a + (2 * j + 1) * s, 2 * d) for j in range(n)]


def _levels(bits: int, lo: float, hi: float, dtype: Any) -> list[float]:
    """Each exact level rounded once to `dtype`."""
    n, a, s, d = _integers(bits, lo, hi)
    return [round_ratio(a + k * s, d, dtype) for k in range(n + 1)]


def is_exactly(value: float, ratio: tuple[int, int]) -> bool:
    """Whether the float `value` is the number `ratio[0]/ratio[1]`."""
    num, den = float(value).as_integer_ratio()
    return num * ratio[1] == ratio[0] * den


@functools.lru_cache(maxsize=256)
def grid(bits: int, lo: float, hi: float, compute: Any, out: Any) -> Grid:
    compute, out = jnp.dtype(compute), jnp.dtype(out)
    n, flo, _, step = _fractions(bits, lo, hi)
    s = 1 / step
    # x > T_j exactly iff x > round_down(T_j); at a tie (x == T_j, representable),
    # the even index wins: odd j compare with the value just below T_j (>=).
    thresholds = [
        round_ratio(*t, compute, "down") if j % 2 == 0 else _below_ratio(*t, compute)
        for j, t in enumerate(_thresholds(bits, lo, hi))
    ]
    return Grid(
        round_to(s, compute),
        round_to(-flo * s, compute),
        np.asarray(thresholds, compute),
        np.asarray(_levels(bits, lo, hi, out), out),
        estimate_bound(bits, lo, hi, compute),
    )


def _lookup(table: np.ndarray, index: Array) -> Array:
    """`table[index]`, the index clipped into range, sharded like `index`. With
    sharding in types (the default of `jax.make_mesh` on recent JAX), a gather from
    a replicated constant by a batch-sharded index must be told its output's
    sharding, or it raises; JAX without `jax.typeof` has no sharding in types."""
    t = jnp.asarray(table)
    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return jnp.take(t, index, mode="clip")
    return t.at[index].get(mode="clip", out_sharding=typeof(index).sharding)


def grid_index(w: Array, g: Grid, n: int) -> Array:
    """The index of the level nearest `w` (ties to even), for any `w` of the compute
    dtype: NaN gives some index in range."""
    estimate = jnp.floor(w * g.scale + g.offset)
    j = jnp.clip(estimate, 0, n - 1).astype(jnp.int32)
    above = w > _lookup(g.thresholds, j)
    return j + above.astype(jnp.int32)


def reference_index(w: Array, bits: int, lo: float, hi: float) -> Array:
    """Independently of `grid_index`: the nearest index of each `w` (ties to even),
    by counting the thresholds below it with a binary search, then settling an
    exact tie by parity; in `[0, n]` (NaN gives some index in range)."""
    n = 2**bits - 1
    down, exact = _reference_thresholds(bits, lo, hi, w.dtype)
    count = jnp.searchsorted(jnp.asarray(down), w, side="left")  # #{T_j < x}
    inner = jnp.minimum(count, n - 1)
    tie = (count < n) & jnp.asarray(exact)[inner] & (jnp.asarray(down)[inner] == w)
    k = jnp.where(tie & (count % 2 == 1), count + 1, count)
    return jnp.minimum(k, n)


@functools.lru_cache(maxsize=64)
def _reference_thresholds(
    bits: int, lo: float, hi: float, dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Each threshold rounded down into `dtype`, and whether that is exact."""
    t = _thresholds(bits, lo, hi)
    down = np.asarray([round_ratio(*v, dtype, "down") for v in t], dtype)
    return down, np.asarray([is_exactly(d, v) for d, v in zip(down, t)])


@functools.lru_cache(maxsize=64)
def reference_levels(bits: int, lo: float, hi: float, dtype: Any) -> np.ndarray:
    """Every exact level rounded once to `dtype`."""
    return np.asarray(_levels(bits, lo, hi, dtype), dtype)


def reference_quantize(x: Array, bits: int, lo: float, hi: float) -> Array:
    """Independently of `grid_index` (`reference_index`), the level rounded once."""
    w = x.astype(wide(x.dtype))
    levels = jnp.asarray(reference_levels(bits, lo, hi, x.dtype))
    return jnp.where(jnp.isnan(w), x, levels[reference_index(w, bits, lo, hi)])


def ge(x: Array, c: float) -> Array:
    """`x >= c` for the exact number `c`, whatever `x`'s dtype (comparing with `c`
    rounded to that dtype would be wrong between `c` and its rounding)."""
    return x >= round_to(Fraction(float(c)), x.dtype, "up")


def le(x: Array, c: float) -> Array:
    """`x <= c` for the exact number `c`, whatever `x`'s dtype."""
    return x <= round_to(Fraction(float(c)), x.dtype, "down")


def within(x: Array, lo: float, hi: float) -> Array:
    """`lo <= x <= hi` for exact `lo`, `hi` (as `ge` and `le`), written
    `clip(x, ...) == x`: two operations, and where `lo` and `hi` are numbers of
    `x`'s dtype the clip is the one a quantiser's value takes outside the range, so
    XLA computes it once."""
    a = round_to(Fraction(float(lo)), x.dtype, "up")
    b = round_to(Fraction(float(hi)), x.dtype, "down")
    return jnp.clip(x, a, b) == x
