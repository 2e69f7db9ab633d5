"""What the API reference shows a reader: a griffe extension (mkdocs.yml, the
mkdocstrings handler's `extensions:`), and the plain functions it is made of, which
tests/test_docs.py checks without griffe or mkdocs.

mkdocstrings inspects the package (`force_inspection`: the rules are made at import
time), so it sees runtime objects, and three of them mislead a reader:

- A data attribute has no docstring at run time: its `__doc__` is its value's type's.
  A rule's `clip_value = 1.0` was documented as "Convert a string or number to a
  floating point number, if possible.". Such a docstring is replaced by the
  attribute's own: the string literal after its assignment in the source, else its
  item in an `**Arguments:**` (or `**Fields:**`) list of its class's docstring, else
  nothing.
- A class's bases are its `__bases__`, private ones included
  (`eqxrules._rules.sign._Sign`, `equinox._module._module.Module`). Each base is
  shown by a public path that imports it (`equinox.Module`), and a private one is
  replaced by its nearest public ancestors (`eqxrules.JVPRule`).
- An annotation naming a private alias (`Mode`, `Quantizer`) or a private type
  variable (`_M`) cannot be looked up by a reader (and mkdocstrings' default showed
  an alias by what it resolves to: a bare `Union` for jaxtyping's `PRNGKeyArray`). The
  pages show annotations as written (`annotations_path: source`), with a private
  alias spelled out (`Literal["exact", "skip_scale", "stop_input"]`) and a private
  type variable without its underscore (`M`)."""

from __future__ import annotations
import __future__

import ast
import builtins
import functools as ft
import inspect
import re
import sys
import textwrap
import typing
from typing import Any

_ITEM = re.compile(
    r"^(?P<indent>\s*)- (?P<names>`[^`]+`(?:,\s*`[^`]+`)*)(?:\s*\([^)]*\))?:\s*(?P<text>.*)$"
)
_SEPARATOR = re.compile(r"^\s*\|[-|: ]+\|\s*$")
_ROW = re.compile(r"^\|\s*`(?P<name>[^`]+)`\s*\|\s*(?P<text>[^|]*?)\s*\|\s*$")


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def documented_names(doc: str | None) -> dict[str, str]:
    """What a docstring says of each name it lists: an item `` - `lo`, `hi`: text ``
    of a markdown list (as under `**Arguments:**`; a note in parentheses after the
    names, such as "(default `False`)", is left out; more indented lines continue the
    item), or a row `` | `name` | text | `` of a table, read with its column's
    heading (`| check | the value must |` makes "The value must be ...")."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    heading = None
    for i, line in enumerate(lines):
        if item := _ITEM.match(line):
            indent = len(item["indent"])
            text = [item["text"].strip()]
            for more in lines[i + 1 :]:
                if not more.strip() or len(more) - len(more.lstrip()) <= indent:
                    break
                text.append(more.strip())
            for name in re.findall(r"`\**([^`]+)`", item["names"]):
                out.setdefault(name, _sentence(" ".join(text)))
        elif row := _ROW.match(line.strip()):
            if heading is not None:
                out.setdefault(row["name"], _sentence(f"{heading} {row['text']}"))
        elif _SEPARATOR.match(lines[i + 1] if i + 1 < len(lines) else ""):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            heading = (
                cells[1] if line.strip().startswith("|") and len(cells) > 1 else None
            )
    return out


def inherited_docstring(value: Any, doc: str | None) -> bool:
    """Whether `doc`, found on the data value `value`, is its type's docstring
    rather than its own (a class, routine, module or property has its own)."""
    if doc is None or (
        inspect.isclass(value)
        or inspect.isroutine(value)
        or inspect.ismodule(value)
        or isinstance(value, property)
    ):
        return False
    own = getattr(type(value), "__doc__", None)
    return isinstance(own, str) and inspect.cleandoc(own) == inspect.cleandoc(doc)


def _source_docstring(owner: Any, name: str) -> str | None:
    """The string literal after `name`'s assignment in `owner`'s source."""
    try:
        source = textwrap.dedent(inspect.getsource(owner))
    except (OSError, TypeError):
        return None
    body = ast.parse(source).body
    if inspect.isclass(owner) and body and isinstance(body[0], ast.ClassDef):
        body = body[0].body
    for statement, after in zip(body, body[1:]):
        targets = (
            statement.targets
            if isinstance(statement, ast.Assign)
            else [statement.target]
            if isinstance(statement, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            return inspect.cleandoc(after.value.value)
    return None


def attribute_docstring(owner: Any, name: str) -> str | None:
    """Attribute `name`'s documentation as its author wrote it: the docstring under
    its assignment (in `owner`, a class or its bases, or a module or the submodule it
    was imported from), else what `owner`'s docstring (or a base's) says of it in a
    list or a table (`documented_names`)."""
    if inspect.isclass(owner):
        owners = [c for c in owner.__mro__ if c.__module__ != "builtins"]
    else:
        value = getattr(owner, name, None)
        owners = [owner] + [
            m
            for key, m in list(sys.modules.items())
            if key.startswith(owner.__name__ + ".") and vars(m).get(name) is value
        ]
    for candidate in owners:
        if (doc := _source_docstring(candidate, name)) is not None:
            return doc
    for candidate in owners:
        if (doc := documented_names(candidate.__doc__).get(name)) is not None:
            return doc
    return None


def _private(path: str) -> bool:
    return any(part.startswith("_") for part in path.split("."))


def public_path(cls: type) -> str | None:
    """The shortest public path that imports `cls` (`equinox.Module` for
    `equinox._module._module.Module`; `UserWarning` for a built-in), or `None`."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    if _private(cls.__qualname__):
        return None
    parts = cls.__module__.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if _private(prefix):
            return None
        module = sys.modules.get(prefix)
        if module is not None and getattr(module, cls.__qualname__, None) is cls:
            return f"{prefix}.{cls.__qualname__}"
    return None


