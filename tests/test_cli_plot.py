"""`python -m eqxrules plot`: what it prints, and a rule class of the user's own
(issue 40 §2: 0.3 said "unknown rule(s)")."""

from __future__ import annotations

import json
import pathlib

import pytest

from eqxrules import _cli, _plot


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = _cli.main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture
def fake_plot(monkeypatch):
    """`plot` replaced by one that writes nothing: for what the command line
    prints, not for the drawing."""

    def fake(rules, out):
        return [pathlib.Path(out) / f"{rule.name}.png" for rule in rules]

    monkeypatch.setattr(_plot, "plot", fake)


def test_plot_help_says_what_verbose_does_and_where_plots_go(capsys):
    """0.2.0's `plot --help` listed `--verbose` "not for plot", and `plot
    --verbose` was an error; nor did it say where the plots went."""
    with pytest.raises(SystemExit) as e:
        _cli.main(["plot", "--help"])
    assert e.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "progress on stderr (verify, plot)" in shown
    assert "not for plot" not in shown
    assert "./plots/NAME.png unless `--out`" in shown
    assert "(default: plots, under the current directory)" in shown


@pytest.mark.parametrize("argv", [["--verbose", "plot"], ["plot", "--verbose"]])
def test_plot_verbose_shows_progress(capsys, fake_plot, tmp_path, argv):
    code = _cli.main([*argv, "ste_sign", "SteRound", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 0
    assert "plotting ste_sign ..." in err and "plotting ste_round ..." in err
    assert f"wrote {tmp_path / 'ste_round.png'} in " in err


def test_plot_says_where_it_wrote(capsys, fake_plot, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = _run(capsys, "plot", "ste_sign")
    assert code == 0 and out.splitlines()[0] == str(pathlib.Path("plots/ste_sign.png"))
    default = "(the default: choose another with `--out DIR`)"
    assert f"Wrote 1 plot to {tmp_path / 'plots'} {default}." in out
    code, out = _run(capsys, "plot", "ste_sign", "detach", "--out", "elsewhere")
    assert f"Wrote 2 plots to {tmp_path / 'elsewhere'}." in out
    assert "the default" not in out


@pytest.mark.parametrize(
    "argv", [["--json", "plot", "ste_sign"], ["plot", "ste_sign", "--json"]]
)
def test_plot_json_before_or_after(capsys, fake_plot, tmp_path, argv):
    code, out = _run(capsys, *argv, "--out", str(tmp_path))
    assert code == 0 and json.loads(out) == [str(tmp_path / "ste_sign.png")]


USER_RULE = """
from typing import ClassVar

import jax.numpy as jnp

import eqxrules


class Clip6(eqxrules.ElementwiseRule):
    \"\"\"ReLU6: clip(x, 0, 6), derivative `t` on [0, 6].\"\"\"

    summary: ClassVar[str] = "clip(x, 0, 6)"

    def kinks(self):
        return (0.0, 6.0)

    def primal(self, x):
        return jnp.clip(x, 0.0, 6.0)

    def slope(self, x):
        return (x >= 0) & (x <= 6)

    def reference_forward(self, x):
        return jnp.minimum(jnp.maximum(x, 0.0), 6.0)

    def reference_derivative(self, x):
        return jnp.minimum(jnp.maximum(x, 0.0), 6.0)


def clip6(x):
    return Clip6()(x)
"""


def test_plot_a_user_rule_class(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_plotted.py").write_text(USER_RULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out = _run(capsys, "plot", "my_plotted:Clip6", "--out", str(tmp_path))
    assert code == 0, out
    assert (tmp_path / "clip6.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="eqxrules plot: 'my_plotted:clip6' is not a"):
        _cli.main(["plot", "my_plotted:clip6", "--out", str(tmp_path)])
