"""`eqxrules.testing.check_unbiased` without `neighbours` (issue 25 §2): each
element's two neighbours are read off its draws, `bounds` only bound the one not
drawn, and the detectable bias is a fraction of each element's own gap.

Every check of a correct rounding here has false-fail rate at most RATE (the
check's own bound, which holds without `neighbours` for inputs at least
`delta = 1 - exp(-c/n)` of their gap from both neighbours, and with `bounds` for
any input: the docstring derives it); the keys are fixed, so each test is
deterministic. Each defect is planted beside the check that must catch it."""

from __future__ import annotations

import math
import re
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from unbiased_helpers import DEFECTS, DRAWS, FORMATS, KEY, RATE, _format, _problem

import eqxrules
from benchmarks.sections.unbiased import format_values, integer_sr
from eqxrules.testing import (
    UnbiasedCheckError,
    check_unbiased,
    detectable_bias,
    draws_to_detect_bias,
)

E2M1 = format_values(ml_dtypes.float4_e2m1fn)
LATER = pytest.mark.slow  # every format but the first: the quick tier runs one


def _formats():
    return [pytest.param(n, marks=[LATER] if i else []) for i, n in enumerate(FORMATS)]


def _shifted_e2m1(shift: float):
    """Stochastic rounding onto E2M1 that rounds up with probability
    `min(1, p + shift)` instead of `p` (a bias of `shift` of the gap); `shift = 0`
    is a correct one."""
    table = jnp.asarray(E2M1, jnp.float32)

    def sr(x, key):
        i = jnp.clip(jnp.searchsorted(table, x, side="right") - 1, 0, len(E2M1) - 2)
        lower, upper = table[i], table[i + 1]
        upper = jnp.where(lower == x, lower, upper)
        p = jnp.where(lower == upper, 0.0, (x - lower) / (upper - lower) + shift)
        return jnp.where(jax.random.uniform(key, x.shape) < p, upper, lower)

    return sr


# ---------------------------------------------------------------------------
# A correct rounding passes without neighbours; the statistic is theirs


@pytest.mark.slow  # 100,000 draws; the quick tier's check of a correct
# rounding without neighbours is `test_without_neighbours_the_statistic_is_...`
@pytest.mark.parametrize("name", FORMATS)
def test_correct_rounding_passes_without_neighbours(name):
    # P(up) in [0.001, 0.999]: every x lies farther than delta (2.1e-4 of its gap
    # here) from both neighbours, the assumption without `bounds`.
    fn, x, pair = _problem(name, p_range=(0.001, 0.999))
    report = check_unbiased(fn, x, key=KEY, draws=DRAWS, false_fail_rate=RATE)
    assert report.passed and report.elements == 1024 and report.one_valued == 0
    assert -math.expm1(-report.threshold / DRAWS) < 0.001  # delta
    np.testing.assert_array_equal(report.lower[:1024], pair[0][:1024])
    np.testing.assert_array_equal(report.upper[:1024], pair[1][:1024])
    # Then 64 representable values: drawn every time, L = U = x.
    assert np.all(report.lower[1024:] == np.asarray(x[1024:]))
    assert np.all(report.upper[1024:] == np.asarray(x[1024:]))
    assert report.detectable < 0.015


@pytest.mark.slow
@pytest.mark.parametrize("name", _formats())
def test_correct_rounding_passes_with_bounds_whatever_x(name):
    # Any P(up), in (0, 1), and representable values: `bounds` (the format's
    # range) allow for an x near a neighbour drawing it every time.
    fn, x, pair = _problem(name)
    values, _ = _format(name)
    report = check_unbiased(fn, x, key=KEY, bounds=(values[0], values[-1]))
    assert report.passed and report.draws == DRAWS and report.false_fail_rate == RATE
    drawn = np.isfinite(report.detectable_fractions)
    assert drawn.sum() == 1024 + 64 - report.one_valued


@pytest.mark.slow
def test_without_neighbours_the_statistic_is_that_with_neighbours():
    # Same key, same draws: where both neighbours are drawn they are L and U, with
    # the same counts (P(up) in [0.01, 0.99], so each element draws both but for
    # probability 2 * 0.99^10000 < 1e-40).
    fn, x, pair = _problem("float4_e2m1fn", p_range=(0.01, 0.99))
    given = check_unbiased(fn, x, key=KEY, neighbours=pair, draws=10_000)
    drawn = check_unbiased(fn, x, key=KEY, draws=10_000)
    assert drawn.passed and given.passed
    assert (drawn.index, drawn.statistic) == (given.index, given.statistic)
    assert drawn.elements == given.elements and drawn.threshold == given.threshold
    np.testing.assert_array_equal(drawn.means, given.means)
    np.testing.assert_array_equal(
        drawn.detectable_fractions[:1024], given.detectable_fractions[:1024]
    )


