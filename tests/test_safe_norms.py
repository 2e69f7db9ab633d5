"""`safe_norm` and `safe_normalize` far from 1: values and first derivatives of
float32 entries near 1e±30, where the plain sum of squares overflows or underflows,
and second derivatives (`safe_normalize`'s Jacobian, which is `safe_norm`'s
Hessian) near 1e±20 and 1e±30 in every second-order mode, eager and jitted (issue
42 §2: `jax.hessian(safe_norm)` was all -inf at 3e-20, and silently wrong at 3e20).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safe_helpers import F32_EPS

import eqxrules
from eqxrules.testing import check_rule

SCALES = [1e-20, 1e20, 1e-30, 1e30]
DIRECTION = np.array([3.0, 4.0, 1.2, -0.5])


def _norm(x):
    return eqxrules.safe_norm(x, -1)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("low,high", [(3e30, 4e30), (3e-30, 4e-30)])
def test_norm_is_scaled_beyond_the_plain_range(low, high):
    x = jax.random.uniform(jax.random.key(0), (5, 3), minval=low, maxval=high)
    exact = np.linalg.norm(np.asarray(x, np.float64), axis=-1)
    n = np.asarray(_norm(x))
    np.testing.assert_allclose(n, exact, rtol=4 * F32_EPS)
    u = np.asarray(x, np.float64) / exact[:, None]
    np.testing.assert_allclose(jax.grad(lambda x: _norm(x).sum())(x), u, rtol=1e-6)
    np.testing.assert_allclose(eqxrules.safe_normalize(x), u, rtol=4 * F32_EPS)
    plain = np.asarray(jnp.linalg.norm(x, axis=-1))  # the planted failure
    assert np.all(np.isinf(plain)) if low > 1 else np.all(plain == 0)


# Second derivatives ---------------------------------------------------------------


def second_order_modes(norm: Any) -> dict[str, Any]:
    """`x ↦` the Hessian of `norm` (a function of a vector to a number) in each
    second-order mode: `hessian`, `jacfwd(jacrev)`, `jacrev(jacrev)`, and the JVP
    of the gradient along each basis vector."""

    def jvp_of_grad(x):
        along = lambda v: jax.jvp(jax.grad(norm), (x,), (v,))[1]  # noqa: E731
        return jax.vmap(along)(jnp.eye(x.size, dtype=x.dtype))

    return {
        "hessian": jax.hessian(norm),
        "jacfwd(jacrev)": jax.jacfwd(jax.jacrev(norm)),
        "jacrev(jacrev)": jax.jacrev(jax.jacrev(norm)),
        "jvp of grad": jvp_of_grad,
    }


def _projection(x: np.ndarray) -> np.ndarray:
    """`(I − u uᵀ)/‖x‖`, `u = x/‖x‖`, in float64: the norm's Hessian and the
    Jacobian of `x/‖x‖`."""
    x = np.asarray(x, np.float64)
    n = np.linalg.norm(x)
    u = x / n
    return (np.eye(x.size) - np.outer(u, u)) / n


def _wrong(got: Any, want: np.ndarray) -> bool:
    """Whether `got` is not `want` within 1e-5 of `want`'s largest entry."""
    got = np.asarray(got, np.float64)
    scale = np.max(np.abs(want))
    return not (np.all(np.isfinite(got)) and np.all(np.abs(got - want) <= 1e-5 * scale))


def hessian_failures(norm: Any, scale: float) -> list[str]:
    """The modes (eager, and jitted together as one program) in which the Hessian
    of `norm` at `scale · DIRECTION` is not `(I − u uᵀ)/‖x‖`."""
    x = jnp.asarray(scale * DIRECTION, jnp.float32)
    want = _projection(x)
    modes = second_order_modes(norm)
    jitted = jax.jit(lambda x: {name: m(x) for name, m in modes.items()})(x)
    failed = [f"jit {name}" for name, h in jitted.items() if _wrong(h, want)]
    return failed + [name for name, m in modes.items() if _wrong(m(x), want)]


@pytest.mark.first_case_quick
@pytest.mark.parametrize("scale", SCALES)
def test_norm_second_derivatives_far_from_one(scale):
    """At every scale where they are finite in float32, the Hessian of `safe_norm`
    is `(I − u uᵀ)/‖x‖` (about 1e20 to 1e-30 here), in every mode, eager and
    jitted; JAX's `jnp.linalg.norm` (the control) is not, at every scale."""
    assert hessian_failures(eqxrules.safe_norm, scale) == []
    plain = jax.jit(jax.hessian(jnp.linalg.norm))(scale * DIRECTION)
    assert _wrong(plain, _projection(np.float32(scale * DIRECTION)))


