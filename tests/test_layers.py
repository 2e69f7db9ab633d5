"""`Quantized` and `quantize`: the value is the layer on the quantised weight and
input; gradients reach the latent weights through the quantiser's rule; whole models
(an MLP, a small CNN) are wrapped in one call."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqxrules


def _build(make, seed=0):
    """`make(key)` with numpy-drawn parameters: tracing the constructor costs nothing,
    where running it compiles a PRNG program per parameter shape."""
    rng = np.random.default_rng(seed)
    shapes = eqx.filter_eval_shape(make, jax.random.key(0))

    def fill(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jnp.asarray(rng.uniform(-0.5, 0.5, leaf.shape), leaf.dtype)
        return leaf

    return jtu.tree_map(fill, shapes)


def _normal(seed, shape, scale=1.0):
    return jnp.asarray(
        scale * np.random.default_rng(seed).normal(size=shape), jnp.float32
    )


def _sign(x):
    return jnp.where(x >= 0, 1.0, -1.0)


def _with_weight(layer, weight):
    return eqx.tree_at(lambda m: m.weight, layer, weight)


def _inflate(layer):
    # Latent weights spread over [-3, 3], so the STE's clip window matters, and two
    # of them exactly on its boundary (inclusive: they get the gradient).
    w = 3 * layer.weight / jnp.max(jnp.abs(layer.weight))
    w = w.reshape(-1).at[:2].set(jnp.array([1.0, -1.0])).reshape(w.shape)
    return _with_weight(layer, w)


LAYERS = {
    "Linear": (lambda k: eqx.nn.Linear(5, 3, key=k), (5,)),
    "Conv1d": (lambda k: eqx.nn.Conv1d(2, 3, 3, key=k), (2, 9)),
    "Conv2d": (lambda k: eqx.nn.Conv2d(2, 3, 3, padding=1, key=k), (2, 5, 5)),
    "Conv3d": (lambda k: eqx.nn.Conv3d(1, 2, 2, key=k), (1, 4, 4, 4)),
}


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(LAYERS))
def test_quantized_value_and_gradients(name):
    make, shape = LAYERS[name]
    layer = _inflate(_build(make))
    x = _normal(1, shape, 2.0)
    q = eqxrules.Quantized(
        layer, kernel_quantizer=eqxrules.SteSign(), input_quantizer=eqxrules.SteSign()
    )
    binary = _with_weight(layer, _sign(layer.weight))

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x)))

    @eqx.filter_jit
    def value_and_grads(model, x):
        return model(x), jax.grad(loss, argnums=(0, 1))(model, x)

    out, (g_model, g_x) = value_and_grads(q, x)
    out_binary, (g_binary, g_bx) = value_and_grads(binary, _sign(x))
    np.testing.assert_allclose(out, out_binary, rtol=1e-6)
    assert set(np.unique(np.asarray(q.quantized_layer.weight))) == {-1.0, 1.0}
    # Through SteSign: the gradient w.r.t. the binary weight, where |w| <= 1.
    inside = np.abs(np.asarray(layer.weight)) <= 1
    assert 0 < inside.mean() < 1 and inside.reshape(-1)[:2].all()
    np.testing.assert_allclose(
        g_model.layer.weight, np.where(inside, g_binary.weight, 0), rtol=1e-5
    )
    np.testing.assert_allclose(
        g_x, np.where(np.abs(np.asarray(x)) <= 1, g_bx, 0), rtol=1e-5
    )
    np.testing.assert_allclose(g_model.layer.bias, g_binary.bias, rtol=1e-5)


def test_quantized_without_quantizers_is_the_layer():
    layer = _build(lambda k: eqx.nn.Linear(4, 2, key=k))
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(eqxrules.Quantized(layer)(x), layer(x))


@pytest.mark.slow
def test_quantized_with_other_rules():
    layer = _inflate(_build(lambda k: eqx.nn.Linear(6, 2, key=k)))
    x = jnp.linspace(-1.5, 1.5, 6)
    q = eqxrules.Quantized(
        layer,
        kernel_quantizer=eqxrules.MagnitudeAwareSign(),
        input_quantizer=eqxrules.SteQuantize(bits=2),
    )
    w = layer.weight
    scale = jnp.mean(jnp.abs(w), axis=0, keepdims=True)
    levels = jnp.array([-1.0, -1 / 3, 1 / 3, 1.0])
    xq = levels[jnp.argmin(jnp.abs(jnp.clip(x, -1, 1)[:, None] - levels), axis=1)]
    np.testing.assert_allclose(
        q(x), _with_weight(layer, scale * _sign(w))(xq), rtol=1e-5
    )


def test_quantized_rejects_a_layer_without_weight_and_bad_quantizers():
    with pytest.raises(TypeError, match="`Quantized`: `layer` .* must have a `weight`"):
        eqxrules.Quantized(eqx.nn.Lambda(jnp.tanh))
    layer = _build(lambda k: eqx.nn.Linear(2, 2, key=k))
    with pytest.raises(
        TypeError, match="`kernel_quantizer` \\(=1.0\\) must be callable"
    ):
        eqxrules.Quantized(layer, kernel_quantizer=1.0)  # pyright: ignore[reportArgumentType]


def _mlp():
    return _build(lambda k: eqx.nn.MLP(4, 3, 8, 2, activation=jnp.tanh, key=k), 3)


def test_quantize_mlp_wraps_every_linear_and_matches_by_hand():
    mlp = _mlp()
    binary = eqxrules.quantize(
        mlp, kernel_quantizer=eqxrules.SteSign(), input_quantizer=eqxrules.SteSign()
    )
    assert all(isinstance(layer, eqxrules.Quantized) for layer in binary.layers)
    x = jnp.array([0.3, -1.2, 0.0, 2.0])
    h = x
    for i, layer in enumerate(mlp.layers):
        h = _with_weight(layer, _sign(layer.weight))(_sign(h))
        if i < len(mlp.layers) - 1:
            h = jnp.tanh(h)
    np.testing.assert_allclose(binary(x), h, rtol=1e-6)

    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2)))(binary)
    for layer in grads.layers:
        assert np.any(np.asarray(layer.layer.weight) != 0)


def test_quantize_twice_does_not_wrap_twice_and_where_selects():
    mlp = _mlp()
    once = eqxrules.quantize(mlp, kernel_quantizer=eqxrules.SteSign())
    twice = eqxrules.quantize(once, kernel_quantizer=eqxrules.SteSign())
    assert all(type(layer.layer) is eqx.nn.Linear for layer in twice.layers)
    first = eqxrules.quantize(
        mlp, kernel_quantizer=eqxrules.SteSign(), where=lambda m: m is mlp.layers[0]
    )
    kinds = [type(layer) for layer in first.layers]
    assert kinds == [eqxrules.Quantized, eqx.nn.Linear, eqx.nn.Linear]
    with pytest.raises(ValueError, match="`quantize`: no layer of `model`"):
        eqxrules.quantize(mlp, where=lambda m: False)


def _cnn(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(1, 4, 3, key=k1),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Conv2d(4, 4, 3, key=k2),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(4 * 4 * 4, 3, key=k3),
        ]
    )


@pytest.mark.slow
def test_quantize_small_cnn_matches_and_learns():
    cnn = _build(_cnn, 4)
    binary = eqxrules.quantize(cnn, kernel_quantizer=eqxrules.SteSign())
    kinds = [type(layer).__name__ for layer in binary.layers]
    assert kinds == ["Quantized", "Lambda", "Quantized", "Lambda", "Quantized"]
    x = _normal(5, (16, 1, 8, 8))
    by_hand = eqx.nn.Sequential(
        [
            _with_weight(layer, _sign(layer.weight))
            if hasattr(layer, "weight")
            else layer
            for layer in cnn.layers
        ]
    )
    forward = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    np.testing.assert_allclose(forward(binary, x), forward(by_hand, x), rtol=1e-5)

    y = jnp.asarray(np.random.default_rng(6).integers(0, 3, 16))
    optim = optax.adam(1e-2)

    def loss(model):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqx.filter_jit
    def step(model, state):
        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, state = optim.update(grads, state)
        return eqx.apply_updates(model, updates), state, value

    state = optim.init(eqx.filter(binary, eqx.is_array))
    losses = []
    for _ in range(30):
        binary, state, value = step(binary, state)
        losses.append(float(value))
    assert losses[-1] < 0.7 * losses[0]


class _DropoutLinear(eqx.Module):
    """A layer with a `weight` that takes a key: dropout on its output."""

    weight: jax.Array

    def __call__(self, x, *, key=None):
        return eqx.nn.Dropout(0.5)(self.weight @ x, inference=key is None, key=key)


class _UnsplitKey(eqxrules.Quantized):
    # Planted defect: the whole key goes to the layer.
    def __call__(self, x, *, key=None):
        return self.quantized_layer(x, key=key)


def _check_key_split(cls):
    layer = _DropoutLinear(_normal(7, (6, 4)))
    x = _normal(8, (4,))
    q = cls(layer, kernel_quantizer=eqxrules.SteSign())
    binary = _with_weight(layer, _sign(layer.weight))
    key = jax.random.key(9)
    # The key is split in three (input quantiser, kernel quantiser, layer).
    np.testing.assert_array_equal(
        q(x, key=key), binary(x, key=jax.random.split(key, 3)[2])
    )
    np.testing.assert_array_equal(q(x), binary(x))


@pytest.mark.slow
def test_quantized_passes_the_layer_its_part_of_the_key():
    _check_key_split(eqxrules.Quantized)
    with pytest.raises(AssertionError):
        _check_key_split(_UnsplitKey)


# -- the sign-after-ReLU warning -----------------------------------------------------

_Warning = eqxrules.NonNegativeSignInputWarning


def _relu_mlp(activation=None, cls=eqx.nn.MLP):
    """MLP 4 → 8 → 8 → 3, with Equinox's default activation (ReLU) if `None`."""
    kwargs = {} if activation is None else {"activation": activation}
    return _build(lambda k: cls(4, 3, 8, 2, key=k, **kwargs), 3)


