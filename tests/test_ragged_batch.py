"""Ragged batches (issue 26 §3): the weight-gradient product of `quantized_dot`
pads a batch M that its blocks do not divide with zero rows at the end, before its
Hadamard transform and quantisers, so its value is, bit for bit, that of the call
on the batch padded with zero rows. The forward and input-gradient products reduce
the features K and N, which stay a `ValueError` (padding them would change the
layer).

On main each of these raised `ValueError: ... the weight-gradient product reduces
the batch M ... must divide` (the planted defects below show what the checks catch).
"""

from __future__ import annotations

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules import recipes
from eqxrules._lowp import ops

KEY = jax.random.key(7)
# Each recipe, with the multiple of its weight-gradient blocks (fp8() has none:
# 32 is any length, and the zeros still change nothing).
RECIPES = {
    "mxfp8": (recipes.mxfp8(), 32),
    "nvfp4": (recipes.nvfp4(), 16),  # SR and RHT on: the same key for both calls
    "fp8": (recipes.fp8(), 32),
}


def _data(m: int):
    k = jax.random.split(jax.random.key(m), 3)
    x = jax.random.normal(k[0], (m, 64))
    w = jax.random.normal(k[1], (64, 32)) / 8
    dy = jax.random.normal(k[2], (m, 32))
    return x, w, dy


def _vjp(recipe, x, w, dy):
    """`(y, dx, dw)` of `quantized_dot` at `(x, w)` with cotangent `dy`."""
    y, pullback = jax.vjp(
        lambda x, w: eqxrules.quantized_dot(x, w, recipe=recipe, key=KEY), x, w
    )
    return (y, *pullback(dy))


def _pad(a, rows: int):
    """`a` with zero rows appended up to `rows`."""
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


def _reference(recipe, x, w, dy, block: int):
    """`(y, dx, dw)` of the call on `x` and `dy` padded with zero rows to a
    multiple of `block`: the padded cotangent is zero there, so `dw` is that of the
    ragged batch padded, and `y`, `dx` keep the real rows."""
    rows = -(-x.shape[0] // block) * block
    y, dx, dw = _vjp(recipe, _pad(x, rows), w, _pad(dy, rows))
    m = x.shape[0]
    return y[:m], dx[:m], dw


@pytest.mark.first_case_quick
@pytest.mark.parametrize("m", [20, 1])
@pytest.mark.parametrize("name", list(RECIPES))
def test_the_weight_gradient_of_a_ragged_batch_is_the_padded_one(name, m):
    recipe, block = RECIPES[name]
    x, w, dy = _data(m)
    y, dx, dw = _vjp(recipe, x, w, dy)
    y_ref, dx_ref, dw_ref = _reference(recipe, x, w, dy, block)
    assert np.isfinite(dw).all()
    assert np.array_equal(dw, dw_ref)
    assert np.array_equal(y, y_ref)
    if m > 1:
        assert np.array_equal(dx, dx_ref)
    else:
        # The input-gradient product is not padded. One row is a matrix-vector
        # product on the CPU, whose float32 sums run in another order than the
        # padded call's (`recipes.identity()`, plain `jnp.dot`, differs as much).
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)


# Planted defects: each must make the check above fail.


@pytest.fixture
def planted(fresh_products):
    """`monkeypatch`, the core's products traced again (`fresh_products`)."""
    return fresh_products


def _plant_padding(monkeypatch, fill: float, at_front: bool):
    """The core's padding (`ops.pad_axis`) with `fill` instead of zeros, at the
    front instead of the end if `at_front`."""
    honest = ops.pad_axis

    def padding(v, axis, multiple):
        rows = honest(v, axis, multiple).shape[axis] - v.shape[axis]
        where = [(0, 0)] * v.ndim
        where[axis] = (rows, 0) if at_front else (0, rows)
        return jnp.pad(v, where, constant_values=fill)

    monkeypatch.setattr(ops, "pad_axis", padding)


FLOOR = {"mxfp8 floor": (recipes.MXFP8(scale_rounding="floor"), 32)}


def _dw_matches(name: str, m: int) -> bool:
    recipe, block = {**RECIPES, **FLOOR}[name]
    x, w, dy = _data(m)
    return np.array_equal(
        _vjp(recipe, x, w, dy)[2], _reference(recipe, x, w, dy, block)[2]
    )


# (fill, at the front, recipe, M): without a Hadamard transform the padded rows
# are sliced off after quantising, so a large fill at the end changes the last
# block's scale; with one (nvfp4) ones at the end are rotated into the real rows;
# zeros at the front shift the blocks, the Hadamard signs and the stochastic
# draws. Where one
# block of 32 holds the whole batch (mxfp8, M=20), front and end make the same
# block, which no check can tell apart: so M=40 for mxfp8 (two blocks) there.
PLANTED = [
    (1e3, False, "mxfp8", 20),  # the last block's scale (the rows are sliced off)
    (1.0, False, "nvfp4", 20),
    (0.0, True, "nvfp4", 20),  # SR and RHT
    # Zeros at the front under mxfp8()'s rounded-up scales, which saturate
    # nothing, hardly move a value: the OCP floor rule shows the shifted blocks.
    (0.0, True, "mxfp8 floor", 40),
]


