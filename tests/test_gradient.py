"""Per-rule tests of gradient shaping: `gradient_reversal`, `gradient_scale`,
`clip_gradient`, `clip_gradient_norm`, `zero_nonfinite_gradient`. (The
catalogue-wide checks live in `test_catalogue.py`.)"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import given, strategies as st

import eqxrules
from eqxrules.testing import strategies

X = jnp.array([0.5, -1.0, 2.0])
CT = jnp.array([3.0, -0.2, -4.0])
TREE = {
    "a": X,
    "nested": (jnp.array([1.0, 2.0]), {"b": jnp.ones((2, 2), jnp.bfloat16)}),
    "count": jnp.array([1, 2, 3]),
    "name": "leaf",
    "k": 7,
    "nothing": None,
}

REVERSE_ONLY = {
    "clip_gradient": lambda x: eqxrules.clip_gradient(x, lo=-1.0, hi=1.0),
    "clip_gradient_norm": lambda x: eqxrules.clip_gradient_norm(x, max_norm=1.0),
    "zero_nonfinite_gradient": eqxrules.zero_nonfinite_gradient,
}
LINEAR = {
    "gradient_reversal": (lambda x: eqxrules.gradient_reversal(x, scale=0.5), -0.5),
    "gradient_reversal_default": (eqxrules.gradient_reversal, -1.0),
    "gradient_scale": (lambda x: eqxrules.gradient_scale(x, scale=2.5), 2.5),
    "gradient_scale_zero": (lambda x: eqxrules.gradient_scale(x, scale=0.0), 0.0),
}
ALL = {**REVERSE_ONLY, **{name: f for name, (f, _) in LINEAR.items()}}


def _vjp(f, x, ct):
    out, pullback = jax.vjp(f, x)
    return out, pullback(ct)[0]


def _check_passthrough(out, tree):
    assert jtu.tree_structure(out) == jtu.tree_structure(tree)
    assert out["name"] == "leaf" and out["k"] == 7 and out["nothing"] is None
    for got, want in zip(jtu.tree_leaves(out), jtu.tree_leaves(tree)):
        if eqx.is_array(want):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# Every rule: identity value on any pytree, non-float leaves untouched.


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("jit", [False, True])
def test_value_is_identity_on_pytrees(name, jit):
    f = eqx.filter_jit(ALL[name]) if jit else ALL[name]
    _check_passthrough(f(TREE), TREE)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", ALL)
def test_gradient_on_pytrees_keeps_dtypes_and_unused_leaves_get_zero(name):
    floats, rest = eqx.partition(TREE, eqx.is_inexact_array)

    def loss(floats):
        out = ALL[name](eqx.combine(floats, rest))
        # Only `a` is used: every other float leaf gets a symbolic-zero cotangent.
        return jnp.sum(out["a"] * CT)

    grads = jax.grad(loss)(floats)
    assert grads["nested"][1]["b"].dtype == jnp.bfloat16
    for leaf in jtu.tree_leaves(grads["nested"]):
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), 0)
    assert np.all(np.isfinite(grads["a"]))


# gradient_reversal / gradient_scale: linear, both modes.


@pytest.mark.parametrize("name", LINEAR)
def test_linear_rules_in_both_modes(name):
    f, factor = LINEAR[name]
    out, g = _vjp(f, X, CT)
    np.testing.assert_array_equal(out, X)
    np.testing.assert_allclose(g, factor * CT)
    out, t = jax.jvp(f, (X,), (CT,))
    np.testing.assert_array_equal(out, X)
    np.testing.assert_allclose(t, factor * CT)
    np.testing.assert_allclose(jax.jacfwd(f)(X), factor * np.eye(3))
    np.testing.assert_allclose(jax.jacrev(f)(X), factor * np.eye(3))


def test_gradient_reversal_forward_mode_on_a_pytree_with_symbolic_zeros():
    def f(a):
        out = eqxrules.gradient_reversal({**TREE, "a": a}, scale=2.0)
        return eqx.filter(out, eqx.is_inexact_array)

    _, t = jax.jvp(f, (X,), (CT,))
    np.testing.assert_allclose(t["a"], -2.0 * CT)
    np.testing.assert_array_equal(t["nested"][0], np.zeros(2))


def test_gradient_reversal_reverses_the_gradient_of_a_whole_loss():
    def loss(x, reversal):
        y = eqxrules.gradient_reversal(x) if reversal else x
        return jnp.sum(jnp.sin(y) ** 2)

    plain = jax.grad(loss)(X, False)
    np.testing.assert_allclose(jax.grad(loss)(X, True), -plain, rtol=1e-6)


@pytest.mark.parametrize("rule", [eqxrules.GradientReversal, eqxrules.GradientScale])
def test_is_exact_only_for_the_identity_derivative(rule):
    identity = 1.0 if rule is eqxrules.GradientScale else -1.0
    assert rule(identity).is_exact()
    assert not rule(0.5).is_exact()


@given(scale=st.floats(-4, 4, allow_nan=False), data=st.data())
def test_gradient_scale_property(scale, data):
    domain = eqxrules.GradientScale.domain
    x, ct = data.draw(strategies.arrays(domain)), data.draw(strategies.arrays(domain))
    _, g = _vjp(lambda x: eqxrules.gradient_scale(x, scale=scale), x, ct)
    np.testing.assert_allclose(g, scale * np.asarray(ct), rtol=1e-6, atol=1e-6)
    _, g = _vjp(lambda x: eqxrules.gradient_reversal(x, scale=scale), x, ct)
    np.testing.assert_allclose(g, -scale * np.asarray(ct), rtol=1e-6, atol=1e-6)


# clip_gradient


def test_clip_gradient_clips_the_cotangent_elementwise():
    out, g = _vjp(lambda x: eqxrules.clip_gradient(x, lo=-0.5, hi=1.0), X, CT)
    np.testing.assert_array_equal(out, X)
    np.testing.assert_array_equal(g, np.array([1.0, -0.2, -0.5], np.float32))


def test_clip_gradient_one_sided_with_infinite_bound():
    _, g = _vjp(lambda x: eqxrules.clip_gradient(x, lo=-np.inf, hi=0.0), X, CT)
    np.testing.assert_array_equal(g, np.array([0.0, -0.2, -4.0], np.float32))


@given(
    lo=st.floats(-3, 0, allow_nan=False),
    hi=st.floats(0, 3, allow_nan=False),
    data=st.data(),
)
def test_clip_gradient_property(lo, hi, data):
    domain = eqxrules.ClipGradient.domain
    x, ct = data.draw(strategies.arrays(domain)), data.draw(strategies.arrays(domain))
    _, g = _vjp(lambda x: eqxrules.clip_gradient(x, lo=lo, hi=hi), x, ct)
    # XLA on CPU flushes float32 denormals to zero: hence the tiny `atol`.
    expected = np.clip(np.asarray(ct), np.float32(lo), np.float32(hi))
    np.testing.assert_allclose(g, expected, rtol=0, atol=1e-37)


# clip_gradient_norm


def test_clip_gradient_norm_uses_the_global_norm_of_the_pytree():
    x = {"a": jnp.zeros(2), "b": jnp.zeros(())}
    ct = {"a": jnp.array([3.0, 0.0]), "b": jnp.array(4.0)}  # global norm 5

    def f(x, max_norm):
        out = eqxrules.clip_gradient_norm({**x, "s": "leaf", "i": 3}, max_norm=max_norm)
        assert out["s"] == "leaf" and out["i"] == 3
        return {"a": out["a"], "b": out["b"]}

    _, g = _vjp(lambda x: f(x, 2.0), x, ct)
    np.testing.assert_allclose(g["a"], [1.2, 0.0], rtol=1e-6)
    np.testing.assert_allclose(g["b"], 1.6, rtol=1e-6)
    _, g = _vjp(lambda x: f(x, 10.0), x, ct)
    np.testing.assert_array_equal(g["a"], ct["a"])
    np.testing.assert_array_equal(g["b"], ct["b"])


def test_clip_gradient_norm_does_not_overflow_in_float16():
    x = jnp.zeros(12, jnp.float16)
    ct = jnp.full(12, 300.0, jnp.float16)  # sum of squares 1.08e6 > float16 max
    _, g = _vjp(lambda x: eqxrules.clip_gradient_norm(x, max_norm=1.0), x, ct)
    assert g.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(g, np.float32), 1 / np.sqrt(12), rtol=2e-3)


def test_clip_gradient_norm_zero_cotangent_gives_zero_not_nan():
    _, g = _vjp(lambda x: eqxrules.clip_gradient_norm(x, max_norm=1.0), X, jnp.zeros(3))
    np.testing.assert_array_equal(g, np.zeros(3))


@given(max_norm=st.floats(0.1, 10), data=st.data())
def test_clip_gradient_norm_property(max_norm, data):
    domain = eqxrules.ClipGradientNorm.domain
    x, ct = data.draw(strategies.arrays(domain)), data.draw(strategies.arrays(domain))
    _, g = _vjp(lambda x: eqxrules.clip_gradient_norm(x, max_norm=max_norm), x, ct)
    norm = np.linalg.norm(np.asarray(ct, np.float64))
    assert np.linalg.norm(g) <= max_norm * (1 + 1e-5)
    factor = max_norm / norm if norm > max_norm else 1.0
    np.testing.assert_allclose(g, np.asarray(ct) * factor, rtol=1e-5, atol=1e-6)


# zero_nonfinite_gradient


def test_zero_nonfinite_gradient_issue_example():
    def f(x):
        return jnp.sum(jnp.sqrt(eqxrules.zero_nonfinite_gradient(x)))

    g = jax.grad(f)(jnp.array([1.0, 0.0, 4.0]))
    np.testing.assert_array_equal(g, [0.5, 0.0, 0.25])
    # Without the rule, sqrt'(0) is infinite.
    assert np.isinf(jax.grad(lambda x: jnp.sum(jnp.sqrt(x)))(jnp.zeros(1)))[0]


def test_zero_nonfinite_gradient_zeroes_nan_and_both_infinities():
    ct = jnp.array([jnp.nan, jnp.inf, -jnp.inf, -2.0, 0.5])
    _, g = _vjp(eqxrules.zero_nonfinite_gradient, jnp.ones(5), ct)
    np.testing.assert_array_equal(g, [0.0, 0.0, 0.0, -2.0, 0.5])


def test_zero_nonfinite_gradient_on_a_pytree():
    x = {"a": jnp.array([0.0, 1.0]), "b": jnp.array(0.0), "s": "x"}

    def f(x):
        y = eqxrules.zero_nonfinite_gradient(x)
        return jnp.sum(jnp.sqrt(y["a"])) + jnp.log(y["b"])

    g = jax.grad(lambda a, b: f({**x, "a": a, "b": b}), argnums=(0, 1))(x["a"], x["b"])
    np.testing.assert_array_equal(g[0], [0.0, 0.5])
    assert float(g[1]) == 0.0


# Reverse-only rules: the forward-mode error names the rule.


@pytest.mark.parametrize("name", REVERSE_ONLY)
@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_reverse_only_rule_names_itself_under_forward_mode(name, transform):
    f = REVERSE_ONLY[name]
    run = {
        "jvp": lambda: jax.jvp(f, (X,), (X,)),
        "jacfwd": lambda: jax.jacfwd(f)(X),
    }[transform]
    with pytest.raises(TypeError, match=f"`{name}` supports reverse mode only"):
        run()


@pytest.mark.parametrize("name", REVERSE_ONLY)
def test_reverse_only_rule_works_under_jit_vmap_and_jacrev(name):
    f = REVERSE_ONLY[name]
    xs = jnp.stack([X, 2 * X])
    cts = jnp.stack([CT, -CT])
    batched = jax.jit(jax.vmap(lambda x, ct: _vjp(f, x, ct)[1]))(xs, cts)
    looped = np.stack([_vjp(f, x, ct)[1] for x, ct in zip(xs, cts)])
    np.testing.assert_allclose(batched, looped, rtol=1e-6)
    assert jax.jacrev(f)(X).shape == (3, 3)


@pytest.mark.parametrize("name", REVERSE_ONLY)
def test_reverse_over_reverse_gives_no_nan_at_a_zero_cotangent(name):
    f = REVERSE_ONLY[name]

    def first(x):
        # The cotangent reaching the rule, `x - X`, is zero at `X` but depends on
        # `x`, so the second derivative goes through the backward pass there.
        return jax.grad(lambda x: jnp.sum(f(x) * (x - X)))(x)

    second = jax.grad(lambda x: jnp.sum(first(x)))(X)
    assert np.all(np.isfinite(second))


# Validation


@pytest.mark.parametrize(
    "build, error, message",
    [
        (
            lambda: eqxrules.ClipGradient(2.0, 1.0),
            ValueError,
            r"`clip_gradient`: `lo` \(=2.0\) must be <= 0, so that a zero cotangent "
            r"stays zero\.",
        ),
        (
            lambda: eqxrules.clip_gradient(X, lo=0.5, hi=1.0),
            ValueError,
            r"`clip_gradient`: `lo` \(=0.5\) must be <= 0",
        ),
        (
            lambda: eqxrules.ClipGradient(-1.0, -0.5),
            ValueError,
            r"`hi` \(=-0.5\) must be >= 0",
        ),
        (
            lambda: eqxrules.ClipGradient(float("nan"), 1.0),
            ValueError,
            r"`clip_gradient`: `lo` \(=nan\) must be <= 0",
        ),
        (
            lambda: eqxrules.ClipGradient("a", 1.0),
            TypeError,
            r"`clip_gradient`: `lo` \(='a'\) must be a real number",
        ),
        (
            lambda: eqxrules.ClipGradientNorm(0.0),
            ValueError,
            r"`clip_gradient_norm`: `max_norm` \(=0.0\) must be finite and positive",
        ),
        (
            lambda: eqxrules.clip_gradient_norm(X, max_norm=-1.0),
            ValueError,
            r"`max_norm` \(=-1.0\) must be finite and positive",
        ),
        (
            lambda: eqxrules.ClipGradientNorm(float("inf")),
            ValueError,
            r"`max_norm` \(=inf\) must be finite",
        ),
        (
            lambda: eqxrules.GradientReversal(float("nan")),
            ValueError,
            r"`gradient_reversal`: `scale` \(=nan\) must be finite\.",
        ),
        (
            lambda: eqxrules.gradient_scale(X, scale=float("-inf")),
            ValueError,
            r"`gradient_scale`: `scale` \(=-inf\) must be finite\.",
        ),
        (
            lambda: eqxrules.GradientScale(True),
            TypeError,
            r"`gradient_scale`: `scale` \(=True\) must be a real number",
        ),
    ],
)
def test_invalid_hyperparameters_name_argument_and_value(build, error, message):
    with pytest.raises(error, match=message):
        build()
