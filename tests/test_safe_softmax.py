"""`safe_softmax` and `safe_logsumexp` (issue 42 §1): JAX's values and derivatives
on every row with an unmasked entry above -inf, masks included; on a row with
nothing in it (every entry masked out or -inf: a padded sequence, a fully masked
attention row) zeros and -inf, with zero derivatives and a finite Hessian, where
`jax.nn.softmax` and `jax.grad(jax.nn.logsumexp)` give NaN (JAX #6811)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safe_helpers import derivatives, finite_zero, ulps

import eqxrules

NEG_INF = -jnp.inf

# Rows of x: ordinary, one -inf entry, every entry -inf, every entry masked out,
# masked out where finite and -inf where not.
X = jnp.array(
    [
        [1.0, -2.0, 0.5, 3.0],
        [NEG_INF, 0.25, -1.0, 2.0],
        [NEG_INF, NEG_INF, NEG_INF, NEG_INF],
        [1.0, 2.0, 3.0, 4.0],
        [NEG_INF, 5.0, NEG_INF, -3.0],
    ]
)
MASK = jnp.array(
    [
        [True, False, True, True],
        [True, True, True, False],
        [True, True, True, True],
        [False, False, False, False],
        [True, False, True, False],
    ]
)
EMPTY = np.array([False, False, True, True, True])


def empty_row_failures(softmax: Callable, x=X, mask=MASK, empty=EMPTY) -> set[str]:
    """Which checks `softmax(x, mask)` fails on the empty rows of `x`: value 0,
    the Jacobian 0 (`jacfwd` and `jacrev`, eager, jitted and under `vmap`), and
    every second derivative finite (`hessian`, `jacrev(jacrev)` of the rows'
    sum, jitted and under `vmap`); and on the others, the value and Jacobian of
    `jax.nn.softmax` (the value to 4 ulps)."""
    failed = set()

    def f(x):
        return softmax(x, mask)

    out = np.asarray(f(x))
    if not finite_zero(out[empty]):
        failed.add("value")
    want = np.asarray(jax.nn.softmax(x[~empty], where=mask[~empty]))
    if np.max(ulps(out[~empty], want)) > 4:
        failed.add("value of the other rows")
    ds = derivatives(f)
    jitted, batched = jax.jit(
        lambda x: (
            {name: d(x) for name, d in ds.items()},
            {name: jax.vmap(d)(jnp.stack([x, x])) for name, d in ds.items()},
        )
    )(x)
    for name, d in ds.items():
        ways = [("jit ", jitted[name]), ("vmap ", batched[name][1])]
        # Eager, the first derivatives only: every eager primitive compiles.
        ways += [("", d(x))] if name in ("jacfwd", "jacrev") else []
        for how, j in ways:
            j = np.asarray(j)
            if not np.all(np.isfinite(j)):
                failed.add(f"{how}{name} finite")
            # The rows of an empty row, and its columns (no row depends on it).
            if name in ("jacfwd", "jacrev") and not (
                finite_zero(j[empty]) and finite_zero(j[:, :, empty])
            ):
                failed.add(f"{how}{name}")
    # Each row's own block (JAX's Jacobian is NaN across to an empty row).
    plain = jax.jacrev(lambda x: jax.nn.softmax(x, where=mask))(x)
    got = np.einsum("ijik->ijk", np.asarray(ds["jacrev"](x)))[~empty]
    if not np.allclose(got, np.einsum("ijik->ijk", np.asarray(plain))[~empty]):
        failed.add("derivative of the other rows")
    return failed


def test_softmax_is_zero_with_zero_derivatives_on_empty_rows():
    assert empty_row_failures(lambda x, m: eqxrules.safe_softmax(x, where=m)) == set()


@pytest.mark.slow  # about 10 s: the check's eager derivatives of JAX's softmax
def test_the_check_fails_jax_s_softmax():
    # The control: JAX gives NaN on the row of -inf entries.
    failed = empty_row_failures(lambda x, m: jax.nn.softmax(x, where=m))
    assert {"value", "jacrev", "jacfwd finite"} <= failed, failed


class _UniformWhenEmpty(eqxrules.SafeSoftmax):
    """The planted defect: an empty row gives `1/n` (the softmax of the row fed
    zeros, not selected away), with a zero derivative."""

    def primal(self, x, where=None):
        y = super().primal(x, where)
        empty = jnp.all(y == 0, axis=self.axis, keepdims=True)
        return jnp.where(empty, 1 / x.shape[-1], y).astype(x.dtype)


def test_the_check_catches_a_softmax_whose_empty_rows_give_one_over_n():
    failed = empty_row_failures(lambda x, m: _UniformWhenEmpty()(x, m))
    assert "value" in failed, failed


@pytest.mark.slow
def test_softmax_axis_none_and_tuple_and_where_none():
    """Along every axis (`None`), along a tuple of axes, and without a mask (a row
    of -inf entries is then what is empty): JAX's value where it is finite."""
    x = X[:2]
    for axis in (None, (0, 1), 0):
        got = eqxrules.safe_softmax(x, axis=axis)
        assert np.max(ulps(got, jax.nn.softmax(x, axis=axis))) <= 4
    assert finite_zero(eqxrules.safe_softmax(X[2]))
    assert finite_zero(jax.jacrev(eqxrules.safe_softmax)(X[2]))


