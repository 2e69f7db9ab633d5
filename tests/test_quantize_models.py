"""`quantize` on whole models (issue 25 §3, and §4's weight-gradient block error):
quantisers and a recipe on one layer compose; quantising again replaces (the new
recipe or quantisers, on the layers `where` selects, given the plain layer);
convolutions a recipe leaves in float32 are warned about; a model with nothing to
quantise says so; a layer's block error names the layer and uses its own
orientation, and a batch the weight-gradient product's blocks do not divide is
padded, not an error (issue 26 §3).

Each test here failed on `625b3dc`, where the mixed model raised `AttributeError`
when called, a second recipe was ignored, convolutions stayed float32 silently,
and the block error mentioned `vmap` without one and named no layer."""

from __future__ import annotations

import functools as ft
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules import recipes

KEY = jax.random.key(5)


# The model and inputs, built by the first test that asks (eager JAX operations,
# compiled on first use: not at collection).
@ft.cache
def _mlp() -> eqx.nn.MLP:
    """64 -> 64 -> 64 -> 32."""
    return eqx.nn.MLP(64, 32, 64, 2, activation=jnp.tanh, key=KEY)


@ft.cache
def _xs() -> jax.Array:
    return jax.random.normal(jax.random.key(6), (32, 64))


SIGN = eqxrules.SteSign()


def _sign(a):
    return jnp.where(a >= 0, 1.0, -1.0)


def _by_hand(layer_fn, xs):
    """The MLP's output with each layer computed by `layer_fn(i, layer, h)`."""
    h = xs
    for i, layer in enumerate(_mlp().layers):
        h = layer_fn(i, layer, h)
        if i < len(_mlp().layers) - 1:
            h = jnp.tanh(h)
    return h


def _recipe_dot(h, weight, bias, recipe):
    return eqxrules.quantized_dot(h, weight.T, recipe=recipe) + bias


# 1. Quantisers and a recipe on one layer compose.


@pytest.mark.first_case_quick
@pytest.mark.parametrize("order", ["quantisers first", "recipe first"])
def test_quantisers_and_a_recipe_compose_on_one_layer(order):
    """Either order gives `Quantized(QuantizedLinear(linear))`, whose value is the
    recipe's product of the sign of the weight (the rule first, then the recipe),
    and whose weight gradient reaches the float weight."""
    if order == "quantisers first":
        q = eqxrules.quantize(
            eqxrules.quantize(_mlp(), kernel_quantizer=SIGN), recipe=recipes.mxfp8()
        )
    else:
        q = eqxrules.quantize(
            eqxrules.quantize(_mlp(), recipe=recipes.mxfp8()), kernel_quantizer=SIGN
        )
    for layer in q.layers:
        assert type(layer) is eqxrules.Quantized
        assert type(layer.layer) is eqxrules.QuantizedLinear
        assert type(layer.layer.linear) is eqx.nn.Linear
        assert layer.kernel_quantizer == SIGN
        assert layer.layer.recipe == recipes.mxfp8()
    got = np.asarray(q(_xs()))
    expected = _by_hand(
        lambda i, lin, h: _recipe_dot(h, _sign(lin.weight), lin.bias, recipes.mxfp8()),
        _xs(),
    )
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    # Planted: the rule dropped (the recipe alone) is another function.
    recipe_only = _by_hand(
        lambda i, lin, h: _recipe_dot(h, lin.weight, lin.bias, recipes.mxfp8()), _xs()
    )
    assert not np.allclose(got, recipe_only, atol=1e-3)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(_xs()) ** 2))(q)
    assert all(np.any(layer.layer.linear.weight != 0) for layer in grads.layers)


def test_a_recipe_and_quantisers_in_one_call_say_how_to_compose():
    with pytest.raises(ValueError, match=r"not both in one call.*quantise twice"):
        eqxrules.quantize(_mlp(), recipe=recipes.mxfp8(), kernel_quantizer=SIGN)


# 2. Quantising again replaces.


def _last(layer):
    return isinstance(layer, eqx.nn.Linear) and layer.out_features == 32


