"""pytest plugin of codex-rest-bridge (entry point `pytest11`): scenario files as tests,
and `codex_` fixtures; scenarios/README.md ("pytest") documents what it registers.

A scenario file is one test item: a malformed one is a collection error naming the
file and line, a failing one reports the failing step's file and line, then the
transcript (left out with `--tb=short`, `line` or `no`). Without pytest-asyncio (no
`harness` extra) the async fixtures say which extra to install when asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import inspect
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from packaging.version import Version

from bridge import TOKEN_VARIABLE
from scenarios.deadline import DEFAULT_SECONDS
from scenarios.paths import file_beside_test

try:
    import pytest_asyncio
except ImportError:  # the harness extra brings it
    pytest_asyncio = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import aiohttp

    from scenarios.deadline import Watch
    from scenarios.format import LoadedScenario
    from scenarios.harness import RunningBridge
    from scenarios.runner import RunOptions, ScenarioResult
    from scenarios.sse import SseReader

DEFAULT_PATTERNS = ("*.scenario.yaml", "*.scenario.yml")
PATTERNS_INI = "codex_scenario_patterns"
MARKER = "codex_bridge"
REAL_MARKER = "codex_real"
TIMEOUT_MARKER = "codex_timeout"
TIMEOUT_INI = "codex_timeout"
TIMEOUT_ENV = "CODEX_TEST_TIMEOUT"
_DEFAULT_DEADLINE = pytest.StashKey[tuple[float, str]]()
_WATCH = pytest.StashKey["Watch"]()
_TAGS = pytest.StashKey[set[str]]()
_TARGET_TOKEN = pytest.StashKey[str | None]()
#: The scenarios collected so far in this run: name -> where it is named.
_NAMES = pytest.StashKey[dict[str, str]]()
T = TypeVar("T")
#: The tags that become marks (every tag is a keyword for `-k`).
MARK_NAME = re.compile(r"[A-Za-z][\w-]*")


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


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    group = parser.getgroup("codex-rest-bridge", "codex-rest-bridge scenarios and fixtures")
    for option, metavar, text in (
        (
            "--codex-bin",
            "PATH",
            "the real codex, for codex_bin and scenarios that script the model "
            "(default: $CODEX_BIN, .codex-npm/, codex on PATH)",
        ),
        (
            "--codex-target",
            "URL",
            "run scenario files against the bridge running at URL (http://host:port) "
            f"instead of one of their own; its token from ${TOKEN_VARIABLE} or the file "
            f"${TOKEN_VARIABLE}_FILE names. Scenarios that "
            "need a bridge built for them skip, saying why. Python tests' fixtures "
            "(codex_bridge, codex_client, ...) still start bridges of their own",
        ),
        (
            "--codex-target-script",
            "FILE",
            "the scenario file whose appServer script the target's fake-codex runs "
            "(that scenario runs against the target too)",
        ),
        (
            "--codex-timeout",
            "SECONDS",
            "the deadline of each async test that uses the codex_ fixtures: past it the "
            "test fails naming what was still pending (default: $CODEX_TEST_TIMEOUT, the "
            f"ini option {TIMEOUT_INI}, else {DEFAULT_SECONDS:g}; 0: none)",
        ),
    ):
        group.addoption(option, dest=option[2:].replace("-", "_"), metavar=metavar, help=text)
    parser.addini(
        TIMEOUT_INI,
        type="string",
        default="",
        help=f"the deadline in seconds of async tests that use the codex_ fixtures "
        f"(default {DEFAULT_SECONDS:g}; 0: none)",
    )
    parser.addini(
        PATTERNS_INI,
        type="linelist",
        default=list(DEFAULT_PATTERNS),
        help="file name patterns collected as scenarios",
    )
    if pytest_asyncio is not None and Version(pytest_asyncio.__version__).release >= (1, 5):
        pluginmanager.register(_LoopScopeDefault(parser), "codex-loop-scope-default")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for marker in (
        f"{MARKER}(script=None, preset='trusted', token=None, limits=None, model=None, "
        "check_script=True): how the codex_bridge fixture's bridge is built",
        f"{REAL_MARKER}: runs the real codex (skips without it; fails when CI=true)",
        f"{TIMEOUT_MARKER}(seconds): this test's deadline (0: none), as --codex-timeout",
    ):
        config.addinivalue_line("markers", marker)
    config.stash[_TAGS] = set()
    # Read once, before anything runs: a token file that cannot be used is a usage error.
    config.stash[_TARGET_TOKEN] = _target_token() if config.getoption("codex_target") else None
    if _ci() and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_EverySkipFails(config), "codex-every-skip-fails")
    config.stash[_DEFAULT_DEADLINE] = _default_deadline(config)


def _seconds(value: Any, where: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise pytest.UsageError(f"{where}: {value!r} is not a number of seconds (0: no deadline)")
    return seconds


def _default_deadline(config: pytest.Config) -> tuple[float, str]:
    """The deadline of tests without the marker, and what set it: the option, else the
    variable, else the ini option, else DEFAULT_SECONDS."""
    given = config.getoption("codex_timeout")
    if given is not None:
        return _seconds(given, "--codex-timeout"), "--codex-timeout"
    if os.environ.get(TIMEOUT_ENV):
        return _seconds(os.environ[TIMEOUT_ENV], f"${TIMEOUT_ENV}"), f"${TIMEOUT_ENV}"
    if config.getini(TIMEOUT_INI):
        return _seconds(config.getini(TIMEOUT_INI), TIMEOUT_INI), f"ini {TIMEOUT_INI}"
    return DEFAULT_SECONDS, "the plugin's default"


def _deadline(item: pytest.Item) -> tuple[float, str] | None:
    """The deadline of an async test that uses a `codex_` fixture or has the marker."""
    if not isinstance(item, pytest.Function) or not inspect.iscoroutinefunction(item.obj):
        return None
    marker = item.get_closest_marker(TIMEOUT_MARKER)
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("seconds")
        chosen = _seconds(value, f"@pytest.mark.{TIMEOUT_MARKER}"), f"@pytest.mark.{TIMEOUT_MARKER}"
    elif any(name.startswith("codex_") for name in item.fixturenames):
        chosen = item.config.stash[_DEFAULT_DEADLINE]
    else:
        return None
    return chosen if chosen[0] > 0 else None


def _watch(item: pytest.Item) -> Watch:
    """What the test's deadline reports on: the fixtures add their bridges to it."""
    from scenarios.deadline import Watch

    return item.stash.setdefault(_WATCH, Watch(0.0, "", []))


