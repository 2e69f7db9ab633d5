"""Every rule is an Equinox layer: it takes `key=` as `eqx.nn.Sequential` passes it
(and ignores it unless it draws random numbers), and sits between `eqx.nn.Linear`
layers under `eqx.filter_grad` and `eqx.filter_jit`, its value and gradients those
of its references. Each check has a planted defect beside it that makes it fail."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from conftest import call
from layer_helpers import (
    CASES,
    K1,
    K2,
    X,
    _apply,
    _asks_for_key,
    _assert_trees_close,
    _assert_trees_equal,
    _differ,
    _DoubleTangent,
    _example,
    _FixedKey,
    _HostNoise,
    _InventsKey,
    _KeyNoise,
    _NaNTangent,
    _needs_key,
    _NoKey,
    _nonzero,
    _NoTangent,
    _NotTraceable,
    _pullback,
    _reference_kwargs,
    _sequential,
    _sum_sin,
    _value_and_grad,
)

import eqxrules

# The slow tier: every rule as a layer of eqx.nn.Sequential. Each entry's first example
# also runs at the minimum versions in CI (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.catalogue_wide]

# -- 1. every Module takes `key=`, and ignores it unless it draws random numbers --


def check_takes_key(rule):
    x = rule.input_domain().sample(jax.random.key(1))
    if _needs_key(rule):
        assert _asks_for_key(lambda: rule(x)), "called without a key, no clear error"
        assert _asks_for_key(lambda: rule(x, key=None)), "key=None: no clear error"
        _assert_trees_equal(rule(x, key=K1), rule(x, key=K1), "same key, other value")
        # A sample may hold only values the rule cannot randomise (a grid's levels,
        # values beyond its range): the key must matter on one of a few samples,
        # or on the midpoints between the domain's kinks (a grid's levels).
        domain = rule.input_domain()
        samples = [domain.sample(jax.random.key(s)) for s in range(1, 9)]
        kinks = np.sort(np.asarray(domain.kinks, np.float64))
        if kinks.size > 1 and isinstance(x, jax.Array):
            mids = np.resize((kinks[1:] + kinks[:-1]) / 2, x.shape)
            samples.append(jnp.asarray(mids, x.dtype))
            # Points strictly inside the intervals between kinks, a fifth of an
            # interval away from each end (a grid's midpoints between its rounding
            # boundaries are its levels, which no key moves): a stochastic rounding
            # moves each with probability at least 2·0.2·0.8 = 0.32 between two
            # keys, so a correct rule fails with probability below 0.68^(4·size).
            for seed in range(4):
                u = np.random.default_rng(seed).uniform(0.2, 0.8, kinks.size - 1)
                inner = np.resize(kinks[:-1] + u * np.diff(kinks), x.shape)
                samples.append(jnp.asarray(inner, x.dtype))
        assert any(_differ(rule(x, key=K1), rule(x, key=K2)) for x in samples), (
            "value ignores the key"
        )
        return
    # With respect to the floating-point inputs (a mask, if any, held fixed).
    x, fixed = eqx.partition(x, eqx.is_inexact_array)
    out, vjp = jax.vjp(lambda x: call(rule, eqx.combine(x, fixed)), x)
    ct = jtu.tree_map(jnp.ones_like, out)
    for key in (None, K1):
        out_key, vjp_key = jax.vjp(
            lambda x, key=key: call(rule, eqx.combine(x, fixed), key=key), x
        )
        _assert_trees_equal(out_key, out, f"value changed by key={key}")
        _assert_trees_equal(vjp_key(ct), vjp(ct), f"gradient changed by key={key}")


@pytest.mark.parametrize("entry, index", CASES)
def test_every_rule_takes_key_like_a_layer(entry, index):
    check_takes_key(_example(entry, index))


# -- 2. every example between two Linear layers, under filter_grad and filter_jit --


def _reference_sequential(seq, index, key):
    """Value, loss and gradients of `seq` by hand: the rule replaced by its
    references, given the key `eqx.nn.Sequential` hands to the rule's position."""
    rule = seq.layers[index]
    kwargs = _reference_kwargs(rule, jax.random.split(key, len(seq.layers))[index])
    h, head_vjp = eqx.filter_vjp(_apply, seq.layers[:index], X)
    y = rule.reference_forward(h, **kwargs)
    tail = seq.layers[index + 1 :]
    out = _apply(tail, y)
    g_tail, ct_y = eqx.filter_grad(lambda t: _sum_sin(_apply(*t)))((tail, y))
    g_rule, ct_h = _pullback(rule, h, ct_y, kwargs)
    (g_head, _) = head_vjp(ct_h)
    return out, _sum_sin(out), (*g_head, g_rule, *g_tail)


def _reference_input_cotangent(rule, h):
    """What the rule's reference sends back to its input `h` for a random output
    cotangent: whether the rule passes gradient there."""
    kwargs = _reference_kwargs(rule, K1)
    out = eqx.filter_eval_shape(lambda h: rule.reference_forward(h, **kwargs), h)
    leaves, treedef = jtu.tree_flatten(out)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    ct = [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)]
    return _pullback(rule, h, jtu.tree_unflatten(treedef, ct), kwargs)[1]


