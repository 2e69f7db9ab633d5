r"""The three paths of an exact grid (see `_exact`), the first that holds for the
grid, decided when traced. Each gives the index nearest the exact input, ties to
the even index, and its exact level rounded once to the output dtype.

- **dyadic** (`dyadic`): a step $2^e$ and $\mathrm{lo}/2^e$ an even integer. The
  formula users write, `round(clip(x) / 2^e) * 2^e`, is then exact.
- **formula** (`formula`, float32): no table, no gather. The index is estimated
  with one multiply-add and corrected by one comparison with the threshold of its
  bucket; the threshold and the level are written as float32 pairs, evaluated with
  a few multiply-adds. The constants are *verified* when traced against the exact
  tables of `_exact`, for every threshold and every level, with each multiply-add
  rounded separately and fused (XLA may do either); a grid that fails takes the
  table.
- **table** (`_exact.grid_index`): the thresholds and levels as constant tables,
  read by a gather, slow on CPUs and TPUs.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._elementwise import wide
from ._exact import (
    _exponent,
    _fractions,
    _lookup,
    _thresholds,
    estimate_bound,
    grid,
    grid_index,
    is_exactly,
    round_to,
)


class Dyadic(NamedTuple):
    """A grid of step $2^e$ whose `lo` is an even number of steps."""

    lo: float
    hi: float
    inverse: float  # 2^-e
    step: float  # 2^e


def dyadic(bits: int, lo: float, hi: float, compute: Any) -> Dyadic | None:
    r"""The grid's dyadic path, if it has one: `round(clip(x, lo, hi)·2^-e)·2^e` is
    exact when the step is $2^e$ (with $2^{\pm e}$ normal in `compute`), `lo` and
    `hi` are numbers of `compute`, and `lo/2^e` is an even integer $m$. Then
    `x·2^-e` is exact (or flushes to 0 where it is below 1/2 anyway), `round`
    gives the integer $i$ nearest it, halves to even, the index $i - m$ has $i$'s
    parity (ties go to the even index), and $i·2^e$ is the exact level."""
    n, flo, fhi, step = _fractions(bits, lo, hi)
    e = _exponent(step)
    m = flo / step
    fi = jnp.finfo(compute)
    if (
        step != Fraction(2) ** e
        or m.denominator != 1
        or m.numerator % 2
        or abs(e) > -int(fi.minexp)
        or max(abs(m), abs(m + n)) >= 2 ** (int(fi.nmant) + 1)
        or any(Fraction(round_to(v, compute)) != v for v in (flo, fhi))
    ):
        return None
    return Dyadic(float(flo), float(fhi), float(1 / step), float(step))


class Formula(NamedTuple):
    """The constants of a grid's gather-free path in float32 (see `formula`). A
    number written as a pair is `hi + lo`, `hi` on a coarse grid of powers of two
    so that its products with the small integers met here are exact."""

    scale: np.float32
    offset: np.float32  # the index estimate is shifted by `anchor`
    step_hi: np.float32
    step_lo: np.float32
    threshold_hi: np.float32  # the anchor's threshold
    threshold_lo: np.float32
    level_hi: np.float32  # the level at index `u0`
    level_lo: np.float32
    anchor: int  # the threshold index at bucket t = 0
    u0: float  # the level coordinate's origin, an index or a half
    tie: str  # where an input on a threshold goes: "down", "up", or "even"
    lowest: np.float32  # the end levels, as rounded to the output dtype
    highest: np.float32


def _pair(m: Array, hi: np.float32, lo: np.float32) -> Array:
    # `+ 0` is left out: XLA drops it, and the verification models what runs.
    return m * hi + lo if lo else m * hi


def formula_value(w: Array, f: Formula) -> tuple[Array, Array]:
    """For float32 `w` in `[lo, hi]`: the bucket `t` (`floor` of the index estimate,
    shifted to the anchor), whether `w` is past the bucket's threshold
    `T = t·step + T_a` (`w - (t·step_hi + T_a,hi)` against `t·step_lo + T_a,lo`:
    monotone in `w`), and so the index; returns it (a float) and its level
    `(index - u0)·step + L_{u0}`, the pairs evaluated with multiply-adds."""
    t = jnp.floor(w * f.scale + f.offset)
    d = w - _pair(t, f.step_hi, f.threshold_hi)
    r = _pair(t, f.step_lo, f.threshold_lo)
    if f.tie == "even":  # past at a tie where the tie's index is odd
        half = t * np.float32(0.5) + np.float32(f.anchor / 2)
        past = jnp.where(jnp.floor(half) == half, d > r, d >= r)
    else:
        past = d > r if f.tie == "down" else d >= r
    below = f.anchor - f.u0
    u = t + jnp.where(past, np.float32(below + 1), np.float32(below))
    index = t + jnp.where(past, np.float32(f.anchor + 1), np.float32(f.anchor))
    return index, formula_level(u, f)


def formula_level(u: Array, f: Formula) -> Array:
    """The level of index `u + u0` (`u` an integer-valued float32), the exact level
    rounded once to the output dtype when cast to it (`proved` for every index)."""
    return _pair(u, f.step_hi, f.level_hi) + _pair(u, f.step_lo, f.level_lo)


def _add32(a: np.ndarray, b: Any) -> np.ndarray:
    """`a + b` rounded once to float32, for float64 `a`, `b` holding exact values:
    the float64 sum rounded to odd (its error is exact by TwoSum), then to float32,
    is the sum rounded once (float64 has more than 2 extra bits; Boldo and
    Melquiond, 2008)."""
    s = a + b
    v = s - a
    err = (a - (s - v)) + (b - v)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.copysign(np.inf, err)), s)
    return s.astype(np.float32)


def _normal(*arrays: Any) -> bool:
    """Finite, and zero or normal in float32: XLA may flush a subnormal, which the
    NumPy model keeps."""
    tiny = np.finfo(np.float32).tiny
    return all(
        np.isfinite(a).all() and not ((a != 0) & (np.abs(a) < tiny)).any()
        for a in map(np.asarray, arrays)
    )


def _models(m: np.ndarray, hi: np.float32, lo: np.float32) -> list[np.ndarray]:
    """Every float32 value `_pair(m, hi, lo)` can take for integer-valued `m` (the
    float64 product is exact): the multiply and the add rounded each, or fused."""
    product = m * np.float64(hi)
    plain = product.astype(np.float32)
    if not lo:
        return [plain]
    return [_add32(plain.astype(np.float64), lo), _add32(product, lo)]


def _sums(m: np.ndarray, a: tuple, b: tuple) -> list[np.ndarray]:
    """Every float32 value `_pair(m, *a) + _pair(m, *b)` can take: a pair that is a
    bare product (its `lo` is 0) may also be fused into the sum."""
    xs, ys = _models(m, *a), _models(m, *b)
    out = [_add32(x.astype(np.float64), y.astype(np.float64)) for x in xs for y in ys]
    if not a[1]:
        out += [_add32(m * np.float64(a[0]), y.astype(np.float64)) for y in ys]
    if not b[1]:
        out += [_add32(x.astype(np.float64), m * np.float64(b[0])) for x in xs]
    return out


def _after(v: np.ndarray) -> np.ndarray:
    """The next float32 above each `v` that is zero or normal."""
    tiny = np.finfo(np.float32).tiny
    a = np.nextafter(v, np.float32(np.inf))
    a = np.where((a > 0) & (a < tiny), tiny, a)
    return np.where((a < 0) & (a > -tiny), 0, a).astype(np.float32)


def _f32(v: Fraction) -> np.float32:
    return np.float32(round_to(v, jnp.float32))


def _split(v: Fraction, q: Fraction) -> tuple[np.float32, np.float32]:
    """`v` as a pair: the multiple of `q` nearest it, and the rest rounded."""
    hi = round(v / q) * q
    return _f32(hi), _f32(v - hi)


def proved(f: Formula, bits: int, lo: float, hi: float, out: Any) -> bool:
    r"""Whether `formula_value(w, f)` is the exact level, rounded to `out`, for every
    float32 `w` in `[lo, hi]` (subnormals may act as zero).

    The estimate, shifted by `f.anchor`, is within 1/2 of the exact index
    (`estimate_bound`), so for `t = floor(estimate)` the exact index is
    $j = t + $ `f.anchor` or $j + 1$: past $T_j$ or not. Whether `w` is past is
    monotone in `w` (`w - N_t` is rounded monotonically, `R_t` depends on `t`
    only), so it is right for every `w` if it is not past at the last float32 not
    past $T_j$ (`thresholds[j]` of the exact table, where a tie goes down for an
    even $j$, up for an odd one) and past at the next; buckets -1 and $n$ hold only
    inputs in `[lo, hi]`: past at the least float32 >= lo, not past at the
    greatest <= hi. And for every index the value, rounded to `out`, must be
    `levels[k]` of the exact table. Each is checked in NumPy for every model of
    the multiply-adds (rounded each or fused: LLVM may contract any multiply into
    the add that takes it), with no subnormal met (XLA may flush them)."""
    out = jnp.dtype(out)
    n, flo, fhi, _ = _fractions(bits, lo, hi)
    scale = n / (fhi - flo)
    estimate = (_f32(scale), _f32(-flo * scale - f.anchor))
    if (f.scale, f.offset) != estimate or estimate_bound(
        bits, lo, hi, jnp.float32, f.anchor
    ) >= Fraction(1, 2):
        return False
    g = grid(bits, lo, hi, jnp.float32, out)
    levels = np.asarray(g.levels)
    if (f.lowest, f.highest) != (levels[0], levels[-1]):
        return False
    t = np.arange(-1 - f.anchor, n + 1 - f.anchor, dtype=np.float64)
    u = np.arange(n + 1, dtype=np.float64) - f.u0
    # The check points: not past at `w` where `want` is False, past where it is
    # True; `at` is the bucket's position in `t`.
    inner = np.arange(1, n + 1)
    at = np.concatenate([inner, inner, [0, n + 1]])
    ends = [round_to(flo, jnp.float32, "up"), round_to(fhi, jnp.float32, "down")]
    w = np.concatenate([g.thresholds, _after(g.thresholds), ends]).astype(np.float32)
    want = np.concatenate([np.zeros(n, bool), np.ones(n, bool), [True, False]])
    strict = (at % 2 == 1) if f.tie == "even" else np.full(at.shape, f.tie == "down")
    big, small = (
        _models(t, f.step_hi, f.threshold_hi),
        _models(t, f.step_lo, f.threshold_lo),
    )
    ds = [w - b[at] for b in big]
    if not f.threshold_hi:  # `w - t·step_hi`, fused
        ds.append(_add32(w.astype(np.float64), -t[at] * np.float64(f.step_hi)))
    values = _sums(u, (f.step_hi, f.level_hi), (f.step_lo, f.level_lo))
    products = [
        (m * np.float64(c)).astype(np.float32)
        for m in (t, u)
        for c in (f.step_hi, f.step_lo)
    ]
    magnitude = np.abs(levels.astype(np.float32))
    if ((magnitude != 0) & (magnitude < jnp.finfo(out).tiny)).any() or not _normal(
        *f[:8], *big, *small, *ds, *values, *products
    ):
        return False
    for d in ds:
        for r in small:
            if not (np.where(strict, d > r[at], d >= r[at]) == want).all():
                return False
    return all(v.astype(out).tobytes() == levels.tobytes() for v in values)


@functools.lru_cache(maxsize=256)
def formula(bits: int, lo: float, hi: float, out: Any) -> Formula | None:
    r"""The float32 gather-free path of a grid, `proved`, or None.

    The anchor is the threshold nearest 0, or the tie nearest it (a threshold a
    float32 holds, such as 0 or 1/2 in the middle), and an input on a tie goes to
    the even index: `>` if the tie's index is even, `>=` if odd, per bucket if the
    grid has several ties. The step, the anchor's threshold and the level $L_{u_0}$
    nearest 0 ($u_0$ an index or a half) are pairs whose `hi` lie on a grid of
    $q$, a power of two, coarse enough that their products with the integers met
    are exact in float32 (so that rounding, fused or not, leaves them alone); the
    finest $q$ whose formula is proved is taken."""
    n, flo, fhi, step = _fractions(bits, lo, hi)
    g = grid(bits, lo, hi, jnp.float32, out)
    ts = _thresholds(bits, lo, hi)
    past = _after(g.thresholds)
    ties = [
        j
        for j, t in enumerate(ts)
        if is_exactly(g.thresholds[j] if j % 2 == 0 else past[j], t)
    ]
    z = -flo / step  # the index of 0
    nearest = min(max(round(z - Fraction(1, 2)), 0), n - 1)
    anchor = min(ties, key=lambda j: abs(j - nearest)) if ties else nearest
    tie = "even" if len(ties) > 1 else "up" if ties and anchor % 2 else "down"
    u0 = min(max(Fraction(round(2 * z), 2), Fraction(0)), Fraction(n))
    reach = max(anchor + 1, n + 1 - anchor, u0, n - u0)
    largest = max(abs(flo), abs(fhi), reach * step) + step
    scale = n / (fhi - flo)
    for coarser in range(3):
        q = Fraction(2) ** (_exponent(largest) - 23 + coarser)
        f = Formula(
            _f32(scale),
            _f32(-flo * scale - anchor),
            *_split(step, q),
            *_split(Fraction(*ts[anchor]), q),
            *_split(flo + u0 * step, q),
            anchor,
            float(u0),
            tie,
            np.float32(g.levels[0]),
            np.float32(g.levels[-1]),
        )
        if proved(f, bits, lo, hi, out):
            return f
    return None


@functools.lru_cache(maxsize=256)
def plan(
    bits: int, lo: float, hi: float, compute: Any, out: Any
) -> Dyadic | Formula | None:
    """The grid's fastest exact path: a `Dyadic`, a `Formula` (float32 only), or
    `None` for the table."""
    d = dyadic(bits, lo, hi, compute)
    if d is not None:
        return d
    return formula(bits, lo, hi, out) if jnp.dtype(compute) == jnp.float32 else None


def quantize(x: Array, bits: int, lo: float, hi: float, inside: Array) -> Array:
    """`2**bits` levels from `lo` to `hi`, exactly, by the grid's fastest path (see
    the module's docstring). `inside` is `[lo <= x <= hi]`: the value selects with
    it (the end levels outside), so XLA computes it once, in the forward pass, and
    keeps that boolean for the backward pass (which masks with it) instead of
    keeping `x` alive to compute it again."""
    n = 2**bits - 1
    w = x.astype(wide(x.dtype))
    lo, hi = float(lo), float(hi)
    path = plan(bits, lo, hi, w.dtype, x.dtype)
    if isinstance(path, Dyadic):
        clipped = jnp.clip(w, path.lo, path.hi)
        value = jnp.round(clipped * path.inverse) * path.step
    elif isinstance(path, Formula):
        clipped = jnp.clip(w, path.lowest, path.highest)
        value = formula_value(w, path)[1]
    else:
        g = grid(bits, lo, hi, w.dtype, x.dtype)
        assert g.bound < Fraction(1, 2), (bits, lo, hi)
        level = _lookup(g.levels, grid_index(w, g, n))
        return jnp.where(inside | (x == x), level, x)
    return jnp.where(inside, value, clipped).astype(x.dtype)