# ---------------------------------------------------------------------------
# What fails without neighbours


@pytest.mark.slow
def test_a_third_value_fails():
    # Planted: a rounding that draws one below its lower neighbour once in 1000
    # draws; and one that draws NaN. No correct rounding draws either.
    x = jnp.array([0.3, 1.5, 2.0, -0.75])

    def third(x, key):
        slip = jax.random.uniform(jax.random.fold_in(key, 1), x.shape) < 1e-3
        return integer_sr(x, key) - slip

    with pytest.raises(UnbiasedCheckError, match="were a third value") as e:
        check_unbiased(third, x, key=KEY, draws=10_000)
    assert e.value.report.stray_draws > 0 and not e.value.report.passed
    nan = check_unbiased(
        lambda x, key: integer_sr(x, key).at[1].set(jnp.nan),
        x,
        key=KEY,
        draws=100,
        raise_on_failure=False,
    )
    assert nan.index == (1,) and nan.stray_draws == 100 and "not finite" in nan.detail


@pytest.mark.slow
def test_one_value_other_than_x_fails_without_bounds():
    # Planted: rounding down always (oneDNN #2903), and both draws below x.
    x = jnp.array([0.3, 1.5, 2.0, -0.75])
    down = dict(key=KEY, draws=1000, raise_on_failure=False)
    report = check_unbiased(lambda x, key: jnp.floor(x), x, **down)
    assert not report.passed and "all 1000 draws at index (0,) are 0" in report.detail
    assert math.isinf(report.statistic) and report.p_value == 0.0
    below = check_unbiased(lambda x, key: integer_sr(x, key) - 2, x, **down)
    assert "lies below `x`" in below.detail
    # With `bounds` near enough, one value is no chance: at x = 0.3 with the upper
    # neighbour at most 2, P(all 1000 draws are 0) <= (1 - 0.15)^1000.
    near = check_unbiased(lambda x, key: jnp.floor(x), x, bounds=(-3.0, 3.0), **down)
    assert not near.passed and "as far as `bounds` allows" in near.detail
    # Drawn outside `bounds`: fails at once.
    out = check_unbiased(integer_sr, x, bounds=(-1.0, [1.0, 1.75, 2.0, 0.0]), **down)
    assert "outside `bounds`" in out.detail and out.stray_draws > 0


@pytest.mark.slow
def test_an_x_near_a_neighbour_needs_bounds():
    # The docstring's assumption, shown: eight x at 2^-20 of the gap above an
    # integer draw that integer in all 10,000 draws with probability
    # (1 - 2^-20)^10000 > 0.99 each, so at least one does but for probability
    # 0.01^8. Without `bounds` that fails; with them, it is chance.
    x = jnp.arange(8.0) + 2.0**-20
    kw = dict(key=KEY, draws=10_000, raise_on_failure=False)
    alone = check_unbiased(integer_sr, x, **kw)
    assert not alone.passed and "the check assumes every `x` lies" in alone.detail
    bounded = check_unbiased(integer_sr, x, bounds=(-1.0, 9.0), **kw)
    assert bounded.passed and bounded.one_valued >= 1
    assert "drew one value only" in str(bounded)


# ---------------------------------------------------------------------------
# The planted defects of the low-precision issue, caught without neighbours


@pytest.mark.first_case_quick
@pytest.mark.parametrize("defect", DEFECTS)
@pytest.mark.parametrize("name", _formats())
def test_planted_defects_are_caught_without_neighbours(name, defect):
    # As with neighbours (`test_unbiased.py`): each defect draws one value other
    # than x at most elements, a third value, or a neighbour that an element at a
    # representable x must never draw.
    fn, x, pair = _problem(name)
    with pytest.raises(UnbiasedCheckError) as e:
        check_unbiased(DEFECTS[defect](fn, pair), x, key=KEY, draws=10_000)
    report = e.value.report
    assert not report.passed and f"at index {report.index}" in report.detail
    assert report.p_value < RATE or report.stray_draws > 0


