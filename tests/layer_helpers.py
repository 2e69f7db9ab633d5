"""What the Equinox-layer tests share (`tests/test_layer_*.py`): the catalogue's
examples and cases, small models built without PRNG programs, references, and tree
comparisons."""

from __future__ import annotations

import dataclasses
import functools as ft
import inspect
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from conftest import call

import eqxrules

KEY = jax.random.key(0)
K1, K2 = jax.random.key(11), jax.random.key(12)
X = jnp.array([0.6, -0.9, 0.3])  # the input of every model here
ENTRIES = eqxrules.catalogue()


@ft.cache
def _examples(entry):
    return tuple(entry.examples(KEY))


def _example(entry, index):
    return _examples(entry)[index]


CASES = [
    pytest.param(entry, i, id=f"{entry.name}-{i}")
    for entry in ENTRIES
    for i in range(len(_examples(entry)))
]


def _needs_key(rule):
    return "key" in rule.call_kwargs(KEY)


def _reference_kwargs(rule, key):
    # The key a rule receives goes to its references too, where they take one (a
    # wrapper's references pass it on to the wrapped module, as the rule does).
    takes = "key" in inspect.signature(rule.reference_forward).parameters
    return {"key": key} if takes else {}


def _pullback(rule, x, ct, kwargs):
    """Reference cotangents `(rule, x)` of the rule at `x` for output cotangent `ct`."""
    if type(rule).reference_vjp is not eqxrules.Rule.reference_vjp:
        ct_rule, *ct_x = call(ft.partial(rule.reference_vjp, ct), x, **kwargs)
        return ct_rule, (
            eqxrules.Args(ct_x) if isinstance(x, eqxrules.Args) else ct_x[0]
        )
    _, vjp = eqx.filter_vjp(
        lambda m, x: call(m.reference_derivative, x, **kwargs), rule, x
    )
    return vjp(ct)


def _linear(n_in, n_out, seed, *, weight_scale=0.8, bias=None):
    """An `eqx.nn.Linear` with numpy-drawn parameters (building it with a key would
    compile a PRNG program per shape)."""
    rng = np.random.default_rng(seed)
    shapes = eqx.filter_eval_shape(eqx.nn.Linear, n_in, n_out, key=KEY)
    weight = weight_scale * rng.uniform(-1, 1, (n_out, n_in))
    bias = rng.uniform(-0.1, 0.1, n_out) if bias is None else bias
    return eqx.tree_at(
        lambda m: (m.weight, m.bias),
        shapes,
        (jnp.asarray(weight, jnp.float32), jnp.asarray(bias, jnp.float32)),
    )


def _flatten(y):
    return jnp.concatenate([jnp.ravel(leaf) for leaf in jtu.tree_leaves(y)])


def _apply(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _sum_sin(y):
    return jnp.sum(jnp.sin(_flatten(y)))


def _value_and_grad(model, x, key):
    def loss(model):
        out = model(x, key=key)
        return _sum_sin(out), out

    return eqx.filter_value_and_grad(loss, has_aux=True)(model)


def _assert_trees_close(actual, expected, what, rtol=1e-5, atol=1e-6):
    a, a_def = jtu.tree_flatten(eqx.filter(actual, eqx.is_array))
    b, b_def = jtu.tree_flatten(eqx.filter(expected, eqx.is_array))
    assert a_def == b_def, f"{what}: structure {a_def} != {b_def}"
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol, err_msg=what)


def _assert_trees_equal(a, b, what):
    for u, v in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(u, v, err_msg=what)


def _differ(a, b):
    return any(
        not np.array_equal(u, v) for u, v in zip(jtu.tree_leaves(a), jtu.tree_leaves(b))
    )


def _nonzero(tree):
    return any(np.any(np.asarray(a) != 0) for a in jtu.tree_leaves(tree))


def _asks_for_key(call):
    """Whether `call()` raises the rule's own error for a missing key."""
    try:
        call()
    except TypeError as e:
        return "needs a PRNG key: call it as `m(x, key=key)`." in str(e)
    return False


def _sequential(rule, layer=None):
    """`Linear → [reshape] → rule → [flatten] → Linear` (`layer` in the rule's
    place, if given), and the index of the rule.

    A rule declared to take any array (elementwise, or any pytree) sits between the
    Linears on a vector; one that acts along an axis (categories, per-channel
    magnitude) gets its declared domain shape through an `eqx.nn.Lambda` reshape.
    The first Linear's output is a sample of the rule's domain, moved by less than
    0.01: off the rule's kinks (the domain keeps 0.05 from them)."""
    shape = rule.input_domain().shape
    if rule.elementwise or rule.pytree_input:
        shape = (math.prod(shape),)
    h0 = dataclasses.replace(rule.input_domain(), shape=shape).sample(jax.random.key(1))
    out = eqx.filter_eval_shape(lambda r, h: r(h, key=KEY), rule, h0)
    layers = [_linear(3, h0.size, 2, weight_scale=0.005, bias=np.ravel(h0))]
    if len(shape) != 1:
        layers.append(eqx.nn.Lambda(lambda h: h.reshape(shape)))
    index = len(layers)
    layers.append(rule if layer is None else layer)
    leaves = jtu.tree_leaves(out)
    if len(leaves) != 1 or leaves[0].ndim != 1:
        layers.append(eqx.nn.Lambda(_flatten))
    layers.append(_linear(sum(leaf.size for leaf in leaves), 2, 3, weight_scale=0.5))
    return eqx.nn.Sequential(layers), index


# Planted defects of rules, which the checks of the layer tests must each catch.


class _NoKey(eqxrules.SteSign):
    def __call__(self, x):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x)


class _KeyNoise(eqxrules.SteSign):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        out = super().__call__(x)
        return out if key is None else out + jax.random.normal(key, out.shape)


class _FixedKey(eqxrules.StochasticRound):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=None if key is None else KEY)


class _InventsKey(eqxrules.StochasticRound):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=KEY if key is None else key)


class _HostNoise(eqxrules.StochasticRound):
    # Host randomness: fixed into a jitted program when traced, new on each eager call.
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=key) + np.random.default_rng().normal()


class _NoTangent(eqxrules.SteSign):
    def tangent(self, args, t_args, t_self, out, **kwargs):
        return None


class _NaNTangent(eqxrules.SteSign):
    def tangent(self, args, t_args, t_self, out, **kwargs):
        return t_args[0] * jnp.nan


class _DoubleTangent(eqxrules.SteSign):
    def tangent(self, args, t_args, t_self, out, **kwargs):
        t = super().tangent(args, t_args, t_self, out, **kwargs)
        return None if t is None else 2 * t


class _NotTraceable(eqxrules.SteSign):
    def primal(self, x):
        return jnp.asarray(np.sign(np.asarray(x)))
