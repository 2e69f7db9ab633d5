"""Every stochastic rounding of the catalogue is unbiased, by
`eqxrules.testing.check_unbiased` (issue 19 sections 1 and 2).

Which examples: every catalogue example whose `needs_key()` is true and that
declares the values it rounds onto, `neighbours(x)` (lower and upper, equal where
`x` is one of them), derived from the rules as data, never from their names: the
stochastic `float_quantize`, `mx_quantize`, `nvfp4_quantize`, `ste_quantize` and
`dorefa_quantize` examples and `stochastic_round` today, and any rule that declares
the same later. (A rule that draws random numbers for another purpose, such as
`gumbel_softmax`, declares no neighbours.)

Each is drawn 100,000 times at false-fail rate 1e-6 on inputs from its domain (2048
for an elementwise rule), the kinks included exactly; elements outside the range it rounds in (where it
saturates, or, in a block-scaled format, where a block's largest element is clipped
to the format's largest value) are left out: there its neighbours do not hold `x`,
and it is not meant to be unbiased. A planted biased variant of a real rule fails.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ENTRIES, examples

import eqxrules
from eqxrules._rules._formats import RESOLUTION
from eqxrules._rules._stochastic import stochastic_quantize
from eqxrules.testing import UnbiasedReport, check_unbiased

DRAWS = 100_000
RATE = 1e-6


def rounds_stochastically(rule: eqxrules.Rule) -> bool:
    """Whether `rule` draws random numbers and declares the two values it rounds
    each element onto."""
    return rule.needs_key() and callable(getattr(rule, "neighbours", None))


CASES = [
    pytest.param(rule, id=f"{entry.name}-{i}")
    for entry in ENTRIES
    for i, rule in enumerate(examples(entry))
    if rounds_stochastically(rule)
]


def check_example(rule: eqxrules.Rule, seed: int = 0) -> UnbiasedReport:
    """`check_unbiased` on `rule`, on a sample of its domain with every kink, over
    the elements its neighbours hold (for an elementwise rule, those of 2048)."""
    domain = rule.input_domain()
    if rule.elementwise:
        domain = dataclasses.replace(domain, shape=(2048,))
    x = domain.sample(jax.random.key(seed), off_kinks=False)
    lower, upper = (np.asarray(v, np.float64) for v in rule.neighbours(x))
    host = np.asarray(x, np.float64)
    held = (lower <= host) & (host <= upper)
    assert held.sum() >= 64, (rule, int(held.sum()))

    def draw(x_held, key):
        if rule.elementwise:
            return rule(x_held, key=key)
        return rule(x, key=key)[held]  # the whole input, read where held

    return check_unbiased(
        draw,
        x[held],
        key=jax.random.key(seed + 1),
        neighbours=(lower[held], upper[held]),
        draws=DRAWS,
        false_fail_rate=RATE,
    )


def test_the_examples_are_found_from_the_catalogue():
    """The set is data: it holds every rule class that declares neighbours, and
    grows with any that does (a user's subclass included), by `needs_key`."""
    classes = {type(p.values[0]).__name__ for p in CASES}
    assert classes >= {"FloatQuantize", "MXQuantize", "NVFP4Quantize", "SteQuantize"}
    assert classes >= {"DoReFa", "StochasticRound"}
    assert not any(type(p.values[0]).__name__ == "GumbelSoftmax" for p in CASES)
    assert not rounds_stochastically(eqxrules.SteQuantize())  # rounds to nearest


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("rule", CASES)
def test_every_stochastic_rounding_in_the_catalogue_is_unbiased(rule):
    report = check_example(rule)
    assert report.passed and report.draws == DRAWS and report.elements > 0
    assert report.detectable < 0.02  # what a bias must exceed to be seen


class _Biased(eqxrules.SteQuantize):
    """Planted: the real rule with 3% of its random range shifted towards stepping
    (a 3% bias, of the kind of oneDNN #2903's "almost always rounds down")."""

    def _with_bits(self, x, bits, resolution=RESOLUTION):
        if bits is None:
            return super()._with_bits(x, bits)
        shift = jnp.uint32(0.03 * 2**32)
        shifted = jnp.where(bits < shift, 0, bits - shift).astype(jnp.uint32)
        return stochastic_quantize(x, *self._grid(), self.slope(x), shifted)


class _NearestFloat(eqxrules.FloatQuantize):
    """Planted: rounds to nearest whatever `rounding` says (qwix's bug)."""

    def primal(self, x, *, key=None):
        return self._with_bits(x, None)


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize(
    "defect",
    [
        _Biased(bits=3, lo=-0.3, hi=0.7, rounding="stochastic"),
        _NearestFloat(format="e4m3", scale=3.0, rounding="stochastic"),
    ],
    ids=["biased-ste_quantize", "nearest-float_quantize"],
)
def test_planted_biased_variants_of_real_rules_fail(defect):
    assert rounds_stochastically(defect)
    with pytest.raises(AssertionError, match="check_unbiased"):
        check_example(defect)
