"""`examples/lowp_moe_digits.py` (issue 38 §4) in quick mode, asserting what twenty
steps can honestly show: every row trains (finite figures, the training loss
falls), the experts of a recipe row compute with the recipe the row gives them,
every expert's two matrices get a weight gradient, and the recipe rows compute
other gradients than float32's. Without training, of the float32 row's trained
layer: the MoE layer is its definition (each token's top-2 experts' outputs
weighted by the renormalised gates, written out token by token in float64), and
the load-balancing loss is $E \\sum_e f_e P_e$ and reaches the router. The
accuracies are figures of the full run, recorded in `examples/lowp_moe_digits.json`:
`tests/test_readme.py` checks that the README's examples row renders them and that
they come from a full run of every row.

Planted defects beside the checks: an expert whose matrices are detached (no
gradient reaches them), a recipe that quantises nothing (float32's gradients),
rows left in token order (not sorted by expert), a balance loss whose router
probabilities are detached, one whose $f_e$ counts slots instead of sharing them,
and, from the quick run's results, a row read against another row's model, a loss
that does not fall and a figure that is not finite."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import _load_example

from eqxrules import recipes

# The slow tier: the quick run compiles three rows' training steps (about 25 s on
# two cores).
pytestmark = pytest.mark.slow

# Between the two causes of a gradient differing from float32's: summing a float32
# product of at most 128 terms (the experts' hidden width) in another order moves
# it by at most about 128·2⁻²⁴ ≈ 7.6e-6 (relative), rounding its operands to E4M3
# (3 mantissa bits) by up to 2⁻⁴ each. A recipe row closer to float32 than this,
# in every weight, quantised nothing.
DIFFERENT = 1e-3
# Float32's unit roundoff. A float32 sum of K products is within about K·u of its
# terms' absolute sum from the exact sum (Higham, Accuracy and Stability of
# Numerical Algorithms, (3.5)); the MoE layer chains two such products (K = 64,
# then 128) and the gates' weighted sum of two outputs.
U = 2.0**-24


@pytest.fixture(scope="module")
def example() -> Any:
    return _load_example("lowp_moe_digits")


@pytest.fixture(scope="module")
def quick(example: Any) -> tuple[dict, str]:
    """The quick run's results and what it printed (one run for the module)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        results = example.main(quick=True)
    return results, out.getvalue()


@pytest.fixture(scope="module")
def tokens(example: Any) -> np.ndarray:
    """The test images, the tokens the reference checks route."""
    (_, _), (x_test, _) = example.load()
    return np.asarray(x_test)


def row_problems(example: Any, row: Any, r: dict, reference: dict) -> list[str]:
    """What the quick run of `row` (its results `r`, float32's `reference`) fails
    to show, one line each."""
    out = []
    name = row.name
    loads = np.ravel(r["loads"])
    figures = [*r["losses"], *r["gradients"], *r["accuracies"], *loads]
    if not np.all(np.isfinite(figures)):
        out.append(f"{name}: a figure is not finite")
    first, last = np.mean(r["losses"][:5]), np.mean(r["losses"][-5:])
    if not last < first - 0.1:
        out.append(f"{name}: the training loss did not fall: {first:.3f} -> {last:.3f}")
    if r["model"].moe.recipe != row.recipe:
        out.append(f"{name}: the experts have another recipe than the row gives them")
    g, ref = np.asarray(r["gradients"]), np.asarray(reference["gradients"])
    if len(g) != len(example.WEIGHTS):
        out.append(f"{name}: {len(g)} gradient norms, not one per weight")
    else:
        dead = [w for w, v in zip(example.WEIGHTS, g) if not v > 0]
        if dead:
            out.append(f"{name}: no weight gradient reached {', '.join(dead)}")
    if row.recipe is not None and len(g) == len(ref):
        live = (g > 0) & (ref > 0)
        change = np.max(np.abs(g[live] / ref[live] - 1), initial=0.0)
        if change < DIFFERENT:
            out.append(f"{name}: float32's gradients (relative change {change:.1e})")
    return out


