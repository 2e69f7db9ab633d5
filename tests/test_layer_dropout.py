"""A key reaches dropout inside every wrapper rule (`Frozen`, `StopGradient`,
`ScaledModel`), and `eqx.nn.inference_mode` switches that dropout off, as in any
Equinox model. Each check has a planted defect beside it that makes it fail."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from conftest import call
from layer_helpers import (
    ENTRIES,
    K1,
    K2,
    KEY,
    X,
    _assert_trees_close,
    _assert_trees_equal,
    _differ,
    _example,
    _examples,
    _HostNoise,
    _linear,
    _needs_key,
    _nonzero,
    _pullback,
    _reference_kwargs,
    _sequential,
    _sum_sin,
)

import eqxrules

# The slow tier: rules around dropout, inference mode. Each entry's first example also
# runs at the minimum versions in CI (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.catalogue_wide]

# -- 3. a key reaches dropout inside a wrapper rule; inference_mode switches it off --


@eqx.filter_jit
def _run(model, x, k1, k2, plain=None):
    """What the dropout checks read off `model`, in one compilation: the value and
    gradients (of the model and `x`) with `k1`, the value with `k2`, and the
    inference-mode values with `k1`, `k2` and no key. Given `plain` (the rule
    without dropout), also its value and the rule's references with `k1`."""

    def loss(model_and_x):
        model, x = model_and_x
        out = call(model, x, key=k1)
        return _sum_sin(out), out

    (_, out), (grads, g_x) = eqx.filter_value_and_grad(loss, has_aux=True)((model, x))
    inference = eqx.nn.inference_mode(model)
    results: dict[str, Any] = dict(
        out=out,
        grads=grads,
        g_x=g_x,
        out_k2=call(model, x, key=k2),
        inference=[call(inference, x, key=k) for k in (k1, k2, None)],
    )
    if plain is not None:
        kwargs = _reference_kwargs(model, k1)
        reference = call(model.reference_forward, x, **kwargs)
        ct = jtu.tree_map(jnp.cos, reference)
        results["reference"] = (reference, *_pullback(model, x, ct, kwargs))
        results["plain"] = call(plain, x)
    return results


def _sub_models(rule):
    """The fields of `rule` holding an `eqx.Module` with parameters."""
    return [
        f.name
        for f in dataclasses.fields(rule)
        if isinstance(getattr(rule, f.name), eqx.Module)
        and jtu.tree_leaves(eqx.filter(getattr(rule, f.name), eqx.is_array))
    ]


WRAPPER_CASES = [
    pytest.param(entry, i, field, id=f"{entry.name}-{i}-{field}")
    for entry in ENTRIES
    for i, rule in enumerate(_examples(entry))
    for field in _sub_models(rule)
]


def _asks_for_dropout_key(call):
    try:
        call()
    except RuntimeError as e:
        return "Dropout requires a key" in str(e)
    return False


def check_key_reaches_dropout(rule, plain):
    """`rule` wraps a sub-model that applies dropout first; `plain` is the same rule
    around the sub-model without it."""
    x = rule.input_domain().sample(jax.random.key(1))
    kwargs = _reference_kwargs(rule, K1)
    assert kwargs, "the rule wraps a module, but its references take no key"
    r = _run(rule, x, K1, K2, plain=plain)
    _assert_trees_close(call(rule, x, key=K1), r["out"], "same key, other mask (eager)")
    assert _differ(r["out"], r["out_k2"]), "the mask ignores the key"
    reference, expected_rule, expected_x = r["reference"]
    _assert_trees_close(r["out"], reference, "value != reference with the same key")
    for value in r["inference"]:
        _assert_trees_equal(value, r["plain"], "inference_mode: dropout still applied")
    _assert_trees_close(r["grads"], expected_rule, "gradient of the rule's parameters")
    _assert_trees_close(r["g_x"], expected_x, "gradient of x")
    assert _asks_for_dropout_key(lambda: call(rule, x)), (
        "without a key, dropout still ran"
    )


@pytest.mark.parametrize("entry, index, field", WRAPPER_CASES)
def test_key_reaches_dropout_inside_every_wrapper_rule(entry, index, field):
    plain = _example(entry, index)
    sub = eqx.nn.Sequential([eqx.nn.Dropout(0.5), getattr(plain, field)])
    check_key_reaches_dropout(
        eqx.tree_at(lambda r: getattr(r, field), plain, sub), plain
    )


