"""`check_rule`'s `held_fixed` check: a rule gets `None` (symbolic-zero) tangents
for the arguments held fixed, which only this check gives it; each planted defect
is caught by it alone."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checker_defects import TextbookScaled, X, failed, linear as linear, plain

import eqxrules
from eqxrules.testing import RuleCheckError, check_rule

# ---------------------------------------------------------------------------
# (i) a ScaledModel-style rule, right when everything moves, that crashes when the
# input is held fixed (`eqx.filter_grad(loss)(model)`: x's tangent is `None`)


class _CrashingScaled(TextbookScaled):
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
        check_rule(lambda m, x: m(x), model, x, forward=plain, derivative=plain)
    assert failed(e) == ["held_fixed"]
    detail = e.value.report["held_fixed"].detail
    assert "with only `m.sub_model` perturbed" in detail
    assert "TypeError" in detail
    assert isinstance(e.value.__cause__, TypeError)


# ---------------------------------------------------------------------------
# (ii) a rule that drops the parameter tangent when only the parameters move


class _LazyScaled(TextbookScaled):
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
        check_rule(lambda m, x: m(x), model, x, forward=plain, derivative=plain)
    assert failed(e) == ["held_fixed"]
    result = e.value.report["held_fixed"]
    assert "with only `m.sub_model` perturbed" in result.detail
    assert result.actual == 0.0 and result.expected != 0.0
    # Without any reference, against the rule's own derivative with zero tangents.
    with pytest.raises(RuleCheckError) as e:
        check_rule(lambda m, x: m(x), model, x, checks=("held_fixed",))
    assert failed(e) == ["held_fixed"]


def test_held_fixed_passes_for_a_correct_rule_and_names_each_group(linear):
    ours = eqxrules.ScaledModel(linear, 2.0)
    x = jnp.array([0.0, 1.0, 2.0])
    report = check_rule(lambda m, x: m(x), ours, x, derivative=plain)
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