#: The fixtures whose bridge or server runs on the test's event loop.
ON_THE_LOOP = (
    "codex_bridge",
    "codex_client",
    "codex_sse",
    "codex_start_bridge",
    "codex_scripted_model",
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A synchronous test cannot use a bridge that runs on the event loop: nothing runs
    the loop while it does, so the bridge never answers and the test would wait on it
    until its client's timeout, or forever. Said at once instead, with what to write."""
    if not isinstance(item, pytest.Function) or inspect.iscoroutinefunction(item.obj):
        return
    if pytest_asyncio is None:  # the fixtures say which extra they need first
        return
    used = [name for name in ON_THE_LOOP if name in item.fixturenames]
    if used:
        pytest.fail(
            f"{item.name} is a synchronous test, but it uses {', '.join(used)}, whose bridge "
            "runs on the test's event loop, which only an `async def` test runs: make the test "
            "`async def` "
            "(with @pytest.mark.asyncio unless asyncio_mode = auto) and call a synchronous "
            "client or service with `await asyncio.to_thread(...)`; or start a bridge in a "
            "process of its own (`rest-bridge serve --port 0`, docs/HOSTS.md)",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """An async test that uses the plugin runs under its deadline (scenarios.deadline)."""
    from scenarios.deadline import bounded

    deadline = _deadline(item)
    if deadline is None:
        return (yield)
    assert isinstance(item, pytest.Function)
    watch = _watch(item)
    watch.seconds, watch.setting = deadline
    original = item.obj
    item.obj = bounded(original, watch)
    try:
        return (yield)
    finally:
        item.obj = original


LOOP_SCOPE_OPTION = "asyncio_default_fixture_loop_scope"


class _LoopScopeDefault:
    """Spares host projects pytest-asyncio's (1.5+) warning about an unset loop scope: the
    option's default becomes `fixture-scope`, what pytest-asyncio does anyway when it is
    unset (no fixture changes loop). A default, so a host's value (its configuration file,
    `-o`) wins. Declared again before pytest-asyncio reads it at configure time, and only
    when pytest-asyncio is in the run (not under `-p no:asyncio`)."""

    def __init__(self, parser: pytest.Parser) -> None:
        self.parser = parser

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        from pytest_asyncio import plugin

        if config.pluginmanager.is_registered(plugin):
            self.parser.addini(
                LOOP_SCOPE_OPTION,
                "default scope of the asyncio event loop used to execute async fixtures "
                "(codex-rest-bridge's plugin: fixture-scope unless set)",
                type="string",
                default="fixture-scope",
            )


def _is_scenario(config: pytest.Config, path: str) -> bool:
    patterns = config.getini(PATTERNS_INI) or DEFAULT_PATTERNS
    return any(fnmatch.fnmatch(os.path.basename(path), pattern) for pattern in patterns)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if _is_scenario(parent.config, str(file_path)):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class _EverySkipFails:
    """Under `CI=true`, a run whose every scenario skipped fails: it checked nothing. Not in
    xdist workers: the main process receives their reports, so sees each outcome once."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.skips: list[str | None] = []  # a skip's reason, None for a scenario that ran

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        scenario = _is_scenario(self.config, report.nodeid.split("::")[0])
        if scenario and (report.when == "call" or report.skipped):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else "?"
            self.skips.append(str(reason) if report.skipped else None)

    def _all_skipped(self) -> bool:
        return bool(self.skips) and None not in self.skips

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self._all_skipped() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self._all_skipped():
            reasons = "; ".join(dict.fromkeys(str(s).removeprefix("Skipped: ") for s in self.skips))
            terminalreporter.write_line(
                f"CI=true: all {len(self.skips)} scenarios were skipped and none ran, which "
                f"fails a CI run (it checked nothing). Skipped: {reasons}",
                red=True,
            )


def _ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


class ScenarioFile(pytest.File):
    """A scenario file: one item, or a collection error with the file and line."""

    def collect(self) -> Iterator[pytest.Item]:
        from scenarios.format import ScenarioError, load_scenario

        try:
            loaded = load_scenario(self.path)
        except ScenarioError as exc:
            raise self.CollectError(str(exc)) from None
        here = loaded.where(("name",), column=True)
        first = self.config.stash.setdefault(_NAMES, {}).setdefault(loaded.name, here)
        if first != here:
            raise self.CollectError(
                f"{here}: the scenario name {loaded.name!r} is taken by {first}; names are "
                "unique in a run (give one a `name:` of its own)"
            )
        yield ScenarioItem.from_parent(self, name=loaded.name, loaded=loaded)


class ScenarioFailed(AssertionError):
    """A scenario failed; the item reports it with `scenarios.reporting`."""

    def __init__(self, result: ScenarioResult) -> None:
        super().__init__(f"scenario {result.loaded.name} failed")
        self.result = result


class ScenarioItem(pytest.Item):
    """Runs one scenario in a fresh event loop, bridge and temporary directory. Its tags are
    keywords (`-k TAG`) and, when names, marks (`-m TAG`); one scripting the model is marked
    `codex_real`; `parallel: false` puts it in the xdist group `codex-serial` and runs it
    holding the run's serial lock, from its setup to its teardown, so that no two such
    scenarios run at once on any of the run's xdist workers, whatever `--dist` mode spread
    them (plain `-n`; or `--dist loadgroup` on a pytest where pytest-xdist's groups no
    longer hold)."""

    def __init__(self, *, loaded: LoadedScenario, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loaded = loaded
        self.extra_keyword_matches.update(loaded.scenario.tags)
        registered = self.config.stash.setdefault(_TAGS, set())
        for tag in filter(MARK_NAME.fullmatch, loaded.scenario.tags):
            if tag not in registered:
                registered.add(tag)
                self.config.addinivalue_line("markers", f"{tag}: a scenario tag")
            self.add_marker(tag)
        if loaded.scenario.real_codex:
            self.add_marker(REAL_MARKER)
        if not loaded.scenario.parallel and self.config.pluginmanager.has_plugin("xdist"):
            self.add_marker(pytest.mark.xdist_group("codex-serial"))
        self._serial: contextlib.ExitStack | None = None

    def setup(self) -> None:
        if not self.loaded.scenario.parallel:
            self._serial = contextlib.ExitStack()
            self._serial.enter_context(_serial_lock(self.config))

    def teardown(self) -> None:
        if self._serial is not None:
            self._serial.close()
            self._serial = None

    def runtest(self) -> None:
        from scenarios.runner import run_scenario_sync

        result = run_scenario_sync(self.loaded, _run_options(self.config, _tmp_root(self.config)))
        if result.outcome == "skipped":  # reported at the scenario file: see makereport
            pytest.skip(result.skip_reason or "skipped")
        if result.outcome == "failed":
            raise ScenarioFailed(result)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, ScenarioFailed):
            from scenarios.reporting import format_result

            brief = self.config.getoption("tbstyle", "auto") in ("short", "line", "no")
            return format_result(excinfo.value.result, transcript=not brief)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, 0, f"scenario: {self.name}"


@contextlib.contextmanager
def _serial_lock(config: pytest.Config) -> Iterator[None]:
    """An exclusive lock on a file that every xdist worker of this run shares: beside the
    workers' own `--basetemp` folders (`.../popen-gwN`). Outside a worker (no `-n`), or
    where there are no `flock` locks (Windows), there is nothing to wait for."""
    basetemp = config.getoption("basetemp")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not basetemp:
        yield
        return
    try:
        import fcntl
    except ImportError:  # Windows: xdist's own grouping is all there is
        yield
        return
    path = Path(basetemp).resolve().parent / "codex-serial.lock"
    with open(path, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A scenario's skip is reported at its file, not at the plugin's line that raised it."""
    report: pytest.TestReport = yield
    if isinstance(item, ScenarioItem) and report.skipped and isinstance(report.longrepr, tuple):
        path, line, _ = item.reportinfo()
        report.longrepr = (os.fspath(path), (line or 0) + 1, report.longrepr[2])
    return report


def _run_options(config: pytest.Config, tmp_root: Path | None) -> RunOptions:
    from scenarios.runner import RunOptions

    script = config.getoption("codex_target_script")
    return RunOptions(
        codex=config.getoption("codex_bin"),
        codex_option="--codex-bin",
        tmp_root=tmp_root,
        target=config.getoption("codex_target"),
        target_token=config.stash.get(_TARGET_TOKEN, None),
        target_script=Path(script) if script else None,
    )


def _target_token() -> str | None:
    """The target's token, from $REST_ADAPTER_TOKEN or the file $REST_ADAPTER_TOKEN_FILE
    names (as `rest-bridge serve` reads it); a file that cannot be used is a usage error
    naming the variable, never the token."""
    from bridge.credentials import SecretError, read_secret

    try:
        return read_secret(TOKEN_VARIABLE) or None
    except SecretError as exc:
        raise pytest.UsageError(str(exc)) from None


_TMP_ROOT = pytest.StashKey[Path]()


def _tmp_root(config: pytest.Config) -> Path:
    """Where the scenario files' runs make their directories: `scenarios/` under pytest's
    `--basetemp` when there is one (always in an xdist worker, which gets one of its own),
    else a directory of this run's under the system's temporary folder."""
    root = config.stash.get(_TMP_ROOT, None)
    if root is None:
        given = config.getoption("basetemp")
        if given:
            root = Path(given).resolve() / "scenarios"
            shutil.rmtree(root, ignore_errors=True)  # as pytest empties a given --basetemp
        else:
            root = Path(tempfile.mkdtemp(prefix="pytest-scenarios-"))
        config.stash[_TMP_ROOT] = root
    return root


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's own directory goes once empty: only failed runs' directories are kept."""
    root = config.stash.get(_TMP_ROOT, None)
    if root is not None and not config.getoption("basetemp"):
        with contextlib.suppress(OSError):
            root.rmdir()


StartBridge = Callable[..., Awaitable["RunningBridge"]]


@pytest.fixture(scope="session")
def codex_bin(pytestconfig: pytest.Config) -> str:
    """The real codex executable; skips when none is configured or found (fails instead
    when `CI=true`), fails when the one configured (`--codex-bin`, `$CODEX_BIN`) cannot run."""
    from scenarios.harness import NO_CODEX, CodexNotFound, required_codex

    unusable: str | None = None
    given = pytestconfig.getoption("codex_bin")
    try:
        found = required_codex(given, "--codex-bin", _ci(), root=pytestconfig.rootpath)
    except CodexNotFound as exc:
        unusable = str(exc)
    if unusable is not None:  # failed outside the `except`: no chained traceback
        pytest.fail(unusable, pytrace=False)
    if found is None:
        pytest.skip(NO_CODEX)
    return found


@_async_fixture
async def codex_scripted_model() -> AsyncIterator[Any]:
    """The scripted model, empty: tests `scripted_model.model.add(...)` the replies."""
    from fakes.model_provider import ModelProviderServer

    async with ModelProviderServer() as server:
        yield server


@_async_fixture
async def codex_start_bridge(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[StartBridge]:
    """Start bridges in-process; each is stopped (with its processes) after the test.

        bridge = await codex_start_bridge(script={"turns": ["Hi"]}, preset="default",
                                          token="t", limits={"maxSessions": 2})

    `script`: a fake-codex script (a mapping, `version: 1` optional, or a path);
    `model`: scripted model replies (a list, a `ModelScript` or a `ModelProviderServer`)
    to run the real codex instead; `app_server`: any other command; `limits`: a
    `RestLimits` or a mapping of its fields (snake_case or camelCase).
    """
    from fakes.app_server.report import report_problems

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

        directory = tmp_path / f"bridge-{next(counter)}"
        directory.mkdir()
        if isinstance(script, str | os.PathLike):
            script = file_beside_test(request, script)
        path, parsed = _script_path(script, directory) if script is not None else (None, None)
        if app_server is not None:
            command, owned_model = list(app_server), None
        else:
            codex = request.getfixturevalue("codex_bin") if model is not None else None
            command, owned_model = await harness.app_server_command(
                directory, path, model=model, codex=codex
            )
        bridge = await harness.start_bridge(
            command, preset=preset, limits=_limits(limits), token=token, exempt_health=exempt_health
        )
        if model is None and app_server is None:
            bridge.report_dir = directory / "fake-reports"
        started.append((bridge, parsed, check_script, owned_model))
        _watch(request.node).bridges.append(bridge)
        return bridge

    yield start
    problems = []
    for bridge, parsed, check_script, owned_model in reversed(started):
        await bridge.close()
        if owned_model is not None:
            await owned_model.close()
        if check_script and bridge.report_dir is not None:
            problems += [message for _, message in report_problems(parsed, bridge.reports())]
    if problems and not _watch(request.node).expired:  # the deadline's failure said it first
        lines = "\n".join(f"  {message}" for message in problems)
        pytest.fail(
            "after the test, the fake app-server reports (check_script=False to allow):\n" + lines,
            pytrace=False,
        )


def _script_path(script: Any, directory: Path) -> tuple[str, Any]:
    """A script file for fake-codex, and the validated script (for the end checks)."""
    from fakes.app_server.script import ScriptError, load_script, parse_script
    from scenarios.format import dump_yaml

    try:
        if isinstance(script, Mapping):
            data = {"version": 1, **script}
            path = directory / "app-server.yaml"
            path.write_text(dump_yaml(data), encoding="utf-8")
            return str(path), parse_script(data, str(path))
        return os.fspath(script), load_script(script)
    except ScriptError as exc:  # names the file and line itself: no traceback
        raise pytest.fail.Exception(str(exc), pytrace=False) from None


def _limits(limits: Any) -> Any:
    from bridge.limits import RestLimits
    from scenarios.format import BridgeSpec

    if limits is None or isinstance(limits, RestLimits):
        return limits
    return BridgeSpec(limits=limits).rest_limits()  # snake_case or camelCase keys


@_async_fixture
async def codex_bridge(
    request: pytest.FixtureRequest, codex_start_bridge: StartBridge
) -> RunningBridge:
    """A running bridge, built as the test's `@pytest.mark.codex_bridge(...)` says.

    Without the marker: the trusted preset, no auth, fake-codex without a script.
    """
    marker = request.node.get_closest_marker(MARKER)
    kwargs = dict(marker.kwargs) if marker else {}
    if marker and marker.args:
        kwargs.setdefault("script", marker.args[0])
    return await codex_start_bridge(**kwargs)


@_async_fixture
async def codex_client(
    request: pytest.FixtureRequest, codex_bridge: RunningBridge
) -> aiohttp.ClientSession:
    """An aiohttp session for `codex_bridge`: relative URLs, its token, contract checks."""
    from scenarios.harness import RunningBridge

    return _ours(request, "codex_bridge", codex_bridge, RunningBridge).client()


@_async_fixture
async def codex_sse(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[..., Awaitable[SseReader]]]:
    """Open SSE streams: `reader = await codex_sse("/v1/sessions/ID/events/stream")`, read
    through `codex_client` unless `client=` says otherwise. The stream must answer 200 with
    `text/event-stream`; every read has a timeout. Streams are closed after the test."""
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
    if "codex_client" not in request.fixturenames:
        raise pytest.UsageError(
            "codex_sse(...) without client= reads from codex_client: request the codex_client "
            "fixture in the test, or pass client=bridge.client()"
        )
    import aiohttp

    client = request.getfixturevalue("codex_client")
    return _ours(request, "codex_client", client, aiohttp.ClientSession)


def _ours(request: pytest.FixtureRequest, name: str, value: Any, kind: type[T]) -> T:
    """`value`, the fixture `name`, when it is the plugin's; else a failure naming the
    clash (a host fixture of the same name overrides the plugin's where it is visible)."""
    if isinstance(value, kind):
        return value
    module = _defined_in(request, name)
    where = f" ({module.__name__}.{name})" if module is not None else ""
    pytest.fail(
        f"the fixture {name!r} is your suite's own{where}, a {type(value).__name__}, and it "
        f"overrides the one of codex-rest-bridge's pytest plugin, which {request.fixturename} "
        f"uses: rename yours (the plugin's names all start with `codex_`)",
        pytrace=False,
    )


def _defined_in(request: pytest.FixtureRequest, name: str) -> Any:
    """The test module or conftest, nearest the test first, that has an attribute `name`
    (the host's fixture, when it kept the function's name)."""
    test = Path(request.node.path).resolve()
    conftests = [
        plugin
        for plugin in request.config.pluginmanager.get_plugins()
        if getattr(plugin, "__name__", "").rsplit(".", 1)[-1] == "conftest"
        and Path(getattr(plugin, "__file__", "/") or "/").resolve().parent in test.parents
    ]
    conftests.sort(key=lambda plugin: len(Path(plugin.__file__).resolve().parts), reverse=True)
    module = getattr(request, "module", None)
    for candidate in [module, *conftests]:
        if candidate is not None and hasattr(candidate, name):
            return candidate
    return None


@pytest.fixture
def codex_run_scenario(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[..., Awaitable[ScenarioResult]]:
    """Run a scenario (a file path, or a mapping built in Python) inside the test; a
    failing one fails the test with its report (`check=False` returns it instead)."""
    from scenarios.format import ScenarioError, load_scenario, parse_scenario
    from scenarios.reporting import format_result
    from scenarios.runner import run_scenario as run

    async def run_one(scenario: Any, *, check: bool = True) -> ScenarioResult:
        if isinstance(scenario, Mapping):
            loaded = parse_scenario(
                {"scenario": 1, **scenario}, source=f"<scenario in {request.node.name}>"
            )
        else:
            try:
                loaded = load_scenario(file_beside_test(request, scenario))
            except ScenarioError as exc:
                raise pytest.fail.Exception(str(exc), pytrace=False) from None
        watch = _watch(request.node)
        watch.scenario = loaded.name
        result = await run(loaded, _run_options(request.config, tmp_path))
        watch.scenario = None
        if result.outcome == "skipped":
            pytest.skip(result.skip_reason or "skipped")
        if check and result.outcome == "failed":
            pytest.fail(format_result(result), pytrace=False)
        return result

    return run_one


# -- respx: the bridge mocked for httpx, no process at all ------------------------------------

pytest_plugins = ["scenarios.respx_fixtures"]
