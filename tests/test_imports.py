"""No import circle among Reef's own modules, including imports inside functions.

The graph is read from the source with `ast`, not from `sys.modules` after importing, so an import inside a
function (the usual way a circle is hidden: it only runs later, when both modules are loaded) counts the same
as one at the top of a module. Nodes are the project's modules (`daemon`, `reef_cli`, `recipes`, `adapters`,
`completions`); third-party and standard-library imports are left out.

What counts as an edge from module M:
- `import a.b.c` and `from a.b.c import name`: an edge to `a.b.c`; `from a.b import c` where `a.b.c` is a
  module: an edge to `a.b.c` (and none to `a.b` unless a plain name is imported from it too). Relative imports
  are resolved against M's package.
- Importing `a.b.c` first runs `a/__init__.py` and `a/b/__init__.py`, so an import also has an edge to each
  package above its target, except the packages above M itself: those have already begun to run before M does
  (a submodule of `daemon.records` importing `daemon.records.migrations` does not wait for
  `daemon/records/__init__.py`). A *name* imported from one of M's own packages (`from daemon.records import
  RecordStore` in `daemon/records/store.py`) is an explicit edge, so a package `__init__` that imports the
  submodule that imports a name back from it is reported as the circle it is.
- Imports under `if TYPE_CHECKING:` count too. They never run, so such a circle cannot fail at import time, but
  it is a circle of dependencies all the same (the record store's migrations named the store that runs them that
  way, and canaries the whole serving object): a module that needs a type of a module above it names what it uses
  as a Protocol instead (`daemon.services.Daemon`, `daemon.records.migrations.Migratable`).
- `importlib.import_module("...")` with a literal project module name counts as an import of that module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "reef_cli", "recipes", "adapters", "completions")  # completions: shell scripts today


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the project packages: dotted name -> file (a package is named by its __init__.py)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if any(not (root.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
                continue  # not importable as a module of the package (a script folder without __init__.py)
            modules[".".join(parts)] = path
    return modules


class _Imports(ast.NodeVisitor):
    """Every import in a module, at any depth: in functions, classes, `try`, `if TYPE_CHECKING:`."""

    def __init__(self) -> None:
        self.found: list[tuple[str, list[str], int]] = []  # (module, imported names, line); level folded in

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, [], node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        dots = "." * node.level
        self.found.append((dots + (node.module or ""), [a.name for a in node.names], node.lineno))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "import_module" and node.args:
            # importlib.import_module("daemon.x"), also when passed on: to_thread(importlib.import_module, "...")
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self.found.append((arg.value, [], node.lineno))
        elif node.args and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "import_module":
            for arg in node.args[1:2]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    self.found.append((arg.value, [], node.lineno))
        self.generic_visit(node)


def _resolve(importer: str, is_package: bool, target: str) -> str:
    """An absolute module name for `target` as written in `importer` (leading dots: a relative import)."""
    level = len(target) - len(target.lstrip("."))
    if not level:
        return target
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    rest = target[level:]
    return ".".join(base + ([rest] if rest else []))


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}, among the project's modules only."""
    modules = project_modules(root)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        visitor = _Imports()
        visitor.visit(ast.parse(path.read_text(), str(path)))
        own = set(_ancestors(name))
        edges = graph[name]
        for written, names, line in visitor.found:
            base = _resolve(name, path.name == "__init__.py", written)
            targets = []
            if names:
                submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
                targets += submodules
                if len(submodules) < len(names):  # some plain name (or *) comes from `base` itself
                    targets.append(base)
            else:
                targets.append(base)
            for target in targets:
                # a name not itself a module (`import daemon.records.store.X` cannot be, but a stale name can):
                # its nearest enclosing module
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if not target or target == name:
                    continue
                for reached in [*_ancestors(target), target]:
                    if reached in modules and reached != name and (reached == target or reached not in own):
                        edges.setdefault(reached, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one circle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_circle(graph, set(c)) for c in components]


