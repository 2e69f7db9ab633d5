"""The guides under docs/guides/ are runnable pages: every ```python block of a page
runs, in order, in one fresh process, when the strict site build runs
(scripts/docs_hooks.py; CI's docs step, in an environment with the docs extra alone,
and `.ci/planted_docs.py` shows a raising guide failing that build). The guides
themselves run there only, not here as well: this file tests the runner (a planted
raising block is named, only python blocks run, a guide needs code) and that every
guide is listed."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _hooks():
    spec = importlib.util.spec_from_file_location(
        "docs_hooks", ROOT / "scripts" / "docs_hooks.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = _hooks()
PAGES = HOOKS.guide_pages()


def test_there_are_guides():
    assert len(PAGES) >= 1


def test_a_raising_guide_fails_and_names_its_block(tmp_path):
    # Planted defect: the second block raises.
    page = tmp_path / "broken.md"
    page.write_text(
        "# Broken\n\n```python\nx = 1\n```\n\nText.\n\n"
        "```python\nassert x == 2, 'planted'\n```\n\n```py\nnot run(\n```\n"
    )
    problem = HOOKS.run_guide(page)
    assert problem is not None
    assert "broken.md" in problem and "planted" in problem
    assert 'broken.md", line 10' in problem


def test_only_python_blocks_run_and_indented_blocks_too():
    text = (
        "```py\nraise SystemExit(3)\n```\n"
        "!!! Example\n\n    ```python\n    y = 2\n    ```\n"
        "```python\nprint(y)\n```\n"
    )
    program = HOOKS.guide_program(text)
    assert "SystemExit" not in program
    assert "y = 2\n" in program and "print(y)" in program


def test_a_guide_without_code_is_refused(tmp_path):
    page = tmp_path / "empty.md"
    page.write_text("# Nothing to run\n\n```py\nx = 1\n```\n")
    with pytest.raises(ValueError, match="at least one"):
        HOOKS.run_guide(page)


def _unlisted(pages, text: str, prefix: str) -> list[str]:
    return [p.name for p in pages if f"{prefix}{p.name}" not in text]


def test_every_guide_is_in_the_nav_and_the_readme():
    nav = (ROOT / "mkdocs.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    assert _unlisted(PAGES, nav, "guides/") == []
    assert _unlisted(PAGES, readme, "(docs/guides/") == []
    # Planted defect: a guide that neither lists.
    extra = ROOT / "docs" / "guides" / "unlisted-guide.md"
    assert _unlisted([*PAGES, extra], nav, "guides/") == ["unlisted-guide.md"]
    assert _unlisted([*PAGES, extra], readme, "(docs/guides/") == ["unlisted-guide.md"]
