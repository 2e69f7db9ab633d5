"""`examples/lowp_cnn_digits.py` (issue 26 §6) in quick mode, asserting what twenty
steps can honestly show: every row trains (finite figures, the training loss
falls), every layer of a recipe row is a `QuantizedConv` or `QuantizedLinear` with
the recipe the row gives its path and gets a weight gradient, and the recipe rows
compute other gradients than float32's. The accuracies are figures of the full
run, recorded in `examples/lowp_cnn_digits.json`: `tests/test_readme.py` checks
that the README's examples row renders them and that they come from a full run of
every row.

Planted defects beside the checks: a convolution whose weight is detached (no
gradient reaches it), a recipe that quantises nothing (float32's gradients), and,
without training, a row read against another row's model, a loss that does not
fall and a figure that is not finite."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest
from conftest import _load_example

import eqxrules
from eqxrules import recipes

# The slow tier: the quick run compiles four rows' training steps (about 25 s on
# two cores).
pytestmark = pytest.mark.slow

# Between the two causes of a gradient differing from float32's: summing a float32
# product of at most 4,096 terms (`conv1`'s weight gradient: 64 images of 64
# positions) in another order moves it by at most about 4096·2⁻²⁴ ≈ 2.4e-4
# (relative), rounding its operands to E4M3 (3 mantissa bits) by up to 2⁻⁴ each. A
# recipe row closer to float32 than this, in every layer, quantised nothing.
DIFFERENT = 1e-3


@pytest.fixture(scope="module")
def example() -> Any:
    return _load_example("lowp_cnn_digits")


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
    figures = [*r["losses"], *r["gradients"], *r["accuracies"]]
    if not np.all(np.isfinite(figures)):
        out.append(f"{name}: a figure is not finite")
    first, last = np.mean(r["losses"][:5]), np.mean(r["losses"][-5:])
    if not last < first - 0.1:
        out.append(f"{name}: the training loss did not fall: {first:.3f} -> {last:.3f}")
    model = r["model"].model
    kinds = {"conv": eqxrules.QuantizedConv, "linear": eqxrules.QuantizedLinear}
    for path in example.LAYERS:
        layer, recipe = getattr(model, path), row.recipe(path)
        if recipe is None:
            if isinstance(layer, tuple(kinds.values())):
                out.append(f"{name}: {path} is quantised in a float32 row")
            continue
        kind = kinds["conv" if path.startswith("conv") else "linear"]
        if not isinstance(layer, kind):
            out.append(f"{name}: {path} is a {type(layer).__name__}, not {kind}")
        elif layer.recipe != recipe:
            out.append(f"{name}: {path} has another recipe than the row gives it")
    g, ref = np.asarray(r["gradients"]), np.asarray(reference["gradients"])
    if len(g) != len(example.LAYERS) or not np.all(g > 0):
        out.append(f"{name}: a layer got no weight gradient: {g}")
    if row.per_layer is not None and len(g) == len(ref):
        live = g > 0
        change = np.max(np.abs(g[live] / ref[live] - 1), initial=0.0)
        if change < DIFFERENT:
            out.append(f"{name}: float32's gradients (relative change {change:.1e})")
    return out


def test_lowp_cnn_digits_quick_trains_every_row(example, quick):
    results, out = quick
    reference = results["float32"]
    for row in example.ROWS:
        assert row_problems(example, row, results[row.name], reference) == []
        assert f"| {row.name} | " in out
    # The recipes the docstring promises, written out here again: the first conv
    # and the classifier (one input channel, ten outputs) in fp8, the nvfp4 row's
    # convolution without the Hadamard transform a convolution refuses.
    fp8, mxfp8, nvfp4 = recipes.fp8(), recipes.mxfp8(), recipes.nvfp4()
    no_rht = dataclasses.replace(nvfp4, hadamard=None)
    layers = example.LAYERS
    assert layers == ("conv1", "conv2", "hidden", "classifier")
    assert [[row.recipe(p) for p in layers] for row in example.ROWS] == [
        [None, None, None, None],
        [fp8, fp8, fp8, fp8],
        [fp8, mxfp8, mxfp8, fp8],
        [fp8, no_rht, nvfp4, fp8],
    ]
    assert "| nvfp4 | fp8 | nvfp4 without RHT | nvfp4 | fp8 |" in out


class DetachedConv(eqxrules.QuantizedConv):
    """Planted defect: the layer computes with its weight detached, so that no
    gradient reaches it (the silent all-zero gradient of Transformer Engine #3281)."""

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        weight = jax.lax.stop_gradient(self.conv.weight)
        detached = eqx.tree_at(lambda q: q.conv.weight, self, weight)
        return eqxrules.QuantizedConv.__call__(detached, x, key=key)


def test_checks_catch_a_detached_conv_and_a_recipe_that_quantises_nothing(
    example, quick, monkeypatch
):
    """A row whose recipe quantises nothing and whose second convolution is
    detached, trained as the quick run trains its rows: both defects are caught."""
    results, _ = quick
    identity = recipes.identity()
    planted = example.Row(
        "identity, conv2 detached", {path: identity for path in example.LAYERS}
    )
    build = example.build

    def detached(row: Any, seed: int) -> Any:
        keyed = build(row, seed)
        layer = keyed.model.conv2
        return eqx.tree_at(
            lambda k: k.model.conv2, keyed, DetachedConv(layer.conv, layer.recipe)
        )

    monkeypatch.setattr(example, "build", detached)
    with contextlib.redirect_stdout(io.StringIO()):
        r = example.train(planted, example.QUICK, example.load(), seed=0)
    r["accuracies"] = [r["accuracy"]]
    problems = row_problems(example, planted, r, results["float32"])
    assert any("got no weight gradient" in p for p in problems), problems
    assert any("float32's gradients" in p for p in problems), problems


def test_checks_catch_another_recipe_a_flat_loss_and_a_nan(example, quick):
    """Planted defects read from the quick run's own results, without training:
    the mxfp8 row read against the nvfp4 row's model (its layers have other
    recipes), a loss that stays where it started, a test accuracy that is NaN."""
    results, _ = quick
    (mxfp8,) = [row for row in example.ROWS if row.name == "mxfp8"]
    problems = row_problems(example, mxfp8, results["nvfp4"], results["float32"])
    assert problems == [
        "mxfp8: conv2 has another recipe than the row gives it",
        "mxfp8: hidden has another recipe than the row gives it",
    ]
    flat = dict(results["mxfp8"], losses=[2.3] * 20, accuracies=[float("nan")])
    problems = row_problems(example, mxfp8, flat, results["float32"])
    assert problems == [
        "mxfp8: a figure is not finite",
        "mxfp8: the training loss did not fall: 2.300 -> 2.300",
    ]
