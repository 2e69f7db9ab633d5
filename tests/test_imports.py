"""The imports of `eqxrules` run one way: no module imports, through others, one
that imports it (0.2.0 had one loop: `_verify` imported `eqxrules.testing`, whose
`__init__` imported `_verify`), and `eqxrules.testing` imports nothing else of
eqxrules, even inside a function (STYLE.md: the checker checks any callable).

Read from the source with `ast`, so a loop that happens to import in a working
order today is caught as well as one that fails."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of `package` by dotted name (a package by its `__init__`)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: at import time only (`module_level`: not
    inside a function, nor under `if TYPE_CHECKING:`), or anywhere."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        deferred = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if module_level and (deferred or _is_type_checking(node)):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _targets(
    name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]
) -> set[str]:
    """The modules of `known` that `node`, in module `name`, makes run first. A
    submodule needs its parent packages, which are always already running, so
    those edges are left out unless a name is taken from the package itself."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source not in known:
        return set()
    out = set()
    ancestor = name == source or name.startswith(source + ".")
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in known:
            out.add(sub)
            if not ancestor:
                out.add(source)
        else:  # a name defined in `source`'s own code
            out.add(source)
    out.discard(name)
    return out


def import_graph(package: pathlib.Path, module_level: bool = True):
    modules = _modules(package)
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = set().union(
            *(
                _targets(name, is_package, node, known)
                for node in _imports(tree, module_level)
            )
        )
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A loop of imports (`[a, b, ..., a]`), or `None`."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def outside_imports(graph: dict[str, set[str]], subpackage: str) -> dict[str, set]:
    """What the modules of `subpackage` import from the rest of the package."""
    inside = {m for m in graph if m == subpackage or m.startswith(subpackage + ".")}
    return {m: graph[m] - inside for m in sorted(inside) if graph[m] - inside}


def test_the_imports_of_eqxrules_have_no_loop():
    graph = import_graph(ROOT / "eqxrules")
    assert "eqxrules._verify" in graph and "eqxrules.testing._check" in graph
    assert graph["eqxrules._verify"] >= {"eqxrules.testing"}
    assert find_cycle(graph) is None


def test_the_checker_imports_nothing_else_of_eqxrules():
    graph = import_graph(ROOT / "eqxrules", module_level=False)
    assert outside_imports(graph, "eqxrules.testing") == {}


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / next(iter(files)).split("/")[0]


# The 0.2.0 layout, in miniature: `testing` imports `verify_rule` back from `_verify`.
_LOOP = {
    "pkg/__init__.py": "from . import testing\nfrom ._verify import verify_rule\n",
    "pkg/_catalogue.py": "X = 1\n",
    "pkg/_verify.py": (
        "from ._catalogue import X\nfrom .testing import check_rule\n"
        "def verify_rule(): ...\n"
    ),
    "pkg/testing/__init__.py": (
        "from typing import TYPE_CHECKING\n"
        "from ._check import check_rule\n"
        "from .._verify import verify_rule\n"
        "if TYPE_CHECKING:\n    from .. import _verify\n"
    ),
    "pkg/testing/_check.py": "from . import _compare\ndef check_rule(): ...\n",
    "pkg/testing/_compare.py": "import math\n",
}


def test_a_planted_loop_is_found(tmp_path):
    package = _write(tmp_path, _LOOP)
    assert find_cycle(import_graph(package)) == [
        "pkg._verify",
        "pkg.testing",
        "pkg._verify",
    ]
    # Fixed the way eqxrules is: the loop is gone, and the submodule imports within
    # `testing` (which need their running parent) are not mistaken for one.
    fixed = dict(_LOOP)
    fixed["pkg/testing/__init__.py"] = "from ._check import check_rule\n"
    graph = import_graph(_write(tmp_path / "fixed", fixed))
    assert find_cycle(graph) is None
    assert graph["pkg.testing._check"] == {"pkg.testing._compare"}
    # A name taken from a running parent package is an edge, and closes a loop.
    fixed["pkg/testing/_compare.py"] = "from .. import X\n"
    fixed["pkg/__init__.py"] = "from . import testing\nX = 1\n"
    loop = find_cycle(import_graph(_write(tmp_path / "parent", fixed)))
    assert loop is not None and "pkg" in loop


def test_a_deferred_import_of_the_catalogue_in_the_checker_is_found(tmp_path):
    files = dict(_LOOP)
    files["pkg/testing/__init__.py"] = (
        "from ._check import check_rule\n"
        "def __getattr__(name):\n"
        "    from .._verify import verify_rule\n"
        "    return verify_rule\n"
    )
    package = _write(tmp_path, files)
    assert find_cycle(import_graph(package)) is None  # no loop at import time
    assert outside_imports(
        import_graph(package, module_level=False), "pkg.testing"
    ) == {"pkg.testing": {"pkg._verify"}}