def test_a_second_recipe_replaces_the_first():
    """`identity()` for evaluation gives the float model; with `where=` (given the
    plain layer), only the selected layers change."""
    mx = eqxrules.quantize(_mlp(), recipe=recipes.mxfp8())
    plain = eqxrules.quantize(mx, recipe=recipes.identity())
    assert [layer.recipe for layer in plain.layers] == [recipes.identity()] * 3
    assert all(type(layer.linear) is eqx.nn.Linear for layer in plain.layers)
    xs, want = _xs(), jax.vmap(_mlp())(_xs())
    np.testing.assert_allclose(plain(xs), want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(mx(xs), want, atol=1e-3)  # it was MXFP8

    mixed = eqxrules.quantize(mx, recipe=recipes.fp8(), where=_last)
    kinds = [layer.recipe for layer in mixed.layers]
    assert kinds == [recipes.mxfp8(), recipes.mxfp8(), recipes.fp8()]
    expected = _by_hand(
        lambda i, lin, h: _recipe_dot(h, lin.weight, lin.bias, kinds[i]), _xs()
    )
    np.testing.assert_allclose(mixed(_xs()), expected, rtol=1e-6, atol=1e-6)
    # The paths the layers are named by follow the model.
    assert [layer.path for layer in mixed.layers] == [
        f"model.layers[{i}]" for i in range(3)
    ]


def test_second_quantisers_replace_the_first_and_keep_a_recipe():
    binary = eqxrules.quantize(_mlp(), kernel_quantizer=SIGN, input_quantizer=SIGN)
    rounded = eqxrules.quantize(binary, kernel_quantizer=eqxrules.SteRound())
    for layer in rounded.layers:
        assert type(layer.layer) is eqx.nn.Linear  # replaced, not nested
        assert layer.kernel_quantizer == eqxrules.SteRound()
        assert layer.input_quantizer is None  # what the call makes of a plain layer
    last = eqxrules.quantize(binary, kernel_quantizer=eqxrules.SteRound(), where=_last)
    assert [layer.kernel_quantizer for layer in last.layers] == [SIGN, SIGN] + [
        eqxrules.SteRound()
    ]
    both = eqxrules.quantize(
        eqxrules.quantize(binary, recipe=recipes.mxfp8()), recipe=recipes.fp8()
    )
    again = eqxrules.quantize(both, kernel_quantizer=eqxrules.SteRound())
    for layer in again.layers:
        assert layer.layer.recipe == recipes.fp8()
        assert layer.kernel_quantizer == eqxrules.SteRound()
        assert type(layer.layer.linear) is eqx.nn.Linear


@pytest.mark.slow
def test_requantising_with_a_sign_after_relu_warns():
    """The new input quantiser is put on, so the constant-sign warning holds for it
    (on `625b3dc` nothing was put on, and nothing warned)."""
    relu = eqx.nn.MLP(4, 3, 8, 2, key=KEY)
    binary = eqxrules.quantize(relu, kernel_quantizer=SIGN)
    with pytest.warns(eqxrules.NonNegativeSignInputWarning, match="layers\\[1\\]"):
        again = eqxrules.quantize(binary, input_quantizer=SIGN)
    assert all(layer.input_quantizer == SIGN for layer in again.layers)


# 3. Convolutions, and models with nothing to quantise.


def _cnn():
    k1, k2, k3 = jax.random.split(KEY, 3)
    return eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(32, 32, 3, key=k1),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(32 * 6 * 6, 32, key=k3),  # 8x8 images, 32 channels
            eqx.nn.Lambda(jnp.tanh),
            eqx.nn.ConvTranspose1d(1, 1, 1, key=k2),
        ]
    )


def test_a_recipe_computes_convolutions_and_warns_of_transposed_ones():
    cnn = _cnn()
    with pytest.warns(UserWarning) as caught:
        q = eqxrules.quantize(cnn, recipe=recipes.mxfp8())
    assert len(caught) == 1
    message = str(caught[0].message)
    for part in ("`model.layers[4]`", "ConvTranspose", "stay in float32"):
        assert part in message, message
    assert "`model.layers[0]`" not in message
    assert type(q.layers[2]) is eqxrules.QuantizedLinear
    assert type(q.layers[0]) is eqxrules.QuantizedConv
    assert q.layers[0].path == "model.layers[0]"
    # With `where=`, the choice is the user's: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqxrules.quantize(cnn, recipe=recipes.mxfp8(), where=_last)
    # A transposed convolution inside a `Quantized` is named by its path too.
    binary = eqxrules.quantize(cnn, kernel_quantizer=SIGN, where=_last)
    with pytest.warns(UserWarning, match=r"`model.layers\[4\]`"):
        both = eqxrules.quantize(binary, recipe=recipes.mxfp8())
    assert type(both.layers[2].layer) is eqxrules.QuantizedLinear


