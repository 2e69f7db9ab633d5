"""`eqxrules._plot.plot`: one PNG per rule, drawn from the rule itself."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest

import eqxrules
from eqxrules import _plot

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # the quick tier's 4 minutes
def test_plots_render_for_each_kind_of_rule(tmp_path):
    # Elementwise and stochastic (a key); not elementwise (a 1-D slice).
    names = ["stochastic_round", "straight_through_onehot"]
    paths = _plot.plot(names, tmp_path / "plots")
    assert paths == [tmp_path / "plots" / f"{n}.png" for n in names]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 2000


def test_plotted_curves_are_the_rule_on_its_boundaries():
    entry = {e.name: e for e in eqxrules.catalogue()}["ste_sign"]
    grid, value, derivative, _ = _plot._curves(entry)
    for kink in entry.examples(jax.random.key(0))[0].kinks():
        assert kink in grid  # evaluated exactly on each boundary
    np.testing.assert_array_equal(value, np.where(grid >= 0, 1, -1))
    np.testing.assert_array_equal(derivative, (np.abs(grid) <= 1).astype(np.float32))


def test_none_plots_every_rule_of_the_catalogue(tmp_path, monkeypatch):
    # A two-entry catalogue and flat curves: this checks the selection, cheaply.
    entries = eqxrules.catalogue()[:2]
    monkeypatch.setattr(_plot, "catalogue", lambda: entries)
    flat = (np.zeros(3), np.zeros(3), np.zeros(3), "x")
    monkeypatch.setattr(_plot, "_curves", lambda entry: flat)
    paths = _plot.plot(None, tmp_path)
    assert [p.stem for p in paths] == [e.name for e in entries]
    assert all(p.read_bytes().startswith(PNG) for p in paths)


def test_unknown_name_lists_the_valid_ones(tmp_path):
    with pytest.raises(
        ValueError, match=r"unknown rule name\(s\) \['nope'\].*ste_sign"
    ):
        _plot.plot(["ste_sign", "nope"], tmp_path)
    assert not list(tmp_path.iterdir())


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(
        ModuleNotFoundError, match=r"pip install 'eqxrules\[examples\]'"
    ):
        _plot.plot(["ste_sign"], tmp_path)
