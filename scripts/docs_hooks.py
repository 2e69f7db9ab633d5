"""mkdocs hooks (`hooks:` in mkdocs.yml): the pages derived from the catalogue.

The rule gallery, which is also the API reference of every catalogue rule, is written
here from `eqxrules.catalogue()`, and each rule's plot is drawn at build time by
`python -m eqxrules plot`: a new rule appears on the site with no edit to `docs/`,
and no plot is committed.

`generated_pages()` needs only eqxrules, not mkdocs, so tests/test_docs.py can check
the API reference's coverage in the normal suite."""

from __future__ import annotations

import dataclasses
import inspect
import os
import pathlib
import re
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
GUIDES = ROOT / "docs" / "guides"
# How long one guide page may run: the guides are short by design (CI runs them
# twice: in the test suite and in the strict build).
GUIDE_TIMEOUT = 240


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
        # The section heading carries the rule's name as its id, so `#ste_sign` (and
        # a docstring's [`ste_sign`][]) lands on the whole section.
        lines += [f"## `{e.name}` {{ #{e.name} }}", "", e.summary, ""]
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
        # The protocol methods (`primal`, `tangent`, ...) are documented once, on
        # the `Rule` bases; here the class docstring holds the maths and the table
        # above the fields.
        lines += [anchor(cls), "", f"::: eqxrules.{cls}", _NO_MEMBERS, ""]
        lines += [f"::: eqxrules.{e.name}", ""]
    return "\n".join(lines)


_FENCE = re.compile(
    r"^(?P<indent>[ ]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
    re.MULTILINE | re.DOTALL,
)


def guide_program(text: str) -> str:
    """Every ```` ```python ```` block of a page, in order, as one program whose line
    numbers are the page's (everything else is blank), so a traceback names the
    page's own line. Code that is shown but not run is fenced with another language
    (`py`, `pycon`, `text`)."""
    lines = [""] * (text.count("\n") + 1)
    for m in _FENCE.finditer(text):
        first = text.count("\n", 0, m.start("body"))
        indent = len(m["indent"])
        for i, line in enumerate(m["body"].splitlines()):
            lines[first + i] = line[indent:]
    return "\n".join(lines) if any(lines) else ""


# Runs the program read from stdin as if it were the page itself.
_BOOT = (
    "import sys; source = sys.stdin.read(); "
    "exec(compile(source, sys.argv[1], 'exec'), {'__name__': '__main__'})"
)


def guide_pages() -> list[pathlib.Path]:
    """The guides: every page under `docs/guides/`, each executed when the site is
    built and in the test suite."""
    return sorted(GUIDES.glob("*.md"))


