"""docs/SECURITY.md's threat model is the map of every surface: each row names the test
that attacks it, and that test must be in the suite.

A surface added later gets its row and its test in the same change; this file fails when
a row names a test that does not exist (renamed, deleted, misspelt), when a row names
none, or when one of the surfaces every deployment has is missing from the table.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
SECURITY = ROOT / "docs" / "SECURITY.md"
HEADING = "## The threat model"

#: Surfaces every deployment of the toolkit has: each must be the subject of a row
#: (matched, case-insensitively, in the row's first cell).
REQUIRED = (
    "health",
    "`trusted`",
    "`default`",
    "`text-turn`",
    "request head",
    "front",
    "peers",
    "shared socket",
    "wedged",
    "app-server processes",
    "environment",
    "app-server's output",
    "operator",
    "signals",
    "scenario files",
    "fake-codex scripts",
    "cassettes",
    "--target",
    "`rest-bridge cluster`",
    "scripted model",
)
TEST_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def rows() -> list[list[str]]:
    """The cells of the table that follows the heading (header and rule left out)."""
    text = SECURITY.read_text(encoding="utf-8")
    assert HEADING in text, f"docs/SECURITY.md has no {HEADING!r} section"
    section = text.split(HEADING, 1)[1]
    lines = []
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    return cells[2:]


@cache
def functions(path: str) -> frozenset[str]:
    """The names of the test functions `path` defines (module level and in classes)."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    )


def test_the_table_has_a_row_for_every_surface() -> None:
    surfaces = [row[0].lower() for row in rows()]
    missing = [name for name in REQUIRED if not any(name.lower() in s for s in surfaces)]
    assert not missing, f"docs/SECURITY.md's threat model has no row for {missing}"


def test_every_row_has_its_five_cells_and_names_a_test() -> None:
    table = rows()
    assert len(table) >= len(REQUIRED)
    for row in table:
        assert len(row) == 5, f"a row of {len(row)} cells: {row[0]!r}"
        assert TEST_REFERENCE.search(row[4]), f"the row {row[0]!r} names no test"


@pytest.mark.parametrize(
    ("path", "name"),
    sorted({match.groups() for row in rows() for match in TEST_REFERENCE.finditer(row[4])}),
)
def test_every_test_a_row_names_is_in_the_suite(path: str, name: str) -> None:
    assert (ROOT / path).is_file(), f"{path} does not exist"
    assert name in functions(path), f"{path} defines no {name}"
