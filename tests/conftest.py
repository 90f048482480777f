"""The project's own helper fixtures, shared by every test folder.

They are not part of the shipped pytest plugin (whose public fixtures all start with
`codex_`): host suites that install the package never see these names.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import cpu_report
import pytest
import pytest_asyncio
import tiers
from aiohttp import web

from bridge import codex_window
from scenarios.codex_install import pinned_codex
from scenarios.format import dump_yaml
from scenarios.harness import (
    NO_CODEX,
    CodexNotFound,
    checker_for,
    contract_middleware,
    fake_codex_command,
    required_codex,
    serve_app,
)
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


#: The `codex_bin` parameter of a codex named with `--codex-bin` or `$CODEX_BIN`.
GIVEN_CODEX = "given"
#: The `--version` line expected of each codex handed out, by path (None: named, any).
_EXPECTED_VERSION: dict[str, str | None] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test on the real codex runs once per release of the support window
    (`bridge/codex_window.py`), or once on the codex named with `--codex-bin`/`CODEX_BIN`;
    a test that parametrizes `codex_bin` itself (indirect) runs on the releases it names."""
    if "codex_bin" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "codex_bin" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return  # the test names its releases itself (indirect=True)
    given = metafunc.config.getoption("codex_bin") or os.environ.get("CODEX_BIN")
    versions = [GIVEN_CODEX] if given else list(codex_window.TESTED)
    metafunc.parametrize(
        "codex_bin", versions, indirect=True, scope="session", ids=[f"codex-{v}" for v in versions]
    )


@pytest.fixture(scope="session")
def codex_bin(request: pytest.FixtureRequest) -> str:
    """The real codex of this test's release of the window, from `.codex-npm/<version>/`
    (`make codex` installs them); skips without it, fails instead when `CI=true`. A test
    that asks for it by name at run time (not as a parameter) gets the pinned release."""
    version = getattr(request, "param", codex_window.PIN)
    config = request.config
    if version == GIVEN_CODEX:
        try:
            found = required_codex(config.getoption("codex_bin"), "--codex-bin", False)
        except CodexNotFound as exc:
            pytest.fail(str(exc), pytrace=False)
        assert found is not None
        _EXPECTED_VERSION[found] = None
        return found
    pinned = pinned_codex(config.rootpath / ".codex-npm", version)
    if pinned is not None:
        _EXPECTED_VERSION[pinned[0]] = f"codex-cli {version}"
        return pinned[0]
    missing = f"codex {version} (of the tested window) is not in .codex-npm/{version}/: make codex"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {missing}", pytrace=False)
    pytest.skip(f"{missing} ({NO_CODEX})")


@pytest.fixture(scope="session")
def codex_version(codex_bin: str) -> str:
    """The `--version` line of this test's real codex (`codex-cli 0.171.0`): the window's
    release it was installed as, checked against what the binary says."""
    done = subprocess.run(
        [codex_bin, "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    said = done.stdout.strip().splitlines()[0]
    expected = _EXPECTED_VERSION.get(codex_bin)
    assert expected in (None, said), f"{codex_bin} says {said!r}, installed as {expected!r}"
    return expected or said


def pytest_configure(config: pytest.Config) -> None:
    # The tiers (`make check`, `make test`): tests/tiers.py.
    config.pluginmanager.register(tiers, "tiers")
    # `--cpu-report`, opt-in: tests/cpu_report.py.
    config.pluginmanager.register(cpu_report, "cpu_report")


def pytest_addoption(parser: pytest.Parser) -> None:
    cpu_report.add_options(parser)
