"""Self-tests of `eqxrules.testing.check_rule`: planted defects, each caught by the
check that names it, beside correct rules that pass."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules.testing import RuleCheckError, check_rule

X = jnp.array([-1.5, -1.0, -0.3, 0.0, 0.4, 1.0, 2.0])  # includes |x| = clip exactly


def _failed(excinfo) -> list[str]:
    return excinfo.value.failed


def _sign(x):
    return jnp.where(x >= 0, 1.0, -1.0).astype(x.dtype)


def _surrogate(x):
    return jnp.where(jnp.abs(x) <= 1.0, x, 0.0)


def _make_ste(inclusive: bool):
    @jax.custom_jvp
    def ste(x):
        return _sign(x)

    @ste.defjvp
    def ste_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        mask = jnp.abs(x) <= 1.0 if inclusive else jnp.abs(x) < 1.0
        return ste(x), t * mask.astype(x.dtype)

    return ste


# ---------------------------------------------------------------------------
# (a) the textbook ScaledModel rule, in both forms


class _TextbookScaled(eqx.Module):
    sub_model: eqx.nn.Linear
    scale: float = eqx.field(static=True)

    def __call__(self, x):
        return _textbook(self, x)


@eqx.filter_custom_jvp
def _textbook(model, x):
    return model.sub_model(x / model.scale)


@_textbook.def_jvp
def _textbook_jvp(primals, tangents):
    model, x = primals
    out = model.sub_model(x / model.scale)
    # The textbook bug: only the input tangent is read.
    _, t_out = jax.jvp(
        model.sub_model, (x / model.scale,), (tangents[1] / model.scale,)
    )
    return out, t_out


class _MaterialisedScaled(_TextbookScaled):
    def __call__(self, x):
        return _materialised(self, x)


@eqx.filter_custom_jvp
def _materialised(model, x):
    return model.sub_model(x / model.scale)


@_materialised.def_jvp
def _materialised_jvp(primals, tangents):
    model, x = primals
    tx = tangents[1]
    tx = jnp.zeros_like(x) if tx is None else tx  # "fixes" the crash, drops params
    out = model.sub_model(x / model.scale)
    _, t_out = jax.jvp(model.sub_model, (x / model.scale,), (tx / model.scale,))
    return out, t_out


@pytest.fixture
def linear():
    return eqx.nn.Linear(3, 1, key=jax.random.key(0))


def _plain(m, x):
    return m.sub_model(x / m.scale)


def test_textbook_scaled_model_crashes_on_none_tangent(linear):
    """Differentiating the model alone gives `None` for x's tangent."""
    model = _TextbookScaled(linear, 2.0)
    with pytest.raises(TypeError):
        eqx.filter_grad(lambda m: m(jnp.ones(3)).sum())(model)
    # The checker reports it as a failure of the derivative checks, not a crash.
    x = jnp.array([0.0, 1.0, 2.0])
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda m: m(x), model, derivative=lambda m: _plain(m, x))
    assert {"jvp", "vjp"} <= set(_failed(e))
    assert isinstance(e.value.__cause__, TypeError)


def test_textbook_scaled_model_silently_zeroes_weight_gradient(linear):
    model = _MaterialisedScaled(linear, 2.0)
    x = jnp.array([0.0, 1.0, 2.0])
    grads = eqx.filter_grad(lambda m, x: m(x).sum())(model, x)
    assert np.all(np.asarray(grads.sub_model.weight) == 0)  # the silent bug
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda m, x: m(x), model, x, derivative=_plain)
    assert set(_failed(e)) == {"jvp", "vjp", "held_fixed"}
    assert "sub_model.weight" in str(e.value)
    assert "sub_model.weight" in e.value.report["vjp"].path


