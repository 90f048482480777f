"""pytest plugin of codex-rest-bridge: scenario files as tests, and fixtures.

Installed with the package, it is registered through the `pytest11` entry point (named
`scenarios.pytest_plugin`, so `-p no:scenarios.pytest_plugin` turns it off and a
`pytest_plugins = ["scenarios.pytest_plugin"]` line never registers it twice).

Collection: every `*.scenario.yaml` / `*.scenario.yml` file (ini option
`scenario_patterns`) is one test item; a malformed one is a collection error naming
the file and line. Scenarios that script the model run the real codex and skip
without it (fail instead when `CI=true`).

Fixtures (async ones work with pytest-asyncio in strict and auto modes):

- `codex_bridge`: a running bridge (`RunningBridge`) on fake-codex, built as the test's
  `@pytest.mark.codex_bridge(script=..., preset=..., token=..., limits=..., model=...)`
  says;
- `bridge_client`: an aiohttp session bound to `codex_bridge` (relative URLs, its
  token, every response checked against its OpenAPI document);
- `start_bridge`: `await start_bridge(**the same keywords)` for more bridges;
- `sse`: `await sse(path, last_event_id=..., after=..., client=...)`, an `SseReader`
  with a timeout on every read;
- `scripted_model`: the scripted model server (`fakes.model_provider`), empty;
- `real_codex`: the real codex executable (skips without one; fails when `CI=true`);
- `run_scenario`: `await run_scenario(path or mapping)` runs a scenario and fails the
  test with its report;
- `fake_codex`, `write_script`, `serve`, `http`, `contract_checkers`: the fake's
  command, fake-codex script files, any aiohttp app served, a contract-checked client;
- `codex_respx`: the bridge mocked for httpx (respx), replaying what the real bridge
  answered for a scenario, no process at all (`scenarios.respx_fixtures`).

After a `codex_bridge` / `start_bridge` test, the bridge's fake-codex reports are
checked like a scenario's end: no scripted reply unused, no server request
unanswered (turn it off with `check_script=False`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - the harness extra brings it
    pytest_asyncio = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

    from scenarios.format import LoadedScenario
    from scenarios.harness import RunningBridge
    from scenarios.openapi_check import OpenApiChecker
    from scenarios.runner import ScenarioResult
    from scenarios.sse import SseReader

DEFAULT_PATTERNS = ("*.scenario.yaml", "*.scenario.yml")
MARKER = "codex_bridge"


def _async_fixture(func: Callable[..., Any]) -> Any:
    """`pytest_asyncio.fixture`, or a fixture that says how to get pytest-asyncio."""
    if pytest_asyncio is not None:
        return pytest_asyncio.fixture(func)

    @pytest.fixture(name=func.__name__)
    def missing() -> None:
        raise pytest.UsageError(
            f"the {func.__name__!r} fixture needs pytest-asyncio: install codex-rest-bridge "
            'with its `harness` extra, e.g. pip install "/path/to/codex-rest-bridge[harness]"'
        )

    return missing


# -- options, markers, collection ----------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("codex-rest-bridge", "codex-rest-bridge scenarios and fixtures")
    group.addoption(
        "--codex-bin",
        dest="codex_bin",
        default=None,
        help="the real codex, for real_codex and scenarios that script the model "
        "(default: $CODEX_BIN, .codex-npm/, codex on PATH)",
    )
    parser.addini(
        "scenario_patterns",
        type="linelist",
        default=list(DEFAULT_PATTERNS),
        help="file name patterns collected as scenarios",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _settle_fixture_loop_scope(config)
    config.addinivalue_line(
        "markers",
        f"{MARKER}(script=None, preset='trusted', token=None, limits=None, model=None, "
        "check_script=True): how the codex_bridge fixture's bridge is built",
    )
    config.addinivalue_line(
        "markers", "real_codex: needs the real codex (skips without it; fails when CI=true)"
    )


LOOP_SCOPE_OPTION = "asyncio_default_fixture_loop_scope"


def _settle_fixture_loop_scope(config: pytest.Config) -> None:
    """Spare every host project pytest-asyncio's warning about an unset loop scope.

    When the host's configuration leaves `asyncio_default_fixture_loop_scope` unset,
    pytest-asyncio (1.5 and later) is told `fixture-scope`: what it does anyway when the
    option is unset, so no fixture changes loop, and the `PytestDeprecationWarning` that
    asks for a choice is not printed. A value the host sets always wins. Runs before
    pytest-asyncio reads the option (`tryfirst`).
    """
    if pytest_asyncio is None or _version(pytest_asyncio.__version__) < (1, 5):
        return
    try:
        if config.getini(LOOP_SCOPE_OPTION):
            return
    except ValueError:  # pytest-asyncio is installed but turned off (-p no:asyncio)
        return
    cache = getattr(config, "_inicache", None)
    if isinstance(cache, dict):
        cache[LOOP_SCOPE_OPTION] = "fixture-scope"


def _version(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    patterns = parent.config.getini("scenario_patterns") or DEFAULT_PATTERNS
    if any(fnmatch.fnmatch(file_path.name, pattern) for pattern in patterns):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class ScenarioFile(pytest.File):
    """A scenario file: one item, or a collection error with the file and line."""

    def collect(self) -> Iterator[pytest.Item]:
        from scenarios.format import ScenarioError, load_scenario

        try:
            loaded = load_scenario(self.path)
        except ScenarioError as exc:
            raise self.CollectError(str(exc)) from None
        yield ScenarioItem.from_parent(self, name=loaded.name, loaded=loaded)


class ScenarioFailed(AssertionError):
    """A scenario failed; the item reports it with `scenarios.reporting`."""

    def __init__(self, result: ScenarioResult) -> None:
        super().__init__(f"scenario {result.loaded.name} failed")
        self.result = result


class ScenarioItem(pytest.Item):
    """Runs one scenario in a fresh event loop, bridge and temporary directory."""

    def __init__(self, *, loaded: LoadedScenario, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loaded = loaded
        self.extra_keyword_matches.update(loaded.scenario.tags)
        if loaded.scenario.real_codex:
            self.add_marker("real_codex")

    def runtest(self) -> None:
        from scenarios.runner import RunOptions, run_scenario_sync

        options = RunOptions(
            codex=self.config.getoption("codex_bin"),
            codex_option="--codex-bin",
            tmp_root=_tmp_root(self),
        )
        result = run_scenario_sync(self.loaded, options)
        if result.outcome == "skipped":
            pytest.skip(result.skip_reason or "skipped")
        if result.outcome == "failed":
            raise ScenarioFailed(result)

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> Any:
        if isinstance(excinfo.value, ScenarioFailed):
            from scenarios.reporting import format_result

            return format_result(excinfo.value.result)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"scenario: {self.name}"


def _tmp_root(node: pytest.Item) -> Path | None:
    factory = getattr(node.config, "_tmp_path_factory", None)
    if factory is None:
        return None
    return Path(factory.getbasetemp()) / "scenarios"


# -- the fixtures the project's own tests grew up with --------------------------------------


@pytest.fixture
def fake_codex() -> list[str]:
    """The command that starts the bundled fake app-server."""
    from scenarios.harness import fake_codex_command

    return [*fake_codex_command(), "app-server"]


@pytest.fixture
def write_script(tmp_path: Path) -> Callable[[dict[str, Any]], str]:
    """Write a fake-codex script (`version: 1` added) and return its path."""
    counter = iter(range(1_000_000))

    def write(script: dict[str, Any]) -> str:
        from scenarios.format import dump_yaml

        path = tmp_path / f"script-{next(counter)}.yaml"
        path.write_text(dump_yaml({"version": 1, **script}))
        return str(path)

    return write


@pytest.fixture
def contract_checkers() -> dict[str, OpenApiChecker]:
    """OpenAPI checkers of the applications this test serves, by base URL."""
    return {}


@_async_fixture
async def serve(
    contract_checkers: dict[str, OpenApiChecker],
) -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    """Start applications on real loopback sockets; returns their base URLs.

    Every response the `http` fixture then receives from them is checked against the
    application's own OpenAPI document.
    """
    from scenarios.harness import checker_for, serve_app

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


@_async_fixture
async def http(
    contract_checkers: dict[str, OpenApiChecker],
) -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client whose every response from a served bridge must match its contract."""
    import aiohttp

    from scenarios.harness import contract_middleware

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=60),
        middlewares=(contract_middleware(contract_checkers),),
    ) as session:
        yield session


