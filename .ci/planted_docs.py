"""The strict documentation build must fail loudly on each planted defect: a broken
cross-reference, a page missing from the nav, a guide whose code raises, and pages a
reader must not be shown (the API reference as inspection alone renders it, a script
from a CDN, a rule's anchor off its gallery heading: the 0.2.0 site). The defects are
planted in two temporary copies of the checkout (the pages a reader must not be
shown are checked after the guides have run, so a raising guide would hide them),
each built with `mkdocs build --strict` (plots replaced by empty stand-ins and the
guides by a quiet page, to save time); each build must exit non-zero and its output
must name every defect planted in it, each in words no other defect's output holds.
Two builds instead of one per defect: each costs about 35 s of CPU, and CI's last
step is CPU-bound. Run by .ci/run after the real build."""

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
    """Plant `defect` in the copy at `tmp`, whose guides are quiet; return what the
    build's output must say."""
    docs = tmp / "docs"
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
# The defects built together: a raising guide fails the build in `on_post_build`
# before the built pages are checked, so "0.2.0 pages" gets a build of its own.
BUILDS = (("broken reference", "missing page", "raising guide"), ("0.2.0 pages",))


def main(defects: tuple[str, ...] = DEFECTS) -> int:
    unknown = [d for d in defects if d not in DEFECTS]
    if unknown:
        raise ValueError(f"unknown defects {unknown}; known: {DEFECTS}")
    env = dict(os.environ, EQXRULES_DOCS_PLOTS="0", NO_MKDOCS_2_WARNING="1")
    with tempfile.TemporaryDirectory(prefix="eqxrules-planted-") as name:
        runs = []
        for i, group in enumerate(BUILDS):  # built side by side
            group = tuple(d for d in group if d in defects)
            if not group:
                continue
            tmp = pathlib.Path(name) / f"repo{i}"
            shutil.copytree(ROOT, tmp, ignore=IGNORE)
            # The real build has run the guides: none of these defects is in a
            # guide's code, and running every guide again costs minutes of CI.
            _quiet_guides(tmp / "docs")
            expected = {defect: _plant(tmp, defect) for defect in group}
            site = str(pathlib.Path(name) / f"site{i}")
            process = subprocess.Popen(
                [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", site],
                cwd=tmp,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            runs.append((expected, process))
        failures = 0
        for expected, process in runs:
            text, _ = process.communicate()
            for defect, says in expected.items():
                caught = process.returncode != 0 and all(e in text for e in says)
                verdict = "caught" if caught else "NOT CAUGHT"
                print(f"planted {defect}: build exit {process.returncode}, {verdict}")
                if not caught:
                    failures += 1
                    missing = [e for e in says if e not in text]
                    print(f"  the output does not say: {missing}\n{text[-3000:]}")
    return 1 if failures else 0


if __name__ == "__main__":
    # `python .ci/planted_docs.py ["DEFECT" ...]`: every defect, or those named.
    sys.exit(main(tuple(sys.argv[1:]) or DEFECTS))
