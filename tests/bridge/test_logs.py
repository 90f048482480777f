"""The bridge's log lines (bridge/logs.py), read from a real `rest-bridge serve`.

Each test starts the program with fake-codex behind it, drives it over real sockets and
reads what it wrote: the banner on stdout, the log lines on stderr. A module's run of
the whole API (success, 401, 4xx, 5xx, an SSE stream, an app-server crash, a text turn,
a request aiohttp's parser refuses) in each format is shared by the tests that read it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from processes import nginx_binary

#: The module's runs are shared by its tests: one worker starts each once.
pytestmark = pytest.mark.xdist_group("logs")

REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
WAIT = 60.0

#: What must never reach a log line.
TOKEN = "tok-LOGS-4f1e-NEVER-LOGGED"
APP_SERVER_TOKEN = "ws-tok-LOGS-9a0c-NEVER-LOGGED"
ENV_SECRET = "env-secret-LOGS-33d1-NEVER-LOGGED"
TURN_TEXT = "turn-text-LOGS-7b2e-NEVER-LOGGED"
REPLY_TEXT = "agent-reply-LOGS-c4a9-NEVER-LOGGED"
SECRETS = (TOKEN, APP_SERVER_TOKEN, ENV_SECRET, TURN_TEXT, REPLY_TEXT)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REPLICA = "logs-r1"

SCRIPT = {
    "version": 1,
    "methods": {
        # The crash writes a secret on stderr: the exit event carries it, no log line does.
        "test/crash": {"steps": [{"stderr": f"dying with {ENV_SECRET}\n"}, {"exit": 3}]},
        # Held until the client answers the server request; then answered, then said.
        "test/held": {
            "steps": [
                {"request": {"method": "item/tool/requestUserInput", "wait": True}},
                {"respond": {"result": {}}},
                {"notify": {"method": "test/replied"}},
            ]
        },
    },
    "turns": [{"repeat": True, "steps": [{"agentMessage": REPLY_TEXT}]}],
}


@dataclass
class Served:
    """A running `rest-bridge serve`: its URL and every line it has written so far."""

    process: subprocess.Popen[bytes]
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    url: str = ""
    changed: threading.Condition = field(default_factory=threading.Condition)
    readers: list[threading.Thread] = field(default_factory=list)
    format: str = "text"

    def read(self, stream: Any, lines: list[str]) -> None:
        for raw in stream:
            with self.changed:
                lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, lines: list[str], found: Callable[[list[str]], bool]) -> None:
        """Until ``found(lines)`` holds; fails if the process ends (and its streams are
        read to their end) without it."""
        with self.changed:
            self.changed.wait_for(lambda: found(lines) or self.process.poll() is not None, WAIT)
        if not found(lines):
            for reader in self.readers:
                reader.join(WAIT)
        assert found(lines), f"not seen in:\n{chr(10).join(lines[-40:])}"

    def wait_for_log(self, pattern: str, count: int = 1) -> None:
        self.wait_for(self.stderr, lambda ls: sum(bool(re.search(pattern, x)) for x in ls) >= count)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        self.process.wait(WAIT)
        for reader in self.readers:
            reader.join(WAIT)

    @property
    def lines(self) -> list[str]:
        return self.stdout + self.stderr


def start(
    tmp: Path, *args: str, env: dict[str, str] | None = None, script: dict[str, Any] = SCRIPT
) -> Served:
    script_path = tmp / "script.json"
    script_path.write_text(json.dumps(script))
    environment = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    environment.update(env or {})
    process = subprocess.Popen(
        [
            *(REST_BRIDGE, "serve", "--port", "0"),
            *("--app-server", f"{FAKE_CODEX} app-server --script {script_path}"),
            *args,
        ],
        env=environment,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    served = Served(process)
    for stream, lines in ((process.stdout, served.stdout), (process.stderr, served.stderr)):
        reader = threading.Thread(target=served.read, args=(stream, lines), daemon=True)
        reader.start()
        served.readers.append(reader)
    served.wait_for(served.stdout, lambda ls: any(" listening on " in x for x in ls))
    line = next(x for x in served.stdout if " listening on " in x)
    found = re.search(r"listening on (http://[0-9.]+:\d+)", line)
    assert found is not None, line
    served.url = found.group(1)
    return served


async def status_of(method: str, url: str) -> int:
    async with aiohttp.ClientSession() as http, http.request(method, url) as response:
        return response.status


async def new_session(base: str) -> str:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{base}/v1/sessions", json={}) as response,
    ):
        return str((await response.json())["sessionId"])


def json_lines(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line]


# -- one run of the whole API, in each format --------------------------------------------


async def read_stream(http: aiohttp.ClientSession, url: str) -> bytes:
    async with http.get(url, headers=AUTH) as response:
        assert response.status == 200
        return await response.read()


async def exercise(served: Served) -> None:
    base = served.url
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/health") as response:
            assert response.status == 200
        # 401: a wrong token; the token in a query and in a body, but not in the header.
        async with http.post(
            f"{base}/v1/sessions", headers={"Authorization": "Bearer wrong-" + TOKEN}
        ) as response:
            assert response.status == 401
        async with http.post(
            f"{base}/v1/sessions?token={TOKEN}&access_token={TOKEN}",
            data=json.dumps({"token": TOKEN}),
        ) as response:
            assert response.status == 401
        async with http.post(f"{base}/v1/sessions", headers=AUTH, json={}) as response:
            assert response.status == 201
            session = (await response.json())["sessionId"]
        async with http.post(f"{base}/v1/sessions", headers=AUTH, json={}) as response:
            assert response.status == 201
            survivor = (await response.json())["sessionId"]
        calls = f"{base}/v1/sessions/{session}/call"
        # 400: a body that is not JSON, with the token in it and in the query.
        async with http.post(
            f"{calls}/thread/start?token={TOKEN}", headers=AUTH, data=f'{{"params": "{TOKEN}'
        ) as response:
            assert response.status == 400
        async with http.post(
            f"{calls}/thread/start", headers=AUTH, json={"params": {}}
        ) as response:
            assert response.status == 200
            thread = (await response.json())["result"]["thread"]["id"]
        stream = asyncio.create_task(
            read_stream(http, f"{base}/v1/sessions/{session}/events/stream")
        )
        turn = {"threadId": thread, "input": [{"type": "text", "text": TURN_TEXT}]}
        async with http.post(f"{calls}/turn/start", headers=AUTH, json={"params": turn}) as r:
            assert r.status == 200
        # A reader that goes away with its stream open.
        async with http.get(
            f"{base}/v1/sessions/{survivor}/events/stream", headers=AUTH
        ) as response:
            assert response.status == 200
            await response.content.readany()
        # 5xx: the app-server crashes under a call; the stream ends with its exit event.
        async with http.post(f"{calls}/test/crash", headers=AUTH, json={"params": {}}) as response:
            assert response.status == 502
            assert (await response.json())["error"] == "app_server_exited"
        events = await asyncio.wait_for(stream, WAIT)
        assert REPLY_TEXT.encode() in events
        assert b"event: exit" in events
        async with http.post(
            f"{base}/v1/text-turn", headers=AUTH, json={"text": TURN_TEXT}
        ) as response:
            assert response.status == 200
        async with http.get(f"{base}/v1/sessions/x%0Ay/events", headers=AUTH) as response:
            assert response.status == 404
        # A start that fails for the caller's options: its WARNING line repeats no value
        # of the body (the working directory holds the token here).
        cwd = {"options": {"cwd": f"/nonexistent/{TOKEN}"}}
        async with http.post(f"{base}/v1/call/model/list", headers=AUTH, json=cwd) as response:
            assert response.status == 502
    # A request aiohttp's parser refuses (a header line without a colon), carrying the
    # token: its own 400, before any of the bridge's code runs.
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(
            f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"no colon {TOKEN}\r\n\r\n".encode()
        )
        assert sock.recv(65536).split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")


def run_through_the_api(tmp: Path, log_format: str) -> Served:
    """A bridge run in ``log_format`` through the whole API, stopped."""
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    app_server_token_file = tmp / "app-server-token"
    app_server_token_file.write_text(APP_SERVER_TOKEN + "\n")
    served = start(
        tmp,
        "--log-format",
        log_format,
        env={
            "REST_ADAPTER_TOKEN_FILE": str(token_file),
            "REST_ADAPTER_APP_SERVER_TOKEN_FILE": str(app_server_token_file),
            "REST_ADAPTER_REPLICA_ID": REPLICA,
            # What an app-server needs from the bridge's environment, and inherits.
            "OPENAI_API_KEY": ENV_SECRET,
        },
    )
    served.format = log_format
    try:
        asyncio.run(exercise(served))
    finally:
        served.stop()
    assert served.process.returncode == 0
    return served


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return run_through_the_api(tmp_path_factory.mktemp("logs-text"), "text")


@pytest.fixture(scope="module")
def json_run(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return run_through_the_api(tmp_path_factory.mktemp("logs-json"), "json")


@pytest.fixture(params=["text", "json"])
def run(request: pytest.FixtureRequest) -> Served:
    """The run in each format."""
    served: Served = request.getfixturevalue(f"{request.param}_run")
    return served


def access_lines(served: Served) -> list[dict[str, Any]]:
    """The access lines as their fields, whatever the format."""
    if served.format == "json":
        return [x for x in json_lines(served.stderr) if x["logger"] == "bridge.access"]
    found = []
    shape = re.compile(
        r"INFO bridge\.access (?P<method>\S+) (?P<route>\S+) (?P<status>\d+) "
        r"(?P<durationMs>[\d.]+)ms (?P<bytes>\d+)B(?P<rest>.*)"
    )
    for line in served.stderr:
        match = shape.search(line)
        if match:
            fields: dict[str, Any] = match.groupdict()
            fields["status"] = int(fields["status"])
            rest = dict(pair.split("=", 1) for pair in fields.pop("rest").split())
            names = {"session": "sessionId", "replica": "replicaId", "error": "errorKind"}
            fields.update({names[k]: v for k, v in rest.items()})
            found.append(fields)
    return found


def test_no_secret_reaches_a_log_line(run: Served):
    assert run.stderr, "the run wrote no log line"
    # The run's lines include a start failure, a crash's WARNING and the stopping line.
    for said in ("options.cwd names", "(not stopped by the bridge)", "rest-bridge: stopping"):
        assert any(said in line for line in run.stderr), said
    for line in run.lines:
        for secret in SECRETS:
            assert secret not in line, f"{secret} in {line!r}"
        assert "Traceback" not in line


def test_every_line_of_the_json_format_is_one_object_with_the_stable_keys(json_run: Served):
    run = json_run
    for line in run.lines:
        record = json.loads(line)
        assert isinstance(record, dict), line
        assert {"time", "level", "logger", "message"} <= set(record), line
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"]), line
    listening = [x for x in json_lines(run.stdout) if x.get("event") == "listening"]
    assert listening == [listening[0]]
    assert listening[0]["url"] == run.url
    assert " listening on http://" in listening[0]["message"]


def test_the_text_format_keeps_the_banner_hosts_read(text_run: Served):
    run = text_run
    assert run.stdout[0].startswith("rest-bridge ")
    assert run.stdout[0].endswith(f" listening on {run.url}")
    assert any(line.startswith("  app-server: ") for line in run.stdout)


def test_each_request_has_one_access_line_with_its_route_template_and_fields(run: Served):
    lines = access_lines(run)
    by_status: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        by_status.setdefault(line["status"], []).append(line)
        assert line["replicaId"] == REPLICA
        assert float(line["durationMs"]) >= 0
        assert int(line["bytes"]) > 0
    assert {200, 201, 400, 401, 404, 499, 502} <= set(by_status)
    assert [x["route"] for x in by_status[401]] == ["/v1/sessions", "/v1/sessions"]
    assert all(x["errorKind"] == "unauthorized" for x in by_status[401])
    routes = {x["route"] for x in lines}
    assert "/v1/sessions/{sessionId}/call/{method}" in routes
    assert not any("thread/start" in r or "?" in r for r in routes), routes
    crash = next(x for x in by_status[502])
    assert crash["errorKind"] == "app_server_exited"
    assert crash["sessionId"].startswith(REPLICA)
    # The stream that ended with its exit event: one line, when it ended, status 200.
    streams = [x for x in lines if x["route"].endswith("/events/stream")]
    assert sorted(x["status"] for x in streams) == [200, 499]
    # A session id that is not one is not repeated.
    assert any(x["status"] == 404 and x.get("sessionId") == "?" for x in lines)
    # aiohttp's parser refused one request before any route: no template, no session.
    refused = [x for x in by_status[400] if x["route"] == "-"]
    assert len(refused) == 1
    assert "sessionId" not in refused[0]
    assert "errorKind" not in refused[0]


def line_time(served: Served, line: str) -> str:
    """A log line's time, as text that sorts as the times do (both formats)."""
    if served.format == "json":
        return str(json.loads(line)["time"])
    return line[: len("2026-11-27 14:50:05,532")]


