"""Packaging: the runtime needs only jax, jaxlib, equinox and jaxtyping."""

import subprocess
import sys

import eqxrules


def test_import_needs_no_extras():
    """`pip install .` then `python -m eqxrules` must work without the test or
    examples extras: importing eqxrules may not pull them in."""
    code = (
        "import sys, eqxrules, eqxrules._cli; "
        "extras = {'hypothesis', 'pytest', 'optax', 'sklearn', 'matplotlib'}; "
        "print(sorted(extras & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_strategies_load_on_first_use():
    assert eqxrules.testing.strategies.arrays is not None


def test_version_and_typed_marker():
    import pathlib

    assert eqxrules.__version__.count(".") == 2
    assert (pathlib.Path(eqxrules.__file__).parent / "py.typed").exists()
