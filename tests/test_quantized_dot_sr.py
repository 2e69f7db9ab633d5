"""The gradient products of `quantized_dot` with stochastic rounding are unbiased:
over keys, each one's mean is the product of its operands' means (issue 19 §4),
checked with `eqxrules.testing.check_unbiased` (a Chernoff-KL bound with a union
bound over the elements, false-fail rate 1e-6, every draw within the product's
range, 20,000 draws), for

- both operands rounded stochastically (the catalogue's `StochasticRound`, onto
  the integers): planted defect, one key for both operands, caught;
- NVFP4 as Transformer Engine trains (the gradient rounded stochastically by
  `NVFP4Quantize`, x and w to nearest), on a gradient whose scales are exact so
  that E[Q(dy)] = dy: planted defect, rounding to nearest, caught.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowp_helpers import product_bounds

import eqxrules
from eqxrules import recipes
from eqxrules._lowp import quantise
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
        within=bounds,
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


@pytest.mark.slow
def test_gradient_products_are_unbiased():
    dw, dx = _dw(), _dx()
    assert dw.passed and dx.passed
    # What the test could have caught (with power 1/2): a bias of 2.5% of an
    # element's range, below the planted defect's (1/12 of it, on average).
    assert dw.detectable < 1 / 24 and dx.detectable < 1 / 24


@pytest.fixture
def one_key(fresh_products):
    """Both operands of a product rounded with the same key (the core's products
    traced again, `fresh_products`, so that the patch is traced)."""
    honest = quantise.operand_keys

    def shared(key):
        k_lhs, _, k_signs = honest(key)
        return k_lhs, k_lhs, k_signs

    fresh_products.setattr(quantise, "operand_keys", shared)


@pytest.mark.slow
def test_planted_key_shared_by_both_operands_is_caught(one_key):
    # With one uniform u per position, x and dy round up together: on dw's diagonal
    # each term's mean is min(f_x, f_dy), not f_x f_dy (on average 1/3, not 1/4).
    with pytest.raises(UnbiasedCheckError):
        _dw()


# NVFP4 as Transformer Engine trains with it (without the Hadamard transform, whose
# random signs would make the expected operands random too): the gradient rounded
# stochastically in both products it enters, x and w to nearest.
NV_RECIPE = dataclasses.replace(recipes.nvfp4(), hadamard=None)
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # e2m1's magnitudes


def _nvfp4_gradient() -> np.ndarray:
    """`dy` [M, N] whose every block of 16 along either axis has its largest
    magnitude A·2^-e (e in 0..3) with A = 2688·2^-8: then NVFP4's scales are exact
    (t = A/2688 = 2^-8, s = 448·2^-e, d = t·s = a/6), nothing is clipped, and
    E[Q(dy)] = dy."""
    g = np.random.default_rng(1)
    big = 2688.0 * 2.0**-8
    dy = g.uniform(-big / 16, big / 16, (M, N))
    i, j = np.indices(dy.shape)
    diagonal = (i + j) % 16 == 0
    e = g.integers(0, 4, diagonal.sum())
    e[0] = 0
    dy[diagonal] = np.where(g.random(e.size) < 0.5, -1, 1) * big * 2.0**-e
    return dy.astype(np.float32)


def _neighbours(v: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The two NVFP4 values around each element, blocks of 16 along `axis`, from
    the scales the data makes exact (`d` = the block's largest magnitude / 6)."""
    blocks = np.moveaxis(v.astype(np.float64), axis, -1).reshape(-1, 16)
    d = np.abs(blocks).max(-1, keepdims=True) / 6
    u = np.abs(blocks) / d
    i = np.clip(np.searchsorted(GRID, u, side="right") - 1, 0, len(GRID) - 1)
    lo, hi = GRID[i], GRID[np.minimum(i + 1, len(GRID) - 1)]
    hi = np.where(u == lo, lo, hi)
    moved = np.moveaxis(v, axis, -1).shape
    back = [
        np.moveaxis((np.sign(blocks) * b * d).reshape(moved), -1, axis)
        for b in (lo, hi)
    ]
    return back[0], back[1]


def _nvfp4_reports(recipe) -> list:
    """`check_unbiased`'s reports on dx and dw of `recipe` (NVFP4's quantisers) with
    the crafted gradient: the mean over keys against the product of the expected
    operands, E[Q(dy)] = dy and x, w rounded to nearest."""
    dy = _nvfp4_gradient()
    qx = np.asarray(eqxrules.NVFP4Quantize(axis=0)(jnp.asarray(X)), np.float64)
    qw = np.asarray(eqxrules.NVFP4Quantize(axis=(0, 1))(jnp.asarray(W)), np.float64)

    def gradients(key):
        _, pull = jax.vjp(
            lambda x, w: eqxrules.quantized_dot(x, w, recipe=recipe, key=key), X, W
        )
        return pull(jnp.asarray(dy))

    return [
        check_unbiased(
            lambda target, key: gradients(key)[which],
            expected,
            key=jax.random.key(12),
            within=bounds,
            draws=DRAWS,
            false_fail_rate=1e-6,
            raise_on_failure=False,
        )
        for which, expected, bounds in (
            (0, dy @ qw.T, product_bounds(_neighbours(dy, 1), 1, (qw, qw), 1)),
            (1, qx.T @ dy, product_bounds((qx, qx), 0, _neighbours(dy, 0), 0)),
        )
    ]


def test_the_crafted_gradients_scales_are_exact():
    dy = _nvfp4_gradient()
    for axis in (0, 1):  # nearest lands on one of the neighbours computed from them
        lo, hi = _neighbours(dy, axis)
        q = np.asarray(jax.jit(eqxrules.NVFP4Quantize(axis=axis))(dy))
        assert np.all((q == lo) | (q == hi))


@pytest.mark.slow
def test_nvfp4_gradient_products_are_unbiased():
    for report in _nvfp4_reports(NV_RECIPE):
        assert report.passed and report.detectable < 0.05, report.detail


@pytest.mark.slow
def test_planted_rounding_to_nearest_fails_the_nvfp4_check():
    # The gradient rounded to nearest where the recipe says stochastically: each
    # product is biased, by far more than the check's detectable bias.
    nearest = dataclasses.replace(NV_RECIPE, gradient_rounding="nearest")
    assert [r.passed for r in _nvfp4_reports(nearest)] == [False, False]