def test_the_log_is_in_the_order_of_its_times(run: Served):
    """Access lines (written in batches), session and exit lines, warnings, the refused
    request's line: each is written after every line with an earlier time."""
    times = [line_time(run, line) for line in run.stderr]
    kinds = {"bridge.access", "bridge.sessions", "aiohttp.server"}
    assert {k for k in kinds if any(k in line for line in run.stderr)} == kinds
    backwards = [
        (before, after)
        for before, after in zip(run.stderr, run.stderr[1:], strict=False)
        if line_time(run, after) < line_time(run, before)
    ]
    assert not backwards, backwards[:3]
    assert times == sorted(times)


def session_events(served: Served) -> list[str]:
    return [line for line in served.stderr if "bridge.sessions" in line]


def test_session_starts_and_ends_and_app_server_exits_are_logged(run: Served):
    said = "\n".join(session_events(run))
    assert len(re.findall(r"session \S+ started \(process\)", said)) == 2
    assert re.search(
        r"app-server of session \S+ ended: the app-server process exited "
        r"with code 3 \(not stopped by the bridge\)",
        said,
    )
    assert re.search(r"session \S+ ended: app_server_exit", said)
    assert re.search(r"session \S+ ended: shutdown", said)
    if run.format == "json":
        ended = [x for x in json_lines(run.stderr) if x.get("event") == "session_ended"]
        assert sorted(x["reason"] for x in ended) == ["app_server_exit", "shutdown"]
        assert all(x["replicaId"] == REPLICA for x in ended)
        exited = [x for x in json_lines(run.stderr) if x.get("event") == "app_server_exited"]
        crashed = [x for x in exited if x["exitCode"] == 3]
        assert len(crashed) == 1
        assert crashed[0]["stoppedByBridge"] is False


