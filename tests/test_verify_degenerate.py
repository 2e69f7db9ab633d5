"""`verify_rule` sees every declared kink, samples a range that covers the kinks,
and gives every rule degenerate slices (issue 25 §1). Each point is shown by a
user's rule with a planted defect that 0.3's `verify_rule` passed: only the first
`size` kinks were placed (a (4, 3) input: 12), inputs were drawn from [-2, 2]
whatever the kinks, and no input held an all-zero, constant or non-finite slice.
The correct rule beside each defect passes."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules import verify_rule

_STEP = 0.4  # 4 bits on [0, 6]: levels 0, 0.4, ..., 6


class ReLU6Quantize(eqxrules.ElementwiseRule):
    r"""4-bit ReLU6: $q = s\,\mathrm{round}(\mathrm{clip}(x, 0, 6) / s)$, $s = 0.4$,
    straight through on $[0, 6]$: $\dot q = t\,[0 \le x \le 6]$."""

    summary: ClassVar[str] = "4-bit ReLU6, straight through on [0, 6]"

    def kinks(self):
        # 15 ties between levels, then the ends: 6 is the 17th.
        return (*((k + 0.5) * _STEP for k in range(15)), 0.0, 6.0)

    def primal(self, x):
        return _STEP * jnp.round(jnp.clip(x, 0.0, 6.0) / _STEP)

    def slope(self, x):
        return (x >= 0) & (x <= 6)

    def reference_forward(self, x):
        return _STEP * jnp.rint(jnp.minimum(jnp.maximum(x, 0.0), 6.0) / _STEP)

    def reference_derivative(self, x):
        # x on [0, 6] (derivative 1, ends included), a constant outside.
        return jnp.where((x >= 0) & (x <= 6), x, jnp.where(x < 0, 0.0, 6.0))


class _ExclusiveAtSix(ReLU6Quantize):
    """Planted: the mask is exclusive at 6, the 17th kink."""

    summary: ClassVar[str] = "4-bit ReLU6, mask exclusive at 6"

    def slope(self, x):
        return (x >= 0) & (x < 6)


def test_every_kink_is_tested_the_17th_included():
    assert len(ReLU6Quantize().kinks()) == 17 > 12  # more than a (4, 3) input holds
    assert verify_rule(ReLU6Quantize).passed
    result = verify_rule(_ExclusiveAtSix, raise_on_failure=False)
    assert not result.passed
    assert any(
        "at its kinks 13 to 17 of 17" in p and "check `jvp` failed" in p
        for p in result.problems
    ), result.problems
    assert any("(input `x` = 6)" in p for p in result.problems), result.problems


def test_on_kinks_holds_every_kink_at_the_declared_shape():
    domain = ReLU6Quantize().input_domain()
    inputs = domain.on_kinks(jax.random.key(0))
    assert len(inputs) == 2 and all(x.shape == domain.shape for x in inputs)
    held = np.concatenate([np.asarray(x).reshape(-1) for x in inputs])
    assert set(np.float32(domain.kinks)) <= set(held)
    # `sample(off_kinks=False)` is the first of them, as before.
    np.testing.assert_array_equal(
        domain.sample(jax.random.key(0), off_kinks=False), inputs[0]
    )


class ReLU6(eqxrules.ElementwiseRule):
    r"""ReLU6: $y = \mathrm{clip}(x, 0, 6)$, $\dot y = t\,[0 \le x \le 6]$."""

    summary: ClassVar[str] = "clip(x, 0, 6)"

    def kinks(self):
        return (0.0, 6.0)

    def primal(self, x):
        return jnp.clip(x, 0.0, 6.0)

    def slope(self, x):
        return (x >= 0) & (x <= 6)

    def reference_forward(self, x):
        return jnp.minimum(jnp.maximum(x, 0.0), 6.0)

    def reference_derivative(self, x):
        return jnp.where((x >= 0) & (x <= 6), x, jnp.where(x < 0, 0.0, 6.0))


class _WrongInside(ReLU6):
    """Planted: the derivative is 0 on (3.5, 5.5), away from every kink and outside
    the default range [-2, 2]."""

    summary: ClassVar[str] = "clip(x, 0, 6), derivative wrong on (3.5, 5.5)"

    def slope(self, x):
        return (x >= 0) & (x <= 6) & ~((x > 3.5) & (x < 5.5))


def test_an_undeclared_range_covers_the_kinks():
    domain = ReLU6().input_domain()
    # [-2, 2] and the kinks span [-2, 6]; 6 lies beyond, so the top moves a
    # quarter of that span past it. The bottom (no kink below -2) stays.
    assert (domain.low, domain.high) == (-2.0, 8.0)
    x = np.concatenate(
        [np.asarray(domain.sample(jax.random.key(i))).reshape(-1) for i in range(4)]
    )
    assert x.max() > 5.5 and x.min() < 0.0
    # A declared range is kept as declared, kinks or not.
    declared = eqxrules.Domain(low=0.0, high=1.0).with_kinks((0.0, 6.0))
    assert (declared.low, declared.high) == (0.0, 1.0)
    assert eqxrules.Domain().with_kinks((-1.0, 1.0)) == eqxrules.Domain(
        kinks=(-1.0, 1.0)
    )


def test_a_defect_between_the_kinks_beyond_two_is_caught():
    # Deterministic: verify_rule's inputs come from its default key(0). On [-2, 2]
    # no input but the kinks 0 and 6 reaches (3.5, 5.5).
    assert verify_rule(ReLU6).passed
    result = verify_rule(_WrongInside, raise_on_failure=False)
    assert not result.passed
    assert any("check `jvp` failed" in p for p in result.problems), result.problems


def _safe_norm(x):
    """sqrt(sum x^2) over the last axis, with a derivative of 0 at a zero row (the
    double `where`: the square root never sees 0)."""
    s = jnp.sum(x * x, axis=-1)
    zero = s == 0
    return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, s)))


class NaiveNorm(eqxrules.JVPRule):
    r"""Euclidean norm of each row: $y = \lVert x \rVert$,
    $\dot y = \langle x, \dot x\rangle / y$ (planted: NaN at a zero row)."""

    summary: ClassVar[str] = "‖x‖ over the last axis, naive"

    def kinks(self):
        return (0.0,)

    def primal(self, x):
        return jnp.sqrt(jnp.sum(x * x, axis=-1))

    def tangent(self, args, t_args, t_self, out):
        (x,), (t,) = args, t_args
        return None if t is None else jnp.sum(x * t, axis=-1) / out

    def reference_forward(self, x):
        return jnp.linalg.norm(x, axis=-1)

    def reference_derivative(self, x):
        return _safe_norm(x)


class SafeNorm(NaiveNorm):
    r"""Euclidean norm of each row: $y = \lVert x \rVert$,
    $\dot y = \langle x, \dot x\rangle / y$, and 0 at a zero row."""

    summary: ClassVar[str] = "‖x‖ over the last axis, 0 derivative at a zero row"

    def tangent(self, args, t_args, t_self, out):
        (x,), (t,) = args, t_args
        if t is None:
            return None
        # 0 where the norm is 0, also where x x underflows (x = 1e-30): there
        # `<x, t>` alone would be right to first order but not to second.
        zero = out == 0
        return jnp.where(zero, 0.0, jnp.sum(x * t, axis=-1) / jnp.where(zero, 1.0, out))


def test_a_naive_norm_is_caught_at_a_zero_row():
    result = verify_rule(NaiveNorm, raise_on_failure=False)
    assert not result.passed
    assert any(
        "all-zero" in p and "NaN where the reference is finite" in p
        for p in result.problems
    ), result.problems


def test_a_safe_norm_passes_also_where_the_references_give_nan():
    result = verify_rule(SafeNorm)
    inf_runs = [r for label, r in result.reports if "one inf" in label]
    assert len(inf_runs) == 1 and inf_runs[0].passed
    assert inf_runs[0]["jvp"].status == "passed"
    # The case is the hard one: the references' own derivative there is NaN in
    # the row holding inf, finite in the others, and the rule's is too.
    x = jnp.array([[jnp.inf, 1.0, 2.0], [3.0, 4.0, 0.0]])
    t = jnp.ones_like(x)
    ref = jax.jvp(_safe_norm, (x,), (t,))[1]
    got = jax.jvp(SafeNorm(), (x,), (t,))[1]
    assert np.isnan(ref[0]) and np.isnan(got[0])
    assert np.isfinite(ref[1]) and got[1] == ref[1]


class HardTanhSte(eqxrules.ElementwiseRule):
    r"""Sign with the derivative of hard tanh: $q = \operatorname{sign}(x)$,
    $\dot q = t\,[\lvert x \rvert \le 1]$."""

    summary: ClassVar[str] = "sign(x); derivative t·[|x| <= 1]"

    def kinks(self):
        return (-1.0, 0.0, 1.0)

    def primal(self, x):
        return jnp.sign(x)

    def slope(self, x):
        return jnp.abs(x) <= 1

    def reference_forward(self, x):
        return jnp.where(x > 0, 1.0, jnp.where(x < 0, -1.0, 0.0))

    def reference_derivative(self, x):
        # x on [-1, 1] (derivative 1, ends included), a constant outside.
        return jnp.where(jnp.abs(x) <= 1, x, jnp.where(x < 0, -1.0, 1.0))


class _MaskedZeroIsNaN(HardTanhSte):
    """Planted: the masked-out slope is written `0 * x`, NaN at an infinite x."""

    summary: ClassVar[str] = "sign(x); masked slope 0·x"

    def slope(self, x):
        return jnp.where(jnp.abs(x) <= 1, 1.0, 0.0 * x)


def test_a_masked_zero_that_becomes_nan_is_caught():
    assert verify_rule(HardTanhSte).passed
    result = verify_rule(_MaskedZeroIsNaN, raise_on_failure=False)
    assert not result.passed
    assert any(
        "one inf" in p and "NaN where the reference is finite" in p
        for p in result.problems
    ), result.problems


@pytest.mark.parametrize("shape", [(), (5,), (4, 3), (2, 3, 4)])
def test_degenerate_inputs_hold_each_slice(shape):
    domain = eqxrules.Domain(shape=shape)
    pairs = dict(domain.degenerate(jax.random.key(0)))
    assert all(x.shape == shape for x in pairs.values())
    assert not np.any(pairs["an all-zero input"])
    assert np.isinf(pairs["a slice holding one inf (the first element)"]).sum() == 1
    if len(shape) >= 2:
        lines = np.asarray(pairs["an all-zero slice along every axis"])
        for axis in range(len(shape)):
            index = [0] * len(shape)
            index[axis] = slice(None)
            assert not np.any(lines[tuple(index)])
        assert np.count_nonzero(lines) > 0  # the rest is random
    # No zero input where the range does not hold 0.
    positive = eqxrules.Domain(low=1.0, high=2.0, shape=shape)
    assert not any("zero" in what for what, _ in positive.degenerate(jax.random.key(0)))


def test_the_arrays_strategy_reaches_every_kink():
    """`strategies.arrays(with_kinks=True)` with more kinks than elements draws a
    run of consecutive kinks, so the last is reached (0.3 placed the first 12
    only). The kinks lie outside `[low, high]`, so no random element equals one."""
    from hypothesis import find, settings

    from eqxrules.testing import strategies

    domain = eqxrules.Domain(kinks=tuple(float(k) for k in range(10, 27)))
    draws = strategies.arrays(domain, off_kinks=False, with_kinks=True)
    x = find(draws, lambda x: 26.0 in np.asarray(x), settings=settings(database=None))
    held = np.asarray(x).reshape(-1)
    assert 26.0 in held and set(held) <= set(domain.kinks)  # 12 consecutive kinks
