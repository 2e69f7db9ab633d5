r"""Exact uniform grids, built at trace time.

A static grid (`bits`, `lo`, `hi` are Python numbers) has exactly known levels
$L_k = \mathrm{lo} + k(\mathrm{hi} - \mathrm{lo})/n$ and decision thresholds
$T_j = (L_j + L_{j+1})/2$. They are computed here with `fractions.Fraction` and
rounded, exactly, into the dtype they are compared or returned in: small constant
tables. The table path (`grid_index`) estimates the level index in float32 (one
multiply-add), then corrects it by one comparison with a threshold read from the
table, so that it is the index nearest the exact input, ties to the even index, and
reads the value, the exact level rounded once to the output dtype. `_paths` has the
faster paths, and checks them against these tables.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._elementwise import wide

MAX_BITS = 16
_TINY = Fraction(1, 2**1100)  # below every quantum of every dtype up to float64


def _exponent(a: Fraction) -> int:
    """`floor(log2(a))` for `a > 0`, exactly."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    if Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


def round_to(v: Fraction, dtype: Any, mode: str = "nearest") -> float:
    """`v` rounded into `dtype`: `"nearest"` (ties to even, subnormals kept), or,
    for comparisons, `"down"` (towards -inf) or `"up"` into the normal numbers and
    zero. XLA flushes subnormals to zero on CPU and GPU (inputs and constants
    alike), so a comparison with a subnormal constant would not be the one
    written; over the normal numbers and zero, `x > c` is `x > c'` with `c'` the
    rounding down of `c` into them, and `x >= c` is `x >= c'` with the rounding up.
    The result is a Python float holding the rounded value exactly."""
    fi = jnp.finfo(dtype)
    if v == 0:
        return 0.0
    if mode != "nearest" and abs(v) < Fraction(float(fi.tiny)):
        tiny = float(fi.tiny)
        if v > 0:
            return tiny if mode == "up" else 0.0
        return 0.0 if mode == "up" else -tiny
    negative = v < 0
    a = -v if negative else v
    p = int(fi.nmant) + 1
    e = max(_exponent(a), int(fi.minexp))
    quantum = Fraction(2) ** (e - p + 1)
    m = a / quantum
    lower = m.numerator // m.denominator
    rem = m - lower
    if mode == "nearest":
        up = rem > Fraction(1, 2) or (rem == Fraction(1, 2) and lower % 2 == 1)
    else:  # directed: away from zero when rounding towards the side `v` is on
        up = rem > 0 and ((mode == "up") != negative)
    r = (lower + up) * quantum
    big = Fraction(float(fi.max))
    if r > big:
        toward_zero = mode != "nearest" and ((mode == "down") != negative)
        r_float = float(fi.max) if toward_zero else float("inf")
    else:
        r_float = float(r)
    return -r_float if negative else r_float


def below(v: Fraction, dtype: Any) -> float:
    """The largest normal number or zero of `dtype` strictly below `v`."""
    return round_to(v - _TINY, dtype, "down")


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


@functools.lru_cache(maxsize=256)
def grid(bits: int, lo: float, hi: float, compute: Any, out: Any) -> Grid:
    compute, out = jnp.dtype(compute), jnp.dtype(out)
    n, flo, _, step = _fractions(bits, lo, hi)
    s = 1 / step
    t = [flo + (j + Fraction(1, 2)) * step for j in range(n)]
    # x > T_j exactly iff x > round_down(T_j); at a tie (x == T_j, representable),
    # the even index wins: odd j compare with the value just below T_j (>=).
    thresholds = [
        round_to(v, compute, "down") if j % 2 == 0 else below(v, compute)
        for j, v in enumerate(t)
    ]
    levels = [round_to(flo + k * step, out) for k in range(n + 1)]
    return Grid(
        round_to(s, compute),
        round_to(-flo * s, compute),
        np.asarray(thresholds, compute),
        np.asarray(levels, out),
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
    n, flo, _, step = _fractions(bits, lo, hi)
    t = [flo + (j + Fraction(1, 2)) * step for j in range(n)]
    down = np.asarray([round_to(v, dtype, "down") for v in t], dtype)
    return down, np.asarray([Fraction(float(d)) == v for d, v in zip(down, t)])


@functools.lru_cache(maxsize=64)
def reference_levels(bits: int, lo: float, hi: float, dtype: Any) -> np.ndarray:
    """Every exact level rounded once to `dtype`, from `Fraction`s."""
    n, flo, _, step = _fractions(bits, lo, hi)
    return np.asarray([round_to(flo + i * step, dtype) for i in range(n + 1)], dtype)


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
