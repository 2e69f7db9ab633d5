"""Stochastic rounding onto the exact grids in use (`ste_quantize`,
`dorefa_quantize`; issue 19 section 1): keys (the same key gives the same draw
eagerly, under `jit` and under `vmap`; none is a clear error), the levels stay (as
rounded to the input's dtype), saturation beyond the range and NaN, the references,
the derivative, a grid whose rounding is not proved (a clear error when built), and
the mean over keys (`check_unbiased`). The proof by counting is in
`test_stochastic_rounding_grid.py`; the keys' and the derivative's checks shared
with the float formats are in `test_stochastic_rounding_use.py`. Planted defects
beside the checks make them fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_exact_grid import _thresholds
from test_stochastic_rounding_grid import _levels_in
from test_stochastic_rounding_use import check_draws

import eqxrules
from eqxrules.testing import check_unbiased

F32 = np.float32
RULES = [
    eqxrules.SteQuantize(rounding="stochastic"),
    eqxrules.SteQuantize(bits=10, lo=1000.0, hi=1001.0, rounding="stochastic"),
    eqxrules.SteQuantize(bits=8, lo=-128.0, hi=127.0, rounding="stochastic"),
    eqxrules.SteQuantize(bits=3, lo=-0.3, hi=0.7, rounding="stochastic"),
    eqxrules.DoReFa(bits=4, rounding="stochastic"),
    eqxrules.DoReFa(bits=13, rounding="stochastic"),  # the table
]
IDS = [f"{r.rule_name()}-{r._grid()}" for r in RULES]
X = jnp.asarray(np.random.default_rng(1).uniform(-0.125, 1.125, (3, 2, 32)), F32)


def _across(rule, t):
    """`t` in [0, 1] mapped onto the rule's range (beyond it outside [0, 1])."""
    _, lo, hi = rule._grid()
    return (lo + (hi - lo) * t).astype(F32)


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_same_key_same_draw_other_key_other_draw(rule):
    check_draws(rule, _across(rule, X))


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_without_a_key_a_clear_error_and_nearest_ignores_one(rule):
    name = rule.rule_name()
    with pytest.raises(TypeError, match=f"`{name}` needs a PRNG key"):
        rule(X)
    with pytest.raises(TypeError, match=f"`{name}` needs a PRNG key"):
        rule.primal(X)
    nearest = dataclasses.replace(rule, rounding="nearest")
    assert rule.needs_key() and not nearest.needs_key()
    np.testing.assert_array_equal(nearest(X, key=jax.random.key(1)), nearest(X))


@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_levels_stay_beyond_the_range_saturates_nan_stays(rule, dtype):
    """Every level, as rounded to the input's dtype, comes back itself for every
    key; beyond the range the end levels; NaN stays NaN."""
    bits, lo, hi = rule._grid()
    _, levels, _, _, _ = _thresholds(bits, lo, hi)
    levels = _levels_in(levels, np.dtype(dtype))
    span = hi - lo
    outside = [lo - span, hi + span, -np.inf, np.inf, np.nan]
    want = np.concatenate([levels, [levels[0], levels[-1], levels[0], levels[-1]]])
    x = jnp.asarray(np.concatenate([levels, outside]), dtype)
    draws = jax.jit(jax.vmap(lambda k: rule(x, key=k)))(
        jax.random.split(jax.random.key(0), 16)
    )
    assert draws.dtype == dtype
    for q in np.asarray(draws, np.float64):
        np.testing.assert_array_equal(q[:-1], want)
        assert np.isnan(q[-1])


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_the_reference_agrees_and_the_derivative_is_nearest_s(rule):
    x = _across(rule, jnp.concatenate([X.ravel(), jnp.linspace(-0.05, 1.05, 4001)]))
    for k in range(3):
        key = jax.random.key(k)
        np.testing.assert_array_equal(
            jax.jit(lambda x: rule(x, key=key))(x), rule.reference_forward(x, key=key)
        )
    nearest = dataclasses.replace(rule, rounding="nearest")
    ct = jnp.cos(x)
    _, pull = jax.vjp(lambda x: rule(x, key=jax.random.key(0)), x)
    np.testing.assert_array_equal(pull(ct)[0], jax.vjp(nearest, x)[1](ct)[0])


def test_a_grid_near_underflow_cannot_round_stochastically():
    """Its residual's proof fails in float32: a `ValueError` when built, naming the
    rule, the argument and the grid; rounding to nearest is fine."""
    grid = dict(bits=8, lo=1e-30, hi=2e-30)
    eqxrules.SteQuantize(**grid)
    with pytest.raises(
        ValueError, match=r"`ste_quantize`: `rounding` \(='stochastic'\)"
    ):
        eqxrules.SteQuantize(**grid, rounding="stochastic")
    with pytest.raises(
        ValueError, match=r"`rounding` \(='Stochastic'\) must be one of"
    ):
        eqxrules.SteQuantize(rounding="Stochastic")


# -- statistics over keys ------------------------------------------------------------


def check_mean(rule, x):
    """`check_unbiased` over 50,000 keys at false-fail rate 1e-6, the neighbours
    from the rule's exact levels (`neighbours`)."""
    check_unbiased(
        lambda x, key: rule(x, key=key),
        x,
        key=jax.random.key(17),
        neighbours=lambda x: tuple(np.asarray(v) for v in rule.neighbours(x)),
        draws=50_000,
        false_fail_rate=1e-6,
    )


def _mean_input(rule):
    """96 inputs across the range, eight of them ties or levels."""
    bits, lo, hi = rule._grid()
    _, levels, ts, _, _ = _thresholds(bits, lo, hi)
    x = np.random.default_rng(6).uniform(lo, hi, 96).astype(F32)
    x[:8] = [float(v) for v in (*levels[:2], *levels[-2:], *ts[:2], *ts[-2:])]
    return jnp.asarray(x)


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("rule", RULES[:4:3] + RULES[4:5], ids=lambda r: repr(r))
def test_the_mean_over_keys_is_the_input(rule):
    check_mean(rule, _mean_input(rule))


class _Nearest(eqxrules.SteQuantize):
    """Planted: rounds to nearest whatever `rounding` says."""

    def _with_bits(self, x, bits, resolution=24):
        return super()._with_bits(x, None)


class _Floor(eqxrules.SteQuantize):
    """Planted: the float32 formula, `floor(v + u)` with `v = (x - lo)·n/(hi - lo)`
    (biased, and not onto the exact levels' rounding)."""

    def _with_bits(self, x, bits, resolution=24):
        n = 2**self.bits - 1
        u = (bits >> 8).astype(jnp.float32) * 2.0**-24
        v = (jnp.clip(x, self.lo, self.hi) - self.lo) * (n / (self.hi - self.lo))
        return self.lo + jnp.floor(v + u + 0.03) * ((self.hi - self.lo) / n)


@pytest.mark.slow
@pytest.mark.parametrize("defect", [_Nearest, _Floor])
def test_planted_defects_fail_the_mean(defect):
    rule = defect(bits=3, lo=-0.3, hi=0.7, rounding="stochastic")
    with pytest.raises(AssertionError):
        check_mean(rule, _mean_input(rule))


@pytest.mark.slow
def test_bfloat16_inputs_on_a_grid_finer_than_bfloat16_are_themselves():
    """On 16 bits every bfloat16 input of magnitude 2^-7 to 1 is a level in its own
    dtype (the levels are 2/65535 apart, less than 3/4 of its ulp, 2^-14 or more),
    so it stays."""
    x = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    a = np.abs(x.astype(F32))
    x = x[(a <= 1) & (a >= 2.0**-7)]
    rule = eqxrules.SteQuantize(bits=16, rounding="stochastic")
    q = rule(jnp.asarray(x), key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(q, F32), x.astype(F32))
