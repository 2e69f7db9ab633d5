"""`quantized_dot_general`, `quantized_einsum` and `quantized_conv` against their
statements (issue 26 §1, §5).

- Each product (the value and both cotangents) equals an explicit reference built
  here from the public quantisers (`dataclasses.replace(q, axis=...)`) and the plain
  `lax` operation and its VJP, each operand blocked along the dimensions the table
  below lists for it (written out per case, not derived by the library's code),
  for the identity, `fp8()`, `mxfp8()` and `nvfp4()` recipes, eager and jitted, on
  random and adversarial data. The products agree within twice Higham's float32
  summation bound (two float32 sums of the same quantised terms, in whatever
  order), which any different quantised operand leaves far behind.
- With the identity recipe, value and cotangents equal `lax.dot_general`'s and
  `lax.conv_general_dilated`'s bit for bit.
- Planted defects beside the checks: blocks along the wrong dimension; the
  input-gradient product reusing the forward's blocking of the kernel; padding that
  is missing or non-zero; a convolution's weight gradient blocked with the batch
  dimension last.

The references and the cases are in `product_references.py`; `vmap` and
`axis_name` in `test_batching.py`; bad input in `test_quantized_products_misuse.py`.
"""

from __future__ import annotations

import dataclasses
import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowp_helpers import gamma, two_orders
from product_references import (
    CONV_CASES,
    CONV_RECIPES,
    DOT_CASES,
    KINDS,
    RECIPES,
    U32,
    conv_failures,
    conv_failures_of,
    conv_of,
    data_of,
    dot_call,
    dot_failures,
    dot_failures_of,
    out_shape,
    vjp,
)

import eqxrules
from eqxrules import recipes
from eqxrules._lowp import ops

# Every case jitted; eagerly (op by op, one compiled program per product), the
# first case of each family, every recipe.
HIGHEST = jax.lax.Precision.HIGHEST
_DOT_RUNS = [
    (case, recipe, jit)
    for jit in (True, False)
    for case in (DOT_CASES if jit else ["matmul"])
    for recipe in [r for r in RECIPES if r != "identity"]
]
_CONV_RUNS = [
    (case, recipe, jit)
    for jit in (True, False)
    for case in (CONV_CASES if jit else ["2d"])
    for recipe in [r for r in CONV_RECIPES if r != "identity"]
]


@pytest.mark.first_case_quick
@pytest.mark.parametrize("case, recipe, jit", _DOT_RUNS)
def test_dot_general_products_equal_the_reference(case, recipe, jit):
    kinds = KINDS if jit else ("random",)
    failures = dot_failures_of(RECIPES[recipe], case, kinds, jit=jit)
    assert failures == dict.fromkeys(kinds, {})


@pytest.mark.first_case_quick
@pytest.mark.parametrize("case, recipe, jit", _CONV_RUNS)
def test_conv_products_equal_the_reference(case, recipe, jit):
    kinds = KINDS if jit else ("random",)
    r = CONV_RECIPES[recipe]
    failures = conv_failures_of(r, case, kinds, jit=jit)
    assert failures == dict.fromkeys(kinds, {})


def _in_float32(f):
    """`f` on float32 copies of its operands, rounded once to their dtype: for
    bfloat16, `lax`'s operation where XLA accumulates in float32, as the core
    does. (On the CPU, jaxlib 0.12 accumulates a bfloat16 `dot` whose operand it
    first transposes, a batch dimension not leading, in bfloat16, rounding after
    every term: issue 40. For float32 this is `f` itself.)"""

    def g(a, b):
        return f(a.astype(jnp.float32), b.astype(jnp.float32)).astype(a.dtype)

    return g


# A bfloat16 output's unit roundoff: each side rounds its float32 sum once.
_U_BF16 = 2.0**-8


def _apart(got, want, magnitudes, n) -> bool:
    """Whether `got` and `want`, two evaluations of the same exact terms, are
    further apart than two float32 sums in different orders may be
    (`two_orders`), plus, for a bfloat16 output, each side's own rounding to it."""
    got, want = (np.asarray(v, np.float64) for v in (got, want))
    bound = two_orders(magnitudes, n)
    if magnitudes.dtype == jnp.bfloat16:
        bound = bound * (1 + _U_BF16) + _U_BF16 * (np.abs(got) + np.abs(want))
    return bool(np.any(np.abs(got - want) > bound))


