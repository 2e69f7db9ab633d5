"""Stochastic rounding onto the exact uniform grids (`ste_quantize`,
`dorefa_quantize`; issue 19 section 1), proven by counting bit patterns.

The rounding is `_stochastic.stochastic_quantize(x, bits, lo, hi, inside, random,
resolution)`: with $k$ the level nearest $x$ (ties to even) and $g = (x - L_k)/s$ its
signed distance from it in steps, $x$ steps to the neighbour on $g$'s side iff
$2j + 1 < 2^{R+1} \\lvert g \\rvert$ for the top $R$ bits $j$ of `random`. The truth
is computed here on the host: $k$ exactly (`test_exact_grid.exact_index`), $g$ in
float64 (its error is below $2^{-32}$ for $n < 2^{16}$: each of its four operations
rounds by at most $2^{-53}$ of a magnitude below $2n$; none on a dyadic grid), the
levels from `Fraction`s.
For every input the bits are enumerated and counted:

1. at a test-only resolution $R = 8$, over every $j$: the count that steps is
   exactly $\\#\\{j : 2j + 1 < 2^9 \\lvert g \\rvert\\}$, but within the proved error of
   $g$ (`Tiers`: $A + \\rho \\lvert g \\rvert$, plus $2^{-32}$) of a decision point,
   where it may be one off; no draw is ever a third value; an input equal to a
   level's value in its dtype never moves; beyond the range the end levels, NaN
   stays NaN. Inputs: every bfloat16 and float16 bit pattern (but float32
   subnormals, which XLA may flush to zero), and in float32 every level (exact and
   rounded), every threshold, the float32 either side of each, random values;
2. at the shipped 24 bits, the decision sits at that count for every input (the
   $j$ either side), and for a few adversarial inputs all $2^{24}$ values of $j$
   are counted: $P(U)$ is within the proved bias ($< 2^{-22}$) of
   $(x - L)/(U - L)$;
3. the proof made when traced (`_stochastic.proof`) rejects constants that are
   wrong, and forced anyway they fail 1.

Planted defects beside the checks (the naive float32 formula, rounding to nearest,
the ceiling rule, the residual from the rounded level, a level that moves, tiers
the proof rejects) each fail them. Keys, the rules and the
statistics are in `test_stochastic_rounding_grid_use.py`.
"""

from __future__ import annotations

import functools as ft
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_exact_grid import _flushable, _thresholds, all_patterns, as_f64, exact_index

from eqxrules._rules import _stochastic
from eqxrules._rules._exact import _fractions, round_to, within
from eqxrules._rules._formats import RESOLUTION
from eqxrules._rules._paths import Dyadic, plan, quantize
from eqxrules._rules._stochastic import proof, stochastic_quantize, tiers

SMALL = 8
TOP = 2**RESOLUTION
# Each grid with its path in float32 (see `_paths`) and its exact tiers.
GRIDS = {
    (8, -1.0, 1.0): ("formula", 1),  # the default
    (2, -0.5, 1.5): ("formula", 1),
    (3, -0.3, 0.7): ("formula", 1),  # neither end representable
    (8, 0.0, 1.0): ("formula", 1),  # DoReFa
    (16, -1.0, 1.0): ("formula", 2),
    (8, -128.0, 127.0): ("dyadic", 1),
    (4, 0.0, 15.0): ("dyadic", 1),
    (13, 0.0, 1.0): ("table", 2),
    (10, 1000.0, 1001.0): ("formula", 2),  # levels far from 0
}
IDS = [f"{b}bits[{lo},{hi}]" for b, lo, hi in GRIDS]


def _path(bits, lo, hi):
    p = plan(bits, lo, hi, jnp.float32, jnp.float32)
    return "dyadic" if isinstance(p, Dyadic) else "formula" if p else "table"


@pytest.mark.slow
def test_each_grid_takes_the_path_and_tiers_stated():
    for g, (path, count) in GRIDS.items():
        t = tiers(*g, jnp.float32)
        assert (_path(*g), len(t.exact)) == (path, count)


