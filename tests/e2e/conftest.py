"""Fixtures for the end-to-end tests: the bridge in front of the real, pinned codex.

Every test gets its own ``CODEX_HOME``, working directory and scripted model. They
reach the spawned codex through ``ClientOptions`` (``env``, ``cwd``,
``configOverrides``), so the bridge's own path from an HTTP request to a child
process's environment, directory and ``-c`` arguments is exercised too; the app-server
command itself stays the plain ``codex app-server``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from bridge.app import trusted_bridge_app
from bridge.limits import RestLimits
from fakes.model_provider import ModelProviderServer


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """The working directory of the codex processes and of their threads."""
    path = tmp_path / "workspace"
    path.mkdir()
    return path


@pytest.fixture
def codex_home(tmp_path: Path) -> Path:
    """A fresh ``CODEX_HOME``: nothing of the machine's own codex state leaks in."""
    path = tmp_path / "codex-home"
    path.mkdir()
    return path


@pytest_asyncio.fixture
async def model() -> AsyncIterator[ModelProviderServer]:
    """The scripted model, empty: tests ``model.model.add(...)`` the replies they need."""
    async with ModelProviderServer() as server:
        yield server


@pytest.fixture
def codex_options(codex_home: Path, workspace: Path, model: ModelProviderServer) -> dict[str, Any]:
    """The ClientOptions (wire form) that point a spawned codex at this test's world."""
    return {
        "env": {"CODEX_HOME": str(codex_home), "OPENAI_API_KEY": "x"},
        "cwd": str(workspace),
        "configOverrides": model.codex_config_overrides(),
    }


@pytest_asyncio.fixture
async def bridge(
    codex_options: dict[str, Any],
    serve: Callable[[web.Application], Any],
    codex_bin: str,
) -> str:
    """A trusted bridge on the real codex; returns its base URL.

    ``codex_options`` comes first so that the scripted model starts before the bridge
    and stops after it (and after the codex processes the bridge stops).
    """
    return str(await serve(trusted_bridge_app([codex_bin, "app-server"], RestLimits())))