@eqx.filter_jit
def _sequential_results(seq, as_lambda, index, key, keyless):
    (loss, out), grads = _value_and_grad(seq, X, key)
    expected = _reference_sequential(seq, index, key)
    h = _apply(seq.layers[:index], X)
    ct_h = _reference_input_cotangent(seq.layers[index], h)
    variants = (as_lambda(X, key=key), seq(X)) if keyless else None
    return (out, loss, grads.layers), expected, ct_h, variants


def check_in_sequential(rule):
    seq, index = _sequential(rule)
    as_lambda, _ = _sequential(rule, eqx.nn.Lambda(rule))
    key = jax.random.key(7)
    keyless = not _needs_key(rule)
    if not keyless:  # `eqx.nn.Lambda` drops the key Sequential gives it
        assert _asks_for_key(lambda: as_lambda(X, key=key)), "Lambda(rule): no error"
    actual, expected, ct_h, variants = _sequential_results(
        seq, as_lambda, index, key, keyless
    )
    out, loss, grads = actual
    expected_out, expected_loss, expected_grads = expected
    _assert_trees_close(out, expected_out, "value in Sequential != reference")
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, err_msg="loss")
    if variants is not None:
        _assert_trees_equal(variants[0], out, "Lambda(rule) != rule")
        _assert_trees_equal(variants[1], out, "Sequential without key != with key")
    g = np.asarray(grads[0].weight)
    assert np.all(np.isfinite(g)), "first Linear's weight gradient is not finite"
    if _nonzero(ct_h):
        assert np.any(g != 0), "the rule passes gradient, but the first Linear got none"
    else:
        assert np.all(g == 0), "the rule blocks gradient, but the first Linear got some"
    for i, (a, b) in enumerate(zip(grads, expected_grads, strict=True)):
        _assert_trees_close(a, b, f"gradient of layer {i} != reference")


# A rule of several inputs (`safe_divide(a, b)`) is no layer: `eqx.nn.Sequential`
# passes each layer one input.
ONE_INPUT = [c for c in CASES if not isinstance(c.values[0].domain, eqxrules.Inputs)]


@pytest.mark.parametrize("entry, index", ONE_INPUT)
def test_every_rule_in_sequential_between_linears(entry, index):
    check_in_sequential(_example(entry, index))


# Planted defects (in `layer_helpers`): each check above must be able to fail.


def test_planted_defects_fail_the_key_check():
    with pytest.raises(TypeError, match="unexpected keyword argument 'key'"):
        check_takes_key(_NoKey())
    with pytest.raises(AssertionError, match="value changed by key"):
        check_takes_key(_KeyNoise())
    with pytest.raises(AssertionError, match="value ignores the key"):
        check_takes_key(_FixedKey())
    with pytest.raises(AssertionError, match="called without a key, no clear error"):
        check_takes_key(_InventsKey())
    with pytest.raises(AssertionError, match="same key, other value"):
        check_takes_key(_HostNoise())


@pytest.mark.parametrize(
    "rule, error, match",
    [
        pytest.param(_NoKey(), TypeError, "unexpected keyword", id="no-key"),
        pytest.param(_FixedKey(), AssertionError, "value in Seq", id="fixed-key"),
        pytest.param(_KeyNoise(), AssertionError, "value in Seq", id="key-noise"),
        pytest.param(_InventsKey(), AssertionError, "Lambda", id="invents-key"),
        pytest.param(
            _NotTraceable(),
            jax.errors.TracerArrayConversionError,
            "numpy.ndarray",
            id="not-traceable",
        ),
        pytest.param(_NaNTangent(), AssertionError, "not finite", id="nan"),
        pytest.param(_NoTangent(), AssertionError, "got none", id="no-tangent"),
        pytest.param(_DoubleTangent(), AssertionError, "layer 0", id="twice"),
    ],
)
def test_planted_defects_fail_the_sequential_check(rule, error, match):
    with pytest.raises(error, match=match):
        check_in_sequential(rule)


class _BlockingReference(_DoubleTangent):
    # The rule passes gradient; a reference that blocks it must be caught. (A
    # subclass, not a monkeypatch: a jitted check would reuse the compilation for
    # the patched class.)
    def reference_derivative(self, x):
        return jnp.zeros_like(x)


class _CopyingReference(_KeyNoise):
    # A reference that copies `_KeyNoise` in Sequential (Linear → rule → Linear: the
    # rule is layer 1 of 3), so that only the Lambda comparison sees the defect.
    def reference_forward(self, x):
        return self(x, key=jax.random.split(jax.random.key(7), 3)[1])


def test_planted_reference_defects_fail_the_sequential_check():
    with pytest.raises(AssertionError, match="but the first Linear got some"):
        check_in_sequential(_BlockingReference())
    with pytest.raises(AssertionError, match="Lambda\\(rule\\) != rule"):
        check_in_sequential(_CopyingReference())
