"""Structured domains through `verify_rule` (issue 39 §1): a matrix function on
the symmetric positive definite matrices, integer labels, probabilities. 0.3's
`Domain` was a box: of the inputs it tried for a `sqrtm`, none was symmetric
positive definite, tangents were dense, and the correct rule and a wrong one got
identical verdicts. A structured domain is a `Domain` subclass written on its
public protocol, as a user's own would be (`_Rank1` below)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules import verify_rule


def _sqrtm(a):
    w, v = jnp.linalg.eigh(a)
    return (v * jnp.sqrt(w)) @ v.T


class Sqrtm(eqxrules.VJPRule):
    r"""The principal square root $S$ of a symmetric positive definite $A$, by
    eigendecomposition; its VJP solves $S X + X S = \bar S$ in the eigenbasis."""

    summary: ClassVar[str] = "sqrtm of an SPD matrix, Sylvester VJP"
    exact: ClassVar[bool] = True
    elementwise: ClassVar[bool] = False
    domain: ClassVar[eqxrules.Domain] = eqxrules.PositiveDefinite(low=0.5, high=2.0)

    def primal(self, a):
        return _sqrtm(a)

    def fwd(self, a):
        w, v = jnp.linalg.eigh(a)
        return _sqrtm(a), (w, v)

    def bwd(self, res, ct, args):
        w, v = res
        r = jnp.sqrt(w)
        x = (v.T @ ct @ v) / (r[:, None] + r[None, :])
        return (v @ x @ v.T,)

    def reference_forward(self, a):
        return _sqrtm((a + a.T) / 2)

    def reference_derivative(self, a):
        return _sqrtm((a + a.T) / 2)


class _OneSidedSqrtm(Sqrtm):
    """Planted: the Sylvester solution divided by twice one root, `2 r_i`, not
    `r_i + r_j`: right on the diagonal only."""

    summary: ClassVar[str] = "sqrtm, one-sided VJP"

    def bwd(self, res, ct, args):
        w, v = res
        r = jnp.sqrt(w)
        x = (v.T @ ct @ v) / (2 * r[:, None])
        return (v @ x @ v.T,)


def _on_a_box(rule):
    class OnABox(rule):
        domain: ClassVar[eqxrules.Domain] = eqxrules.Domain(shape=(3, 3))

    return OnABox


def test_a_matrix_function_is_verified_on_its_spd_domain():
    result = verify_rule(Sqrtm)
    assert result.passed, result
    wrong = verify_rule(_OneSidedSqrtm, raise_on_failure=False)
    assert any("check `vjp` failed at `a`" in p for p in wrong.problems), wrong
    # On a box, neither is judged: both fail alike (NaN square roots of matrices
    # that are not positive definite, dense tangents).
    on_box = [
        verify_rule(_on_a_box(r), raise_on_failure=False)
        for r in (Sqrtm, _OneSidedSqrtm)
    ]
    assert not on_box[0].passed and not on_box[1].passed


class CrossEntropy(eqxrules.JVPRule):
    r"""Cross-entropy of logits $z$ (rows) against integer labels $k$:
    $y_i = \log \sum_j e^{z_{ij}} - z_{i k_i}$, $\dot y_i = \langle
    \operatorname{softmax}(z_i) - e_{k_i}, \dot z_i \rangle$; the labels are not
    differentiated."""

    summary: ClassVar[str] = "cross-entropy of logits against labels"
    exact: ClassVar[bool] = True
    elementwise: ClassVar[bool] = False
    domain: ClassVar = eqxrules.Inputs(
        logits=eqxrules.Domain(shape=(4, 3)),
        labels=eqxrules.Integers(0, 2, shape=(4,)),
    )

    def primal(self, logits, labels):
        # `log_softmax` picked, not `logsumexp(z) - z_k`: at logits of 1e30 that
        # loses the log 2 of a tie to rounding (0 where 0.693 is due).
        log_p = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(log_p, labels[:, None], axis=-1)[:, 0]

    def tangent(self, args, t_args, t_self, out):
        (z, k), (t, _) = args, t_args
        if t is None:
            return None
        p = jax.nn.softmax(z, axis=-1) - jax.nn.one_hot(k, z.shape[-1], dtype=z.dtype)
        return jnp.sum(p * t, axis=-1)

    def reference_forward(self, logits, labels):
        log_p = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jax.nn.one_hot(labels, 3) * log_p, axis=-1)

    def reference_derivative(self, logits, labels):
        return self.reference_forward(logits, labels)


@pytest.mark.slow  # the quick tier's 4 minutes
def test_integer_labels_are_inputs_held_as_they_are():
    result = verify_rule(CrossEntropy)
    assert result.passed, result
    labels = [x for label, r in result.reports for x in [label] if "`labels`" in label]
    assert any("`labels` every element 2 (`high`)" in x for x in labels)
    x = CrossEntropy.domain.sample(jax.random.key(0))
    assert x[1].dtype == jnp.int32 and set(np.asarray(x[1])) <= {0, 1, 2}


@dataclasses.dataclass(frozen=True)
class _Rank1(eqxrules.Domain):
    """A user's own structured domain, on the public protocol alone: symmetric
    rank-one matrices `v vᵀ`, moving along symmetric directions."""

    shape: tuple[int, ...] = (3, 3)

    def sample(self, key, dtype=jnp.float32, *, off_kinks=True):
        v = jax.random.normal(key, self.shape[:1])
        return jnp.outer(v, v).astype(dtype)

    def project(self, t):
        return (t + t.T) / 2


class Trace(eqxrules.JVPRule):
    r"""$y = \operatorname{tr} A$, $\dot y = \operatorname{tr} \dot A$."""

    summary: ClassVar[str] = "trace"
    exact: ClassVar[bool] = True
    elementwise: ClassVar[bool] = False
    domain: ClassVar[eqxrules.Domain] = _Rank1()

    def primal(self, a):
        return jnp.trace(a)

    def tangent(self, args, t_args, t_self, out):
        return None if t_args[0] is None else jnp.trace(t_args[0])

    def reference_forward(self, a):
        return jnp.sum(jnp.diag(a))

    def reference_derivative(self, a):
        return jnp.sum(jnp.diag(a))


def test_a_domain_of_ones_own_needs_no_private_override():
    assert _Rank1().structured
    assert _Rank1().degenerate(jax.random.key(0)) == []  # not the box's
    assert verify_rule(Trace).passed


@pytest.mark.parametrize(
    "domain, message",
    [
        (lambda: eqxrules.PositiveDefinite(low=0.0), "`low` (=0.0) must be positive"),
        (lambda: eqxrules.Symmetric(shape=(3, 4)), "must end in two equal axes"),
        (lambda: eqxrules.Integers(2, 1), "`low` (=2) must be at most `high`"),
        (lambda: eqxrules.Simplex(shape=(4,), axis=1), "`axis` (=1) is out of range"),
    ],
)
def test_a_structured_domain_rejects_bad_arguments(domain, message):
    with pytest.raises(ValueError) as e:
        domain()
    assert message in str(e.value)
    with pytest.raises(TypeError, match=r"`Integers`: `low` must be an int"):
        eqxrules.Integers(0.5, 2)
