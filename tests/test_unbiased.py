"""`eqxrules.testing.check_unbiased` (issue 19 §2): it passes correct stochastic
rounding onto the integers, float8_e4m3fn and float4_e2m1fn, and catches planted
defects modelled on real bugs; its detectable bias and its stated false-fail rate
hold, checked exactly and over repeated keys.

The roundings and the planted defects are in `unbiased_helpers.py` and
`benchmarks/sections/unbiased.py` (whose calibration the tests run at a small
size), not written with any eqxrules rule; `test_unbiased_seen.py` tests the check
without `neighbours`. Every
statistical assertion states its own false-fail rate and the bound behind it; the
keys are fixed, so each test is deterministic, and the rate says how unlucky a key
would have to be for a correct checker to fail it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from unbiased_helpers import (
    DEFECTS,
    DRAWS,
    FORMATS,
    KEY,
    RATE,
    _always_down,
    _biased,
    _most,
    _problem,
    _zeros,
)

from benchmarks.sections.unbiased import calibrate, exact_rate, integer_sr
from eqxrules.testing import (
    UnbiasedCheckError,
    _unbiased,
    check_unbiased,
    detectable_bias,
    draws_to_detect_bias,
)

# ---------------------------------------------------------------------------
# Correct roundings pass; the defects are caught


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", FORMATS)
def test_correct_rounding_passes(name):
    # False-fail rate at most RATE (the check's own bound).
    fn, x, pair = _problem(name)
    report = check_unbiased(fn, x, key=KEY, neighbours=pair, draws=DRAWS)
    assert report.passed and report.stray_draws == 0 and report.draws == DRAWS
    assert report.elements == 1024 and report.false_fail_rate == RATE
    # A representable x has L = U = x: every draw was x itself.
    assert np.array_equal(report.means[1024:], np.asarray(x[1024:], np.float64))
    assert report.interval[0] <= report.mean <= report.interval[1]
    assert "passed" in str(report)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("defect", DEFECTS)
@pytest.mark.parametrize("name", FORMATS)
def test_planted_defects_are_caught(name, defect):
    # Each defect is far beyond the detectable bias at 10,000 draws at most
    # elements (or draws a value that is no neighbour): the check passes it with
    # probability at most 1/2 per such element (`detectable`), the elements drawing
    # independently. (The 3% bias needs more draws: its own test, below.)
    fn, x, pair = _problem(name)
    with pytest.raises(UnbiasedCheckError) as e:
        check_unbiased(
            DEFECTS[defect](fn, pair), x, key=KEY, neighbours=pair, draws=10_000
        )
    report, message = e.value.report, str(e.value)
    assert not report.passed and message == report.detail
    assert f"at index {report.index}" in message and f"{report.x:.9g}" in message
    if defect in ("zeros", "moves_representable"):
        assert report.stray_draws > 0 and "neither neighbour" in message
    else:
        # The worst element: its mean, `x` there and the bound it broke.
        assert report.stray_draws == 0
        low, high = report.interval
        assert not low <= report.mean <= high and report.p_value < RATE
        assert f"{report.mean:.9g}" in message and f"[{low:.9g}, {high:.9g}]" in message


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", FORMATS)
def test_a_3pc_bias_is_detectable_and_caught(name):
    # Where P(up) lies in [0.5, 0.95], the report says a 3% relative bias (a shift
    # of 0.03 p in P(up)) is above the detectable bias at every element, so each
    # element catches it with probability at least 1/2: the 1024 independent
    # elements all miss it with probability at most 2^-1024.
    fn, x, pair = _problem(name, p_range=(0.5, 0.95))
    report = check_unbiased(fn, x, key=KEY, neighbours=pair, draws=DRAWS)
    lower, upper = (v[:1024] for v in pair)  # then 64 representable values
    p = (np.asarray(x[:1024], np.float64) - lower) / (upper - lower)
    shift = 0.03 * p * (upper - lower)
    assert report.passed and np.all(report.detectable_biases[:1024] <= shift)
    assert report.detectable < 0.015  # the worst element, at p = 1/2
    with pytest.raises(UnbiasedCheckError, match="an unbiased rounding keeps"):
        check_unbiased(_biased(fn, pair), x, key=KEY, neighbours=pair, draws=DRAWS)


# ---------------------------------------------------------------------------
# Without neighbours: the neighbours drawn (`test_unbiased_seen.py` tests them
# further), or a range (`within`)


@pytest.mark.slow
def test_bounds_give_the_same_test_as_neighbours():
    # Same key, same draws. With `bounds` = (L, U), the two values drawn at an
    # element are L and U, with the same count; at an element that drew one value
    # `bounds` put the other neighbour where it is (r = p): the statistic is the
    # same. With `within` = (L, U) the mean of the draws carries the count: the
    # same up to float32 summation. False-fail rate at most RATE per check.
    fn, x, pair = _problem("float8_e4m3fn")
    by_neighbours = check_unbiased(fn, x, key=KEY, neighbours=pair, draws=10_000)
    by_bounds = check_unbiased(fn, x, key=KEY, bounds=pair, draws=10_000)
    by_range = check_unbiased(fn, x, key=KEY, within=pair, draws=10_000)
    assert by_bounds.passed and by_range.passed
    assert by_bounds.index == by_neighbours.index == by_range.index
    assert by_bounds.statistic == by_neighbours.statistic
    assert by_range.statistic == pytest.approx(by_neighbours.statistic, rel=1e-3)
    np.testing.assert_array_equal(by_bounds.means, by_neighbours.means)
    np.testing.assert_allclose(by_range.means, by_neighbours.means, rtol=1e-6)
    drawn = np.isfinite(by_bounds.detectable_fractions)  # both neighbours drawn
    assert drawn.sum() >= 1024 + 64 - by_bounds.one_valued
    for report in (by_bounds, by_range):
        np.testing.assert_array_equal(
            report.detectable_biases[drawn], by_neighbours.detectable_biases[drawn]
        )


@pytest.mark.slow
def test_within_catches_bias_and_strays():
    fn, x, pair = _problem("integers", p_range=(0.5, 0.95))
    lower, upper = pair
    # Caught with the probability of the neighbours' test (same statistic).
    with pytest.raises(UnbiasedCheckError, match="of the way from"):
        check_unbiased(_biased(fn, pair), x, key=KEY, within=pair)
    with pytest.raises(UnbiasedCheckError, match="outside `within`"):
        check_unbiased(_zeros(fn, pair), x, key=KEY, within=pair, draws=100)
    # A wider range passes a correct rounding (false-fail rate at most RATE), and
    # detects less.
    wide = check_unbiased(fn, x, key=KEY, within=(lower - 1, upper + 1), draws=10_000)
    tight = check_unbiased(fn, x, key=KEY, within=pair, draws=10_000)
    assert wide.passed and np.all(wide.detectable_biases > tight.detectable_biases)


# ---------------------------------------------------------------------------
# What the report says it detects, it detects


@pytest.mark.parametrize("beta", [0.5, 0.1])
@pytest.mark.parametrize("elements", [1, 1000])
@pytest.mark.parametrize("draws", [100, 1000, 10_000])
def test_detectable_bias_is_detected_exactly(draws, elements, beta):
    # Exact binomial probabilities, no sampling: a true P(up) shifted by the
    # detectable bias either way fails an element with probability at least
    # 1 - beta (where the shift stays in [0, 1]). A side on which even the
    # farthest P(up) is caught with less than that counts its whole reach. A
    # quarter of the shift at p = 1/2 fails with much less.
    p = np.array([0.01, 0.1, 0.3, 0.5, 0.9, 0.999])
    shift = detectable_bias(draws, p, elements=elements, false_pass_rate=beta)
    threshold = math.log(2 * elements / 1e-6)
    for pi, si in zip(p, shift):
        for end in (0.0, 1.0):
            truth = pi + si * np.sign(end - pi)
            if 0 < truth < 1:
                assert exact_rate(pi, draws, threshold, truth) >= 1 - beta, truth
            farthest = exact_rate(pi, draws, threshold, abs(end - 1e-12))
            if farthest < 1 - beta:
                assert si >= abs(end - pi)
    assert exact_rate(0.5, draws, threshold, 0.5 + shift[3] / 4) < 0.05


@pytest.mark.slow
def test_detectable_bias_holds_over_keys():
    # One element at p = 0.3, 2000 draws, false-fail rate 1e-3. Shifted by 1.05x
    # the reported detectable bias, each run fails with probability at least 1/2,
    # so fewer than `runs - _most(runs, 1/2)` failures have probability at most
    # RATE. A quarter of it fails each run with probability at most `exact_rate`
    # (exact binomial), and more than `_most` failures, at most RATE again.
    x = jnp.array([0.3])
    pair = (np.zeros(1), np.ones(1))
    kw = dict(neighbours=pair, draws=2000, false_fail_rate=1e-3, raise_on_failure=False)
    report = check_unbiased(integer_sr, x, key=KEY, **kw)
    p = float(x[0])
    assert report.passed and report.elements == 1
    expected = detectable_bias(2000, p, false_fail_rate=1e-3)
    assert report.detectable == pytest.approx(float(expected))
    runs = 200
    for scale, sign in ((1.05, 1), (1.05, -1), (0.25, 1)):
        truth = p + sign * scale * report.detectable

        def shifted(x, key, truth=truth):
            return (jax.random.uniform(key, x.shape) < truth).astype(x.dtype)

        fails = sum(
            not check_unbiased(shifted, x, key=jax.random.fold_in(KEY, r), **kw).passed
            for r in range(runs)
        )
        if scale > 1:
            assert runs - fails <= _most(runs, 0.5), (sign, fails)
        else:
            rate = exact_rate(p, 2000, report.threshold, truth)
            assert rate < 0.1 and fails <= _most(runs, rate), fails


def test_draws_to_detect_bias_inverts_detectable_bias():
    for bias, p, m in ((0.015, 0.5, 1000), (0.03 * 0.1, 0.1, 1), (0.2, 0.5, 1)):
        n = draws_to_detect_bias(bias, p, elements=m)
        assert detectable_bias(n, p, elements=m) <= bias
        assert detectable_bias(n - 1, p, elements=m) > bias
    # It grows as 1 / bias^2.
    assert draws_to_detect_bias(0.005) > 8 * draws_to_detect_bias(0.02)


# ---------------------------------------------------------------------------
# Calibration: a correct rounding fails no more often than stated


def _calibration(rate: float, elements: int, runs: int = 200) -> tuple[int, float]:
    """Failures of `runs` checks of a correct rounding (the benchmark section's
    calibration, small), and the exact rate of the test on that `x`."""
    fn, x, pair = _problem("integers", elements)
    x, pair = x[:elements], (pair[0][:elements], pair[1][:elements])
    row = calibrate(fn, x, pair, runs=runs, draws=1000, rate=rate, key=KEY)
    return row["failures"], row["exact"]


@pytest.mark.slow
def test_calibration():
    # Each run fails with probability at most the stated rate, so more than
    # `_most(runs, rate)` failures in 200 independent runs has probability at most
    # RATE (exact binomial tail). Where the exact rate of the test is large
    # enough to see (one element at a stated 0.5), the count must also agree
    # with it: outside the two-sided binomial interval, probability at most 2 RATE.
    for rate, elements in ((0.1, 64), (0.5, 1)):
        failures, exact = _calibration(rate, elements)
        assert exact <= rate and failures <= _most(200, rate), (rate, failures)
        if rate == 0.5:
            low = 200 - _most(200, 1 - exact)
            assert low <= failures <= _most(200, exact), (failures, exact)


@pytest.mark.slow
def test_calibration_catches_an_overstated_rate(monkeypatch):
    # Planted: a checker whose statistic is 3x too large (as a test that trusted a
    # normal approximation far into the tail might be): it fails a correct
    # rounding far more often than the 0.1 it states, and the count shows it.
    kl = _unbiased._kl
    monkeypatch.setattr(_unbiased, "_kl", lambda a, p: 3 * kl(a, p))
    failures, _ = _calibration(0.1, 64)
    assert failures > _most(200, 0.1)


# ---------------------------------------------------------------------------
# Draws, keys, and the report


@pytest.mark.slow
def test_chunks_do_not_change_the_draws():
    # Draw i has key i whatever the chunk; the padded draws of the last chunk are
    # masked out (13 chunks of 8 hold 104 draws for 100).
    fn, x, pair = _problem("float4_e2m1fn")
    whole = check_unbiased(fn, x, key=KEY, neighbours=pair, draws=100)
    chunked = check_unbiased(fn, x, key=KEY, neighbours=pair, draws=100, chunk=8)
    np.testing.assert_array_equal(whole.means, chunked.means)
    assert whole.statistic == chunked.statistic


@pytest.mark.slow
def test_raw_keys_neighbours_of_x_and_reports_without_raising():
    # False-fail rate at most RATE per passing check.
    fn, x, pair = _problem("integers")
    kw = dict(neighbours=pair, draws=1000)
    assert check_unbiased(fn, x, key=jax.random.PRNGKey(0), **kw).passed
    around = check_unbiased(
        fn, x, key=KEY, draws=1000, neighbours=lambda x: (np.floor(x), np.ceil(x))
    )
    np.testing.assert_array_equal(
        around.means, check_unbiased(fn, x, key=KEY, **kw).means
    )
    report = check_unbiased(
        _always_down(fn, pair), x, key=KEY, raise_on_failure=False, **kw
    )
    assert not report.passed and str(report).startswith("check_unbiased failed: ")
    assert report.p_value == 0.0 and report.statistic > report.threshold


def _fn(x, key):
    return integer_sr(x, key)


X = jnp.array([0.25, 1.0, 2.5])
PAIR = (np.floor(np.asarray(X)), np.ceil(np.asarray(X)))

MISUSE = [
    (dict(fn=1), TypeError, "`fn` must be callable"),
    (dict(x=jnp.array([1, 2])), TypeError, "`x` must be floating point"),
    (dict(x=jnp.zeros((0,))), ValueError, "must have an element"),
    (dict(x=jnp.array([0.5, jnp.nan])), ValueError, r"`x` at index \(1,\) \(=nan\)"),
    (dict(key=0), TypeError, "`key` must be one PRNG key"),
    (dict(key=jax.random.split(KEY, 2)), TypeError, "`key` must be one PRNG key"),
    (dict(bounds=PAIR), ValueError, "at most one of .*got `neighbours` and `bounds`"),
    (dict(within=PAIR), ValueError, "got `neighbours` and `within`"),
    (dict(neighbours=None, bounds=PAIR[0]), TypeError, "`bounds` must be a pair"),
    (dict(neighbours=None, within=(0.0, 1.0)), ValueError, "`within` at index"),
    (dict(neighbours=PAIR[0]), TypeError, "`neighbours` must be a pair"),
    (dict(neighbours=(PAIR[0], np.ones(2))), ValueError, "do not broadcast"),
    (
        dict(neighbours=(PAIR[0] + 1, PAIR[1] + 1)),
        ValueError,
        r"must hold `x` \(=0.25\)",
    ),
    (
        dict(neighbours=(PAIR[0], PAIR[1] + np.float64(1e-9))),
        ValueError,
        "representable",
    ),
    (dict(neighbours=(PAIR[0], np.inf)), ValueError, "finite"),
    (dict(draws=0), ValueError, r"`draws` \(=0\) must be >= 1"),
    (dict(draws=10.0), TypeError, "`draws` must be an int"),
    (dict(false_fail_rate=0.0), ValueError, r"`false_fail_rate` \(=0.0\) must lie"),
    (dict(false_fail_rate="0.1"), TypeError, "`false_fail_rate` must be a float"),
    (dict(false_pass_rate=1.0), ValueError, "`false_pass_rate`"),
    (dict(chunk=0), ValueError, "`chunk`"),
    (dict(fn=lambda x, key: x[:2]), ValueError, "must return one array of `x`'s shape"),
    (dict(fn=lambda x, key: (x, x)), ValueError, "must return one array"),
    (dict(fn=lambda x, key: x > 0), TypeError, "must return real numbers"),
]


@pytest.mark.parametrize("change, error, match", MISUSE)
def test_misuse(change, error, match):
    kw = dict(fn=_fn, x=X, key=KEY, neighbours=PAIR, draws=10)
    kw.update(change)
    with pytest.raises(error, match=f"^`check_unbiased`: .*{match}"):
        check_unbiased(kw.pop("fn"), kw.pop("x"), **kw)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: detectable_bias(0), ValueError, r"`detectable_bias`: `draws` \(=0\)"),
        (lambda: detectable_bias(10, 1.5), ValueError, r"`p` \(=1.5\) must lie"),
        (lambda: detectable_bias(10, elements=0), ValueError, "`elements`"),
        (lambda: draws_to_detect_bias(0.0), ValueError, r"`bias` \(=0.0\) must lie"),
        (lambda: draws_to_detect_bias(0.1, false_fail_rate=2), ValueError, "(0, 1)"),
    ],
)
def test_misuse_of_the_design_helpers(call, error, match):
    with pytest.raises(error, match=match):
        call()
