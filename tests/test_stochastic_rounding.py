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
   of the format, values below half its smallest subnormal, $\\pm$max;
2. the rules round with that core (for MX and NVFP4: with the scales of rounding
   to nearest, computed here in NumPy), their bits drawn as documented from the
   key; beyond $\\pm$max they saturate, NaN stays NaN;
3. a statistical smoke test over keys, with a stated false-fail rate;
4. keys (same key, same draw eagerly, under `jit` and `vmap`; other keys, other
   draws; none, a clear error), the derivative, and the layers;
5. the situations of `tests/test_matrix.py` (`vmap`, `scan`, `checkpoint`, ...)
   on the stochastic examples, which that file leaves to their first example.

Each check has planted defects beside it that make it fail.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ENTRIES, examples as catalogue_examples
from matrix import inputs, modes, transforms  # noqa: F401  (register the situations)
from matrix.harness import BF16, F16, SITUATIONS, Case

import eqxrules
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


@pytest.mark.parametrize(
    "defect",
    [_nearest, _always_down, _naive_sum, _eight_bits, _three_percent, _exact_moves],
    ids=lambda d: d.__name__,
)
def test_planted_core_defects_are_caught(defect):
    with pytest.raises(AssertionError):
        check_core(defect, "e4m3")


# -- the rules ---------------------------------------------------------------------


def _float_case(fmt_name, scale):
    """`(rule, x, u, multiplier)` for `FloatQuantize`: `u = x/scale` (float32,
    within range), the value is `scale·round(u)`."""
    fmt = FORMATS[fmt_name]
    ys = _inputs(fmt_name)[::7]
    x = (ys * F32(scale)).astype(F32)
    u = (x / F32(scale)).astype(F32)
    keep = np.abs(u) <= fmt.max
    x, u = x[keep], u[keep]
    rule = eqxrules.FloatQuantize(format=fmt_name, scale=scale, rounding="stochastic")
    return rule, x, u, np.full_like(u, F32(scale))


def _blocks(x, size):
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _block_input(size, seed, rows, spread):
    """`rows` rows of 4 blocks, each block's magnitudes at a random power of two
    from 2^-spread to 2^spread (no tiny or non-finite block: those are
    `test_float_formats`' business)."""
    rng = np.random.default_rng(seed)
    powers = rng.integers(-spread, spread, (rows, 4, 1))
    x = rng.standard_normal((rows, 4, size)) * 2.0**powers
    return x.reshape(rows, 4 * size).astype(F32)


def _mx_case(fmt_name, rows=4):
    fmt = FORMATS[fmt_name]
    size = 8
    x = _block_input(size, 3, rows, spread=20)
    b = _blocks(x, size)
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    e = np.floor(np.log2(amax.astype(np.float64))) - fmt.emax
    scale = np.broadcast_to(np.ldexp(F32(1), e.astype(np.int32)), b.shape)
    u = np.clip(b / scale, -fmt.max, fmt.max).astype(F32)
    rule = eqxrules.MXQuantize(format=fmt_name, block_size=size, rounding="stochastic")
    return rule, x, u.reshape(x.shape), scale.reshape(x.shape).astype(F32)


def _nvfp4_case(rows=4):
    x = _block_input(16, 4, rows, spread=3)  # every block scale within e4m3's
    t = F32(np.max(np.abs(x))) / F32(2688)
    b = _blocks(x, 16)
    a = np.max(np.abs(b), axis=-1, keepdims=True)
    r = np.clip((a / F32(6)) / t, 0, 448).astype(F32)
    s = r.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    d = np.broadcast_to((t * s).astype(F32), b.shape)
    u = np.clip(b / d, -6, 6).astype(F32)
    assert np.all(s > 0)
    rule = eqxrules.NVFP4Quantize(rounding="stochastic")
    return rule, x, u.reshape(x.shape), d.reshape(x.shape).astype(F32)


