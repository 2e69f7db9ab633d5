"""`safe_eigh` (issue 42 §1): `jnp.linalg.eigh`'s value, and a derivative that drops
the terms of pairs of equal eigenvalues, checked against central finite
differences (float64 NumPy) of a loss invariant to rotations inside the degenerate
eigenspace (a projector onto it, plus a function of the eigenvalues), on
`diag(1, 1, 3, 4)` and on the same matrix in a random basis, where float32 leaves
the two equal eigenvalues differing in their last bits. The plain `eigh` gives
NaN on the first and a wrong derivative on the second (the controls), and so does
a planted `safe_eigh` that keeps the degenerate terms."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules._rules.safe_eigh import degenerate

WEIGHTS = np.arange(16.0).reshape(4, 4) / 10
SPECTRUM = np.array([1.0, 1.0, 3.0, 4.0])


def _basis(kind: str) -> np.ndarray:
    if kind == "identity":
        return np.eye(4)
    q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((4, 4)))
    return q


def degenerate_matrix(kind: str) -> jax.Array:
    """`Q diag(1, 1, 3, 4) Qᵀ` in float32, `Q` the identity or a random rotation."""
    q = _basis(kind)
    return jnp.asarray(q @ np.diag(SPECTRUM) @ q.T, jnp.float32)


def invariant_loss(eigh):
    """A loss invariant to rotations inside the eigenspace of the two smallest
    eigenvalues: a weighted sum of the projector onto it, and of `sin λ`."""

    def loss(a):
        w, v = eigh(a)
        p = v[..., :2] @ jnp.swapaxes(v[..., :2], -1, -2)
        return jnp.sum(p * WEIGHTS) + jnp.sum(jnp.sin(w))

    return loss


def _loss64(a: np.ndarray) -> float:
    w, v = np.linalg.eigh((a + a.T) / 2)
    p = v[:, :2] @ v[:, :2].T
    return float(np.sum(p * WEIGHTS) + np.sum(np.sin(w)))


def finite_differences(a: jax.Array, h: float = 1e-6) -> np.ndarray:
    """Central differences of the loss in float64 at `a` (as float64: the float32
    matrix, rounding and all), one entry of `a` at a time."""
    a64 = np.asarray(a, np.float64)
    out = np.zeros_like(a64)
    for i, j in np.ndindex(*a64.shape):
        e = np.zeros_like(a64)
        e[i, j] = h
        out[i, j] = (_loss64(a64 + e) - _loss64(a64 - e)) / (2 * h)
    return out


def gradient_failures(eigh, kind: str) -> list[str]:
    """The ways the gradient of the invariant loss through `eigh` at the degenerate
    matrix is not the finite differences' (within 1e-4 of their largest entry):
    reverse mode, forward mode, jitted."""
    a = degenerate_matrix(kind)
    want = finite_differences(a)
    loss = invariant_loss(eigh)
    grads = {
        "grad": jax.grad(loss)(a),
        "jacfwd": jax.jacfwd(loss)(a),
        "jit grad": jax.jit(jax.grad(loss))(a),
    }
    tol = 1e-4 * np.max(np.abs(want))
    return [
        name
        for name, g in grads.items()
        if not np.all(np.abs(np.asarray(g, np.float64) - want) <= tol)
    ]


BASES = ["identity", "random"]


@pytest.mark.first_case_quick
@pytest.mark.parametrize("kind", BASES)
def test_derivative_of_an_invariant_loss_is_the_finite_differences(kind):
    assert gradient_failures(eqxrules.safe_eigh, kind) == []
    # The control: JAX's eigh, NaN on the diagonal matrix, wrong in the rotated.
    assert gradient_failures(jnp.linalg.eigh, kind) == ["grad", "jacfwd", "jit grad"]


class _KeepsDegenerateTerms(eqxrules.SafeEigh):
    r"""The planted defect: `jnp.linalg.eigh`'s derivative, $F_{ij} = 1 /
    (\lambda_j - \lambda_i)$ for every pair (inf on the diagonal matrix, and of
    order $10^7$ where float32 splits the equal pair)."""

    summary: ClassVar[str] = "eigh(a); the plain derivative"

    def tangent(self, args, t_args, t_self, out, **kwargs):
        (t,) = t_args
        w, v = out
        t = (t + t.T) / 2
        m = v.T @ t @ v
        f = 1 / (w[None, :] - w[:, None] + jnp.eye(w.size)) - jnp.eye(w.size)
        return jnp.diagonal(m), v @ (f * m)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("kind", BASES)
def test_the_check_catches_a_safe_eigh_that_keeps_the_degenerate_terms(kind):
    assert gradient_failures(_KeepsDegenerateTerms(), kind) != []


@pytest.mark.slow  # about 10 s: Jacobians in both modes, a Hessian, 16 gradients
def test_away_from_degeneracy_it_is_jax_s_derivative():
    """On random symmetric matrices (a batch, under `vmap` and `jit`), the
    Jacobian of eigenvalues and eigenvectors, forward and reverse, is
    `jnp.linalg.eigh`'s, and the Hessian of the loss is the finite
    differences' of its gradient."""
    b = jax.random.normal(jax.random.key(1), (3, 4, 4))
    a = b + jnp.swapaxes(b, -1, -2)

    def jac(eigh, mode):
        return jax.jit(jax.vmap(mode(lambda a: tuple(eigh(a)))))(a)

    for mode in (jax.jacfwd, jax.jacrev):
        got, want = jac(eqxrules.safe_eigh, mode), jac(jnp.linalg.eigh, mode)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    loss = invariant_loss(eqxrules.safe_eigh)
    hess = np.asarray(jax.hessian(loss)(a[0])).reshape(16, 16)
    g = jax.jit(jax.grad(loss))
    h = 1e-2
    fd = np.stack(
        [
            (np.asarray(g(a[0] + h * e)) - np.asarray(g(a[0] - h * e))).ravel()
            / (2 * h)
            for e in jnp.eye(16).reshape(16, 4, 4)
        ]
    )
    np.testing.assert_allclose(hess, fd, atol=2e-3 * np.max(np.abs(fd)))