@pytest.mark.slow
def test_wide_bounds_say_where_they_cannot_see():
    # With bounds as wide as E4M3's range, an element near 0 that draws one value
    # is chance (the other neighbour might be 448 away): rounding to nearest is
    # not seen there, and the report counts those elements instead of stating a
    # bias for them.
    fn, x, pair = _problem("float8_e4m3fn")
    values, _ = _format("float8_e4m3fn")
    nearest = DEFECTS["nearest"](fn, pair)
    report = check_unbiased(
        nearest, x, key=KEY, draws=10_000, bounds=(values[0], values[-1]),
        raise_on_failure=False,
    )  # fmt: skip
    assert report.one_valued > 900 and "drew one value only" in str(report)
    assert np.isnan(report.detectable_fractions).sum() == report.one_valued


# ---------------------------------------------------------------------------
# `bounds` catch a 10% bias; the detectable bias is a fraction of each gap


def test_bounds_catch_a_10pc_bias_of_e2m1():
    # The README's form: bounds of E2M1's range. P(up) raised by 10% of the gap
    # is more than 8 times the detectable bias (with power 1/2) at every element
    # with a gap, and 62 independent elements all miss it with probability at
    # most 2^-62. (Before, the draws were mapped onto the 12-wide range and the
    # detectable bias was a fraction of it: this passed.)
    x = jnp.linspace(-3.0, 3.0, 64)
    kw = dict(key=KEY, bounds=(-6.0, 6.0))
    report = check_unbiased(_shifted_e2m1(0.0), x, **kw)
    assert report.passed and report.detectable < 0.1 / 8
    with pytest.raises(UnbiasedCheckError, match="an unbiased rounding keeps"):
        check_unbiased(_shifted_e2m1(0.1), x, **kw)


def test_detectable_is_a_fraction_of_each_elements_gap():
    fn = _shifted_e2m1(0.0)
    x = jnp.linspace(-3.0, 3.0, 64)
    report = check_unbiased(fn, x, key=KEY, bounds=(-6.0, 6.0), draws=10_000)
    gap = report.upper - report.lower
    inside = np.isfinite(gap) & (gap > 0)
    p = (np.asarray(x, np.float64)[inside] - report.lower[inside]) / gap[inside]
    expected = detectable_bias(10_000, p, elements=report.elements)
    np.testing.assert_array_equal(report.detectable_fractions[inside], expected)
    np.testing.assert_array_equal(
        report.detectable_biases[inside], expected * gap[inside]
    )
    assert report.detectable == expected.max() < 0.05
    assert f"Detectable bias {report.detectable:.3g} of an element's gap" in str(report)


def test_the_draws_for_a_1pc_bias_are_the_documented_ones():
    # The figures in `check_unbiased`'s docstring are `draws_to_detect_bias`'s.
    doc = " ".join((check_unbiased.__doc__ or "").split())
    found = re.search(r"takes ([\d,]+) draws for one element and ([\d,]+) among", doc)
    assert found, "the docstring states the draws for a 1% bias"
    one, many = (int(g.replace(",", "")) for g in found.groups())
    assert one == draws_to_detect_bias(0.01, 0.5)
    assert many == draws_to_detect_bias(0.01, 0.5, elements=1000)
    assert detectable_bias(one, 0.5) <= 0.01 < detectable_bias(one - 1, 0.5)


@pytest.mark.slow
def test_the_catalogue_rounding_passes_without_neighbours():
    # A real rule, as the README checks it: E2M1 stochastic rounding, x away from
    # its neighbours (P(up) in [0.001, 0.999]) and representable values.
    rng = np.random.default_rng(0)
    gap = rng.integers(0, len(E2M1) - 1, 256)
    p = rng.uniform(0.001, 0.999, 256)
    inside = E2M1[gap] + p * (E2M1[gap + 1] - E2M1[gap])
    x = jnp.asarray(np.concatenate([inside, E2M1]), jnp.float32)

    def fn(x, key):
        return eqxrules.float_quantize(x, format="e2m1", rounding="stochastic", key=key)

    report = check_unbiased(fn, x, key=KEY, draws=20_000)
    assert report.passed and report.elements == 256


@pytest.mark.slow
def test_the_docstring_example_runs():
    # Without `neighbours`, x exactly on integers (not linspace's near-integers,
    # which would need `bounds`); false-fail rate 1e-6.
    doc = check_unbiased.__doc__ or ""
    code = textwrap.dedent(doc.split("```python", 1)[1].split("```", 1)[0])
    namespace: dict = dict(jax=jax, jnp=jnp, check_unbiased=check_unbiased)
    exec(code, namespace)
    report = namespace["report"]
    assert report.passed and round(report.detectable, 3) == 0.012
