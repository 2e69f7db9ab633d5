"""The sign family's thresholds (issue 18 §3): `clip_value=None` on every rule with a
clip, as larq accepts it; and every threshold compared exactly with the
hyperparameter's float32 value, whatever the input's dtype.

0.2.0 compared a bfloat16 or float16 input with the threshold rounded to the input's
dtype, so the inputs between `float32(c)` and its rounding were on the wrong side
(`ste_sign`'s gradient at the bfloat16 0.050048828125 was 1 for `clip_value=0.05`);
and `MagnitudeAwareSign`, `SteTernary` and `SteHeaviside` rejected
`clip_value=None`. Each test below fails on that behaviour.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqxrules

CLIPPED = [
    eqxrules.SteSign,
    eqxrules.MagnitudeAwareSign,
    eqxrules.SteTernary,
    eqxrules.SteHeaviside,
]
# Thresholds whose float32 value bfloat16 or float16 cannot hold: rounded to the
# input's dtype, some go up and some go down.
THRESHOLDS = [0.05, 0.1, 0.3, 1 / 3, 0.7, 1.1, 2.9]
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _neighbours(c: float, dtype) -> tuple[float, float]:
    """The largest value of `dtype` at most `float32(c)` and the smallest above it,
    found among every bit pattern (exact as float32)."""
    every = np.arange(2**16, dtype=np.uint16).view(dtype).astype(np.float32)
    every = every[np.isfinite(every)]
    c32 = np.float32(c)
    return float(every[every <= c32].max()), float(every[every > c32].min())


def _gradient(rule, x: float, dtype) -> float:
    """The gradient of the rule at the one-element input `x` of `dtype`."""
    g = jax.grad(lambda x: rule(x).sum())(jnp.asarray([x], dtype))
    return float(g[0])


@pytest.mark.parametrize("cls", CLIPPED, ids=lambda c: c.__name__)
def test_clip_value_none_is_no_clipping(cls):
    rule = cls(clip_value=None)
    assert rule.clip_value is None
    x = jnp.asarray([-50.0, -1.5, 0.0, 3.0, 1e30])
    g = jax.grad(lambda x: rule(x).sum())(x)
    expected = jnp.abs(x) if cls is eqxrules.MagnitudeAwareSign else jnp.ones_like(x)
    np.testing.assert_array_equal(g, expected)
    # ... and the functional form takes it by position, like the other clips.
    assert jnp.array_equal(type(rule).function(x, clip_value=None), rule(x))


@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("c", THRESHOLDS)
@pytest.mark.parametrize("cls", CLIPPED, ids=lambda c: c.__name__)
def test_clip_compares_with_the_float32_value_exactly(cls, c, dtype):
    """Just inside and just outside `float32(c)`, in the input's dtype: the
    gradient passes at the one and not at the other (not at `c` rounded)."""
    inside, outside = _neighbours(c, DTYPES[dtype])
    rule = cls(clip_value=c)
    assert _gradient(rule, inside, dtype) != 0
    assert _gradient(rule, outside, dtype) == 0


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("th", THRESHOLDS)
def test_ternary_threshold_compares_with_the_float32_value_exactly(th, dtype):
    below, above = _neighbours(th, DTYPES[dtype])
    rule = eqxrules.SteTernary(threshold_value=th, clip_value=None)
    x = jnp.asarray([below, above, -below, -above], dtype)
    on = below == np.float32(th)  # `x >= th` holds at `th` itself
    expected = [1.0 if on else 0.0, 1.0, -1.0 if on else 0.0, -1.0]
    np.testing.assert_array_equal(np.asarray(rule(x), np.float32), expected)


def test_float32_values_on_the_boundary_and_bfloat16_beyond_it():
    """The issue's example: `float32(0.05)` is on the boundary of
    `clip_value=0.05` (inclusive), and the bfloat16 0.050048828125 beyond it."""
    rule = eqxrules.SteSign(clip_value=0.05)
    assert _gradient(rule, float(np.float32(0.05)), jnp.float32) == 1.0
    assert float(jnp.bfloat16(0.05)) == 0.050048828125
    assert _gradient(rule, 0.050048828125, jnp.bfloat16) == 0.0