def _rule_cases():
    cases = [
        pytest.param(_float_case, (f, s), id=f"float-{f}-{s}")
        for f in FORMATS
        for s in (1.0, 3.0)
    ]
    cases += [pytest.param(_mx_case, (f,), id=f"mx-{f}") for f in FORMATS]
    return [*cases, pytest.param(_nvfp4_case, (), id="nvfp4")]


def _outcomes(rule, u, multiplier):
    """The two values each element may take, `(down, up)`, and `f`."""
    name = getattr(rule, "format", "e2m1")
    lo, hi, f = _neighbours(name, u)
    down = (np.copysign(lo, u).astype(F32) * multiplier).astype(F32)
    up = (np.copysign(hi, u).astype(F32) * multiplier).astype(F32)
    return down, up, f


def check_rule_threshold(rule, x, u, multiplier):
    """`rule` with bits injected (`_with_bits`): each element is the lower value
    for `j >= ceil(2^24 f)` and the upper one below, `f` from the scales of
    rounding to nearest (computed in NumPy) and the format's list of values."""
    down, up, f = _outcomes(rule, u, multiplier)
    c = np.ceil(f * TOP)
    low = _low(x.size, RESOLUTION, seed=5).reshape(x.shape)
    for what, j in {"c - 1": np.maximum(c - 1, 0), "c": np.minimum(c, TOP - 1)}.items():
        bits = (j.astype(np.uint32) << np.uint32(32 - RESOLUTION)) | low
        q = np.asarray(jax.jit(rule._with_bits)(x, bits))
        want = np.where(j < c, up, down)
        bad = q != want
        assert not bad.any(), (
            f"{rule!r} at j = {what}: x = {x[bad][:3]}, got {q[bad][:3]}, "
            f"expected {want[bad][:3]}"
        )


@pytest.mark.parametrize("make,args", _rule_cases())
def test_rules_round_with_the_core_and_the_nearest_scales(make, args):
    check_rule_threshold(*make(*args))


@pytest.mark.parametrize("make,args", _rule_cases())
def test_rules_draw_their_bits_from_the_key_as_documented(make, args):
    rule, x, _, _ = make(*args)
    key = jax.random.key(3)
    bits = jax.random.bits(key, x.shape, jnp.uint32)
    np.testing.assert_array_equal(rule(x, key=key), rule._with_bits(x, bits))


class _NoScales(eqxrules.MXQuantize):
    """Planted: the element rounding stochastic, but on the unscaled block."""

    def _with_bits(self, x, bits):
        return stochastic_round_to(FORMATS[self.format], jnp.clip(x, -6, 6), bits)


class _IgnoresBits(eqxrules.FloatQuantize):
    """Planted: rounds to nearest whatever `rounding` says."""

    def _with_bits(self, x, bits):
        return super()._with_bits(x, None)


def _fields(rule):
    return {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule)}


@pytest.mark.parametrize(
    "defect,case",
    [
        (_NoScales, lambda: _mx_case("e2m1")),
        (_IgnoresBits, lambda: _float_case("e4m3", 3.0)),
    ],
    ids=["mx-without-scales", "float-nearest"],
)
def test_planted_rule_defects_fail_the_threshold_check(defect, case):
    rule, *rest = case()
    with pytest.raises(AssertionError):
        check_rule_threshold(defect(**_fields(rule)), *rest)


# -- statistics over keys ------------------------------------------------------------

DRAWS = 50_000
FALSE_FAIL_RATE = 1e-6


@ft.partial(jax.jit, static_argnums=(0, 4))
def _draw_counts(rule, x, down, up, draws):
    keys = jax.random.split(jax.random.key(17), draws)
    out = jax.vmap(lambda k: rule(x, key=k))(keys)
    return jnp.sum(out == up, axis=0), jnp.sum((out != up) & (out != down), axis=0)


