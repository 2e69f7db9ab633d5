"""Per-rule tests of the stop-gradient preprocessors: `stop_gradient_call`,
`frozen_call`, `detach`, `standardize`. (The catalogue-wide checks live in
`test_catalogue.py`.)"""

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

KEY = jax.random.key(0)
X = jnp.array([0.3, -0.5, 1.1])


def _mlp(key=KEY):
    return eqx.nn.MLP(3, 2, 5, 2, activation=jnp.tanh, key=key)


def _split(module):
    """Parameters and the rest, so `jax.hessian` can take the parameters."""
    return eqx.partition(module, eqx.is_inexact_array)


def _stopped_params(module):
    params, static = _split(module)
    return eqx.combine(jax.lax.stop_gradient(params), static)


def _allclose_trees(a, b, **kw):
    leaves_a, leaves_b = jtu.tree_leaves(a), jtu.tree_leaves(b)
    assert jtu.tree_structure(a) == jtu.tree_structure(b)
    for u, v in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **kw)


def _all_zero(tree):
    return all(not np.any(np.asarray(leaf)) for leaf in jtu.tree_leaves(tree))


class _PytreeFn(eqx.Module):
    """A callable pytree whose input and output hold non-array leaves."""

    weight: jax.Array
    name: str = eqx.field(static=True, default="pytree-fn")

    def __call__(self, x):
        return {"y": jnp.sin(self.weight * x["a"]), "tag": x["tag"], "n": x["n"]}


# stop_gradient_call / StopGradient


def test_stop_gradient_call_value_and_zero_derivatives():
    mlp = _mlp()
    out = eqxrules.stop_gradient_call(mlp, X)
    np.testing.assert_array_equal(out, mlp(X))
    g_mlp, g_x = eqx.filter_grad(
        lambda mx: jnp.sum(eqxrules.StopGradient(mx[0])(mx[1]) ** 2)
    )((mlp, X))
    assert _all_zero(eqx.filter(g_mlp, eqx.is_inexact_array))
    np.testing.assert_array_equal(g_x, np.zeros(3))
    # The plain composition would have given non-zero gradients.
    assert not _all_zero(jax.grad(lambda x: jnp.sum(mlp(x)))(X))


def test_stop_gradient_call_forward_mode_is_zero_in_every_input():
    mlp = _mlp()
    params, static = _split(mlp)
    t_params = jtu.tree_map(jnp.ones_like, params)

    def f(p, x):
        return eqxrules.stop_gradient_call(eqx.combine(p, static), x)

    out, t_out = jax.jvp(f, (params, X), (t_params, jnp.ones(3)))
    np.testing.assert_array_equal(out, mlp(X))
    np.testing.assert_array_equal(t_out, np.zeros(2))
    # Only the parameters perturbed: `x`'s tangent is a symbolic zero.
    _, t_out = jax.jvp(lambda p: f(p, X), (params,), (t_params,))
    np.testing.assert_array_equal(t_out, np.zeros(2))


def test_stop_gradient_call_on_pytrees_with_non_array_leaves():
    fn = _PytreeFn(jnp.array(2.0))
    x = {"a": jnp.array([0.1, 0.2]), "tag": "hello", "n": 3}
    out = eqxrules.stop_gradient_call(fn, x)
    assert out["tag"] == "hello" and out["n"] == 3
    np.testing.assert_allclose(out["y"], np.sin(2 * np.array([0.1, 0.2])), rtol=1e-6)
    g = jax.grad(
        lambda a: jnp.sum(eqxrules.stop_gradient_call(fn, {**x, "a": a})["y"])
    )(x["a"])
    np.testing.assert_array_equal(g, np.zeros(2))


def test_stop_gradient_call_second_order_matches_plain_stop_gradient():
    mlp = _mlp()
    params, static = _split(mlp)

    def f(p, x):
        return jnp.sum(eqxrules.stop_gradient_call(eqx.combine(p, static), x) ** 2)

    assert _all_zero(jax.jit(jax.hessian(f, argnums=(0, 1)))(params, X))


def test_stop_gradient_rejects_non_callable():
    with pytest.raises(TypeError, match="`stop_gradient_call`: `fn` .* callable"):
        eqxrules.StopGradient(jnp.ones(3))  # type: ignore[arg-type]


# frozen_call / Frozen


def test_frozen_call_flows_in_x_not_in_parameters():
    mlp = _mlp()
    np.testing.assert_array_equal(eqxrules.frozen_call(mlp, X), mlp(X))
    g_mlp, g_x = eqx.filter_grad(lambda mx: jnp.sum(eqxrules.Frozen(mx[0])(mx[1])))(
        (mlp, X)
    )
    assert _all_zero(eqx.filter(g_mlp, eqx.is_inexact_array))
    np.testing.assert_allclose(
        g_x, jax.grad(lambda x: jnp.sum(mlp(x)))(X), rtol=1e-6, atol=1e-7
    )