# -- bridges ---------------------------------------------------------------------------


StartBridge = Callable[..., Awaitable["RunningBridge"]]


@pytest.fixture(scope="session")
def real_codex(pytestconfig: pytest.Config) -> str:
    """The real codex executable; skips when none is configured or found (fails instead
    when `CI=true`), fails when the one configured (`--codex-bin`, `$CODEX_BIN`) cannot run."""
    from scenarios.harness import NO_CODEX, CodexNotFound, find_codex

    unusable: str | None = None
    try:
        found = find_codex(
            pytestconfig.getoption("codex_bin"), root=pytestconfig.rootpath, option="--codex-bin"
        )
    except CodexNotFound as exc:
        unusable = str(exc)
    if unusable is not None:
        pytest.fail(unusable, pytrace=False)
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {NO_CODEX}", pytrace=False)
        pytest.skip(NO_CODEX)
    return found


@_async_fixture
async def scripted_model() -> AsyncIterator[Any]:
    """The scripted model, empty: tests `scripted_model.model.add(...)` the replies."""
    from fakes.model_provider import ModelProviderServer

    async with ModelProviderServer() as server:
        yield server


@_async_fixture
async def start_bridge(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[StartBridge]:
    """Start bridges in-process; each is stopped (with its processes) after the test.

        bridge = await start_bridge(script={"turns": ["Hi"]}, preset="default",
                                    token="t", limits={"maxSessions": 2})

    `script`: a fake-codex script (a mapping, `version: 1` optional, or a path);
    `model`: scripted model replies (a list, a `ModelScript` or a `ModelProviderServer`)
    to run the real codex instead; `app_server`: any other command; `limits`: a
    `RestLimits` or a mapping of its fields (snake_case or camelCase).
    """
    from scenarios.expectations import fake_report_problems

    started: list[tuple[RunningBridge, Any, bool, Any]] = []
    counter = iter(range(1_000_000))

    async def start(
        script: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        preset: str = "trusted",
        token: str | None = None,
        limits: Any = None,
        exempt_health: bool = True,
        model: Any = None,
        app_server: list[str] | None = None,
        check_script: bool = True,
    ) -> RunningBridge:
        from scenarios import harness

        number = next(counter)
        directory = tmp_path / f"bridge-{number}"
        work = directory / "work"
        work.mkdir(parents=True)
        parsed = None
        owned_model = None
        report_dir = None
        if model is not None:
            command, owned_model = await _real_codex_command(request, model, directory, work)
        elif app_server is not None:
            command = list(app_server)
        else:
            path = None
            if script is not None:
                path, parsed = _script_path(script, directory)
            report_dir = directory / "fake-reports"
            command = harness.fake_app_server_command(path, report_dir=report_dir, cwd=work)
        bridge = await harness.start_bridge(
            command,
            preset=preset,
            limits=_limits(limits),
            token=token,
            exempt_health=exempt_health,
        )
        bridge.report_dir = report_dir
        started.append((bridge, parsed, check_script, owned_model))
        return bridge

    yield start
    problems = []
    for bridge, parsed, check_script, owned_model in reversed(started):
        await bridge.close()
        if owned_model is not None:
            await owned_model.close()
        if check_script and bridge.report_dir is not None:
            problems += fake_report_problems(parsed, bridge.reports())
    if problems:
        lines = "\n".join(f"  {problem.message}" for problem in problems)
        pytest.fail(
            "after the test, the fake app-server reports (check_script=False to allow):\n" + lines,
            pytrace=False,
        )


async def _real_codex_command(
    request: pytest.FixtureRequest, model: Any, directory: Path, work: Path
) -> tuple[list[str], Any]:
    from fakes.model_provider import ModelProviderServer, ModelScript

    codex = request.getfixturevalue("real_codex")
    owned = None
    if isinstance(model, ModelProviderServer):
        server = model
    else:
        script = model if isinstance(model, ModelScript) else ModelScript(replies=list(model))
        server = owned = ModelProviderServer(script)
        await server.start()
    home = directory / "codex-home"
    home.mkdir()
    command = server.codex_command(codex, codex_home=home, cwd=work)
    return command, owned


def _script_path(script: Any, directory: Path) -> tuple[str, Any]:
    """A script file for fake-codex, and the validated script (for the end checks)."""
    from fakes.app_server.script import load_script, parse_script
    from scenarios.format import dump_yaml

    if isinstance(script, Mapping):
        data = {"version": 1, **script}
        path = directory / "app-server.yaml"
        path.write_text(dump_yaml(data), encoding="utf-8")
        return str(path), parse_script(data, str(path))
    return os.fspath(script), load_script(script)


def _limits(limits: Any) -> Any:
    from pydantic.alias_generators import to_snake

    from bridge.limits import RestLimits

    if limits is None or isinstance(limits, RestLimits):
        return limits
    return RestLimits(**{to_snake(key): value for key, value in dict(limits).items()})


@_async_fixture
async def codex_bridge(request: pytest.FixtureRequest, start_bridge: StartBridge) -> RunningBridge:
    """A running bridge, built as the test's `@pytest.mark.codex_bridge(...)` says.

    Without the marker: the trusted preset, no auth, fake-codex without a script.
    """
    marker = request.node.get_closest_marker(MARKER)
    kwargs = dict(marker.kwargs) if marker else {}
    if marker and marker.args:
        kwargs.setdefault("script", marker.args[0])
    return await start_bridge(**kwargs)


@_async_fixture
async def bridge_client(codex_bridge: RunningBridge) -> aiohttp.ClientSession:
    """An aiohttp session for `codex_bridge`: relative URLs, its token, contract checks."""
    return codex_bridge.client()


@_async_fixture
async def sse(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Awaitable[SseReader]]]:
    """Open Server-Sent Event streams: `reader = await sse("/v1/sessions/ID/events/stream")`.

    The stream must answer 200 with `text/event-stream`; every read of the returned
    `SseReader` has a timeout (`next`, `collect`, `until`, `rest`). Streams are closed
    after the test. `client` defaults to `bridge_client`.
    """
    from scenarios.sse import SseReader

    responses: list[aiohttp.ClientResponse] = []

    async def open_stream(
        path: str,
        *,
        client: aiohttp.ClientSession | None = None,
        last_event_id: int | str | None = None,
        after: int | None = None,
        comments: bool = False,
        timeout: float = 10.0,
    ) -> SseReader:
        session = client if client is not None else _default_client(request)
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
        params = {"after": str(after)} if after is not None else {}
        async with asyncio.timeout(timeout):
            response = await session.get(path, headers=headers, params=params)
        responses.append(response)
        if response.status != 200:
            body = await response.text()
            raise AssertionError(f"GET {path}: expected a 200 stream, got {response.status} {body}")
        return SseReader(response, comments=comments)

    yield open_stream
    for response in responses:
        response.close()


