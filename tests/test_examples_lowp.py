"""`examples/lowp_training.py` (issue 19 §5) in quick mode, asserting what a dozen
steps can honestly show: every row trains (finite figures, the training loss falls,
the validation loss ends well below a uniform model's), every linear layer of a
recipe row is a `QuantizedLinear` with that recipe and gets a weight gradient, the
recipe rows compute other gradients than float32's, and a recipe that draws random
numbers is an error without a key. The gaps to float32 are figures of the full run,
recorded in `examples/lowp_training.json`: `tests/test_readme.py` checks that the
README renders them and that they come from a full run of every row.

Planted defects beside the checks: a layer whose weight is detached (no gradient
reaches it), and a recipe that quantises nothing (float32's gradients)."""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import _load_example

import eqxrules
from eqxrules import recipes

# The slow tier: trains a transformer in every recipe.
pytestmark = pytest.mark.slow

# A model that has learnt nothing predicts each of the 256 bytes alike.
UNIFORM = math.log(256)
# Between the two causes of a gradient differing from float32's: summing a float32
# product of at most 256 terms in another order moves it by at most about
# 256·2⁻²⁴ ≈ 2e-5 (relative), rounding its operands to E4M3 (3 mantissa bits) by
# up to 2⁻⁴ each. A recipe row closer to float32 than this quantised nothing.
DIFFERENT = 1e-3


@pytest.fixture(scope="module")
def example() -> Any:
    return _load_example("lowp_training")