def test_eqxrules_scaled_model_gives_plain_autodiff_weight_gradients(linear):
    """Ours, on the same model: the weight gradient plain autodiff gives."""
    x = jnp.array([0.0, 1.0, 2.0])
    ours = eqxrules.ScaledModel(linear, 2.0)
    plain = eqx.filter_grad(lambda m, x: _plain(m, x).sum())(ours, x)
    grads = eqx.filter_grad(lambda m, x: m(x).sum())(ours, x)
    np.testing.assert_allclose(grads.sub_model.weight, [[0.0, 0.5, 1.0]])
    np.testing.assert_allclose(grads.sub_model.weight, plain.sub_model.weight)
    # And with respect to the model alone, where the textbook rule crashes.
    alone = eqx.filter_grad(lambda m: m(x).sum())(ours)
    np.testing.assert_allclose(alone.sub_model.weight, [[0.0, 0.5, 1.0]])
    check_rule(lambda m, x: m(x), ours, x, forward=_plain, derivative=_plain)


# ---------------------------------------------------------------------------
# (b) a sign STE whose mask is exclusive at |x| = clip


def test_correct_ste_passes():
    report = check_rule(_make_ste(True), X, forward=_sign, derivative=_surrogate)
    assert report.passed
    assert report["finite_differences"].status == "skipped"


def test_exclusive_mask_is_caught_by_jvp_and_vjp():
    with pytest.raises(RuleCheckError) as e:
        check_rule(_make_ste(False), X, forward=_sign, derivative=_surrogate)
    assert set(_failed(e)) == {"jvp", "vjp"}
    assert e.value.report["vjp"].max_abs_error > 0


# ---------------------------------------------------------------------------
# (c) a JVP that is not linear in the tangent


def test_nonlinear_jvp_is_caught_by_linearity():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return jnp.sin(x), jnp.cos(x) * t * jnp.abs(t)

    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, forward=jnp.sin, derivative=jnp.sin, modes=("fwd",))
    assert "linearity" in _failed(e)
    assert "jvp" in _failed(e)


# ---------------------------------------------------------------------------
# (d) a custom_vjp whose backward is twice its declared derivative


def _make_vjp_rule(scale: float = 1.0, dtype=None):
    @jax.custom_vjp
    def f(x):
        return jnp.tanh(x)

    def fwd(x):
        return jnp.tanh(x), x

    def bwd(x, ct):
        g = scale * ct * (1 - jnp.tanh(x) ** 2)
        return (g if dtype is None else g.astype(dtype),)

    f.defvjp(fwd, bwd)
    return f


def test_correct_custom_vjp_passes_and_reports_no_forward_mode():
    report = check_rule(_make_vjp_rule(), X, forward=jnp.tanh, derivative=jnp.tanh)
    assert report.passed
    assert not report.forward_mode
    for name in ("jvp", "linearity", "transpose"):
        assert report[name].status == "unsupported"


def test_doubled_backward_is_caught_by_vjp():
    with pytest.raises(RuleCheckError) as e:
        check_rule(_make_vjp_rule(2.0), X, forward=jnp.tanh, derivative=jnp.tanh)
    assert _failed(e) == ["vjp"]


def test_doubled_backward_is_caught_by_finite_differences_without_reference():
    report = check_rule(_make_vjp_rule(), X, forward=jnp.tanh)
    assert report["finite_differences"].status == "passed"
    with pytest.raises(RuleCheckError) as e:
        check_rule(_make_vjp_rule(2.0), X, forward=jnp.tanh)
    assert _failed(e) == ["finite_differences"]


# ---------------------------------------------------------------------------
# (e) float32 cotangents for bfloat16 primals


def test_float32_cotangent_for_bfloat16_primal_is_caught_by_dtype():
    x = X.astype(jnp.bfloat16)
    check_rule(_make_vjp_rule(), x, forward=jnp.tanh, derivative=jnp.tanh)
    with pytest.raises(RuleCheckError) as e:
        check_rule(
            _make_vjp_rule(dtype=jnp.float32), x, forward=jnp.tanh, derivative=jnp.tanh
        )
    assert _failed(e) == ["dtype"]
    assert "float32" in str(e.value) and "bfloat16" in str(e.value)


# ---------------------------------------------------------------------------
# (f) a forward that differs from its reference at one element


def test_forward_off_at_one_element_is_caught_by_primal():
    @jax.custom_jvp
    def wrong(x):
        return jnp.where(x > 0, 1.0, -1.0)  # sign(0) must be +1; X holds one 0

    @wrong.defjvp
    def wrong_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return wrong(x), t * (jnp.abs(x) <= 1.0)

    with pytest.raises(RuleCheckError) as e:
        check_rule(wrong, X, forward=_sign, derivative=_surrogate)
    assert _failed(e) == ["primal"]
    assert e.value.report["primal"].max_abs_error == 2.0