def test_a_model_with_nothing_to_quantise_says_what_it_lacks():
    convs = eqx.nn.Sequential([eqx.nn.ConvTranspose1d(4, 4, 3, key=KEY)])
    with pytest.raises(ValueError) as info:
        eqxrules.quantize(convs, recipe=recipes.mxfp8())
    message = str(info.value)
    assert "has no `eqx.nn.Linear` or `eqx.nn.Conv`" in message
    assert "transposed convolutions, `model.layers[0]`" in message
    assert "where" not in message, message
    norm = eqx.nn.Sequential([eqx.nn.LayerNorm(4), eqx.nn.Embedding(3, 4, key=KEY)])
    with pytest.raises(ValueError) as info:
        eqxrules.quantize(norm, kernel_quantizer=SIGN)
    message = str(info.value)
    assert "has no `eqx.nn.Linear` or `eqx.nn.Conv`" in message
    assert "where" not in message, message
    for kwargs in ({"recipe": recipes.mxfp8()}, {"kernel_quantizer": SIGN}):
        with pytest.raises(ValueError, match="no layer of `model` .* matches `where`"):
            eqxrules.quantize(_mlp(), where=lambda layer: False, **kwargs)


# 4. The block errors.


@pytest.mark.slow  # the quick tier's 4 minutes
def test_a_ragged_batch_is_padded_and_a_feature_dimension_still_raises():
    """A batch of 10 (no block of 32 divides it) differentiates, as one call on
    the batch or vmapped with the layers' `axis_name` naming the `vmap`, as the
    batch padded with zero rows to 32 does (main raised a `ValueError`
    here); a layer whose features the blocks do not divide is still an error
    naming the layer, when quantised. Without biases (tanh(0) = 0), the padded
    rows stay zero through the model, so the padded batch is every layer's
    reference."""
    mlp = eqx.nn.MLP(
        64, 32, 64, 2, jnp.tanh, use_bias=False, use_final_bias=False, key=KEY
    )
    q = eqxrules.quantize(mlp, recipe=recipes.mxfp8())
    named = eqxrules.quantize(mlp, recipe=recipes.mxfp8(), axis_name="batch")
    xs = jax.random.normal(jax.random.key(6), (10, 64))
    padded = jnp.concatenate([xs, jnp.zeros((22, 64))])
    want = eqx.filter_grad(lambda m: jnp.sum(m(padded)[:10]))(q)
    for model, loss in (
        (q, lambda m: jnp.sum(m(xs))),
        (named, lambda m: jnp.sum(jax.vmap(m, axis_name="batch")(xs))),
    ):
        got = eqx.filter_grad(loss)(model)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.array_equal(g, r)
    wide = eqx.nn.MLP(64, 32, 40, 1, key=KEY)  # 40 hidden features: no block of 32
    with pytest.raises(ValueError) as info:
        eqxrules.quantize(wide, recipe=recipes.mxfp8())
    message = str(info.value)
    assert "the layer at `model.layers[0]`" in message, message
    assert "reduces its `out_features` (=40)" in message, message


MXFP8 = recipes.mxfp8()


def test_a_layer_block_error_speaks_of_the_layer_in_its_own_orientation():
    """`eqx.nn.Linear(2048, 10)`: its weight is (10, 2048); the error names
    `out_features`, never `w`'s axes (the transpose of the weight)."""
    head = eqx.nn.Sequential([eqx.nn.Linear(2048, 10, key=KEY)])
    with pytest.raises(ValueError) as info:
        eqxrules.quantize(head, recipe=MXFP8)
    message = str(info.value)
    for part in (
        "`quantize`: the layer at `model.layers[0]`",
        "`in_features`=2048 and `out_features`=10, weight shape (10, 2048)",
        "input-gradient product reduces its `out_features` (=10)",
    ):
        assert part in message, message
    assert "`w`" not in message, message
    with pytest.raises(ValueError, match=r"`QuantizedLinear`: `linear` \(an `eqx"):
        eqxrules.QuantizedLinear(head.layers[0], MXFP8)