@pytest.mark.slow  # the quick tier's 4 minutes
def test_attention_with_fully_masked_rows():
    """Attention of 3 queries over 4 keys, the last two keys padding and the last
    query padding too (its row fully masked): finite outputs and gradients in
    `q`, `k` and `v`, the padded query's output and gradients 0; the plain
    `jax.nn.softmax` of `-inf`-masked logits (the control) makes the gradient in
    `v` all NaN."""
    key_q, key_k, key_v = jax.random.split(jax.random.key(0), 3)
    q, k, v = (
        jax.random.normal(kk, (n, 8)) for kk, n in ((key_q, 3), (key_k, 4), (key_v, 4))
    )
    mask = jnp.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)

    def attention(softmax):
        def loss(q, k, v):
            logits = jnp.where(mask, q @ k.T / jnp.sqrt(8.0), NEG_INF)
            return jnp.sum(jnp.tanh(softmax(logits) @ v))

        return loss

    out = eqxrules.safe_softmax(jnp.where(mask, q @ k.T, NEG_INF)) @ v
    assert finite_zero(out[2])
    grads = jax.jit(jax.grad(attention(eqxrules.safe_softmax), (0, 1, 2)))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    assert finite_zero(grads[0][2]) and finite_zero(grads[2][2:])
    plain = jax.grad(attention(jax.nn.softmax), (0, 1, 2))(q, k, v)
    assert np.all(np.isnan(np.asarray(plain[2])))


@pytest.mark.slow  # the quick tier's 4 minutes
def test_masked_out_entries_change_nothing():
    """A NaN or inf at a masked-out entry changes no value and no derivative, in
    either mode (its tangent is selected away, not multiplied by 0)."""
    clean = X[:2]
    spoiled = clean.at[0, 1].set(jnp.nan).at[1, 3].set(jnp.inf)
    mask = MASK[:2]
    f = lambda x: eqxrules.safe_softmax(x, where=mask)  # noqa: E731
    for d in (f, jax.jacfwd(f), jax.jacrev(f)):
        np.testing.assert_array_equal(np.asarray(d(spoiled)), np.asarray(d(clean)))
    t = jnp.zeros_like(clean).at[0, 1].set(jnp.inf)
    assert np.all(np.isfinite(np.asarray(jax.jvp(f, (clean,), (t,))[1])))


@pytest.mark.slow
def test_softmax_nan_and_inf_and_dtypes():
    """A NaN or +inf in an unmasked entry makes its row NaN (as JAX's), value and
    derivative, and no other row; bfloat16 and float16 are kept, value and
    gradient, with an empty row's zeros."""
    x = X[:3].at[0, 2].set(jnp.nan).at[1, 2].set(jnp.inf)
    out = np.asarray(eqxrules.safe_softmax(x))
    g = np.asarray(jax.grad(lambda x: jnp.sum(eqxrules.safe_softmax(x) ** 2))(x))
    assert np.all(np.isnan(out[:2])) and np.all(np.isnan(g[:2]))
    assert finite_zero(out[2]) and finite_zero(g[2])
    for dtype in (jnp.bfloat16, jnp.float16):
        x = X[:3].astype(dtype)
        y = eqxrules.safe_softmax(x)
        g = jax.grad(
            lambda x: eqxrules.safe_softmax(x)[:, 0].astype(jnp.float32).sum()
        )(x)
        assert y.dtype == g.dtype == dtype
        assert finite_zero(y[2]) and finite_zero(g[2])
        assert np.all(np.isfinite(np.asarray(g, np.float32)))


