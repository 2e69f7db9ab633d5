"""A `VJPRule`'s learnable `parameter` fields get their cotangents from `bwd`, in
its declared slot (issue 39 §3): 0.3 gave them none, so `d/ds sum(s * x)` was
silently 0.0. The implicit layer (a fixed point with a learned `W`), the case that
needs it, runs through `verify_rule`; planted defects beside each correct rule."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array

import eqxrules
from eqxrules import verify_rule
from eqxrules.checks import finite_everywhere


class Scaled(eqxrules.VJPRule):
    r"""$y = s x$ with a learned scale $s$: $\bar x = s \bar y$, $\bar s = \sum
    x \bar y$."""

    s: Array = eqxrules.parameter(finite_everywhere)
    summary: ClassVar[str] = "s·x, s learned"
    exact: ClassVar[bool] = True

    def primal(self, x):
        return self.s * x

    def fwd(self, x):
        return self.s * x, x

    def bwd(self, x, ct, args):
        return (self.s * ct,), {"s": jnp.sum(x * ct)}

    def reference_forward(self, x):
        return x * self.s

    def reference_derivative(self, x):
        return x * self.s

    @classmethod
    def examples(cls, key):
        return [cls(jnp.array(2.0))]


class _ArgumentsOnly(Scaled):
    """Planted: 0.3's `bwd`, the arguments' cotangents alone."""

    summary: ClassVar[str] = "s·x, no slot"

    def bwd(self, x, ct, args):
        return (self.s * ct,)


def test_the_parameter_gets_its_cotangent_from_bwd():
    x = jnp.array([1.0, 2.0, 3.0])
    m = Scaled(jnp.array(2.0))
    grads = eqx.filter_grad(lambda m, x: m(x).sum())(m, x)
    assert float(grads.s) == 6.0  # d/ds sum(s x) = sum x, not 0.0
    np.testing.assert_array_equal(jax.grad(lambda x: m(x).sum())(x), [2.0] * 3)
    # bfloat16 stays bfloat16, in the slot too.
    half = Scaled(jnp.array(2.0, jnp.bfloat16))
    g = eqx.filter_grad(lambda m: m(x.astype(jnp.bfloat16)).sum())(half)
    assert g.s.dtype == jnp.bfloat16
    assert verify_rule(Scaled).passed


def test_a_bwd_without_the_slot_is_a_clear_error():
    x = jnp.array([1.0, 2.0, 3.0])
    with pytest.raises(
        TypeError, match=r"`_ArgumentsOnly`.*field\(s\) `s`.*\{'s': \.\.\.\}"
    ):
        eqx.filter_grad(lambda m: m(x).sum())(_ArgumentsOnly(jnp.array(2.0)))
    result = verify_rule(_ArgumentsOnly, raise_on_failure=False)
    assert not result.passed
    assert any("gives their cotangents from `bwd`" in p for p in result.problems)


class _MissingKey(Scaled):
    """Planted: the slot names no field."""

    summary: ClassVar[str] = "s·x, empty slot"

    def bwd(self, x, ct, args):
        return (self.s * ct,), {}


def test_a_slot_missing_a_field_is_a_clear_error():
    with pytest.raises(TypeError, match=r"for each `parameter` field, `s`"):
        jax.grad(lambda x: _MissingKey(jnp.array(2.0))(x).sum())(jnp.ones(3))


_ITERATIONS = 60  # |W| <= 0.6 and |tanh'| <= 1: the error shrinks 0.6x a step


def _iterate(w, x, iterations=_ITERATIONS):
    return jax.lax.fori_loop(
        0, iterations, lambda _, z: jnp.tanh(w @ z + x), jnp.zeros_like(x)
    )


class FixedPoint(eqxrules.VJPRule):
    r"""An implicit layer: $z^\star = \tanh(W z^\star + x)$, $W$ learned and
    contractive, solved by iteration and differentiated implicitly: with
    $D = \operatorname{diag}(1 - z^{\star 2})$ and $v = (I - D W)^{-\top} \bar z$,
    $\bar x = D v$ and $\bar W = (D v) z^{\star\top}$."""

    W: Array = eqxrules.parameter(finite_everywhere)
    summary: ClassVar[str] = "fixed point of tanh(W z + x), implicit derivative"
    exact: ClassVar[bool] = True
    elementwise: ClassVar[bool] = False
    domain: ClassVar[eqxrules.Domain] = eqxrules.Domain(shape=(3,))

    def primal(self, x):
        return _iterate(self.W, x)

    def fwd(self, x):
        z = _iterate(self.W, x)
        return z, z

    def bwd(self, z, ct, args):
        d = 1 - z**2
        a = jnp.eye(z.shape[0]) - d[:, None] * self.W
        w = d * jnp.linalg.solve(a.T, ct)
        return (w,), {"W": jnp.outer(w, z)}

    def reference_forward(self, x):
        return _iterate(self.W, x, 3 * _ITERATIONS)

    def reference_derivative(self, x):
        # Plain autodiff through the unrolled iteration: the same derivative,
        # reached without solving.
        return _iterate(self.W, x, 3 * _ITERATIONS)

    @classmethod
    def examples(cls, key):
        w = jax.random.normal(key, (3, 3))
        return [cls(0.6 * w / jnp.linalg.norm(w, 2))]


class _WrongWeightGradient(FixedPoint):
    """Planted: `W`'s cotangent transposed."""

    summary: ClassVar[str] = "fixed point, W's cotangent transposed"

    def bwd(self, z, ct, args):
        (w,), grads = super().bwd(z, ct, args)
        return (w,), {"W": grads["W"].T}


@pytest.mark.slow  # the quick tier's 4 minutes
def test_an_implicit_layer_is_verified_weight_included():
    result = verify_rule(FixedPoint)
    assert result.passed, result
    held = [r["held_fixed"] for label, r in result.reports if "random input" in label]
    assert held and held[0].status == "passed"  # `m.W` and `x`, each alone
    wrong = verify_rule(_WrongWeightGradient, raise_on_failure=False)
    assert not wrong.passed
    assert any("check `vjp` failed at `m.W`" in p for p in wrong.problems), wrong
