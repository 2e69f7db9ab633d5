"""The NaN-safe rules (issues 27 and 42) at and away from their singular sets, as one
table: each rule's singular set, its value there, the plain formula away from it,
and the naive formulas and near misses that fail there.

Each check (tests/safe_helpers.py) is a function of an implementation `f(x)` that
returns the names of the checks it fails. The rules pass them; the naive formulas
and the near misses the issues list (an epsilon inside the square root, a clipped
`arccos`, a tangent divided by `max(|x|, tiny)`, a slope behind a single `where`,
JAX's own `arctan2`, `xlogy`, `softmax` and `logsumexp`, a softmax whose empty
rows give `1/n`) fail them, each where it is expected to: that is what shows the
checks can fail. What each rule does beyond its singular set is tested beside its
idea: tests/test_safe_norms.py, _angles, _masks, _softmax and _eigh.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import xlogy
from safe_helpers import (
    F32_EPS,
    TINY,
    away_failures,
    finite_zero,
    single_where,
    singular_failures,
)

import eqxrules

NEG_INF = -np.inf


def _pairs(f):
    """`f(a, b)` for the pairs `x[..., 0], x[..., 1]`: one array, so that every
    check differentiates in both inputs at once."""
    return lambda x: f(x[..., 0], x[..., 1])


def _log_where(x):
    """`log x` where `x > 0` (NaN counts as positive: it must stay visible), else
    0: the classic masked `log`, whose plain derivative at 0 is NaN."""
    return eqxrules.safe_where(~(x <= 0), jnp.log, x, 0.0)


# Naive formulas and near misses -------------------------------------------------


@jax.custom_jvp
def _norm_max_tiny(x):
    """`‖x‖` whose tangent is divided by `max(‖x‖, tiny)`."""
    return jnp.linalg.norm(x, axis=-1)


@_norm_max_tiny.defjvp
def _(primals, tangents):
    (x,), (t,) = primals, tangents
    n = jnp.maximum(jnp.linalg.norm(x, axis=-1), TINY)
    return _norm_max_tiny(x), jnp.sum(x * t, axis=-1) / n


@jax.custom_jvp
def _xlogy_plain_derivative(x, y):
    """The planted defect: `x log y`, 0 at (0, 0), with the plain derivative
    `(log y, x/y)`, which is (-inf, NaN) there."""
    both = (x == 0) & (y == 0)
    return jnp.where(both, 0.0, x * jnp.log(jnp.where(both, 1.0, y)))


@_xlogy_plain_derivative.defjvp
def _(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    return _xlogy_plain_derivative(x, y), tx * jnp.log(y) + ty * x / y


def _softmax_uniform_when_empty(x):
    """The planted defect: a row with nothing in it gives `1/n`, the softmax of a
    row of zeros (what feeding 0 without selecting the value away gives)."""
    empty = jnp.all(x == NEG_INF, axis=-1, keepdims=True)
    return jax.nn.softmax(jnp.where(empty, 0.0, x))


def _rsqrt_half(x):
    return 0.5 / jnp.sqrt(x)


NAIVE = {
    "sqrt": {
        "jnp.sqrt": jnp.sqrt,
        "sqrt(x + eps)": lambda x: jnp.sqrt(x + 1e-12),
        "single where": single_where(jnp.sqrt, _rsqrt_half, lambda x: x > 0),
    },
    "arccos": {
        "jnp.arccos": jnp.arccos,
        "arccos(clip(x, -1, 1))": lambda x: jnp.arccos(jnp.clip(x, -1, 1)),
        "arccos(clip(x, -1 + eps, 1 - eps))": lambda x: jnp.arccos(
            jnp.clip(x, -1 + F32_EPS, 1 - F32_EPS)
        ),
        "single where": single_where(
            jnp.arccos, lambda x: -1 / jnp.sqrt(1 - x * x), lambda x: abs(x) < 1
        ),
    },
    "arcsin": {
        "jnp.arcsin": jnp.arcsin,
        "arcsin(clip(x, -1, 1))": lambda x: jnp.arcsin(jnp.clip(x, -1, 1)),
    },
    "atan2": {"jnp.arctan2": _pairs(jnp.arctan2)},
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
    "xlogy": {
        "jax.scipy.special.xlogy": _pairs(xlogy),
        "jnp.where(x == 0, 0, x log y)": _pairs(
            lambda x, y: jnp.where(x == 0, 0.0, x * jnp.log(y))
        ),
        "planted: plain derivative": _pairs(_xlogy_plain_derivative),
    },
    "softmax": {
        "jax.nn.softmax": jax.nn.softmax,
        "planted: empty rows give 1/n": _softmax_uniform_when_empty,
    },
    "logsumexp": {"jax.nn.logsumexp": lambda x: jax.nn.logsumexp(x, -1)},
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
    ("atan2", "jnp.arctan2"): ({"jacfwd", "jacrev", "hessian"}, set()),
    ("norm", "jnp.linalg.norm"): ({"jacfwd", "jacrev"}, set()),
    ("norm", "sqrt(sum x² + eps)"): ({"value"}, {"value"}),
    ("norm", "tangent / max(‖x‖, tiny)"): ({"hessian", "jacrev(jacrev)"}, set()),
    ("divide", "jnp.where(b == 0, 0, a / b)"): ({"jacrev", "jacrev(jacrev)"}, set()),
    ("divide", "a / (b + eps)"): ({"value", "jacfwd", "jacrev"}, set()),
    ("where", "jnp.where(x > 0, log(x), 0)"): ({"jacrev", "jacrev(jacrev)"}, set()),
    ("xlogy", "jax.scipy.special.xlogy"): ({"jacfwd", "jacrev"}, set()),
    ("xlogy", "jnp.where(x == 0, 0, x log y)"): ({"jacrev", "hessian"}, set()),
    ("xlogy", "planted: plain derivative"): ({"jacfwd", "jacrev"}, set()),
    ("softmax", "jax.nn.softmax"): ({"value", "jacfwd", "jacrev"}, set()),
    ("softmax", "planted: empty rows give 1/n"): ({"value"}, set()),
    ("logsumexp", "jax.nn.logsumexp"): ({"jacfwd", "jacrev", "hessian"}, set()),
    ("normalize", "x / ‖x‖"): ({"value", "jacfwd"}, set()),
    ("normalize", "x / max(‖x‖, tiny)"): ({"jacfwd", "hessian"}, set()),
}

# The singular set, the value there, and the rule.
SAFE = {
    "sqrt": (eqxrules.safe_sqrt, jnp.array([0.0, -0.0, 0.0])),
    "arccos": (eqxrules.safe_arccos, jnp.array([1.0, -1.0, 1.0])),
    "arcsin": (eqxrules.safe_arcsin, jnp.array([1.0, -1.0, -1.0])),
    # `atan2(y, x)` at the origin, each sign of each zero.
    "atan2": (
        _pairs(eqxrules.safe_atan2),
        jnp.array([[0.0, 0.0], [0.0, -0.0], [-0.0, -0.0], [-0.0, 0.0]]),
    ),
    "norm": (lambda x: eqxrules.safe_norm(x, -1), jnp.zeros((2, 3)).at[1].set(-0.0)),
    "normalize": (eqxrules.safe_normalize, jnp.zeros((2, 3)).at[1].set(-0.0)),
    # `b == 0`, whatever `a` is (a NaN or inf there is hidden, as documented).
    "divide": (
        _pairs(eqxrules.safe_divide),
        jnp.array([[1.0, 0], [jnp.nan, 0], [jnp.inf, -0.0], [0, 0]]),
    ),
    "where": (_log_where, jnp.array([0.0, -0.0, -1.0])),
    "xlogy": (
        _pairs(eqxrules.safe_xlogy),
        jnp.array([[0.0, 0.0], [-0.0, 0.0], [0.0, -0.0], [-0.0, -0.0]]),
    ),
    # Rows with nothing in them: every entry -inf.
    "softmax": (eqxrules.safe_softmax, jnp.full((2, 5), NEG_INF)),
    "logsumexp": (eqxrules.safe_logsumexp, jnp.full((2, 5), NEG_INF)),
}
PI = np.float32(np.pi)
VALUES = {
    "sqrt": [0.0, 0.0, 0.0],
    "arccos": [0.0, PI, 0.0],
    "arcsin": [np.float32(np.pi / 2), -np.float32(np.pi / 2), -np.float32(np.pi / 2)],
    "atan2": [0.0, PI, -PI, -0.0],
    "norm": [0.0, 0.0],
    "normalize": np.zeros((2, 3)),
    "divide": [0.0, 0.0, 0.0, 0.0],
    "where": [0.0, 0.0, 0.0],
    "xlogy": [0.0, 0.0, 0.0, 0.0],
    "softmax": np.zeros((2, 5)),
    "logsumexp": [NEG_INF, NEG_INF],
}
PLAIN = {
    "sqrt": jnp.sqrt,
    "arccos": jnp.arccos,
    "arcsin": jnp.arcsin,
    "atan2": _pairs(jnp.arctan2),
    "norm": lambda x: jnp.linalg.norm(x, axis=-1),
    "normalize": lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True),
    "divide": lambda x: x[..., 0] / x[..., 1],
    "where": jnp.log,
    "xlogy": lambda x: x[..., 0] * jnp.log(x[..., 1]),
    "softmax": jax.nn.softmax,
    "logsumexp": lambda x: jax.nn.logsumexp(x, -1),
}


def away_inputs(name: str) -> jax.Array:
    key = jax.random.key(3)
    if name == "divide":  # `b` at least 0.1 in magnitude
        x = jax.random.normal(key, (16, 2))
        return x.at[:, 1].set(jnp.where(abs(x[:, 1]) < 0.1, 0.5, x[:, 1]))
    if name == "atan2":  # points away from the origin
        return jax.random.normal(key, (16, 2)) + jnp.array([0.3, -0.2])
    if name == "xlogy":  # `y` log-uniform over [1e-4, 4]
        x, y = jax.random.normal(key, (16,)), jax.random.uniform(key, (16,))
        return jnp.stack([x, jnp.exp(-9.2 + 10.6 * y)], -1)
    if name in ("softmax", "logsumexp"):  # rows with one -inf entry among them
        x = 3 * jax.random.normal(key, (6, 5))
        return x.at[0, 0].set(NEG_INF).at[3, 2].set(NEG_INF)
    if name in ("sqrt", "where"):  # log-uniform over [1e-8, 4]
        return jnp.exp(jax.random.uniform(key, (64,), minval=-18.4, maxval=1.38))
    if name in ("arccos", "arcsin"):  # JAX's own derivative is inexact nearer ±1
        return jax.random.uniform(key, (64,), minval=-0.99, maxval=0.99)
    x = jax.random.normal(key, (6, 3))
    return x * jnp.array([1.0, 1.0, 1e-5, 1e-5, 1e3, 1e3])[:, None]


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(SAFE))
def test_rule_is_finite_and_conventional_at_its_singular_set(name):
    f, x = SAFE[name]
    assert singular_failures(f, x, VALUES[name]) == set()


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(SAFE))
def test_rule_is_the_plain_formula_away_from_its_singular_set(name):
    f, _ = SAFE[name]
    assert away_failures(f, PLAIN[name], away_inputs(name)) == set()


@pytest.mark.parametrize("name", list(SAFE))
def test_the_plain_formula_is_not_finite_at_the_singular_set(name):
    """The control, for every rule and in both tiers: at the singular set the
    plain formula's value or its Jacobian (reverse mode) is inf or NaN. Were JAX
    to fix one, this fails, and the rule's reason to exist is to be revisited."""
    _, x = SAFE[name]
    value, jacobian = jax.jit(lambda x: (PLAIN[name](x), jax.jacrev(PLAIN[name])(x)))(x)
    assert not (np.all(np.isfinite(value)) and np.all(np.isfinite(jacobian)))