def test_lowp_moe_digits_quick_trains_every_row(example, quick):
    results, out = quick
    reference = results["float32"]
    for row in example.ROWS:
        assert row_problems(example, row, results[row.name], reference) == []
        assert f"| {row.name} | {example.recipe_name(row.recipe)} | " in out
    # The rows and the layer the docstring promises, written out here again.
    assert [row.recipe for row in example.ROWS] == [
        None,
        recipes.fp8(),
        recipes.mxfp8(),
    ]
    assert (example.EXPERTS, example.TOP_K) == (4, 2)
    assert len(example.WEIGHTS) == 2 + 2 * example.EXPERTS


def _reference(moe: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """`(y, bound, balance)`, token by token in float64: the MoE layer's output,
    how far float32 may be from it (elementwise), and the load-balancing loss."""
    w = {f: np.asarray(getattr(moe, f), np.float64) for f in ("w_in", "b_in")}
    w.update({f: np.asarray(getattr(moe, f), np.float64) for f in ("w_out", "b_out")})
    router_w = np.asarray(moe.router.weight, np.float64)
    router_b = np.asarray(moe.router.bias, np.float64)
    logits = x @ router_w.T + router_b
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    y = np.zeros((len(x), w["w_out"].shape[2]))
    size = np.zeros_like(y)  # the terms' absolute sums, layer by layer
    counts = np.zeros(probs.shape[1])
    for t in range(len(x)):
        chosen = np.argsort(-probs[t])[:2]
        gates = probs[t, chosen] / probs[t, chosen].sum()
        for e, g in zip(chosen, gates):
            counts[e] += 1
            h = np.maximum(x[t] @ w["w_in"][e] + w["b_in"][e], 0)
            h_size = np.abs(x[t]) @ np.abs(w["w_in"][e]) + np.abs(w["b_in"][e])
            y[t] += g * (h @ w["w_out"][e] + w["b_out"][e])
            size[t] += g * (h_size @ np.abs(w["w_out"][e]) + np.abs(w["b_out"][e]))
    k_in, k_out = w["w_in"].shape[1], w["w_out"].shape[1]
    # Each layer's sum within (K + 2)·u of its size, plus the router's gates (a
    # softmax: a few u each) and the final weighted sum: 16 u more than the sums.
    # (Routing itself is compared exactly: a token whose float32 top 2 were
    # another pair than float64's would fail the check, never pass it.)
    bound = (k_in + k_out + 16) * U * size
    f = counts / counts.sum()
    balance = len(counts) * float(np.sum(f * probs.mean(axis=0)))
    return y, bound, balance


def moe_problems(example: Any, model: Any, x: np.ndarray) -> list[str]:
    """Where the float32 model's MoE layer, on tokens `x`, is not its definition:
    its output, its load-balancing loss, or that loss's gradient in the router."""
    out = []
    moe = model.moe
    y, balance = moe(jnp.asarray(x))
    want, bound, want_balance = _reference(moe, x)
    error = np.abs(np.asarray(y, np.float64) - want)
    if not np.all(error <= bound):
        worst = np.argmax(error - bound)
        out.append(
            f"output: {int(np.sum(error > bound))} entries off their reference "
            f"(worst {error.flat[worst]:.2e} > {bound.flat[worst]:.2e})"
        )
    # Sums of positive terms: a mean of N probabilities within N·u of its own
    # size, relative; the shares, their products and their sum of 4, 8 u more.
    if not abs(float(balance) - want_balance) <= (len(x) + 8) * U * want_balance:
        out.append(f"balance: {float(balance):.6f}, not E·Σ f P = {want_balance:.6f}")
    grads = eqx.filter_grad(lambda m: m(jnp.asarray(x))[1])(moe)
    if not float(jnp.linalg.norm(grads.router.weight)) > 0:
        out.append("balance: no gradient reaches the router")
    return out


def test_the_moe_layer_is_its_definition(example, quick, tokens):
    results, _ = quick
    assert moe_problems(example, results["float32"]["model"], tokens) == []


def test_checks_catch_unsorted_rows_and_two_wrong_balance_losses(
    example, quick, tokens, monkeypatch
):
    """Planted defects in the float32 row's trained layer: rows left in token order
    (`ragged_dot` then multiplies them by other experts), router probabilities
    detached in the balance loss (Switch's loss then trains nothing), and $f_e$
    counting the slots instead of sharing them (the loss 2N times too large)."""
    model = quick[0]["float32"]["model"]
    dispatch = example.dispatch

    def unsorted(experts):
        order, sizes = dispatch(experts)
        return jnp.arange(order.size), sizes

    with monkeypatch.context() as m:
        m.setattr(example, "dispatch", unsorted)
        (problem,) = moe_problems(example, model, tokens)
    assert problem.startswith("output:"), problem

    load_balance = example.load_balance

    def detached(probs, sizes):
        return load_balance(jax.lax.stop_gradient(probs), sizes)

    def counted(probs, sizes):
        return example.EXPERTS * jnp.sum(sizes * jnp.mean(probs, axis=0))

    for planted, expected in (
        (detached, "balance: no gradient reaches the router"),
        (counted, "not E·Σ f P"),
    ):
        with monkeypatch.context() as m:
            m.setattr(example, "load_balance", planted)
            (problem,) = moe_problems(example, model, tokens)
        assert expected in problem, problem


def test_checks_catch_a_detached_expert_and_a_recipe_that_quantises_nothing(
    example, quick, monkeypatch
):
    """A row whose recipe quantises nothing and whose expert 2's matrices are
    detached in both grouped products (the silent all-zero gradient of Transformer
    Engine #3281), trained as the quick run trains its rows: both defects are
    caught."""
    results, _ = quick
    planted = example.Row("identity, expert 2 detached", recipes.identity())
    grouped = example.MoE.grouped

    def detached(self, rows, w, sizes):
        w = w.at[2].set(jax.lax.stop_gradient(w[2]))
        return grouped(self, rows, w, sizes)

    # The step is jit-compiled per model structure: a recipe other than the rows'
    # compiles (and so traces the patched method) afresh.
    monkeypatch.setattr(example.MoE, "grouped", detached)
    with contextlib.redirect_stdout(io.StringIO()):
        r = example.train(planted, example.QUICK, example.load(), seed=0)
    r["accuracies"], r["loads"] = [r["accuracy"]], [r["loads"]]
    problems = row_problems(example, planted, r, results["float32"])
    assert f"{planted.name}: no weight gradient reached w_in[2], w_out[2]" in problems
    assert any("float32's gradients" in p for p in problems), problems


def test_checks_catch_another_recipe_a_flat_loss_and_a_nan(example, quick):
    """Planted defects read from the quick run's own results, without training:
    the mxfp8 row read against the fp8 row's model (its experts have another
    recipe), a loss that stays where it started, a test accuracy that is NaN."""
    results, _ = quick
    (mxfp8,) = [row for row in example.ROWS if row.name == "mxfp8"]
    problems = row_problems(example, mxfp8, results["fp8"], results["float32"])
    assert problems == [
        "mxfp8: the experts have another recipe than the row gives them"
    ]
    flat = dict(results["mxfp8"], losses=[2.3] * 20, accuracies=[float("nan")])
    problems = row_problems(example, mxfp8, flat, results["float32"])
    assert problems == [
        "mxfp8: a figure is not finite",
        "mxfp8: the training loss did not fall: 2.300 -> 2.300",
    ]
    other = dataclasses.replace(mxfp8, recipe=recipes.fp8())
    assert row_problems(example, other, results["fp8"], results["float32"]) == []
