"""The NaN-safe rules (issue 27) at and away from their singular sets.

Each check is a function of an implementation `f(x)` that returns the names of the
checks it fails. The rules pass them; the naive formulas and the near misses the
issue lists (an epsilon inside the square root, a clipped `arccos`, a tangent
divided by `max(|x|, tiny)`, a slope behind a single `where`) fail them, each
where it is expected to: that is what shows the checks can fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules.testing import check_rule

TINY = float(jnp.finfo(jnp.float32).tiny)
F32_EPS = float(jnp.finfo(jnp.float32).eps)


def _norm(x):
    return eqxrules.safe_norm(x, -1)


def _normalize(x):
    return eqxrules.safe_normalize(x, -1)


def _divide(x):
    """`a / b` for the pairs `x[..., 0], x[..., 1]`: one array, so that every
    check below differentiates in `a` and `b` at once."""
    return eqxrules.safe_divide(x[..., 0], x[..., 1])


def _log_where(x):
    """`log x` where `x > 0` (NaN counts as positive: it must stay visible), else
    0: the classic masked `log`, whose plain derivative at 0 is NaN."""
    return eqxrules.safe_where(~(x <= 0), jnp.log, x, 0.0)


# Naive formulas and near misses -------------------------------------------------


def _single_where(value: Callable, slope: Callable, ok: Callable) -> Callable:
    """A custom JVP whose slope is `where(ok, slope(x), 0)`: one `where`, so the
    unselected `slope` is still evaluated (inf) and its derivative meets a zero
    cotangent in reverse-over-reverse (0 * inf = NaN)."""

    @jax.custom_jvp
    def f(x):
        return value(x)

    @f.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), t * jnp.where(ok(x), slope(x), 0.0)

    return f


@jax.custom_jvp
def _norm_max_tiny(x):
    """`‖x‖` whose tangent is divided by `max(‖x‖, tiny)`."""
    return jnp.linalg.norm(x, axis=-1)


@_norm_max_tiny.defjvp
def _(primals, tangents):
    (x,), (t,) = primals, tangents
    n = jnp.maximum(jnp.linalg.norm(x, axis=-1), TINY)
    return _norm_max_tiny(x), jnp.sum(x * t, axis=-1) / n


def _rsqrt_half(x):
    return 0.5 / jnp.sqrt(x)


NAIVE = {
    "sqrt": {
        "jnp.sqrt": jnp.sqrt,
        "sqrt(x + eps)": lambda x: jnp.sqrt(x + 1e-12),
        "single where": _single_where(jnp.sqrt, _rsqrt_half, lambda x: x > 0),
    },
    "arccos": {
        "jnp.arccos": jnp.arccos,
        "arccos(clip(x, -1, 1))": lambda x: jnp.arccos(jnp.clip(x, -1, 1)),
        "arccos(clip(x, -1 + eps, 1 - eps))": lambda x: jnp.arccos(
            jnp.clip(x, -1 + F32_EPS, 1 - F32_EPS)
        ),
        "single where": _single_where(
            jnp.arccos, lambda x: -1 / jnp.sqrt(1 - x * x), lambda x: abs(x) < 1
        ),
    },
    "arcsin": {
        "jnp.arcsin": jnp.arcsin,
        "arcsin(clip(x, -1, 1))": lambda x: jnp.arcsin(jnp.clip(x, -1, 1)),
    },
    "norm": {
        "jnp.linalg.norm": lambda x: jnp.linalg.norm(x, axis=-1),
        "sqrt(sum x² + eps)": lambda x: jnp.sqrt(jnp.sum(x * x, -1) + 1e-12),
        "tangent / max(‖x‖, tiny)": _norm_max_tiny,
    },
    "divide": {
        "jnp.where(b == 0, 0, a / b)": lambda x: jnp.where(
            x[..., 1] == 0, 0.0, x[..., 0] / x[..., 1]
        ),
        "a / (b + eps)": lambda x: x[..., 0] / (x[..., 1] + 1e-12),
    },
    "where": {
        "jnp.where(x > 0, log(x), 0)": lambda x: jnp.where(x > 0, jnp.log(x), 0.0),
    },
    "normalize": {
        "x / ‖x‖": lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True),
        "x / max(‖x‖, tiny)": lambda x: (
            x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), TINY)
        ),
    },
}

# What each naive version must fail: (at the singular set, away from it).
EXPECTED = {
    ("sqrt", "jnp.sqrt"): ({"jacfwd", "jacrev"}, set()),
    ("sqrt", "sqrt(x + eps)"): ({"value", "jacfwd"}, {"value"}),
    ("sqrt", "single where"): ({"jacrev(jacrev)"}, set()),
    ("arccos", "jnp.arccos"): ({"jacfwd", "jacrev"}, set()),
    ("arccos", "arccos(clip(x, -1, 1))"): ({"jacfwd", "jacrev"}, set()),
    ("arccos", "arccos(clip(x, -1 + eps, 1 - eps))"): ({"value"}, set()),
    ("arccos", "single where"): ({"jacrev(jacrev)"}, set()),
    ("arcsin", "jnp.arcsin"): ({"jacfwd", "jacrev"}, set()),
    ("arcsin", "arcsin(clip(x, -1, 1))"): ({"jacfwd", "jacrev"}, set()),
    ("norm", "jnp.linalg.norm"): ({"jacfwd", "jacrev"}, set()),
    ("norm", "sqrt(sum x² + eps)"): ({"value"}, {"value"}),
    ("norm", "tangent / max(‖x‖, tiny)"): ({"hessian", "jacrev(jacrev)"}, set()),
    ("divide", "jnp.where(b == 0, 0, a / b)"): ({"jacrev", "jacrev(jacrev)"}, set()),
    ("divide", "a / (b + eps)"): ({"value", "jacfwd", "jacrev"}, set()),
    ("where", "jnp.where(x > 0, log(x), 0)"): ({"jacrev", "jacrev(jacrev)"}, set()),
    ("normalize", "x / ‖x‖"): ({"value", "jacfwd"}, set()),
    ("normalize", "x / max(‖x‖, tiny)"): ({"jacfwd", "hessian"}, set()),
}

# The singular set, the value there, and the rule.
SAFE = {
    "sqrt": (eqxrules.safe_sqrt, jnp.array([0.0, -0.0, 0.0])),
    "arccos": (eqxrules.safe_arccos, jnp.array([1.0, -1.0, 1.0])),
    "arcsin": (eqxrules.safe_arcsin, jnp.array([1.0, -1.0, -1.0])),
    "norm": (_norm, jnp.zeros((2, 3)).at[1].set(-0.0)),
    "normalize": (_normalize, jnp.zeros((2, 3)).at[1].set(-0.0)),
    # `b == 0`, whatever `a` is (a NaN or inf there is hidden, as documented).
    "divide": (_divide, jnp.array([[1.0, 0], [jnp.nan, 0], [jnp.inf, -0.0], [0, 0]])),
    "where": (_log_where, jnp.array([0.0, -0.0, -1.0])),
}
VALUES = {
    "sqrt": [0.0, 0.0, 0.0],
    "arccos": [0.0, np.float32(np.pi), 0.0],
    "arcsin": [np.float32(np.pi / 2), -np.float32(np.pi / 2), -np.float32(np.pi / 2)],
    "norm": [0.0, 0.0],
    "normalize": np.zeros((2, 3)),
    "divide": [0.0, 0.0, 0.0, 0.0],
    "where": [0.0, 0.0, 0.0],
}
PLAIN = {
    "sqrt": jnp.sqrt,
    "arccos": jnp.arccos,
    "arcsin": jnp.arcsin,
    "norm": lambda x: jnp.linalg.norm(x, axis=-1),
    "normalize": lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True),
    "divide": lambda x: x[..., 0] / x[..., 1],
    "where": jnp.log,
}


def _away_inputs(name: str) -> jax.Array:
    key = jax.random.key(3)
    if name == "divide":  # `b` at least 0.1 in magnitude
        x = jax.random.normal(key, (16, 2))
        return x.at[:, 1].set(jnp.where(abs(x[:, 1]) < 0.1, 0.5, x[:, 1]))
    if name in ("sqrt", "where"):  # log-uniform over [1e-8, 4]
        return jnp.exp(jax.random.uniform(key, (64,), minval=-18.4, maxval=1.38))
    if name in ("arccos", "arcsin"):  # JAX's own derivative is inexact nearer ±1
        return jax.random.uniform(key, (64,), minval=-0.99, maxval=0.99)
    x = jax.random.normal(key, (6, 3))
    return x * jnp.array([1.0, 1.0, 1e-5, 1e-5, 1e3, 1e3])[:, None]


# The checks -----------------------------------------------------------------------


def _finite_zero(a) -> bool:
    return bool(np.all(np.asarray(a) == 0))


def singular_failures(f: Callable, x: jax.Array, value) -> set[str]:
    """Which checks `f` fails at `x`, a point of the singular set: the value there;
    every derivative finite and 0 (the convention) in forward mode, reverse mode,
    `hessian` and `jacrev(jacrev)`, eager, jitted and under `vmap`, the modes
    agreeing."""
    failed = set()

    def loss(x):
        return jnp.sum(f(x))

    if not np.array_equal(np.asarray(f(x)), np.asarray(value, np.float32)):
        failed.add("value")
    derivatives = {
        "jacfwd": jax.jacfwd(f),
        "jacrev": jax.jacrev(f),
        "hessian": jax.hessian(loss),
        "jacrev(jacrev)": jax.jacrev(jax.jacrev(loss)),
    }
    # Jitted and jitted under `vmap` as one program: one compilation, not eight.
    jitted, batched = jax.jit(
        lambda x, xs: (
            {name: d(x) for name, d in derivatives.items()},
            {name: jax.vmap(d)(xs) for name, d in derivatives.items()},
        )
    )(x, jnp.stack([x, x]))
    for name, d in derivatives.items():
        eager = d(x)
        if not _finite_zero(eager):
            failed.add(name)
        if not np.array_equal(np.asarray(jitted[name]), np.asarray(eager)):
            failed.add(f"jit {name}")
        if not np.array_equal(np.asarray(batched[name][1]), np.asarray(eager)):
            failed.add(f"vmap {name}")
    return failed


def away_failures(f: Callable, plain: Callable, x: jax.Array) -> set[str]:
    """Which checks `f` fails away from the singular set: the value within 4 ulps
    of `plain`'s; each row of the Jacobian within 1e-5 of its largest entry of
    JAX's derivative of `plain` (`normalize`'s Jacobian cancels)."""
    failed = set()
    a, b = np.asarray(f(x)), np.asarray(plain(x))
    ulps = np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32))
    if not (np.all(np.isfinite(a)) and np.max(ulps) <= 4):
        failed.add("value")
    j, jp = (np.asarray(jax.jacrev(g)(x)).reshape(a.size, x.size) for g in (f, plain))
    if not np.all(np.abs(j - jp) <= 1e-5 * np.max(np.abs(jp), axis=1, keepdims=True)):
        failed.add("derivative")
    return failed


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(SAFE))
def test_rule_is_finite_and_conventional_at_its_singular_set(name):
    f, x = SAFE[name]
    assert singular_failures(f, x, VALUES[name]) == set()


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(SAFE))
def test_rule_is_the_plain_formula_away_from_its_singular_set(name):
    f, _ = SAFE[name]
    assert away_failures(f, PLAIN[name], _away_inputs(name)) == set()


@pytest.mark.slow  # 14 cases of about 5 s: each compiles 12 derivatives
@pytest.mark.parametrize("name,naive", list(EXPECTED), ids=lambda s: str(s))
def test_naive_versions_fail_the_same_checks(name, naive):
    """Each naive formula and near miss fails the checks the rule passes, where
    the issue says it does: the single `where` passes `hessian` (forward over
    reverse) but not `jacrev(jacrev)`; `max(‖x‖, tiny)` has a finite first
    derivative and a NaN second one."""
    f, x = NAIVE[name][naive], SAFE[name][1]
    at, away = EXPECTED[name, naive]
    failed = singular_failures(f, x, VALUES[name])
    assert at <= failed, failed
    assert away <= away_failures(f, PLAIN[name], _away_inputs(name))
    if naive == "single where":
        assert "hessian" not in failed and "jacfwd" not in failed
    if naive == "tangent / max(‖x‖, tiny)":
        assert not {"jacfwd", "jacrev"} & failed


@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", list(SAFE))
def test_low_precision_keeps_dtype_and_conventions_finite(name, dtype):
    """At the singular set in bfloat16 and float16: the value, dtype kept, and first
    and second derivatives 0 (no float32 constant that is inf in float16)."""
    f, x = SAFE[name]
    x = x.astype(dtype)

    def loss(x):
        return jnp.sum(f(x).astype(jnp.float32))

    # One jitted program (the conventions' constants are the same eager).
    value, grad, jacfwd, hessian = jax.jit(
        lambda x: (f(x), jax.grad(loss)(x), jax.jacfwd(f)(x), jax.hessian(loss)(x))
    )(x)
    assert value.dtype == dtype and grad.dtype == dtype
    expected = np.asarray(jnp.asarray(VALUES[name], dtype), np.float32)
    np.testing.assert_array_equal(np.asarray(value, np.float32), expected)
    assert _finite_zero(grad)
    assert _finite_zero(jacfwd) and _finite_zero(hessian)


def test_a_planted_float32_convention_is_inf_in_float16():
    """The check above fails a convention that is finite only in float32: the
    one-sided slope at the smallest normal float32, 1/(2 sqrt(tiny))."""
    big = 0.5 / np.sqrt(TINY)  # 1.8e19

    def slope(x):  # computed in float32, as a rule's slope may be, and cast
        return jnp.full(x.shape, big, jnp.float32).astype(x.dtype)

    f = _single_where(jnp.sqrt, slope, lambda x: x == 0)
    g = jax.grad(lambda x: jnp.sum(f(x)))(jnp.zeros(3, jnp.float16))
    assert np.isfinite(big) and np.all(np.isinf(np.asarray(g, np.float32)))


# A NaN stays visible, in its own element or slice only ----------------------------


def nan_is_local(f: Callable, name: str) -> bool:
    """Whether a NaN makes its own element (its own slice, for the reductions) NaN
    in value and gradient, and nothing else: not the zero slice beside it."""
    x = _away_inputs(name)[:4]
    x = x.at[0].set(jnp.nan).at[1].set(SAFE[name][1][0])
    if x.ndim == 2:
        x = x.at[0, 1:].set(0.0)
    out = np.asarray(f(x))
    grad = np.asarray(jax.grad(lambda x: jnp.sum(f(x) * jnp.cos(f(x))))(x))
    first = out if out.ndim == 1 else out[:, 0]
    return bool(
        np.array_equal(np.isnan(first), [True, False, False, False])
        and np.all(np.isnan(grad[0]))
        and np.all(np.isfinite(grad[1:]))
        and np.all(np.isfinite(out[1:]))
    )


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", ["sqrt", "arccos", "arcsin", "norm", "normalize"])
def test_nan_is_visible_only_where_it_is(name):
    assert nan_is_local(SAFE[name][0], name)


@jax.custom_jvp
def _norm_nan_hidden(x):
    return jnp.linalg.norm(x, axis=-1)


@_norm_nan_hidden.defjvp
def _(primals, tangents):
    # Planted: the zero test is `n > 0`, which a NaN fails too, so a NaN slice
    # gets the zero slice's derivative, 0.
    (x,), (t,) = primals, tangents
    n = _norm_nan_hidden(x)
    ok = n > 0
    dot = jnp.sum(x / jnp.where(ok, n, 1)[:, None] * t, axis=-1)
    return n, jnp.where(ok, dot, 0.0)


@pytest.mark.slow  # about 10 s: every derivative of the planted norm, eager too
def test_the_nan_check_catches_a_nan_selected_away():
    assert singular_failures(_norm_nan_hidden, SAFE["norm"][1], VALUES["norm"]) == set()
    assert not nan_is_local(_norm_nan_hidden, "norm")


# safe_norm's scaled range ---------------------------------------------------------


@pytest.mark.first_case_quick
@pytest.mark.parametrize("low,high", [(3e30, 4e30), (3e-30, 4e-30)])
def test_norm_is_scaled_beyond_the_plain_range(low, high):
    x = jax.random.uniform(jax.random.key(0), (5, 3), minval=low, maxval=high)
    exact = np.linalg.norm(np.asarray(x, np.float64), axis=-1)
    n = np.asarray(_norm(x))
    np.testing.assert_allclose(n, exact, rtol=4 * F32_EPS)
    u = np.asarray(x, np.float64) / exact[:, None]
    np.testing.assert_allclose(jax.grad(lambda x: _norm(x).sum())(x), u, rtol=1e-6)
    np.testing.assert_allclose(_normalize(x), u, rtol=4 * F32_EPS)
    plain = np.asarray(jnp.linalg.norm(x, axis=-1))  # the planted failure
    assert np.all(np.isinf(plain)) if low > 1 else np.all(plain == 0)


# arccos and arcsin beyond ±1 ------------------------------------------------------


@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_arc_rounding_band_is_four_epsilons(dtype):
    eps = float(jnp.finfo(dtype).eps)
    x = jnp.asarray([1 + 4 * eps, -1 - 4 * eps, 1 + 5 * eps, -1 - 5 * eps], dtype)
    for f, ends in [
        (eqxrules.safe_arccos, [0, np.pi]),
        (eqxrules.safe_arcsin, [1, -1]),
    ]:
        out = np.asarray(f(x), np.float32)
        g = np.asarray(jax.vmap(jax.grad(f))(x), np.float32)
        np.testing.assert_array_equal(
            out[:2], np.asarray(f(jnp.asarray([1, -1], dtype)), np.float32)
        )
        assert (
            np.all(g[:2] == 0) and np.all(np.isnan(out[2:])) and np.all(np.isnan(g[2:]))
        )
        del ends


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


# The checker names the singular point --------------------------------------------


class _NaiveSqrt(eqxrules.SafeSqrt):
    r"""$y = \sqrt{x}$, $\dot y = t / (2\sqrt{x})$: the plain slope, inf at 0."""

    summary: ClassVar[str] = "√x; the plain derivative"

    def slope(self, x):
        return 0.5 / jnp.sqrt(x)


class _NaiveArccos(eqxrules.SafeArccos):
    r"""$y = \arccos x$, $\dot y = -t / \sqrt{1 - x^2}$: the plain slope."""

    summary: ClassVar[str] = "arccos(x); the plain derivative"

    def slope(self, x):
        return -1 / jnp.sqrt(1 - x * x)


@pytest.mark.first_case_quick
@pytest.mark.parametrize(
    "rule,point", [(_NaiveSqrt, "`x` = 0)"), (_NaiveArccos, "`x` = -1)")]
)
def test_verify_rule_names_the_singular_point(rule, point):
    problems = eqxrules.verify_rule(rule, raise_on_failure=False).problems
    assert any("at its kinks" in p and point in p and "`vjp`" in p for p in problems)
    assert eqxrules.verify_rule(eqxrules.SafeSqrt, raise_on_failure=False).passed


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


# The rules of several inputs: which NaN is visible, broadcasting, `fn`'s own
# parameters ----------------------------------------------------------------------


def _value_and_grads(f: Callable, *args) -> tuple[np.ndarray, ...]:
    """The value of `f(*args)` and its gradient in each argument (of a weighted
    sum, so that no cotangent is zero)."""
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * jnp.cos(f(*a))), range(len(args)))
    return (np.asarray(f(*args)), *(np.asarray(g) for g in grads(*args)))


def test_divide_nan_is_visible_where_b_is_not_zero():
    """A NaN in `a` or `b` makes its own element NaN, value and both gradients,
    where `b != 0`; where `b == 0` a NaN `a` is hidden (the documented
    convention) but a NaN `b` is not (NaN is not 0)."""
    a = jnp.array([jnp.nan, 1.0, jnp.nan, 2.0, 3.0])
    b = jnp.array([2.0, jnp.nan, 0.0, 0.0, 4.0])
    out, g_a, g_b = _value_and_grads(eqxrules.safe_divide, a, b)
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

    out, g_x, g_o = _value_and_grads(f, x, other)
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
    got = _value_and_grads(eqxrules.safe_divide, a, b)
    want = _value_and_grads(jnp.divide, a, b)
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
