"""Packaging: the runtime needs only jax, jaxlib, equinox and jaxtyping."""

import collections
import itertools
import os
import pathlib
import shlex
import subprocess
import sys

import tomllib
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


ROOT = pathlib.Path(__file__).resolve().parent.parent


_VALUED = {"-p", "-n", "-c", "-o", "-W", "--dist", "--rootdir"}  # take a value


def _marker_expression(args: list[str], default: str) -> str | None:
    """The `-m` expression of a pytest command's arguments (the last one given;
    `default`, from `addopts`, where none is), or `None` if the command selects
    by path or `-k` too (then it runs only part of the suite, whatever its `-m`)."""
    expression = default
    rest = iter(args)
    for arg in rest:
        if arg == "-m":
            expression = next(rest)
        elif arg in _VALUED:
            next(rest)
        elif arg == "-k" or not arg.startswith("-"):
            return None
    return expression


def unselected(run: str, readme_command: str, addopts: str) -> list[dict]:
    """The combinations of the suite's markers (pyproject.toml's) that no pytest run
    of `.ci/run` at the newest versions selects: the README's command (which
    `.ci/run` runs through `tests eval "$cmd"`) and each `tests python -m pytest`
    line. A test is selected by a run whose `-m` expression its markers satisfy."""
    default = _marker_expression(shlex.split(addopts), "")
    assert default is not None, addopts
    commands = []
    if 'tests eval "$cmd"' in run:
        commands.append(readme_command.split("&&")[-1])
    # A run's own command, without what its shell line does with the exit status
    # (`|| newest_rc=$?`).
    commands += [
        line.strip().removesuffix("\\").split("||")[0][len("tests ") :]
        for line in run.splitlines()
        if line.strip().startswith("tests python -m pytest")
    ]
    expressions = []
    for command in commands:
        args = shlex.split(command)
        assert args[:3] == ["python", "-m", "pytest"], command
        expression = _marker_expression(args[3:], default)
        if expression is not None:
            expressions.append(expression or "True")
    markers = sorted(
        m.split(":")[0]
        for m in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
            "ini_options"
        ]["markers"]
    )
    missed = []
    for values in itertools.product([False, True], repeat=len(markers)):
        names = dict(zip(markers, values))
        # A marker no test carries is false, as in pytest's own `-m`.
        scope = collections.defaultdict(bool, names)
        if not any(eval(e, {"__builtins__": {}}, scope) for e in expressions):
            missed.append(names)
    return missed


def test_ci_runs_every_test():
    """`.ci/run` runs every test: the README's command (the quick tier) and its
    other pytest runs at the newest versions together select a test whatever its
    markers. Planted defects: the slow tier narrowed to one marker, or to one file,
    leaves tests out."""
    run = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start") :]
    block = quick_start[quick_start.index("```bash") + 7 :]
    readme_command = block.strip().splitlines()[1]
    assert readme_command.endswith("python -m pytest")
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]["addopts"]
    assert unselected(run, readme_command, addopts) == []
    slow_step = "tests python -m pytest -m slow\n"
    assert slow_step in run
    for planted in (
        "tests python -m pytest -m ci_slow\n",
        "tests python -m pytest -m slow tests/test_matrix.py\n",
    ):
        missed = unselected(run.replace(slow_step, planted), readme_command, addopts)
        assert {"slow": True} in [{k: v for k, v in m.items() if v} for m in missed]