# ---------------------------------------------------------------------------
# (g) a VJP that is right per example but wrong under vmap


def _make_batching_bug():
    @jax.custom_batching.custom_vmap
    def mask(x):
        return (jnp.abs(x) <= 1.0).astype(x.dtype)

    @mask.def_vmap
    def mask_vmap(axis_size, in_batched, x):
        # Wrong batching rule: every example gets the first example's mask.
        m = (jnp.abs(x[:1]) <= 1.0).astype(x.dtype)
        return jnp.broadcast_to(m, x.shape), True

    @jax.custom_vjp
    def ste(x):
        return _sign(x)

    def fwd(x):
        return _sign(x), x

    def bwd(x, ct):
        return (ct * mask(x),)

    ste.defvjp(fwd, bwd)
    return ste


def test_vmap_only_bug_is_caught_by_batching():
    with pytest.raises(RuleCheckError) as e:
        check_rule(_make_batching_bug(), X, forward=_sign, derivative=_surrogate)
    assert _failed(e) == ["batching"]


# ---------------------------------------------------------------------------
# (h) a NaN gradient where the reference is finite


def test_nan_gradient_is_caught_by_vjp():
    @jax.custom_jvp
    def f(x):
        return jnp.sqrt(jnp.abs(x))

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), t * jnp.sign(x) / (2 * jnp.sqrt(jnp.abs(x)))  # inf * 0 at 0

    def safe(x):
        return jnp.sqrt(jnp.abs(x) + 1e-30) * 0 + jnp.where(
            x == 0, 0.0, jnp.sqrt(jnp.abs(jnp.where(x == 0, 1.0, x)))
        )

    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, forward=safe, derivative=safe)
    assert "vjp" in _failed(e)
    assert "NaN where the reference is finite" in e.value.report["vjp"].detail


# ---------------------------------------------------------------------------
# The checker's own contract


def test_zero_cotangent_check_catches_a_nonzero_gradient():
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, ct: (ct + 1.0,))
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, forward=lambda x: x, derivative=lambda x: x, atol=10.0)
    assert _failed(e) == ["zero_cotangent"]


def _solve(transpose_correct: bool):
    """`A^{-1} b` by `lax.custom_linear_solve`, whose JVP uses `solve` and whose VJP
    uses `transpose_solve`: a wrong transpose makes them disagree."""
    a = jnp.array([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 4.0]])

    def f(b):
        return jax.lax.custom_linear_solve(
            lambda v: a @ v,
            b,
            solve=lambda _, v: jnp.linalg.solve(a, v),
            transpose_solve=lambda _, v: jnp.linalg.solve(
                a.T if transpose_correct else a, v
            ),
        )

    return f


def test_transpose_check_catches_inconsistent_jvp_and_vjp():
    b = X[:3]
    check_rule(_solve(True), b)
    with pytest.raises(RuleCheckError) as e:
        check_rule(_solve(False), b)
    assert "transpose" in _failed(e)
    # Finite differences (a forward-mode comparison) cannot see it; the transpose
    # check is what ties the VJP to the JVP.
    assert "finite_differences" not in _failed(e)


def test_message_names_check_leaf_errors_and_tolerance():
    with pytest.raises(RuleCheckError) as e:
        check_rule(_make_vjp_rule(2.0), X, forward=jnp.tanh, derivative=jnp.tanh)
    msg = str(e.value)
    assert "check `vjp` failed" in msg
    assert "at `x`" in msg  # `f`'s argument, as its signature names it
    assert "max abs error" in msg and "max rel error" in msg
    assert "rtol=1e-05" in msg and "atol=1e-06" in msg
    assert isinstance(e.value, AssertionError)


def test_rule_that_raises_fails_checks_chained_not_crash():
    def broken(x):
        raise RuntimeError("boom")

    report = check_rule(broken, X, forward=jnp.tanh, raise_on_failure=False)
    assert not report.passed
    assert all(r.status == "failed" for r in report.results if r.status != "skipped")
    with pytest.raises(RuleCheckError) as e:
        check_rule(broken, X, forward=jnp.tanh)
    assert isinstance(e.value.__cause__, RuntimeError)