@pytest.fixture(scope="module")
def quick(example: Any) -> tuple[dict, str]:
    """The quick run's results and what it printed (one run for the module)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        results = example.main(quick=True)
    return results, out.getvalue()


def row_problems(example: Any, row: Any, r: dict, reference: dict) -> list[str]:
    """What the quick run of `row` (its results `r`, float32's `reference`) fails
    to show, one line each."""
    out = []
    name = row.name
    linears = 4 * example.QUICK.depth  # fused q·k·v, output, MLP in and out
    figures = [*r["losses"], *r["validation"], *r["gradients"]]
    if not np.all(np.isfinite(figures)):
        out.append(f"{name}: a figure is not finite")
    if not r["losses"][-1] < r["losses"][0]:
        out.append(f"{name}: the training loss did not fall: {r['losses']}")
    if not max(r["validation"]) < UNIFORM - 1:
        out.append(f"{name}: validation {r['validation']} not below ln 256 - 1")
    model = r["model"].model
    quantised = example.layers(model, eqxrules.QuantizedLinear)
    if len(example.layers(model, eqx.nn.Linear)) != linears or len(quantised) != (
        0 if row.recipe is None else linears
    ):
        out.append(f"{name}: {len(quantised)} of the {linears} layers quantised")
    recipe_of = example.layer_recipes(row, example.QUICK)
    for q in quantised:
        path = (q.path or "").removeprefix("model.")
        want = recipe_of(path) if callable(recipe_of) else recipe_of
        if q.recipe != want:
            out.append(f"{name}: the layer at {path} has another recipe than the row's")
    if any(b.attention.products != row.attention for b in model.blocks):
        out.append(f"{name}: an attention's products are not the row's")
    g, ref = np.asarray(r["gradients"]), np.asarray(reference["gradients"])
    if len(g) != linears or not np.all(g > 0):
        out.append(f"{name}: a linear layer got no weight gradient: {g}")
    if row.recipe is not None and len(g) == len(ref):
        live = g > 0
        change = np.max(np.abs(g[live] / ref[live] - 1), initial=0.0)
        if change < DIFFERENT:
            out.append(f"{name}: float32's gradients (relative change {change:.1e})")
    return out


def test_lowp_training_quick_trains_every_row(example, quick):
    results, out = quick
    reference = results["float32"]
    for row in example.ROWS:
        assert row_problems(example, row, results[row.name], reference) == []
        assert f"| {row.name} | " in out
    assert [row.recipe for row in example.ROWS[1:]] == [
        recipes.fp8(),
        recipes.mxfp8(),
        recipes.nvfp4(),
        recipes.NVFP4(gradient_rounding="nearest", hadamard=None),
        recipes.Custom(fwd=recipes.nvfp4().products().fwd),
        recipes.Custom(
            dx=recipes.nvfp4().products().dx, dw=recipes.nvfp4().products().dw
        ),
        recipes.NVFP4(square_weight_blocks=False),
        example.LastBlock(recipes.nvfp4(), recipes.mxfp8()),
        recipes.mxfp8(),
        recipes.MXFP8(scale_rounding="floor"),
        recipes.FP8Blockwise(block_size=32),
        recipes.fp8_rowwise(),
        recipes.mxfp4(),
        recipes.NVFP4(four_over_six=True),
    ]
    attention = [row.attention for row in example.ROWS]
    assert attention == [None] * 9 + [recipes.mxfp8()] + [None] * 5
    # The per-layer row's function: the last block's layers in mxfp8().
    per_layer = example.ROWS[8].recipe.for_depth(2)
    assert per_layer("blocks[1].mlp_in") == recipes.mxfp8()
    assert per_layer("blocks[0].mlp_in") == recipes.nvfp4()
    assert results["corpus"]["ascii"]  # so a byte is a character
    assert results["corpus"]["files"] == sorted(results["corpus"]["files"])


class DetachedLinear(eqxrules.QuantizedLinear):
    """Planted defect: the layer computes with its weight detached, so that no
    gradient reaches it (the silent all-zero gradient of Transformer Engine #3281)."""

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        weight = jax.lax.stop_gradient(self.linear.weight)
        detached = eqx.tree_at(lambda q: q.linear.weight, self, weight)
        return eqxrules.QuantizedLinear.__call__(detached, x, key=key)


def test_checks_catch_a_detached_layer_and_a_recipe_that_quantises_nothing(
    example, quick, monkeypatch
):
    """A row whose recipe quantises nothing and one of whose layers is detached,
    trained as the quick run trains its rows: both defects are caught."""
    results, _ = quick
    planted = example.Row("identity, one layer detached", recipes.identity())
    build = example.build

    def detached(row: Any, s: Any, seed: int) -> Any:
        model = build(row, s, seed)
        second = lambda m: example.layers(m, eqxrules.QuantizedLinear)[1]  # noqa: E731
        layer = second(model)
        return eqx.tree_at(second, model, DetachedLinear(layer.linear, layer.recipe))

    monkeypatch.setattr(example, "build", detached)
    s = example.QUICK
    train, validation, _ = example.corpus()
    data = (train, example.validation_set(validation, s))
    with contextlib.redirect_stdout(io.StringIO()):
        r = example.train(planted, s, data, seed=0)
    r["validation"] = [r["validation"]]
    problems = row_problems(example, planted, r, results["float32"])
    assert any("got no weight gradient" in p for p in problems), problems
    assert any("float32's gradients" in p for p in problems), problems


def test_the_model_example_describes_the_data_and_the_model(load_example):
    """`lowp_training_model.py` alone: the corpus, the parameters (counted here
    from the architecture: embedding, positions, per block two layer norms, the
    fused q·k·v and output projections without bias, the MLP with bias; the final
    norm; the readout tied), and an untrained loss near a uniform model's."""
    model = load_example("lowp_training_model")
    with contextlib.redirect_stdout(io.StringIO()):
        r = model.main(quick=True)
    s = model.QUICK
    w, h = s.width, s.hidden
    block = 2 * 2 * w + 3 * w * w + w * w + (w * h + h) + (h * w + w)
    assert r["parameters"] == 256 * w + s.context * w + s.depth * block + 2 * w
    assert abs(r["loss"] - UNIFORM) < 0.5, r["loss"]
    assert r["corpus"]["ascii"] and r["corpus"]["bytes"] > 0


def test_a_recipe_that_draws_random_numbers_needs_a_key(example):
    (row,) = [r for r in example.ROWS if r.name == "nvfp4"]
    model = example.build(row, example.QUICK, seed=0)
    batch = jnp.zeros((2, example.QUICK.context + 1), jnp.int32)
    with pytest.raises(TypeError, match="wrap the model in `eqxrules.Keyed`"):
        example.loss_fn(model, batch, None)