def _caught(build):
    """Every warning raised while `build()` runs (any kind: none may go unseen)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return caught


def _check_warns(build, *parts):
    """`build()` warns once, a `NonNegativeSignInputWarning` whose message has
    every one of `parts`."""
    caught = _caught(build)
    assert [w.category for w in caught] == [_Warning], caught
    message = str(caught[0].message)
    for part in parts:
        assert part in message, (part, message)


def _check_silent(build):
    caught = _caught(build)
    assert caught == [], [str(w.message) for w in caught]


SIGNS = {
    "SteSign": eqxrules.SteSign(),
    "SteSign(clip_value=None)": eqxrules.SteSign(clip_value=None),
    "ApproxSign": eqxrules.ApproxSign(),
    "SwishSign": eqxrules.SwishSign(),
    "QuadraticSign": eqxrules.QuadraticSign(),
    "ste_sign": eqxrules.ste_sign,
}
NON_NEGATIVE = {
    "jax.nn.relu": None,  # Equinox's default
    "jax.nn.sigmoid": jax.nn.sigmoid,
    "jax.nn.softplus": jax.nn.softplus,
    "jnp.abs": jnp.abs,
}


@pytest.mark.parametrize("sign", list(SIGNS))
@pytest.mark.parametrize("activation", list(NON_NEGATIVE))
def test_quantize_warns_when_a_sign_sees_only_non_negative_inputs(sign, activation):
    mlp = _relu_mlp(NON_NEGATIVE[activation])
    _check_warns(
        lambda: eqxrules.quantize(mlp, input_quantizer=SIGNS[sign]),
        "`quantize`",
        "of `model.layers[1]`, `model.layers[2]` sees",
        f"`{activation}`",
        "+1 everywhere",
        "`jax.nn.hard_tanh`",
        "`where=`",
    )


def test_the_warning_is_true_and_names_only_the_layers_after_the_activation():
    """The trap's output is the same for inputs of both signs (the tanh MLP's is
    not: the check can fail); with `where`, only the chosen layer is named, and an
    MLP inside another model is found, with its path."""

    def outputs(mlp):
        binary = eqxrules.quantize(mlp, input_quantizer=eqxrules.SteSign())
        x = jnp.array([[0.3, -1.2, 0.5, 2.0], [-0.7, 0.4, -2.0, 1.0]])
        return np.asarray(jax.vmap(binary)(x))

    with pytest.warns(_Warning):
        out = outputs(_relu_mlp())
    np.testing.assert_array_equal(out[0], out[1])
    out = outputs(_mlp())  # tanh: no warning, and the outputs differ
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(out[0], out[1])

    mlp = _relu_mlp()
    last = mlp.layers[2]
    _check_warns(
        lambda: eqxrules.quantize(
            mlp, input_quantizer=eqxrules.SteSign(), where=lambda m: m is last
        ),
        "of `model.layers[2]` sees",
    )
    nested = eqx.nn.Sequential([eqx.nn.Lambda(jnp.tanh), mlp])
    _check_warns(
        lambda: eqxrules.quantize(nested, input_quantizer=eqxrules.SteSign()),
        "of `model.layers[1].layers[1]`, `model.layers[1].layers[2]` sees",
        "of the `eqx.nn.MLP` at `model.layers[1]`",
    )


def test_planted_defect_a_detector_that_misses_relu_fails_the_warning_check(
    monkeypatch,
):
    mlp = _relu_mlp()
    monkeypatch.setattr(eqxrules._sign_warning, "_NON_NEGATIVE", ())
    with pytest.raises(AssertionError):
        _check_warns(lambda: eqxrules.quantize(mlp, input_quantizer=eqxrules.SteSign()))


class _SignedMLP(eqx.nn.MLP):
    """An MLP subclass: it may call its layers otherwise, so nothing is proved."""


def _quantize_case(mlp, **kwargs):
    return lambda: eqxrules.quantize(mlp, **kwargs)


def _first_only(mlp):
    first = mlp.layers[0]
    return lambda m: m is first


def _second_only(mlp):
    second = mlp.layers[1]
    return lambda m: m is second


_S = eqxrules.SteSign()
# Each case where nothing is provable (so no warning), beside its twin that differs
# in the one thing that makes it provable: the silence check fails on the twin. Each
# is built by the test from a ReLU MLP `relu` (not at collection: its arrays are put
# on the device, a compilation per new shape).
SILENT = {
    "tanh activation": lambda relu: (
        _quantize_case(_mlp(), input_quantizer=_S),
        _quantize_case(relu, input_quantizer=_S),
    ),
    "first layer only": lambda relu: (
        _quantize_case(relu, input_quantizer=_S, where=_first_only(relu)),
        _quantize_case(relu, input_quantizer=_S, where=_second_only(relu)),
    ),
    "a weight quantiser": lambda relu: (
        _quantize_case(relu, kernel_quantizer=_S),
        _quantize_case(relu, input_quantizer=_S),
    ),
    "Heaviside, 0 or 1 after ReLU": lambda relu: (
        _quantize_case(relu, input_quantizer=eqxrules.SteHeaviside()),
        _quantize_case(relu, input_quantizer=eqxrules.ApproxSign()),
    ),
    "an MLP subclass": lambda relu: (
        _quantize_case(_relu_mlp(cls=_SignedMLP), input_quantizer=_S),
        _quantize_case(_relu_mlp(), input_quantizer=_S),
    ),
}


@pytest.mark.parametrize("case", list(SILENT))
def test_quantize_does_not_warn_where_nothing_is_proved(case):
    silent, twin = SILENT[case](_relu_mlp())
    _check_silent(silent)
    with pytest.raises(AssertionError):  # the planted defect: the provable twin
        _check_silent(twin)
