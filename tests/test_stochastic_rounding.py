"""Stochastic rounding of the float quantisers (issue 19, section 1), proven by
counting rather than sampled.

The rounding is `_formats.stochastic_round_to(fmt, y, bits)`; its random bits are
an argument, so the tests enumerate them and count, for each input, exactly how
many bit patterns round up:

1. the core, per format: over every 8-bit `j` (the same code at a test-only
   resolution), exactly $\\lceil 2^8 f \\rceil$ round up, $f = (|y| - L)/(U - L)$
   from the format's list of values; at the shipped 24 bits, the threshold sits
   exactly at $j = \\lceil 2^{24} f \\rceil$ for every input, and for a few
   adversarial inputs all $2^{24}$ values of `j` are counted. Inputs: every
   bfloat16 value in range, random float32 values, every pair of neighbouring
   values of the format just above $L$, halfway and just below $U$, subnormals
   of the format, values below half its smallest subnormal, $\\pm$max.

Planted defects beside the check make it fail. The rules (which round with this
core, with the scales of rounding to nearest, their bits drawn from the key) and
the statistics over keys are in `test_stochastic_rounding_rules.py`; the rules in
use (keys, saturation, the derivative, layers, the transformation matrix) in
`test_stochastic_rounding_use.py`.
"""

from __future__ import annotations

import functools as ft
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eqxrules._rules._formats import (
    FORMATS,
    RESOLUTION,
    exponent,
    pow2,
    round_to,
    stochastic_round_to,
)

F32 = np.float32
SMALL = 8  # the test-only resolution at which every `j` is counted for every input
TOP = 2**RESOLUTION


# -- the truth, on the host ---------------------------------------------------------


def _neighbours(fmt_name: str, y: np.ndarray) -> tuple[np.ndarray, ...]:
    """`(L, U, f)`: the format's magnitudes around `|y|`, `L <= |y| <= U` (both
    `|y|` for a value of the format), from its list of values, and
    `f = (|y| - L)/(U - L)`. In float64 all three are exact: `|y| - L` has at
    most 24 significant bits, and `U - L` is a power of two."""
    grid = np.asarray(FORMATS[fmt_name].magnitudes(), np.float64)
    a = np.abs(y.astype(np.float64))
    i = np.searchsorted(grid, a, side="right") - 1
    lo = grid[i]
    exact = a == lo
    hi = np.where(exact, lo, grid[np.minimum(i + 1, len(grid) - 1)])
    f = np.where(exact, 0.0, (a - lo) / np.where(exact, 1.0, hi - lo))
    return lo, hi, f


def _inputs(fmt_name: str) -> np.ndarray:
    """The float32 inputs the core is proven on (all within the format's range;
    no float32 subnormal, which XLA flushes to zero)."""
    fmt = FORMATS[fmt_name]
    every = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(F32)
    every = every[np.isfinite(every)]
    rng = np.random.default_rng(len(fmt_name) + fmt.mbits)
    uniform = rng.uniform(-fmt.max, fmt.max, 2048)
    smallest = 2.0 ** (fmt.emin - fmt.mbits)
    logs = rng.uniform(np.log2(smallest) - 12, np.log2(fmt.max), 2048)
    spread = rng.choice([-1.0, 1.0], 2048) * 2.0**logs
    m = np.asarray(fmt.magnitudes(), F32)
    lo, hi = m[:-1], m[1:]
    pairs = [
        lo,
        np.nextafter(lo, hi),
        (lo + hi) / 2,
        np.nextafter(hi, lo),
        lo + (hi - lo) / 3,
    ]
    tiny = np.array([smallest / 2, smallest / 3, smallest * 2.0**-20, 2.0**-126], F32)
    ys = np.concatenate([every, uniform, spread, *pairs, tiny, m]).astype(F32)
    ys = np.concatenate([ys, -ys])
    ok = np.isfinite(ys) & (np.abs(ys) <= fmt.max)
    ok &= (ys == 0) | (np.abs(ys) >= np.finfo(F32).tiny)
    return ys[ok]


