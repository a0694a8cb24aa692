"""No import cycles between specdec's modules.

A cycle hides in lazy imports (``import`` inside a function, or under ``if TYPE_CHECKING:``):
Python tolerates it at run time, but the two modules can no longer be read, tested or replaced
apart. The walker below reads every module's source with :mod:`ast` (importing nothing) and
counts every ``import`` statement wherever it stands.

Edges: ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` when that is a module, else
``a``; relative imports are resolved against the importing module's package; an edge to a
package goes to its ``__init__``. Only edges between the walked package's own modules count.
Python also runs every parent package's ``__init__`` on import, but those implicit edges are
left out on purpose: with them every ``specdec.x`` that ``specdec/__init__.py`` re-exports
would sit on a cycle through the package itself.
"""

from __future__ import annotations

import ast
import textwrap
from collections import deque
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "specdec"

Edges = dict[str, dict[str, int]]  # importer -> {imported module: line of the first such import}


# ----------------------------------------------------------------------------- the walker


def module_files(root: Path) -> dict[str, Path]:
    """Every module under the package directory ``root``, by dotted name (a package by the
    name of its ``__init__.py``'s directory)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _package_of(name: str, path: Path) -> str:
    """The package a module's relative imports start from: itself for an ``__init__.py``."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _from_base(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute module named by ``from <base> import ...``."""
    if node.level == 0:
        return node.module or ""
    package = _package_of(name, path).split(".")
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _targets(node: ast.AST, name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """The modules of ``modules`` that one import statement imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = _from_base(node, name, path)
    found = []
    for alias in node.names:
        # "from a import b": the submodule a.b when there is one, else a name defined in a.
        candidate = f"{base}.{alias.name}"
        target = candidate if candidate in modules else base
        if target in modules:
            found.append(target)
    return found


def import_edges(root: Path) -> Edges:
    """Every import between the modules under ``root``: module-level ones, those inside
    functions and those under ``if TYPE_CHECKING:`` alike (``ast.walk`` sees them all)."""
    modules = module_files(root)
    edges: Edges = {name: {} for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, path, modules):
                    if target != name:
                        edges[name].setdefault(target, node.lineno)
    return edges


def _components(edges: Edges) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative: the graph may be deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _shortest_cycle(edges: Edges, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as the modules in order (the
    first repeated at the end)."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(edges[node]):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child in members and child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{component} is not a cycle")


def find_cycles(edges: Edges) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module."""
    return [_shortest_cycle(edges, c) for c in _components(edges) if len(c) > 1]


def describe(edges: Edges, cycle: list[str], root: Path) -> str:
    """``a -> b -> a`` with where each import stands."""
    steps = [
        f"    {a} -> {b}  ({_relative_file(a, root)}:{edges[a][b]})"
        for a, b in zip(cycle, cycle[1:])
    ]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


def _relative_file(name: str, root: Path) -> str:
    return str(module_files(root)[name].relative_to(root.parent))


# ----------------------------------------------------------------------------- the tests


def test_specdec_has_no_import_cycles():
    edges = import_edges(SRC)
    assert len(edges) > 50 and "specdec.engine" in edges  # the walker found the package
    cycles = find_cycles(edges)
    report = "\n".join(describe(edges, c, SRC) for c in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) in src/specdec:\n{report}"


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root / "pkg"


@pytest.fixture
def cyclic_package(tmp_path: Path) -> Path:
    """Two cycles the walker must see, and two look-alikes it must not report."""
    return _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.e import E\n",
            # A cycle through an import inside a function.
            "pkg/a.py": """
                def load():
                    from pkg.b import B

                    return B
            """,
            "pkg/b.py": "from . import a\n\nB = 1\n",
            # A cycle through an import only type checkers run, relative two levels up.
            "pkg/c.py": """
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from pkg.sub.d import D
            """,
            "pkg/sub/__init__.py": "from .d import D\n",
            "pkg/sub/d.py": "from ..c import TYPE_CHECKING as D\n",
            # Not cycles: importing pkg.sub.d runs pkg/__init__.py, which imports e, but such
            # implicit parent edges do not count; f imports a name of pkg.sub, not a module.
            "pkg/e.py": "import pkg.sub.d\n\nE = 1\n",
            "pkg/f.py": "from pkg.sub import D\n",
        },
    )


def test_negative_control_finds_function_level_and_type_checking_cycles(cyclic_package):
    edges = import_edges(cyclic_package)
    cycles = find_cycles(edges)
    assert sorted(cycles) == [
        ["pkg.a", "pkg.b", "pkg.a"],
        ["pkg.c", "pkg.sub.d", "pkg.c"],
    ]
    text = describe(edges, min(cycles), cyclic_package)
    assert text.startswith("pkg.a -> pkg.b -> pkg.a\n")
    assert "pkg/a.py:3" in text and "pkg/b.py:1" in text  # where each import stands


def test_edges_resolve_submodules_packages_and_relative_imports(cyclic_package):
    edges = import_edges(cyclic_package)
    assert edges["pkg.b"] == {"pkg.a": 1}  # "from . import a": the module a
    assert edges["pkg.sub.d"] == {"pkg.c": 1}  # two levels up, then c
    assert edges["pkg.f"] == {"pkg.sub": 1}  # D is a name in pkg.sub, not a module
    assert edges["pkg.e"] == {"pkg.sub.d": 1}  # no implicit edges to pkg or pkg.sub
    assert edges["pkg"] == {"pkg.e": 1}
