"""Shared mode's connections, against an app-server the bridge connects to by URL.

The app-server here is a small WebSocket server in the test (real sockets, real frames:
``unix://`` and ``ws://`` with a token) that does on purpose what codex does only on
bad days: close one connection, write a frame that is not JSON, never answer. The real
codex in shared mode is tests/e2e/test_shared_mode.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp import WSMsgType, web
from cli_runs import main_here
from processes import open_descriptors

from bridge.app import default_app, trusted_bridge_app
from bridge.limits import AppServerSettings, RestLimits, RestLimitsEnvError
from bridge.settings import AppServerVariables
from scenarios.sse import SseReader

TOKEN = "s3cret-app-server-token"
WAIT = 30.0


class WsAppServer:
    """Answers `initialize`; `echo` echoes; `close/me` closes; `garbage` writes non-JSON;
    `hang` never answers; `ask` sends a server request and answers with the reply; `deaf`
    stops reading."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.connections = 0
        self.open: set[web.WebSocketResponse] = set()
        self.authorizations: list[str | None] = []
        #: One item per connection that ended.
        self.ended: asyncio.Queue[None] = asyncio.Queue()
        self.closing = asyncio.Event()
        #: Leave `initialize` unanswered.
        self.mute = False
        self.app = web.Application()
        self.app.router.add_get("/", self.handle)
        self.app.on_shutdown.append(self.close_all)

    async def close_all(self, app: web.Application) -> None:
        self.closing.set()
        for ws in list(self.open):
            await ws.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.authorizations.append(request.headers.get("Authorization"))
        if (
            self.token is not None
            and request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            return web.Response(status=401)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.connections += 1
        self.open.add(ws)
        asked: dict[int, int] = {}
        try:
            async for message in ws:
                if message.type is not WSMsgType.TEXT:
                    continue
                body = json.loads(message.data)
                method, ident = body.get("method"), body.get("id")
                if method is None:
                    if ident in asked:
                        await ws.send_str(json.dumps({"id": asked.pop(ident), "result": body}))
                    continue
                if method == "initialize" and self.mute:
                    continue
                if method == "initialize":
                    await ws.send_str(json.dumps({"id": ident, "result": {"userAgent": "ws/1"}}))
                elif method == "echo":
                    await ws.send_str(json.dumps({"id": ident, "result": body.get("params")}))
                elif method == "notify":
                    await ws.send_str(json.dumps({"method": "hello", "params": body["params"]}))
                    await ws.send_str(json.dumps({"id": ident, "result": {}}))
                elif method == "close/me":
                    await ws.close()
                elif method == "big":
                    blob = "x" * int(body["params"])
                    await ws.send_str(json.dumps({"method": "big", "params": blob}))
                    await ws.send_str(json.dumps({"id": ident, "result": {}}))
                elif method == "deaf":
                    # Stop reading: what the bridge sends from now on piles up.
                    await self.closing.wait()
                    break
                elif method == "garbage":
                    await ws.send_str("this is not JSON")
                elif method == "ask":
                    asked[1000 + ident] = ident
                    request_ = {"id": 1000 + ident, "method": "item/tool/requestUserInput"}
                    await ws.send_str(json.dumps({**request_, "params": {}}))
                elif method != "hang" and ident is not None:
                    await ws.send_str(json.dumps({"id": ident, "result": {}}))
        finally:
            self.open.discard(ws)
            self.ended.put_nowait(None)
        return ws


@pytest_asyncio.fixture
async def ws_server(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []

    async def start(kind: str, token: str | None = None) -> tuple[WsAppServer, str]:
        server = WsAppServer(token)
        runner = web.AppRunner(server.app, shutdown_timeout=1.0)
        await runner.setup()
        runners.append(runner)
        if kind == "unix":
            path = str(tmp_path / "app-server.sock")
            await web.UnixSite(runner, path).start()
            return server, f"unix://{path}"
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return server, f"ws://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def bridge_on(serve, url: str, token: str | None = None, **limits: int) -> str:
    settings = AppServerSettings(mode="shared", url=url, token=token)
    return str(await serve(trusted_bridge_app(["unused"], RestLimits(**limits), settings)))


async def post(http, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as response:
        return response.status, await response.json()


async def new_session(http, base: str) -> str:
    status, body = await post(http, f"{base}/v1/sessions", {})
    assert status == 201, body
    return str(body["sessionId"])


@pytest.mark.quick
@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["unix", "ws"])
async def test_sessions_calls_and_events_over_a_url(serve, http, ws_server, kind):
    server, url = await ws_server(kind)
    base = await bridge_on(serve, url)
    session = await new_session(http, base)
    status, body = await post(http, f"{base}/v1/sessions/{session}/call/echo", {"params": [1]})
    assert (status, body) == (200, {"result": [1]})
    status, body = await post(http, f"{base}/v1/sessions/{session}/call/notify", {"params": 7})
    assert status == 200, body
    async with http.get(f"{base}/v1/sessions/{session}/events?waitMs=5000") as response:
        event = await response.json()
    assert (event["method"], event["params"]) == ("hello", 7)
    status, body = await post(http, f"{base}/v1/call/echo", {"params": {"a": 1}})
    assert (status, body) == (200, {"result": {"a": 1}})
    assert server.connections == 2
    async with http.get(f"{base}/v1/compatibility") as response:
        shared = (await response.json())["appServer"]["shared"]
    assert shared["source"] == "url"
    assert shared["userAgent"] == "ws/1"
    assert shared["connections"] == 1


@pytest.mark.quick
@pytest.mark.asyncio
async def test_compatibility_names_no_command_for_an_app_server_it_did_not_start(
    serve, http, ws_server
):
    """Given a URL, the bridge runs no command (nor its `--version`): it says so, and
    names the app-server by the user agent its `initialize` answered."""
    _, url = await ws_server("unix")
    base = await bridge_on(serve, url)
    await new_session(http, base)
    async with http.get(f"{base}/v1/compatibility") as response:
        app_server = (await response.json())["appServer"]
    assert (app_server["command"], app_server["version"]) == ([], None)
    assert "did not start" in app_server["versionError"]
    assert (app_server["mode"], app_server["shared"]["source"]) == ("shared", "url")
    assert app_server["shared"]["userAgent"] == "ws/1"


@pytest.mark.asyncio
async def test_a_server_request_is_answered_over_http(serve, http, ws_server):
    _, url = await ws_server("unix")
    base = await bridge_on(serve, url)
    session = await new_session(http, base)
    call = asyncio.ensure_future(post(http, f"{base}/v1/sessions/{session}/call/ask", {}))
    async with http.get(f"{base}/v1/sessions/{session}/events?waitMs=5000") as response:
        request = await response.json()
    assert request["kind"] == "request"
    key = request["requestKey"]
    reply = {"result": {"answers": ["yes"]}}
    status, body = await post(http, f"{base}/v1/sessions/{session}/requests/{key}/result", reply)
    assert (status, body) == (200, {"status": "sent", "requestKey": key})
    status, body = await call
    assert status == 200
    assert body["result"] == {"id": int(key), "result": {"answers": ["yes"]}}


@pytest.mark.quick
@pytest.mark.asyncio
async def test_a_connection_the_server_closes_ends_that_session_alone(serve, http, ws_server):
    _, url = await ws_server("unix")
    base = await bridge_on(serve, url)
    doomed = await new_session(http, base)
    other = await new_session(http, base)
    hanging = asyncio.ensure_future(post(http, f"{base}/v1/sessions/{doomed}/call/hang", {}))
    async with http.get(f"{base}/v1/sessions/{doomed}/events/stream") as stream:
        reader = SseReader(stream)
        status, body = await post(http, f"{base}/v1/sessions/{doomed}/call/close/me", {})
        assert status == 502, body
        assert body["error"] == "app_server_exited"
        frames = await reader.until(lambda f: f.event == "exit", timeout=WAIT)
    # A normal closure (1000) reads as a clean exit, as a process's exit 0 would.
    assert frames[-1].json()["params"] == {
        "exitCode": 0,
        "signal": None,
        "stderrTail": "",
        "connection": "closed by the app-server",
    }
    status, body = await hanging
    assert status == 502, body
    assert body["error"] == "app_server_exited"
    # What ended is a connection (the app-server serves on), and the 409s say so: on a
    # call, a reply, a long-poll and a stream past the `exit` event.
    ended = f"The connection of session {doomed!r} to the shared app-server has ended."
    doomed_url = f"{base}/v1/sessions/{doomed}"
    exit_seq = frames[-1].json()["seq"]
    for method, url, body in (
        ("POST", f"{doomed_url}/call/echo", {"params": 1}),
        ("POST", f"{doomed_url}/requests/1/result", {"result": {}}),
        ("GET", f"{doomed_url}/events?after={exit_seq}&waitMs=10", None),
        ("GET", f"{doomed_url}/events/stream?after={exit_seq}", None),
    ):
        async with http.request(method, url, json=body) as response:
            assert response.status == 409, url
            assert await response.json() == {"error": "session_exited", "message": ended}
    status, body = await post(http, f"{base}/v1/sessions/{other}/call/echo", {"params": 2})
    assert (status, body) == (200, {"result": 2})
    async with http.get(f"{base}/v1/sessions") as response:
        states = {s["sessionId"]: s["state"] for s in (await response.json())["sessions"]}
    assert states == {doomed: "exited", other: "running"}


@pytest.mark.quick
@pytest.mark.asyncio
async def test_a_frame_that_is_not_json_is_a_protocol_error(serve, http, ws_server):
    _, url = await ws_server("unix")
    base = await bridge_on(serve, url)
    session = await new_session(http, base)
    status, body = await post(http, f"{base}/v1/sessions/{session}/call/garbage", {})
    assert status == 502, body
    assert body["error"] == "protocol_error"
    async with http.get(f"{base}/v1/sessions/{session}/events?after=0&waitMs=5000") as response:
        event = await response.json()
    assert event["kind"] == "exit"
    assert "not JSON" in event["params"]["protocolError"]


@pytest.mark.quick
@pytest.mark.asyncio
async def test_the_ws_token_is_sent_and_never_shown(serve, http, ws_server, caplog):
    server, url = await ws_server("ws", token=TOKEN)
    base = await bridge_on(serve, url, TOKEN)
    await new_session(http, base)
    assert server.authorizations == [f"Bearer {TOKEN}"]
    wrong = await bridge_on(serve, url, "not-the-token")
    caplog.set_level(logging.DEBUG)
    status, body = await post(http, f"{wrong}/v1/sessions", {})
    assert status == 502
    assert body["error"] == "app_server_spawn_failed"
    assert "401" in body["message"]
    async with http.get(f"{wrong}/v1/compatibility") as response:
        compat = await response.text()
    for text in (json.dumps(body), compat, caplog.text):
        assert TOKEN not in text
        assert "not-the-token" not in text


@pytest.mark.quick
@pytest.mark.asyncio
async def test_no_server_at_the_url_is_502_with_the_reason_in_words(serve, http, tmp_path, caplog):
    """The client hears why, in the system's words; the operator's log also hears where.
    No exception class names, no path or address in the body, never the token."""
    caplog.set_level(logging.ERROR, logger="bridge")
    # A port bound but not listening, and a unix socket bound but not listening: both
    # refuse, for as long as the test holds them.
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix:
        tcp.bind(("127.0.0.1", 0))
        unix.bind(str(tmp_path / "deaf.sock"))
        cases = [
            (f"unix://{tmp_path}/nothing.sock", "No such file or directory"),
            (f"unix://{tmp_path}/deaf.sock", "Connection refused"),
            (f"ws://127.0.0.1:{tcp.getsockname()[1]}", "Connection refused"),
        ]
        for url, reason in cases:
            caplog.clear()
            base = await bridge_on(serve, url, TOKEN)
            status, body = await post(http, f"{base}/v1/sessions", {})
            assert status == 502
            assert body == {
                "error": "app_server_spawn_failed",
                "message": f"Could not connect to the shared app-server: {reason}; "
                "check the bridge's app-server settings.",
            }
            assert [r.getMessage() for r in caplog.records] == [
                f"could not connect to the app-server at {url}: {reason}"
            ]
            assert TOKEN not in caplog.text


@pytest.mark.quick
@pytest.mark.asyncio
async def test_an_unanswered_initialize_is_a_connection_that_did_not_open(
    serve, http, ws_server, caplog
):
    """The 504 names the setting that bounds it, and the operator gets a WARNING line."""
    server, url = await ws_server("unix")
    server.mute = True
    base = await bridge_on(serve, url, spawn_timeout_ms=200)
    with caplog.at_level(logging.WARNING, logger="bridge"):
        status, body = await post(http, f"{base}/v1/sessions", {})
    assert status == 504, body
    assert body["message"] == (
        "Opening a connection to the shared app-server did not complete before its deadline"
        " (REST_ADAPTER_SPAWN_TIMEOUT_MS, 200 ms)."
    )
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "Opening a connection to the shared app-server did not complete before its deadline:"
        " no answer to `initialize` within 200 ms"
    ]
    await asyncio.wait_for(server.ended.get(), WAIT)  # and the bridge closed it


@pytest.mark.quick
@pytest.mark.asyncio
async def test_what_waits_for_a_deaf_app_server_is_bounded_in_bytes(serve, http, ws_server):
    """Frames waiting to be sent are bounded like a child's stdin (16 MiB), counted in
    the bytes that go on the wire: ten calls of 3.6 MB each (1.2 million three-byte
    characters) cannot all wait; some are 429 `busy` at once."""
    _, url = await ws_server("unix")
    base = await bridge_on(serve, url, max_body_bytes=8_000_000)
    session = f"{base}/v1/sessions/{await new_session(http, base)}"
    status, body = await post(http, f"{session}/call/deaf", {"timeoutMs": 1})
    assert (status, body["error"]) == (504, "timeout")
    payload = orjson.dumps({"params": "\u20ac" * 1_200_000, "timeoutMs": 120_000})
    headers = {"Content-Type": "application/json"}

    async def big_call() -> tuple[int, Any]:
        async with http.post(f"{session}/call/x", data=payload, headers=headers) as response:
            return response.status, await response.json()

    calls = [asyncio.ensure_future(big_call()) for _ in range(10)]
    try:
        done, _ = await asyncio.wait(calls, timeout=WAIT, return_when=asyncio.FIRST_COMPLETED)
        assert done, "every call is still waiting: the bound let 36 MB pile up"
        status, body = next(iter(done)).result()
        assert (status, body["error"]) == (429, "busy"), body
    finally:
        for waiting in calls:
            waiting.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


@pytest.mark.quick
@pytest.mark.asyncio
async def test_limits_hold_in_shared_mode(serve, http, ws_server):
    server, url = await ws_server("unix")
    base = await bridge_on(serve, url, max_sessions=2, session_idle_timeout_ms=300)
    first = await new_session(http, base)
    await new_session(http, base)
    status, body = await post(http, f"{base}/v1/sessions", {})
    assert status == 429
    assert body["error"] == "session_limit_reached"
    # The idle reaper closes the connections of idle sessions, which frees their slots.
    for _ in range(2):
        await asyncio.wait_for(server.ended.get(), WAIT)
    assert not server.open
    async with http.get(f"{base}/v1/sessions") as response:
        assert first not in [s["sessionId"] for s in (await response.json())["sessions"]]
    await new_session(http, base)


@pytest.mark.quick
@pytest.mark.asyncio
async def test_the_default_preset_in_shared_mode_still_refuses_by_preset(serve, http, ws_server):
    _, url = await ws_server("unix")
    settings = AppServerSettings(mode="shared", url=url)
    base = await serve(default_app(["unused"], RestLimits(), settings))
    body = {"options": {"experimentalApi": True}}
    status, payload = await post(http, f"{base}/v1/sessions", body)
    assert status == 403
    assert payload["data"] == {"fields": ["experimentalApi"]}


@pytest.mark.quick
def test_settings_from_the_environment():
    env = {"REST_ADAPTER_APP_SERVER_MODE": "shared"}
    assert AppServerVariables.from_env(env).app_server() == AppServerSettings(mode="shared")
    url = {"REST_ADAPTER_APP_SERVER_URL": "ws://h:1", "REST_ADAPTER_APP_SERVER_TOKEN": TOKEN}
    assert AppServerVariables.from_env(url).app_server() == AppServerSettings(
        "shared", "ws://h:1", TOKEN
    )
    assert TOKEN not in repr(AppServerVariables.from_env(url).app_server())
    assert AppServerVariables.from_env({}).app_server().mode == "process"
    assert AppServerVariables.from_env(env).app_server(mode="process").mode == "process"
    for variable, value in (
        ("REST_ADAPTER_APP_SERVER_MODE", "Shared"),
        ("REST_ADAPTER_APP_SERVER_URL", "http://h:1"),
        ("REST_ADAPTER_APP_SERVER_URL", "unix://relative.sock"),
        ("REST_ADAPTER_APP_SERVER_URL", "ws://h"),
    ):
        with pytest.raises(RestLimitsEnvError) as caught:
            AppServerVariables.from_env({variable: value}).app_server()
        assert caught.value.variable == variable
    with pytest.raises(ValueError, match="needs the shared mode"):
        AppServerSettings(mode="process", url="ws://h:1")


@pytest.mark.quick
@pytest.mark.parametrize(
    ("env", "args", "says"),
    [
        ({"REST_ADAPTER_APP_SERVER_MODE": "both"}, [], "REST_ADAPTER_APP_SERVER_MODE='both'"),
        ({"REST_ADAPTER_APP_SERVER_URL": "tcp://x"}, [], "REST_ADAPTER_APP_SERVER_URL"),
        ({}, ["--app-server-mode", "process", "--app-server-url", "ws://h:1"], "shared mode"),
    ],
)
def test_serve_refuses_bad_app_server_settings(env, args, says, monkeypatch):
    """Run by the CLI's own main in this process (tests/cli_runs.py)."""
    result = main_here(["serve", "--port", "0", *args], monkeypatch, env, keep_settings=True)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.quick
@pytest.mark.parametrize(
    ("env", "args"),
    [
        ({"REST_ADAPTER_APP_SERVER_URL": "ws://bridge:pw-0fd2@h:1"}, []),
        ({}, ["--app-server-mode", "shared", "--app-server-url", "ws://bridge:pw-0fd2@h:1"]),
    ],
)
def test_a_url_holding_credentials_is_refused_without_showing_them(env, args, monkeypatch, capsys):
    """Whatever stands before the host would be printed on the start line and in every
    connection error: the token has its own variable, never shown. (Run by the CLI's own
    main in this process: tests/cli_runs.py.)"""
    result = main_here(["serve", "--port", "0", *args], monkeypatch, env, keep_settings=True)
    assert result.returncode == 2, result.stderr
    assert "REST_ADAPTER_APP_SERVER_TOKEN" in result.stderr
    assert "pw-0fd2" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.quick
@pytest.mark.asyncio
async def test_a_message_over_max_line_bytes_is_a_protocol_error(serve, http, ws_server):
    _, url = await ws_server("unix")
    base = await bridge_on(serve, url, max_line_bytes=100_000)
    session = await new_session(http, base)
    status, body = await post(http, f"{base}/v1/sessions/{session}/call/big", {"params": 50_000})
    assert status == 200, body
    status, body = await post(http, f"{base}/v1/sessions/{session}/call/big", {"params": 200_000})
    assert status == 502, body
    assert body["error"] == "protocol_error"
    other = await new_session(http, base)
    status, body = await post(http, f"{base}/v1/sessions/{other}/call/echo", {"params": 1})
    assert (status, body) == (200, {"result": 1})


@pytest.mark.quick
@pytest.mark.asyncio
async def test_connections_leave_no_descriptor_behind(serve, http, ws_server):
    server, url = await ws_server("unix")
    base = await bridge_on(serve, url)

    async def cycle() -> None:
        session = await new_session(http, base)
        status, _ = await post(http, f"{base}/v1/sessions/{session}/call/echo", {"params": 1})
        assert status == 200
        async with http.delete(f"{base}/v1/sessions/{session}") as response:
            assert response.status == 200

    await cycle()
    await asyncio.wait_for(server.ended.get(), WAIT)
    baseline = open_descriptors()
    for _ in range(30):
        await cycle()
        await asyncio.wait_for(server.ended.get(), WAIT)
    assert not server.open
    # The test process holds both ends (bridge and server): nothing may pile up.
    assert open_descriptors() <= baseline + 2


@pytest.mark.quick
@pytest.mark.asyncio
async def test_a_drain_waits_for_the_connections(serve, http, ws_server):
    from bridge.limits import ReplicaSettings
    from bridge.replica import configure
    from bridge.routes import BACKEND

    server, url = await ws_server("unix")
    settings = AppServerSettings(mode="shared", url=url)
    app = trusted_bridge_app(["unused"], RestLimits(), settings)
    drain = configure(app[BACKEND], ReplicaSettings(replica_id="shared-1"))
    base = await serve(app)
    session = await new_session(http, base)
    assert session.startswith("shared-1.")
    done = asyncio.Event()
    drain.start(done)
    status, body = await post(http, f"{base}/v1/sessions", {})
    assert (status, body["error"]) == (503, "replica_unavailable")
    status, body = await post(http, f"{base}/v1/sessions/{session}/call/echo", {"params": 3})
    assert (status, body) == (200, {"result": 3})
    assert not done.is_set()
    async with http.delete(f"{base}/v1/sessions/{session}") as response:
        assert response.status == 200
    await asyncio.wait_for(done.wait(), WAIT)
    assert not server.open