def _circle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """One shortest path start -> ... -> start inside a strongly connected component (breadth first)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt not in component:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"not strongly connected: {sorted(component)}")


def describe(graph: dict[str, dict[str, int]], circle: list[str], root: Path = ROOT) -> str:
    """The circle, and for each step the file and line of the import that makes it."""
    modules = project_modules(root)
    steps = [f"{a} ({modules[a].relative_to(root)}:{graph[a][b]}) imports {b}"
             for a, b in zip(circle, circle[1:], strict=False)]
    return " -> ".join(circle) + "\n    " + "\n    ".join(steps)


def test_the_scan_sees_every_package_and_function_level_imports() -> None:
    graph = import_graph()
    for package in ("daemon", "reef_cli", "recipes", "adapters"):
        assert package in graph
    assert len(graph) > 100
    # a function-level import is an edge like any other (open_store imports the PostgreSQL backend when asked)
    assert "daemon.records.postgresql" in graph["daemon.records"]


def test_no_import_circle() -> None:
    graph = import_graph()
    cycles = import_cycles(graph)
    assert not cycles, "import circles among Reef's modules:\n" + "\n".join(describe(graph, c) for c in cycles)


def _graph_of(tmp_path: Path, files: dict[str, str]) -> dict[str, dict[str, int]]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").touch()
    return import_graph(tmp_path)


def test_a_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    graph = _graph_of(
        tmp_path,
        {
            "daemon/a.py": "from daemon.b import B\n",
            "daemon/b.py": "B = 1\ndef f():\n    from daemon import a\n    return a\n",
        },
    )
    assert import_cycles(graph) == [["daemon.a", "daemon.b", "daemon.a"]]


def test_relative_and_type_checking_imports(tmp_path: Path) -> None:
    files = {
        "daemon/pkg/__init__.py": "",
        "daemon/pkg/a.py": "from . import b\nfrom .b import X\nfrom ..c import Y\n",
        "daemon/pkg/b.py": "import daemon.c\n",
        "daemon/c.py": "",
    }
    graph = _graph_of(tmp_path, files)
    assert set(graph["daemon.pkg.a"]) == {"daemon.pkg.b", "daemon.c"}
    assert set(graph["daemon.pkg.b"]) == {"daemon.c"}
    assert import_cycles(graph) == []
    # the circle of migrations and the record store, as it was: named back for type annotations only
    files["daemon/pkg/b.py"] = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from daemon.pkg.a import A\n"
    graph = _graph_of(tmp_path, files)
    assert import_cycles(graph) == [["daemon.pkg.a", "daemon.pkg.b", "daemon.pkg.a"]]


def test_package_init_edges(tmp_path: Path) -> None:
    # a package __init__ re-exporting from its submodules, and siblings importing each other absolutely: no circle
    files = {
        "daemon/records/__init__.py": "from daemon.records.store import Store\n",
        "daemon/records/store.py": "import daemon.records.migrations\nclass Store: ...\n",
        "daemon/records/migrations.py": "from daemon.records import store as _s\n",
        "daemon/user.py": "from daemon.records.store import Store\n",
    }
    graph = _graph_of(tmp_path, files)
    assert import_cycles(graph) == [
        ["daemon.records.migrations", "daemon.records.store", "daemon.records.migrations"]
    ]
    files["daemon/records/migrations.py"] = "VERSION = 1\n"
    graph = _graph_of(tmp_path, files)
    assert import_cycles(graph) == []
    assert "daemon.records" in graph["daemon.user"]  # importing a submodule runs its package first
    # a submodule importing a name from its own package, whose __init__ imports that submodule: a circle
    files["daemon/records/migrations.py"] = "from daemon.records import Store\n"
    graph = _graph_of(tmp_path, files)
    assert import_cycles(graph) == [
        ["daemon.records", "daemon.records.store", "daemon.records.migrations", "daemon.records"]
    ]
    # and a package __init__ reached through a module outside the package
    files["daemon/records/migrations.py"] = "from daemon.user import X\n"
    graph = _graph_of(tmp_path, files)
    assert import_cycles(graph) == [
        ["daemon.records", "daemon.records.store", "daemon.records.migrations", "daemon.user", "daemon.records"]
    ]
