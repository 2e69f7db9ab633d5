"""The optional extras: what needs one says which to install when it is missing."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _without_hypothesis(code: str) -> subprocess.CompletedProcess:
    # `None` in `sys.modules` makes `import hypothesis` fail as if it were absent.
    # Run from the checkout's root, so that `-c` imports this eqxrules.
    prelude = "import sys; sys.modules['hypothesis'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT
    )


@pytest.mark.slow
def test_strategies_without_hypothesis_name_the_extra():
    """`eqxrules.testing.strategies` needs the `test` extra: without hypothesis,
    importing it (either way) says which extra to install; `eqxrules` still
    imports."""
    for code in (
        "import eqxrules.testing.strategies",
        "import eqxrules.testing; eqxrules.testing.strategies",
    ):
        run = _without_hypothesis(code)
        assert run.returncode == 1
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: `eqxrules.testing.strategies` needs")
        assert "pip install 'eqxrules[test]'" in last
    assert _without_hypothesis("import eqxrules, eqxrules.testing").returncode == 0
