"""Fixtures every test folder shares."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def codex_bin(real_codex: str) -> str:
    """The real codex: the plugin's `real_codex` (`--codex-bin`, `$CODEX_BIN`, then the
    pinned copy `make codex` installs in .codex-npm/). Skips without one; fails instead
    when `CI=true`."""
    return real_codex
