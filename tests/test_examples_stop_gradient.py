"""The examples of the stop-gradient and gradient-shaping rules run, and print the
figures they promise. (The LSTM and regression examples are fast enough to run in
full; the domain-adaptation one runs in quick mode: 3 seeds.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

# The slow tier: trains DANN and an LSTM.
pytestmark = pytest.mark.slow


def test_lstm_truncated_bptt(load_example, capsys):
    example = load_example("lstm_truncated_bptt")
    result = example.main(quick=True)
    printed = capsys.readouterr().out

    assert "Sample after: [4, 8, 15, 16, 23, 42]" in printed.splitlines()
    assert result["sample_after"] == [4, 8, 15, 16, 23, 42]
    assert result["sample_before"] != result["sample_after"]
    assert f"Sample before: {result['sample_before']}" in printed

    losses = result["losses"]
    assert sorted(losses) == [0, 50, 100]
    # An untrained model is about uniform over the 43 tokens.
    assert abs(losses[0] - math.log(43)) < 0.3
    assert losses[0] > losses[50] > losses[100]
    assert losses[100] < 0.3
    for epoch, loss in losses.items():
        assert f"Epoch {epoch:3d}: loss {loss:.4f}" in printed

    # With detach, no gradient crosses the window boundary; without, it does.
    gradient = result["cross_window_gradient"]
    assert gradient["detach"] == 0.0
    assert gradient["no_detach"] > 1e-4
    assert "0 with detach" in printed


def test_linear_regression(load_example, capsys):
    example = load_example("linear_regression")
    result = example.main(quick=True)
    printed = capsys.readouterr().out

    losses = result["losses"]
    assert len(losses) == 15
    assert losses[0] == 46.0
    steps = -np.diff(losses[:14])
    np.testing.assert_allclose(steps, 3.53, atol=0.01)
    assert abs(result["decrease_per_step"] - 3.53) < 0.005
    assert abs(result["prediction"] - 500.11) < 0.01
    assert "Step  0: loss 46.00" in printed
    assert "The loss falls by 3.53 per step" in printed
    assert "Prediction at x = 42: 500.11" in printed

    # At an exact fit the plain norm loss has a NaN gradient; the rule makes it 0.
    exact = result["exact_fit_gradient"]
    assert all(math.isnan(v) for v in exact["plain"].values())
    assert exact["nan_safe"] == {"w": 0.0, "b": 0.0}


def test_domain_adaptation(load_example, capsys):
    """Gradient reversal must earn its place: on the lit-unevenly target digits the
    network trained without it stays far below, seed by seed, while the one with it
    recovers, and the domain classifier is fooled only with it."""
    example = load_example("domain_adaptation")
    result = example.main(quick=True)
    printed = capsys.readouterr().out

    runs, mean = result["runs"], result["mean"]
    assert result["seeds"] == len(runs["reversal"]) == len(runs["no_reversal"]) >= 3
    for seed, (rev, plain) in enumerate(zip(runs["reversal"], runs["no_reversal"])):
        # Without reversal the source-trained classifier fails on the target...
        assert plain["target"] < 0.5, seed
        # ...with it the target accuracy comes back, far above the baseline.
        assert rev["target"] > 0.8, seed
        assert rev["target"] > plain["target"] + 0.3, seed
        # Both solve the source task.
        assert rev["source"] > 0.9 and plain["source"] > 0.9, seed
        # The domain classifier tells the domains apart only without reversal.
        assert plain["domain"] > 0.95, seed
        assert rev["domain"] < 0.75, seed
    assert mean["reversal"]["target"] > mean["no_reversal"]["target"] + 0.5
    assert (
        f"{mean['reversal']['target']:.3f} with reversal, "
        f"{mean['no_reversal']['target']:.3f} without"
    ) in printed
