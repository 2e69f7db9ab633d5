"""The NaN-safe angles beyond their table rows in tests/test_safe.py: `safe_arccos`
and `safe_arcsin` (one implementation) within rounding of ±1 and beyond, and
`safe_atan2` at the origin of vectors in use, and far from 1."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safe_helpers import F32_EPS

import eqxrules

# arccos and arcsin beyond ±1 ------------------------------------------------------


@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_arc_rounding_band_is_four_epsilons(dtype):
    eps = float(jnp.finfo(dtype).eps)
    x = jnp.asarray([1 + 4 * eps, -1 - 4 * eps, 1 + 5 * eps, -1 - 5 * eps], dtype)
    for f in (eqxrules.safe_arccos, eqxrules.safe_arcsin):
        out = np.asarray(f(x), np.float32)
        g = np.asarray(jax.vmap(jax.grad(f))(x), np.float32)
        np.testing.assert_array_equal(
            out[:2], np.asarray(f(jnp.asarray([1, -1], dtype)), np.float32)
        )
        assert (
            np.all(g[:2] == 0) and np.all(np.isnan(out[2:])) and np.all(np.isnan(g[2:]))
        )


def test_arccos_of_a_unit_vector_with_itself():
    """The motivating case: `u @ u` rounds past 1 for some normalised `u`, where
    the plain `arccos` is NaN; the rule gives 0 with a zero gradient there, and a
    finite value and gradient everywhere."""
    v = jax.random.normal(jax.random.key(1), (500, 16))

    def angle(f, v):
        u = v / jnp.linalg.norm(v)
        return f(u @ u)

    cosine = np.asarray(jax.vmap(lambda v: angle(lambda c: c, v))(v))
    past = cosine > 1
    assert np.any(past)
    assert np.all(
        np.isnan(np.asarray(jax.vmap(lambda v: angle(jnp.arccos, v))(v))[past])
    )
    safe = np.asarray(jax.vmap(lambda v: angle(eqxrules.safe_arccos, v))(v))
    g = np.asarray(jax.vmap(jax.grad(lambda v: angle(eqxrules.safe_arccos, v)))(v))
    assert np.all(safe[cosine >= 1] == 0) and np.all(g[cosine >= 1] == 0)
    assert np.all(np.isfinite(safe)) and np.all(np.isfinite(g))


def test_arc_derivative_is_accurate_up_to_the_ends():
    """Within 1000 epsilons of 1, the derivative to 1e-6 of the float64 one, where
    `1/sqrt(1 - x*x)` evaluated in float32 loses digits to cancellation (the
    planted failure)."""
    x = 1 - F32_EPS * np.arange(1, 1000, dtype=np.float32)
    exact = 1 / np.sqrt(1 - np.asarray(x, np.float64) ** 2)
    for sign, f in [(-1, eqxrules.safe_arccos), (1, eqxrules.safe_arcsin)]:
        g = np.asarray(jax.vmap(jax.grad(f))(jnp.asarray(x)))
        np.testing.assert_allclose(g, sign * exact, rtol=1e-6)
    cancelled = 1 / np.sqrt(np.float32(1) - x * x)
    assert not np.allclose(cancelled, exact, rtol=1e-6, atol=0)


def test_arccos_and_arcsin_share_one_implementation():
    """`arcsin x = π/2 − arccos x`: the values agree to rounding and the slopes
    are exactly opposite, everywhere, the edges and beyond included (one
    implementation, `_Arc`, whose `kind` is all that differs)."""
    x = jnp.concatenate(
        [jnp.linspace(-1.0, 1.0, 101), jnp.asarray([1 + 4 * F32_EPS, -1.5, jnp.nan])]
    )
    cos, sin = eqxrules.safe_arccos(x), eqxrules.safe_arcsin(x)
    np.testing.assert_allclose(sin, np.pi / 2 - cos, atol=4 * F32_EPS)
    g_cos, g_sin = (
        jax.vmap(jax.grad(f))(x) for f in (eqxrules.SafeArccos(), eqxrules.SafeArcsin())
    )
    np.testing.assert_array_equal(np.asarray(g_sin), -np.asarray(g_cos))
    assert (
        type(eqxrules.SafeArccos()).__mro__[1] is type(eqxrules.SafeArcsin()).__mro__[1]
    )


# atan2 ----------------------------------------------------------------------------


def _angles(atan2, v):
    """The angle of each 2-D vector `v[i] = (x, y)`."""
    return atan2(v[:, 1], v[:, 0])


@pytest.mark.first_case_quick
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_atan2_angles_of_vectors_with_a_zero_one(jit):
    """The angles of 2-D vectors, one of them zero (a particle on the origin):
    value, gradient and Hessian finite, in both modes and under `vmap`; the zero
    vector's derivatives 0; the others' JAX's. The control, `jnp.arctan2`,
    is NaN at the zero vector."""
    v = jnp.array([[1.0, 1.0], [0.0, 0.0], [-1.0, 0.0], [0.0, -2.0]])
    wrap = jax.jit if jit else (lambda f: f)

    def loss(atan2):
        return lambda v: jnp.sum(jnp.sin(_angles(atan2, v)) * jnp.arange(4.0))

    safe = loss(eqxrules.safe_atan2)
    grad, jac, hess = (
        wrap(jax.grad(safe))(v),
        wrap(jax.jacfwd(lambda v: _angles(eqxrules.safe_atan2, v)))(v),
        wrap(jax.hessian(safe))(v),
    )
    batched = wrap(jax.vmap(jax.grad(lambda p: eqxrules.safe_atan2(p[1], p[0]))))(v)
    for a in (grad, jac, hess, batched):
        assert np.all(np.isfinite(np.asarray(a)))
    assert np.all(np.asarray(grad)[1] == 0) and np.all(np.asarray(hess)[1] == 0)
    assert np.all(np.asarray(batched)[1] == 0)
    plain = wrap(jax.grad(loss(jnp.arctan2)))(v)
    others = np.array([0, 2, 3])
    np.testing.assert_allclose(np.asarray(grad)[others], np.asarray(plain)[others])
    assert np.all(np.isnan(np.asarray(plain)[1]))


@pytest.mark.first_case_quick
@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e-10, 1e10, 1e20, 1e30])
def test_atan2_derivative_is_jax_s_at_every_scale(scale):
    """Computed from `x² + y²` as JAX's is (dividing by `|x| + |y|` first would
    keep it finite everywhere, at 1.15 times the flops of the hand-written double
    where): right where that square neither overflows nor underflows, infinite as
    JAX's nearer the origin than about 1e-19, 0 as JAX's beyond about 1e19."""
    p = jnp.asarray(scale * np.array([[3.0, 4.0], [-1.0, 0.5]]), jnp.float32)
    got = jax.vmap(jax.grad(eqxrules.safe_atan2, (0, 1)))(p[:, 1], p[:, 0])
    jax_s = jax.vmap(jax.grad(jnp.arctan2, (0, 1)))(p[:, 1], p[:, 0])
    got, jax_s = np.asarray(got), np.asarray(jax_s)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(jax_s))
    np.testing.assert_allclose(got, jax_s, rtol=1e-6)  # equal infinities pass
    if 1e-10 <= scale <= 1e10:
        # (∂/∂y, ∂/∂x) = (x, -y)/(x² + y²) at (3, 4) and (-1, 0.5), times `scale`.
        exact = np.asarray([[3.0, -1.0], [-4.0, -0.5]]) / np.array([25.0, 1.25])
        np.testing.assert_allclose(got, exact / scale, rtol=1e-6)


@pytest.mark.slow
def test_atan2_nan_and_dtypes():
    """A NaN makes its own element NaN, value and both derivatives; bfloat16 and
    float16 are kept, value and derivatives, with the origin's zeros."""
    y = jnp.array([jnp.nan, 0.0, 1.0])
    x = jnp.array([1.0, 0.0, jnp.nan])
    value = eqxrules.safe_atan2(y, x)
    gy, gx = jax.grad(lambda y, x: eqxrules.safe_atan2(y, x).sum(), (0, 1))(y, x)
    for a in (value, gy, gx):
        np.testing.assert_array_equal(np.isnan(np.asarray(a)), [True, False, True])
    for dtype in (jnp.bfloat16, jnp.float16):
        yd, xd = jnp.array([0.0, 1.0], dtype), jnp.array([0.0, 1.0], dtype)
        gy, gx = jax.grad(lambda y, x: eqxrules.safe_atan2(y, x).sum(), (0, 1))(yd, xd)
        assert eqxrules.safe_atan2(yd, xd).dtype == gy.dtype == gx.dtype == dtype
        assert float(gy[0]) == float(gx[0]) == 0 and float(gy[1]) == 0.5
