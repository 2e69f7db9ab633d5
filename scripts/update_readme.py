"""Regenerate the README's generated tables (the catalogue, and the checks from
`check_rule`'s docstring). `tests/test_readme.py` fails until this has been run
after a rule or a check changes: `python scripts/update_readme.py`."""

import pathlib
import re

from eqxrules import _cli
from eqxrules.testing import check_rule

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _replace(text: str, name: str, body: str) -> str:
    pattern = f"<!-- {name}:begin -->\n.*?<!-- {name}:end -->"
    block = f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->"
    return re.sub(pattern, lambda _: block, text, flags=re.S)


def main() -> None:
    doc = check_rule.__doc__ or ""
    checks = "\n".join(
        line.strip() for line in doc.splitlines() if line.strip().startswith("|")
    )
    text = README.read_text()
    text = _replace(text, "catalogue", _cli.catalogue_markdown())
    text = _replace(text, "checks", checks)
    README.write_text(text)


if __name__ == "__main__":
    main()