def test_the_proved_bound_is_the_documented_one():
    """Every grid's proof: $A \\le 2^{-25}$ (no stray draw) and a bias below
    $2^{-22}$, in float32 and float64."""
    for g in GRIDS:
        for compute in (jnp.float32, jnp.float64):
            t = tiers(*g, compute)
            assert t.absolute <= Fraction(1, 2**25), (g, compute)
            assert t.bias < Fraction(1, 2**22), (g, compute)


# -- the truth, on the host ---------------------------------------------------------


def _truth(x: np.ndarray, bits, lo, hi):
    """Per input (float64 values): the nearest index, `g` in float64, the index
    of the level below it (the floor bucket), the exact levels and step."""
    n, levels, _, _, _ = _thresholds(bits, lo, hi)
    k = exact_index(x, bits, lo, hi)
    kk = np.clip(k, 0, n)
    step = (Fraction(hi) - Fraction(lo)) / n
    with np.errstate(invalid="ignore"):
        g = (x - lo) * n / (hi - lo) - kk
    below = np.where(g < 0, kk - 1, kk)
    return kk, g, np.clip(below, 0, n - 1), levels, step


def _levels_in(levels, dtype):
    return np.asarray([round_to(v, dtype) for v in levels], np.float64)


def _decisions(g: np.ndarray, resolution: int, margin: np.ndarray):
    """`(low, high)`: the fewest and most `j` in `[0, 2^R)` that may step for an
    input at distance `g` computed within `margin`; equal where no decision point
    `(j + 1/2)/2^R` is within `margin` of `|g|`."""
    top = 2.0 ** (resolution + 1)

    def count(v):
        return np.clip(np.ceil((np.maximum(v, 0) * top - 1) / 2), 0, 2**resolution)

    a = np.abs(g)
    return count(a - margin), count(a + margin)


# -- counting through the code --------------------------------------------------------


