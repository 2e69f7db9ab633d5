"""The straight-through family's random rules sample without bias:
`stochastic_round` rounds up with probability `x - floor(x)`, and
`gumbel_softmax` draws each class with its softmax probability. Each is checked by
`eqxrules.testing.check_unbiased` at false-fail rate 1e-6 (its Chernoff-KL bound
with a union bound over the elements), with a planted biased variant beside it that
the check catches but for a probability computed exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from benchmarks.sections.unbiased import exact_rate
from eqxrules.testing import UnbiasedCheckError, check_unbiased

# Many draws each: the slow tier (`tests/test_unbiased.py` keeps a quick check).
pytestmark = pytest.mark.slow


def _shifted_round(x, key):
    """Planted: `floor(x + 0.1 + 0.9 u)`, a random offset that misses `[0, 0.1)`:
    rounds up with probability `min(1, f / 0.9)` instead of `f`."""
    return jnp.floor(x + 0.1 + 0.9 * jax.random.uniform(key, x.shape))


def test_stochastic_round_is_unbiased_and_lands_on_neighbours():
    # `check_unbiased` at false-fail rate 1e-6 (its Chernoff-KL and union bound):
    # every draw a neighbour (floor or ceil), representable values kept, the
    # frequency of the upper one f. The planted rounding beside it is caught but
    # for probability 1e-6: the exact binomial probability that the test misses
    # it at -1.3 (f = 0.7, rounding up with 0.778) is far below that.
    x = jnp.array([-1.3, -0.5, 0.0, 0.25, 1.7, 2.0])
    pair = (np.floor(np.asarray(x)), np.ceil(np.asarray(x)))
    kw = dict(key=jax.random.key(0), neighbours=pair, draws=20_000)
    report = check_unbiased(eqxrules.stochastic_round, x, **kw, false_fail_rate=1e-6)
    assert report.passed and report.elements == 4
    np.testing.assert_array_equal(report.means[[2, 5]], [0.0, 2.0])
    miss = 1 - exact_rate(0.7, 20_000, report.threshold, 0.7 / 0.9)
    assert miss < 1e-6
    with pytest.raises(UnbiasedCheckError, match="an unbiased rounding keeps"):
        check_unbiased(_shifted_round, x, **kw)
    # Different keys, different roundings; the same key, the same rounding.
    key = jax.random.key(1)
    np.testing.assert_array_equal(
        eqxrules.stochastic_round(x, key), eqxrules.StochasticRound()(x, key=key)
    )


def test_gumbel_softmax_samples_the_categorical_distribution():
    # Each one-hot entry is 1 with probability softmax(logits) (the Gumbel-max
    # trick): `check_unbiased` at false-fail rate 1e-6 reads 0 and 1 off the
    # draws (`bounds` (0, 1): no assumption on the probabilities). Planted beside
    # it: the temperature dividing the logits before the noise is added, sampling
    # softmax(logits / 0.7) = (0.063, 0.171, 0.305, 0.461): the exact binomial
    # probability that the test misses it at the first entry is below 1e-6.
    logits = jnp.log(jnp.array([0.1, 0.2, 0.3, 0.4]))
    probs = jax.nn.softmax(logits)
    kw = dict(key=jax.random.key(0), bounds=(0.0, 1.0), draws=20_000)
    report = check_unbiased(
        lambda p, key: eqxrules.gumbel_softmax(logits, key), probs, **kw
    )
    assert report.passed and report.elements == 4 and report.false_fail_rate == 1e-6
    np.testing.assert_array_equal(report.lower, 0.0)
    np.testing.assert_array_equal(report.upper, 1.0)
    tempered = np.asarray(jax.nn.softmax(logits / 0.7), np.float64)
    p = float(probs[0])
    assert 1 - exact_rate(p, 20_000, report.threshold, tempered[0]) < 1e-6
    with pytest.raises(UnbiasedCheckError, match="an unbiased rounding keeps"):
        check_unbiased(
            lambda p, key: eqxrules.gumbel_softmax(logits / 0.7, key), probs, **kw
        )
