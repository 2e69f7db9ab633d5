"""The strict documentation build must fail loudly on each planted defect: a broken
cross-reference, a page missing from the nav, and a guide whose code raises. Each is
planted in a temporary copy of the checkout, which is then built with
`mkdocs build --strict` (plots replaced by empty stand-ins, to save time); the build
must exit non-zero and name the defect. Run by .ci/run after the real build."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns(".git", ".venv*", ".ci-*", "site", "__pycache__")


def _plant(tmp: pathlib.Path, defect: str) -> str:
    """Plant `defect` in the copy at `tmp`; return what the build's output must say."""
    docs = tmp / "docs"
    if defect == "broken reference":
        index = docs / "index.md"
        index.write_text(index.read_text() + "\nSee [`NoSuchName`][].\n")
        return "NoSuchName"
    if defect == "missing page":
        config = tmp / "mkdocs.yml"
        text = config.read_text().replace(
            "  - Rule gallery: gallery.md\n",
            "  - Rule gallery: gallery.md\n  - Gone: gone.md\n",
        )
        config.write_text(text)
        return "gone.md"
    if defect == "raising guide":
        for page in (docs / "guides").glob("*.md"):
            page.write_text("# Quiet\n\n```python\nx = 1\n```\n")
        (docs / "guides" / "writing-rules.md").write_text(
            "# Broken\n\n```python\nraise RuntimeError('planted guide failure')\n```\n"
        )
        return "planted guide failure"
    raise ValueError(defect)


def main() -> int:
    env = dict(os.environ, EQXRULES_DOCS_PLOTS="0", NO_MKDOCS_2_WARNING="1")
    defects = ("broken reference", "missing page", "raising guide")
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
            caught = process.returncode != 0 and expected in text
            verdict = "caught" if caught else "NOT CAUGHT"
            print(f"planted {defect}: build exit {process.returncode}, {verdict}")
            if not caught:
                failures += 1
                print(text[-3000:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
