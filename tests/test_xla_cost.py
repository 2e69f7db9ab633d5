"""Zero overhead, as XLA counts it: a rule costs the flops and temp bytes of the same
maths written as a plain `jax.custom_jvp` (`custom_vjp`), inside a jitted
forward+backward. These figures are deterministic (no wall clock), so they can be
tested; `python -m benchmarks` reports them for every rule."""

from __future__ import annotations

import dataclasses
import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from benchmarks import baselines, cases, learned, networks, xla
from benchmarks.config import QUICK

# The slow tier: compiles networks for XLA's cost analysis.
pytestmark = pytest.mark.slow

SIZES = dataclasses.replace(QUICK, width=16, depth=2, batch=8, cnn_batch=4)
ENTRIES = {e.name: e for e in eqxrules.catalogue()}


@pytest.fixture(autouse=True)
def _random_digits(monkeypatch):
    # Integer images like scikit-learn's digits, without importing scikit-learn.
    rng = np.random.default_rng(0)
    data = (
        rng.integers(0, 17, (64, 64)).astype(np.float32),
        rng.integers(0, 10, 64).astype(np.int32),
    )
    monkeypatch.setattr(networks, "digits", lambda: data)


def _rule(name: str, index: int = 0):
    return ENTRIES[name].examples(jax.random.key(0))[index]


def _figures(loss, params, data) -> tuple[float, int]:
    f = xla.figures(jax.value_and_grad(loss), params, data)
    return f["flops"], f["temp"]


def _costs(case) -> dict[str, tuple[float, int]]:
    return {
        v: _figures(case.losses[v], case.params, case.data)
        for v in ("eqxrules", "hand")
    }


def test_scaled_model_around_an_mlp_costs_what_hand_written_costs():
    for case in cases.scaled_model_cases(SIZES)[:2]:  # exact, skip_scale
        costs = _costs(case)
        assert costs["eqxrules"] == costs["hand"], case.rule


@pytest.mark.parametrize("name", ["ste_sign", "gradient_reversal", "clip_gradient"])
def test_rule_in_a_network_costs_what_hand_written_costs(name):
    """`ste_sign` in a binarised MLP, `gradient_reversal` (a JVP rule) and
    `clip_gradient` (a VJP rule) in a two-head net."""
    (case,) = cases.cases_for(ENTRIES[name], SIZES, [0], cnn=False)
    costs = _costs(case)
    assert costs["eqxrules"] == costs["hand"], costs


def test_rule_saves_the_residuals_hand_written_saves():
    rule = _rule("ste_sign")
    variants = baselines.build_variants(rule, {})
    x = jnp.linspace(-2.0, 2.0, 64).reshape(8, 8)

    def saved(v):
        f = ft.partial(variants[v], None)
        return [(a.shape, a.dtype) for a, _ in xla.saved_residuals(f, x)]

    assert saved("eqxrules") == saved("hand")


def test_a_wasteful_hand_written_rule_is_told_apart():
    """The planted defect: the same rule whose tangent is also multiplied by
    `1 + 0 * sin(x)`. XLA cannot drop that (`0 * inf` is NaN), so the flop counts
    differ and the equality above would fail for such a rule."""
    rule = _rule("ste_sign")

    @jax.custom_jvp
    def wasteful(x):
        return rule.primal(x)

    @wasteful.defjvp
    def wasteful_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        out = rule.primal(x)
        return out, rule.tangent((x,), (t,), None, out) * (1 + 0 * jnp.sin(x))

    ws = networks.mlp_weights(SIZES)
    data = networks.digits_batch(SIZES.batch)
    ours = _figures(networks.binarised_mlp_loss(rule), ws, data)
    theirs = _figures(networks.binarised_mlp_loss(wasteful), ws, data)
    assert ours[0] < theirs[0]


def _temp_against_trick(name: str) -> list[tuple[str, dict[str, tuple[float, int]]]]:
    rows = []
    for case in cases.cases_for(ENTRIES[name], SIZES, [0], cnn=True):
        variants = (
            "eqxrules",
            "trick",
            "quantized_hand" if "CNN" in case.scenario else "hand",
        )
        rows.append(
            (
                case.scenario,
                {v: _figures(case.losses[v], case.params, case.data) for v in variants},
            )
        )
    return rows


@pytest.mark.parametrize("name", ["ste_quantize", "dorefa_quantize"])
def test_quantiser_needs_no_more_than_the_trick(name):
    """The quantisers' mask is computed once, in the forward pass, and kept as a
    boolean: no more flops or temp memory than the `stop_gradient` trick in the
    binarised MLP and the quantised CNN (before, XLA kept the float pre-activation
    alive to compute the mask again: 1.43x and 1.23x the trick's temp), and the
    same as the hand-written `custom_jvp` with the same maths."""
    for scenario, costs in _temp_against_trick(name):
        ours, trick = costs["eqxrules"], costs["trick"]
        assert ours[0] <= trick[0] and ours[1] <= trick[1], (scenario, costs)
        hand = costs.get("hand", costs.get("quantized_hand"))
        assert ours == hand, (scenario, costs)


