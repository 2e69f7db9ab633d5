"""The README's generated tables cannot drift from the code."""

import inspect
import pathlib
import re

import eqxrules
from eqxrules import _cli
from eqxrules.testing import check_rule

README = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()


def _between(name: str) -> str:
    match = re.search(f"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", README, re.S)
    assert match, f"README has no {name} markers"
    return match.group(1).strip()


def test_catalogue_table_matches_catalogue():
    """Regenerate with `python -m eqxrules list --markdown`."""
    assert _between("catalogue") == _cli.catalogue_markdown()


def test_example_rule_is_the_catalogue_rule():
    """The "Declaring a rule" example is `QuadraticSign`'s source, whole: at most
    40 lines. Regenerate with `python scripts/update_readme.py`."""
    source = inspect.getsource(eqxrules.QuadraticSign)
    assert _between("rule-example") == f"```python\n{source}```"
    assert len(source.splitlines()) <= 40


def test_checks_table_matches_check_rule_docstring():
    doc = check_rule.__doc__ or ""
    rows = [line.strip() for line in doc.splitlines() if line.strip().startswith("|")]
    assert rows
    assert _between("checks") == "\n".join(rows)


def test_quick_start_has_exactly_two_commands():
    quick = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```")[0]
    commands = [line for line in quick.splitlines() if line.strip()]
    assert len(commands) == 2
    assert "python -m eqxrules" in commands[0]
    assert "pytest" in commands[1] and "[test,examples]" in commands[1]


def test_thirty_second_example_runs():
    code = README.split("## In 30 seconds", 1)[1].split("```python", 1)[1]
    namespace: dict = {}
    exec(code.split("```", 1)[0], namespace)
    assert namespace["report"].passed
