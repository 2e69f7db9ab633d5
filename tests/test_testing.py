"""Self-tests of `eqxrules.testing.check_rule`: planted defects, each caught by the
check that names it, beside correct rules that pass (the held-fixed arguments:
`test_testing_held_fixed.py`; second order, selection and messages:
`test_testing_selection.py`)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checker_defects import (
    TextbookScaled,
    X,
    failed,
    linear as linear,
    make_ste,
    make_vjp_rule,
    plain,
    sign,
    surrogate,
)

import eqxrules
from eqxrules.testing import RuleCheckError, check_rule

# ---------------------------------------------------------------------------
# (a) the textbook ScaledModel rule, in both forms


class _MaterialisedScaled(TextbookScaled):
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


def test_textbook_scaled_model_crashes_on_none_tangent(linear):
    """Differentiating the model alone gives `None` for x's tangent."""
    model = TextbookScaled(linear, 2.0)
    with pytest.raises(TypeError):
        eqx.filter_grad(lambda m: m(jnp.ones(3)).sum())(model)
    # The checker reports it as a failure of the derivative checks, not a crash.
    x = jnp.array([0.0, 1.0, 2.0])
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda m: m(x), model, derivative=lambda m: plain(m, x))
    assert {"jvp", "vjp"} <= set(failed(e))
    assert isinstance(e.value.__cause__, TypeError)


def test_textbook_scaled_model_silently_zeroes_weight_gradient(linear):
    model = _MaterialisedScaled(linear, 2.0)
    x = jnp.array([0.0, 1.0, 2.0])
    grads = eqx.filter_grad(lambda m, x: m(x).sum())(model, x)
    assert np.all(np.asarray(grads.sub_model.weight) == 0)  # the silent bug
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda m, x: m(x), model, x, derivative=plain)
    assert set(failed(e)) == {"jvp", "vjp", "held_fixed"}
    assert "sub_model.weight" in str(e.value)
    assert "sub_model.weight" in e.value.report["vjp"].path


def test_eqxrules_scaled_model_gives_plain_autodiff_weight_gradients(linear):
    """Ours, on the same model: the weight gradient plain autodiff gives."""
    x = jnp.array([0.0, 1.0, 2.0])
    ours = eqxrules.ScaledModel(linear, 2.0)
    autodiff = eqx.filter_grad(lambda m, x: plain(m, x).sum())(ours, x)
    grads = eqx.filter_grad(lambda m, x: m(x).sum())(ours, x)
    np.testing.assert_allclose(grads.sub_model.weight, [[0.0, 0.5, 1.0]])
    np.testing.assert_allclose(grads.sub_model.weight, autodiff.sub_model.weight)
    # And with respect to the model alone, where the textbook rule crashes.
    alone = eqx.filter_grad(lambda m: m(x).sum())(ours)
    np.testing.assert_allclose(alone.sub_model.weight, [[0.0, 0.5, 1.0]])
    check_rule(lambda m, x: m(x), ours, x, forward=plain, derivative=plain)


# ---------------------------------------------------------------------------
# (b) a sign STE whose mask is exclusive at |x| = clip


def test_correct_ste_passes():
    report = check_rule(make_ste(True), X, forward=sign, derivative=surrogate)
    assert report.passed
    assert report["finite_differences"].status == "skipped"


def test_exclusive_mask_is_caught_by_jvp_and_vjp():
    with pytest.raises(RuleCheckError) as e:
        check_rule(make_ste(False), X, forward=sign, derivative=surrogate)
    assert set(failed(e)) == {"jvp", "vjp"}
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
    assert "linearity" in failed(e)
    assert "jvp" in failed(e)


# ---------------------------------------------------------------------------
# (d) a custom_vjp whose backward is twice its declared derivative


def test_correct_custom_vjp_passes_and_reports_no_forward_mode():
    report = check_rule(make_vjp_rule(), X, forward=jnp.tanh, derivative=jnp.tanh)
    assert report.passed
    assert not report.forward_mode
    for name in ("jvp", "linearity", "transpose"):
        assert report[name].status == "unsupported"


def test_doubled_backward_is_caught_by_vjp():
    with pytest.raises(RuleCheckError) as e:
        check_rule(make_vjp_rule(2.0), X, forward=jnp.tanh, derivative=jnp.tanh)
    assert failed(e) == ["vjp"]


def test_doubled_backward_is_caught_by_finite_differences_without_reference():
    report = check_rule(make_vjp_rule(), X, forward=jnp.tanh)
    assert report["finite_differences"].status == "passed"
    with pytest.raises(RuleCheckError) as e:
        check_rule(make_vjp_rule(2.0), X, forward=jnp.tanh)
    assert failed(e) == ["finite_differences"]


# ---------------------------------------------------------------------------
# (e) float32 cotangents for bfloat16 primals


def test_float32_cotangent_for_bfloat16_primal_is_caught_by_dtype():
    x = X.astype(jnp.bfloat16)
    check_rule(make_vjp_rule(), x, forward=jnp.tanh, derivative=jnp.tanh)
    with pytest.raises(RuleCheckError) as e:
        check_rule(
            make_vjp_rule(dtype=jnp.float32), x, forward=jnp.tanh, derivative=jnp.tanh
        )
    assert failed(e) == ["dtype"]
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
        check_rule(wrong, X, forward=sign, derivative=surrogate)
    assert failed(e) == ["primal"]
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
        return sign(x)

    def fwd(x):
        return sign(x), x

    def bwd(x, ct):
        return (ct * mask(x),)

    ste.defvjp(fwd, bwd)
    return ste


def test_vmap_only_bug_is_caught_by_batching():
    with pytest.raises(RuleCheckError) as e:
        check_rule(_make_batching_bug(), X, forward=sign, derivative=surrogate)
    assert failed(e) == ["batching"]


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
    assert "vjp" in failed(e)
    assert "NaN where the reference is finite" in e.value.report["vjp"].detail


# ---------------------------------------------------------------------------
# The checker's own contract


def test_zero_cotangent_check_catches_a_nonzero_gradient():
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, ct: (ct + 1.0,))
    # A loose `atol` at the standard cotangent's scale alone keeps `vjp` quiet (at
    # the cotangent times 1e-3 its tolerance is 1e-3 of it, and `vjp` fails too).
    kwargs = dict(forward=lambda x: x, derivative=lambda x: x, atol=10.0)
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, **kwargs, cotangent_scales=(1.0,))
    assert failed(e) == ["zero_cotangent"]
    assert "max rel error inf" in str(e.value)  # relative to 0, not "0"
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, X, **kwargs)
    assert failed(e) == ["vjp", "zero_cotangent"]
    assert "with the cotangent times 0.001" in e.value.report["vjp"].detail


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
    assert "transpose" in failed(e)
    # Finite differences (a forward-mode comparison) cannot see it; the transpose
    # check is what ties the VJP to the JVP.
    assert "finite_differences" not in failed(e)


def test_message_names_check_leaf_errors_and_tolerance():
    with pytest.raises(RuleCheckError) as e:
        check_rule(make_vjp_rule(2.0), X, forward=jnp.tanh, derivative=jnp.tanh)
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


def test_mismatched_referencesignature_is_a_clear_error():
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
        make_ste(True), X.astype(dtype), forward=sign, derivative=surrogate
    )
    assert report.passed