def _block():
    """A sub-model with dropout between two Linears: 3 → 4 → 3."""
    return eqx.nn.Sequential(
        [_linear(3, 4, 20), eqx.nn.Dropout(0.5), _linear(4, 3, 21)]
    )


class _Plain(eqx.Module):
    """`block(x / scale, key=key)`, differentiated by plain autodiff."""

    block: eqx.nn.Sequential
    scale: float = 1.0

    def __call__(self, x, *, key=None):
        return self.block(x / self.scale, key=key)


def _in_sequential(layer):
    return eqx.nn.Sequential([_linear(3, 3, 22), layer, _linear(3, 2, 23)])


def _check_wrapper_with_dropout(wrapper, scale):
    """`Linear → wrapper(block with dropout) → Linear` against the same Sequential
    with the block called plainly; returns both runs' gradients."""
    model, plain = _in_sequential(wrapper), _in_sequential(_Plain(_block(), scale))
    r, p = _run(model, X, K1, K2), _run(plain, X, K1, K2)
    _assert_trees_close(model(X, key=K1), r["out"], "same key, other mask (eager)")
    assert _differ(r["out"], r["out_k2"]), "the mask ignores the key"
    _assert_trees_close(r["out"], p["out"], "value != the plain block's")
    for value in r["inference"]:
        _assert_trees_equal(value, r["inference"][0], "inference_mode: keyed")
    for i in (0, 2):  # through the block's input the gradient flows as usual
        _assert_trees_close(r["grads"].layers[i], p["grads"].layers[i], f"layer {i}")
    return r["grads"].layers[1], p["grads"].layers[1].block


def check_frozen_with_dropout(frozen_cls):
    got, plain = _check_wrapper_with_dropout(frozen_cls(_block()), 1.0)
    assert _nonzero(plain), "the block has no gradient to block"
    assert not _nonzero(got), "Frozen: the module's parameters got gradient"


def check_scaled_model_with_dropout(scaled_cls):
    got, plain = _check_wrapper_with_dropout(scaled_cls(_block(), 2.0), 2.0)
    assert _nonzero(got.sub_model), "ScaledModel: the sub-model got no gradient"
    _assert_trees_close(got.sub_model, plain, "ScaledModel: sub-model gradient")


def test_frozen_with_dropout_inside_in_sequential():
    check_frozen_with_dropout(eqxrules.Frozen)


def test_scaled_model_with_dropout_inside_in_sequential():
    check_scaled_model_with_dropout(eqxrules.ScaledModel)


def _with_dropouts(rule, dropout: Callable[..., Any] = eqx.nn.Dropout(0.5)):
    """The Sequential of `check_in_sequential` with dropout after the first Linear
    and `dropout` before the last."""
    layers = _sequential(rule)[0].layers
    return eqx.nn.Sequential(
        [layers[0], eqx.nn.Dropout(0.5), *layers[1:-1], dropout, layers[-1]]
    )


@eqx.filter_jit
def _inference_values(model, k1, k2, keyless):
    """In one compilation: `model`'s values with `k1` and `k2`; in inference mode
    with `k1`, `k2` (and no key, if `keyless`); and with every Dropout replaced by
    the identity, with `k1` and `k2` (the layer count, so the split, unchanged)."""
    without_dropout = eqx.tree_at(
        lambda m: [layer for layer in m.layers if isinstance(layer, eqx.nn.Dropout)],
        model,
        replace_fn=lambda _: eqx.nn.Identity(),
    )
    inference = eqx.nn.inference_mode(model)
    keys = (k1, k2, None) if keyless else (k1, k2)
    return (
        [model(X, key=k) for k in (k1, k2)],
        [inference(X, key=k) for k in keys],
        [without_dropout(X, key=k) for k in (k1, k2)],
    )


def check_inference_mode(model):
    keyless = not any(
        isinstance(m, eqxrules.Rule) and _needs_key(m) for m in model.layers
    )
    values, inference, without_dropout = _inference_values(model, K1, K2, keyless)
    _assert_trees_close(model(X, key=K1), values[0], "same key, other output (eager)")
    assert _differ(values[0], values[1]), "the output ignores the key"
    # A rule has no `inference` flag: one that draws random numbers still does.
    _assert_trees_equal(inference[:2], without_dropout, "inference_mode")
    if keyless:
        for value in inference:
            _assert_trees_equal(value, without_dropout[0], "inference_mode: keyed")


