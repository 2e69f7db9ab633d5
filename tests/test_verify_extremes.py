"""`verify_rule` at the ends of the dtype's range (issue 39 §1): finite inputs near
both ends (1e±30 and a quarter of the largest float32), `-inf` as well as `+inf`,
a masked row, as the domain's range allows. 0.3 tried none: a norm computed as
`sqrt(x * x)` (inf beyond 1.8e19) and a logsumexp whose gradient is NaN on an all
`-inf` row (attention's masking input) passed. Each planted defect beside its
correct twin; and what a structured domain or shapes that do not broadcast
change."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import eqxrules
from eqxrules import verify_rule
from eqxrules.testing import strategies


def _softplus(x):
    # max(x, 0) as (x + |x|) / 2: its derivative at 0 is 1/2, sigma(0).
    return (x + jnp.abs(x)) / 2 + jnp.log1p(jnp.exp(-jnp.abs(x)))


class Softplus(eqxrules.ElementwiseRule):
    r"""$y = \log(1 + e^x)$, $\dot y = \sigma(x)\, t$."""

    summary: ClassVar[str] = "log(1 + exp(x))"
    exact: ClassVar[bool] = True

    def primal(self, x):
        return jnp.logaddexp(x, 0.0)

    def slope(self, x):
        return jax.nn.sigmoid(x)

    def reference_forward(self, x):
        return _softplus(x)

    def reference_derivative(self, x):
        return _softplus(x)


class _NaiveSoftplus(Softplus):
    """Planted: `log(1 + exp(x))` as written, inf beyond x = 88 (and right on
    0.3's inputs, all within [-2, 2] or infinite)."""

    summary: ClassVar[str] = "log(1 + exp(x)), naive"

    def primal(self, x):
        return jnp.log(1 + jnp.exp(x))


def test_a_value_that_overflows_is_caught_at_1e30():
    assert verify_rule(Softplus).passed
    result = verify_rule(_NaiveSoftplus, raise_on_failure=False)
    assert not result.passed
    assert all("1e+30" in p or "of float32's largest" in p for p in result.problems)
    assert any(
        "at every element ±1e+30" in p and "infinite where the reference is finite" in p
        for p in result.problems
    ), result.problems


def _logsumexp_rule(safe: bool):
    class Lse(eqxrules.VJPRule):
        r"""logsumexp over the last axis, $y = \log \sum e^x$; its VJP the softmax,
        $\bar x = \bar y\, e^{x - y}$ (0 on a row of $-\infty$, where $y$ does not
        move)."""

        summary: ClassVar[str] = "logsumexp over the last axis"
        exact: ClassVar[bool] = True
        elementwise: ClassVar[bool] = False

        def primal(self, x):
            return jax.nn.logsumexp(x, axis=-1)

        def fwd(self, x):
            return self.primal(x), x

        def bwd(self, x, ct, args):
            m = jnp.max(x, axis=-1, keepdims=True)
            if safe:
                m = jnp.where(jnp.isfinite(m), m, 0.0)
            e = jnp.exp(x - m)
            total = jnp.sum(e, axis=-1, keepdims=True)
            if safe:
                total = jnp.where(total == 0, 1.0, total)
            return (ct[..., None] * e / total,)

        def reference_forward(self, x):
            m = jnp.max(x, axis=-1, keepdims=True)
            m = jnp.where(jnp.isfinite(m), m, 0.0)
            return (m + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)))[
                ..., 0
            ]

        def reference_derivative(self, x):
            # Where a row is all -inf its value stays -inf: no derivative.
            masked = jnp.all(x == -jnp.inf, axis=-1, keepdims=True)
            safe_x = jnp.where(masked, 0.0, x)
            y = jax.nn.logsumexp(safe_x, axis=-1)
            return jnp.where(masked[..., 0], jax.lax.stop_gradient(-jnp.inf), y)

    return Lse


def test_a_logsumexp_whose_gradient_is_nan_on_a_masked_row_is_caught():
    assert verify_rule(_logsumexp_rule(True)).passed
    result = verify_rule(_logsumexp_rule(False), raise_on_failure=False)
    assert not result.passed
    assert any(
        "a masked row" in p and "NaN where the reference is finite" in p
        for p in result.problems
    ), result.problems


