"""Products exact whatever the backend's default precision (issue 41 §1): on a
GPU JAX's default float32 matmul is TF32 (10 mantissa bits), on a TPU a bfloat16
pass, so a product of arbitrary float32 operands at the default precision
computes other values than on the CPU. Every matrix product and convolution of
the quantised functions' value and gradients must therefore name its precision:
`Precision.DEFAULT` only where both operands are quantised values exact in
bfloat16 (`LowPrecision.payload`; TF32 and bfloat16 hold them, so each product is
exact and the float32 accumulation the only rounding), `Precision.HIGHEST`
otherwise.

Checked structurally, on the CPU: the jaxpr of each function's jitted value and
gradients, for every recipe, walked through every nested program: no product
leaves its precision to the backend; with the identity recipe (nothing
quantised) every product is at `HIGHEST`; with `mxfp8()` (power-of-two scales)
and `fp8()` (the tensor scale on the output) every product at `DEFAULT`.
Planted beside it: products at the backend's precision, and a `DEFAULT` for
operands that are not exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import eqxrules
from eqxrules import recipes
from eqxrules._lowp import quantise

KEY = jax.random.key(0)
RECIPES = {
    "identity": recipes.identity(),
    "fp8": recipes.fp8(),
    "mxfp8": recipes.mxfp8(),
    "nvfp4": recipes.nvfp4(),
}
PRODUCTS = ("dot_general", "conv_general_dilated", "ragged_dot_general", "ragged_dot")
NO_RHT = dataclasses.replace(recipes.nvfp4(), hadamard=None)


def _functions(recipe):
    conv_recipe = NO_RHT if recipe == RECIPES["nvfp4"] else recipe
    x, w = jnp.ones((32, 64)), jnp.ones((64, 32))
    images, kernel = jnp.ones((2, 32, 4, 4)), jnp.ones((32, 32, 3, 3))
    experts, sizes = jnp.ones((2, 64, 32)), jnp.asarray([10, 22], jnp.int32)
    return {
        "quantized_dot": (
            lambda a, b: eqxrules.quantized_dot(a, b, recipe=recipe, key=KEY),
            (x, w),
        ),
        "quantized_einsum": (
            lambda a, b: eqxrules.quantized_einsum(
                "qd,kd->qk", a, b, recipe=recipe, key=KEY
            ),
            (x, x),
        ),
        "quantized_conv": (
            lambda a, b: eqxrules.quantized_conv(
                a, b, (1, 1), "SAME", recipe=conv_recipe, key=KEY
            ),
            (images, kernel),
        ),
        "quantized_ragged_dot": (
            lambda a, b: eqxrules.quantized_ragged_dot(
                a, b, sizes, recipe=recipe, key=KEY
            ),
            (x, experts),
        ),
    }


def _subjaxprs(value):
    """The jaxprs inside an equation's parameter (a jaxpr, a closed one, or a
    sequence of them)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def products(jaxpr):
    """Every product equation of `jaxpr`, nested programs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in PRODUCTS:
            yield eqn
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                yield from products(sub)


def _highest(precision) -> bool:
    highest = jax.lax.Precision.HIGHEST
    if isinstance(precision, (tuple, list)):
        return all(p == highest for p in precision)
    return precision == highest


def precision(eqn) -> str:
    """`"highest"`, `"default"` (named) or `"backend's"` (left to the backend:
    `None`)."""
    p = eqn.params.get("precision")
    if p is None:
        return "backend's"
    return "highest" if _highest(p) else "default"


def _precisions(recipe) -> dict[str, set[str]]:
    """Each function's set of its products' precisions."""
    out = {}
    for name, (f, args) in _functions(recipe).items():
        loss = lambda a, b, f=f: jnp.sum(f(a, b) ** 2)  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.jit(jax.value_and_grad(loss, (0, 1))))(*args)
        found = list(products(jaxpr.jaxpr))
        assert len(found) >= 3, (name, len(found))  # the three products, at least
        out[name] = {precision(e) for e in found}
    return out


# What each recipe's products must name: nothing quantised is not exact in
# bfloat16; power-of-two scales, and per-tensor scales on the output, are. (A
# ragged product's fp8() and nvfp4() have a tensor scale per group: at HIGHEST.)
WANT = {
    "identity": {"highest"},
    "fp8": {"default"},
    "mxfp8": {"default"},
}


@pytest.mark.first_case_quick
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_product_names_its_precision(recipe):
    found = _precisions(RECIPES[recipe])
    assert all("backend's" not in p for p in found.values()), found
    want = WANT.get(recipe)
    for name, got in found.items():
        if want is not None and not (
            name == "quantized_ragged_dot" and recipe == "fp8"
        ):
            assert got == want, (name, got)


def test_planted_backends_precision_is_caught(fresh_products):
    """Planted: every product at the backend's precision."""

    def backends(op, a, b, extras):
        return op(a.dequantised(), b.dequantised(), *extras)

    fresh_products.setattr(quantise, "contract", backends)
    found = _precisions(RECIPES["mxfp8"])
    assert all(p == {"backend's"} for p in found.values()), found


def test_planted_default_for_inexact_operands_is_caught(fresh_products):
    """Planted: `DEFAULT` whatever the operands (the identity recipe's float32
    operands are not exact in bfloat16)."""

    def always_default(op, a, b, extras):
        precision = jax.lax.Precision.DEFAULT
        return op(a.dequantised(), b.dequantised(), *extras, precision=precision)

    fresh_products.setattr(quantise, "contract", always_default)
    found = _precisions(RECIPES["identity"])
    assert all(p != WANT["identity"] for p in found.values()), found