@pytest.mark.first_case_quick
@pytest.mark.parametrize(
    "spectrum", [[1.0, 1.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0], [0.0] * 4]
)
def test_second_derivatives_are_finite_at_a_degenerate_spectrum(spectrum):
    """In every second-order mode, where JAX's are NaN (the control)."""
    q = _basis("random")
    a = jnp.asarray(q @ np.diag(spectrum) @ q.T, jnp.float32)
    loss = invariant_loss(eqxrules.safe_eigh)
    modes = {
        "hessian": jax.hessian(loss),
        "jacfwd(jacrev)": jax.jacfwd(jax.jacrev(loss)),
        "jacrev(jacrev)": jax.jacrev(jax.jacrev(loss)),
    }
    for name, m in modes.items():
        assert np.all(np.isfinite(np.asarray(jax.jit(m)(a)))), name
    diagonal = jnp.diag(jnp.asarray(spectrum, jnp.float32))
    assert not np.all(
        np.isfinite(jax.hessian(invariant_loss(jnp.linalg.eigh))(diagonal))
    )


@pytest.mark.slow
def test_the_tolerance_is_sixteen_n_epsilons_of_the_spectrum():
    """Eigenvalues within `16 n ε max|λ|` count as equal (their terms dropped),
    twice that not (their terms kept: JAX's derivative)."""
    n, eps = 3, float(jnp.finfo(jnp.float32).eps)
    tol = 16 * n * eps * 4.0
    for gap, equal in ((0.5 * tol, True), (2 * tol, False)):
        w = jnp.array([1.0, 1.0 + gap, 4.0])
        close = np.asarray(degenerate(w))
        assert close[0, 1] == close[1, 0] == equal and not close[0, 2]
        a = jnp.diag(w)
        jac = jax.jacfwd(lambda a: eqxrules.safe_eigh(a)[1])(a)
        plain = jax.jacfwd(lambda a: jnp.linalg.eigh(a)[1])(a)
        assert np.all(np.isfinite(np.asarray(jac)))
        same = np.allclose(np.asarray(jac), np.asarray(plain), rtol=1e-4)
        assert same != equal


@pytest.mark.slow
def test_dtypes_nan_and_shapes():
    """bfloat16 and float16 are kept (decomposed in float32), value and gradient;
    a NaN in a matrix of a batch makes it NaN, value and derivative, and no other;
    a matrix that is not square is a `ValueError` naming `a` and its shape."""
    a = degenerate_matrix("identity")
    for dtype in (jnp.bfloat16, jnp.float16):
        w, v = eqxrules.safe_eigh(a.astype(dtype))
        g = jax.grad(invariant_loss(eqxrules.safe_eigh))(a.astype(dtype))
        assert w.dtype == v.dtype == g.dtype == dtype
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    rotated = degenerate_matrix("random")
    batch = jnp.stack([rotated, rotated.at[0, 1].set(jnp.nan)])
    w, _ = eqxrules.safe_eigh(batch)
    g = jax.grad(lambda b: jax.vmap(invariant_loss(eqxrules.safe_eigh))(b).sum())(batch)
    assert np.all(np.isfinite(np.asarray(w[0]))) and np.all(np.isnan(np.asarray(w[1])))
    assert np.all(np.isfinite(np.asarray(g[0]))) and np.any(np.isnan(np.asarray(g[1])))
    with pytest.raises(
        ValueError, match=r"`safe_eigh`: `a` must be a square.*\(3, 4\)"
    ):
        eqxrules.safe_eigh(jnp.zeros((3, 4)))
