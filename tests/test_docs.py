"""The API reference covers every public name (the optax pattern), and the checks the
build runs on its pages catch what a reader must not meet.

Reads only the site's sources: the pages under `docs/` and the pages the mkdocs hook
(scripts/docs_hooks.py) generates from the catalogue, and feeds the hook's page checks
and the API extension's functions (scripts/docs_api.py) planted pages and objects.
mkdocs itself is not needed; `mkdocs build --strict` in `.ci/run` checks that each
reference renders, runs the page checks on the whole site, and .ci/planted_docs.py
shows that build failing on planted defects."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import eqxrules
import eqxrules.testing

ROOT = pathlib.Path(__file__).resolve().parent.parent
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hooks():
    return _script("docs_hooks")


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


def test_gallery_sections_carry_the_rules_anchors():
    # `#quadratic_sign` must land on the section, not on the functional form at its
    # end: the heading has the id, and no other anchor takes it.
    gallery = _hooks().generated_pages()["gallery.md"]
    for e in eqxrules.catalogue():
        assert f"## `{e.name}` {{ #{e.name} }}" in gallery
        assert f"{{#{e.name}}}" not in gallery


# Pieces of pages as 0.2.0's build wrote them (planted defects), and as they must be.
_OLD_ATTRIBUTE = """<div class="doc doc-contents ">
<p>Convert a string or number to a floating point number, if possible.</p>
</div>"""
_OLD_STR_ATTRIBUTE = """<p>str(object='') -&gt; str
str(bytes_or_buffer[, encoding[, errors]]) -&gt; str</p>"""
_NEW_ATTRIBUTE = """<div class="doc doc-contents ">
<p>A non-negative number, or <code>None</code> for no clipping.</p>
</div>"""
_OLD_BASES = """<p class="doc doc-class-bases">
    Bases: <code>eqxrules._rules.sign._Sign</code></p>"""
_OLD_MODULE_BASE = """<p class="doc doc-class-bases">
    Bases: <code>equinox._module._module.Module</code></p>"""
_NEW_BASES = """<p class="doc doc-class-bases">
    Bases: <code>eqxrules.JVPRule</code>, <code>equinox.Module</code></p>"""


def _signature(text: str) -> str:
    return (
        '<div class="doc-signature highlight"><pre><span></span><code>'
        f"{text}</code></pre></div>"
    )


def test_page_checks_catch_what_api_pages_showed():
    problems = _hooks().api_problems
    assert problems(_NEW_ATTRIBUTE + _NEW_BASES) == []
    assert "a built-in's docstring" in problems(_OLD_ATTRIBUTE)[0]
    assert "a built-in's docstring" in problems(_OLD_STR_ATTRIBUTE)[0]
    assert "a private base" in problems(_OLD_BASES)[0]
    assert "a private base" in problems(_OLD_MODULE_BASE)[0]
    readable = [
        "calibrate(\n    model: M,\n    key: PRNGKeyArray | None = None,\n) -&gt; M",
        'scaled_call(\n    mode: Literal[\n        "exact", "skip_scale"\n    ] = "exact",\n)',
        "quantize(\n    where: Callable[[Any], bool] = _has_weight_layer,\n)",
    ]
    for text in readable:
        assert problems(_signature(text)) == [], text
    for text, word in [
        ("calibrate(\n    model: _M,\n) -&gt; _M", "'_M'"),
        ("sample(\n    key: Union,\n) -&gt; Array", "'Union'"),
        ("scaled_call(\n    mode: Literal = 'exact',\n)", "'Literal'"),
        ("f(x: eqxrules._catalogue.Rule)", "'eqxrules._catalogue'"),
    ]:
        (found,) = problems(_signature(text))
        assert found.startswith(word), (text, found)
    # An unwrapped signature (no formatter installed) runs off the page.
    one_line = "f(" + ", ".join(["x: int"] * 20) + ")"
    assert len(one_line) > _hooks().SIGNATURE_WIDTH
    (long,) = problems(_signature(one_line))
    assert long.startswith(f"a signature line of {len(one_line)} characters")
    assert problems(_signature("f(\n" + "    x: int,\n" * 20 + ")")) == []


def test_page_checks_catch_what_loads_from_another_host():
    found = _hooks().external_resources
    local = (
        '<script src="../javascripts/mathjax/tex-svg-full.js"></script>'
        '<link rel="stylesheet" href="../assets/stylesheets/main.css">'
        '<a href="https://github.com/jax-ml/jax">JAX</a>'
        '<link rel="canonical" href="https://example.org/eqxrules/">'
    )
    assert found(local) == []
    planted = [
        '<script src="https://unpkg.com/mathjax@3/es5/tex-mml-chtml.js"></script>',
        '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">',
        '<link rel="preconnect" href="https://fonts.gstatic.com" crossorigin>',
        '<img src="//example.org/plot.png">',
        "<style>@import url('https://fonts.googleapis.com/css');</style>",
    ]
    for tag in planted:
        assert len(found(local + tag)) == 1, tag
    css = _hooks().stylesheet_resources
    assert css("a { background: url(../images/x.svg) }") == []
    assert len(css("@font-face { src: url('https://fonts.gstatic.com/x.woff2') }")) == 1


def test_page_checks_catch_a_rule_anchor_off_its_heading():
    check = _hooks().anchor_problems
    new = '<h2 id="quadratic_sign"><code>quadratic_sign</code></h2>'
    old = (
        '<h2 id="quadratic_sign_1"><code>quadratic_sign</code></h2>'
        '<p><a href="" id="quadratic_sign"></a></p>'
    )
    assert check(new, ["quadratic_sign"]) == []
    assert check(old, ["quadratic_sign"]) == [
        "#quadratic_sign is a <a>, not its section's heading"
    ]
    assert check("", ["quadratic_sign"]) == [
        "#quadratic_sign is nothing, not its section's heading"
    ]


def test_fields_show_their_own_documentation():
    api = _script("docs_api")
    # The inspected docstring of a data attribute is its value's type's (the leak).
    assert api.inherited_docstring(1.0, float.__doc__)
    assert api.inherited_docstring(eqxrules.checks.real, eqxrules.checks.Check.__doc__)
    assert not api.inherited_docstring(eqxrules.catalogue, eqxrules.catalogue.__doc__)
    assert not api.inherited_docstring(1.0, "A non-negative number.")
    # What replaces it: the docstring under the assignment, or the owner's list.
    assert api.attribute_docstring(eqxrules.SteSign, "clip_value") == (
        "A non-negative number, or `None` for no clipping."
    )
    assert api.attribute_docstring(eqxrules.testing, "CHECKS") == (
        "Every check `check_rule` runs, in order."
    )
    assert api.attribute_docstring(eqxrules.checks, "positive") == (
        "The value must be finite and positive"
    )
    assert api.attribute_docstring(eqxrules.QuadraticSign, "clip_value") is None
    doc = """Planted.

    - `lo`, `hi`: the lowest and highest level,
        finite.
    - `exact` (default `False`): whether it is exact.

    Not an item: `lo`, said again.

    | check | the value must |
    |---|---|
    | `real` | be real |
    | `a(b)`, `c(d)` | be either |
    """
    assert _script("docs_api").documented_names(doc) == {
        "lo": "The lowest and highest level, finite.",
        "hi": "The lowest and highest level, finite.",
        "exact": "Whether it is exact.",
        "real": "The value must be real",
    }


class _PrivateBase(eqxrules.JVPRule):
    """A private family base (planted)."""


class _Planted(_PrivateBase):
    """A rule whose only direct base is private."""


def test_bases_are_shown_by_public_paths():
    api = _script("docs_api")
    assert api.public_bases(eqxrules.ApproxSign) == ["eqxrules.ElementwiseRule"]
    assert api.public_bases(_Planted) == ["eqxrules.JVPRule"]
    assert api.public_bases(eqxrules.Domain) == []
    assert api.public_bases(eqxrules.Rule) == ["equinox.Module"]
    assert api.public_bases(eqxrules.testing.RuleCheckError) == ["AssertionError"]
    assert api.public_path(_PrivateBase) is None


def test_annotations_are_shown_readable():
    import eqxrules._layers as layers
    import eqxrules._rules.scaled as scaled

    readable = _script("docs_api").readable_annotation
    assert readable("_M", vars(layers)) == "M"
    assert readable("Quantizer | None", vars(layers)) == "Callable[..., Array] | None"
    # jaxtyping exports `PRNGKeyArray`: shown as written, not as the `Union` it is.
    assert readable("PRNGKeyArray | None", vars(layers)) == "PRNGKeyArray | None"
    assert (
        readable("Mode", vars(scaled)) == 'Literal["exact", "skip_scale", "stop_input"]'
    )
    assert readable('Float[Array, "*shape"]', vars(scaled)) == 'Float[Array, "*shape"]'


def test_defaults_and_values_are_shown_as_python():
    api = _script("docs_api")
    real = eqxrules.checks.real
    assert api.readable_default(real, repr(real)) == "real"
    assert api.readable_value(real, repr(real)) == "Check(...)"
    assert api.readable_value(1.0, "1.0") == "1.0"
