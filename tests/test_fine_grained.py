"""The quantisers of the field's recipes (issue 41 §3) against NumPy written from
their statements (`block_references.py`), bit for bit, on random, heavy-tailed,
multi-scale, zero, tiny, power-of-two, NaN and inf matrices:

- `BlockFloatQuantize`: a float32 scale amax/M per 1xB tile (along either axis)
  or BxB block;
- `RowFloatQuantize`: a power-of-two scale 2^ceil(log2(amax/M)) per row;
- `MXQuantize(scale_rounding="ceil")` beside the OCP floor rule;
- `NVFP4Quantize(four_over_six=True)`: each block scaled to 4 or 6, whichever has
  the lower squared error, under a tensor scale of amax/(256·6).

Planted beside the checks: a scale rounded the other way (floor for ceil), tiles
reduced along the wrong axis, Four Over Six under the plain tensor scale (448),
and each rule checked against another's reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from block_references import block_float, cases, mismatches, nvfp4, pow2

import eqxrules
from eqxrules._rules import blocks, fine_grained, nvfp4 as nvfp4_module
from eqxrules._rules._formats import FORMATS


@pytest.fixture
def retraced(monkeypatch):
    """`monkeypatch`, with JAX's caches cleared before and after the test, so that
    a patched helper is traced (an equal quantiser's `jit` would reuse its
    trace) and no patched trace outlives the test."""
    jax.clear_caches()
    yield monkeypatch
    jax.clear_caches()


def _run(q, x):
    return np.asarray(jax.jit(q)(jnp.asarray(x)), np.float32)


def _block_float_mismatches(fmt, size, axis, dtype=np.float32) -> dict[str, int]:
    q = eqxrules.BlockFloatQuantize(format=fmt, block_size=size, axis=axis)
    out = {}
    for name, x in cases(size).items():
        x = x.astype(dtype)
        got = jax.jit(q)(jnp.asarray(x))
        assert got.dtype == x.dtype
        want = block_float(x.astype(np.float32), fmt, size, axis)
        bad = mismatches(np.asarray(got, np.float32), want.astype(dtype))
        if bad:
            out[name] = bad
    return out


@pytest.mark.first_case_quick
@pytest.mark.parametrize("axis", [-1, 0, (0, 1)])
@pytest.mark.parametrize("fmt, size", [("e4m3", 16), ("e5m2", 4), ("e4m3", 128)])
def test_block_float_equals_the_numpy_rule(fmt, size, axis):
    assert _block_float_mismatches(fmt, size, axis) == {}


def test_block_float_in_bfloat16_equals_the_numpy_rule():
    assert _block_float_mismatches("e4m3", 16, -1, ml_dtypes.bfloat16) == {}


def test_planted_tiles_along_the_wrong_axis_are_caught(retraced):
    """The defect: each scale taken over the tiles' index along the blocked axis
    (across tiles) instead of within a tile."""
    retraced.setattr(fine_grained, "_within", lambda axis, ndim: (axis % ndim,))
    assert _block_float_mismatches("e4m3", 16, -1) != {}


def _pow2_mismatches(q, rule: str, size: int) -> dict[str, int]:
    """`q` against the power-of-two rule `rule` with tiles of `size` along
    `q.axis` (a row: the whole axis): its values, and its codes, each a value of
    its format (a scale too small leaves the value on the grid scaled from it,
    but its largest codes beyond the format's largest: `name codes`)."""
    out = {}
    dtype = getattr(ml_dtypes, FORMATS[q.format].dtype)
    for name, x in cases(16).items():
        length = x.shape[q.axis] if size == 0 else size
        bad = mismatches(_run(q, x), pow2(x, q.format, length, q.axis, rule))
        if bad:
            out[name] = bad
        codes = np.asarray(jax.jit(q.encode)(jnp.asarray(x)).codes, np.float32)
        outside = int(np.sum(codes.astype(dtype).astype(np.float32) != codes))
        if outside:
            out[f"{name} codes"] = outside
    return out


@pytest.mark.first_case_quick
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_row_float_equals_the_numpy_rule(fmt, axis):
    q = eqxrules.RowFloatQuantize(format=fmt, axis=axis)
    assert _pow2_mismatches(q, "ceil", 0) == {}


@pytest.mark.first_case_quick
@pytest.mark.parametrize("rule", ["ceil", "floor"])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_mx_scale_rounding_equals_the_numpy_rule(fmt, axis, rule):
    q = eqxrules.MXQuantize(format=fmt, block_size=16, axis=axis, scale_rounding=rule)
    assert _pow2_mismatches(q, rule, 16) == {}


def test_the_ceil_rule_saturates_nothing_and_is_floor_unless_floor_saturates():
    """Where the floor rule puts no element beyond ±M the two rules are the same
    scale; where it does (amax's significand above M's), ceil doubles it."""
    x = jnp.asarray(cases(32)["random"])
    floor = eqxrules.MXQuantize(format="e4m3", axis=-1, scale_rounding="floor")
    ceil = eqxrules.MXQuantize(format="e4m3", axis=-1, scale_rounding="ceil")
    k_floor, k_ceil = floor.encode(x).scales, ceil.encode(x).scales
    blocked = np.asarray(x).reshape(x.shape[0], -1, 32)
    top = np.max(np.abs(blocked), axis=-1, keepdims=True)
    saturates = top / np.exp2(np.asarray(k_floor, np.float64)) > 448
    assert saturates.any() and not saturates.all()
    np.testing.assert_array_equal(k_ceil, np.asarray(k_floor) + saturates)
    assert np.all(top / np.exp2(np.asarray(k_ceil, np.float64)) <= 448)


def test_planted_scale_rounded_the_other_way_is_caught(retraced):
    """The defect: `ceil` rounding down (the floor rule's exponent, as a rule that
    forgets to round up gives it). Caught for row-wise and MX scales."""
    floor = blocks._scale_exponent
    retraced.setattr(
        blocks, "_scale_exponent", lambda top, fmt, rounding: floor(top, fmt, "floor")
    )
    row = eqxrules.RowFloatQuantize()
    mx = eqxrules.MXQuantize(format="e4m3", block_size=16, scale_rounding="ceil")
    assert _pow2_mismatches(row, "ceil", 0) != {}
    assert _pow2_mismatches(mx, "ceil", 16) != {}


def _nvfp4_mismatches(q, four_over_six: bool) -> dict[str, int]:
    out = {}
    for name, x in cases(16).items():
        if name == "tiny":  # its tensor scale is subnormal: flushed by XLA
            continue
        bad = mismatches(_run(q, x), nvfp4(x, q.axis, four_over_six))
        if bad:
            out[name] = bad
    return out


@pytest.mark.first_case_quick
@pytest.mark.parametrize("axis", [-1, 0, (0, 1)])
def test_four_over_six_equals_the_numpy_rule(axis):
    q = eqxrules.NVFP4Quantize(axis=axis, four_over_six=True)
    assert _nvfp4_mismatches(q, True) == {}


def test_each_nvfp4_rule_fails_the_others_reference():
    """The check tells the two rules apart: plain NVFP4 against the 4/6 reference,
    and 4/6 against the plain one."""
    plain = eqxrules.NVFP4Quantize()
    four_six = eqxrules.NVFP4Quantize(four_over_six=True)
    assert _nvfp4_mismatches(plain, True) != {}
    assert _nvfp4_mismatches(four_six, False) != {}


def test_planted_four_over_six_under_the_plain_tensor_scale_is_caught(retraced):
    """The defect: 4/6 under the plain tensor scale (448·6), where the largest
    blocks' scale to 4 would be 672 and is clipped to 448."""
    retraced.setattr(nvfp4_module, "_ROOM", {False: 448.0, True: 448.0})
    assert _nvfp4_mismatches(eqxrules.NVFP4Quantize(four_over_six=True), True) != {}


@pytest.mark.slow  # the quick tier's 4 minutes
def test_four_over_six_errs_less_on_gaussian_blocks():
    """The reason for the option: less squared error than NVFP4 on Gaussian data
    (the issue measured about 16% less; here at least 5%, over 4096 blocks)."""
    x = jax.random.normal(jax.random.key(0), (256, 256))
    mse = {
        four_over_six: float(
            jnp.mean((eqxrules.NVFP4Quantize(four_over_six=four_over_six)(x) - x) ** 2)
        )
        for four_over_six in (False, True)
    }
    assert mse[True] < 0.95 * mse[False], mse