def start_guide(page: pathlib.Path) -> subprocess.Popen[str]:
    """Run `page`'s program in a fresh Python process, from the repository root
    (so `examples` imports), with no plotting window."""
    program = guide_program(page.read_text())
    if not program:
        raise ValueError(f"{page}: a guide must have at least one ```python block.")
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    source = tempfile.TemporaryFile("w+")
    source.write(program)
    source.seek(0)
    process = subprocess.Popen(
        [sys.executable, "-c", _BOOT, str(page)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=source,
        text=True,
    )
    source.close()  # the child has its own handle
    return process


def finish_guide(page: pathlib.Path, process: subprocess.Popen[str]) -> str | None:
    """`None` if `page`'s program ran cleanly, else why not (with its output)."""
    try:
        out, _ = process.communicate(timeout=GUIDE_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        return f"{page.name}: ran past {GUIDE_TIMEOUT} s\n{out[-3000:]}"
    if process.returncode != 0:
        return (
            f"{page.name}: its code raised (exit {process.returncode})\n{out[-3000:]}"
        )
    return None


def run_guide(page: pathlib.Path) -> str | None:
    return finish_guide(page, start_guide(page))


# The rule protocol (documented once, on the `Rule` bases) and the internal hooks
# some families share: not shown on each rule; its own API (a `from_data`, say) is.
PROTOCOL = (
    "bwd call_kwargs domain elementwise exact examples forward_mode function "
    "functional_name fwd higher_order input_domain invalid_hyperparameters is_exact "
    "kinks primal pytree_input reference_derivative reference_forward reference_vjp "
    "rule_name summary tangent slope shape_cotangent block check_length "
    "constant_on_non_negative needs_key second_order cotangent_thresholds"
).split()
_NO_MEMBERS = f'    options:\n      filters: ["!^_", "!^({"|".join(PROTOCOL)})$"]'
_NEGATIVE_FILTER = re.compile(r'"!([^"]+)"')
_DIRECTIVE = re.compile(
    r"^:::\s+(?P<path>[\w.]+)[ ]*\n(?P<options>(?:[ ]{4,}\S.*\n?)*)", re.MULTILINE
)


def _resolve(path: str) -> Any:
    import importlib

    module, _, name = path.rpartition(".")
    try:
        return importlib.import_module(path)
    except ImportError:
        return getattr(importlib.import_module(module), name)


def _own_members(cls: type) -> dict[str, Any]:
    """The public methods and properties `cls` defines itself (mkdocstrings shows
    each with its own docstring: it does not inherit one)."""
    out = {}
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if isinstance(value, property) or inspect.isfunction(value):
            out[name] = value
    return out


def missing_docstrings(pages: dict[str, str]) -> list[str]:
    """Every object the pages render (`::: path`) without a docstring, and, for a
    class rendered with its members, each of its own public methods without one."""
    missing = []
    for text in pages.values():
        for m in _DIRECTIVE.finditer(text):
            path = m["path"]
            obj = _resolve(path)
            if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj):
                if not (obj.__doc__ or "").strip():
                    missing.append(path)
            if inspect.isclass(obj) and "members: false" not in m["options"]:
                hidden = [re.compile(f) for f in _NEGATIVE_FILTER.findall(m["options"])]
                missing += [
                    f"{path}.{name}"
                    for name, member in _own_members(obj).items()
                    if not (member.__doc__ or "").strip()
                    and not any(h.search(name) for h in hidden)
                ]
    return sorted(set(missing))


def generated_pages() -> dict[str, str]:
    """The pages this hook adds to the site, by path under `docs/`."""
    return {GALLERY: gallery_markdown()}


def _plots(out: pathlib.Path) -> list[pathlib.Path]:
    if os.environ.get("EQXRULES_DOCS_PLOTS") == "0":
        # Empty stand-ins (the planted-defect builds of .ci/planted_docs.py, which
        # test the build's checks, not the plots).
        import eqxrules

        for e in eqxrules.catalogue():
            (out / f"{e.name}.png").write_bytes(b"")
        return sorted(out.glob("*.png"))
    subprocess.run(
        [sys.executable, "-m", "eqxrules", "plot", "--out", str(out)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    return sorted(out.glob("*.png"))


_tmp: tempfile.TemporaryDirectory[str] | None = None


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    pages = {f.src_uri: f.content_string for f in files if f.src_uri.endswith(".md")}
    pages.update(generated_pages())
    missing = missing_docstrings(pages)
    if missing:
        raise PluginError(
            "the API reference renders these without a docstring: " + ", ".join(missing)
        )
    global _tmp
    for path, content in generated_pages().items():
        files.append(File.generated(config, path, content=content))
    _tmp = tempfile.TemporaryDirectory(prefix="eqxrules-plots-")
    for png in _plots(pathlib.Path(_tmp.name)):
        files.append(
            File.generated(config, f"{PLOTS}/{png.name}", abs_src_path=str(png))
        )
    return files


# What a reader of the built site must never meet. `on_post_build` checks every page,
# so the build fails on it; tests/test_docs.py plants each defect in a page.

# Signatures are wrapped (mkdocstrings' `line_length`, by ruff) to fit the page.
SIGNATURE_WIDTH = 80
_TAG = re.compile(
    r"<(script|link|img|iframe|source|embed|object|video|audio)\b[^>]*>", re.I
)
_URL_ATTRIBUTE = re.compile(
    r"""\b(src|href|data|srcset)\s*=\s*["']?\s*(https?:)?//""", re.I
)
# A `<link>` with one of these fetches what it names; `canonical` and the like do not.
_FETCHING_LINKS = re.compile(
    r"""\brel\s*=\s*["']?[^"'>]*\b(stylesheet|preload|modulepreload|preconnect|"""
    r"""dns-prefetch|prefetch|icon|manifest)\b""",
    re.I,
)
_CSS_URL = re.compile(r"""(url\(\s*["']?|@import\s+["'])\s*(https?:)?//""", re.I)
_STYLE = re.compile(r"<style\b[^>]*>(.*?)</style>", re.I | re.S)
_PARAGRAPH = re.compile(r"<p\b[^>]*>(.*?)</p>", re.S)
_BASES = re.compile(r'<p class="doc doc-class-bases">(.*?)</p>', re.S)
_SIGNATURE = re.compile(r'<div class="doc-signature highlight">(.*?)</div>', re.S)
# `Union`, `Optional` or `Literal` without its arguments; a private name (a type
# variable `_M`, a class `_Sign`); a path through a private module.
_UNREADABLE = re.compile(
    r"\b(Union|Optional|Literal)\b(?!\[)|(?<![\w.])_[A-Z]\w*|\b[A-Za-z]\w*\._\w+"
)


def _text(html_fragment: str) -> str:
    import html

    return html.unescape(re.sub(r"<[^>]+>", "", html_fragment))


def _builtin_docstrings() -> list[str]:
    """The first line of every built-in type's docstring ("Convert a string or
    number to a floating point number, if possible.")."""
    import builtins

    lines = set()
    for value in vars(builtins).values():
        doc = inspect.getdoc(value) if isinstance(value, type) else None
        if doc and len(doc.splitlines()[0]) >= 12:
            lines.add(doc.splitlines()[0].strip())
    return sorted(lines)


def external_resources(html_text: str) -> list[str]:
    """Every script, style sheet, font, image or frame the page (or a style in it)
    loads from another host: offline, it would be missing."""
    found = []
    for m in _TAG.finditer(html_text):
        tag = m.group(0)
        if m.group(1).lower() == "link" and not _FETCHING_LINKS.search(tag):
            continue
        if _URL_ATTRIBUTE.search(tag):
            found.append(tag)
    for style in _STYLE.findall(html_text):
        found += [f"<style> {m.group(0)}" for m in _CSS_URL.finditer(style)]
    return found


def stylesheet_resources(css: str) -> list[str]:
    """Every `url(...)` or `@import` of a style sheet that names another host."""
    return [m.group(0) for m in _CSS_URL.finditer(css)]


def api_problems(html_text: str) -> list[str]:
    """What the API reference must not show: a built-in's docstring standing in for
    an attribute's, a private base, a signature with an unreadable or private
    annotation, a signature line too long for the page."""
    problems = []
    leaks = _builtin_docstrings()
    for paragraph in _PARAGRAPH.findall(html_text):
        text = " ".join(_text(paragraph).split())
        problems += [
            f"a built-in's docstring: {text[:70]!r}"
            for b in leaks
            if text.startswith(b)
        ]
    for bases in _BASES.findall(html_text):
        text = " ".join(_text(bases).split())
        if _UNREADABLE.search(text.removeprefix("Bases:")):
            problems.append(f"a private base: {text!r}")
    for signature in _SIGNATURE.findall(html_text):
        text = _text(signature)
        if m := _UNREADABLE.search(text):
            problems.append(
                f"{m.group(0)!r} in the signature {' '.join(text.split())[:100]!r}"
            )
        long = [line for line in text.splitlines() if len(line) > SIGNATURE_WIDTH]
        problems += [
            f"a signature line of {len(line)} characters: {line[:60]!r}..."
            for line in long
        ]
    return problems


def anchor_problems(html_text: str, names: list[str]) -> list[str]:
    """Each rule's name must be the id of its gallery section's heading (not of some
    element within the section)."""
    problems = []
    for name in names:
        m = re.search(rf"<(\w+)\b[^>]*\bid=\"{re.escape(name)}\"", html_text)
        if m is None or m.group(1).lower() != "h2":
            where = "nothing" if m is None else f"a <{m.group(1)}>"
            problems.append(f"#{name} is {where}, not its section's heading")
    return problems


def site_problems(site: pathlib.Path) -> list[str]:
    """Every problem of the built site at `site`, each with its page."""
    import eqxrules

    problems = []
    for path in sorted(site.rglob("*")):
        where = path.relative_to(site).as_posix()
        if path.suffix == ".html":
            text = path.read_text(encoding="utf-8")
            problems += [f"{where}: loads {r}" for r in external_resources(text)]
            problems += [f"{where}: {p}" for p in api_problems(text)]
        elif path.suffix == ".css":
            text = path.read_text(encoding="utf-8")
            problems += [f"{where}: loads {r}" for r in stylesheet_resources(text)]
    gallery = site / "gallery" / "index.html"
    names = [e.name for e in eqxrules.catalogue()]
    problems += [f"gallery: {p}" for p in anchor_problems(gallery.read_text(), names)]
    return problems


_guides: dict[pathlib.Path, subprocess.Popen[str]] = {}


def on_pre_build(config: Any) -> None:
    # Every guide runs while the site builds, side by side; a guide whose code
    # raises fails the build in `on_post_build`.
    for page in guide_pages():
        _guides[page] = start_guide(page)


def on_post_build(config: Any) -> None:
    from mkdocs.exceptions import PluginError

    global _tmp
    if _tmp is not None:
        _tmp.cleanup()
        _tmp = None
    failures = [finish_guide(p, proc) for p, proc in _guides.items()]
    _guides.clear()
    failed = [f for f in failures if f is not None]
    if failed:
        raise PluginError("guides whose code fails:\n" + "\n\n".join(failed))
    problems = site_problems(pathlib.Path(config["site_dir"]))
    if problems:
        raise PluginError(
            f"the built site has {len(problems)} problems:\n" + "\n".join(problems)
        )


if __name__ == "__main__":
    # `python scripts/docs_hooks.py docs/guides/PAGE.md ...`: run guides as the
    # build does.
    problems = [run_guide(pathlib.Path(p).resolve()) for p in sys.argv[1:]]
    for problem in problems:
        if problem:
            print(problem, file=sys.stderr)
    sys.exit(1 if any(problems) else 0)