def public_bases(cls: type) -> list[str]:
    """`cls`'s bases as a reader can import them: a private base is replaced by its
    nearest public ancestors, and a base another listed one inherits from is left
    out (it says nothing more)."""
    found: list[type] = []

    def visit(base: type) -> None:
        if base is object:
            return
        if public_path(base) is not None:
            found.append(base)
        else:
            for b in base.__bases__:
                visit(b)

    for base in cls.__bases__:
        visit(base)
    kept = [
        b
        for i, b in enumerate(found)
        if b not in found[:i]
        and not any(o is not b and issubclass(o, b) for o in found)
    ]
    return [path for b in kept if (path := public_path(b)) is not None]


@ft.cache
def _aliases_defined_in(module_name: str) -> dict[str, str]:
    """The names a module assigns at its top level (not those it imports), each
    with its value's source text."""
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module else ""
    except (OSError, TypeError):
        source = ""
    out = {}
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets = [statement.target]
        else:
            continue
        text = ast.get_source_segment(source, statement.value)
        for target in targets:
            if isinstance(target, ast.Name) and text is not None:
                out[target.id] = text
    return out


def _private_alias(name: str, value: Any, module_name: str) -> str | None:
    """If `name` is a type alias (`Mode = Literal[...]`) that module `module_name`
    defines and no public module above it exports, its value as written."""
    written = _aliases_defined_in(module_name).get(name)
    if typing.get_origin(value) is None or written is None:
        return None
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if _private(prefix):
            return written
        module = sys.modules.get(prefix)
        if module is not None and vars(module).get(name) is value:
            return None
    return written


