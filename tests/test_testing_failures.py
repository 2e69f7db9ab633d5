"""How `check_rule` reports a failure: the argument named as the user wrote it, the
input element at the failing index, and the cause where JAX's own error hides it;
and finite differences in forward mode alone. Each shown on a planted defect."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxrules.testing import RuleCheckError, check_rule

X = jnp.array([-1.5, -1.0, -0.3, 0.0, 0.4, 1.0, 2.0])


def _sign(x):
    return jnp.where(x >= 0, 1.0, -1.0).astype(x.dtype)


def _exclusive_ste():
    """Planted: a sign STE whose mask drops |x| = 1, where the surrogate keeps it."""

    @jax.custom_jvp
    def ste(x):
        return _sign(x)

    ste.defjvp(lambda p, t: (ste(p[0]), t[0] * (jnp.abs(p[0]) < 1.0)))
    return ste


def _surrogate(x):
    return jnp.where(jnp.abs(x) <= 1.0, x, 0.0)


def _sin_with_tangent(tangent):
    """`sin`, with the tangent rule `tangent(x, t)`."""

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]), tangent(p[0], t[0])))
    return f


# ---------------------------------------------------------------------------
# The input at the failing index, and the argument's own name


def test_a_failure_gives_the_input_element_at_its_index():
    with pytest.raises(RuleCheckError) as e:
        check_rule(_exclusive_ste(), X, derivative=_surrogate, checks=("jvp", "vjp"))
    for name, path in (("jvp", "jvp(out)"), ("vjp", "x")):
        result = e.value.report[name]
        assert result.path == path and result.index in {(1,), (5,)}
        # The output and the cotangent both follow `x` index by index.
        assert result.inputs == {"x": float(X[result.index])}
        assert f"(input `x` = {float(X[result.index]):g})" in result.describe()


class _Scaled(eqx.Module):
    sub_model: eqx.nn.Linear

    def __call__(self, x):
        return _scaled(self, x)


@eqx.filter_custom_jvp
def _scaled(model, x):
    return model.sub_model(x / 2)


@_scaled.def_jvp
def _scaled_jvp(primals, tangents):
    # Planted: the parameters' tangent is dropped (materialised as zeros).
    model, x = primals
    t_x = jnp.zeros_like(x) if tangents[1] is None else tangents[1]
    return jax.jvp(model.sub_model, (x / 2,), (t_x / 2,))


def _plain(m, x):
    return m.sub_model(x / 2)


def test_arguments_are_named_by_the_signature_of_fn():
    model = _Scaled(eqx.nn.Linear(3, 2, key=jax.random.key(0)))
    x = jnp.array([0.0, 1.0, 2.0])
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda m, x: m(x), model, x, derivative=_plain)
    message = str(e.value)
    assert "args[" not in message
    vjp = e.value.report["vjp"]
    assert vjp.path.startswith("m.sub_model.")
    leaf = {"m.sub_model.weight": model.sub_model.weight}.get(
        vjp.path, model.sub_model.bias
    )
    assert vjp.inputs == {vjp.path: float(np.asarray(leaf)[vjp.index])}
    assert "with only `m.sub_model` perturbed" in e.value.report["held_fixed"].detail
    # The output (2,) follows no input index by index (the weights are parameters,
    # `x` has 3 elements): said plainly.
    jvp = e.value.report["jvp"]
    assert jvp.inputs == {}
    assert "no input element maps to the index" in jvp.describe()


def test_with_no_name_to_know_the_position_is_given():
    model = _Scaled(eqx.nn.Linear(3, 2, key=jax.random.key(0)))
    x = jnp.array([0.0, 1.0, 2.0])
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda *a: a[0](a[1]), model, x, derivative=lambda *a: _plain(*a))
    assert e.value.report["vjp"].path.startswith("args[0].sub_model.")
    assert "with only `args[0].sub_model` perturbed" in str(e.value)


def test_every_input_of_the_output_shape_is_given_and_pytree_leaves_named():
    @jax.custom_jvp
    def f(tree, scale):
        return tree["w"] * jnp.sin(tree["x"]) * scale

    @f.defjvp
    def f_jvp(primals, tangents):
        (tree, scale), (t, t_scale) = primals, tangents
        w, x = tree["w"], tree["x"]
        out = w * jnp.sin(x) * scale
        # Planted: the tangent of `x` is taken with sin, not cos.
        return out, (t["w"] * jnp.sin(x) + w * jnp.sin(x) * t["x"]) * scale + (
            w * jnp.sin(x) * t_scale
        )

    def g(tree, scale):
        return tree["w"] * jnp.sin(tree["x"]) * scale

    tree = {"w": X + 2.0, "x": X}
    with pytest.raises(RuleCheckError) as e:
        check_rule(f, tree, jnp.float32(0.5), derivative=g)
    jvp, vjp = e.value.report["jvp"], e.value.report["vjp"]
    i = jvp.index
    # The scalar `scale` has another shape: only the tree's two leaves follow.
    assert jvp.inputs == {"tree['w']": float(X[i] + 2.0), "tree['x']": float(X[i])}
    assert vjp.path == "tree['x']"
    assert "(inputs `tree['w']` = " in jvp.describe()


def test_many_inputs_of_the_shape_are_cut_short():
    from eqxrules.testing import CheckResult

    inputs = {f"x{i}": float(i) for i in range(6)}
    result = CheckResult("jvp", "failed", path="jvp(out)", index=(0,), inputs=inputs)
    assert "(inputs `x0` = 0, `x1` = 1, `x2` = 2, `x3` = 3, and 2 more)" in (
        result.describe()
    )


# ---------------------------------------------------------------------------
# Finite differences with forward mode alone: the JVP against central differences


def test_finite_differences_run_in_forward_mode_alone():
    correct = check_rule(
        _sin_with_tangent(lambda x, t: jnp.cos(x) * t), X, modes=("fwd",)
    )
    assert correct.passed
    assert correct["finite_differences"].status == "passed"
    assert correct["vjp"].status == "skipped"  # reverse mode was not asked for
    # Planted: a JVP twice too large, linear in its tangent. Without a reference,
    # only finite differences can see it.
    doubled = _sin_with_tangent(lambda x, t: 2 * jnp.cos(x) * t)
    with pytest.raises(RuleCheckError) as e:
        check_rule(doubled, X, modes=("fwd",))
    assert e.value.failed == ["finite_differences"]
    result = e.value.report["finite_differences"]
    assert result.path == "jvp(out)" and result.index is not None
    assert result.detail.startswith("the JVP along a random unit v against central")
    assert result.inputs == {"x": pytest.approx(float(X[result.index]))}


def test_a_reverse_only_rule_in_forward_mode_alone_is_unsupported():
    @jax.custom_vjp
    def f(w, x):
        return w * jnp.tanh(x)

    f.defvjp(
        lambda w, x: (f(w, x), (w, x)),
        lambda r, ct: (ct * jnp.tanh(r[1]), ct * r[0] * (1 - jnp.tanh(r[1]) ** 2)),
    )
    report = check_rule(f, X, X + 1, modes=("fwd",))
    assert report.passed and not report.forward_mode
    # `held_fixed` with nothing to compare used to pass.
    for name in ("linearity", "held_fixed", "finite_differences"):
        assert report[name].status == "unsupported", name


# ---------------------------------------------------------------------------
# A JVP JAX cannot transpose, checked in reverse mode


_NONLINEAR = {
    "t |t|": lambda x, t: jnp.cos(x) * t * jnp.abs(t),  # AssertionError
    "branch on t": lambda x, t: jnp.where(t > 0, jnp.cos(x) * t, 0.0),  # same
    "sin(t)": lambda x, t: jnp.cos(x) * jnp.sin(t),  # no transpose rule for sin
}


@pytest.mark.parametrize("tangent", _NONLINEAR.values(), ids=list(_NONLINEAR))
def test_a_nonlinear_jvp_in_reverse_mode_names_the_cause(tangent):
    f = _sin_with_tangent(tangent)
    with pytest.raises(Exception) as raw:
        jax.grad(lambda x: f(x).sum())(X)  # what JAX says: nothing of the cause
    assert "linear" not in str(raw.value)
    report = check_rule(f, X, derivative=jnp.sin, raise_on_failure=False)
    assert "linearity" in report.failed
    reverse = ["vjp", "transpose", "batching", "jit", "zero_cotangent", "dtype"]
    assert set(reverse) <= set(report.failed)
    for name in reverse:
        detail = report[name].detail
        assert detail.startswith("the rule's JVP is not linear in its tangent, so JAX ")
        assert "`linearity` check" in detail and type(raw.value).__name__ in detail
    # In reverse mode alone too, where `linearity` does not run.
    report = check_rule(
        f, X, derivative=jnp.sin, modes=("rev",), raise_on_failure=False
    )
    assert report["vjp"].detail.startswith("the rule's JVP is not linear")


def test_the_cause_is_chained_to_where_it_happened():
    @jax.custom_jvp
    def f(w, x):
        return w * jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (w, x), (t_w, t_x) = primals, tangents
        # Planted: the input's tangent enters squared-like, t |t|.
        return f(w, x), t_w * jnp.sin(x) + w * jnp.cos(x) * t_x * jnp.abs(t_x)

    report = check_rule(
        f,
        X + 2,
        X,
        derivative=lambda w, x: w * jnp.sin(x),
        modes=("rev",),
        raise_on_failure=False,
    )
    # With `x` held fixed its tangent is zero, a constant: that VJP transposes.
    detail = report["held_fixed"].detail
    assert detail.startswith("VJP with only `x` perturbed, the rest held fixed: ")
    assert "the rule's JVP is not linear in its tangent" in detail


def test_other_assertion_errors_are_not_taken_for_it():
    # A reverse-only rule's own assertion: its JVP never evaluates.
    @jax.custom_vjp
    def f(x):
        return jnp.tanh(x)

    def bwd(x, ct):
        raise AssertionError("my backward")

    f.defvjp(lambda x: (jnp.tanh(x), x), bwd)
    report = check_rule(f, X, derivative=jnp.tanh, raise_on_failure=False)
    assert report["vjp"].detail == "the rule raised AssertionError: my backward"

    # A tangent rule's own assertion: it fails in forward mode as well.
    def assert_in_tangent(x, t):
        raise AssertionError("my tangent")

    report = check_rule(
        _sin_with_tangent(assert_in_tangent),
        X,
        derivative=jnp.sin,
        raise_on_failure=False,
    )
    assert report["vjp"].detail == "the rule raised AssertionError: my tangent"