@pytest.mark.slow
def test_frozen_call_forward_mode():
    mlp = _mlp()
    params, static = _split(mlp)
    t_params = jtu.tree_map(jnp.ones_like, params)
    t_x = jnp.array([1.0, -2.0, 0.5])

    def f(p, x):
        return eqxrules.frozen_call(eqx.combine(p, static), x)

    @jax.jit
    def tangents(params, t_params):
        both = jax.jvp(f, (params, X), (t_params, t_x))[1]
        # Parameters alone perturbed (`x` a symbolic zero): no tangent at all.
        params_only = jax.jvp(lambda p: f(p, X), (params,), (t_params,))[1]
        jacobian = jax.jacfwd(lambda x: f(params, x))(X)
        return both, params_only, jacobian

    both, params_only, jacobian = tangents(params, t_params)
    _, expected = jax.jvp(mlp, (X,), (t_x,))
    np.testing.assert_allclose(both, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(params_only, np.zeros(2))
    np.testing.assert_allclose(jacobian, jax.jacfwd(mlp)(X), rtol=1e-6, atol=1e-7)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("transform", ["hessian", "grad_grad"])
def test_frozen_call_second_order_matches_plain_composition(transform):
    """Second derivatives, also the mixed ones in (parameters, x), equal those of the
    module with `stop_gradient` on its parameters. (Evaluating the primal without
    freezing would revive the parameter path at second order.)"""
    mlp = _mlp()
    params, static = _split(mlp)

    def rule(p, x):
        return jnp.sum(eqxrules.frozen_call(eqx.combine(p, static), x) ** 2)

    def plain(p, x):
        return jnp.sum(_stopped_params(eqx.combine(p, static))(x) ** 2)

    def second(f):
        if transform == "hessian":
            return jax.jit(jax.hessian(f, argnums=(0, 1)))(params, X)
        inner = jax.grad(f, argnums=1)
        outer = jax.grad(lambda p, x: jnp.sum(inner(p, x) ** 2), argnums=(0, 1))
        return jax.jit(outer)(params, X)

    expected = second(plain)
    assert not _all_zero(expected)
    _allclose_trees(second(rule), expected, rtol=1e-5, atol=1e-7)


def test_frozen_call_on_pytrees_with_non_array_leaves():
    fn = _PytreeFn(jnp.array(2.0))
    x = {"a": jnp.array([0.1, 0.2]), "tag": "hello", "n": 3}
    out = eqxrules.frozen_call(fn, x)
    assert out["tag"] == "hello" and out["n"] == 3
    g_fn, g_a = eqx.filter_grad(
        lambda fa: jnp.sum(eqxrules.frozen_call(fa[0], {**x, "a": fa[1]})["y"])
    )((fn, x["a"]))
    assert float(g_fn.weight) == 0.0
    np.testing.assert_allclose(g_a, 2 * np.cos(2 * np.array([0.1, 0.2])), rtol=1e-6)


@jax.jit
def _frozen_and_plain_input_gradients(x):
    mlp = _mlp(jax.random.key(3))
    rule = jax.grad(lambda x: jnp.sum(jnp.sin(eqxrules.frozen_call(mlp, x))))(x)
    plain = jax.grad(lambda x: jnp.sum(jnp.sin(mlp(x))))(x)
    return rule, plain


@pytest.mark.slow
@given(data=st.data())
def test_frozen_call_input_gradient_is_the_true_one(data):
    x = data.draw(strategies.arrays(eqxrules.Frozen.domain))
    rule, plain = _frozen_and_plain_input_gradients(x)
    np.testing.assert_allclose(rule, plain, rtol=1e-5, atol=1e-6)


def test_frozen_rejects_non_callable():
    with pytest.raises(TypeError, match="`frozen_call`: `module` .* callable"):
        eqxrules.Frozen("not a module")  # type: ignore[arg-type]


# detach / Detach

TREE = {
    "a": jnp.array([0.5, -1.0, 2.0]),
    "nested": (jnp.array(3.0), {"b": jnp.ones((2, 2), jnp.bfloat16)}),
    "count": jnp.array([1, 2, 3]),
    "flag": jnp.array(True),
    "name": "leaf",
    "k": 7,
    "nothing": None,
}


def _float_sum(tree):
    return sum(
        jnp.sum(leaf.astype(jnp.float32))
        for leaf in jtu.tree_leaves(tree)
        if eqx.is_inexact_array(leaf)
    )


@pytest.mark.parametrize("jit", [False, True])
def test_detach_is_identity_on_pytrees_with_non_float_leaves(jit):
    fn = eqx.filter_jit(eqxrules.detach) if jit else eqxrules.detach
    out = fn(TREE)
    assert jtu.tree_structure(out) == jtu.tree_structure(TREE)
    assert out["name"] == "leaf" and out["k"] == 7 and out["nothing"] is None
    for got, want in zip(jtu.tree_leaves(out), jtu.tree_leaves(TREE)):
        if eqx.is_array(want):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_detach_has_zero_derivative_in_both_modes():
    floats, rest = eqx.partition(TREE, eqx.is_inexact_array)
    grads = jax.grad(lambda f: _float_sum(eqxrules.detach(eqx.combine(f, rest))))(
        floats
    )
    assert _all_zero(grads)
    assert grads["nested"][1]["b"].dtype == jnp.bfloat16
    t = jtu.tree_map(jnp.ones_like, floats)
    _, t_out = jax.jvp(
        lambda f: eqx.filter(
            eqxrules.detach(eqx.combine(f, rest)), eqx.is_inexact_array
        ),
        (floats,),
        (t,),
    )
    assert _all_zero(t_out)
    # Plain autodiff through the identity would not be zero.
    assert not _all_zero(jax.grad(lambda f: _float_sum(f))(floats))


def test_detach_on_a_python_float_gives_an_array():
    out = eqxrules.detach(1.5)
    assert isinstance(out, jax.Array) and float(out) == 1.5


# standardize / Standardize


def _expected_standardize(x, axis, eps):
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=axis, keepdims=True)
    std = x.std(axis=axis, keepdims=True)
    return (x - mean) / (std + eps), std + eps


