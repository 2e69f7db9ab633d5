"""Row-wise and block-scaled recipes leak nothing from a later token into an
earlier one (issue 41 §3; the low-precision guide's "What one scale per tensor
shares" shows `fp8()` leaking).

One layer, 64 tokens of 256 features. A spike in the last token's input must
leave every earlier token's output `y` unchanged, bit for bit, and a spike in the
last token's output gradient every earlier token's input gradient `dx`: each
token's operands are scaled within the token (tiles and blocks along the
features, rows of features). One scale per tensor (`fp8()`, and `nvfp4()`'s
tensor scale) lets the spike move all 63. Planted beside the check: tiles along
the tokens instead of the features.
"""

from __future__ import annotations

import dataclasses
import functools as ft

import jax
import jax.numpy as jnp
import pytest

import eqxrules
from eqxrules import recipes

TOKENS = jax.random.normal(jax.random.key(0), (64, 256))
WEIGHT = jax.random.normal(jax.random.key(1), (256, 128)) / 16
COTANGENT = jax.random.normal(jax.random.key(2), (64, 128))

SCALED_WITHIN_TOKENS = {
    "fp8_blockwise": recipes.fp8_blockwise(),
    "fp8_rowwise": recipes.fp8_rowwise(),
    "mxfp8": recipes.mxfp8(),
    "mxfp8 floor": recipes.MXFP8(scale_rounding="floor"),
    "mxfp4": recipes.mxfp4(),
}


@ft.partial(jax.jit, static_argnums=0)
def _products(recipe, x, dy):
    """(y, dx) of `quantized_dot(x, WEIGHT)` with cotangent `dy`."""
    f = ft.partial(eqxrules.quantized_dot, recipe=recipe, key=jax.random.key(3))
    y, pull = jax.vjp(f, x, WEIGHT)
    return y, pull(dy)[0]


def moved(recipe) -> dict[str, int]:
    """How many of the 63 earlier tokens' `y` (a spike of 100 in the last token's
    input) and `dx` (in its output gradient) the last token changed."""
    y, dx = _products(recipe, TOKENS, COTANGENT)
    spiked_y, _ = _products(recipe, TOKENS.at[63, 0].set(100.0), COTANGENT)
    _, spiked_dx = _products(recipe, TOKENS, COTANGENT.at[63, 0].set(100.0))
    return {
        "y": int(jnp.sum(jnp.any(y[:63] != spiked_y[:63], axis=1))),
        "dx": int(jnp.sum(jnp.any(dx[:63] != spiked_dx[:63], axis=1))),
    }


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(SCALED_WITHIN_TOKENS))
def test_no_later_token_moves_an_earlier_one(name):
    assert moved(SCALED_WITHIN_TOKENS[name]) == {"y": 0, "dx": 0}


def test_one_scale_per_tensor_leaks():
    """The check can fail: `fp8()` and `nvfp4()` (its tensor scale) move all 63."""
    assert moved(recipes.fp8()) == {"y": 63, "dx": 63}
    assert moved(recipes.nvfp4())["y"] == 63


class _AlongTheTokens(eqxrules.BlockFloatQuantize):
    """Tiles along the axis the product does not contract: for `x` and `dy`, the
    tokens."""

    def for_reduction_axis(self, axis, length, where):
        return dataclasses.replace(self, axis=1 - axis % 2)


def test_planted_tiles_along_the_tokens_leak():
    honest = recipes.FP8Blockwise(block_size=32).products()
    wrong = _AlongTheTokens(format="e4m3", block_size=32)
    planted = dataclasses.replace(
        honest,
        fwd=recipes.Product(wrong, honest.fwd.rhs),
        dx=recipes.Product(wrong, honest.dx.rhs),
    )
    assert moved(recipes.FP8Blockwise(block_size=32)) == {"y": 0, "dx": 0}
    found = moved(planted)
    assert found["y"] > 0 and found["dx"] > 0, found
