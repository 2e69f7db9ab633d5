"""Checks that cannot pass vacuously or fail falsely (issue 39 §2). Each case is a
planted defect that 0.3's checker passed (or a correct rule it failed) beside its
correct twin:

- a comparison that compares nothing (NaN wherever the reference is) said
  "passed": at x = -1 a square root whose derivative is 246x too large got the
  correct one's verdict, check for check;
- finite differences at an output of -inf gave NaN, so a correct masked rule
  failed and a logsumexp whose gradient is NaN on an all -inf row passed;
- finite differences paired output leaves by position after dropping `None`
  leaves: `{"count": int, "y": sin(x)}` failed ("-0.250116 vs 0")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxrules.testing import RuleCheckError, check_rule


def _sqrt(scale: float):
    """`sqrt` with its derivative `scale` times too large (1: correct)."""

    @jax.custom_jvp
    def f(x):
        return jnp.sqrt(x)

    f.defjvp(lambda p, t: (jnp.sqrt(p[0]), scale * t[0] / (2 * jnp.sqrt(p[0]))))
    return f


def test_a_comparison_of_nothing_fails_it_does_not_pass():
    inside, outside = jnp.array([0.5, 1.0, 4.0]), -jnp.ones(3)
    refs = dict(forward=jnp.sqrt, derivative=jnp.sqrt)
    assert check_rule(_sqrt(1.0), inside, **refs).passed
    with pytest.raises(RuleCheckError) as e:
        check_rule(_sqrt(246.0), inside, **refs)
    assert {"jvp", "vjp"} <= set(e.value.failed)
    # At x = -1 every value and derivative is NaN, the reference's too: the
    # correct rule and the wrong one are both told so, not both "passed".
    for scale in (1.0, 246.0):
        report = check_rule(_sqrt(scale), outside, **refs, raise_on_failure=False)
        for name in ("primal", "jvp", "vjp"):
            result = report[name]
            assert result.status == "failed" and result.compared == 0, result
            assert result.detail.startswith("nothing compared")
    assert check_rule(_sqrt(1.0), inside, **refs)["vjp"].compared == 3


def _lse(safe: bool):
    """logsumexp over the last axis, its custom VJP the softmax: with `safe`, the
    max subtracted only where it is finite and the sum divided by only where it
    is not 0, so that an all -inf row gives 0 (where its value does not move)."""

    @jax.custom_vjp
    def f(x):
        return jax.nn.logsumexp(x, axis=-1)

    def fwd(x):
        return f(x), x

    def bwd(x, ct):
        m = jnp.max(x, axis=-1, keepdims=True)
        if safe:
            m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(x - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        if safe:
            total = jnp.where(total == 0, 1.0, total)
        return (ct[..., None] * e / total,)

    f.defvjp(fwd, bwd)
    return f


MASKED = jnp.array([[0.5, -1.0, 2.0], [-jnp.inf, -jnp.inf, -jnp.inf]])


def test_finite_differences_treat_an_output_of_minus_inf_as_check_grads_does():
    # No custom rule at all: a masked output of -inf does not move.
    def masked(x):
        return jnp.where(jnp.array([True, False, True]), x, -jnp.inf)

    report = check_rule(
        masked, jnp.array([0.3, 1.0, -2.0]), checks=("finite_differences",)
    )
    assert report["finite_differences"].status == "passed"
    # The safe logsumexp passes; the one whose gradient is NaN on the masked row
    # fails (0.3 had it the other way round).
    check_rule(_lse(True), MASKED, checks=("finite_differences",))
    with pytest.raises(RuleCheckError) as e:
        check_rule(_lse(False), MASKED, checks=("finite_differences",))
    assert e.value.failed == ["finite_differences"]


def _with_count(key: str, scale: float):
    """`{key: 3, "y": sin(x)}`, the derivative of `y` `scale` times the true one."""

    @jax.custom_jvp
    def s(x):
        return jnp.sin(x)

    s.defjvp(lambda p, t: (jnp.sin(p[0]), scale * jnp.cos(p[0]) * t[0]))

    def f(x):
        return {key: jnp.asarray(3), "y": s(x)}

    return f


@pytest.mark.parametrize("key", ["count", "z_count"])  # sorted before y, and after
def test_finite_differences_pair_output_leaves_by_path(key):
    x = jnp.array([0.2, -1.0, 0.7])
    for modes in (("rev",), ("fwd", "rev")):
        kw = dict(checks=("finite_differences",), modes=modes)
        report = check_rule(_with_count(key, 1.0), x, **kw)
        assert report["finite_differences"].status == "passed"
        with pytest.raises(RuleCheckError):
            check_rule(_with_count(key, 2.0), x, **kw)


def test_an_infinite_value_where_the_reference_is_finite_is_named():
    """The rule overflows (`sqrt(x * x)` at 1e30) where its reference does not:
    the failure says so, naming the input, with a relative error of inf, not 0."""

    @jax.custom_jvp
    def norm(x):
        return jnp.sqrt(jnp.sum(x * x))

    norm.defjvp(lambda p, t: (norm(p[0]), jnp.sum(p[0] * t[0]) / norm(p[0])))

    def scaled(x):  # the reference: no overflow
        m = jnp.max(jnp.abs(x))
        return m * jnp.sqrt(jnp.sum((x / m) ** 2))

    x = jnp.full((3,), 1e30)
    with pytest.raises(RuleCheckError) as e:
        check_rule(norm, x, forward=scaled, derivative=scaled)
    result = e.value.report["primal"]
    assert result.detail == "infinite where the reference is finite"
    assert result.max_rel_error == np.inf
    assert "max abs error inf, max rel error inf" in result.describe()
    assert check_rule(
        norm, jnp.full((3,), 1e3), forward=scaled, derivative=scaled
    ).passed
