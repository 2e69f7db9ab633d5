"""The issue-3 examples, in quick mode: they run and reach their figures."""

from __future__ import annotations

import pytest

# The slow tier: trains three networks on digits.
pytestmark = pytest.mark.slow


def test_binary_mlp_digits_learns_and_reports_the_trick(load_example, capsys):
    figures = load_example("binary_mlp_digits").main(quick=True)
    out = capsys.readouterr().out
    epochs = len(figures["losses"])
    assert epochs >= 2 and out.count("epoch ") == epochs  # a progress line per epoch
    assert figures["losses"][-1] < 0.5 * figures["losses"][0]
    assert figures["trick_losses"][-1] < 0.5 * figures["trick_losses"][0]
    assert figures["accuracy"] > 0.8 and figures["trick_accuracy"] > 0.8
    assert "test accuracy: eqxrules SteSign" in out and "stop_gradient trick" in out
    assert set(figures["on_boundary"]) == {"eqxrules", "trick"}


def test_straight_through_vq_loss_falls(load_example, capsys):
    figures = load_example("straight_through_vq").main(quick=True)
    out = capsys.readouterr().out
    for name in ("straight_through_onehot", "gumbel_softmax"):
        r = figures[name]
        assert r["losses"][-1] < r["losses"][0]
        assert r["test_loss"] < 0.5 * r["start_loss"]
        assert r["test_loss"] < figures["baseline"]  # better than the mean image
        assert r["codes_used"] > 2  # not collapsed onto one or two codes
        assert f"{name}: test loss {r['start_loss']:.4f} -> {r['test_loss']:.4f}" in out


def test_qat_digits_trains_every_row_and_prints_the_table(load_example, capsys):
    """Quick mode of the issue-11 example: every row trains (one progress line per
    epoch, the loss falls), the learned steps move under optax while the fixed
    rows have none, and the table lists every row; the float-format rows (issue 14)
    also report the trained float32 model quantised without training."""
    example = load_example("qat_digits")
    results = example.main(quick=True)
    lines = capsys.readouterr().out.splitlines()
    for row in example.ROWS:
        r = results[row.name]
        progress = [ln for ln in lines if ln.startswith(f"{row.name:30s} seed 0 epoch")]
        assert len(progress) == len(r["losses"]) >= 2, row.name
        assert r["losses"][-1] < r["losses"][0], row.name
        assert 0.0 <= r["accuracy"] <= 1.0
        assert any(ln.startswith(f"| {row.name} | ") for ln in lines), row.name
        if row.ptq:
            assert r["ptq"] and 0.0 <= r["ptq_accuracy"] <= 1.0, row.name
            assert any(
                ln.startswith(f"| {row.name} | {r['ptq_accuracy']:.1%} | ")
                for ln in lines
            ), row.name
        else:
            assert "ptq" not in r, row.name
        steps = r["step_trajectory"]
        learned = hasattr(row.inputs, "initialised_from")
        if learned:
            assert None not in steps and steps[-1] != steps[0], row.name
        else:
            assert set(steps) == {None}, row.name
    assert any(hasattr(row.inputs, "initialised_from") for row in example.ROWS)
    kinds = {
        type(q).__name__
        for row in example.ROWS
        if row.ptq
        for q in (row.weights, row.inputs)
    }
    assert {"MXQuantize", "NVFP4Quantize"} <= kinds