@pytest.mark.slow  # 24 cases of about 5 s: each compiles 12 derivatives
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
    assert away <= away_failures(f, PLAIN[name], away_inputs(name))
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
    assert finite_zero(grad)
    assert finite_zero(jacfwd) and finite_zero(hessian)


def test_a_planted_float32_convention_is_inf_in_float16():
    """The check above fails a convention that is finite only in float32: the
    one-sided slope at the smallest normal float32, 1/(2 sqrt(tiny))."""
    big = 0.5 / np.sqrt(TINY)  # 1.8e19

    def slope(x):  # computed in float32, as a rule's slope may be, and cast
        return jnp.full(x.shape, big, jnp.float32).astype(x.dtype)

    f = single_where(jnp.sqrt, slope, lambda x: x == 0)
    g = jax.grad(lambda x: jnp.sum(f(x)))(jnp.zeros(3, jnp.float16))
    assert np.isfinite(big) and np.all(np.isinf(np.asarray(g, np.float32)))


# A NaN stays visible, in its own element or slice only ----------------------------


def nan_is_local(f, name: str) -> bool:
    """Whether a NaN makes its own element (its own slice, for the reductions) NaN
    in value and gradient, and nothing else: not the singular element or slice
    beside it, which keeps its value."""
    x = away_inputs(name)[:4]
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
        and np.array_equal(out[1], np.asarray(VALUES[name], np.float32)[0])
        and np.all(np.isfinite(out[2:]))
    )


# `logsumexp` is left out: its singular row's value is -inf, whose `cos` is NaN;
# `xlogy`'s derivative in `x` does not depend on `x` (its NaN tests are in
# tests/test_safe_masks.py and tests/test_safe_softmax.py).
@pytest.mark.first_case_quick
@pytest.mark.parametrize(
    "name", ["sqrt", "arccos", "arcsin", "norm", "normalize", "atan2", "softmax"]
)
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