def test_a_crash_is_a_warning_and_a_stop_the_bridge_asked_for_stays_info(run: Served):
    exits = [line for line in run.stderr if "app-server of session" in line]
    if run.format == "json":
        levels = {
            json.loads(x)["message"].endswith("bridge)"): json.loads(x)["level"] for x in exits
        }
    else:
        levels = {x.endswith("bridge)"): x.split()[2] for x in exits}
    # The crash (exit 3, not asked for), and the sessions the bridge stopped at shutdown.
    assert levels == {True: "WARNING", False: "INFO"}, exits


# -- levels, reasons, noise ----------------------------------------------------------------


def test_warning_level_still_shows_every_app_server_crash(tmp_path: Path):
    served = start(tmp_path, "--log-level", "warning")

    async def drive() -> str:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{served.url}/v1/sessions", json={}) as response:
                session = str((await response.json())["sessionId"])
            call = f"{served.url}/v1/sessions/{session}/call/test/crash"
            async with http.post(call, json={"params": {}}) as response:
                assert response.status == 502
            return session

    try:
        session = asyncio.run(drive())
        served.wait_for_log(
            rf"WARNING bridge\.sessions app-server of session {session} ended: the app-server "
            r"process exited with code 3 \(not stopped by the bridge\)$"
        )
    finally:
        served.stop()
    assert not any(" INFO " in line for line in served.stderr), served.stderr