@pytest.mark.first_case_quick
@pytest.mark.parametrize("fill, at_front, name, m", PLANTED)
def test_planted_padding_is_caught(planted, fill, at_front, name, m):
    _plant_padding(planted, fill, at_front)
    assert not _dw_matches(name, m)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name, m", [("mxfp8", 20), ("nvfp4", 20), ("mxfp8", 40)])
def test_the_honest_padding_passes_where_the_planted_fail(planted, name, m):
    """The planted fixture alone (the honest padding, traced again) passes the
    cases the planted defects fail, so the failures are theirs."""
    assert _dw_matches(name, m)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_planted_missing_padding_is_caught(planted, name):
    """Without the padding the blocks do not divide the batch: the quantiser (or
    the Hadamard transform's reshape into blocks) refuses it."""
    planted.setattr(ops, "pad_axis", lambda v, axis, multiple: v)
    with pytest.raises((ValueError, TypeError), match="must divide|cannot reshape"):
        _dw_matches(name, 20)


def test_a_feature_dimension_the_blocks_do_not_divide_still_raises():
    """K and N are the layer's features: padding them would change the layer, so
    the forward and input-gradient products keep their `ValueError`, at the call."""
    mx = recipes.mxfp8()
    with pytest.raises(ValueError, match=r"forward product reduces K, .* \(=48\)"):
        eqxrules.quantized_dot(jnp.ones((20, 48)), jnp.ones((48, 32)), recipe=mx)
    with pytest.raises(ValueError, match=r"input-gradient product reduces N, .*=40"):
        eqxrules.quantized_dot(jnp.ones((20, 64)), jnp.ones((64, 40)), recipe=mx)


# A quantised model: a ragged last batch, one example, per-example gradients.


def _model(axis_name="batch"):
    # No biases and tanh(0) = 0: rows of zeros stay zero through the model, so the
    # batch padded with zero rows is every layer's reference.
    # Two layers: the first one's gradient comes through the second one's
    # input-gradient product (each further layer only adds compile time).
    mlp = eqx.nn.MLP(
        64, 32, 64, 1, jnp.tanh, use_bias=False, use_final_bias=False, key=KEY
    )
    quantized = eqxrules.quantize(mlp, recipe=recipes.nvfp4(), axis_name=axis_name)
    return eqxrules.Keyed(quantized)


def _loss(model, xs, m):
    """The loss of the first `m` rows of `xs`, the model `vmap`ped over them (its
    layers' `axis_name` naming the `vmap`: one call on the batch)."""
    out = jax.vmap(ft.partial(model, key=KEY), axis_name="batch")(xs)
    return jnp.sum(out[:m] ** 2)


def _equal(a, b) -> bool:
    return all(
        np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _finite(tree) -> bool:
    return all(np.isfinite(v).all() for v in jax.tree.leaves(tree))


def _close(a, b) -> bool:
    return all(
        np.allclose(u, v, rtol=1e-5, atol=1e-6)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


@ft.cache
def _xs() -> jax.Array:
    """Built by the first test that asks (eager JAX, not at collection)."""
    return jax.random.normal(jax.random.key(8), (20, 64))


_grad = eqx.filter_jit(eqx.filter_grad(_loss))
_one = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x, key=KEY) ** 2)))


@pytest.mark.slow
def test_a_quantized_model_trains_on_a_ragged_last_batch():
    model = _model()
    got = _grad(model, _xs(), 20)  # a last batch of 20, in blocks of 16
    assert _finite(got) and _equal(got, _grad(model, _pad(_xs(), 32), 20))
    assert not _equal(got, _grad(model, _xs()[:16], 16))  # the 4 last rows count


def _one_row_reference(got, want) -> None:
    """`got`, one example's gradients, against `want`, the padded batch's: the
    last layer's weight gradient bit for bit; the others to float32 rounding, as
    their cotangents come through input-gradient products of one row (not padded,
    and summed in another order on the CPU than the padded call's 16 rows)."""
    last = lambda g: g.model.layers[-1].linear.weight  # noqa: E731
    assert np.array_equal(last(got), last(want))
    assert _close(got, want)


@pytest.mark.slow
def test_a_quantized_model_trains_on_one_example_and_per_example():
    model = _model()
    # One example: a batch of one under the named `vmap`, and the example alone
    # (the model without `axis_name`).
    batch_of_one = _grad(model, _xs()[:1], 1)
    assert _finite(batch_of_one)
    _one_row_reference(batch_of_one, _grad(model, _pad(_xs()[:1], 16), 1))
    alone = _model(axis_name=None)
    assert _equal(_one(alone, _xs()[0]), batch_of_one)

    # Per-example gradients: `vmap` of `grad` over examples, each example its own
    # call (a batch of one, padded to the block), as it is alone.
    per_example = eqx.filter_jit(eqx.filter_vmap(_one, in_axes=(None, 0)))(
        alone, _xs()[:3]
    )
    for i in range(3):
        g_i = jax.tree.map(lambda v: v[i], per_example)
        assert _finite(g_i)
        _one_row_reference(g_i, _one(alone, _xs()[i]))
        _one_row_reference(g_i, _grad(model, _pad(_xs()[i : i + 1], 16), 1))