def test_raising_in_one_check_fails_only_that_check():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        raise ValueError("jvp broken")

    report = check_rule(
        f, X, forward=jnp.sin, derivative=jnp.sin, raise_on_failure=False
    )
    assert report["primal"].status == "passed"
    assert report["jvp"].status == "failed"
    assert isinstance(report["jvp"].exception, ValueError)


def test_no_inexact_input_is_a_clear_error():
    with pytest.raises(TypeError, match="no floating-point array"):
        check_rule(lambda x: x, jnp.arange(3))


def test_mismatched_reference_signature_is_a_clear_error():
    with pytest.raises(TypeError, match="`derivative` must take the same arguments"):
        check_rule(lambda m, x: x, 1.0, X, derivative=lambda x: x)
    with pytest.raises(TypeError, match="`forward` must take the same arguments"):
        check_rule(jnp.sin, X, forward=lambda x, y: x)


def test_bad_modes_is_a_clear_error():
    with pytest.raises(ValueError, match="`modes`"):
        check_rule(jnp.sin, X, modes=("forward",))


def test_module_parameters_are_checked_as_arguments():
    mlp = eqx.nn.MLP(3, 2, 4, 1, activation=jnp.tanh, key=jax.random.key(1))
    report = check_rule(lambda m, x: m(x), mlp, jnp.ones(3))
    assert report["finite_differences"].status == "passed"


def test_pytree_inputs_and_outputs():
    def f(tree):
        return {"s": jnp.sin(tree["a"]), "c": jnp.cos(tree["b"][0])}

    tree = {"a": X, "b": (X[:3], "label", 3)}
    report = check_rule(f, tree, forward=f, derivative=f)
    assert report.passed


@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_tolerances_per_dtype_accept_correct_rule(dtype):
    report = check_rule(
        _make_ste(True), X.astype(dtype), forward=_sign, derivative=_surrogate
    )
    assert report.passed


# ---------------------------------------------------------------------------
# (i) a ScaledModel-style rule, right when everything moves, that crashes when the
# input is held fixed (`eqx.filter_grad(loss)(model)`: x's tangent is `None`)


class _CrashingScaled(_TextbookScaled):
    def __call__(self, x):
        return _crashing(self, x)


@eqx.filter_custom_jvp
def _crashing(model, x):
    return model.sub_model(x / model.scale)


@_crashing.def_jvp
def _crashing_jvp(primals, tangents):
    model, x = primals
    t_model, t_x = tangents
    y, t_y = x / model.scale, t_x / model.scale  # assumes t_x is never None
    return eqx.filter_jvp(
        lambda m, y: m(y), (model.sub_model, y), (t_model.sub_model, t_y)
    )


def test_crash_on_held_fixed_input_is_caught_by_held_fixed_only(linear):
    model, x = _CrashingScaled(linear, 2.0), jnp.array([0.0, 1.0, 2.0])
    with pytest.raises(TypeError):
        eqx.filter_grad(lambda m: m(x).sum())(model)  # what a user meets
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda m, x: m(x), model, x, forward=_plain, derivative=_plain)
    assert _failed(e) == ["held_fixed"]
    detail = e.value.report["held_fixed"].detail
    assert "with only `m.sub_model` perturbed" in detail
    assert "TypeError" in detail
    assert isinstance(e.value.__cause__, TypeError)


# ---------------------------------------------------------------------------
# (ii) a rule that drops the parameter tangent when only the parameters move


class _LazyScaled(_TextbookScaled):
    def __call__(self, x):
        return _lazy(self, x)


@eqx.filter_custom_jvp
def _lazy(model, x):
    return model.sub_model(x / model.scale)


@_lazy.def_jvp
def _lazy_jvp(primals, tangents):
    model, x = primals
    t_model, t_x = tangents
    out = model.sub_model(x / model.scale)
    if t_x is None:  # "the input does not move, so nothing does": the bug
        return out, jnp.zeros_like(out)
    return eqx.filter_jvp(
        lambda m, y: m(y),
        (model.sub_model, x / model.scale),
        (t_model.sub_model, t_x / model.scale),
    )


