"""`eqxrules.verify_rule`: the catalogue's battery on a user's rule class,
without registering it. Each part of the battery is shown to fail on a planted
defect."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import pytest

import eqxrules
from eqxrules import RuleVerificationError, hyperparameter, verify_rule
from eqxrules.checks import positive


class Scale(eqxrules.JVPRule):
    r"""Multiply by a positive `factor`: $y = a x$, $\dot y = a \dot x$."""

    factor: float = hyperparameter(2.0, positive)

    summary: ClassVar[str] = "a·x, a = factor"
    exact: ClassVar[bool] = True

    def primal(self, x):
        return self.factor * x

    def tangent(self, args, t_args, t_self, out):
        return None if t_args[0] is None else self.factor * t_args[0]

    def reference_forward(self, x):
        return self.factor * x

    def reference_derivative(self, x):
        return self.factor * x

    @classmethod
    def examples(cls, key):
        return [cls(), cls(factor=0.5)]


def test_a_correct_rule_passes_and_stays_out_of_the_catalogue():
    before = eqxrules.catalogue()
    result = verify_rule(Scale)
    assert result.passed and result.problems == []
    # Two examples, each at a random input (no kinks), at each degenerate and
    # extreme input, and off its kinks with finite differences (exact) and at
    # second order.
    degenerate = len(Scale.domain.degenerate(jax.random.key(0)))
    extremes = len(Scale.domain.extremes(jax.random.key(0)))
    assert (degenerate, extremes) == (5, 5)
    assert len(result.reports) == 2 * (1 + degenerate + extremes + 2)
    labels = [label for label, _ in result.reports]
    assert labels[0] == "example 0 (Scale()) at a random input (it declares no kinks)"
    assert not any("at its kinks" in label for label in labels)
    assert all(r.passed for _, r in result.reports)
    assert "passed" in str(result)
    assert eqxrules.catalogue() == before
    assert Scale.function is None  # not even given a functional form


class _WrongDerivative(Scale):
    """Planted: the derivative is 3x too big when `factor` is 2."""

    summary: ClassVar[str] = "a·x, wrong derivative"

    def tangent(self, args, t_args, t_self, out):
        return None if t_args[0] is None else 3 * t_args[0]


class _NoReference(eqxrules.JVPRule):
    """Planted: no references."""

    summary: ClassVar[str] = "x"

    def primal(self, x):
        return x

    def tangent(self, args, t_args, t_self, out):
        return t_args[0]


class _Coerces(Scale):
    """Planted: a negative factor is silently made positive."""

    summary: ClassVar[str] = "a·|x|, coerced"

    def __init__(self, factor=2.0):
        self.factor = abs(factor) if isinstance(factor, float) else factor


@jax.custom_vjp
def _reverse_only(x):
    return 2 * x


_reverse_only.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))


class _ClaimsForwardMode(Scale):
    """Planted: a `JVPRule` whose value goes through a `custom_vjp`."""

    summary: ClassVar[str] = "a·x via custom_vjp"

    def primal(self, x):
        return self.factor / 2 * _reverse_only(x)

    def tangent(self, args, t_args, t_self, out):
        return jax.jvp(lambda x: self.primal(x), args, (t_args[0],))[1]


class _Float32(Scale):
    """Planted: computes in float32 whatever comes in."""

    summary: ClassVar[str] = "a·x in float32"

    def primal(self, x):
        return (self.factor * x).astype(jnp.float32)

    def tangent(self, args, t_args, t_self, out):
        return (
            None if t_args[0] is None else (self.factor * t_args[0]).astype(jnp.float32)
        )


@pytest.mark.parametrize(
    "rule,shown",
    [
        (_WrongDerivative, "check `vjp` failed"),
        (_NoReference, "lacks `reference_forward`"),
        (_Coerces, "`factor`=-1.0: was accepted (a ValueError is due)"),
        (_ClaimsForwardMode, "forward mode: declared True"),
        (_Float32, "`value` is float32 for bfloat16 input"),
    ],
    ids=lambda v: getattr(v, "__name__", "")[:20],
)
def test_each_part_of_the_battery_catches_its_defect(rule, shown):
    result = verify_rule(rule, raise_on_failure=False)
    assert not result.passed
    assert any(shown in p for p in result.problems), result.problems
    with pytest.raises(RuleVerificationError) as info:
        verify_rule(rule)
    assert shown in str(info.value)
    assert info.value.verification.problems == result.problems


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"`verify_rule`: `rule` must be.*instance"):
        verify_rule(Scale())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`verify_rule`: `rule` must be.*int"):
        verify_rule(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`raise_on_failure` must be a bool.*'no'"):
        verify_rule(Scale, raise_on_failure="no")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name", ["verify_rule", "RuleVerification", "RuleVerificationError"]
)
def test_moved_from_eqxrules_testing_says_where(name):
    # `eqxrules.testing` may not import the catalogue (tests/test_imports.py), so
    # these live in `eqxrules`; the old spelling names the new one.
    import eqxrules.testing

    assert name in eqxrules.__all__ and name not in eqxrules.testing.__all__
    with pytest.raises(AttributeError, match=rf"moved to `eqxrules\.{name}`"):
        getattr(eqxrules.testing, name)
    assert not hasattr(eqxrules.testing, name)


class _Transposed(eqxrules.JVPRule):
    r"""Planted: the transpose of a matrix, $Y = A^\top$, with a derivative that
    forgets to transpose. Its argument is `A`, and failures name it so (0.3
    reported every rule's argument as `x`)."""

    summary: ClassVar[str] = "Aᵀ, derivative untransposed"
    elementwise: ClassVar[bool] = False
    domain: ClassVar[eqxrules.Domain] = eqxrules.Domain(shape=(3, 3))

    def primal(self, A):
        return A.T

    def tangent(self, args, t_args, t_self, out):
        return t_args[0]

    def reference_forward(self, A):
        return jnp.swapaxes(A, 0, 1)

    def reference_derivative(self, A):
        return jnp.swapaxes(A, 0, 1)


def test_a_failure_names_the_argument_as_primal_does():
    result = verify_rule(_Transposed, raise_on_failure=False)
    assert any("check `vjp` failed at `A`" in p for p in result.problems), result
    assert not any("at `x`" in p for p in result.problems)


def test_parameter_without_a_check_names_parameter():
    with pytest.raises(TypeError, match=r"^`parameter`: give a default, then one"):
        eqxrules.parameter()
    with pytest.raises(TypeError, match=r"^`hyperparameter`: give a default"):
        eqxrules.hyperparameter(1.0)
