"""The project's own helper fixtures, shared by every test folder.

They are not part of the shipped pytest plugin (whose public fixtures all start with
`codex_`): host suites that install the package never see these names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import tiers
from aiohttp import web

from scenarios.format import dump_yaml
from scenarios.harness import checker_for, contract_middleware, fake_codex_command, serve_app
from scenarios.openapi_check import OpenApiChecker


@pytest.fixture
def fake_codex() -> list[str]:
    """The command that starts the bundled fake app-server."""
    return [*fake_codex_command(), "app-server"]


@pytest.fixture
def write_script(tmp_path: Path) -> Callable[[dict[str, Any]], str]:
    """Write a fake-codex script (`version: 1` added) and return its path."""
    counter = iter(range(1_000_000))

    def write(script: dict[str, Any]) -> str:
        path = tmp_path / f"script-{next(counter)}.yaml"
        path.write_text(dump_yaml({"version": 1, **script}))
        return str(path)

    return write


@pytest.fixture
def contract_checkers() -> dict[str, OpenApiChecker]:
    """OpenAPI checkers of the applications this test serves, by base URL."""
    return {}


@pytest_asyncio.fixture
async def serve(
    contract_checkers: dict[str, OpenApiChecker],
) -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    """Start applications on real loopback sockets; returns their base URLs.

    Every response the `http` fixture then receives from them is checked against the
    application's own OpenAPI document.
    """
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner, base = await serve_app(app)
        runners.append(runner)
        checker = checker_for(app)
        if checker is not None:
            contract_checkers[base] = checker
        return base

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest_asyncio.fixture
async def http(
    contract_checkers: dict[str, OpenApiChecker],
) -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client whose every response from a served bridge must match its contract."""
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=60),
        middlewares=(contract_middleware(contract_checkers),),
    ) as session:
        yield session


def pytest_configure(config: pytest.Config) -> None:
    # The tiers (`make check`, `make test`): tests/tiers.py.
    config.pluginmanager.register(tiers, "tiers")