def test_warning_level_writes_no_access_or_session_line(tmp_path: Path):
    served = start(tmp_path, "--log-level", "warning")

    async def drive() -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{served.url}/v1/sessions", json={}) as response:
                assert response.status == 201
            async with http.get(f"{served.url}/nowhere") as response:
                assert response.status == 404

    try:
        asyncio.run(drive())
    finally:
        served.stop()
    assert served.stderr == []
    assert any(" listening on " in line for line in served.stdout)


def test_the_command_line_level_wins_over_the_variable(tmp_path: Path):
    served = start(tmp_path, "--log-level", "info", env={"REST_ADAPTER_LOG_LEVEL": "error"})

    try:
        assert asyncio.run(status_of("GET", f"{served.url}/health")) == 200
        served.wait_for_log(r"bridge\.access GET /health 200 ")
    finally:
        served.stop()


def test_a_refusal_sent_before_100_continue_has_the_line_of_any_401(tmp_path: Path):
    """aiohttp runs a route's Expect handler before any middleware: its 401 is logged."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    served = start(
        tmp_path, "--log-format", "json", env={"REST_ADAPTER_TOKEN_FILE": str(token_file)}
    )
    try:
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
            sock.sendall(
                b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 2\r\nExpect: 100-continue\r\n\r\n"
            )
            assert sock.recv(65536).startswith(b"HTTP/1.1 401 ")
        served.wait_for_log(r'"logger":"bridge\.access"')
    finally:
        served.stop()
    lines = [x for x in json_lines(served.stderr) if x["logger"] == "bridge.access"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert {k: line[k] for k in ("method", "route", "status", "errorKind")} == {
        "method": "POST",
        "route": "/v1/sessions",
        "status": 401,
        "errorKind": "unauthorized",
    }
    assert line["bytes"] > 0
    assert "sessionId" not in line


def test_a_bad_log_variable_stops_serve_naming_it(tmp_path: Path):
    done = subprocess.run(
        [REST_BRIDGE, "serve", "--port", "0"],
        env={**os.environ, "REST_ADAPTER_LOG_FORMAT": "xml"},
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode == 2
    assert "REST_ADAPTER_LOG_FORMAT='xml' is not a valid choice (text, json)" in done.stderr


def test_an_idle_session_ends_with_its_reason(tmp_path: Path):
    served = start(tmp_path, env={"REST_ADAPTER_SESSION_IDLE_TIMEOUT_MS": "200"})

    try:
        session = asyncio.run(new_session(served.url))
        served.wait_for_log(rf"session {session} ended: idle_timeout")
    finally:
        served.stop()


def test_a_sighup_stops_serve_as_sigterm_does(tmp_path: Path):
    """A closed terminal sends SIGHUP: serve stops its sessions, writes the access lines
    it holds, and exits 0, instead of dying by the signal and leaving its app-servers."""
    served = start(tmp_path)
    try:
        session = asyncio.run(new_session(served.url))
    finally:
        served.stop(signal.SIGHUP)
    assert served.process.returncode == 0, served.lines[-20:]
    served.wait_for_log(rf"session {session} ended: shutdown")
    served.wait_for_log(r"app-server of session .* ended")
    assert any("POST /v1/sessions 201" in line for line in served.stderr), served.stderr
    assert any("rest-bridge: stopping" in line for line in served.lines), served.lines


def test_a_deleted_session_ends_with_its_reason(tmp_path: Path):
    served = start(tmp_path)

    async def drive() -> str:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{served.url}/v1/sessions", json={}) as response:
                session = str((await response.json())["sessionId"])
            async with http.delete(f"{served.url}/v1/sessions/{session}") as response:
                assert response.status == 200
            return session

    try:
        session = asyncio.run(drive())
        served.wait_for_log(rf"session {session} ended: deleted")
        served.wait_for_log(rf"app-server of session {session} ended: .* code 0$")
    finally:
        served.stop()


def test_a_session_a_drain_outlives_ends_with_the_drain(tmp_path: Path):
    served = start(
        tmp_path,
        env={"REST_ADAPTER_REPLICA_ID": REPLICA, "REST_ADAPTER_DRAIN_TIMEOUT_MS": "100"},
    )

    try:
        session = asyncio.run(new_session(served.url))
        served.process.send_signal(signal.SIGUSR1)
        served.wait_for_log(rf"session {session} ended: drain")
    finally:
        served.stop()


async def post_many(url: str, count: int, body: Any) -> list[tuple[int, dict[str, Any]]]:
    async with aiohttp.ClientSession() as http:

        async def one() -> tuple[int, dict[str, Any]]:
            async with http.post(url, json=body) as response:
                return response.status, await response.json()

        return list(await asyncio.gather(*(one() for _ in range(count))))


def test_start_failures_are_one_line_a_kind_an_interval_with_the_count_held_back(
    tmp_path: Path,
):
    """A broken command: callers cannot flood the log with one ERROR line per request."""
    served = start(tmp_path, "--app-server", "/nonexistent/codex app-server")
    try:
        answers = asyncio.run(post_many(f"{served.url}/v1/call/x", 200, {}))
    finally:
        served.stop()
    assert {status for status, _ in answers} == {502}
    said = [line for line in served.stderr if "start failure" in line or "could not start" in line]
    assert len(said) == 2, said
    assert (
        " ERROR bridge could not start the app-server `/nonexistent/codex app-server`: "
        in (said[0])
    )
    # The rest, held back, are counted when the bridge stops: none goes unsaid.
    assert said[1].endswith(
        "199 more app-server start failures like the last (spawn) since the last such line"
    )


def test_a_command_that_is_no_app_server_cannot_flood_the_log_either(tmp_path: Path):
    """It starts, writes text, is killed for breaking the protocol: each of its lines
    (the kill, the exit, the start failure) is throttled too."""
    served = start(tmp_path, "--app-server", "/bin/sh -c 'echo hello; exec cat'")
    try:
        answers = asyncio.run(post_many(f"{served.url}/v1/call/x", 200, {}))
    finally:
        served.stop()
    # (429: at most MAX_SESSIONS starts at once.)
    assert 502 in {status for status, _ in answers} <= {429, 502}
    said = [line for line in served.stderr if "bridge.access" not in line]
    assert len(said) <= 10, said  # a few lines a kind, not one a request
    for first in ("stopping app-server pid", "(killed by the bridge)", "ended during start-up"):
        assert any(first in line for line in said), (first, said)
    assert any("more lines like the last (protocol_broken) since" in line for line in said)


INITIALIZE_FAILS = {
    "version": 1,
    "initialize": {"error": {"code": -32603, "message": f"boom /secret/path {ENV_SECRET[:3]}"}},
}


def test_a_failing_initialize_is_an_error_line_and_the_client_hears_no_path(tmp_path: Path):
    served = start(tmp_path, "--log-format", "json", script=INITIALIZE_FAILS)
    try:
        answers = asyncio.run(post_many(f"{served.url}/v1/sessions", 3, {}))
    finally:
        served.stop()
    for status, body in answers:
        assert status == 502
        assert body == {
            "error": "app_server_error",
            "message": "The app-server answered `initialize` with an error; check the bridge's "
            "app-server command (`rest-bridge serve --app-server`). The bridge's log has its "
            "message.",
            "code": -32603,
        }
    failed = [x for x in json_lines(served.stderr) if x.get("event") == "app_server_start_failed"]
    assert [x["level"] for x in failed] == ["ERROR", "ERROR"], failed
    assert failed[0]["failure"] == "initialize"
    assert "refused `initialize`: boom /secret/path" in failed[0]["message"]
    assert FAKE_CODEX in failed[0]["message"]  # the operator's line names the command
    assert failed[1]["heldBack"] == 2


def test_an_initialize_the_callers_options_shaped_points_the_caller_at_them(tmp_path: Path):
    """A refusal of a start the request's options shaped may be the caller's doing: the
    client is told to check them first, and the operator's line is a WARNING of a kind of
    its own (a caller's refusals do not hold back the bridge's own ERROR lines)."""
    served = start(tmp_path, "--log-format", "json", script=INITIALIZE_FAILS)
    named = {"options": {"clientInfo": {"name": "caller", "version": "1"}}}
    try:
        answers = asyncio.run(post_many(f"{served.url}/v1/sessions", 2, named))
        answers += asyncio.run(post_many(f"{served.url}/v1/sessions", 1, {}))
    finally:
        served.stop()
    assert [status for status, _ in answers] == [502, 502, 502]
    assert "check the request's options (clientInfo among them), else " in answers[0][1]["message"]
    assert "options" not in answers[2][1]["message"]
    failed = [x for x in json_lines(served.stderr) if x.get("event") == "app_server_start_failed"]
    firsts = {x["failure"]: x["level"] for x in failed if "heldBack" not in x}
    assert firsts == {"initialize_options": "WARNING", "initialize": "ERROR"}, failed


def test_an_app_server_that_never_answers_initialize_is_a_line_naming_the_command(
    tmp_path: Path,
):
    script = {"version": 1, "initialize": {"noReply": True}}
    served = start(tmp_path, env={"REST_ADAPTER_SPAWN_TIMEOUT_MS": "200"}, script=script)
    try:
        answers = asyncio.run(post_many(f"{served.url}/v1/sessions", 1, {}))
    finally:
        served.stop()
    assert answers[0][0] == 504
    late = [line for line in served.stderr if "did not complete before its deadline" in line]
    assert len(late) == 1, served.stderr
    assert f"no answer to `initialize` from `{FAKE_CODEX} app-server --script " in late[0]


def test_drain_lines_are_log_lines_with_the_sessions_left(tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    served = start(
        tmp_path,
        "--log-format",
        "json",
        env={
            "REST_ADAPTER_REPLICA_ID": REPLICA,
            "REST_ADAPTER_DRAIN_TIMEOUT_MS": "100",
            "REST_ADAPTER_TOKEN_FILE": str(token_file),
        },
    )

    async def create() -> None:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{served.url}/v1/sessions", headers=AUTH, json={}) as response,
        ):
            assert response.status == 201

    try:
        asyncio.run(create())
        served.process.send_signal(signal.SIGUSR1)
        served.process.wait(WAIT)  # it exits by itself at the drain's deadline
    finally:
        served.stop()
    said_on_stdout = [json.loads(x)["message"] for x in served.stdout]
    assert not [
        x for x in said_on_stdout if x.startswith(("rest-bridge: drain", "rest-bridge: stop"))
    ]
    said = {x["event"]: x for x in json_lines(served.stderr) if "event" in x}
    started, deadline = said["drain_started"], said["drain_deadline"]
    assert (started["level"], started["sessions"], started["held"]) == ("INFO", 1, 1)
    assert started["replicaId"] == REPLICA
    assert "sessions left: 1" in started["message"]
    assert (deadline["level"], deadline["sessions"]) == ("WARNING", 1)
    assert said["stopping"]["logger"] == "bridge"
    assert not [line for line in served.lines for secret in SECRETS if secret in line]


def abandon_calls(served: Served, count: int) -> None:
    """``count`` calls held by the app-server, their clients gone; then the app-server
    answers each (a reply nobody waits for) and says so with a notification."""
    base = served.url

    async def drive() -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base}/v1/sessions", json={}) as response:
                session = (await response.json())["sessionId"]
            events = f"{base}/v1/sessions/{session}/events"

            async def wait_for(kind: str, method: str | None) -> list[dict[str, Any]]:
                seen: list[dict[str, Any]] = []
                after = 0
                while len(seen) < count:
                    async with http.get(events, params={"after": after, "waitMs": 5000}) as r:
                        if r.status == 204:
                            continue
                        event = await r.json()
                    after = event["seq"]
                    if event["kind"] == kind and method in (None, event["method"]):
                        seen.append(event)
                return seen

            async with aiohttp.ClientSession() as callers:
                calls = [
                    asyncio.create_task(
                        callers.post(
                            f"{base}/v1/sessions/{session}/call/test/held", json={"params": {}}
                        )
                    )
                    for _ in range(count)
                ]
                requests = await wait_for("request", None)
            # The callers' connections are closed: their handlers are cancelled.
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            for request in requests:
                key = request["requestKey"]
                async with http.post(
                    f"{base}/v1/sessions/{session}/requests/{key}/result", json={"result": {}}
                ) as response:
                    assert response.status == 200
            await wait_for("notification", "test/replied")

    asyncio.run(drive())


def test_late_replies_to_abandoned_calls_write_no_line_at_info(tmp_path: Path):
    served = start(tmp_path)
    try:
        abandon_calls(served, 20)
    finally:
        served.stop()
    assert not [line for line in served.stderr if "unknown or finished request id" in line]
    gone = [line for line in served.stderr if "/call/{method} 499 " in line]
    assert len(gone) == 20


def test_late_replies_are_still_seen_at_debug(tmp_path: Path):
    served = start(tmp_path, "--log-level", "debug")
    try:
        abandon_calls(served, 5)
    finally:
        served.stop()
    late = [line for line in served.stderr if "unknown or finished request id" in line]
    assert len(late) == 5
    assert all(" DEBUG " in line for line in late)


def test_the_cluster_passes_the_log_options_to_its_replicas(tmp_path: Path):
    """In json, the launcher's log (stderr, as serve's) is one JSON object a line: the
    replicas' lines as they wrote them (with their replicaId), the launcher's own with an
    event, nginx's wrapped."""
    process = subprocess.Popen(
        [
            *(REST_BRIDGE, "cluster", "--replicas", "1", "--port", "0"),
            *("--dir", str(tmp_path / "front"), "--nginx", nginx_binary()),
            *("--app-server", f"{FAKE_CODEX} app-server", "--log-format", "json"),
        ],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")},
            "REST_ADAPTER_TOKEN": TOKEN,
        },
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    seen: list[str] = []
    try:
        for line in process.stderr:  # the launcher's and its replicas' own words
            seen.append(line)
            if '"event": "ready"' in line:
                break
    finally:
        process.send_signal(signal.SIGINT)
        out, rest = process.communicate(timeout=WAIT)
    assert process.returncode == 0, [*seen, rest]
    assert out == ""
    lines = [json.loads(line) for line in [*seen, *rest.splitlines()] if line.strip()]
    assert all(
        isinstance(x, dict) and {"time", "level", "logger", "message"} <= set(x) for x in lines
    )
    banner = [x for x in lines if x.get("event") == "listening"]
    assert len(banner) == 1, lines
    assert banner[0]["url"].startswith("http://127.0.0.1:")
    assert banner[0]["replicaId"] == "replica-0"
    own = [x for x in lines if x["logger"] == "bridge.cluster"]
    events = [x["event"] for x in own]
    assert {"replica_started", "front_started", "ready", "stopping", "stopped"} <= set(events)
    # Every line a replica wrote names it, those that did not carry the field included.
    replicas = [x for x in lines if x["logger"] not in ("bridge.cluster", "nginx")]
    assert replicas
    assert all(x["replicaId"] == "replica-0" for x in replicas)
    assert not [line for line in [*seen, rest] for secret in SECRETS if secret in line]