def check_mean(rule, x, u, multiplier):
    """Over `DRAWS` keys, every draw is one of the two neighbours, and the
    fraction that round up is within the Hoeffding bound of `f` at the stated
    false-fail rate (union bound over the elements). A value of the format never
    moves."""
    down, up, f = _outcomes(rule, u, multiplier)
    counts, stray = _draw_counts(rule, x, down, up, DRAWS)
    counts = np.where(down == up, 0, np.asarray(counts)).ravel()
    x, f = x.ravel(), f.ravel()
    assert not np.any(np.asarray(stray)), "a draw is not one of the two neighbours"
    bound = math.sqrt(math.log(2 * x.size / FALSE_FAIL_RATE) / (2 * DRAWS))
    error = np.abs(counts / DRAWS - f)
    i = int(np.argmax(error))
    assert error[i] <= bound, (
        f"x = {x[i]!r}: {counts[i]} of {DRAWS} round up, f = {f[i]}, bound {bound:.4f}"
    )
    assert np.all(counts[f == 0] == 0), "a value of the format moved"


def _float_mean_case(rule=None):
    """96 inputs across e2m1's range at scale 3, eight of them values of the
    format."""
    rule = rule or eqxrules.FloatQuantize(
        format="e2m1", scale=3.0, rounding="stochastic"
    )
    u = np.random.default_rng(6).uniform(-6, 6, 96).astype(F32)
    u[:8] = [0, 0.5, -1, 1.5, 3, -4, 6, -6]
    x = (u * F32(3)).astype(F32)
    return rule, x, (x / F32(3)).astype(F32), np.full_like(u, F32(3))


@pytest.mark.parametrize(
    "make,args",
    [
        pytest.param(_float_mean_case, (), id="float"),
        pytest.param(_mx_case, ("e4m3", 1), id="mx"),
        pytest.param(_nvfp4_case, (1,), id="nvfp4"),
    ],
)
def test_the_mean_over_keys_is_the_input(make, args):
    check_mean(*make(*args))


class _FixedKey(eqxrules.FloatQuantize):
    """Planted: ignores the key it is given (the same draw for every key)."""

    def primal(self, x, *, key=None):
        return super().primal(x, key=jax.random.key(0))


class _Biased(eqxrules.FloatQuantize):
    """Planted: rounds up 3% more often than it should."""

    def _with_bits(self, x, bits):
        if bits is None:
            return super()._with_bits(x, bits)
        fmt = FORMATS[self.format]
        u = jnp.clip(x / self.scale, -fmt.max, fmt.max)
        return _three_percent(fmt, u, bits, RESOLUTION) * self.scale


@pytest.mark.parametrize("defect", [_FixedKey, _Biased])
def test_planted_defects_fail_the_mean(defect):
    rule = defect(format="e2m1", scale=3.0, rounding="stochastic")
    with pytest.raises(AssertionError):
        check_mean(*_float_mean_case(rule))


# -- saturation, NaN, exact values -------------------------------------------------


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_beyond_max_saturates_nan_stays_and_values_of_the_format_stay(fmt_name):
    fmt = FORMATS[fmt_name]
    m = np.asarray(fmt.magnitudes(), F32)
    values = np.concatenate([m, -m])
    outside = np.array([np.inf, -np.inf, 2 * fmt.max, -1e30, np.nan], F32)
    x = jnp.asarray(np.concatenate([values, outside]) * F32(4))
    want = np.concatenate([values, [fmt.max, -fmt.max, fmt.max, -fmt.max, np.nan]])
    want = (want * F32(4)).astype(F32)
    rule = eqxrules.FloatQuantize(format=fmt_name, scale=4.0, rounding="stochastic")
    draws = jax.jit(jax.vmap(lambda k: rule(x, key=k)))(
        jax.random.split(jax.random.key(0), 64)
    )
    for q in np.asarray(draws):
        np.testing.assert_array_equal(q, want)