def _default_client(request: pytest.FixtureRequest) -> aiohttp.ClientSession:
    # Only a fixture already set up can be fetched inside the running event loop.
    if "bridge_client" not in request.fixturenames:
        raise pytest.UsageError(
            "sse(...) without client= reads from bridge_client: request the bridge_client "
            "fixture in the test, or pass client=bridge.client()"
        )
    client: aiohttp.ClientSession = request.getfixturevalue("bridge_client")
    return client


@pytest.fixture
def run_scenario(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[..., Awaitable[ScenarioResult]]:
    """Run a scenario (a file path, or a mapping built in Python) inside the test.

    Returns the result when it passes; fails the test with the scenario's report
    otherwise (`check=False` returns a failed result instead).
    """
    from scenarios.format import load_scenario, parse_scenario
    from scenarios.reporting import format_result
    from scenarios.runner import RunOptions
    from scenarios.runner import run_scenario as run

    async def run_one(scenario: Any, *, check: bool = True) -> ScenarioResult:
        if isinstance(scenario, Mapping):
            loaded = parse_scenario(
                {"scenario": 1, **scenario}, source=f"<scenario in {request.node.name}>"
            )
        else:
            loaded = load_scenario(scenario)
        options = RunOptions(
            codex=request.config.getoption("codex_bin"),
            codex_option="--codex-bin",
            tmp_root=tmp_path,
        )
        result = await run(loaded, options)
        if result.outcome == "skipped":
            pytest.skip(result.skip_reason or "skipped")
        if check and result.outcome == "failed":
            pytest.fail(format_result(result), pytrace=False)
        return result

    return run_one


# -- respx: the bridge mocked for httpx, no process at all ------------------------------------

pytest_plugins = ["scenarios.respx_fixtures"]