def readable_annotation(text: str, namespace: dict[str, Any]) -> str:
    """The annotation `text`, written in the module whose globals are `namespace`,
    with every name a reader cannot import spelled out: a private type variable
    without its underscore (`_M` → `M`), an alias the module defines and no public
    module exports by its value as written there (`Mode` →
    `Literal["exact", ...]`)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return text
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Name) or node.id not in namespace:
            continue
        value = namespace[node.id]
        if isinstance(value, typing.TypeVar):
            if node.id.startswith("_"):
                edits.append((node, node.id.lstrip("_")))
        elif written := _private_alias(node.id, value, namespace.get("__name__", "")):
            edits.append((node, readable_annotation(written, namespace)))
    # The edits are on one line (an annotation); apply them right to left.
    for node, new in sorted(edits, key=lambda e: -e[0].col_offset):
        text = text[: node.col_offset] + new + text[node.end_col_offset :]
    return text


def _is_source(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return True


def readable_default(value: Any, text: str) -> str:
    """A parameter's default as its signature shows it: `text` (its repr) where that
    is Python, else the name a public module of its package exports it by (`real`,
    not `Check(must='be a real number', holds=<function <lambda> at 0x...>, ...)`),
    else `Type(...)`."""
    if _is_source(text):
        return text
    package = type(value).__module__.split(".")[0]
    for key, module in sorted(sys.modules.items()):
        if key.split(".")[0] == package and not _private(key) and module is not None:
            for name, member in vars(module).items():
                if member is value and not name.startswith("_"):
                    return name
    return f"{type(value).__name__}(...)"


def readable_value(value: Any, text: str) -> str:
    """An attribute's value as its entry shows it: `text` (its repr) where that is
    Python, else `Type(...)` (the entry's docstring says what it is)."""
    return text if _is_source(text) else f"{type(value).__name__}(...)"


def _namespace(obj: Any) -> dict[str, Any]:
    function = inspect.unwrap(getattr(obj, "__func__", obj))
    if hasattr(function, "__globals__"):
        return function.__globals__
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    return vars(module) if module is not None else vars(builtins)


class ReaderFacingApi:
    """The griffe extension (loaded by path: `scripts/docs_api.py:ReaderFacingApi`).
    griffe calls these hooks by name while it inspects the package."""

    def on_class_instance(self, *, node: Any, cls: Any, **kwargs: Any) -> None:
        if inspect.isclass(getattr(node, "obj", None)):
            cls.bases = public_bases(node.obj)

    def on_module_members(self, *, node: Any, mod: Any, **kwargs: Any) -> None:
        # `from __future__ import annotations` leaves a `_Feature` named
        # `annotations` in the module: not part of its API.
        for name in list(mod.members):
            if isinstance(getattr(node.obj, name, None), __future__._Feature):
                mod.del_member(name)

    def on_attribute_instance(self, *, node: Any, attr: Any, **kwargs: Any) -> None:
        owner = getattr(getattr(node, "parent", None), "obj", None)
        if owner is None:
            return
        if attr.docstring is not None and inherited_docstring(
            node.obj, attr.docstring.value
        ):
            from griffe import Docstring

            own = attribute_docstring(owner, attr.name)
            attr.docstring = None if own is None else Docstring(own, parent=attr)
        if attr.value is not None:
            attr.value = _unless_same(
                attr.value, readable_value(node.obj, str(attr.value))
            )
        if attr.annotation is not None:
            module = sys.modules.get(getattr(owner, "__module__", owner.__name__))
            namespace = vars(module) if module is not None else {}
            attr.annotation = _readable(attr.annotation, namespace)

    def on_function_instance(self, *, node: Any, func: Any, **kwargs: Any) -> None:
        obj = getattr(node, "obj", None)
        namespace = _namespace(obj)
        try:
            defaults = {
                p.name: p.default for p in inspect.signature(obj).parameters.values()
            }
        except (TypeError, ValueError):
            defaults = {}
        for parameter in func.parameters:
            if parameter.annotation is not None:
                parameter.annotation = _readable(parameter.annotation, namespace)
            if parameter.default is not None and parameter.name in defaults:
                parameter.default = _unless_same(
                    parameter.default,
                    readable_default(defaults[parameter.name], str(parameter.default)),
                )
        if func.returns is not None:
            func.returns = _readable(func.returns, namespace)


def _unless_same(expression: Any, text: str) -> Any:
    """The griffe expression itself (whose names mkdocstrings can cross-reference)
    where `text` says the same."""
    return expression if str(expression) == text else text


def _readable(annotation: Any, namespace: dict[str, Any]) -> Any:
    return _unless_same(annotation, readable_annotation(str(annotation), namespace))
