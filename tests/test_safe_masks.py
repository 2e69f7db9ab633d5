"""The NaN-safe divisions and masks beyond their table rows in tests/test_safe.py:
which NaN stays visible, broadcasting, `safe_where`'s `fn` (its parameters, that it
be elementwise, a Python scalar `otherwise`), and `safe_xlogy` in entropy and
cross-entropy."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import xlogy
from safe_helpers import value_and_grads

import eqxrules
from eqxrules._rules.safe_masks import SafeWhere

# Which NaN is visible, broadcasting, `fn`'s own parameters -----------------------


def test_divide_nan_is_visible_where_b_is_not_zero():
    """A NaN in `a` or `b` makes its own element NaN, value and both gradients,
    where `b != 0`; where `b == 0` a NaN `a` is hidden (the documented
    convention) but a NaN `b` is not (NaN is not 0)."""
    a = jnp.array([jnp.nan, 1.0, jnp.nan, 2.0, 3.0])
    b = jnp.array([2.0, jnp.nan, 0.0, 0.0, 4.0])
    out, g_a, g_b = value_and_grads(eqxrules.safe_divide, a, b)
    nan = [True, True, False, False, False]
    for v in (out, g_a, g_b):
        np.testing.assert_array_equal(np.isnan(v), nan)
    np.testing.assert_array_equal(out[2:], [0.0, 0.0, 0.75])
    np.testing.assert_array_equal([g_a[2:4], g_b[2:4]], np.zeros((2, 2)))


def test_where_nan_is_visible_only_where_it_is_used():
    """A NaN `x` where the mask holds and a NaN `otherwise` where it does not make
    their element NaN (value, and gradient in `x` and `otherwise`); a NaN `x`
    where the mask does not hold, or a NaN `otherwise` where it does, is not
    used and changes nothing."""
    mask = jnp.array([True, False, True, False])
    x = jnp.array([jnp.nan, jnp.nan, 2.0, -1.0])
    other = jnp.array([0.5, 0.5, jnp.nan, jnp.nan])

    def f(x, other):
        return eqxrules.safe_where(mask, jnp.log, x, other)

    out, g_x, g_o = value_and_grads(f, x, other)
    nan = [True, False, False, True]
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(np.isnan(g_x), [True, False, False, False])
    np.testing.assert_array_equal(np.isnan(g_o), [False, False, False, True])
    assert g_x[1] == g_x[3] == 0 and g_o[0] == g_o[2] == 0


@pytest.mark.parametrize("b_shape", [(3,), (), (4, 1)], ids=["row", "scalar", "column"])
def test_divide_broadcasts_with_gradients_of_each_shape(b_shape):
    """`a` of shape (4, 3) and `b` that broadcasts: the value and the gradient in
    each (of its own shape, summed over the broadcast axes) equal the plain
    `a / b`'s, away from zero."""
    a = jax.random.normal(jax.random.key(0), (4, 3))
    b = 1.5 + jax.random.uniform(jax.random.key(1), b_shape)
    got = value_and_grads(eqxrules.safe_divide, a, b)
    want = value_and_grads(jnp.divide, a, b)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def test_where_zero_d_otherwise_gets_the_sum_of_its_cotangents():
    """A 0-d `otherwise` broadcasts; its gradient is the sum of the cotangents of
    the masked-out elements (a 0-d array, of its dtype)."""
    x = jnp.array([[-1.0, 2.0], [0.0, 3.0]])
    g = jax.grad(
        lambda o: jnp.sum(
            eqxrules.safe_where(x > 0, jnp.log, x, o) * jnp.arange(4.0).reshape(2, 2)
        )
    )(jnp.float32(7.0))
    assert g.shape == () and g.dtype == jnp.float32 and float(g) == 0.0 + 2.0


