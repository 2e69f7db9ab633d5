"""Recipes in models with convolutions (issue 26 §2): `quantize(model, recipe=...)`
reaches `eqx.nn.Conv` (1-D to 3-D) as `QuantizedConv`, `Keyed` keys it, a recipe
may be given per layer as a function of its path, and a ragged last batch trains.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules import recipes

KEY = jax.random.key(5)
NVFP4 = dataclasses.replace(recipes.nvfp4(), hadamard=None)  # draws: SR


def _cnn(dims: int = 2, key=KEY):
    k = jax.random.split(key, 3)
    conv = {1: eqx.nn.Conv1d, 2: eqx.nn.Conv2d, 3: eqx.nn.Conv3d}[dims]
    return eqx.nn.Sequential(
        [
            conv(32, 32, 3, padding=1, key=k[0]),
            eqx.nn.Lambda(jax.nn.relu),
            conv(32, 32, 3, padding=1, groups=1, key=k[1]),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(32 * 4**dims, 32, key=k[2]),
        ]
    )


def _x(dims: int, batch: int = 3):
    return jax.random.normal(jax.random.key(dims), (batch, 32) + (4,) * dims)


@pytest.mark.slow
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_the_identity_recipe_is_the_plain_model_bit_for_bit(dims):
    """The convolutions (a `QuantizedLinear` computes `x · wᵀ`, which differs in
    rounding from `eqx.nn.Linear`'s `w · x`)."""
    cnn = eqx.nn.Sequential(list(_cnn(dims).layers[:3]))
    q = eqxrules.quantize(cnn, recipe=recipes.identity(), axis_name="batch")
    assert [type(layer) for layer in q.layers[::2]] == [eqxrules.QuantizedConv] * 2
    x = _x(dims)

    def loss(model):
        return jnp.sum(jax.vmap(model, axis_name="batch")(x) ** 2)

    got, want = eqx.filter_value_and_grad(loss)(q), eqx.filter_value_and_grad(loss)(cnn)
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(got[1].layers[0].conv.weight, want[1].layers[0].weight)
    assert np.array_equal(got[1].layers[2].conv.bias, want[1].layers[2].bias)


@pytest.mark.slow
def test_a_conv_layer_is_quantized_conv_on_the_batch():
    """Under a `vmap` its `axis_name` names, a `QuantizedConv`'s products run on the
    whole batch: the same value and weight gradient as `quantized_conv` called on
    the batch."""
    conv = _cnn(2).layers[0]
    layer = eqxrules.QuantizedConv(conv, recipes.mxfp8(), axis_name="batch")
    x = _x(2, 5)

    def mapped(w):
        model = eqx.tree_at(lambda c: c.conv.weight, layer, w)
        return jnp.sum(jax.vmap(model, axis_name="batch")(x))

    def batch(w):
        y = eqxrules.quantized_conv(
            x, w, (1, 1), ((1, 1), (1, 1)), recipe=recipes.mxfp8()
        )
        return jnp.sum(y + conv.bias)

    assert np.array_equal(jax.grad(mapped)(conv.weight), jax.grad(batch)(conv.weight))
    # A batch given to the layer itself (no `axis_name`): the same.
    plain = eqxrules.QuantizedConv(conv, recipes.mxfp8())
    assert np.array_equal(plain(x), jax.vmap(layer, axis_name="batch")(x))


@pytest.mark.slow
def test_keyed_keys_every_conv_and_a_recipe_that_draws_needs_one():
    q = eqxrules.quantize(_cnn(2), recipe=NVFP4)
    x = _x(2)
    with pytest.raises(TypeError, match=r"`QuantizedConv`: its recipe draws"):
        jax.vmap(q)(x)
    keyed = eqxrules.Keyed(q)

    @eqx.filter_jit  # one program per model, not op by op
    def grad(keyed, key):
        # NVFP4 rounds the gradients stochastically: the draws show in them.
        return jax.grad(
            lambda x: jnp.sum(jax.vmap(lambda xi: keyed(xi, key=key))(x) ** 2)
        )(x)

    def run(key):
        return grad(keyed, key)

    assert np.array_equal(run(KEY), run(KEY))
    assert not np.array_equal(run(KEY), run(jax.random.key(6)))
    # The key reaches the convolutions: with the convolutions' recipe rounding
    # to nearest, another key changes nothing.
    nearest = dataclasses.replace(NVFP4, gradient_rounding="nearest")
    q = eqxrules.quantize(q, recipe=nearest, where=lambda n: isinstance(n, eqx.nn.Conv))
    q = eqxrules.quantize(
        q, recipe=nearest, where=lambda n: isinstance(n, eqx.nn.Linear)
    )
    keyed = eqxrules.Keyed(q)
    assert np.array_equal(run(KEY), run(jax.random.key(6)))


def test_a_recipe_per_layer_by_its_path():
    cnn = _cnn(2)
    seen = []

    def recipe(path):
        seen.append(path)
        return {"layers[0]": None, "layers[4]": recipes.mxfp8()}.get(path, NVFP4)

    q = eqxrules.quantize(cnn, recipe=recipe)
    assert seen == ["layers[0]", "layers[2]", "layers[4]"]
    assert type(q.layers[0]) is eqx.nn.Conv2d
    assert q.layers[2].recipe == NVFP4 and q.layers[4].recipe == recipes.mxfp8()
    # Re-quantising replaces a layer's recipe; `where` sees the plain layer.
    again = eqxrules.quantize(
        q, recipe=recipes.fp8(), where=lambda n: isinstance(n, eqx.nn.Conv)
    )
    assert type(again.layers[0]) is eqxrules.QuantizedConv
    assert again.layers[2].recipe == recipes.fp8()
    assert again.layers[2].conv.weight is q.layers[2].conv.weight
    assert again.layers[4].recipe == recipes.mxfp8()


@pytest.mark.slow
def test_a_ragged_last_batch_trains():
    """3 examples of 4x4: the weight-gradient products contract 3·16 = 48
    positions, which blocks of 32 do not divide (padded with zeros)."""
    q = eqxrules.Keyed(eqxrules.quantize(_cnn(2), recipe=NVFP4))
    x = _x(2, 3)

    @eqx.filter_jit
    def grads(model, key):
        return eqx.filter_grad(
            lambda m: jnp.sum(jax.vmap(lambda xi: m(xi, key=key))(x) ** 2)
        )(model)

    g = grads(q, KEY)
    w = g.model.layers[2].conv.weight
    assert w.shape == (32, 32, 3, 3) and bool(jnp.all(jnp.isfinite(w)))
    assert float(jnp.abs(w).sum()) > 0


def test_what_a_recipe_cannot_compute_is_a_clear_error():
    cnn = _cnn(2)
    with pytest.raises(ValueError, match=r"`model.layers\[0\]`.*random Hadamard"):
        eqxrules.quantize(cnn, recipe=recipes.nvfp4())
    odd = eqx.nn.Sequential([eqx.nn.Conv1d(4, 32, 3, key=KEY)])
    with pytest.raises(ValueError, match=r"input features \(=4\).*Leave it out"):
        eqxrules.quantize(odd, recipe=recipes.mxfp8())
    circular = eqx.nn.Conv1d(32, 32, 3, padding_mode="CIRCULAR", key=KEY)
    with pytest.raises(ValueError, match=r"`padding_mode`='CIRCULAR'"):
        eqxrules.QuantizedConv(circular, recipes.mxfp8())
    with pytest.raises(TypeError, match=r"`conv` \(a Linear\) must be an `eqx.nn"):
        eqxrules.QuantizedConv(eqx.nn.Linear(2, 2, key=KEY), recipes.mxfp8())  # type: ignore
    layer = eqxrules.QuantizedConv(cnn.layers[0], recipes.mxfp8())
    with pytest.raises(ValueError, match=r"`x` \(shape \(32,\)\) must have rank 3"):
        layer(jnp.ones(32))
