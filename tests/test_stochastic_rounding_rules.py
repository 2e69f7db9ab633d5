"""Stochastic rounding of the float quantisers (issue 19, section 1), the rules:

2. `FloatQuantize`, `MXQuantize` and `NVFP4Quantize` round with the core that
   `test_stochastic_rounding.py` proves by counting (for MX and NVFP4: with the
   scales of rounding to nearest, computed here in NumPy), each element the lower
   neighbour for $j \\ge \\lceil 2^{24} f \\rceil$ and the upper one below, and
   draw their bits as documented from the key;
3. a statistical smoke test over keys (`check_unbiased`, at a stated false-fail
   rate).

Each check has planted defects beside it that make it fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from backend import quotient
from bits_helpers import numpy_bits
from test_stochastic_rounding import (
    F32,
    TOP,
    _inputs,
    _low,
    _neighbours,
    _three_percent,
)

import eqxrules
from eqxrules._rules._formats import FORMATS, RESOLUTION, stochastic_round_to
from eqxrules.testing import check_unbiased

# -- the rules ---------------------------------------------------------------------
# Quotients as the backend divides, which the rules do (`backend.quotient`, checked
# against the correctly rounded one: its plant is in test_backend_references.py).


def _float_case(fmt_name, scale):
    """`(rule, x, u, multiplier)` for `FloatQuantize`: `u = x/scale` (float32,
    within range, divided as the backend divides), the value is
    `scale·round(u)`."""
    fmt = FORMATS[fmt_name]
    ys = _inputs(fmt_name)[::7]
    x = (ys * F32(scale)).astype(F32)
    u = quotient(x, F32(scale))
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
    t = quotient(np.max(np.abs(x)), F32(2688))
    b = _blocks(x, 16)
    a = np.max(np.abs(b), axis=-1, keepdims=True)
    r = np.clip(quotient(quotient(a, F32(6)), t), 0, 448).astype(F32)
    s = r.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    d = np.broadcast_to((t * s).astype(F32), b.shape)
    u = np.clip(quotient(b, d), -6, 6).astype(F32)
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


@pytest.mark.first_case_quick
@pytest.mark.parametrize("make,args", _rule_cases())
def test_rules_round_with_the_core_and_the_nearest_scales(make, args):
    check_rule_threshold(*make(*args))


@pytest.mark.first_case_quick
@pytest.mark.parametrize("make,args", _rule_cases())
def test_rules_draw_their_bits_from_the_key_as_documented(make, args):
    rule, x, _, _ = make(*args)
    key = jax.random.key(3)
    bits = jnp.asarray(numpy_bits(key, x.shape))
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


def check_mean(rule, x, u, multiplier):
    """`eqxrules.testing.check_unbiased` over 50,000 keys at false-fail rate
    1e-6: every draw one of the two neighbours, a value of the format never moved,
    and the fraction rounded up within the Chernoff-KL bound of `f`. The mean is
    that of the value in range, `u·multiplier` (beyond it, the value saturates)."""
    down, up, _ = _outcomes(rule, u, multiplier)
    check_unbiased(
        lambda _, key: rule(x, key=key),
        jnp.asarray(u * multiplier),
        key=jax.random.key(17),
        neighbours=(np.minimum(down, up), np.maximum(down, up)),
        draws=50_000,
        false_fail_rate=1e-6,
    )


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


@pytest.mark.first_case_quick
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


@pytest.mark.first_case_quick
@pytest.mark.parametrize("defect", [_FixedKey, _Biased])
def test_planted_defects_fail_the_mean(defect):
    rule = defect(format="e2m1", scale=3.0, rounding="stochastic")
    with pytest.raises(AssertionError):
        check_mean(*_float_mean_case(rule))