def test_block_rules_keep_nan_blocks_and_zeros():
    x = np.asarray(np.random.default_rng(0).standard_normal((2, 32)), F32)
    x[0, 3] = np.nan
    x[1, 16:] = 0.0
    for rule in (
        eqxrules.MXQuantize(block_size=16, rounding="stochastic"),
        eqxrules.NVFP4Quantize(rounding="stochastic"),
    ):
        for k in range(4):
            q = np.asarray(rule(jnp.asarray(x), key=jax.random.key(k)))
            nvfp4 = isinstance(rule, eqxrules.NVFP4Quantize)
            assert np.all(np.isnan(q[0] if nvfp4 else q[0, :16])), rule
            if not nvfp4:
                assert not np.any(np.isnan(q[1])) and np.all(q[1, 16:] == 0)


# -- keys -------------------------------------------------------------------------

SR_RULES = [
    eqxrules.FloatQuantize(format="e2m1", rounding="stochastic"),
    eqxrules.MXQuantize(block_size=8, rounding="stochastic"),
    eqxrules.NVFP4Quantize(rounding="stochastic"),
]
X = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, 32)), jnp.float32)


@pytest.mark.parametrize("rule", SR_RULES, ids=lambda r: r.rule_name())
def test_a_stochastic_rule_without_a_key_is_a_clear_error(rule):
    name = rule.rule_name()
    for call in (lambda: rule(X), lambda: rule(X, key=None)):
        with pytest.raises(TypeError, match=f"`{name}` needs a PRNG key"):
            call()
    with pytest.raises(TypeError, match=f"`{name}` needs a PRNG key"):
        type(rule).function(X, **_fields(rule))
    assert rule.needs_key() and "key" in rule.call_kwargs(jax.random.key(0))


@pytest.mark.parametrize("rule", SR_RULES, ids=lambda r: r.rule_name())
def test_nearest_accepts_and_ignores_a_key(rule):
    nearest = dataclasses.replace(rule, rounding="nearest")
    assert not nearest.needs_key() and nearest.call_kwargs(jax.random.key(0)) == {}
    plain = nearest(X)
    np.testing.assert_array_equal(nearest(X, key=jax.random.key(1)), plain)
    by_function = type(nearest).function(X, **_fields(nearest), key=jax.random.key(1))
    np.testing.assert_array_equal(by_function, plain)


def check_draws(rule, x):
    """The same key gives the same draw eagerly, under `jit` and under `vmap` with
    split keys; other keys give other draws."""
    k1, k2 = jax.random.key(1), jax.random.key(2)
    eager = rule(x, key=k1)
    np.testing.assert_array_equal(eqx.filter_jit(rule)(x, key=k1), eager)
    assert not np.array_equal(rule(x, key=k2), eager), "the draw ignores the key"
    keys = jax.random.split(k1, x.shape[0])
    mapped = jax.vmap(lambda x, k: rule(x, key=k))(x, keys)
    for i in range(x.shape[0]):
        np.testing.assert_array_equal(mapped[i], rule(x[i], key=keys[i]))
    assert not np.array_equal(mapped[0], mapped[1]), "split keys, same draw"


@pytest.mark.parametrize("rule", SR_RULES, ids=lambda r: r.rule_name())
def test_same_key_same_draw_other_key_other_draw(rule):
    check_draws(rule, X)


def test_planted_fixed_key_fails_the_draw_check():
    with pytest.raises(AssertionError, match="ignores the key"):
        check_draws(_FixedKey(format="e2m1", rounding="stochastic"), X)


