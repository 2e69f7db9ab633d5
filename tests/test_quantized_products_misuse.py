"""Bad input to `quantized_dot_general`, `quantized_einsum` and `quantized_conv`:
clear errors naming the function, the argument and what must hold."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from product_references import KEY, NO_RHT

import eqxrules
from eqxrules import recipes


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: eqxrules.quantized_dot_general(
                jnp.ones((4, 8)),
                jnp.ones((8, 2)),
                (((0,), (0,)), ((), ())),
                recipe=recipes.identity(),
            ),
            ValueError,
            r"`quantized_dot_general`: `dimension_numbers` \(=.*\) do not fit",
        ),
        (
            lambda: eqxrules.quantized_dot_general(
                jnp.ones((4, 8)), jnp.ones((8, 2)), "ij", recipe=recipes.identity()
            ),
            ValueError,
            r"`quantized_dot_general`: `dimension_numbers` \(='ij'\) must be",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                "ij,jk", jnp.ones((4, 8)), jnp.ones((8,)), recipe=recipes.identity()
            ),
            ValueError,
            r"`quantized_einsum`: `subscripts` \(='ij,jk'\) gives `rhs` 2 axes",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                "ii,ij->j",
                jnp.ones((4, 4)),
                jnp.ones((4, 2)),
                recipe=recipes.identity(),
            ),
            ValueError,
            r"repeats a label within `lhs`",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                "ij,jk->k",
                jnp.ones((4, 8)),
                jnp.ones((8, 2)),
                recipe=recipes.identity(),
            ),
            ValueError,
            r"label 'i' is in one operand only",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                "...j,jk", jnp.ones((4, 8)), jnp.ones((8, 2)), recipe=recipes.identity()
            ),
            ValueError,
            r"no ellipsis",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                1, jnp.ones((4, 8)), jnp.ones((8, 2)), recipe=recipes.identity()
            ),
            TypeError,
            r"`quantized_einsum`: `subscripts` \(=1\) must be a string",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((16, 32, 3, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.nvfp4(),
                key=KEY,
            ),
            ValueError,
            r"`quantized_conv`: the recipe's `dw` product asks for a random Hadamard",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 48, 8, 8)),
                jnp.ones((32, 48, 3, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            ValueError,
            r"`quantized_conv`: the forward product reduces the input features "
            r"\(=48\), which its `lhs` \(the input, in blocks of 32\) must divide",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((40, 32, 3, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            ValueError,
            r"`quantized_conv`: the input-gradient product reduces the output "
            r"features \(=40\)",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((32, 32, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            ValueError,
            r"`quantized_conv`: `lhs` \(shape \(2, 32, 8, 8\)\) and `rhs` \(shape "
            r"\(32, 32, 3\)\) must have the same rank",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((32, 32, 3, 3)),
                (1,),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            ValueError,
            r"`quantized_conv`: `window_strides` \(=\(1,\)\) must be 2 positive ints",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8), jnp.int32),
                jnp.ones((32, 32, 3, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            TypeError,
            r"`quantized_conv` expects a floating-point array for `lhs`",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((32, 32, 3, 3)),
                (1, 1),
                "SAME",
                recipe=NO_RHT,
            ),
            TypeError,
            r"`quantized_conv`: `recipe` draws random numbers \(dx.lhs, dw.rhs\)",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()
