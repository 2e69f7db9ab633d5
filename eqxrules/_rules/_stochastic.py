r"""Stochastic rounding onto the exact uniform grids of `_exact` and `_paths`.

An input $x$ in $[\mathrm{lo}, \mathrm{hi}]$ goes to one of the two levels around
it, $L \le x \le U$ (exact rationals, each rounded once to the output dtype), to $U$
with probability $(x - L)/(U - L)$, for the exact $x$ and the exact levels, within
a bound proved for the grid when traced. How:

1. The path's nearest index $k$ (`_paths`; exact, ties to even) and its level.
2. $g = (x - L_k)/s$, the signed distance from it in steps $s$
   ($\lvert g \rvert \le 1/2$), computed to within $A + \rho \lvert g \rvert$
   (`residual`, `Tiers`): the level is a sum of *tiers* $u S_i + \Lambda_i$, with
   $u = k - o$ (an integer, $\lvert u \rvert \le$ `reach`, $o$ the middle index)
   and $S_i$, $\Lambda_i$ on ever finer grids of powers of two, each coarse enough
   that its tier is exact; only the last tier is rounded. $x - (u S_0 +
   \Lambda_0)$ is split exactly (TwoSum), the other tiers are subtracted in turn,
   then the TwoSum's error is added back and the sum scaled by $n/(\mathrm{hi} -
   \mathrm{lo})$. Each rounding is bounded (`_bound`), with `Fraction`s, from the
   grid's constants: a proof for every input of the grid, made when traced.
3. `stochastic_move`: the input steps from $L_k$ to the neighbour on the side of
   $g$ with probability within $2^{-25}$ of $\lvert g \rvert$ (24 random bits), and
   never within $2^{-25}$ of a step from $L_k$. Where $A \le 2^{-25}$ (required),
   a rounded $g$ of the wrong sign is within that, so the input never steps to a
   level that is not its neighbour. The probability of $U$ is then within
   $2^{-25} + A + \rho/2$ of $(x - L)/(U - L)$, the bias `Tiers.bias` (required
   below $2^{-22}$; about $2^{-23}$ in float32, $2^{-25}$ on a dyadic grid).

An input equal to a level's value in its own dtype (the level rounded once) is that
level with probability 1, though the exact level may differ from it.
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
    _integers,
    _lookup,
    ge,
    grid,
    grid_index,
    le,
    reference_index,
    reference_levels,
    round_ratio,
    round_to,
)
from ._formats import RESOLUTION, stochastic_move
from ._paths import Dyadic, Formula, formula_level, formula_value, plan

BIAS = Fraction(1, 2**22)
"""The bias every grid's stochastic rounding must be proved below: `Tiers.bias`, in
steps."""
_MAX_TIERS = 6


class Tiers(NamedTuple):
    r"""The constants of `residual` for one grid and compute dtype, and what they
    prove: $\lvert \tilde g - g \rvert \le$ `absolute` $+$ `relative`
    $\cdot \lvert g \rvert$ for every input in $[\mathrm{lo}, \mathrm{hi}]$
    with its exact nearest index (subnormal inputs may act as zero)."""

    origin: int  # u = k - origin
    exact: tuple[tuple[Any, Any], ...]  # (S_i, Λ_i): u·S_i + Λ_i exact for |u| <= reach
    last: tuple[Any, Any]  # the rest, rounded: u·S + Λ rounds
    scale: Any  # n / (hi - lo), rounded
    absolute: Fraction
    relative: Fraction

    @property
    def bias(self) -> Fraction:
        r"""The bound on $\lvert P(U) - (x - L)/(U - L) \rvert$ at the shipped
        resolution: the rule's $2^{-25}$, plus the error of $g$ at
        $\lvert g \rvert \le 1/2$."""
        return Fraction(1, 2 ** (RESOLUTION + 1)) + self.absolute + self.relative / 2


def _bound(
    step: Fraction,
    scale: Fraction,
    reach: int,
    tiers: list[tuple[Fraction, Fraction]],
    rest: tuple[Fraction, Fraction],
    last: tuple[Fraction, Fraction],
    compute: Any,
) -> tuple[Fraction, Fraction]:
    r"""`(absolute, relative)` for `residual` with these constants: every operation
    rounded to nearest (a multiply-add rounded once where fused, which the bounds
    cover), and any result that could be subnormal flushed to zero (`flush` for
    each). Magnitudes and errors are linear in $\lvert r \rvert$, $r = x - L_k$,
    $\lvert r \rvert \le s/2$, written `(c, k)` for $c + k \lvert r \rvert$.
    `rest` is the exact remainder of the level after the exact tiers, `last` its
    rounded tier."""
    fi = jnp.finfo(compute)
    ur = Fraction(1, 2 ** (int(fi.nmant) + 1))
    flush = Fraction(float(fi.tiny))
    mags = [reach * abs(s) + abs(v) for s, v in tiers]  # bound on |u·S + Λ|
    remainder = reach * abs(rest[0]) + abs(rest[1])
    last_error = (  # |(u·S + Λ rounded) - the exact rest|
        reach * abs(rest[0] - last[0])
        + abs(rest[1] - last[1])
        + ur * reach * abs(last[0]) * (2 + ur)
        + ur * abs(last[1])
        + 2 * flush
    )
    # Tier i's TwoSum: a_i + e_i = a_(i-1) - K_i exactly, where that is
    # r + (the later tiers and the rest) - (the errors so far, b's); |e_i| <= ur|a_i|.
    errors = (Fraction(0), Fraction(0))  # |exact sum of b_0 and the e_i|
    drift = Fraction(0)  # what rounding b += e_i and flushing add to b
    for i in range(len(tiers)):
        later = sum(mags[i + 1 :]) + remainder
        a = ((later + errors[0]) * (1 + ur), (1 + errors[1]) * (1 + ur))
        errors = (errors[0] + ur * a[0], errors[1] + ur * a[1])
        if i:
            drift += ur * (errors[0] + errors[1] * step / 2 + drift) + flush
        drift += 4 * flush  # the TwoSum's own steps and its error, flushed
    # t = fl(a_m - K_last), a_m - K_last = r + (rest - K_last) - errors.
    t_error = ur * (last_error + errors[0]) + flush
    t_k = ur * (1 + errors[1])
    # r~ = fl(t + b) = r + (rest - K_last) + t's error + drift.
    c = last_error + t_error + drift
    k = t_k
    c, k = c + ur * c + flush, k + ur * (1 + k)
    # g~ = fl(r~·scale~): |g~ - g| <= scale~(1 + ur)|r~ - r| + |r|(|scale~ - c| + ur·scale~)
    rounded = Fraction(round_to(scale, compute))
    absolute = rounded * (1 + ur) * c + flush
    relative = (rounded * (1 + ur) * k + abs(rounded - scale) + ur * rounded) / scale
    return absolute, relative


def _unit(v: Fraction) -> Fraction:
    """The largest power of two of which the dyadic `v` is a multiple (`v` > 0)."""
    return Fraction(v.numerator & -v.numerator, v.denominator)


def proof(
    origin: int,
    exact: Any,
    last: Any,
    scale: Any,
    bits: int,
    lo: float,
    hi: float,
    compute: Any,
) -> tuple[Fraction, Fraction] | None:
    r"""`(absolute, relative)` for `residual` with these constants (numbers of
        `compute`), or `None` if a tier said exact is not. Tier `(S, Λ)` is exact if
        both are multiples of a power of two $q$, not below the smallest normal number,
        with $\mathrm{reach} \lvert S
    vert + \lvert \Lambda
    vert < 2^p q$ ($p$ the
        precision): then $u S$ and $u S + \Lambda$ are multiples of $q$ below $2^p q$
        for every integer $\lvert u
    vert \le$ `reach`, so exact and normal, fused or
        not. `scale` must be $n/(\mathrm{hi} - \mathrm{lo})$ rounded to nearest. The
        rest of the level after the exact tiers is computed exactly, and `last`'s
        distance from it is part of the bound (`_bound`)."""
    compute = jnp.dtype(compute)
    fi = jnp.finfo(compute)
    p = int(fi.nmant) + 1
    n, flo, fhi, step = _fractions(bits, lo, hi)
    reach = max(origin, n - origin)
    tiers = [(Fraction(float(s)), Fraction(float(v))) for s, v in exact]
    rest = (step, flo + origin * step)
    for s, v in tiers:
        nonzero = [abs(c) for c in (s, v) if c]
        q = min(map(_unit, nonzero)) if nonzero else Fraction(float(fi.tiny))
        if q < Fraction(float(fi.tiny)) or reach * abs(s) + abs(v) >= 2**p * q:
            return None
        rest = (rest[0] - s, rest[1] - v)
    exact_scale = n / (fhi - flo)
    if not tiers or Fraction(float(scale)) != Fraction(round_to(exact_scale, compute)):
        return None
    rounded = (Fraction(float(last[0])), Fraction(float(last[1])))
    return _bound(step, exact_scale, reach, tiers, rest, rounded, compute)


@functools.lru_cache(maxsize=256)
def tiers(bits: int, lo: float, hi: float, compute: Any) -> Tiers | None:
    r"""The grid's `Tiers` in `compute`, `proof`-checked, or `None` if they prove
    no bias below `BIAS` with $A \le 2^{-25}$ (grids whose levels near float32's
    underflow). Tiers are added, each on the finest grid of powers of two that
    leaves it exact, until the rest is within $s/16$ over the grid."""
    compute = jnp.dtype(compute)
    fi = jnp.finfo(compute)
    p = int(fi.nmant) + 1
    n, flo, fhi, step = _fractions(bits, lo, hi)
    origin = n // 2
    reach = max(origin, n - origin)
    rest = (step, flo + origin * step)
    exact: list[tuple[Fraction, Fraction]] = []
    while reach * abs(rest[0]) + abs(rest[1]) > step / 16:
        if len(exact) == _MAX_TIERS:
            return None
        q = Fraction(2) ** (_exponent(reach * abs(rest[0]) + abs(rest[1])) + 1 - p)
        while True:
            s, v = (round(r / q) * q for r in rest)
            if reach * abs(s) + abs(v) < 2**p * q:
                break
            q *= 2
        exact.append((s, v))
        rest = (rest[0] - s, rest[1] - v)
    kind = np.dtype(compute).type
    constants = (
        origin,
        tuple((kind(float(s)), kind(float(v))) for s, v in exact),
        tuple(kind(round_to(r, compute)) for r in rest),
        kind(round_to(n / (fhi - flo), compute)),
    )
    bound = proof(*constants, bits, lo, hi, compute)
    if bound is None:
        return None
    t = Tiers(*constants, *bound)  # pyright: ignore[reportArgumentType]
    if t.absolute > Fraction(1, 2 ** (RESOLUTION + 1)) or t.bias >= BIAS:
        return None
    return t


def stochastic_ready(bits: int, lo: float, hi: float) -> bool:
    """Whether the grid's stochastic rounding is proved in float32 (the compute
    dtype of every input but float64): a dyadic grid, or `Tiers`."""
    lo, hi = float(lo), float(hi)
    dyadic = isinstance(plan(bits, lo, hi, jnp.float32, jnp.float32), Dyadic)
    return dyadic or tiers(bits, lo, hi, jnp.float32) is not None


def _two_sum(a: Array, b: Array) -> tuple[Array, Array]:
    """`(s, e)` with `s = fl(a + b)` and `s + e = a + b` exactly (Knuth)."""
    s = a + b
    back = s - a
    return s, (a - (s - back)) + (b - back)


def residual(w: Array, index: Array, t: Tiers) -> Array:
    r"""$\tilde g \approx (w - L_k)/s$ for the nearest index $k$ = `index` (an
    integer-valued float of `w`'s dtype), within the bound of `t`: the exact tiers
    subtracted exactly (TwoSum; their errors summed apart, being tiny), the last
    rounded, then the errors added back."""
    u = index - t.origin
    (s0, v0), *others = t.exact
    a, b = _two_sum(w, -(u * s0 + v0))
    for s, v in others:
        a, e = _two_sum(a, -(u * s + v))
        b = b + e
    s, v = t.last
    return ((a - (u * s + v)) + b) * t.scale


def stochastic_quantize(
    x: Array,
    bits: int,
    lo: float,
    hi: float,
    inside: Array,
    random: Array,
    resolution: int = RESOLUTION,
) -> Array:
    """`2**bits` levels from `lo` to `hi`, rounded stochastically with the uint32
    `random` (one per element of `x`), by the grid's path (see the module's
    docstring); `inside` is `[lo <= x <= hi]`: outside, the end levels. A
    `resolution` other than `RESOLUTION` is for tests that enumerate every `j`."""
    n = 2**bits - 1
    w = x.astype(wide(x.dtype))
    lo, hi = float(lo), float(hi)
    path = plan(bits, lo, hi, w.dtype, x.dtype)
    if isinstance(path, Dyadic):
        clipped = jnp.clip(w, path.lo, path.hi)
        v = clipped * path.inverse
        index = jnp.round(v)
        g = v - index  # exact (Sterbenz): no tiers
        ends = (path.lo * path.inverse, path.hi * path.inverse)
        step = path.step

        def level(k: Array) -> Array:
            return k * step

        stay = level(index)
    else:
        t = tiers(bits, lo, hi, w.dtype)
        assert t is not None, (bits, lo, hi, w.dtype)
        ends = (0, n)
        if isinstance(path, Formula):
            f = path
            clipped = jnp.clip(w, f.lowest, f.highest)
            index, stay = formula_value(w, f)

            def level(k: Array) -> Array:
                return formula_level(k - f.u0, f)

        else:
            table = grid(bits, lo, hi, w.dtype, x.dtype)
            assert table.bound < Fraction(1, 2), (bits, lo, hi)
            clipped = jnp.clip(w, table.levels[0], table.levels[-1])
            index = grid_index(w, table, n).astype(w.dtype)

            def level(k: Array) -> Array:
                return _lookup(table.levels, k.astype(jnp.int32))

            stay = level(index)

        g = residual(w, index, t)
    stay = stay.astype(x.dtype)
    other = level(jnp.clip(index + jnp.where(g < 0, -1, 1), *ends)).astype(x.dtype)
    q = choose(x, stay, other, stochastic_move(g, random, resolution))
    return jnp.where(inside, q, clipped.astype(x.dtype))


def choose(x: Array, stay: Array, other: Array, move: Array) -> Array:
    """`other` where `move`, else `stay` (levels in `x`'s dtype), but an input equal
    to either of them is that level: a level stays."""
    q = jnp.where(move, other, stay)
    return jnp.where(x == other, other, jnp.where(x == stay, stay, q))


@functools.lru_cache(maxsize=64)
def _level_table(bits: int, lo: float, hi: float, dtype: Any, parts: int) -> np.ndarray:
    """`parts` rows: each exact level as a sum of `parts` numbers of `dtype`, each
    the rest rounded to nearest (shape `(parts, n + 1)`)."""
    n, a, s, d = _integers(bits, lo, hi)
    rows = []
    rest = [(a + i * s, d) for i in range(n + 1)]  # integer ratios
    for _ in range(parts):
        row = [round_ratio(*v, dtype) for v in rest]
        rest = [_minus(v, r) for v, r in zip(rest, row)]
        rows.append(row)
    return np.asarray(rows, dtype)


def _minus(v: tuple[int, int], r: float) -> tuple[int, int]:
    """The integer ratio `v` less the float `r`, exactly."""
    num, den = r.as_integer_ratio()
    return v[0] * den - num * v[1], v[1] * den


def reference_stochastic_quantize(
    x: Array, bits: int, lo: float, hi: float, random: Array
) -> Array:
    r"""Independently of `stochastic_quantize`: the nearest index by binary search
    (`reference_index`), the level as three numbers of the compute dtype read from
    a table, $g$ = `(((x - A) - B) - C) / s` with the first difference split by
    TwoSum (a true division by the step, rounded), then the documented rule: the
    top 25 bits with the last set, $2j + 1$, below $2^{25} \lvert g \rvert$. The
    values are the levels rounded once (`reference_levels`); an input equal to one
    of the two is it; beyond the range the end levels; NaN stays NaN."""
    n = 2**bits - 1
    w = x.astype(wide(x.dtype))
    k = reference_index(w, bits, lo, hi)
    parts = jnp.asarray(_level_table(bits, lo, hi, w.dtype, 3))
    a = w - parts[0][k]
    back = a - w
    error = (w - (a - back)) + (-parts[0][k] - back)
    _, _, _, step = _fractions(bits, lo, hi)
    g = (((a - parts[1][k]) - parts[2][k]) + error) / jnp.where(
        jnp.isnan(w), w, round_to(step, w.dtype)
    )
    scaled = jnp.ceil(jnp.minimum(jnp.abs(g) * 2.0**25, 2.0**25))
    move = ((random >> 7) | 1) < scaled.astype(jnp.uint32)
    levels = jnp.asarray(reference_levels(bits, lo, hi, x.dtype))
    stay, other = levels[k], levels[jnp.clip(jnp.where(g < 0, k - 1, k + 1), 0, n)]
    q = jnp.where(move, other, stay)
    q = jnp.where(x == other, other, jnp.where(x == stay, stay, q))
    inside = ge(w, lo) & le(w, hi)
    end = jnp.where(ge(w, lo), levels[-1], levels[0])
    return jnp.where(jnp.isnan(w), x, jnp.where(inside, q, end))


def reference_neighbours(
    x: Array, bits: int, lo: float, hi: float
) -> tuple[Array, Array]:
    r"""The two levels around each `x`, $L \le x \le U$ for the exact levels (found
    by binary search: $x \ge L_k$ iff $x \ge L_k$ rounded up), each rounded once
    to `x`'s dtype; both `x` where `x` is one of them; both the end level beyond
    the range; NaN for NaN."""
    n = 2**bits - 1
    w = x.astype(wide(x.dtype))
    _, flo, _, step = _fractions(bits, lo, hi)
    up = np.asarray([round_to(flo + i * step, w.dtype, "up") for i in range(n + 1)])
    count = jnp.searchsorted(jnp.asarray(up, w.dtype), w, side="right")  # #{L_k <= x}
    k = jnp.clip(count - 1, 0, n - 1)
    levels = jnp.asarray(reference_levels(bits, lo, hi, x.dtype))
    lower, upper = levels[k], levels[k + 1]
    level = (x == lower) | (x == upper)
    lower, upper = jnp.where(level, x, lower), jnp.where(level, x, upper)
    inside = ge(w, lo) & le(w, hi)
    end = jnp.where(ge(w, lo), levels[-1], levels[0])
    lower, upper = jnp.where(inside, lower, end), jnp.where(inside, upper, end)
    nan = jnp.isnan(w)
    return jnp.where(nan, x, lower), jnp.where(nan, x, upper)