def _identity_mismatches(recipe, jit, conv=True, bounded=None):
    """The cases (and dtypes) where `recipe`'s products, value and cotangents, are
    not `lax`'s bit for bit (in float32; for bfloat16, as `_in_float32` says), at
    `Precision.HIGHEST`, which the products name for float32 operands (a GPU's
    default is TF32; the CPU's is float32 itself).

    Bit for bit on the CPU. Elsewhere (`bounded`, by default off the CPU) within
    the bound of two float32 summation orders of the same terms (`_apart`): a GPU
    chooses its GEMM and convolution algorithms per program, and the library's
    product and `lax`'s are two programs (on an H200 with autotuning, the jitted
    `2d` convolution differed in its last bits)."""
    run = jax.jit(vjp, static_argnums=0) if jit else vjp
    if bounded is None:
        bounded = jax.default_backend() != "cpu"

    def differ(got, want, f, args):
        if not bounded:
            return not all(np.array_equal(g, w) for g, w in zip(got, want))
        n = sum(a.size for a in args[:2])
        magnitudes = run(f, *(jnp.abs(a) for a in args))
        return any(_apart(g, w, m, n) for g, w, m in zip(got, want, magnitudes))

    mismatched = []
    for name, (ls, rs, dn, _) in DOT_CASES.items():
        lhs, rhs = data_of((ls, rs), "random")
        plain = ft.partial(jax.lax.dot_general, dimension_numbers=dn, precision=HIGHEST)
        dy = data_of([out_shape(plain, lhs, rhs)], "random")[0]
        for dtype in (jnp.float32, jnp.bfloat16):
            args = [v.astype(dtype) for v in (lhs, rhs, dy)]
            got = run(dot_call(recipe, dn, None), *args)
            want = run(_in_float32(plain), *args)
            if differ(got, want, _in_float32(plain), args):
                mismatched.append((name, dtype))
    for name in CONV_CASES if conv else ():
        conv_, quantized = conv_of(name)
        lhs, rhs = data_of(CONV_CASES[name][:2], "random")
        dy = data_of([out_shape(conv_, lhs, rhs)], "random")[0]
        got = run(quantized(recipe, None), lhs, rhs, dy)
        want = run(conv_, lhs, rhs, dy)
        if differ(got, want, conv_, (lhs, rhs, dy)):
            mismatched.append(name)
    return mismatched


@pytest.mark.first_case_quick
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_the_identity_recipe_is_lax_bit_for_bit(jit):
    assert _identity_mismatches(recipes.identity(), jit) == []


def test_planted_rounding_in_the_identity_recipe_is_caught():
    """Planted: the weight gradient's cotangent rounded (to e5m2), in float32 and
    bfloat16 alike."""
    product = recipes.Product(rhs=eqxrules.FloatQuantize(format="e5m2"))
    planted = recipes.Custom(dw=product)
    dtypes = (jnp.float32, jnp.bfloat16)
    want = [(name, dtype) for name in DOT_CASES for dtype in dtypes]
    assert _identity_mismatches(planted, jit=True, conv=False) == want


@pytest.mark.slow  # 10 s
def test_the_summation_bound_holds_here_and_catches_a_rounding():
    """The comparison other backends take (`bounded`), on this one: the identity
    recipe is within it of `lax` everywhere, and the planted e5m2 rounding of the
    weight gradient's cotangent is outside it in every case and dtype."""
    assert _identity_mismatches(recipes.identity(), jit=True, bounded=True) == []
    product = recipes.Product(rhs=eqxrules.FloatQuantize(format="e5m2"))
    planted = recipes.Custom(dw=product)
    dtypes = (jnp.float32, jnp.bfloat16)
    want = [(name, dtype) for name in DOT_CASES for dtype in dtypes]
    got = _identity_mismatches(planted, jit=True, conv=False, bounded=True)
    assert got == want


