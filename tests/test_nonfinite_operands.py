"""A NaN or an infinity in an MX operand of a quantised product (issue 41 §5).

`MXQuantize` makes a block with a NaN or an infinity NaN (the specification's NaN
scale), which takes a reduction over every block. Inside a product that reads its
blocks whole (`ops.Operand.whole`: every output that reads one element of a block
reads all of them, as in a `dot_general`, a ragged product, and a convolution's
forward and input-gradient products without feature groups), the product marks
only the non-finite elements NaN (`LowPrecision.encode_operand`), where the codes'
dtype holds a NaN (every format but E2M1): every output that reads the block reads
that NaN, so the values are the same. Checked here, against the explicit
references of `product_references.py` and `test_ragged_dot.py` (the public
quantisers, each block NaN as a whole), on operands and cotangents each with a
NaN, a +inf and a -inf, for the value and both cotangents, jitted: NaN exactly
where the reference is, and elsewhere within the float32 summation bound.

Planted beside them, each caught: a convolution's weight gradient claimed to read
its blocks whole (each kernel position reads a window of the positions its blocks
run along); a convolution in feature groups that a block of channels straddles,
claimed whole; an infinity left a code (not a NaN); and an E2M1 operand marked
by its elements, whose codes' dtype has no NaN (a residual loses it).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import product_references
import pytest
import test_ragged_dot as ragged
from lowp_helpers import data
from product_references import (
    CONV_CASES,
    DOT_CASES,
    conv_failures,
    dot_failures,
    far,
)

import eqxrules
from eqxrules import recipes
from eqxrules._lowp import ops
from eqxrules._lowp.recipes import Custom, Product
from eqxrules._rules import _encoded, blocks

KIND = "nonfinite"
_SR = eqxrules.MXQuantize(
    format="e4m3", block_size=32, rounding="stochastic", scale_rounding="floor"
)
# Every element format's path: E4M3 (`mxfp8()`); E3M2 (FP6, its codes in the E5M2
# dtype) and E5M2; the floor rule with stochastic rounding; and E2M1 (`mxfp4()`,
# whose codes' dtype has no NaN: each block tested as a whole still).
RECIPES = {
    "mxfp8": recipes.mxfp8(),
    "mxfp6_e5m2": recipes.MXFP8(format="e3m2", gradient_format="e5m2"),
    "mx_floor_stochastic": Custom(
        fwd=Product(_SR, _SR), dx=Product(_SR, _SR), dw=Product(_SR, _SR)
    ),
    "mxfp4": recipes.mxfp4(),
}
# A convolution takes no random Hadamard transform.
CONV_RECIPES = {
    **RECIPES,
    "mxfp4": dataclasses.replace(recipes.mxfp4(), hadamard=None),
}
# 4 feature groups of 32 input and 16 output features: a block of 32 output
# features (the input gradient's) straddles two groups.
GROUPS_OF_16 = (
    (2, 128, 6),
    (64, 32, 3),
    (1,),
    "SAME",
    (None, None),
    None,
    4,
    {"fwd": ((1,), (1,)), "dx": ((1,), (0,)), "dw": ((0, 2), (0, 2))},
)
CONVS = {**CONV_CASES, "1d_groups_of_16": GROUPS_OF_16}


@pytest.fixture
def conv_cases(monkeypatch):
    """`product_references.CONV_CASES` with the case of feature groups that a
    block straddles, for this test only (added at run time, not at collection, so
    that other modules collect their own cases)."""
    monkeypatch.setitem(product_references.CONV_CASES, "1d_groups_of_16", GROUPS_OF_16)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("case", list(DOT_CASES))
def test_dot_general_products_with_nonfinite_operands(case, recipe):
    assert dot_failures(RECIPES[recipe], case, KIND, jit=True) == {}


@pytest.mark.first_case_quick
@pytest.mark.parametrize("recipe", list(CONV_RECIPES))
@pytest.mark.parametrize("case", list(CONVS))
def test_conv_products_with_nonfinite_operands(conv_cases, case, recipe):
    assert conv_failures(CONV_RECIPES[recipe], case, KIND, jit=True) == {}


def _ragged_failures(recipe, sizes) -> dict[str, int]:
    """`test_ragged_dot`'s comparison with its loop over groups, on rows and a
    cotangent with non-finite elements: NaN where the reference is NaN, elsewhere
    within its bound, computed from the finite elements (an output that reads none
    of the non-finite ones has its terms among them). The groups' matrices are
    finite: on the CPU `lax.ragged_dot` itself (jaxlib 0.10) gives every row a
    NaN from a NaN or an infinity in any group's matrix (it sums the groups'
    masked products), which no loop over groups does."""
    lhs = jnp.asarray(data(KIND, (ragged.M, ragged.K), 0))
    dy = jnp.asarray(data(KIND, (ragged.M, ragged.N), 2))
    rhs = jnp.asarray(data("random", (ragged.G, ragged.K, ragged.N), 1))
    gs = jnp.asarray(sizes, jnp.int32)

    def vjp(a, b, g, sizes, key):
        def f(a, b):
            return eqxrules.quantized_ragged_dot(a, b, sizes, recipe=recipe, key=key)

        y, pull = jax.vjp(f, a, b)
        return (y, *pull(g))

    got = jax.jit(vjp)(lhs, rhs, dy, gs, ragged.KEY)
    want = eqx.filter_jit(ragged.reference)(recipe, lhs, rhs, sizes, dy, ragged.KEY)
    finite = [
        jnp.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0) for v in (lhs, rhs, dy)
    ]
    bounds = ragged._bound(finite[0], finite[1], sizes, finite[2])
    out = {}
    for name, g, w, b in zip(("y", "dlhs", "drhs"), got, want, bounds):
        bad = far(g, w, b)
        if bad:
            out[name] = bad
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sizes", list(ragged.SIZES))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_ragged_products_with_nonfinite_operands(recipe, sizes):
    assert _ragged_failures(RECIPES[recipe], ragged.SIZES[sizes]) == {}


def test_the_reference_has_nans_and_finite_outputs():
    """The data can tell the two markings apart: the reference's value and
    cotangents each have NaN outputs and finite ones."""
    case = "2d"
    lhs_shape, rhs_shape, *_, blocked = CONV_CASES[case]
    conv, _ = product_references.conv_of(case)
    lhs, rhs = product_references.data_of((lhs_shape, rhs_shape), KIND)
    dy = product_references.data_of(
        [product_references.out_shape(conv, lhs, rhs)], KIND
    )[0]
    spec = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, None)
    square = (spec.rhs_spec[0], spec.rhs_spec[1])
    out = eqx.filter_jit(product_references.conv_reference)(
        recipes.mxfp8(), lhs, rhs, dy, conv, blocked, square, None
    )
    for v in out:
        nan = np.isnan(np.asarray(v))
        assert nan.any() and not nan.all()


@pytest.mark.first_case_quick
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_the_parts_differ_from_encode_only_at_nonfinite_blocks(fmt):
    """`encode_operand` against `encode`: the same codes and exponents in every
    finite block; in a block with a NaN or an infinity, a NaN code exactly at
    those elements (E2M1: `encode`'s parts, whose codes' dtype has no NaN)."""
    q = eqxrules.MXQuantize(format=fmt, block_size=32, scale_rounding="ceil")
    x = jnp.asarray(data(KIND, (8, 96), 0))
    e, o = jax.jit(q.encode)(x), jax.jit(q.encode_operand)(x)
    blocks_of = np.asarray(x).reshape(8, 3, 32)
    finite = np.isfinite(blocks_of).all(axis=-1, keepdims=True)
    codes, scales = np.asarray(e.codes), np.asarray(e.scales)
    o_codes, o_scales = np.asarray(o.codes), np.asarray(o.scales)
    if fmt == "e2m1":
        assert np.array_equal(o_codes, codes) and np.array_equal(o_scales, scales)
        return
    assert not finite.all()
    assert np.array_equal(np.where(finite, o_codes, 0), np.where(finite, codes, 0))
    assert np.array_equal(np.where(finite, o_scales, 0), np.where(finite, scales, 0))
    assert np.array_equal(np.isnan(o_codes), ~np.isfinite(blocks_of))
    # The stored parts keep the NaN codes (the residuals' dtypes).
    kept = q.restored(q.stored(o))
    assert np.array_equal(np.isnan(np.asarray(kept.codes)), np.isnan(o_codes))


# Planted defects.


@pytest.fixture
def planted(fresh_products):
    """`fresh_products`, with JAX's caches cleared too (a quantiser's own `jit`)."""
    jax.clear_caches()
    yield fresh_products
    jax.clear_caches()


def test_planted_conv_weight_gradient_claimed_whole_is_caught(planted, conv_cases):
    honest = ops.Conv.transposed_operands

    def claimed(self, role):
        return tuple(o._replace(whole=True) for o in honest(self, role))

    planted.setattr(ops.Conv, "transposed_operands", claimed)
    failures = conv_failures(RECIPES["mxfp8"], "2d", KIND, jit=True)
    assert set(failures) == {"dw"}


@pytest.mark.slow
def test_planted_input_gradient_in_feature_groups_claimed_whole_is_caught(
    planted, conv_cases
):
    honest = ops.Conv.transposed_operands

    def claimed(self, role):
        out = honest(self, role)
        return tuple(o._replace(whole=True) for o in out) if role == "dx" else out

    planted.setattr(ops.Conv, "transposed_operands", claimed)
    failures = conv_failures(RECIPES["mxfp8"], "1d_groups_of_16", KIND, jit=True)
    assert set(failures) == {"dx"}


def _nan_only(b, q):
    """The defect: a NaN element made a NaN code, an infinite one left a code."""
    return jnp.where(jnp.isnan(b), jnp.nan, q)


def test_planted_infinity_left_a_code_is_caught(planted):
    planted.setattr(blocks, "_nan_elements", _nan_only)
    assert dot_failures(RECIPES["mxfp8"], "matmul", KIND, jit=True) != {}


@pytest.mark.slow
def test_planted_infinity_left_a_code_is_caught_in_a_ragged_product(planted):
    planted.setattr(blocks, "_nan_elements", _nan_only)
    assert _ragged_failures(RECIPES["mxfp8"], ragged.SIZES["uneven"]) != {}


@pytest.mark.slow
def test_planted_e2m1_marked_by_its_elements_is_caught(planted):
    """Its residual (the weight gradient's `a`, kept in `float4_e2m1fn`) loses the
    NaN codes."""
    honest = _encoded.code_dtype
    planted.setattr(
        blocks,
        "holds_nan",
        lambda fmt: fmt == "e2m1" or honest(fmt) == honest(fmt, True),
    )
    recipe = CONV_RECIPES["mxfp4"]
    assert dot_failures(recipe, "matmul", KIND, jit=True) != {}
