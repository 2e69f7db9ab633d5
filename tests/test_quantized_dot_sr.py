"""The gradient products of `quantized_dot` with stochastic rounding are unbiased:
over keys, each one's mean is the product of its operands' means (issue 19 §4),
checked with `eqxrules.testing.check_unbiased` (a Chernoff-KL bound with a union
bound over the elements, false-fail rate 1e-6, every draw within the product's
range), and a planted defect, both operands rounded with one key, caught.

The rounding is the catalogue's `StochasticRound` (onto the integers,
$E[q(v)] = v$): an operand quantiser of `quantized_dot` like any other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowp_helpers import product_bounds

import eqxrules
from eqxrules import recipes
from eqxrules._lowp import dot
from eqxrules.testing import UnbiasedCheckError, check_unbiased

M, K, N = 32, 16, 16  # K = N: one key for both operands of dw gives equal bits
SR = eqxrules.StochasticRound()
E4M3 = eqxrules.FloatQuantize(format="e4m3")
RECIPE = recipes.Custom(
    fwd=recipes.Product(E4M3, E4M3),
    dx=recipes.Product(SR, E4M3),  # dy rounded stochastically, w to nearest
    dw=recipes.Product(SR, SR),  # both stochastically, with independent keys
)
DRAWS = 20_000
rng = np.random.default_rng(0)
# Values in [0, 1): each stochastically rounded one is 0 or 1, with random
# probabilities.
X = rng.random((M, K)).astype(np.float32)
W = rng.standard_normal((K, N)).astype(np.float32)
DY = rng.random((M, N)).astype(np.float32)


def _gradients(key):
    _, pull = jax.vjp(
        lambda x, w: eqxrules.quantized_dot(x, w, recipe=RECIPE, key=key), X, W
    )
    return pull(jnp.asarray(DY))


def _floor_ceil(v):
    return np.floor(v), np.ceil(v)


def _check(which: int, expected, bounds):
    return check_unbiased(
        lambda target, key: _gradients(key)[which],
        expected,
        key=jax.random.key(11),
        bounds=bounds,
        draws=DRAWS,
        false_fail_rate=1e-6,
    )


def _dw():
    # E[Q(x)ᵀ Q(dy)] = E[Q(x)]ᵀ E[Q(dy)] = xᵀ dy: the two noises are independent.
    bounds = product_bounds(_floor_ceil(X), 0, _floor_ceil(DY), 0)
    return _check(1, X.T.astype(np.float64) @ DY, bounds)


def _dx():
    # E[Q(dy) Q(w)ᵀ] = dy Q(w)ᵀ: w is rounded to nearest.
    qw = np.asarray(E4M3(jnp.asarray(W)), np.float64)
    bounds = product_bounds(_floor_ceil(DY), 1, (qw, qw), 1)
    return _check(0, DY.astype(np.float64) @ qw.T, bounds)


def test_gradient_products_are_unbiased():
    dw, dx = _dw(), _dx()
    assert dw.passed and dx.passed
    # What the test could have caught (with power 1/2): a bias of 2.5% of an
    # element's range, below the planted defect's (1/12 of it, on average).
    assert dw.detectable < 1 / 24 and dx.detectable < 1 / 24


@pytest.fixture
def one_key(monkeypatch):
    """Both operands of a product rounded with the same key (the products' compiled
    cache replaced, so that the patch is traced)."""
    honest = dot.operand_keys

    def shared(key):
        k_lhs, _, k_signs = honest(key)
        return k_lhs, k_lhs, k_signs

    def evaluate(*args):
        return dot._evaluate(*args)

    monkeypatch.setattr(dot, "operand_keys", shared)
    monkeypatch.setattr(dot, "_compiled", jax.jit(evaluate, static_argnums=(0, 1)))


def test_planted_key_shared_by_both_operands_is_caught(one_key):
    # With one uniform u per position, x and dy round up together: on dw's diagonal
    # each term's mean is min(f_x, f_dy), not f_x f_dy (on average 1/3, not 1/4).
    with pytest.raises(UnbiasedCheckError):
        _dw()
