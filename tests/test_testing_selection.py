"""`check_rule` beyond the planted defects of `test_testing.py`: second order,
selecting checks, the worst element, warnings, and programs reused only when the
rule is the same."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checker_defects import X, failed, make_ste, make_vjp_rule, surrogate

from eqxrules.testing import RuleCheckError, check_rule

# ---------------------------------------------------------------------------
# (j) a first derivative right and a second wrong: `stop_gradient` on the primal
# inside the tangent rule


def _sin_with_tangent(stop: bool):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return jnp.sin(x), jnp.cos(jax.lax.stop_gradient(x) if stop else x) * t

    return f


def test_correct_second_derivative_passes_order_2():
    report = check_rule(_sin_with_tangent(False), X, derivative=jnp.sin, order=2)
    assert report["second_order"].status == "passed"
    report = check_rule(make_vjp_rule(), X, derivative=jnp.tanh, order=2)
    assert report["second_order"].status == "passed"


def test_killed_second_derivative_is_caught_by_second_order_only():
    f = _sin_with_tangent(True)
    report = check_rule(f, X, forward=jnp.sin, derivative=jnp.sin)
    assert report.passed  # order 1 cannot see it
    assert report["second_order"].status == "skipped"
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, forward=jnp.sin, derivative=jnp.sin, order=2)
    assert failed(e) == ["second_order"]
    assert e.value.report["second_order"].detail.startswith("JVP of VJP")
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, forward=jnp.sin, derivative=jnp.sin, order=2, modes=("rev",))
    assert failed(e) == ["second_order"]
    assert e.value.report["second_order"].detail.startswith("VJP of VJP")
    # With no `derivative`, a true derivative is checked against `forward`'s.
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, forward=jnp.sin, order=2)
    assert failed(e) == ["second_order"]


# ---------------------------------------------------------------------------
# Selecting checks


def test_selected_checks_run_and_the_rest_are_skipped():
    report = check_rule(
        make_ste(False),
        X,
        derivative=surrogate,
        checks=("vjp",),
        raise_on_failure=False,
    )
    assert report.failed == ["vjp"]
    for r in report.results:
        if r.name != "vjp":
            assert (r.status, r.detail) == ("skipped", "not selected")
    report = check_rule(make_ste(False), X, derivative=surrogate, skip=["jvp", "vjp"])
    assert report.passed
    assert report["jvp"].detail == "not selected"


def test_unselected_checks_cost_nothing():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        raise AssertionError("differentiated although no selected check needs it")

    report = check_rule(f, X, forward=jnp.sin, derivative=jnp.sin, checks=("primal",))
    assert report.passed and report["primal"].status == "passed"


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(checks="jvp"), TypeError, ["`checks`", "'jvp'", "tuple or list"]),
        (dict(skip="jvp"), TypeError, ["`skip`", "'jvp'"]),
        (dict(checks=3), TypeError, ["`checks`", "int"]),
        (dict(checks=("jvp", 3)), TypeError, ["`checks`", "3", "int"]),
        (dict(checks=("jvpp",)), ValueError, ["`checks`", "'jvpp'", "'held_fixed'"]),
        (dict(skip=("nope",)), ValueError, ["`skip`", "'nope'", "'primal'"]),
        (dict(checks=("jvp",), skip=("vjp",)), ValueError, ["`checks`", "`skip`"]),
        (dict(checks=()), ValueError, ["`checks`", "at least one"]),
        (dict(checks=("second_order",)), ValueError, ["'second_order'", "`order`"]),
        (dict(order=3), ValueError, ["`order`", "3", "1 or 2"]),
        (dict(order=0), ValueError, ["`order`", "0"]),
        (dict(order=True), TypeError, ["`order`", "bool"]),
        (dict(order=2.0), TypeError, ["`order`", "float"]),
        (dict(order="2"), TypeError, ["`order`", "str"]),
    ],
)
def test_bad_selection_or_order_is_a_clear_error(kwargs, error, words):
    with pytest.raises(error) as e:
        check_rule(jnp.sin, X, **kwargs)
    message = str(e.value)
    assert message.startswith("`check_rule`:")
    for word in words:
        assert word in message


# ---------------------------------------------------------------------------
# The worst element


def test_failure_names_worst_element_and_both_values():
    with pytest.raises(RuleCheckError) as e:
        check_rule(make_ste(False), X, derivative=surrogate, checks=("vjp",))
    result = e.value.report["vjp"]
    assert result.path == "x"
    assert result.index in {(1,), (5,)}  # |x| = 1, where the mask is exclusive
    assert result.actual == 0.0 and result.expected != 0.0
    assert result.max_abs_error == abs(result.expected)
    assert f"index {result.index}" in str(e.value)
    assert "where the reference has" in str(e.value)


# ---------------------------------------------------------------------------
# Warnings: the rule's are reported once; the checker's own arithmetic raises none


def test_a_rule_warning_is_reported_once():
    @jax.custom_jvp
    def f(x):
        warnings.warn("f is deprecated", UserWarning)
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
    with pytest.warns(UserWarning, match="f is deprecated") as record:
        report = check_rule(f, X, forward=jnp.sin, derivative=jnp.sin)
    assert sum("f is deprecated" in str(w.message) for w in record) == 1
    assert report.passed  # a warning is not a failure
    assert report.warnings == ["UserWarning: f is deprecated"]
    assert "the rule warned: UserWarning: f is deprecated" in str(report)


def test_infinities_and_nans_in_rule_and_reference_raise_no_warning():
    # The forward is -inf at 0 and NaN below: the comparison meets inf - inf.
    @jax.custom_jvp
    def log_ste(x):
        return jnp.log(x)

    log_ste.defjvp(lambda p, t: (jnp.log(p[0]), t[0]))
    report = check_rule(log_ste, X, forward=jnp.log, derivative=lambda x: x)
    assert report.passed and report.warnings == []

    # The tangent is +-inf at 0 in both: linearity meets inf - inf, transpose inf *
    # 0. (The zero cotangent gives 0 * inf = NaN there, which that check reports;
    # and both inner products of `transpose` are infinite, so it compared nothing.)
    @jax.custom_jvp
    def cbrt(x):
        return jnp.cbrt(x)

    cbrt.defjvp(lambda p, t: (jnp.cbrt(p[0]), t[0] / (3 * jnp.cbrt(p[0]) ** 2)))
    skip = ("zero_cotangent", "transpose")
    report = check_rule(cbrt, X, derivative=jnp.cbrt, skip=skip)
    assert report.passed and report.warnings == []
    report = check_rule(cbrt, X, derivative=jnp.cbrt, raise_on_failure=False)
    assert report.failed == ["transpose", "zero_cotangent"]
    assert report["transpose"].detail.startswith("nothing compared")
    assert report.warnings == []


# ---------------------------------------------------------------------------
# Programs compiled by one call are reused by the next only when the traced program
# is the same: a rule that changed is checked afresh, never reported on from before


def _tanh_rule(scale, host: bool = False):
    def slope(x):
        return scale * (1 - np.tanh(x) ** 2)

    @jax.custom_vjp
    def f(x):
        return jnp.tanh(x)

    def bwd(x, ct):
        if host:  # the same code, a different closure: only its repr is alike
            shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
            s = jax.pure_callback(lambda x: slope(x).astype(x.dtype), shape, x)
        else:
            s = scale * (1 - jnp.tanh(x) ** 2)
        return (ct * s,)

    f.defvjp(lambda x: (jnp.tanh(x), x), bwd)
    return f


@pytest.mark.parametrize("host", [False, True])
def test_a_changed_rule_is_checked_afresh(host):
    check_rule(_tanh_rule(1.0, host), X, derivative=jnp.tanh, checks=("vjp",))
    with pytest.raises(RuleCheckError):
        check_rule(_tanh_rule(2.0, host), X, derivative=jnp.tanh, checks=("vjp",))


def test_a_changed_closed_over_array_is_checked_afresh():
    w = jnp.ones(7)

    @jax.custom_vjp
    def f(x):
        return w * x

    f.defvjp(lambda x: (w * x, None), lambda _, ct: (ct * w,))
    check_rule(f, X, derivative=lambda x: w * x, checks=("vjp",))
    w = 2 * jnp.ones(7)  # the closure's cell now holds another array
    reference = jnp.ones(7)
    with pytest.raises(RuleCheckError):
        check_rule(f, X, derivative=lambda x: reference * x, checks=("vjp",))


def test_linearity_tolerance_is_normwise_per_leaf():
    """`linearity` bounds each element by rtol of the leaf's largest output, since a
    floating-point JVP errs by ulps of the terms it sums, not of its (possibly
    cancelled) result: softmax's JVP on jax 0.7 missed an elementwise bound by
    1.19e-6 at an element of 1e-2. A nonlinear JVP is still far outside."""
    from eqxrules.testing._compare import _compare, _linear_expected

    a = np.array([2.0, 0.004], np.float32)  # J t1
    b = np.array([1.0, -0.012], np.float32)  # J t2: 2a - b/2 = [3.5, 0.014]
    exact = 2 * a - b / 2
    rounded = exact + np.array([0.0, 1.2e-6], np.float32)  # cancellation's error
    expected, scale = _linear_expected(a, b, rounded)
    _compare(rounded, expected, prefix="jvp", rtol=1e-5, atol=1e-6, scale=scale)
    # The same miss under an elementwise scale fails: the normwise one is needed.
    elementwise = 2 * np.abs(a) + np.abs(b) / 2
    with pytest.raises(Exception, match="beyond tolerance"):
        _compare(
            rounded, expected, prefix="jvp", rtol=1e-5, atol=1e-6, scale=elementwise
        )
    nonlinear = exact + np.array([0.0, 0.05], np.float32)  # t^2-like, O(1e-2)
    with pytest.raises(Exception, match="beyond tolerance"):
        _compare(nonlinear, expected, prefix="jvp", rtol=1e-5, atol=1e-6, scale=scale)