class _SquaresTheNorm(eqxrules.SafeNorm):
    """The planted defect: 0.3.0's tangent, `x · (1/n)`, whose own derivative
    (the second derivative) divides by `n²`: inf near 1e-20, 0 near 1e20."""

    def tangent(self, args, t_args, t_self, out, **kwargs):
        (x,), (t,) = args, t_args
        zero = out == 0
        inv = jnp.where(zero, 0.0, 1 / jnp.where(zero, 1.0, out))
        return jnp.sum(x * inv * t)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("scale", [1e-20, 1e20])
def test_the_check_catches_a_tangent_that_squares_the_norm(scale):
    failed = hessian_failures(_SquaresTheNorm(), scale)
    assert {"hessian", "jit jacrev(jacrev)", "jvp of grad"} <= set(failed), failed
    assert hessian_failures(_SquaresTheNorm(), 1.0) == []  # right near 1


@pytest.mark.first_case_quick
@pytest.mark.parametrize("scale", SCALES)
def test_normalize_jacobian_far_from_one(scale):
    """`safe_normalize`'s Jacobian, forward and reverse, eager and jitted, is
    `(I − y yᵀ)/‖x‖` at every scale where it is finite in float32; the plain
    `x / jnp.linalg.norm(x)` (the control) is not, at every scale."""
    x = jnp.asarray(scale * DIRECTION, jnp.float32)
    want = _projection(x)
    modes = {"jacfwd": jax.jacfwd, "jacrev": jax.jacrev}
    for name, mode in modes.items():
        j = mode(eqxrules.safe_normalize)
        assert not _wrong(j(x), want), name
        assert not _wrong(jax.jit(j)(x), want), f"jit {name}"
    plain = jax.jit(jax.jacfwd(lambda x: x / jnp.linalg.norm(x)))(x)
    assert _wrong(plain, want)


# The checker names a zero slice -------------------------------------------------


def test_check_rule_names_a_zero_slice():
    """`check_rule` on an input with a zero slice: the naive tangent `<x, t>/n`
    fails `vjp` at that slice, named; the rule passes."""

    class NaiveNorm(eqxrules.SafeNorm):
        def tangent(self, args, t_args, t_self, out, **kwargs):
            (x,), (t,) = args, t_args
            return jnp.sum(x * t, axis=-1) / out

    x = jnp.zeros((2, 3)).at[1].set(1.0)
    reports = {
        fails: check_rule(
            rule,
            x,
            forward=rule.reference_forward,
            derivative=rule.reference_derivative,
            raise_on_failure=False,
        )["vjp"]
        for rule, fails in [(NaiveNorm(-1), True), (eqxrules.SafeNorm(-1), False)]
    }
    assert reports[False].status == "passed" and reports[True].status == "failed"
    assert "index (0, 0) (input `args[0]` = 0)" in reports[True].describe()


def _unit_where_the_norm_overflows(normalize: Any) -> tuple[np.ndarray, np.ndarray]:
    # 16 elements of 2^126: the norm 2^128 overflows float32, the unit vector and
    # the norm's gradient are 1/4 each.
    x = jnp.full((16,), 2.0**126, jnp.float32)
    return np.asarray(normalize(x)), np.asarray(jax.grad(eqxrules.safe_norm)(x))


def test_unit_vector_where_the_norm_overflows():
    u, g = _unit_where_the_norm_overflows(eqxrules.safe_normalize)
    np.testing.assert_array_equal(u, 0.25)
    np.testing.assert_array_equal(g, 0.25)


def test_a_unit_vector_divided_by_the_overflowed_norm_is_caught(monkeypatch):
    """Planted: `x / ‖x‖` with the norm scaled back first (inf here: 0 each)."""
    from eqxrules._rules import safe_norms

    def unscaled(w, axis):
        p, r = safe_norms._scaled(w, axis)
        return w / jnp.where(r == 0, 1, r * p)

    monkeypatch.setattr(safe_norms, "_unit", unscaled)
    u, g = _unit_where_the_norm_overflows(eqxrules.safe_normalize)
    assert not (u == 0.25).all() and not (g == 0.25).all()
