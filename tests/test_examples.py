"""The foundation examples, in quick mode, and guards that every example is run by
some test (so none can rot) and listed in the README's Examples table."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_example_is_run_by_a_test():
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for example in sorted((ROOT / "examples").glob("*.py")):
        assert f'"{example.stem}"' in tests or f"'{example.stem}'" in tests, (
            f"no test runs examples/{example.name}"
        )


def test_readme_lists_every_example_once():
    """The README's Examples table has one row per script in examples/, no more."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = sorted(row.split("`")[1] for row in rows)
    assert listed == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.mark.slow
def test_scaled_model_example(load_example, capsys):
    figures = load_example("scaled_model").main(quick=True)
    out = capsys.readouterr().out
    for mode in ("exact", "skip_scale", "stop_input"):
        assert figures[mode]["weights_match_plain"], mode
        assert f"mode={mode!r}" in out
    np.testing.assert_allclose(figures["exact"]["x"], figures["plain_x"], rtol=1e-6)
    np.testing.assert_allclose(
        figures["skip_scale"]["x"], 4 * figures["plain_x"], rtol=1e-5
    )
    np.testing.assert_array_equal(figures["stop_input"]["x"], 0)


def test_module_gradients_example(load_example, capsys):
    m = load_example("module_gradients")
    figures = m.main(quick=True)
    out = capsys.readouterr().out
    assert "grads.linear.weight" in out and "grads.linear.bias" in out
    x = jnp.array([1.0, 2.0, 3.0])
    s = jax.nn.sigmoid(0.1 - 0.4 + 0.9)
    dz = 2 * (s - 1) * s * (1 - s)  # by hand: d/dz (sigmoid(z) - y)^2
    np.testing.assert_allclose(figures["weight_grad"], dz * x[None], rtol=1e-5)
    np.testing.assert_allclose(figures["bias_grad"], [dz], rtol=1e-5)
    assert figures["losses"][-1] < figures["losses"][0]