@pytest.mark.parametrize(
    "name, index", [("lsq_quantize", 0), ("lsq_quantize", 3), ("pact_quantize", 0)]
)
def test_learned_quantiser_costs_no_more_than_hand_written_or_the_trick(name, index):
    """LSQ, LSQ+ and PACT in quantisation-aware training (weights, inputs and their
    steps trained): the flops and temp bytes of a hand-written `custom_jvp` with
    the same maths, and no more than the `stop_gradient` formulation users write
    today (the LSQ paper's detach trick with a gradient-scaled step; PACT's clip
    and straight-through estimator)."""
    (case,) = cases.cases_for(ENTRIES[name], SIZES, [index], cnn=False)
    assert "steps trained" in case.scenario
    costs = {
        v: _figures(case.losses[v], case.params, case.data)
        for v in ("eqxrules", "hand", "trick")
    }
    ours, trick = costs["eqxrules"], costs["trick"]
    assert ours == costs["hand"], costs
    assert ours[0] <= trick[0] and ours[1] <= trick[1], costs


def test_a_wasteful_step_derivative_is_told_apart():
    """The planted defect beside the check above: LSQ whose step derivative is also
    multiplied by `1 + 0 * sin(x)` costs more, so the equality would fail."""

    class Wasteful(eqxrules.LSQ):
        def tangent(self, args, t_args, t_self, out, **kwargs):
            t = super().tangent(args, t_args, t_self, out, **kwargs)
            return t * (1 + 0 * jnp.sin(args[0]))

    rule = _rule("lsq_quantize")
    wasteful = Wasteful(rule.step, bits=rule.bits)
    figures = []
    for r in (rule, wasteful):
        variants = baselines.build_variants(r, {})
        _, losses, params, data, _ = learned.qat_case_parts(r, variants, SIZES)
        figures.append(_figures(losses["eqxrules"], params, data))
    assert figures[0][0] < figures[1][0]


@pytest.mark.parametrize("name", ["float_quantize", "mx_quantize", "nvfp4_quantize"])
def test_float_quantiser_costs_no_more_than_hand_written_or_the_trick(name):
    """The float quantisers in a network that applies them to every weight and
    every layer input (the binarised MLP for `float_quantize`, the block-quantised
    MLP, blocks along each reduction dimension, for MX and NVFP4): the flops and
    temp bytes of the hand-written `custom_jvp` with the same maths, and no more
    than the `stop_gradient` trick, either from the references or around the same
    rounding (`trick_same`)."""
    # Depth 3, batch 128: at depth 2, batch 8 a mask recomputed in the backward
    # pass from the float pre-activation (kept alive, 4 bytes an element instead of
    # a 1-byte bool) still fitted under the trick's temp bytes.
    sizes = dataclasses.replace(QUICK, width=64)
    (case,) = cases.cases_for(ENTRIES[name], sizes, [0], cnn=False)
    costs = {
        v: _figures(case.losses[v], case.params, case.data)
        for v in ("eqxrules", "hand", "trick", "trick_same")
    }
    ours = costs["eqxrules"]
    assert ours == costs["hand"], costs
    for v in ("trick", "trick_same"):
        assert ours[0] <= costs[v][0] and ours[1] <= costs[v][1], (v, costs)


def _forward(name: str, bits: int) -> tuple[float, bool]:
    """XLA's flops per element of the quantiser's forward pass on 4096 float32
    elements, and whether the program holds a gather."""
    x = jnp.linspace(-1.5, 1.5, 4096, dtype=jnp.float32)
    f = xla.figures(lambda x: ENTRIES[name].function(x, bits=bits), x)
    return f["flops"] / x.size, " gather(" in f["compiled"].as_text()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("name", ["ste_quantize", "dorefa_quantize"])
def test_exact_quantiser_forward_needs_no_gather(name, bits, monkeypatch):
    """The exact grids' forward pass reads no table (a gather per element made it
    6-9x slower than the plain formula on CPU), and costs fewer flops than it did.
    The planted defect, the table path (`plan` forced to give none), gathers."""
    from eqxrules._rules import _paths

    flops, gathers = _forward(name, bits)
    with monkeypatch.context() as m:
        m.setattr(_paths, "plan", lambda *args: None)
        table_flops, table_gathers = _forward(name, bits)
    assert not gathers and table_gathers
    assert flops < table_flops, (flops, table_flops)