def health_requests(metrics: str) -> float:
    """The GET /health requests a replica's metrics count."""
    found = re.findall(
        r'^http_server_request_duration_seconds_count\{[^}]*http_route="/health"[^}]*\} (\S+)$',
        metrics,
        re.MULTILINE,
    )
    return sum(float(x) for x in found)


def test_with_an_ops_listener_the_cluster_probes_livez_not_the_api(tmp_path: Path):
    """The launcher's probe of each replica (here every 0.1 s) goes to the operations
    listener's /livez: no access line, not a request of the HTTP metrics."""
    script = tmp_path / "slow.json"
    slow = {"steps": [{"sleep": 1500}], "result": {"slept": True}}
    script.write_text(json.dumps({"version": 1, "methods": {"test/slow": slow}}))
    process = subprocess.Popen(
        [
            *(REST_BRIDGE, "cluster", "--replicas", "1", "--port", "0", "--ops-port", "0"),
            *("--dir", str(tmp_path / "front"), "--nginx", nginx_binary()),
            *("--app-server", f"{FAKE_CODEX} app-server --script {script}"),
            *("--log-format", "json", "--probe-interval-ms", "100"),
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    said: dict[str, dict[str, Any]] = {}
    try:
        for line in process.stderr:
            record = json.loads(line)
            said.setdefault(record.get("event", ""), record)
            if record.get("event") == "ready":
                break
        front, ops = said["front_started"]["url"], said["replica_started"]["ops"]

        async def drive() -> tuple[float, float]:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{ops}/metrics") as response:
                    before = health_requests(await response.text())
                # A call that lasts 1.5 s: about 15 probes meanwhile.
                async with http.post(f"{front}/v1/call/test/slow", json={"params": {}}) as r:
                    assert r.status == 200, await r.text()
                async with http.get(f"{ops}/metrics") as response:
                    return before, health_requests(await response.text())

        before, after = asyncio.run(drive())
    finally:
        process.send_signal(signal.SIGINT)
        _, rest = process.communicate(timeout=WAIT)
    assert process.returncode == 0, rest
    assert after == before, (before, after)
    lines = [json.loads(x) for x in rest.splitlines() if x.strip()]
    routes = [x["route"] for x in lines if x["logger"] == "bridge.access"]
    assert "/v1/call/{method}" in routes
