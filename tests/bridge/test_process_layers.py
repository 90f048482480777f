"""The process layer's dependencies point one way: backend → sessions → peer → channel.

Read from the modules' own import statements: a channel knows no peer, a peer knows no
process, socket, session or HTTP, and neither the shared mode nor the bundled backend
reaches up to the replica or across to the other's backend.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bridge

PACKAGE = Path(bridge.__file__).parent

#: Module → what it must not import (a module or any module under it).
FORBIDDEN = {
    "process/channel.py": ["bridge.process", "aiohttp", "bridge.models", "bridge.errors"],
    "process/peer.py": [
        "bridge.process.stdio",
        "bridge.process.websocket",
        "bridge.process.session",
        "bridge.process.backend",
        "bridge.process.descendants",
        "aiohttp",
        "bridge.errors",
        "bridge.models",
    ],
    "process/stdio.py": ["bridge.process.peer", "bridge.process.session", "aiohttp"],
    "process/websocket.py": ["bridge.process.peer", "bridge.process.session"],
    "process/tenancy.py": ["bridge.process.session", "bridge.process.shared", "aiohttp"],
    "process/session.py": ["bridge.process.stdio", "bridge.process.websocket", "bridge.replica"],
    "process/text_turn.py": ["bridge.process.stdio", "bridge.process.websocket"],
    "process/shared.py": ["bridge.process.backend", "bridge.replica"],
    "process/backend.py": [
        "bridge.replica",
        "bridge.process.shared",
        "bridge.process.stdio",
        "bridge.process.websocket",
    ],
}


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports (``from a import b`` counts as ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_a_process_module_imports_nothing_above_or_beside_it(module: str) -> None:
    names = imported(PACKAGE / module)
    wrong = sorted(
        name
        for name in names
        for forbidden in FORBIDDEN[module]
        if name == forbidden or name.startswith(forbidden + ".")
    )
    assert wrong == []