def test_where_parameters_of_fn_need_a_finite_fill():
    """`fn`'s own parameters get the gradient of the masked-in elements when `fn`
    is finite at `fill` (the default 1 for `log`); with `fill` at `fn`'s
    singular point (0 for `log`) that gradient is NaN, the documented limit
    (planted: the check sees it)."""

    class ScaledLog(eqx.Module):
        scale: jax.Array

        def __call__(self, x):
            return self.scale * jnp.log(x)

    x = jnp.array([-1.0, 0.0, 2.0, 4.0])
    fn = ScaledLog(jnp.asarray(3.0))

    def grad_scale(fill):
        def loss(fn):
            return jnp.sum(eqxrules.safe_where(x > 0, fn, x, 0.0, fill=fill))

        return float(eqx.filter_grad(loss)(fn).scale)

    assert grad_scale(1.0) == pytest.approx(np.log(2.0) + np.log(4.0))
    assert np.isnan(grad_scale(0.0))


class _NaiveDivide(eqxrules.SafeDivide):
    r"""$q = a/b$ (0 where $b = 0$), $\dot q = (\dot a - q\dot b)/b$: the plain
    tangent, inf or NaN where $b = 0$."""

    summary: ClassVar[str] = "a/b; the plain derivative"

    def tangent(self, args, t_args, t_self, out, **kwargs):
        (_, b), (t_a, t_b) = args, t_args
        t_a = jnp.zeros_like(out) if t_a is None else t_a
        t_b = jnp.zeros_like(out) if t_b is None else t_b
        return (t_a - out * t_b) / b


@pytest.mark.slow  # verify_rule on two rule classes
def test_verify_rule_names_the_zero_divisor():
    """`verify_rule` on a rule of several inputs checks each input's kinks and
    degenerate values: the plain tangent fails where `b` is 0, named."""
    problems = eqxrules.verify_rule(_NaiveDivide, raise_on_failure=False).problems
    assert any("`b` = 0" in p or "`b` an all-zero input" in p for p in problems), (
        problems
    )
    assert eqxrules.verify_rule(eqxrules.SafeDivide, raise_on_failure=False).passed


# `safe_where` takes what `jnp.where` takes, and an elementwise `fn` ----------------


@pytest.mark.first_case_quick
@pytest.mark.parametrize("otherwise", [0, 2, -1.5], ids=["int 0", "int 2", "float"])
def test_where_takes_a_python_scalar_otherwise(otherwise):
    """As `jnp.where` does (issue 40 §3: `otherwise=0` was a `TypeError`): the value
    is `jnp.where`'s, in `x`'s dtype, and the gradient in `x` is the safe one."""
    x = jnp.array([-1.0, 0.0, 2.0])
    got = eqxrules.safe_where(x > 0, jnp.log, x, otherwise)
    want = jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)), otherwise)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    g = jax.grad(lambda x: eqxrules.safe_where(x > 0, jnp.log, x, otherwise).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), [0.0, 0.0, 0.5])
    low = eqxrules.safe_where(x > 0, jnp.log, x.astype(jnp.bfloat16), otherwise)
    assert low.dtype == jnp.bfloat16


@pytest.mark.parametrize("otherwise", [True, "0", [0.0]], ids=["bool", "str", "list"])
def test_where_rejects_other_otherwise(otherwise):
    with pytest.raises(TypeError, match="`safe_where`.*`otherwise`"):
        eqxrules.safe_where(jnp.array([True]), jnp.log, jnp.array([2.0]), otherwise)


NOT_ELEMENTWISE = {
    # One element alone gives shape (1,): `cumsum` flattens.
    "jnp.cumsum": (jnp.cumsum, "gives shape (1,)"),
    # Of another shape than `x`.
    "jnp.sum": (jnp.sum, "to shape ()"),
    # One element alone has no axis -1.
    "jax.nn.softmax": (jax.nn.softmax, "raised"),
}


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(NOT_ELEMENTWISE))
def test_where_names_a_function_that_is_not_elementwise(name):
    """What shapes can tell when `safe_where` is traced is a `ValueError` naming
    `safe_where`, `fn` and what must hold (issue 40 §3), jitted too."""
    fn, why = NOT_ELEMENTWISE[name]
    x = jnp.array([1.0, 2.0, 3.0])
    mask = jnp.array([True, False, True])
    for call in (eqxrules.safe_where, jax.jit(eqxrules.safe_where, static_argnums=1)):
        with pytest.raises(ValueError, match="`safe_where`: `fn` must be elementwise"):
            call(mask, fn, x, 0.0)
    with pytest.raises(ValueError) as info:
        eqxrules.safe_where(mask, fn, x, 0.0)
    assert why in str(info.value)


