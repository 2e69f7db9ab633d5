"""Regenerate what is derived from the catalogue and committed: the README's
catalogue table, its checks (from `check_rule`'s docstring) and its example rule
(the source of `QuadraticSign`), and the rules' type stub
(`scripts/update_stubs.py`). `tests/test_readme.py` and `tests/test_package.py`
fail until this has been run after a rule or a check changes:
`python scripts/update_readme.py`."""

import inspect
import pathlib
import re
import sys

import eqxrules
from eqxrules import _cli
from eqxrules.testing import check_rule

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _replace(text: str, name: str, body: str) -> str:
    pattern = f"<!-- {name}:begin -->\n.*?<!-- {name}:end -->"
    block = f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->"
    return re.sub(pattern, lambda _: block, text, flags=re.S)


def example_rule() -> str:
    """The README's example of a whole rule: a real one of the catalogue."""
    return f"```python\n{inspect.getsource(eqxrules.QuadraticSign)}```"


def main() -> None:
    doc = check_rule.__doc__ or ""
    checks = "\n".join(
        line.strip() for line in doc.splitlines() if line.strip().startswith("|")
    )
    text = README.read_text()
    text = _replace(text, "catalogue", _cli.catalogue_markdown())
    text = _replace(text, "checks", checks)
    text = _replace(text, "rule-example", example_rule())
    README.write_text(text)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import update_stubs

    update_stubs.STUB.write_text(update_stubs.stub())


if __name__ == "__main__":
    main()