def test_dropped_parameter_tangent_is_caught_by_held_fixed_only(linear):
    model, x = _LazyScaled(linear, 2.0), jnp.array([0.0, 1.0, 2.0])
    grads = eqx.filter_grad(lambda m: m(x).sum())(model)
    assert np.all(np.asarray(grads.sub_model.weight) == 0)  # the silent bug
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda m, x: m(x), model, x, forward=_plain, derivative=_plain)
    assert _failed(e) == ["held_fixed"]
    result = e.value.report["held_fixed"]
    assert "with only `m.sub_model` perturbed" in result.detail
    assert result.actual == 0.0 and result.expected != 0.0
    # Without any reference, against the rule's own derivative with zero tangents.
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda m, x: m(x), model, x, checks=("held_fixed",))
    assert _failed(e) == ["held_fixed"]


def test_held_fixed_passes_for_a_correct_rule_and_names_each_group(linear):
    ours = eqxrules.ScaledModel(linear, 2.0)
    x = jnp.array([0.0, 1.0, 2.0])
    report = check_rule(lambda m, x: m(x), ours, x, derivative=_plain)
    assert report["held_fixed"].status == "passed"
    # One differentiable argument: perturbing it alone is what `jvp` and `vjp` do.
    report = check_rule(jnp.sin, X, derivative=jnp.sin)
    assert report["held_fixed"].status == "skipped"


def test_held_fixed_on_a_reverse_only_rule():
    @jax.custom_vjp
    def f(w, x):
        return w * jnp.tanh(x)

    def fwd(w, x):
        return f(w, x), (w, x)

    def bwd(res, ct):
        w, x = res
        return ct * jnp.tanh(x), ct * w * (1 - jnp.tanh(x) ** 2)

    f.defvjp(fwd, bwd)
    report = check_rule(f, X, X + 1, derivative=lambda w, x: w * jnp.tanh(x))
    assert report.passed
    assert report["held_fixed"].status == "passed"


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
    report = check_rule(_make_vjp_rule(), X, derivative=jnp.tanh, order=2)
    assert report["second_order"].status == "passed"


def test_killed_second_derivative_is_caught_by_second_order_only():
    f = _sin_with_tangent(True)
    report = check_rule(f, X, forward=jnp.sin, derivative=jnp.sin)
    assert report.passed  # order 1 cannot see it
    assert report["second_order"].status == "skipped"
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, forward=jnp.sin, derivative=jnp.sin, order=2)
    assert _failed(e) == ["second_order"]
    assert e.value.report["second_order"].detail.startswith("JVP of VJP")
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, forward=jnp.sin, derivative=jnp.sin, order=2, modes=("rev",))
    assert _failed(e) == ["second_order"]
    assert e.value.report["second_order"].detail.startswith("VJP of VJP")
    # With no `derivative`, a true derivative is checked against `forward`'s.
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, forward=jnp.sin, order=2)
    assert _failed(e) == ["second_order"]


# ---------------------------------------------------------------------------
# Selecting checks


def test_selected_checks_run_and_the_rest_are_skipped():
    report = check_rule(
        _make_ste(False),
        X,
        derivative=_surrogate,
        checks=("vjp",),
        raise_on_failure=False,
    )
    assert report.failed == ["vjp"]
    for r in report.results:
        if r.name != "vjp":
            assert (r.status, r.detail) == ("skipped", "not selected")
    report = check_rule(_make_ste(False), X, derivative=_surrogate, skip=["jvp", "vjp"])
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
        check_rule(_make_ste(False), X, derivative=_surrogate, checks=("vjp",))
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
    # 0. (The zero cotangent gives 0 * inf = NaN there, which that check reports.)
    @jax.custom_jvp
    def cbrt(x):
        return jnp.cbrt(x)

    cbrt.defjvp(lambda p, t: (jnp.cbrt(p[0]), t[0] / (3 * jnp.cbrt(p[0]) ** 2)))
    report = check_rule(cbrt, X, derivative=jnp.cbrt, skip=("zero_cotangent",))
    assert report.passed and report.warnings == []
    report = check_rule(cbrt, X, derivative=jnp.cbrt, raise_on_failure=False)
    assert report.failed == ["zero_cotangent"]


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
