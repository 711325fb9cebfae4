"""No module of irismesh imports, however indirectly, one that imports it back.

Read from the source (ast): imports inside functions count (they run on first use), imports
for the type checker (`if TYPE_CHECKING:`) do not, nor a module's import of the packages
that contain it (Python loads those first anyway).
"""

from __future__ import annotations

import ast
from pathlib import Path

import irismesh
import irismesh.discovery
import irismesh.patterns
import irismesh.security

PACKAGES = {
    "irismesh": Path(irismesh.__file__).parent,
    "irismesh.patterns": Path(irismesh.patterns.__file__).parent,
    "irismesh.discovery": Path(irismesh.discovery.__file__).parent,
    "irismesh.security": Path(irismesh.security.__file__).parent,
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


class _Imports(ast.NodeVisitor):
    def __init__(self, known: dict[str, Path]) -> None:
        self.known = known
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            self.found.add(node.module)
            self.found.update(f"{node.module}.{alias.name}" for alias in node.names)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        visitor = _Imports(modules)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        graph[name] = {
            dep
            for dep in visitor.found
            if dep in modules and dep != name and not name.startswith(dep + ".")
        }
    return graph


def _circle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from `start` back to it, if there is one (depth first)."""
    path: list[str] = []
    seen: set[str] = set()

    def walk(node: str) -> bool:
        for dep in sorted(graph[node]):
            if dep == start:
                path.append(dep)
                return True
            if dep not in seen:
                seen.add(dep)
                path.append(dep)
                if walk(dep):
                    return True
                path.pop()
        return False

    return [start, *path] if walk(start) else None


def test_the_graph_has_the_modules() -> None:
    graph = _graph()
    assert {"irismesh.node", "irismesh.cli", "irismesh._cli.completion"} <= set(graph)
    assert "irismesh.node" in graph["irismesh"]


def test_no_module_imports_itself_back() -> None:
    graph = _graph()
    circles = [c for c in (_circle_from(name, graph) for name in sorted(graph)) if c]
    assert circles[:1] == []


def test_the_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circle_from("a", graph) == ["a", "b", "c", "a"]
    assert _circle_from("d", graph) is None
