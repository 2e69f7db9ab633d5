"""`quantized_dot` costs what the same steps cost written by hand, as XLA counts it
(issue 19 §6): inside a jitted `value_and_grad` with respect to `x` and `w`, on
the whole batch and under `jax.vmap` over the examples, its flops and temp bytes
are at most those of `benchmarks.sections.quantized_dot.hand_written` (one plain
`jax.custom_vjp`, the recipe's public quantisers along each product's reduced
axis, `lax.dot_general`). Deterministic figures (`cost_analysis()`,
`memory_analysis()`), no wall clock; `python -m benchmarks --only quantized_dot`
reports them, with wall time, at realistic shapes.

The planted defect beside the check: `quantized_dot` quantising each operand twice
(`Q(Q(a))`, which XLA cannot fold; planted through a `recipes.Custom` recipe of
quantiser subclasses, against the honest recipe's hand-written composition),
caught: its flops (FP8 and NVFP4), and its temp bytes (NVFP4)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from benchmarks import xla
from benchmarks.sections import quantized_dot as section
from eqxrules import recipes

# The slow tier: compiles the recipes' products for XLA's cost analysis.
pytestmark = pytest.mark.slow

SHAPE = (64, 64, 32)  # M, K, N: every block (16, 32, 16x16) divides each


def _costs(recipe, figures=None) -> dict[str, tuple[float, int]]:
    figures = figures or section.measure(recipe, SHAPE)
    return {v: (f["flops"], f["temp"]) for v, f in figures.items()}


def _over(costs: dict[str, tuple[float, int]]) -> dict[str, list[str]]:
    """For each way of calling `quantized_dot`, the figures above the hand-written
    composition's: the check, empty when it passes."""
    hand = costs["hand"]
    return {
        mode: [
            figure
            for figure, ours, theirs in zip(("flops", "temp"), costs[mode], hand)
            if ours > section.XLA_TARGET * theirs
        ]
        for mode in ("eqxrules", "vmapped")
    }


@pytest.mark.parametrize("name", section.RECIPES)
def test_quantized_dot_costs_no_more_than_hand_written(name):
    recipe = section.RECIPES[name]
    figures = section.measure(recipe, SHAPE)
    costs = _costs(recipe, figures)
    assert _over(costs) == {"eqxrules": [], "vmapped": []}, costs
    # The baseline is the same maths: value and gradients bit for bit.
    args = section.problem(recipe, SHAPE)
    hand = jax.tree.leaves(figures["hand"]["compiled"](*args))
    for mode in ("eqxrules", "vmapped"):
        ours = jax.tree.leaves(figures[mode]["compiled"](*args))
        assert all(np.array_equal(a, b) for a, b in zip(ours, hand)), mode


def _twice(q):
    """`q` quantising twice, `Q(Q(a))`: a user's subclass of `q`'s class, so the
    defect enters through a public seam (a `recipes.Custom` recipe), not by
    patching `quantized_dot`'s internals."""
    if q is None:
        return None

    class Twice(type(q)):
        def _encode(self, x, bits):
            once = super()._encode
            return once(self.decode(once(x, bits), x), bits)

    return Twice(**{f.name: getattr(q, f.name) for f in dataclasses.fields(q)})


def _planted_costs(recipe) -> dict[str, tuple[float, int]]:
    """The costs of `quantized_dot` with each operand quantised twice (the
    planted defect), against the hand-written composition of the honest
    `recipe`."""
    products = recipe.products()
    twice = recipes.Custom(
        **{
            name: recipes.Product(_twice(p.lhs), _twice(p.rhs), p.hadamard)
            for name in ("fwd", "dx", "dw")
            for p in [getattr(products, name)]
        }
    )
    args = section.problem(recipe, SHAPE)
    planted, honest = section.losses(twice), section.losses(recipe)
    losses = {
        "eqxrules": planted["eqxrules"],
        "vmapped": planted["vmapped"],
        "hand": honest["hand"],
    }
    return {
        v: (f["flops"], f["temp"])
        for v, loss in losses.items()
        for f in [xla.figures(jax.value_and_grad(loss, (0, 1)), *args)]
    }


def test_planted_operand_quantised_twice_is_caught():
    plain = "nvfp4(), no SR, no RHT"
    over = {n: _over(_planted_costs(section.RECIPES[n])) for n in ("fp8()", plain)}
    for name, modes in over.items():
        assert modes["eqxrules"] == modes["vmapped"], name
        assert "flops" in modes["eqxrules"], (name, modes)
    # The temp bytes too, for NVFP4 (which figure a defect moves is XLA's to say).
    assert "temp" in over[plain]["eqxrules"], over
