"""Fixtures shared by the project's own tests."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from bridge.routes import OPENAPI
from scenarios.openapi_check import OpenApiChecker

FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))


@pytest.fixture
def fake_codex() -> list[str]:
    """The command that starts the bundled fake app-server."""
    return [FAKE_CODEX, "app-server"]


@pytest.fixture
def write_script(tmp_path: Path) -> Callable[[dict[str, Any]], str]:
    """Write a fake-codex script and return its path."""
    counter = iter(range(1_000_000))

    def write(script: dict[str, Any]) -> str:
        path = tmp_path / f"script-{next(counter)}.yaml"
        path.write_text(yaml.safe_dump({"version": 1, **script}))
        return str(path)

    return write


@pytest.fixture
def contract_checkers() -> dict[str, OpenApiChecker]:
    """OpenAPI checkers of the applications this test serves, by base URL."""
    return {}


@pytest_asyncio.fixture
async def serve(
    contract_checkers: dict[str, OpenApiChecker],
) -> AsyncIterator[Callable[[web.Application], Any]]:
    """Start applications on real loopback sockets; returns their base URLs.

    Every response the ``http`` fixture then receives from them is checked against
    the application's own OpenAPI document.
    """
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        base = f"http://127.0.0.1:{port}"
        source = app.get(OPENAPI)
        if source is not None:
            contract_checkers[base] = OpenApiChecker(orjson.loads(source.encoded()))
        return base

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest_asyncio.fixture
async def http(
    contract_checkers: dict[str, OpenApiChecker],
) -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client whose every response from a served bridge must match its contract."""

    async def check_contract(
        request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        response = await handler(request)
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        checker = contract_checkers.get(base)
        if checker is not None:
            content_type = response.headers.get("Content-Type", "")
            streaming = content_type.startswith("text/event-stream")
            body = None if streaming else await response.read()
            checker.check(request.method, request.url.path, response.status, content_type, body)
        return response

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=60), middlewares=(check_contract,)
    ) as session:
        yield session
