"""A Python float is the 0-d array it stands for: `jax.grad(rule)(0.25)` gives what
`jax.grad(rule)(jnp.float32(0.25))` gives, for every entry (0.2.0+ raised
`'TypedFloat' object has no attribute 'astype'` in `quadratic_sign`'s slope: under
`jax.grad`, JAX hands a custom rule a Python float as its own float subclass)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CALL_KEY, ENTRIES, examples

import eqxrules


def _grad(rule, x):
    kw = rule.call_kwargs(CALL_KEY)
    return jax.grad(lambda x: jnp.sum(rule(x, **kw)).astype(jnp.float32))(x)


def _outcome(rule, x):
    try:
        return np.asarray(_grad(rule, x)), None
    except Exception as e:  # noqa: BLE001  (compared below)
        return None, type(e)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_a_python_float_is_a_0d_array(entry):
    rule = examples(entry)[0]
    value = 0.25
    as_array, error = _outcome(rule, jnp.float32(value))
    as_float, float_error = _outcome(rule, value)
    # A rule that takes no 0-d input refuses a Python float the same way.
    assert float_error == error, (float_error, error)
    if error is None:
        np.testing.assert_array_equal(as_float, as_array)


def test_the_test_fails_where_a_float_reaches_the_maths(monkeypatch):
    """Planted: the conversion taken out, `quadratic_sign`'s slope meets the
    float again."""
    from eqxrules import _catalogue

    monkeypatch.setattr(_catalogue, "_as_arrays", lambda args: list(args))
    rule = eqxrules.QuadraticSign()
    _, error = _outcome(rule, 0.25)
    assert error is AttributeError