# logsumexp ------------------------------------------------------------------------


@pytest.mark.first_case_quick
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_logsumexp_is_minus_inf_with_zero_derivatives_on_empty_rows(jit):
    """Value JAX's (-inf on the empty rows); derivative the safe softmax (0 on the
    empty rows), in both modes; Hessian finite (0 on the empty rows): it is the
    softmax's Jacobian. The control, JAX's, is NaN there."""
    wrap = jax.jit if jit else (lambda f: f)
    f = lambda x: eqxrules.safe_logsumexp(x, where=MASK)  # noqa: E731
    value = np.asarray(wrap(f)(X))
    want = np.asarray(jax.nn.logsumexp(X, axis=-1, where=MASK))
    assert np.array_equal(np.isinf(value), EMPTY) and np.max(ulps(value, want)) <= 4
    softmax = np.asarray(eqxrules.safe_softmax(X, where=MASK))
    for d in (jax.jacfwd(f), jax.jacrev(f)):
        jac = np.asarray(wrap(d)(X))
        np.testing.assert_allclose(np.einsum("iij->ij", jac), softmax, rtol=1e-6)
    hess = np.asarray(wrap(jax.hessian(lambda x: f(x).sum()))(X))
    assert np.all(np.isfinite(hess)) and finite_zero(hess[EMPTY])
    jac_softmax = jax.jacrev(lambda x: eqxrules.safe_softmax(x, where=MASK))(X)
    np.testing.assert_allclose(
        np.einsum("ijik->ijk", hess), np.einsum("ijik->ijk", jac_softmax), atol=1e-6
    )
    plain = jax.grad(lambda x: jax.nn.logsumexp(x, axis=-1).sum())(X)
    assert np.all(np.isnan(np.asarray(plain)[2]))


@pytest.mark.slow  # the quick tier's 4 minutes
def test_logsumexp_far_from_one():
    """Entries near 1e30 and -1e30: JAX's value, and the softmax as derivative,
    where `exp(x - ℓ)` (the planted control) is 1 for every entry that rounds to
    the max."""
    x = jnp.array([[1e30, 1e30, 0.0], [-1e30, -1e30, -2e30], [1e-30, 0.0, -1e-30]])
    value = eqxrules.safe_logsumexp(x)
    assert np.max(ulps(value, jax.nn.logsumexp(x, axis=-1))) <= 4
    grad = np.asarray(jax.grad(lambda x: eqxrules.safe_logsumexp(x).sum())(x))
    np.testing.assert_allclose(grad, np.asarray(jax.nn.softmax(x)), rtol=1e-6)
    np.testing.assert_allclose(grad[0], [0.5, 0.5, 0.0])
    naive = np.exp(np.asarray(x - value[:, None], np.float32))
    assert np.allclose(naive[0], [1.0, 1.0, 0.0])


@pytest.mark.slow
def test_logsumexp_nan_and_inf_and_dtypes():
    """A NaN makes its row NaN, value and derivative; a row holding +inf gives
    +inf, with a NaN derivative at that entry and 0 at the others (JAX's); other
    rows are unchanged. bfloat16 and float16 are kept, with an empty row's -inf
    and zeros."""
    x = X[:3].at[0, 2].set(jnp.nan).at[1, 2].set(jnp.inf)
    out = np.asarray(eqxrules.safe_logsumexp(x))
    g = np.asarray(jax.grad(lambda x: eqxrules.safe_logsumexp(x)[:2].sum())(x))
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf
    assert np.all(np.isnan(g[0])) and np.isnan(g[1, 2]) and finite_zero(g[1, [0, 1, 3]])
    for dtype in (jnp.bfloat16, jnp.float16):
        x = X[:3].astype(dtype)
        g = jax.grad(
            lambda x: eqxrules.safe_logsumexp(x)[1:].astype(jnp.float32).sum()
        )(x)
        assert eqxrules.safe_logsumexp(x).dtype == g.dtype == dtype
        assert float(eqxrules.safe_logsumexp(x)[2]) == -np.inf and finite_zero(g[2])
