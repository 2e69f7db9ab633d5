"""`mx_quantize` at the top of float32 (issue 40 §3): a block whose largest
magnitude is at least $2^{127}$ quantises to finite values, by the OCP rule (the
shared exponent $\\lfloor \\log_2 a \\rfloor - e_\\max$, at most 127), in every element
format, rounding to nearest or stochastically. Main gave `inf` there
(`mx_quantize(jnp.full((32,), 1.8e38))`): the scale was applied as
$q \\cdot 2^{k+1} / 2$, whose first product overflows. The truth is
`tests/test_float_formats.py`'s NumPy rule (float32 arithmetic, `ml_dtypes`
casts); a planted defect, that product again, is caught beside the check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_float_formats import MAX, numpy_mx

import eqxrules
from eqxrules._rules import blocks
from eqxrules._rules._formats import pow2

F32 = np.float32
AMAX = (1.8e38, 3e38)  # 2^127 ≈ 1.70e38; float32's largest ≈ 3.40e38


def _top_rows(amax: float) -> np.ndarray:
    """Rows of one block of 32 whose largest magnitude is `amax`: all equal (the
    issue's case), and random values below it with `-amax` last."""
    rng = np.random.default_rng(0)
    spread = (rng.uniform(-1, 1, 32) * amax).astype(F32)
    spread[-1] = -F32(amax)
    return np.stack([np.full(32, amax, F32), spread])


def _mismatches(fmt: str, amax: float) -> list[str]:
    """What differs from the OCP rule at the top: `mx_quantize` and the rule's own
    reference against the NumPy rule, bit for bit; a stochastic rounding that is
    not finite."""
    x = _top_rows(amax)
    want = numpy_mx(x, fmt, 32, -1)
    assert np.all(np.isfinite(want)), "the NumPy rule itself must be finite here"
    rule = eqxrules.MXQuantize(format=fmt)
    found = []
    got = np.asarray(jax.jit(lambda x: eqxrules.mx_quantize(x, format=fmt))(x))
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        found.append("mx_quantize")
    reference = np.asarray(rule.reference_forward(jnp.asarray(x)))
    if not np.array_equal(reference.view(np.uint32), want.view(np.uint32)):
        found.append("reference_forward")
    stochastic = eqxrules.MXQuantize(format=fmt, rounding="stochastic")
    drawn = jax.jit(lambda x, k: stochastic(x, key=k))(x, jax.random.key(0))
    if not bool(jnp.all(jnp.isfinite(drawn))):
        found.append("stochastic")
    return found


@pytest.mark.first_case_quick
@pytest.mark.parametrize("amax", AMAX)
@pytest.mark.parametrize("fmt", list(MAX))
def test_mx_at_the_top_of_float32_is_the_ocp_rule(fmt, amax):
    assert _mismatches(fmt, amax) == []


def test_the_issue_case_is_256_times_2_to_the_119():
    """The value the issue computed by hand: 1.8e38 in MXFP8 (e4m3, emax 8) has
    the scale $2^{127 - 8}$, and 1.8e38 / 2^119 ≈ 270.8 rounds to 256."""
    got = eqxrules.mx_quantize(jnp.full((32,), 1.8e38), format="e4m3")
    assert np.all(np.asarray(got) == F32(256 * 2.0**119))


def test_planted_overflowing_scale_is_caught(monkeypatch):
    """Planted: main's `q·2^(k+1)·0.5`, infinite wherever `q·2^(k+1)` passes
    float32's largest value; the reference (its own arithmetic) stays right."""
    overflowing = lambda q, k: q * pow2(k + 1) * 0.5  # noqa: E731
    monkeypatch.setattr(blocks, "_times_pow2", overflowing)
    assert _mismatches("e4m3", 1.8e38) == ["mx_quantize", "stochastic"]
    assert _mismatches("e2m1", 3e38) == ["mx_quantize", "stochastic"]
