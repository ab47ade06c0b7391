"""The house's floor plan, read from the source: rooms (the packages of `arealite/`, the scripts
of `benchmarks/`) lean on each other one way only, and the ground floor stands alone.

A room is a subpackage or a top-level module. Room A leans on room B when any file of A
imports B: at the top, inside a function, or under ``TYPE_CHECKING`` (a loop is a loop for
the reader, whenever Python happens to run the import). A workflow named by an import
string (``module:Class``) is not an import: that is how plugins stay above what runs them.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The ground floor: these import nothing but each other, and ``utils`` nothing at all.
GROUND = ("config", "data", "api", "utils")
LOWEST = "utils"

Graph = dict[str, dict[str, list[str]]]  # room -> room it imports -> the files that do


def _imported_modules(tree: ast.AST, module: list[str], is_package: bool) -> list[list[str]]:
    """Every module `tree` imports, as dotted parts; ``from pkg import name`` counts as
    ``pkg.name`` (name may be a module), relative imports are resolved against `module`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module[:-1]
                base = base[: len(base) - (node.level - 1)]
            else:
                base = []
            stem = base + (node.module.split(".") if node.module else [])
            out += [stem + [alias.name] for alias in node.names]
    return out


@functools.lru_cache(maxsize=None)
def room_graph(root: Path) -> Graph:
    """Which room of the package at `root` imports which other room of it, with the files that do."""
    top = root.name
    graph: Graph = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        module = parts[:-1] if is_package else parts
        if len(module) < 2:  # the package's own __init__
            continue
        room = module[1]
        graph.setdefault(room, {})
        for target in _imported_modules(ast.parse(path.read_text(), str(path)), module, is_package):
            if len(target) >= 2 and target[0] == top and target[1] != room and target[1] != "*":
                graph[room].setdefault(target[1], []).append(str(path.relative_to(root)))
    return graph


def loops(graph: Graph) -> list[list[str]]:
    """One loop ``[a, b, ..., a]`` through each set of rooms that reach each other (Tarjan's
    strongly connected components, then a shortest way back to the first room of each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_loop_through(graph, comp) for comp in components]


def _loop_through(graph: Graph, comp: list[str]) -> list[str]:
    start, inside = comp[0], set(comp)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first, inside the component, until the way back to start is found
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in inside and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no loop found through {comp}")  # a component of two or more always has one


def _describe(graph: Graph, loop: list[str]) -> str:
    rooms = sorted(v for v in _reaching(graph, loop[0]) if loop[0] in _reaching(graph, v))
    steps = [f"{a} -> {b} ({', '.join(sorted(set(graph[a][b]))[:3])})" for a, b in zip(loop, loop[1:])]
    return (f"rooms {', '.join(rooms)} reach each other; one loop: " + " -> ".join(loop) + "\n    "
            + "\n    ".join(steps))


def _reaching(graph: Graph, start: str) -> set[str]:
    """The rooms `start` leads to, itself included."""
    seen, todo = {start}, [start]
    while todo:
        for w in graph.get(todo.pop(), {}):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@pytest.mark.parametrize("top", ["arealite", "benchmarks"])
def test_rooms_import_each_other_one_way_only(top):
    graph = room_graph(REPO / top)
    found = loops(graph)
    assert not found, f"import circles between the rooms of {top}/:\n  " + "\n  ".join(
        _describe(graph, loop) for loop in found)


def test_the_ground_floor_imports_nothing_above_it():
    graph = room_graph(REPO / "arealite")
    upward = [f"{room} -> {target} ({', '.join(sorted(set(files)))})"
              for room in GROUND for target, files in sorted(graph.get(room, {}).items())
              if target not in GROUND or room == LOWEST]
    assert not upward, (f"the ground packages ({', '.join(GROUND)}) import only each other, and {LOWEST} "
                        "nothing of arealite; these reach up:\n  " + "\n  ".join(upward))


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The checks above are only as good as the graph: lazy, TYPE_CHECKING, relative and
    ``from pkg import module`` imports all count, and a loop is named room by room."""
    pkg = tmp_path / "house"
    for room, src in {
        "low/__init__.py": "from ..mid import thing\n",
        "mid/thing.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from house.high.x import y\n",
        "high/x.py": "def f():\n    from house import low\n",
        "alone.py": "import house.mid.thing\n",
    }.items():
        (pkg / room).parent.mkdir(parents=True, exist_ok=True)
        (pkg / room).write_text(src)
    (pkg / "__init__.py").write_text("")
    graph = room_graph(pkg)
    assert {r: sorted(t) for r, t in graph.items()} == {
        "alone": ["mid"], "high": ["low"], "low": ["mid"], "mid": ["high"]}
    assert loops(graph) == [["high", "low", "mid", "high"]]
    assert "high -> low (high/x.py)" in _describe(graph, loops(graph)[0])