def _adversarial(fmt_name: str) -> np.ndarray:
    """A few inputs at which every one of the $2^{24}$ values of `j` is counted."""
    fmt = FORMATS[fmt_name]
    one_up = 1 + 2.0**-fmt.mbits
    smallest = 2.0 ** (fmt.emin - fmt.mbits)
    return np.array(
        [
            np.nextafter(F32(1), F32(2)),  # just above L
            np.nextafter(F32(one_up), F32(0)),  # just below U
            1 + 2.0 ** -(fmt.mbits + 1),  # halfway
            -(1 + 2.0 ** -(fmt.mbits + 1)) * 4,
            smallest * 1.375,  # a subnormal of the format
            smallest / 2,  # the last input rounded without bias
            2.0**-126,  # far below: P(U) = 2^-24, not 2^-126/smallest
            fmt.max,
            np.nextafter(F32(fmt.max), F32(0)),
            1.0,
            0.0,
        ],
        F32,
    )


# -- counting through the code --------------------------------------------------------


@ft.partial(jax.jit, static_argnums=(0, 1, 2))
def _tally(core, fmt_name, resolution, y, low, lo, hi):
    """Over every `j` in `[0, 2^resolution)`, with `bits = j << (32 - resolution) |
    low` (`low`: fixed garbage below the bits read): how many of the `2^resolution`
    round `y` to `±hi` and how many to neither `±lo` nor `±hi`."""
    fmt = FORMATS[fmt_name]
    shift = 32 - resolution
    chunk = 2 ** min(resolution, max(0, 22 - math.ceil(math.log2(y.size))))
    rows = jnp.arange(chunk, dtype=jnp.uint32)[:, None]

    def body(i, acc):
        j = rows + (i * chunk).astype(jnp.uint32)
        bits = (j << shift) | low
        q = core(fmt, jnp.broadcast_to(y, bits.shape), bits, resolution)
        is_lo, is_hi = q == jnp.copysign(lo, y), q == jnp.copysign(hi, y)
        up = jnp.sum(is_hi & ~is_lo, axis=0)
        return acc[0] + up, acc[1] + jnp.sum(~(is_lo | is_hi), axis=0)

    zeros = jnp.zeros(y.shape, jnp.int32)
    return jax.lax.fori_loop(0, 2**resolution // chunk, body, (zeros, zeros))


def _low(n: int, resolution: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    garbage = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    return garbage & np.uint32((1 << (32 - resolution)) - 1)


def _counted(core, fmt_name, ys, resolution, what):
    """The exact count of `j` that round each of `ys` up, asserting it is
    $\\lceil 2^R f \\rceil$ and that every outcome is one of the two neighbours."""
    lo, hi, f = _neighbours(fmt_name, ys)
    up, stray = _tally(
        core, fmt_name, resolution, ys, _low(ys.size, resolution), F32(lo), F32(hi)
    )
    up, stray = np.asarray(up), np.asarray(stray)
    want = np.ceil(f * 2.0**resolution)
    bad = (up != want) | (stray != 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise AssertionError(
            f"{fmt_name}, {what}: y = {ys[i]!r} (L = {lo[i]}, U = {hi[i]}, "
            f"f = {f[i]!r}): {up[i]} of 2^{resolution} round up, expected "
            f"{want[i]:.0f}; {stray[i]} give neither neighbour "
            f"({int(bad.sum())} inputs wrong)"
        )
    return up / 2.0**resolution, f


@ft.partial(jax.jit, static_argnums=(0, 1))
def _at(core, fmt_name, y, bits):
    return core(FORMATS[fmt_name], y, bits, RESOLUTION)


def _threshold(core, fmt_name, ys):
    """At the shipped resolution: `y` rounds up iff `j < ceil(2^24 f)`, at the
    `j` on either side of that threshold, at the ends, and at random `j`."""
    lo, hi, f = _neighbours(fmt_name, ys)
    c = np.ceil(f * TOP)
    low = _low(ys.size, RESOLUTION, seed=1)
    rng = np.random.default_rng(2)
    probes = {
        "j = c - 1": np.maximum(c - 1, 0),
        "j = c": np.minimum(c, TOP - 1),
        "j = 0": np.zeros_like(c),
        "j = 2^24 - 1": np.full_like(c, TOP - 1),
        "random j": rng.integers(0, TOP, c.shape).astype(np.float64),
    }
    for what, j in probes.items():
        bits = (j.astype(np.uint32) << np.uint32(32 - RESOLUTION)) | low
        q = np.asarray(_at(core, fmt_name, ys, bits))
        up = j < c
        want = np.copysign(np.where(up, hi, lo), ys).astype(F32)
        bad = q != want
        if bad.any():
            i = int(np.argmax(bad))
            raise AssertionError(
                f"{fmt_name}, 24 bits, {what}: y = {ys[i]!r} (f = {f[i]!r}, "
                f"threshold {c[i]:.0f}, j = {j[i]:.0f}) gave {q[i]!r}, expected "
                f"{want[i]!r} ({int(bad.sum())} inputs wrong)"
            )


def check_core(core, fmt_name: str) -> None:
    """`core` (with `stochastic_round_to`'s signature) rounds every input of
    `_inputs` up with probability exactly $\\lceil 2^R f \\rceil / 2^R$ over its
    bits, within $2^{-20}$ of $f$ at the shipped resolution: counted over every
    8-bit `j`, at the 24-bit threshold, and over every 24-bit `j` for
    `_adversarial`."""
    ys = _inputs(fmt_name)
    _counted(core, fmt_name, ys, SMALL, "every 8-bit j")
    _threshold(core, fmt_name, ys)
    p, f = _counted(core, fmt_name, _adversarial(fmt_name), RESOLUTION, "every j")
    assert np.all(np.abs(p - f) < 2.0**-20), (fmt_name, p, f)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_the_core_rounds_up_with_the_exact_probability(fmt_name):
    check_core(stochastic_round_to, fmt_name)


def test_the_bias_is_zero_down_to_half_the_smallest_subnormal():
    """The documented resolution: $2^{24} f$ is an integer (no bias) for every
    input of every format down to half its smallest subnormal; below that the
    bias is under $2^{-24} (U - L)$."""
    for name, fmt in FORMATS.items():
        ys = _inputs(name)
        _, _, f = _neighbours(name, ys)
        scaled = f * TOP
        half = 2.0 ** (fmt.emin - fmt.mbits - 1)
        big = np.abs(ys) >= half
        assert np.all(scaled[big] == np.floor(scaled[big])), name
        assert np.all(np.ceil(scaled) / TOP - f < 2.0**-20), name
        assert np.any(~big & (scaled != np.floor(scaled))), name  # the claim is sharp


# Planted defects: each fails `check_core`.


def _magnitude(fmt, y):
    k = jnp.maximum(exponent(y), fmt.emin) - fmt.mbits
    return jnp.abs(y) * pow2(-k), pow2(k)


def _nearest(fmt, y, bits, resolution):
    return round_to(fmt, y)


def _always_down(fmt, y, bits, resolution):
    v, step = _magnitude(fmt, y)
    return jnp.copysign(jnp.floor(v) * step, y)


def _naive_sum(fmt, y, bits, resolution):
    """`floor(v + u)` in float32: the addition rounds."""
    v, step = _magnitude(fmt, y)
    u = (bits >> (32 - resolution)).astype(jnp.float32) * 2.0**-resolution
    return jnp.copysign(jnp.floor(v + u) * step, y)


def _eight_bits(fmt, y, bits, resolution):
    """Only 8 random bits, whatever the resolution: biased by up to 2^-8."""
    return stochastic_round_to(fmt, y, bits, 8)


def _three_percent(fmt, y, bits, resolution):
    v, step = _magnitude(fmt, y)
    lo = jnp.floor(v)
    j = (bits >> (32 - resolution)).astype(jnp.float32)
    # 3% more often, but a value of the format stays.
    up = (v > lo) & (j < jnp.minimum(v - lo + 0.03, 1.0) * 2.0**resolution)
    return jnp.copysign((lo + up) * step, y)


def _exact_moves(fmt, y, bits, resolution):
    """`j <= 2^R f`: a value of the format rounds up when `j` is 0."""
    v, step = _magnitude(fmt, y)
    lo = jnp.floor(v)
    j = (bits >> (32 - resolution)).astype(jnp.float32)
    return jnp.copysign((lo + (j <= (v - lo) * 2.0**resolution)) * step, y)


@pytest.mark.first_case_quick
@pytest.mark.parametrize(
    "defect",
    [_nearest, _always_down, _naive_sum, _eight_bits, _three_percent, _exact_moves],
    ids=lambda d: d.__name__,
)
def test_planted_core_defects_are_caught(defect):
    with pytest.raises(AssertionError):
        check_core(defect, "e4m3")