def test_einsum_is_dot_general_transposed():
    q, k = data_of(((2, 4, 16, 32), (2, 4, 16, 32)), "random")
    p, v = data_of(((2, 4, 16, 16), (2, 4, 16, 32)), "random")
    r = recipes.mxfp8()
    scores = eqxrules.quantized_einsum("bhqd,bhkd->bhqk", q, k, recipe=r)
    general = eqxrules.quantized_dot_general(
        q, k, (((3,), (3,)), ((0, 1), (0, 1))), recipe=r
    )
    assert np.array_equal(scores, general)
    # The output in another order than dot_general's: a transpose of it.
    out = eqxrules.quantized_einsum("bhqk,bhkd->bdhq", p, v, recipe=r)
    general = eqxrules.quantized_dot_general(
        p, v, (((3,), (2,)), ((0, 1), (0, 1))), recipe=r
    )
    assert np.array_equal(out, jnp.transpose(general, (0, 3, 1, 2)))
    # The identity recipe: jnp.einsum within float32 summation bounds.
    ident = eqxrules.quantized_einsum(
        "bhqk,bhkd->bdhq", p, v, recipe=recipes.identity()
    )
    want = jnp.einsum("bhqk,bhkd->bdhq", p, v, precision=HIGHEST)
    bound = 2 * gamma(16, U32) * jnp.einsum("bhqk,bhkd->bdhq", jnp.abs(p), jnp.abs(v))
    assert bool(jnp.all(jnp.abs(ident - want) <= bound))


# Planted defects: each must make the check above fail.


class _NextAxis(eqxrules.MXQuantize):
    """MX blocks along the axis after the one asked for (cyclically)."""

    def for_reduction_axis(self, axis, length, where):
        return dataclasses.replace(self, axis=axis - 1)


@pytest.mark.slow
def test_planted_blocks_along_the_wrong_dimension_are_caught():
    wrong = _NextAxis(format="e4m3", block_size=32)
    product = recipes.Product(wrong, wrong)
    planted = recipes.Custom(fwd=product, dx=product, dw=product)
    honest = recipes.mxfp8()
    assert set(dot_failures(honest, "matmul", "random", jit=True, run=planted)) == {
        "y",
        "dx",
        "dw",
    }


@pytest.fixture
def planted(fresh_products):
    """`monkeypatch`, the core's products traced again (`fresh_products`)."""
    return fresh_products


@pytest.mark.slow
def test_planted_forward_blocking_in_the_input_gradient_is_caught(planted):
    """The input-gradient product's kernel blocked along the input features (as
    the forward's), where the recipe says along the output features."""
    honest = ops.Conv.transposed_operands

    def forward_kernel(self, role):
        lhs, rhs = honest(self, role)
        return (lhs, self.operands()[1]) if role == "dx" else (lhs, rhs)

    planted.setattr(ops.Conv, "transposed_operands", forward_kernel)
    failures = conv_failures(
        recipes.MXFP8(scale_rounding="floor"), "2d", "random", jit=True
    )
    assert set(failures) == {"dx"}  # the input cotangent


@pytest.mark.slow
def test_planted_batch_last_in_the_conv_weight_gradient_is_caught(planted):
    """The weight-gradient blocks with the batch flattened last, across the batch
    dimension numbers' order."""
    honest = ops.Conv.transposed_operands

    def batch_last(self, role):
        lhs, rhs = honest(self, role)
        if role == "dw":
            lhs = lhs._replace(blocked=(*lhs.blocked[1:], lhs.blocked[0]))
            rhs = rhs._replace(blocked=(*rhs.blocked[1:], rhs.blocked[0]))
        return lhs, rhs

    planted.setattr(ops.Conv, "transposed_operands", batch_last)
    failures = conv_failures(
        recipes.MXFP8(scale_rounding="floor"), "2d", "random", jit=True
    )
    assert set(failures) == {"dw"}


@pytest.mark.slow
@pytest.mark.parametrize("fill", [1e3, None], ids=["non-zero", "missing"])
def test_planted_padding_is_caught(planted, fill):
    """The conv's weight-gradient product over 4·7·7 = 196 positions, in blocks of
    32: padded with a large value (the last block's scale changes), or not at all
    (the quantiser refuses the length)."""
    honest = ops.pad_axis

    def padding(v, axis, multiple):
        if fill is None:
            return v
        widths = [(0, 0)] * v.ndim
        widths[axis] = (0, honest(v, axis, multiple).shape[axis] - v.shape[axis])
        return jnp.pad(v, widths, constant_values=fill)

    planted.setattr(ops, "pad_axis", padding)
    if fill is None:
        with pytest.raises(ValueError, match="must divide"):
            conv_failures(recipes.mxfp8(), "2d", "random", jit=True)
    else:
        assert set(
            conv_failures(
                recipes.MXFP8(scale_rounding="floor"), "2d", "random", jit=True
            )
        ) == {"dw"}


@pytest.mark.slow
def test_the_planted_fixture_alone_passes(planted):
    """The planted fixture with the honest helpers passes the cases the planted
    defects fail, so the failures are theirs."""
    assert conv_failures(recipes.mxfp8(), "2d", "random", jit=True) == {}
