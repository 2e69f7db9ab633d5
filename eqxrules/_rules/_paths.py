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
    estimate_bound,
    grid,
    grid_index,
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
    return index, _pair(u, f.step_hi, f.level_hi) + _pair(u, f.step_lo, f.level_lo)


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


def _models(
    m: np.ndarray, hi: np.float32, lo: np.float32
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The rounded product `m·hi`, and every float32 value `_pair(m, hi, lo)` can
    take for integer-valued `m` (the float64 products are exact): the multiply and
    the add rounded each, or fused."""
    product = m * np.float64(hi)
    plain = product.astype(np.float32)
    if not lo:
        return plain, [plain]
    return plain, [_add32(plain.astype(np.float64), lo), _add32(product, lo)]


def _exact(m: np.ndarray, hi: np.float32, lo: np.float32, q: Fraction) -> Any:
    """`_pair(m, hi, lo)` if a float32 holds it exactly for every `m`, else None.
    With `hi`, `lo` multiples of `q` and `m` integers (or halves), it is a whole
    number of `q`s (or of `q/2`s), held if there are fewer than 2^24 of them."""
    halves = 1 if (m == np.floor(m)).all() else 2
    whole = [Fraction(float(c)) / q for c in (hi, lo)]
    if any(c.denominator != 1 for c in whole):
        return None
    units = (halves * m).astype(np.int64) * int(whole[0]) + halves * int(whole[1])
    if np.abs(units).max() >= 2**24:
        return None
    return (units * float(q / halves)).astype(np.float32)


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


@functools.lru_cache(maxsize=256)
def formula(bits: int, lo: float, hi: float, out: Any) -> Formula | None:
    r"""The float32 gather-free path of a grid, with its proof, or None.

    Construction: the estimate of the index, shifted by an anchor $j_a$, is within
    1/2 of the exact index (`estimate_bound`), so for `t = floor(estimate)` the
    exact index is $j_a + t$ or one more: past $T_{j_a + t}$ or not. The anchor is
    the threshold nearest 0, or the tie nearest it (a threshold a float32 holds,
    such as 0 or 1/2 in the middle), and an input on a tie goes to the even index:
    `>` if the tie's index is even, `>=` if odd, per bucket if the grid has several
    ties. The step, $T_{j_a}$ and the level $L_{u_0}$ nearest 0 ($u_0$ an index or
    a half) are pairs whose `hi` lie on a grid of $q$, a power of two, coarse
    enough that every product with the `t` and `u` met is exact in float32.

    Proof, for every bucket $j = -1, \dots, n$: whether `w` is past is monotone
    in `w` (`w - N_t` is rounded monotonically, `R_t` depends on `t` only), so it
    is right for every float32 `w` if it is not past at the last float32 not past
    $T_j$ (`thresholds[j]` of the exact table) and past at the next one; the end
    buckets hold only inputs in `[lo, hi]`: past at the least float32 >= lo for
    bucket -1, not past at the greatest <= hi for bucket n. And for every index,
    the value rounded to `out` is `levels[k]` of the exact table. Each is checked
    in NumPy for every model of the multiply-adds (rounded each or fused: LLVM may
    contract them), with no subnormal met (XLA may flush them); a grid whose
    checks fail gets None. The estimate, and float32 compares and floors, are
    exact or bounded whatever XLA fuses."""
    out = jnp.dtype(out)
    n, flo, fhi, step = _fractions(bits, lo, hi)
    g = grid(bits, lo, hi, jnp.float32, out)
    ts = [flo + (j + Fraction(1, 2)) * step for j in range(n)]
    past = _after(g.thresholds)
    ties = [
        j
        for j, v in enumerate(ts)
        if Fraction(float(g.thresholds[j] if j % 2 == 0 else past[j])) == v
    ]
    z = -flo / step  # the index of 0
    nearest = min(max(round(z - Fraction(1, 2)), 0), n - 1)
    anchor = min(ties, key=lambda j: abs(j - nearest)) if ties else nearest
    tie = "even" if len(ties) > 1 else "up" if anchor % 2 and ties else "down"
    u0 = min(max(Fraction(round(2 * z), 2), Fraction(0)), Fraction(n))
    if estimate_bound(bits, lo, hi, jnp.float32, anchor) >= Fraction(1, 2):
        return None
    t = np.arange(-1 - anchor, n + 1 - anchor, dtype=np.float64)
    u = np.arange(n + 1, dtype=np.float64) - float(u0)
    reach = Fraction(float(max(-t[0], t[-1], -u[0], u[-1])))
    largest = max(abs(flo), abs(fhi), reach * step) + step
    for coarser in range(3):  # the finest q whose products are exact
        q = Fraction(2) ** (_exponent(largest) - 23 + coarser)
        sh, sl = _split(step, q)
        th, tl = _split(ts[anchor], q)
        lh, ll = _split(flo + u0 * step, q)
        big, p = _exact(t, sh, th, q), _exact(u, sh, lh, q)
        if big is not None and p is not None:
            break
    else:
        return None
    r_product, r = _models(t, sl, tl)
    small_product, small = _models(u, sl, ll)
    p64 = p.astype(np.float64)
    values = [_add32(p64, v.astype(np.float64)) for v in small]
    if not ll:  # LLVM may contract `u·step_lo` into the final add
        values.append(_add32(p64, u * np.float64(sl)))
    # Each bucket's check points: not past at `w` where `want` is False, past where
    # it is True (`at` is the bucket's position in `t`).
    inner = np.arange(1, n + 1)
    at = np.concatenate([inner, inner, [0, n + 1]])
    ends = [round_to(flo, jnp.float32, "up"), round_to(fhi, jnp.float32, "down")]
    w = np.concatenate([g.thresholds, past, ends]).astype(np.float32)
    want = np.concatenate([np.zeros(n, bool), np.ones(n, bool), [True, False]])
    d = w - big[at]
    strict = (at % 2 == 1) if tie == "even" else np.full(at.shape, tie == "down")
    levels = np.asarray(g.levels)
    magnitude = np.abs(levels.astype(np.float32))
    if ((magnitude != 0) & (magnitude < jnp.finfo(out).tiny)).any() or not _normal(
        sh, sl, th, tl, lh, ll, big, p, d, r_product, small_product, *r, *small, *values
    ):
        return None
    for rt in r:
        if not (np.where(strict, d > rt[at], d >= rt[at]) == want).all():
            return None
    if any(v.astype(out).tobytes() != levels.tobytes() for v in values):
        return None
    return Formula(
        _f32(n / (fhi - flo)),
        _f32(-flo * n / (fhi - flo) - anchor),
        sh,
        sl,
        th,
        tl,
        lh,
        ll,
        anchor,
        float(u0),
        tie,
        np.float32(levels[0]),
        np.float32(levels[-1]),
    )


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
