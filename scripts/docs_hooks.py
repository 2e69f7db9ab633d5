"""mkdocs hooks (`hooks:` in mkdocs.yml): the pages derived from the catalogue.

The rule gallery, which is also the API reference of every catalogue rule, is written
here from `eqxrules.catalogue()`, and each rule's plot is drawn at build time by
`python -m eqxrules plot`: a new rule appears on the site with no edit to `docs/`,
and no plot is committed.

`generated_pages()` needs only eqxrules, not mkdocs, so tests/test_docs.py can check
the API reference's coverage in the normal suite."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

# Document this checkout, not whatever copy of eqxrules is installed.
ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GALLERY = "gallery.md"
PLOTS = "gallery/plots"


def _default(field: dataclasses.Field) -> str | None:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return "(computed)"
    return None


def anchor(name: str) -> str:
    """A bare-name anchor, so the docstrings' `[`Name`][]` references resolve."""
    return f"[](){{#{name}}}"


def gallery_markdown() -> str:
    import eqxrules

    lines = [
        "# Rule gallery",
        "",
        "Every rule of the catalogue, generated from `eqxrules.catalogue()` when the",
        "site is built: its summary, its defaults, the value and derivative of its",
        "first example (drawn by `python -m eqxrules plot` from the rule itself), and",
        "its docstring with the formula. The functional form follows each class.",
        "",
    ]
    for e in eqxrules.catalogue():
        cls = e.module.__name__
        lines += [f"## `{e.name}`", "", e.summary, ""]
        modes = " + ".join(
            m for m, on in (("jvp", e.forward_mode), ("vjp", True)) if on
        )
        lines += [
            f"Module `eqxrules.{cls}`; derivative modes: {modes}; "
            f"exact derivative: {'yes' if e.exact else 'no'}; "
            f"elementwise: {'yes' if e.elementwise else 'no'}.",
            "",
        ]
        defaults = [
            (f.name, _default(f)) for f in dataclasses.fields(e.module) if f.init
        ]
        if defaults:
            lines += ["| field | default |", "|---|---|"]
            lines += [f"| `{n}` | {d or '(required)'} |" for n, d in defaults]
            lines.append("")
        lines += [f"![{e.name}: value and derivative]({PLOTS}/{e.name}.png)", ""]
        lines += [anchor(cls), "", f"::: eqxrules.{cls}", ""]
        lines += [anchor(e.name), "", f"::: eqxrules.{e.name}", ""]
    return "\n".join(lines)


def generated_pages() -> dict[str, str]:
    """The pages this hook adds to the site, by path under `docs/`."""
    return {GALLERY: gallery_markdown()}


def _plots(out: pathlib.Path) -> list[pathlib.Path]:
    subprocess.run(
        [sys.executable, "-m", "eqxrules", "plot", "--out", str(out)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    return sorted(out.glob("*.png"))


_tmp: tempfile.TemporaryDirectory[str] | None = None


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    global _tmp
    for path, content in generated_pages().items():
        files.append(File.generated(config, path, content=content))
    _tmp = tempfile.TemporaryDirectory(prefix="eqxrules-plots-")
    for png in _plots(pathlib.Path(_tmp.name)):
        files.append(
            File.generated(config, f"{PLOTS}/{png.name}", abs_src_path=str(png))
        )
    return files


def on_post_build(config: Any) -> None:
    global _tmp
    if _tmp is not None:
        _tmp.cleanup()
        _tmp = None
