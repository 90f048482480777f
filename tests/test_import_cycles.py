"""Dependencies point one way: no import cycle among the modules of fakes/, bridge/ or scenarios/.

The graph is read from the source with `ast`, not by importing anything, and counts
every import a module makes: at the top, inside a function (the usual way to hide a
cycle) and under `if TYPE_CHECKING:` (a type is a dependency too). An edge goes from a
module to the project module it names: `from a.b import c` names `a.b.c` when that is a
module, else `a.b`. Importing a submodule also runs its package's `__init__`, but that
implicit edge is not counted: the graph is the one a reader draws from the import lines.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fakes", "bridge", "scenarios")

#: Groups of modules that import each other today, each to be broken by its owner: a
#: cycle is allowed only inside one of these groups, so no new one can appear and a
#: group may only shrink. Empty once every package is free of cycles.
KNOWN: dict[str, list[frozenset[str]]] = {
    "fakes": [],
    "bridge": [],
    "scenarios": [
        # The cassette and record commands run the CLI, which dispatches to them.
        frozenset({"scenarios.cassette", "scenarios.cli", "scenarios.record"}),
    ],
}

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(
    tree: ast.Module, module: str, is_package: bool, modules: Collection[str]
) -> set[str]:
    """The project `modules` that `tree` imports: `from a.b import c` names the module
    `a.b.c` when there is one, else `a.b` (where `c` is defined)."""
    package = module if is_package else module.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                named.add(submodule if submodule in modules else base)
    return {name for name in named if name in modules and name != module}


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> Graph:
    """Module → the project modules it imports, over every .py file of `packages`."""
    files = {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }
    return {
        module: imported_modules(
            ast.parse(path.read_text(encoding="utf-8"), str(path)),
            module,
            path.name == "__init__.py",
            files,
        )
        for module, path in files.items()
    }


def strongly_connected(graph: Graph) -> list[set[str]]:
    """The groups of two or more modules that import each other, directly or not
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return groups


def a_cycle(graph: Graph, group: set[str]) -> list[str]:
    """One concrete cycle through the first module of `group`, for the failure message."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    return [start]


def cycles_outside(graph: Graph, package: str, known: list[frozenset[str]]) -> list[str]:
    """A description of each cycle through `package` not inside one of the `known` groups."""
    found = []
    for group in strongly_connected(graph):
        if not any(module.split(".")[0] == package for module in group):
            continue
        if any(group <= allowed for allowed in known):
            continue
        found.append(" -> ".join(a_cycle(graph, group)) + f"  (group: {sorted(group)})")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    problems = cycles_outside(import_graph(), package, KNOWN[package])
    assert not problems, "import cycles:\n" + "\n".join(problems)


#: The layers of the process package as a newcomer draws them, bottom up: what each of
#: the lower modules may import of the project (nothing else).
LOWER_LAYERS = {
    # A channel carries messages: it knows no JSON-RPC, session or HTTP.
    "bridge.process.channel": set(),
    "bridge.process.stdio": {
        "bridge.limits",
        "bridge.process.channel",
        "bridge.process.descendants",
    },
    "bridge.process.websocket": {"bridge.limits", "bridge.process.channel"},
    # The JSON-RPC peer knows its channel and the JSON codec: neither HTTP nor sessions.
    "bridge.process.peer": {"bridge.process.channel", "bridge.wire"},
}
#: Siblings over the peer that must not lean on each other, and the HTTP layer above.
FORBIDDEN = {
    "bridge.process.session": {"bridge.process.text_turn", "bridge.process.shared"},
    "bridge.process.text_turn": {"bridge.process.session", "bridge.process.shared"},
    "bridge.process.tenancy": {"bridge.process.session", "bridge.process.shared"},
}
HTTP_LAYER = {"bridge.app", "bridge.routes", "bridge.auth", "bridge.server", "bridge.openapi"}


def test_the_process_layers_import_only_downwards() -> None:
    graph = import_graph()
    wrong = [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if (module in LOWER_LAYERS and target not in LOWER_LAYERS[module])
        or target in FORBIDDEN.get(module, ())
        or (module.startswith("bridge.process") and target in HTTP_LAYER)
    ]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_sees_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import thing\n",
            "pkg/b.py": "def later():\n    from pkg import a\n",
            "pkg/c.py": "import pkg.a\n",
        },
    )
    graph = import_graph(root, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.a"}
    [problem] = cycles_outside(graph, "pkg", [])
    assert problem.startswith("pkg.a -> pkg.b -> pkg.a")
    assert cycles_outside(graph, "pkg", [frozenset({"pkg.a", "pkg.b", "pkg.x"})]) == []


def test_the_check_sees_type_only_and_relative_imports(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "from .one import X\n",
            "pkg/sub/one.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ..two import Y\n"
                "X = 1\n"
            ),
            "pkg/two.py": "from pkg.sub import X\nY = X\n",
        },
    )
    graph = import_graph(root, ["pkg"])
    assert graph["pkg.sub"] == {"pkg.sub.one"}
    assert graph["pkg.sub.one"] == {"pkg.two"}
    assert graph["pkg.two"] == {"pkg.sub"}
    [problem] = cycles_outside(graph, "pkg", [])
    assert "pkg.sub -> pkg.sub.one -> pkg.two -> pkg.sub" in problem


def test_the_check_passes_a_graph_without_cycles(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "import os\n",
            "pkg/high.py": "from pkg import low\nfrom pkg.low import os\n",
        },
    )
    graph = import_graph(root, ["pkg"])
    assert graph["pkg.high"] == {"pkg.low"}
    assert cycles_outside(graph, "pkg", []) == []