@pytest.mark.parametrize("axis", [-1, 0, (0, 1)])
def test_standardize_value_and_derivative(axis):
    x = jax.random.normal(KEY, (4, 3)) * 3 + 1
    ct = jax.random.normal(jax.random.key(1), (4, 3))
    eps = 1e-3
    expected, denominator = _expected_standardize(x, axis, eps)
    out, pullback = jax.vjp(lambda x: eqxrules.standardize(x, axis=axis, eps=eps), x)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    (g,) = pullback(ct)
    np.testing.assert_allclose(g, np.asarray(ct) / denominator, rtol=1e-5, atol=1e-7)
    _, t_out = jax.jvp(
        lambda x: eqxrules.standardize(x, axis=axis, eps=eps), (x,), (ct,)
    )
    np.testing.assert_allclose(t_out, np.asarray(ct) / denominator, rtol=1e-5)


@pytest.mark.slow
def test_standardize_gradient_differs_from_plain_autodiff():
    x = jnp.array([1.0, 2.0, 4.0])
    rule = jax.grad(lambda x: eqxrules.standardize(x)[0])(x)
    plain = jax.grad(lambda x: ((x - x.mean()) / (x.std() + 1e-5))[0])(x)
    np.testing.assert_allclose(rule, [1 / (np.std([1.0, 2.0, 4.0]) + 1e-5), 0, 0])
    assert not np.allclose(rule, plain)


def test_standardize_on_pytrees_keeps_non_float_leaves_and_dtypes():
    tree = {**TREE, "nested": (jnp.array([3.0, 4.0]), TREE["nested"][1])}
    out = eqxrules.standardize(tree, axis=-1)
    assert out["name"] == "leaf" and out["k"] == 7 and out["nothing"] is None
    np.testing.assert_array_equal(out["count"], TREE["count"])
    assert out["nested"][1]["b"].dtype == jnp.bfloat16
    expected, _ = _expected_standardize(TREE["a"], -1, 1e-5)
    np.testing.assert_allclose(out["a"], expected, rtol=1e-5)
    g = jax.grad(lambda a: jnp.sum(eqxrules.standardize({**tree, "a": a})["a"]))(
        TREE["a"]
    )
    np.testing.assert_allclose(g, np.full(3, 1 / (np.std(TREE["a"]) + 1e-5)), rtol=1e-5)


def test_standardize_low_precision_statistics_do_not_overflow():
    # float16 squares of 300 overflow (max 65504); the statistics are computed wider.
    x = jnp.array([300.0, -300.0, 100.0, 0.0], jnp.float16)
    out = eqxrules.standardize(x)
    assert out.dtype == jnp.float16
    expected, _ = _expected_standardize(np.asarray(x, np.float32), -1, 1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2e-3)


@given(data=st.data())
def test_standardize_vjp_property(data):
    domain = eqxrules.Standardize.domain
    x = data.draw(strategies.arrays(domain))
    ct = data.draw(strategies.arrays(domain))
    _, pullback = jax.vjp(eqxrules.standardize, x)
    (g,) = pullback(ct)
    _, denominator = _expected_standardize(x, -1, 1e-5)
    np.testing.assert_allclose(g, np.asarray(ct) / denominator, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(eps=-1.0), ValueError, r"`standardize`: `eps` \(=-1.0\) must be finite"),
        (dict(eps=float("nan")), ValueError, r"`eps` \(=nan\) must be finite"),
        (dict(eps="small"), TypeError, r"`eps` \(='small'\) must be a real number"),
        (dict(axis=1.5), TypeError, r"`standardize`: `axis` \(=1.5\) must be an int"),
        (dict(axis=()), TypeError, r"`axis` \(=\(\)\) must be an int"),
    ],
)
def test_standardize_validates_hyperparameters(kwargs, error, message):
    with pytest.raises(error, match=message):
        eqxrules.Standardize(**kwargs)
    with pytest.raises(error, match=message):
        eqxrules.standardize(jnp.ones(3), **kwargs)


def test_standardize_accepts_zero_eps():
    out = eqxrules.standardize(jnp.array([1.0, 3.0]), eps=0.0)
    np.testing.assert_allclose(out, [-1.0, 1.0])