def _kind(rule):
    # What `inference_mode` could meet in a rule: randomness of its own, sub-models
    # (with `inference` flags of their own), its kind of derivative and input.
    kind = (rule.forward_mode, rule.pytree_input, rule.elementwise)
    return (_needs_key(rule), bool(_sub_models(rule)), *kind)


def _one_entry_per_kind():
    kinds = {}
    for entry in ENTRIES:
        kinds.setdefault(_kind(_examples(entry)[0]), entry)
    return list(kinds.values())


@pytest.mark.parametrize("entry", _one_entry_per_kind(), ids=lambda e: e.name)
def test_inference_mode_on_sequential_of_rule_and_dropout(entry):
    check_inference_mode(_with_dropouts(_example(entry, 0)))


class _Opaque(eqx.Module):
    """Calls a closure: `inference_mode` cannot reach a Dropout inside it."""

    fn: object = eqx.field(static=True)

    def __call__(self, x, *, key=None):
        return self.fn(x, key=key)  # pyright: ignore[reportCallIssue]


class _DropsKey(eqxrules.Frozen):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x)


class _FrozenFixedKey(eqxrules.Frozen):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=None if key is None else KEY)


class _FrozenInventsKey(eqxrules.Frozen):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=KEY if key is None else key)


class _FrozenHostNoise(eqxrules.Frozen):
    # Host randomness: fixed into a jitted program when traced, new on each eager call.
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=key) + np.random.default_rng().normal()


class _Leaky(eqxrules.Frozen):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.module(x, key=key)  # pyright: ignore[reportCallIssue]


class _Textbook(eqxrules.ScaledModel):
    # The textbook rule the ScaledModel docstring warns of: reads `x`'s tangent only.
    def tangent(self, args, t_args, t_self, out, *, key=None):
        return eqxrules.partial_jvp(
            lambda x: self.sub_model(x / self.scale, key=key),  # pyright: ignore[reportCallIssue]
            tuple(args),
            tuple(t_args),
        )


def _hidden_dropout():
    # Drops only when given a key, and out of `inference_mode`'s reach.
    dropout = eqx.nn.Dropout(0.5)
    return _Opaque(lambda x, key: x if key is None else dropout(x, key=key))


def test_planted_defects_fail_the_wrapper_dropout_check():
    mlp = eqx.nn.MLP(3, 2, 5, 2, activation=jnp.tanh, key=KEY)
    sub = eqx.nn.Sequential([eqx.nn.Dropout(0.5), mlp])
    plain = eqxrules.Frozen(mlp)
    with pytest.raises(RuntimeError, match="Dropout requires a key"):
        check_key_reaches_dropout(_DropsKey(sub), plain)
    with pytest.raises(AssertionError, match="the mask ignores the key"):
        check_key_reaches_dropout(_FrozenFixedKey(sub), plain)
    with pytest.raises(AssertionError, match="same key, other mask"):
        check_key_reaches_dropout(_FrozenHostNoise(sub), plain)
    with pytest.raises(AssertionError, match="without a key, dropout still ran"):
        check_key_reaches_dropout(_FrozenInventsKey(sub), plain)
    hidden = eqxrules.Frozen(eqx.nn.Sequential([_hidden_dropout(), mlp]))
    with pytest.raises(AssertionError, match="inference_mode: dropout still applied"):
        check_key_reaches_dropout(hidden, plain)
    with pytest.raises(AssertionError, match="gradient of the rule's parameters"):
        check_key_reaches_dropout(_Leaky(sub), plain)


def test_planted_defects_fail_the_frozen_and_scaled_model_checks():
    with pytest.raises(AssertionError, match="Frozen: the module's parameters got"):
        check_frozen_with_dropout(_Leaky)
    with pytest.raises(AssertionError, match="ScaledModel: the sub-model got no"):
        check_scaled_model_with_dropout(_Textbook)
    with pytest.raises(AssertionError, match="the mask ignores the key"):
        check_frozen_with_dropout(_FrozenFixedKey)
    with pytest.raises(AssertionError, match="same key, other mask"):
        check_frozen_with_dropout(_FrozenHostNoise)


def test_planted_defects_fail_the_inference_mode_check():
    with pytest.raises(AssertionError, match="inference_mode: keyed"):
        check_inference_mode(_with_dropouts(eqxrules.SteSign(), _hidden_dropout()))
    with pytest.raises(AssertionError, match="the output ignores the key"):
        check_inference_mode(_sequential(eqxrules.SteSign())[0])
    with pytest.raises(AssertionError, match="same key, other output"):
        check_inference_mode(_with_dropouts(_HostNoise()))
