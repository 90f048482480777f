"""Fixtures for the fakes' tests: the real codex, for the tests that compare against it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PINNED_CODEX = ROOT / ".codex-npm" / "node_modules" / ".bin" / "codex"


@pytest.fixture(scope="session")
def codex_bin() -> str:
    """The real codex (``$CODEX_BIN``, else ``make codex``'s copy), as in tests/e2e.

    Skips without it; fails instead when ``CI=true``.
    """
    where = os.environ.get("CODEX_BIN") or str(PINNED_CODEX)
    found = shutil.which(where)
    if found is None:
        message = (
            f"the real codex is not installed (looked for {where!r}); run `make codex` "
            "or point CODEX_BIN at a codex 0.169.0 binary"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return found
