"""Starting a bridge in-process on a loopback port, and clients that check its contract.

Used by the scenario runner and by the pytest plugin's fixtures alike.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yarl
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from bridge import TOKEN_VARIABLE
from bridge.app import PRESET_ROUTES, PRESETS, SERVER_SETTINGS
from bridge.auth import with_bearer_auth
from bridge.codex_binary import native_beside
from bridge.limits import RestLimits
from bridge.route_paths import route_path
from bridge.routes import OPENAPI, SSE_CONTENT_TYPE
from fakes.app_server.cli import SCRIPT_ENV
from fakes.app_server.report import REPORT_ENV, read_reports
from scenarios.codex_install import pinned_codex
from scenarios.openapi_check import OpenApiChecker

#: A client middleware every bridge client made in this context passes its exchanges
#: through (set by `scenarios.cassette` while it records a scenario).
RECORDER: contextvars.ContextVar[aiohttp.ClientMiddlewareType | None] = contextvars.ContextVar(
    "codex_bridge_recorder", default=None
)


def fake_codex_command() -> list[str]:
    """How to start the bundled fake (without `app-server`): the console script beside this
    interpreter (a venv's bin/), else one on PATH, else the module run by this interpreter."""
    sibling = Path(sys.executable).with_name("fake-codex")
    found = str(sibling) if sibling.exists() else shutil.which("fake-codex")
    return [found] if found else [sys.executable, "-m", "fakes.app_server.cli"]


def fake_app_server_command(
    script: str | os.PathLike[str] | None = None,
    *,
    report_dir: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> list[str]:
    """`fake-codex app-server [--script S]` behind `env`, which sets `$FAKE_CODEX_SCRIPT`
    (so `--version` reads the script's `versionOutput`; empty without a script, so a stray
    one in the environment is not picked up) and, as given, `$FAKE_CODEX_REPORT` and the
    working directory. The bridge keeps wrappers before `app-server` for `--version`."""
    path = os.path.abspath(script) if script is not None else ""
    env = [
        "env",
        *(["-C", os.path.abspath(cwd)] if cwd is not None else []),
        f"{SCRIPT_ENV}={path}",
    ]
    if report_dir is not None:
        env.append(f"{REPORT_ENV}={os.path.abspath(report_dir)}")
    return [*env, *fake_codex_command(), "app-server", *(["--script", path] if path else [])]


async def app_server_command(
    directory: Path,
    script: str | os.PathLike[str] | None = None,
    *,
    model: Any = None,
    codex: Any = None,
) -> tuple[list[str], Any]:
    """The app-server of a bridge whose files go in `directory` (its cwd `work/`): fake-codex
    on `script`, reporting into `fake-reports/`; with `model` (a `ModelProviderServer`, a
    `ModelScript` or its replies) the real `codex` behind that scripted model. Returns the
    command and the model server started here (closed by the caller after the bridge)."""
    from fakes.model_provider import ModelProviderServer

    work = directory / "work"
    work.mkdir(parents=True, exist_ok=True)
    if model is None:
        return fake_app_server_command(
            script, report_dir=directory / "fake-reports", cwd=work
        ), None
    owned = None if isinstance(model, ModelProviderServer) else ModelProviderServer(model)
    if owned is not None:
        await owned.start()
    home = directory / "codex-home"
    home.mkdir()
    return (owned or model).codex_command(codex, codex_home=home, cwd=work), owned


#: What a run says when it needs the real codex and none was configured or found: the
#: same words from `rest-bridge scenarios` and from pytest.
NO_CODEX = (
    "no real codex: none configured (CODEX_BIN, or `--codex PATH` for `rest-bridge "
    "scenarios`, `--codex-bin PATH` for pytest) and none found (.codex-npm/ of the "
    "project, `codex` on PATH)"
)


class CodexNotFound(Exception):
    """A codex the user named (an option or `$CODEX_BIN`) cannot be run: never a skip, a
    path given on purpose that does not work is a mistake to fix."""


def find_codex(
    explicit: str | None = None, root: Path | None = None, *, option: str = "--codex"
) -> str | None:
    """The real codex, as an absolute path: the one named, `explicit` (given as `option`)
    or else `$CODEX_BIN`, as given (`CodexNotFound` when it cannot run; npm's launcher stands
    for the native binary beside it, `codex_binary.native_beside`); else the pinned
    copy `make codex` installs (`.codex-npm/` in `root`, then in the working directory),
    then `codex` on PATH; None when there is none."""
    for source, value in ((option, explicit), ("CODEX_BIN", os.environ.get("CODEX_BIN"))):
        if value:
            return _named_codex(source, value)
    for base in (root, Path.cwd()):
        pinned = pinned_codex(base / ".codex-npm") if base is not None else None
        if pinned is not None:
            path, note = pinned
            if note:
                print(f"note: {note}", file=sys.stderr)
            return path
    found = shutil.which("codex")
    return _native(os.path.abspath(found)) if found else None


def _native(codex: str) -> str:
    """The native binary beside an npm launcher (`codex_binary.native_beside`), saying so
    on stderr when it has to be the launcher."""
    path, note = native_beside(codex)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return path


def required_codex(
    explicit: str | None, option: str, require: bool, root: Path | None = None
) -> str | None:
    """`find_codex`, None meaning "skip" (`NO_CODEX`); with `require` (CI=true) none is
    a `CodexNotFound` too."""
    found = find_codex(explicit, root, option=option)
    if found is None and require:
        raise CodexNotFound(f"CI=true: {NO_CODEX}")
    return found


def _named_codex(source: str, value: str) -> str:
    found = shutil.which(value)
    if found:
        return _native(os.path.abspath(found))
    path = Path(value)
    if "/" not in value and not path.exists():
        why = "not found on PATH"
    elif not path.exists():
        why = "no such file"
    elif path.is_dir():
        why = "a directory, not the codex executable"
    else:
        why = "not executable"
    setting = f"CODEX_BIN={value}" if source == "CODEX_BIN" else f"{source} {value}"
    raise CodexNotFound(
        f"{setting}: {why} (a codex you name is used as given; fix the path, or drop it "
        "to use the one in .codex-npm/ or on PATH)"
    )


def contract_middleware(checkers: Mapping[str, OpenApiChecker]) -> aiohttp.ClientMiddlewareType:
    """A client middleware checking each response of a known base URL against its OpenAPI
    document (`ContractViolation`, an AssertionError); streams for status and type only."""

    async def check_contract(
        request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        response = await handler(request)
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        checker = checkers.get(base)
        if checker is not None:
            content_type = response.headers.get("Content-Type", "")
            streaming = content_type.startswith(SSE_CONTENT_TYPE)
            body = None if streaming else await response.read()
            checker.check(request.method, request.url.path, response.status, content_type, body)
        return response

    return check_contract


def checker_for(app: web.Application) -> OpenApiChecker | None:
    """An OpenAPI checker for an application built by `bridge.app`, if it has a document."""
    source = app.get(OPENAPI)
    return None if source is None else OpenApiChecker(orjson.loads(source()))


async def serve_app(app: web.Application, host: str = "127.0.0.1") -> tuple[web.AppRunner, str]:
    """Serve `app` on a free loopback port; returns the runner and the base URL."""
    runner = web.AppRunner(app, access_log=None, **SERVER_SETTINGS)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, f"http://{host}:{runner.addresses[0][1]}"


def bearer(auth: bool | str, token: str | None) -> dict[str, str]:
    """`Authorization` for a step's `auth`: True → the bridge's `token` (if any), a string
    → that token, False → none."""
    chosen = None if auth is False else (auth if isinstance(auth, str) else token)
    return {"Authorization": f"Bearer {chosen}"} if chosen else {}


@dataclass
class RunningBridge:
    """A bridge served in-process (or running elsewhere, see `connect_bridge`): where it
    is, how to talk to it, how to stop it."""

    url: str
    #: The application and its server; None for a bridge running elsewhere (a target).
    app: web.Application | None
    runner: web.AppRunner | None
    command: list[str]
    preset: str
    token: str | None = None
    checker: OpenApiChecker | None = None
    #: Where the fake-codex processes write their reports (None: not reporting).
    report_dir: Path | None = None
    #: Whether it asks for a token (a target says so in its OpenAPI document).
    auth: bool = False
    _clients: list[aiohttp.ClientSession] = field(default_factory=list)
    #: The requests it is serving now (in-process only): method, path, loop time started.
    _serving: dict[int, tuple[str, str, float]] = field(default_factory=dict)

    def open(self) -> list[tuple[str, str, float]]:
        """The requests this (in-process) bridge is still serving, streams included: each
        one's method, path with query, and the event loop's time when it came."""
        return list(self._serving.values())

    def reports(self) -> list[dict[str, Any]]:
        """What each fake-codex process behind this bridge reported so far."""
        return read_reports(self.report_dir) if self.report_dir is not None else []

    def client(
        self, *, auth: bool | str = True, contract_check: bool = True, **kwargs: Any
    ) -> aiohttp.ClientSession:
        """An aiohttp session bound to this bridge (relative URLs), closed with it, checking
        every response against the bridge's OpenAPI document unless `contract_check` is false."""
        checkers = {self.url: self.checker} if contract_check and self.checker else {}
        recorder = RECORDER.get()
        middlewares = (contract_middleware(checkers), *((recorder,) if recorder else ()))
        headers = {**bearer(auth, self.token), **kwargs.pop("headers", {})}
        session = aiohttp.ClientSession(
            base_url=self.url,
            headers=headers,
            middlewares=middlewares,
            timeout=kwargs.pop("timeout", aiohttp.ClientTimeout(total=60)),
            **kwargs,
        )
        self._clients.append(session)
        return session

    async def close(self) -> None:
        """Close the clients, stop the server and every app-server process it started."""
        for session in self._clients:
            await session.close()
        self._clients.clear()
        if self.runner is not None:
            await self.runner.cleanup()


async def start_bridge(
    command: Sequence[str],
    *,
    preset: str = "trusted",
    limits: RestLimits | None = None,
    token: str | None = None,
    exempt_health: bool = True,
) -> RunningBridge:
    """Build a preset on `command`, with bearer auth when `token` is given, and serve it."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}")
    app = PRESETS[preset](list(command), limits, None)
    if token is not None:
        with_bearer_auth(app, token, exempt_health=exempt_health)
    checker = checker_for(app)
    serving: dict[int, tuple[str, str, float]] = {}
    app.middlewares.append(_serving_middleware(serving))
    runner, url = await serve_app(app)
    return RunningBridge(
        url, app, runner, list(command), preset, token, checker, auth=bool(token), _serving=serving
    )


def _serving_middleware(serving: dict[int, tuple[str, str, float]]) -> Middleware:
    """Keeps `serving` up to date: what a test's deadline reports as still open."""

    @web.middleware
    async def note_serving(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = id(request)
        serving[key] = (request.method, request.path_qs, asyncio.get_running_loop().time())
        try:
            return await handler(request)
        finally:
            serving.pop(key, None)

    return note_serving


class TargetError(Exception):
    """A bridge given by URL (`--codex-target`) that cannot be used."""


async def connect_bridge(url: str, token: str | None = None) -> RunningBridge:
    """A bridge already running at `url` (`http://host:port`). Its OpenAPI document (asked
    with `token`, when given) checks every response, names its routes and says whether it
    has auth on (as a 401 without a token does); closing it closes only the clients."""
    target = yarl.URL(url)
    if target.scheme not in ("http", "https") or not target.host or target.path not in ("", "/"):
        raise TargetError(f"{url}: a target is an http(s)://host:port URL without a path")
    base = f"{target.scheme}://{target.host}:{target.port}"
    headers = bearer(True, token)
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
            session.get(base + route_path("openapi"), headers=headers) as response,
        ):
            raw = await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TargetError(f"{url}: cannot reach the bridge: {exc or type(exc).__name__}") from None
    if status == 401 and not token:
        return RunningBridge(base, None, None, [], "?", auth=True)
    if status in (401, 403) and token:
        raise TargetError(
            f"{url}: the target refused the token in ${TOKEN_VARIABLE} ({status} to GET "
            f"{route_path('openapi')}): set it to the token the target was started with"
        )
    if status != 200:
        raise TargetError(f"{url}: GET {route_path('openapi')} answered {status}")
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise TargetError(f"{url}: {route_path('openapi')} is not JSON") from None
    mounted = frozenset(  # HEAD on the health routes comes with their GET
        operation.get("operationId")
        for operations in document.get("paths", {}).values()
        for method, operation in operations.items()
        if method != "head"
    )
    preset = next((name for name, routes in PRESET_ROUTES.items() if routes == mounted), "?")
    checker = OpenApiChecker(document)
    return RunningBridge(base, None, None, [], preset, token, checker, auth="security" in document)
