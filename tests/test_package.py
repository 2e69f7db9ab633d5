"""Packaging: the runtime needs only jax, jaxlib, equinox and jaxtyping."""

import ast
import os
import pathlib
import subprocess
import sys

import conftest
from conftest import once_per_session

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


def _update_stubs():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts/update_stubs.py"
    spec = importlib.util.spec_from_file_location("update_stubs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rules_type_stub_is_current():
    """Type checkers see the rules through eqxrules/_rules/__init__.pyi, generated
    from the catalogue: run `python scripts/update_stubs.py` after a rule changes."""
    stubs = _update_stubs()
    assert stubs.STUB.read_text() == stubs.stub()


def test_the_stub_check_catches_a_stale_stub(monkeypatch):
    # Planted defect: a rule whose derived signature changed since the stub was
    # written (a new keyword, as adding a hyperparameter gives).
    import inspect

    stubs = _update_stubs()
    fn = eqxrules.ste_sign
    sig = inspect.signature(fn)
    extra = inspect.Parameter("width", inspect.Parameter.KEYWORD_ONLY, default=2.0)
    monkeypatch.setattr(
        fn, "__signature__", sig.replace(parameters=[*sig.parameters.values(), extra])
    )
    assert "width: Any = 2.0" in stubs.stub()
    assert stubs.STUB.read_text() != stubs.stub()


def test_version_matches_the_changelog():
    import pathlib
    import re

    changelog = (
        pathlib.Path(__file__).resolve().parent.parent / "CHANGELOG.md"
    ).read_text()
    released = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M
    )
    assert released and released[0] == eqxrules.__version__


def test_once_per_session_computes_once_and_shares_it():
    """The tests' `once_per_session` (tests/conftest.py) runs `compute` for the
    first caller only; a caller with another name gets its own."""
    calls = []

    def compute():
        calls.append(1)
        return {"calls": len(calls)}

    name = f"probe-{os.getpid()}"
    assert once_per_session(name, compute) == {"calls": 1}
    assert once_per_session(name, compute) == {"calls": 1}
    assert once_per_session(name + "-other", compute) == {"calls": 2}
    assert len(calls) == 2


def tier_problems(modules, tests) -> list[str]:
    """What the tier policy (tests/conftest.py) names that does not exist: a module
    in `modules`, or a test function in `tests` (module -> names). A renamed test
    or module would otherwise change tiers silently."""
    here = pathlib.Path(__file__).parent
    problems = [f"no module {m}" for m in modules if not (here / m).is_file()]
    for module, names in tests.items():
        path = here / module
        defined = set()
        if path.is_file():
            tree = ast.parse(path.read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        problems += [f"no test {module}::{n}" for n in names if n not in defined]
    return problems


def test_the_tier_policy_names_what_exists():
    """Every module and test the tiers name exists, and `.ci/run` runs the
    `ci_slow` part; a misspelt name (the planted defect) is found."""
    modules = [*conftest.SLOW_MODULES, *conftest.CATALOGUE_WIDE, *conftest.SLOW_IN_CI]
    tests = {**conftest.FIRST_CASE_ONLY}
    for module, names in conftest.SLOW_TESTS.items():
        tests[module] = (*tests.get(module, ()), *names)
    assert tier_problems(modules, tests) == []
    run = (pathlib.Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert "python -m pytest -m ci_slow" in run
    planted = tier_problems(["test_matrixx.py"], {"test_cli.py": ("test_nope",)})
    assert planted == ["no module test_matrixx.py", "no test test_cli.py::test_nope"]