def test_extremes_keep_to_the_signs_the_range_allows():
    key = jax.random.key(0)
    positive = dict(eqxrules.Domain(low=0.0, high=4.0).extremes(key))
    assert all(np.all(np.asarray(x) >= 0) for x in positive.values())
    assert not any("-inf" in what for what in positive)
    signed = dict(eqxrules.Domain().extremes(key))
    big = signed["every element ±1e+30"]
    assert set(np.abs(np.asarray(big)).ravel()) == {np.float32(1e30)}
    assert np.any(np.asarray(big) < 0) and np.any(np.asarray(big) > 0)
    row = np.asarray(signed["a slice of -inf along the last axis (a masked row)"])
    assert np.all(row[0] == -np.inf) and np.all(np.isfinite(row[1:]))
    tiny, top = (
        dict(eqxrules.Domain().extremes(key, jnp.float16)),
        jnp.finfo(jnp.float16),
    )
    assert "every element ±0.001" in tiny and f"±{float(top.max) / 4:.4g}" in str(tiny)


def test_an_input_outside_the_references_domain_is_skipped_and_said_so():
    result = verify_rule(eqxrules.SafeArccos)
    skipped = [s for s in result.skipped if "every element ±1e+30" in s]
    assert skipped and "outside the rule's domain" in skipped[0]
    assert "the reference value is finite nowhere there" in skipped[0]
    assert "skipped outside its domain" in str(result)


class Affine(eqxrules.JVPRule):
    r"""$y = W x + b$: a matrix `W` of shape `(3, 4)` and a bias `b` of shape
    `(3,)`, shapes that do not broadcast, and an `x` of shape `(4,)`."""

    summary: ClassVar[str] = "W x + b"
    exact: ClassVar[bool] = True
    elementwise: ClassVar[bool] = False
    domain: ClassVar = eqxrules.Inputs(
        W=eqxrules.Domain(shape=(3, 4)),
        b=eqxrules.Domain(shape=(3,)),
        x=eqxrules.Domain(shape=(4,)),
    )

    def primal(self, W, b, x):
        return W @ x + b

    def tangent(self, args, t_args, t_self, out):
        (W, _, x), (tW, tb, tx) = args, t_args
        terms = [
            t
            for t in (
                None if tW is None else tW @ x,
                tb,
                None if tx is None else W @ tx,
            )
            if t is not None
        ]
        return sum(terms[1:], terms[0]) if terms else None

    def reference_forward(self, W, b, x):
        return jnp.einsum("ij,j->i", W, x) + b

    def reference_derivative(self, W, b, x):
        return jnp.einsum("ij,j->i", W, x) + b


class _BiasTwice(Affine):
    """Planted: the bias's tangent doubled."""

    summary: ClassVar[str] = "W x + b, b's derivative doubled"

    def tangent(self, args, t_args, t_self, out):
        tW, tb, tx = t_args
        return super().tangent(
            args, (tW, None if tb is None else 2 * tb, tx), t_self, out
        )


def test_inputs_of_shapes_that_do_not_broadcast():
    """0.3 crashed with NumPy's "shape mismatch", naming neither the rule nor an
    input. Each input is named as `primal` names it."""
    assert verify_rule(Affine).passed
    result = verify_rule(_BiasTwice, raise_on_failure=False)
    assert any("check `vjp` failed at `b`" in p for p in result.problems), result
    with pytest.raises(ValueError, match=r"`W` \(3, 4\), `b` \(3,\), `x` \(4,\)"):
        Affine.domain.shape  # noqa: B018


@pytest.mark.first_entry_quick
@pytest.mark.parametrize(
    "domain",
    [
        eqxrules.Domain(shape=(3, 2)),
        eqxrules.Domain(low=0.0, high=1.0, shape=(4,)),
        eqxrules.PositiveDefinite(),
        eqxrules.Inputs(a=eqxrules.Domain(), m=eqxrules.Mask()),
    ],
    ids=["signed", "non-negative", "spd", "inputs"],
)
@given(data=st.data())
def test_the_strategies_draw_extremes_within_the_domain(domain, data):
    x = data.draw(strategies.inputs(domain, extremes=True))
    leaves = list(x) if isinstance(x, eqxrules.Args) else [x]
    for leaf in leaves:
        a = np.asarray(leaf, np.float64)
        assert not np.any(np.isnan(a))
        if isinstance(domain, eqxrules.PositiveDefinite):
            assert np.all(a == a.T) and np.all(np.linalg.eigvalsh(a) > 0)
        elif getattr(domain, "low", -1) >= 0:
            assert np.all(a >= 0)
