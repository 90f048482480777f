"""The `codex_respx` fixture and `--codex-record-cassettes` (the plugin registers this
module); importing it needs neither respx nor httpx: the fixture names the extra."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from scenarios.paths import file_beside_test

_CALL_REPORT = pytest.StashKey[pytest.TestReport]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("codex-rest-bridge").addoption(
        "--codex-record-cassettes",
        action="store_true",
        dest="codex_record_cassettes",
        help="codex_respx: re-record stale cassettes (by default a stale one fails the test)",
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep the call phase's report: a mock's end check stays quiet when the test failed."""
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


@pytest.fixture
def codex_respx(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """`codex_respx(path or mapping, **options)`: a started `ScenarioRouter` mocking the
    bridge for httpx from the scenario's cassette (`scenario_router`'s keywords; a relative
    path is found beside the test file, then in the working directory). After the test,
    an exchange the host never made fails it, unless the test failed already.
    scenarios/README.md ("respx: no process at all") has the rest."""
    try:
        from scenarios import respx_mock
    except ModuleNotFoundError as exc:  # `from None`: no chained traceback
        raise pytest.fail.Exception(str(exc), pytrace=False) from None
    defaults = {"record": "refresh"} if request.config.getoption("codex_record_cassettes") else {}
    routers: list[Any] = []

    def start(scenario: Any, **options: Any) -> Any:
        if isinstance(scenario, str | os.PathLike):
            scenario = file_beside_test(request, scenario)
        try:
            router = respx_mock.scenario_router(scenario, **{**defaults, **options})
        except respx_mock.CassetteError as exc:
            raise pytest.fail.Exception(str(exc), pytrace=False) from None
        router.start()
        routers.append(router)
        return router

    yield start
    report = request.node.stash.get(_CALL_REPORT, None)
    quiet = report is None or report.failed
    problems = []
    for router in reversed(routers):
        try:
            router.stop(quiet=quiet)
        except AssertionError as exc:
            problems.append(str(exc))
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
