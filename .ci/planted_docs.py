"""The strict documentation build must fail loudly on each planted defect: a broken
cross-reference, a page missing from the nav, a guide whose code raises, and pages a
reader must not be shown (the API reference as inspection alone renders it, a script
from a CDN, a rule's anchor off its gallery heading: the 0.2.0 site). Each is planted
in a temporary copy of the checkout, which is then built with `mkdocs build --strict`
(plots replaced by empty stand-ins and the guides by a quiet page, to save time); the build must exit non-zero and
name the defect. Run by .ci/run after the real build."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns(".git", ".venv*", ".ci-*", "site", "__pycache__")


def _edit(path: pathlib.Path, old: str, new: str) -> None:
    text = path.read_text()
    if old not in text:
        raise ValueError(f"cannot plant: {path.name} no longer has {old!r}")
    path.write_text(text.replace(old, new))


def _quiet_guides(docs: pathlib.Path) -> None:
    for page in (docs / "guides").glob("*.md"):
        page.write_text("# Quiet\n\n```python\nx = 1\n```\n")


def _plant(tmp: pathlib.Path, defect: str) -> tuple[str, ...]:
    """Plant `defect` in the copy at `tmp`; return what the build's output must say.
    The guides are quietened first (the real build has run them): none of these
    defects is in a guide's code, and running every guide again, four times over,
    would cost minutes of CI."""
    docs = tmp / "docs"
    _quiet_guides(docs)
    if defect == "broken reference":
        index = docs / "index.md"
        index.write_text(index.read_text() + "\nSee [`NoSuchName`][].\n")
        return ("NoSuchName",)
    if defect == "missing page":
        config = tmp / "mkdocs.yml"
        text = config.read_text().replace(
            "  - Rule gallery: gallery.md\n",
            "  - Rule gallery: gallery.md\n  - Gone: gone.md\n",
        )
        config.write_text(text)
        return ("gone.md",)
    if defect == "raising guide":
        (docs / "guides" / "writing-rules.md").write_text(
            "# Broken\n\n```python\nraise RuntimeError('planted guide failure')\n```\n"
        )
        return ("planted guide failure",)
    if defect == "0.2.0 pages":
        config = tmp / "mkdocs.yml"
        # Inspection alone: built-ins' docstrings on fields, private bases, `Union`.
        _edit(config, "              - scripts/docs_api.py:ReaderFacingApi\n", "")
        _edit(config, "            extensions:\n", "")
        _edit(
            config,
            "  - javascripts/mathjax/tex-svg-full.js\n",
            "  - https://unpkg.com/mathjax@3/es5/tex-mml-chtml.js\n",
        )
        hooks = tmp / "scripts" / "docs_hooks.py"
        _edit(hooks, "## `{e.name}` {{ #{e.name} }}", "## `{e.name}`")
        _edit(
            hooks,
            'lines += [f"::: eqxrules.{e.name}", ""]',
            'lines += [anchor(e.name), "", f"::: eqxrules.{e.name}", ""]',
        )
        return (
            "a built-in's docstring: 'Convert a string or number",
            "a private base: 'Bases: eqxrules._rules.sign._Sign'",
            "'_M' in the signature",
            'loads <script src="https://unpkg.com/mathjax@3',
            "#quadratic_sign is a <a>, not its section's heading",
        )
    raise ValueError(defect)


DEFECTS = ("broken reference", "missing page", "raising guide", "0.2.0 pages")


def main(defects: tuple[str, ...] = DEFECTS) -> int:
    env = dict(os.environ, EQXRULES_DOCS_PLOTS="0", NO_MKDOCS_2_WARNING="1")
    with tempfile.TemporaryDirectory(prefix="eqxrules-planted-") as name:
        runs = []
        for i, defect in enumerate(defects):  # built side by side
            tmp = pathlib.Path(name) / f"repo{i}"
            shutil.copytree(ROOT, tmp, ignore=IGNORE)
            expected = _plant(tmp, defect)
            site = str(pathlib.Path(name) / f"site{i}")
            process = subprocess.Popen(
                [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", site],
                cwd=tmp,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            runs.append((defect, expected, process))
        failures = 0
        for defect, expected, process in runs:
            text, _ = process.communicate()
            caught = process.returncode != 0 and all(e in text for e in expected)
            verdict = "caught" if caught else "NOT CAUGHT"
            print(f"planted {defect}: build exit {process.returncode}, {verdict}")
            if not caught:
                failures += 1
                missing = [e for e in expected if e not in text]
                print(f"  the output does not say: {missing}\n{text[-3000:]}")
    return 1 if failures else 0


if __name__ == "__main__":
    # `python .ci/planted_docs.py ["DEFECT" ...]`: every defect, or those named.
    sys.exit(main(tuple(sys.argv[1:]) or DEFECTS))