@pytest.mark.parametrize("rule", SR_RULES, ids=lambda r: r.rule_name())
def test_the_derivative_is_the_straight_through_one_of_nearest(rule):
    nearest = dataclasses.replace(rule, rounding="nearest")
    ct = jnp.cos(jnp.arange(X.size, dtype=jnp.float32)).reshape(X.shape)
    x = X * 5  # some beyond the range, where FloatQuantize's derivative is 0
    _, pull = jax.vjp(lambda x: rule(x, key=jax.random.key(0)), x)
    _, pull_nearest = jax.vjp(nearest, x)
    np.testing.assert_array_equal(pull(ct)[0], pull_nearest(ct)[0])
    _, t = jax.jvp(lambda x: rule(x, key=jax.random.key(0)), (x,), (ct,))
    np.testing.assert_array_equal(t, jax.jvp(nearest, (x,), (ct,))[1])


# -- layers --------------------------------------------------------------------------


def _sr_kernel_and_input():
    return dict(
        kernel_quantizer=eqxrules.FloatQuantize(format="e4m3", rounding="stochastic"),
        input_quantizer=eqxrules.MXQuantize(
            format="e2m1", block_size=4, rounding="stochastic"
        ),
    )


def test_quantized_splits_the_key_between_its_stochastic_quantisers():
    linear = eqx.nn.Linear(8, 3, key=jax.random.key(0))
    layer = eqxrules.Quantized(linear, **_sr_kernel_and_input())
    x = jnp.linspace(-1.0, 1.0, 8)
    key = jax.random.key(4)
    k_in, k_kernel, _ = jax.random.split(key, 3)
    xq = layer.input_quantizer(x, key=k_in)
    wq = layer.kernel_quantizer(linear.weight, key=k_kernel)
    np.testing.assert_array_equal(layer(x, key=key), wq @ xq + linear.bias)
    assert not np.array_equal(layer(x, key=jax.random.key(5)), layer(x, key=key))
    with pytest.raises(TypeError, match="needs a PRNG key"):
        layer(x)


def test_quantize_with_stochastic_quantisers_needs_a_key():
    k1, k2 = jax.random.split(jax.random.key(0))
    model = eqx.nn.Sequential(
        [
            eqx.nn.Linear(8, 8, key=k1),
            eqx.nn.Lambda(jnp.tanh),
            eqx.nn.Linear(8, 4, key=k2),
        ]
    )
    q = eqxrules.quantize(model, **_sr_kernel_and_input())
    x = jnp.linspace(-1.0, 1.0, 8)
    out, grads = eqx.filter_value_and_grad(
        lambda m: jnp.sum(m(x, key=jax.random.key(1)) ** 2)
    )(q)
    assert np.isfinite(out) and np.any(grads.layers[0].layer.weight != 0)
    with pytest.raises(TypeError, match="needs a PRNG key"):
        q(x)
    # `eqx.nn.MLP` passes no key to its layers: a clear error, never nearest.
    mlp = eqxrules.quantize(eqx.nn.MLP(8, 4, 8, 1, key=k1), **_sr_kernel_and_input())
    with pytest.raises(TypeError, match="needs a PRNG key"):
        mlp(x, key=jax.random.key(1))


# -- the transformation matrix, on the stochastic examples --------------------------
# `tests/test_matrix.py` runs most situations on each entry's first example only
# (rounding to nearest, here): these cells run them on the stochastic examples.


def _stochastic_cells():
    cells = []
    for entry in ENTRIES:
        for index, rule in enumerate(catalogue_examples(entry)):
            if getattr(rule, "rounding", None) != "stochastic":
                continue
            for s in SITUATIONS.values():
                chosen = s.examples(entry)
                if not chosen or index in chosen:  # not applicable, or run already
                    continue
                cells += [
                    pytest.param(
                        entry,
                        index,
                        s.name,
                        dtype,
                        id=f"{entry.name}-{index}-{s.name}-{dtype}",
                        marks=[pytest.mark.slow] if dtype in (BF16, F16) else [],
                    )
                    for dtype in s.dtypes
                ]
    return cells


@pytest.mark.parametrize("entry,index,situation,dtype", _stochastic_cells())
def test_stochastic_examples_through_the_matrix(entry, index, situation, dtype):
    SITUATIONS[situation].run(Case(entry, index), dtype)