def test_without_the_check_cumsum_is_silently_wrong(monkeypatch):
    """The planted control: with the check taken out, `jnp.cumsum` behind
    `safe_where` gives `[1, 0, 5]` (it sums `fill` in place of the masked-out
    element) where `jnp.where` gives `[1, 0, 6]`: what the check prevents."""
    x, mask = jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True])
    monkeypatch.setattr(SafeWhere, "_check_elementwise", lambda *args: None)
    got = eqxrules.safe_where(mask, jnp.cumsum, x, 0.0)
    np.testing.assert_array_equal(np.asarray(got), [1.0, 0.0, 5.0])
    np.testing.assert_array_equal(jnp.where(mask, jnp.cumsum(x), 0.0), [1, 0, 6])


def test_where_takes_elementwise_functions_with_parameters_per_element():
    """No false alarm: `fn` closing over an array of parameters per element (of
    `x`'s shape, or of a trailing part of it), or an `eqx.Module`, is elementwise;
    its value and derivatives are the double where's."""
    x = jnp.array([[-1.0, 2.0, 3.0], [0.5, 0.0, 4.0]])
    for w in (jnp.arange(1.0, 7.0).reshape(2, 3), jnp.array([1.0, 2.0, 3.0])):

        def fn(v, w=w):
            return w * jnp.log(v)

        def plain(x, w=w):
            return jnp.where(x > 0, w * jnp.log(jnp.where(x > 0, x, 1.0)), 0.0)

        got = value_and_grads(lambda x: eqxrules.safe_where(x > 0, fn, x, 0), x)
        want = value_and_grads(plain, x)
        for g, h in zip(got, want, strict=True):
            np.testing.assert_allclose(g, h, rtol=1e-6)


# xlogy ----------------------------------------------------------------------------


def _entropy(xlogy, p):
    return -jnp.sum(xlogy(p, p))


@pytest.mark.first_case_quick
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_xlogy_entropy_of_a_distribution_with_zeros(jit):
    """`-Σ p log p`: gradient `-(log p + 1)` where `p > 0` and 0 where `p = 0`,
    and a finite Hessian (`-1/p` on the diagonal, 0 at `p = 0`), also under
    `vmap`; JAX's `xlogy` (the control) gives NaN there."""
    p = jnp.array([0.5, 0.25, 0.25, 0.0])
    wrap = jax.jit if jit else (lambda f: f)
    safe = lambda p: _entropy(eqxrules.safe_xlogy, p)  # noqa: E731
    grad, hess = wrap(jax.grad(safe))(p), wrap(jax.hessian(safe))(p)
    logs = np.log(np.array([0.5, 0.25, 0.25]))
    np.testing.assert_allclose(grad, np.append(-(logs + 1), 0.0), rtol=1e-6)
    np.testing.assert_allclose(hess, np.diag([-2.0, -4.0, -4.0, 0.0]), rtol=1e-6)
    batched = wrap(jax.vmap(jax.grad(safe)))(jnp.stack([p, p[::-1]]))
    np.testing.assert_array_equal(np.asarray(batched)[0], np.asarray(grad))
    plain = wrap(jax.grad(lambda p: _entropy(xlogy, p)))(p)
    assert np.isnan(np.asarray(plain)[3])


def test_xlogy_cross_entropy_against_one_hot_targets():
    """`-Σ t log q` with one-hot targets `t` and a prediction `q` with zeros: the
    gradient in `q` is `-t/q` (0 where both are 0), in `t` it is `-log q` (0
    where both are 0); JAX's `xlogy` gives inf in `t`'s and NaN in `q`'s."""
    t = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    q = jnp.array([[0.5, 0.5, 0.0], [0.25, 0.75, 0.0]])

    def loss(xlogy):
        return lambda t, q: -jnp.sum(xlogy(t, q))

    g_t, g_q = jax.grad(loss(eqxrules.safe_xlogy), (0, 1))(t, q)
    tn, qn = np.asarray(t), np.asarray(q)
    want_q = -tn / np.where(qn == 0, 1.0, qn)  # `t` is 0 where `q` is
    want_t = -np.log(np.where(qn == 0, 1.0, qn))
    np.testing.assert_allclose(g_q, want_q, rtol=1e-6)
    np.testing.assert_allclose(g_t, want_t, rtol=1e-6)
    plain = jax.grad(loss(xlogy), (0, 1))(t, q)
    assert not any(np.isfinite(np.asarray(g)[:, 2]).any() for g in plain)