@ft.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _tally(core, bits, lo, hi, resolution, x, low, down, up):
    """Over every `j` in `[0, 2^resolution)` (`bits = j << (32 - R) | low`): how
    many round `x` to `up`, how many to neither `down` nor `up` (strays)."""
    shift = 32 - resolution
    chunk = 2 ** min(resolution, max(0, 21 - math.ceil(math.log2(x.size))))
    rows = jnp.arange(chunk, dtype=jnp.uint32)[:, None]
    xs = jnp.broadcast_to(x, (chunk, *x.shape))

    def body(i, acc):
        random = ((rows + (i * chunk).astype(jnp.uint32)) << shift) | low
        q = core(xs, bits, lo, hi, random, resolution).astype(down.dtype)
        is_up, is_down = q == up, q == down
        stray = ~(is_up | is_down) & ~(jnp.isnan(q) & jnp.isnan(down))
        return (
            acc[0] + jnp.sum(is_up, 0, dtype=jnp.int32),
            acc[1] + jnp.sum(stray, 0, dtype=jnp.int32),
        )

    zeros = jnp.zeros(x.shape, jnp.int32)
    return jax.lax.fori_loop(0, 2**resolution // chunk, body, (zeros, zeros))


def shipped(x, bits, lo, hi, random, resolution):
    inside = within(x, lo, hi)
    return stochastic_quantize(x, bits, lo, hi, inside, random, resolution)


def _low(n: int, resolution: int) -> np.ndarray:
    garbage = np.random.default_rng(0).integers(0, 2**32, n, dtype=np.uint64)
    return garbage.astype(np.uint32) & np.uint32((1 << (32 - resolution)) - 1)


def _expected(x, bits, lo, hi, resolution):
    """Per input: the two values it may take (`down`, `up`, in its dtype, as
    float32 or float64), the fewest and most `j` (of `2^R`) that may give `up`,
    and `g`."""
    dtype = x.dtype
    wide = np.promote_types(dtype, np.float32)
    xs = as_f64(x)
    _, g, below, levels, _ = _truth(xs, bits, lo, hi)
    out = _levels_in(levels, dtype)
    down, up = out[below], out[below + 1]
    t = tiers(bits, lo, hi, wide)
    dyadic = isinstance(plan(bits, lo, hi, wide, wide), Dyadic)
    # On a dyadic grid `g` is exact, here (a power-of-two step) and in the rule.
    a, rho, host = (0, 0, 0) if dyadic else (t.absolute, t.relative, 2.0**-32)
    with np.errstate(invalid="ignore"):
        margin = float(a) + float(rho) * np.abs(g) + host
        low, high = _decisions(g, resolution, margin)
    whole = 2.0**resolution
    # Where the nearest level is the upper one, the steps go down.
    ups_low = np.where(g >= 0, low, whole - high)
    ups_high = np.where(g >= 0, high, whole - low)
    level = (xs == down) | (xs == up)
    for mask, value in ((level, xs), (xs < lo, out[0]), (xs > hi, out[-1])):
        down, up = np.where(mask, value, down), np.where(mask, value, up)
        ups_low, ups_high = (
            np.where(mask, whole, ups_low),
            np.where(mask, whole, ups_high),
        )
    nan = np.isnan(xs)
    down, up = np.where(nan, np.nan, down), np.where(nan, np.nan, up)
    ups_low, ups_high = np.where(nan, 0, ups_low), np.where(nan, 0, ups_high)
    return down.astype(wide), up.astype(wide), ups_low, ups_high, g


def check_counts(core, x, bits, lo, hi, resolution=SMALL, what=""):
    """`core` (with `shipped`'s signature) gives each input `up` for a count of
    `j` within `_expected`'s range, and never a third value."""
    down, up, ups_low, ups_high, _ = _expected(x, bits, lo, hi, resolution)
    ups, strays = _tally(
        core,
        bits,
        lo,
        hi,
        resolution,
        jnp.asarray(x),
        _low(x.size, resolution),
        jnp.asarray(down),
        jnp.asarray(up),
    )
    ups, strays = np.asarray(ups), np.asarray(strays)
    bad = (ups < ups_low) | (ups > ups_high) | (strays != 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise AssertionError(
            f"{bits} bits [{lo}, {hi}], {x.dtype}{what}: x = {x[i]!r} (neighbours "
            f"{down[i]!r}, {up[i]!r}): {ups[i]} of 2^{resolution} give the upper, "
            f"expected {ups_low[i]:.0f} to {ups_high[i]:.0f}; {strays[i]} give "
            f"neither ({int(bad.sum())} of {x.size} inputs wrong)"
        )
    return ups, ups_low, ups_high


def _points(bits, lo, hi) -> np.ndarray:
    """float32 inputs: every level (exact and rounded), threshold, the float32
    either side of each, random values in and beyond the range, zeros, NaN."""
    n, levels, ts, _, _ = _thresholds(bits, lo, hi)
    centre = np.array([float(v) for v in levels + ts], np.float32)
    rng = np.random.default_rng(bits)
    span = hi - lo
    random = rng.uniform(lo - span / 8, hi + span / 8, 4096).astype(np.float32)
    tiny = np.array([0.0, -0.0, 1e-30, -1e-30, 2.0**-126, np.nan], np.float32)
    x = np.concatenate(
        [
            centre,
            np.nextafter(centre, np.float32(-np.inf)),
            np.nextafter(centre, np.float32(np.inf)),
            random,
            tiny,
        ]
    )
    return np.unique(x[~_flushable(x)])  # XLA may read a subnormal as 0


def _inputs(dtype_name, bits, lo, hi):
    if dtype_name == "float32":
        return _points(bits, lo, hi)
    x = all_patterns(ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.float16)
    return x[~_flushable(x)]


@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bits,lo,hi", list(GRIDS), ids=IDS)
def test_every_input_steps_for_the_exact_count_of_bit_patterns(dtype, bits, lo, hi):
    check_counts(shipped, _inputs(dtype, bits, lo, hi), bits, lo, hi)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("bits,lo,hi", [(8, -1.0, 1.0), (13, 0.0, 1.0), (4, 0.0, 15.0)])
def test_float64_inputs(bits, lo, hi):
    """float64 inputs are computed in float64 (the table, or the dyadic formula)."""
    with jax.enable_x64(True):
        check_counts(shipped, _points(bits, lo, hi).astype(np.float64), bits, lo, hi)


# -- the shipped 24 bits ----------------------------------------------------------------


@ft.partial(jax.jit, static_argnums=(1, 2, 3))
def _at(x, bits, lo, hi, random):
    return shipped(x, bits, lo, hi, random, RESOLUTION)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("bits,lo,hi", list(GRIDS), ids=IDS)
def test_at_24_bits_the_decision_sits_at_the_count(bits, lo, hi):
    """The `j` just inside and just outside the count that gives `up` (where the
    nearest level is the upper one, `up` is where it stays: `j` at or past the
    count of moves), and random `j`, each as `_expected` says."""
    x = _points(bits, lo, hi)
    down, up, low, high, g = _expected(x, bits, lo, hi, RESOLUTION)
    moves = np.where(g >= 0, (low, high), (TOP - high, TOP - low))
    rng = np.random.default_rng(3)
    probes = {
        "last that moves": (moves[0] - 1, moves[0] >= 1),
        "first that stays": (moves[1], moves[1] < TOP),
        "random": (rng.integers(0, TOP, x.shape), None),
    }
    for what, (j, where) in probes.items():
        j = np.clip(j, 0, TOP - 1).astype(np.uint32)
        random = (j << np.uint32(8)) | _low(x.size, RESOLUTION)
        q = np.asarray(_at(jnp.asarray(x), bits, lo, hi, random), np.float64)
        move = j < np.where(g >= 0, low, TOP - high)  # certainly moves
        stay = j >= np.where(g >= 0, high, TOP - low)  # certainly stays
        want_up = np.where(g >= 0, move, stay)
        sure = (move | stay) if where is None else where
        ok = np.where(want_up, q == up, q == down) | ~sure
        ok |= (down == up) & (q == up)
        ok |= np.isnan(q) & np.isnan(x)
        assert ok.all(), (what, x[~ok][:3], q[~ok][:3], down[~ok][:3], up[~ok][:3])


def _adversarial(bits, lo, hi) -> np.ndarray:
    """Inputs at which all 2^24 `j` are counted: beside a level (just above, just
    below), a third of a step, a tie, the level nearest 0 and beside it."""
    _, levels, ts, _, _ = _thresholds(bits, lo, hi)
    k = min(range(len(levels)), key=lambda i: abs(levels[i]))
    near = np.float32(float(levels[k]))
    third = np.float32(float(levels[k] + (levels[1] - levels[0]) / 3))
    tie = np.float32(float(ts[min(k, len(ts) - 1)]))
    up, down = np.float32(np.inf), np.float32(-np.inf)
    return np.array(
        [
            near,
            np.nextafter(near, up),
            np.nextafter(near, down),
            third,
            tie,
            np.nextafter(tie, up),
            np.float32(lo),
            np.float32(1e-30),
        ],
        np.float32,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "bits,lo,hi", [(16, -1.0, 1.0), (13, 0.0, 1.0), (8, -128.0, 127.0)]
)
def test_every_24_bit_pattern_for_adversarial_inputs(bits, lo, hi):
    """P(U) within the proved bias of `(x - L)/(U - L)` (exactly: the fraction of
    `j` that give `U` is the count for exact `g`, but near a decision point)."""
    x = _adversarial(bits, lo, hi)
    x = x[(x >= lo) & (x <= hi)]
    ups, _, _ = check_counts(shipped, x, bits, lo, hi, RESOLUTION, ", every j")
    _, g, _, _, _ = _truth(x.astype(np.float64), bits, lo, hi)
    down, up, _, _, _ = _expected(x, bits, lo, hi, RESOLUTION)
    f = np.where(g >= 0, g, 1 + g)
    t = tiers(bits, lo, hi, jnp.float32)
    bias = float(t.bias) if t else 2.0**-25
    level = down == up
    assert np.all(np.abs(ups / TOP - f)[~level] <= bias), (x, ups / TOP - f)
    assert bias < 2.0**-22


# -- planted defects: each fails the count ---------------------------------------------


def _table(bits, lo, hi, dtype):
    n, levels, _, _, _ = _thresholds(bits, lo, hi)
    return jnp.asarray(_levels_in(levels, dtype), dtype)


def _nearest(x, bits, lo, hi, random, resolution):
    return quantize(x, bits, lo, hi, within(x, lo, hi))


def _naive(x, bits, lo, hi, random, resolution):
    """The float32 formula: `v = (x - lo)·n/(hi - lo)`, up iff `j < 2^R (v -
    floor(v))`, onto the exact levels: `v` is rounded (by 2^-8 of a step at 16
    bits)."""
    n = 2**bits - 1
    w = jnp.clip(x.astype(jnp.float32), lo, hi)
    v = (w - lo) * np.float32(n / (hi - lo))
    k = jnp.floor(v)
    j = (random >> (32 - resolution)).astype(jnp.float32)
    k = jnp.minimum(k + (j < (v - k) * 2.0**resolution), n).astype(jnp.int32)
    return jnp.where(x == x, _table(bits, lo, hi, x.dtype)[k], x)


def _ceiling_move(g, random, resolution=RESOLUTION):
    """`j < 2^R |g|`: biased by up to a whole 2^-R."""
    j = (random >> (32 - resolution)).astype(jnp.float32)
    return j < jnp.abs(g) * 2.0**resolution


def _rounded_level_residual(w, index, t):
    """`g` from the level rounded to float32, not the exact one."""
    u = index - t.origin
    level = sum((u * s + v for s, v in (*t.exact, t.last)), jnp.zeros_like(w))
    return (w - level) * t.scale


def _moving_levels(x, stay, other, move):
    """A level moves like any other input."""
    return jnp.where(move, other, stay)


def _coarse_tiers(bits, lo, hi, compute):
    """The level as a plain float32 pair: `u·S` rounds (the proof rejects it)."""
    t = tiers.__wrapped__(bits, lo, hi, compute)
    n, _, _, step = _fractions(bits, lo, hi)
    middle = Fraction(lo) + t.origin * step
    pair = [np.float32(round_to(v, jnp.float32)) for v in (step, middle)]
    rest = [
        np.float32(round_to(v - Fraction(float(p)), jnp.float32))
        for v, p in zip((step, middle), pair)
    ]
    return t._replace(exact=(tuple(pair),), last=tuple(rest))


PATCHED = {
    "ceiling": ("stochastic_move", _ceiling_move),
    "rounded level": ("residual", _rounded_level_residual),
    "levels move": ("choose", _moving_levels),
    "coarse tiers": ("tiers", _coarse_tiers),
}
DEFECTS = {
    "nearest": (_nearest, "float32", (8, -1.0, 1.0)),
    "naive": (_naive, "float32", (16, -1.0, 1.0)),
    "ceiling": (None, "float32", (8, -1.0, 1.0)),
    "rounded level": (None, "float32", (16, -1.0, 1.0)),
    "levels move": (None, "bfloat16", (16, -1.0, 1.0)),
    "coarse tiers": (None, "float32", (16, -1.0, 1.0)),
}


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(DEFECTS))
def test_planted_defects_fail_the_count(name, monkeypatch):
    core, dtype, grid = DEFECTS[name]
    if core is None:  # the shipped pipeline with one part replaced
        monkeypatch.setattr(_stochastic, *PATCHED[name])

        def core(*args):  # a new function: a new trace of `_tally`
            return shipped(*args)

    with pytest.raises(AssertionError):
        check_counts(core, _inputs(dtype, *grid), *grid)


def test_the_proof_rejects_the_coarse_tiers():
    """The constants `_coarse_tiers` forces (and which fail the count) are rejected
    when traced: `u·S` rounds."""
    t = _coarse_tiers(16, -1.0, 1.0, jnp.float32)
    assert proof(t.origin, t.exact, t.last, t.scale, 16, -1.0, 1.0, jnp.float32) is None
    good = tiers(16, -1.0, 1.0, jnp.float32)
    assert proof(*good[:4], 16, -1.0, 1.0, jnp.float32) == good[4:]
    wrong_scale = good.scale * np.float32(1 + 2.0**-23)
    assert proof(*good[:3], wrong_scale, 16, -1.0, 1.0, jnp.float32) is None
