"""Every rule that keeps an array's shape is a quantiser: in `Quantized` and through
`quantize`, with a key split between the input quantiser, the kernel quantiser and
the layer, its value and gradients those of the same model quantised by hand. Each
check has a planted defect beside it that makes it fail."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from layer_helpers import (
    ENTRIES,
    K1,
    K2,
    KEY,
    _asks_for_key,
    _assert_trees_close,
    _assert_trees_equal,
    _differ,
    _DoubleTangent,
    _example,
    _examples,
    _NaNTangent,
    _needs_key,
    _pullback,
    _reference_kwargs,
    _sum_sin,
    _value_and_grad,
)

import eqxrules

# The slow tier: every quantiser through `quantize`. Each entry's first example also
# runs at the minimum versions in CI (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.catalogue_wide]

# -- 4. every rule that keeps an array's shape, as a quantiser ---------------------

SHAPES = ((4, 3), (3, 4), (3,), (4,))  # weights and inputs of the model 3 → 4 → 3


def _keeps_shape(rule):
    """Whether `rule` maps every weight and input of the quantised model to an array
    of the same shape and dtype."""
    for shape in SHAPES:
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        try:
            out = eqx.filter_eval_shape(lambda r, x: r(x, key=KEY), rule, x)
        except (TypeError, ValueError):
            return False
        if out != x:
            return False
    return True


QUANTIZERS = [entry for entry in ENTRIES if _keeps_shape(_examples(entry)[0])]


def test_every_rule_that_takes_any_array_is_a_quantizer():
    for entry in ENTRIES:
        if entry.elementwise or entry.module.pytree_input:
            assert entry in QUANTIZERS, entry.name


def _x_domain(rule):
    """The domain of `x`: a rule of several inputs that keeps shapes called on `x`
    alone (`safe_softmax` without `where`) draws it from its first input's."""
    domain = rule.input_domain()
    return domain.domains[0] if isinstance(domain, eqxrules.Inputs) else domain


def _float_model(rule, *, mlp=False):
    """A Sequential (or an MLP) 3 → 4 → 3 with tanh, its weights drawn from the
    rule's domain (so off its kinks)."""
    shapes = eqx.filter_eval_shape(eqx.nn.MLP, 3, 3, 4, 1, activation=jnp.tanh, key=KEY)
    layers = []
    for i, layer in enumerate(shapes.layers):
        domain = dataclasses.replace(_x_domain(rule), shape=layer.weight.shape)
        bias = np.random.default_rng(i).uniform(-0.1, 0.1, layer.bias.shape)
        params = (domain.sample(jax.random.key(30 + i)), jnp.asarray(bias, jnp.float32))
        layers.append(eqx.tree_at(lambda m: (m.weight, m.bias), layer, params))
    if mlp:
        return eqx.tree_at(lambda m: m.layers, shapes, tuple(layers))
    return eqx.nn.Sequential([layers[0], eqx.nn.Lambda(jnp.tanh), layers[1]])


def _by_hand(model, x, key, quantise):
    """`model` with each Linear's input and weight quantised by `quantise(a, key)`,
    the keys split as documented: by Sequential per layer, then by `Quantized` in
    three (input, kernel, layer)."""
    for layer, k in zip(model.layers, jax.random.split(key, len(model.layers))):
        if isinstance(layer, eqx.nn.Linear):
            k_input, k_kernel, _ = jax.random.split(k, 3)
            x = quantise(x, k_input)
            weight = quantise(layer.weight, k_kernel)
            layer = eqx.tree_at(lambda m: m.weight, layer, weight)
        x = layer(x)
    return x


def _reference_twin(rule, key):
    """The rule's references as one function: `reference_forward` for the value,
    the reference pullback for the gradient."""
    kwargs = _reference_kwargs(rule, key)

    @jax.custom_vjp
    def twin(a):
        return rule.reference_forward(a, **kwargs)

    def bwd(a, ct):
        return (_pullback(rule, a, ct, kwargs)[1],)

    twin.defvjp(lambda a: (twin(a), a), bwd)
    return twin


