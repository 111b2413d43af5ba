"""The import graph, between the repository's folders and between its files: no cycle at either
level (``bench/`` included), no worker importing another worker, and the README's picture of the
folder graph is the graph the code has.

Every ``kvrelay.*`` (and ``bench.*``) import counts, module-level or inside a function: a lazy
import still ties the two files together, it only moves the failure to run time. Importing a
submodule is an edge to that submodule only, not to the packages above it (their
``__init__``s re-export; that is no circle of meaning). Imports under ``if TYPE_CHECKING:``
run never and do not count."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import pytest

    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ("prefill_worker", "decode_worker")


def _folders() -> dict[str, str]:
    """``kvrelay.<name>`` -> folder, for the top-level packages (``kvrelay`` itself included)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    return {name: folder for name, folder in dirs.items() if name.count(".") <= 1}


@functools.cache
def _tree(path: Path) -> ast.AST:
    """A file's syntax tree, parsed once for the module's tests (~400 files: parsing them for
    each graph was most of this module's 14 s)."""
    return ast.parse(path.read_text(), str(path))


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """folder -> the other folders its modules import."""
    folders = _folders()
    by_module = {name: folder for name, folder in folders.items()}
    graph: dict[str, set[str]] = {folder: set() for folder in folders.values()}
    for name, folder in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            if name == "kvrelay" and path.parent != ROOT / folder:
                continue
            for node in ast.walk(_tree(path)):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets = [node.module]
                else:
                    continue
                for target in targets:
                    parts = target.split(".")
                    if parts[0] != "kvrelay" or len(parts) == 1:
                        continue  # the bare namespace package (its __version__) is everyone's
                    dest = by_module.get(".".join(parts[:2]), by_module["kvrelay"])
                    if dest != folder:
                        graph[folder].add(dest)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_folders() -> None:
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _modules() -> dict[str, Path]:
    """Every project module by its import name: ``kvrelay.*`` through pyproject's package-dir,
    and ``bench.*``."""
    mods: dict[str, Path] = {}
    for name, folder in _folders().items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if name == "kvrelay" and len(parts) > 1:
                continue
            mods[".".join([name, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    for path in (ROOT / "bench").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _runtime_imports(tree: ast.AST) -> list[ast.AST]:
    """Every import that runs, at any depth: all but those under ``if TYPE_CHECKING:`` (an
    annotation's name ties no file to another at run time)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


@functools.cache
def file_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (at any depth of its code)."""
    mods = _modules()

    def owner(target: str) -> str | None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _runtime_imports(_tree(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                dest = owner(target)
                if dest and dest != mod:
                    graph[mod].add(dest)
    return graph


def test_no_import_cycle_between_files() -> None:
    cycle = _cycle(file_graph())
    assert cycle is None, "import cycle between files: " + " -> ".join(cycle or [])


def test_file_graph_sees_lazy_and_relative_imports() -> None:
    graph = file_graph()
    assert "kvrelay.engine.config" in graph["kvrelay.engine.engine_core"]
    # a function-level import counts: the structured-output compiler is imported lazily
    lazy = [m for m, path in _modules().items()
            if any(isinstance(n, ast.FunctionDef) and any(
                isinstance(i, ast.ImportFrom) and (i.module or "").startswith("kvrelay.")
                for i in ast.walk(n)) for n in ast.walk(_tree(path)))]
    assert lazy and all(graph[m] for m in lazy)


def test_cycle_detection_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_worker_imports_another_worker() -> None:
    graph = import_graph()
    for w in WORKERS:
        others = graph[w] & (set(WORKERS) - {w})
        assert not others, f"{w} imports {sorted(others)}"


def test_readme_shows_the_import_graph() -> None:
    """The README's ``folder -> folders`` block lists exactly the code's edges."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- import-graph -->\n```text\n(.*?)```", text, re.S)
    assert block, "README.md lacks the <!-- import-graph --> block"
    shown: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        src, _, dests = line.partition("->")
        shown[src.strip().rstrip("/")] = {d.strip().rstrip("/") for d in dests.split(",")
                                          if d.strip() and d.strip() != "(nothing)"}
    graph = import_graph()
    assert shown == graph, f"README import graph is stale; the code has:\n{render(graph)}"


def render(graph: dict[str, set[str]]) -> str:
    """The README block's lines, most-depended-on folders last."""
    order = sorted(graph, key=lambda f: (-len(_reach(graph, f)), f))
    return "\n".join(f"{f + '/':<16} -> " + (", ".join(f"{d}/" for d in sorted(graph[f]))
                                            or "(nothing)") for f in order)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen
