"""The house's shape, checked: no import cycle inside fsdp_testing or fsdp_core (imports anywhere
in a module count, lazy ones included; ``if TYPE_CHECKING:`` blocks do not), no module much over
500 lines, and loading the pytest plugin imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"fsdp_testing": ROOT / "fsdp_testing", "fsdp_core": ROOT / "src" / "fsdp_core"}
MAX_LINES = 520
"""About 500: a module that grows past it has two jobs; split it by role."""


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def add(candidate: str) -> None:
        # "from a.b import c" names module a.b.c when it exists, else a.b.
        while candidate and candidate not in modules:
            candidate = candidate.rpartition(".")[0]
        if candidate and candidate != name:
            targets.add(candidate)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                add(f"{base}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return targets


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # A package's __init__ importing its own submodules is how packages re-export; the
        # submodules importing siblings through the package is what would make a cycle.
        graph[name] = {t for t in _imports(name, path, modules) if not t.startswith(name + ".")}
    return graph


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_layout_names_its_rooms() -> None:
    modules = _modules()
    for expected in (
        "fsdp_testing._launch.pool",
        "fsdp_testing._launch.fork_server",
        "fsdp_testing._launch.rank_process",
        "fsdp_testing._launch.threads",
        "fsdp_testing._launch.torchrun",
        "fsdp_testing._rank.run_task",
        "fsdp_testing._rank.state_reset",
        "fsdp_testing._report.verdict",
        "fsdp_testing._report.hang_report",
        "fsdp_testing._report.collective_log",
    ):
        assert expected in modules
    flat = sorted(
        name
        for name, path in modules.items()
        if path.parent == PACKAGES["fsdp_testing"]
        and name.rpartition(".")[2].startswith("_")
        and not name.endswith("__main__")
    )
    assert flat == ["fsdp_testing._protocol"], "private modules belong in a folder by role"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_much_over_500_lines(package: str) -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in PACKAGES[package].rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_loading_the_plugin_imports_no_torch() -> None:
    code = (
        "import sys, fsdp_testing.plugin, fsdp_testing._launch.spec, fsdp_testing.collectives;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