@eqx.filter_jit
def _quantized_results(model, float_model, mlp, rule, x, keyless):
    (loss, out), grads = _value_and_grad(model, x, K1)

    def by_hand(m):
        out = _by_hand(m, x, K1, lambda a, k: _reference_twin(rule, k)(a))
        return _sum_sin(out), out

    (expected_loss, expected_out), expected = eqx.filter_value_and_grad(
        by_hand, has_aux=True
    )(float_model)
    variants = (model(x), mlp(x, key=K1)) if keyless else None
    return (
        (out, model(x, key=K2), loss, grads),
        (expected_out, expected_loss, expected),
        variants,
    )


def _quantize(model, rule, cls):
    """`eqxrules.quantize(model)` with `rule` for both quantisers, its `Quantized`
    layers rebuilt as `cls`."""
    model = eqxrules.quantize(model, kernel_quantizer=rule, input_quantizer=rule)
    is_quantized = lambda m: isinstance(m, eqxrules.Quantized)  # noqa: E731
    return jtu.tree_map(
        lambda m: (
            cls(m.layer, kernel_quantizer=rule, input_quantizer=rule)
            if is_quantized(m)
            else m
        ),
        model,
        is_leaf=is_quantized,
    )


def check_quantized(rule, cls=eqxrules.Quantized):
    float_model = _float_model(rule)
    model = _quantize(float_model, rule, cls)
    mlp = _quantize(_float_model(rule, mlp=True), rule, cls)
    x = dataclasses.replace(_x_domain(rule), shape=(3,)).sample(jax.random.key(2))
    keyless = not _needs_key(rule)
    if not keyless:
        assert _asks_for_key(lambda: model(x)), "without a key: no clear error"
        # `eqx.nn.MLP` passes no key to its layers: the rule says so clearly.
        assert _asks_for_key(lambda: mlp(x, key=K1)), "MLP: no clear error"
    actual, expected, variants = _quantized_results(
        model, float_model, mlp, rule, x, keyless
    )
    out, out_k2, loss, grads = actual
    expected_out, expected_loss, expected = expected
    _assert_trees_close(out, expected_out, "value")
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, err_msg="loss")
    if variants is not None:
        _assert_trees_equal(variants[0], out, "the quantised value depends on the key")
        _assert_trees_equal(variants[1], out, "quantised MLP != Sequential")
    else:
        assert _differ(out, out_k2), "the quantised value ignores the key"
    for i in (0, 2):
        latent = grads.layers[i].layer
        assert np.all(np.isfinite(latent.weight)), f"layer {i}: gradient not finite"
        _assert_trees_close(latent, expected.layers[i], f"latent gradient, layer {i}")


@pytest.mark.parametrize("entry", QUANTIZERS, ids=lambda e: e.name)
def test_every_shape_keeping_rule_quantizes_with_key(entry):
    check_quantized(_example(entry, 0))


class _IgnoresKey(eqxrules.Quantized):
    # `Quantized.__call__` before it passed keys on.
    def __call__(self, x, *, key=None):
        if self.input_quantizer is not None:
            x = self.input_quantizer(x)
        return self.quantized_layer(x)


class _OneKeyForAll(eqxrules.Quantized):
    def __call__(self, x, *, key=None):
        kwargs = {} if key is None else {"key": key}
        if self.input_quantizer is not None:
            x = self.input_quantizer(x, **kwargs)
        weight = self.kernel_quantizer(self.layer.weight, **kwargs)  # pyright: ignore[reportOptionalCall]
        return eqx.tree_at(lambda m: m.weight, self.layer, weight)(x)


@pytest.mark.parametrize(
    "cls, rule, error, match",
    [
        (_IgnoresKey, eqxrules.StochasticRound(), TypeError, "needs a PRNG key"),
        (_OneKeyForAll, eqxrules.StochasticRound(), AssertionError, "value"),
        (eqxrules.Quantized, _DoubleTangent(), AssertionError, "latent gradient"),
        (eqxrules.Quantized, _NaNTangent(), AssertionError, "gradient not finite"),
    ],
    ids=["ignores-key", "one-key-for-all", "wrong-gradient", "nan-gradient"],
)
def test_planted_defects_fail_the_quantizer_check(cls, rule, error, match):
    with pytest.raises(error, match=match):
        check_quantized(rule, cls)