@pytest.mark.slow  # about 4 s: eager second derivatives
def test_xlogy_derivatives_at_and_beside_the_origin():
    """At (0, 0) every derivative is 0, the Hessian too; beside it the plain ones:
    `∂/∂x = log y` at `x = 0`, `∂/∂y = x/y` (0 at `x = 0`), and the mixed second
    derivative `1/y`, the same in both orders (the Hessian is symmetric)."""

    def f(xy):
        return eqxrules.safe_xlogy(xy[0], xy[1])

    at = jnp.zeros(2)
    assert np.all(np.asarray(jax.grad(f)(at)) == 0)
    assert np.all(np.asarray(jax.hessian(f)(at)) == 0)
    beside = jnp.array([0.0, 0.5])
    np.testing.assert_allclose(jax.grad(f)(beside), [np.log(0.5), 0.0], rtol=1e-6)
    h = np.asarray(jax.hessian(f)(beside))
    np.testing.assert_allclose(h, [[0.0, 2.0], [2.0, 0.0]], rtol=1e-6)
    h_rr = np.asarray(jax.jacrev(jax.jacrev(f))(beside))
    np.testing.assert_allclose(h_rr, h, rtol=1e-6)


@pytest.mark.slow
def test_xlogy_nan_is_visible_and_negative_y_is_nan():
    """A NaN `y` makes its element's value and both derivatives NaN; a NaN `x` its
    value and its derivative in `y` (in `x` it is `log y`, which no `x` changes).
    `0 · log y` of a negative or infinite `y` is NaN, not 0: no value there."""
    x = jnp.array([0.0, jnp.nan, 1.0, 0.0, 0.0, 2.0])
    y = jnp.array([jnp.nan, 0.5, 0.5, -1.0, jnp.inf, 0.25])
    out = eqxrules.safe_xlogy(x, y)
    g_x, g_y = jax.grad(lambda x, y: eqxrules.safe_xlogy(x, y).sum(), (0, 1))(x, y)
    np.testing.assert_array_equal(
        np.isnan(np.asarray(out)), [True, True, False, True, True, False]
    )
    np.testing.assert_array_equal(np.isnan(np.asarray(g_y))[:3], [True, True, False])
    assert np.isnan(g_x[0]) and float(g_x[1]) == pytest.approx(np.log(0.5))


class _PlainXlogy(eqxrules.SafeXlogy):
    r"""$q = x \log y$, $\dot q = \dot x \log y + \dot y\, x/y$: the plain
    derivative, $(-\infty, \mathrm{NaN})$ at (0, 0)."""

    summary: ClassVar[str] = "x·log(y); the plain derivative"

    def tangent(self, args, t_args, t_self, out, **kwargs):
        (x, y), (t_x, t_y) = args, t_args
        return t_x * jnp.log(y) + t_y * x / y


def test_the_checks_catch_an_xlogy_whose_derivative_at_the_origin_is_nan():
    """The planted defect: the tests above fail on it (the entropy's gradient is
    NaN at `p = 0`)."""
    p = jnp.array([0.5, 0.5, 0.0])
    grad = jax.grad(lambda p: _entropy(_PlainXlogy(), p))(p)
    assert np.isnan(np.asarray(grad)[2])


@pytest.mark.slow  # verify_rule on a rule of two inputs
def test_verify_rule_catches_an_xlogy_whose_derivative_at_the_origin_is_nan():
    """... and so does `verify_rule`, at the kink 0 of `x` (with `y` drawn off its
    kinks) and at the degenerate all-zero inputs."""
    problems = eqxrules.verify_rule(_PlainXlogy, raise_on_failure=False).problems
    assert any("`vjp`" in p or "`jvp`" in p for p in problems), problems
