"""The API reference covers every public name (the optax pattern).

Reads only the site's sources: the pages under `docs/` and the pages the mkdocs hook
(scripts/docs_hooks.py) generates from the catalogue. mkdocs itself is not needed;
`mkdocs build --strict` in `.ci/run` checks that each reference renders."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import eqxrules
import eqxrules.testing

ROOT = pathlib.Path(__file__).resolve().parent.parent
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


def _hooks():
    spec = importlib.util.spec_from_file_location(
        "docs_hooks", ROOT / "scripts" / "docs_hooks.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def site_pages() -> dict[str, str]:
    """Every markdown page of the site, by path under docs/."""
    pages = {
        str(p.relative_to(ROOT / "docs")): p.read_text()
        for p in (ROOT / "docs").rglob("*.md")
    }
    pages.update(_hooks().generated_pages())
    return pages


def public_names() -> set[str]:
    names = {f"eqxrules.{n}" for n in eqxrules.__all__}
    names |= {f"eqxrules.testing.{n}" for n in eqxrules.testing.__all__}
    return names


def documented(pages: dict[str, str]) -> set[str]:
    """The objects the pages render with mkdocstrings' `::: path` directive."""
    return {m for text in pages.values() for m in _DIRECTIVE.findall(text)}


def undocumented(pages: dict[str, str]) -> set[str]:
    return public_names() - documented(pages)


def test_every_public_name_is_in_the_api_reference():
    assert undocumented(site_pages()) == set()


def test_every_reference_names_a_public_object():
    # A stale `::: eqxrules.Gone` would fail the build; a private one would be
    # documented by accident.
    assert documented(site_pages()) - public_names() == set()


def _without(pages: dict[str, str], path: str) -> dict[str, str]:
    return {
        k: re.sub(rf"^:::\s+{re.escape(path)}\s*$", "", v, flags=re.MULTILINE)
        for k, v in pages.items()
    }


def test_coverage_check_catches_a_missing_name():
    # Planted defects: the reference with one name removed, for a catalogue rule
    # (generated gallery), core names (`verify_rule` moved there from
    # `eqxrules.testing`), and an `eqxrules.testing` name.
    pages = site_pages()
    for path in (
        "eqxrules.ste_sign",
        "eqxrules.quantize",
        "eqxrules.verify_rule",
        "eqxrules.testing.check_rule",
    ):
        assert path in documented(pages)
        assert undocumented(_without(pages, path)) == {path}


def test_gallery_follows_the_catalogue():
    # One section, one plot and one reference per rule, derived from the catalogue.
    gallery = _hooks().generated_pages()["gallery.md"]
    for e in eqxrules.catalogue():
        assert f"## `{e.name}`" in gallery
        assert f"(gallery/plots/{e.name}.png)" in gallery
        assert f"::: eqxrules.{e.module.__name__}" in gallery


def test_nothing_is_rendered_without_a_docstring():
    assert _hooks().missing_docstrings(site_pages()) == []


class _Undocumented:
    """A class with a public method that has no docstring."""

    def method(self):
        pass


def test_the_docstring_check_catches_a_missing_one(monkeypatch):
    # Planted defects: a page that renders an undocumented method's class, and a
    # function whose docstring was removed.
    hooks = _hooks()
    monkeypatch.setattr(eqxrules, "_Undocumented", _Undocumented, raising=False)
    page = {"x.md": "::: eqxrules._Undocumented\n"}
    assert hooks.missing_docstrings(page) == ["eqxrules._Undocumented.method"]
    hidden = {
        "x.md": "::: eqxrules._Undocumented\n    options:\n      members: false\n"
    }
    assert hooks.missing_docstrings(hidden) == []
    monkeypatch.setattr(eqxrules.calibrate, "__doc__", None)
    assert hooks.missing_docstrings(site_pages()) == ["eqxrules.calibrate"]
