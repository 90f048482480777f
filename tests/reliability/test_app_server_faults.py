"""Faults of the app-server, each scripted in fake-codex and driven through the bridge.

Every test injects one fault beside a healthy *witness* session on the same bridge and
checks four things: the caller gets the contract's error kind; a session that existed
gets its ``exit`` event, its log complete and in order; the witness is still served;
and once everything is deleted, no process, zombie, descriptor or task is left over.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
import pytest
from processes import resident_kib

from bridge.app import trusted_bridge_app
from bridge.limits import RestLimits
from scenarios.sse import SseReader

pytestmark = pytest.mark.asyncio

THEME = "Faults from the app-server"


@dataclass
class Bench:
    """A trusted bridge on fake-codex, a witness session, and the baseline before both."""

    http: aiohttp.ClientSession
    base: str
    row: Any
    resources: Any
    baseline: Any
    witness: str = ""

    async def request(
        self, method: str, path: str, body: Any = None
    ) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
        async with self.http.request(method, self.base + path, json=body) as response:
            # orjson: it reads as deep as the bridge writes (the json module stops short).
            payload = await response.json(loads=orjson.loads) if response.status != 204 else None
            return response.status, payload, response.headers

    async def create(self, script: str | None = None, **options: Any) -> tuple[int, Any]:
        if script is not None:
            options.setdefault("env", {})["FAKE_CODEX_SCRIPT"] = script
        status, body, _ = await self.request(
            "POST", "/v1/sessions", {"options": options} if options else {}
        )
        return status, body

    async def session(self, script: str | None = None) -> str:
        status, body = await self.create(script)
        assert status == 201, body
        return str(body["sessionId"])

    async def call(self, session_id: str, method: str, params: Any = None, **extra: Any) -> Any:
        body = {"params": {} if params is None else params, **extra}
        return await self.request("POST", f"/v1/sessions/{session_id}/call/{method}", body)

    async def text_turn(self, script: str, **extra: Any) -> tuple[int, Any]:
        """POST /v1/text-turn with fake-codex following ``script``; (status, body)."""
        body = {"text": "hi", "options": {"env": {"FAKE_CODEX_SCRIPT": script}}, **extra}
        status, answer, _ = await self.request("POST", "/v1/text-turn", body)
        return status, answer

    async def start_turn(self, session_id: str) -> str:
        status, started, _ = await self.call(session_id, "thread/start")
        assert status == 200, started
        thread_id = started["result"]["thread"]["id"]
        turn = {"threadId": thread_id, "input": [{"type": "text", "text": "hi"}]}
        status, body, _ = await self.call(session_id, "turn/start", turn)
        assert status == 200, body
        return str(thread_id)

    async def log(self, session_id: str, until: str = "exit") -> list[dict[str, Any]]:
        """The session's events from seq 1 through the first of kind (or method) ``until``.

        Asserts that nothing was lost: seqs from 1, none skipped, no ``gap``.
        """
        events: list[dict[str, Any]] = []
        for _ in range(100_000):
            after = events[-1]["seq"] if events else 0
            path = f"/v1/sessions/{session_id}/events?after={after}&waitMs=10000"
            status, event, _ = await self.request("GET", path)
            assert status == 200, (status, event, events[-3:])
            events.append(event)
            if until in (event["kind"], event["method"]):
                break
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        assert "gap" not in [e["kind"] for e in events]
        self.row.nothing_lost = True
        return events

    async def delete(self, session_id: str) -> dict[str, Any]:
        """DELETE the session while a stream reads its log; the stream's ``exit`` event.

        Once deleted the session answers nothing new, so its log is read by a stream
        opened before the delete; the log is checked whole (seqs from 1, no gap).
        """
        url = f"{self.base}/v1/sessions/{session_id}/events/stream?after=0"
        async with self.http.get(url) as response:
            assert response.status == 200
            reader = SseReader(response)
            status, body, _ = await self.request("DELETE", f"/v1/sessions/{session_id}")
            assert status == 200, body
            frames = await reader.rest(timeout=60)
        events = [frame.json() for frame in frames]
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        assert "gap" not in [e["kind"] for e in events]
        assert events[-1]["kind"] == "exit"
        self.row.nothing_lost = True
        return events[-1]

    async def exit_event(self, session_id: str) -> dict[str, Any]:
        event = (await self.log(session_id))[-1]
        assert event["kind"] == "exit"
        assert set(event["params"]) >= {"exitCode", "signal", "stderrTail"}
        return event

    async def survived(self) -> None:
        """The witness still answers, and health is fine."""
        status, body, _ = await self.call(self.witness, "thread/start")
        assert status == 200, body
        status, body, _ = await self.request("GET", "/health")
        assert status == 200, body
        self.row.survived = True

    async def no_leak(self) -> None:
        """Delete every session; then nothing may remain beyond the baseline."""
        status, listing, _ = await self.request("GET", "/v1/sessions")
        assert status == 200
        for summary in listing["sessions"]:
            status, body, _ = await self.request("DELETE", f"/v1/sessions/{summary['sessionId']}")
            assert status == 200, body
        await self.resources.settled(self.baseline)
        self.row.no_leak = True

    async def finish(self, outcome: str) -> None:
        self.row.outcome = outcome
        await self.survived()
        await self.no_leak()


@pytest.fixture
def bench(serve, http, fake_codex, report, resources):
    """Start a bench: `await bench(**limits)` (limits as RestLimits fields)."""

    async def start(command: list[str] | None = None, **limits: Any) -> Bench:
        limits.setdefault("shutdown_grace_ms", 1000)
        app = trusted_bridge_app(command or fake_codex, RestLimits(**limits))
        base = await serve(app)
        async with http.get(base + "/health") as response:
            assert response.status == 200
        bench = Bench(http, base, report, resources, resources.snapshot())
        if command is None:
            bench.witness = await bench.session()
        return bench

    return start


def session_gone(status: int, body: Any, kind: str = "app_server_exited") -> None:
    assert status == 502, body
    assert body["error"] == kind, body


# -- the process exits ----------------------------------------------------------------


async def test_exit_before_answering_initialize(bench, write_script):
    """Exits before answering `initialize`"""
    bridge = await bench()
    script = write_script(
        {"initialize": {"steps": [{"stderr": "fatal: no config\n"}, {"exit": 1}]}}
    )
    status, body = await bridge.create(script)
    session_gone(status, body)
    assert body["data"] == {"exitCode": 1, "signal": None}
    assert "fatal" not in body["message"]
    options = {"env": {"FAKE_CODEX_SCRIPT": script}}
    status, body, _ = await bridge.request(
        "POST", "/v1/call/model/list", {"params": {}, "options": options}
    )
    session_gone(status, body)
    status, body = await bridge.text_turn(script)
    session_gone(status, body)
    status, listing, _ = await bridge.request("GET", "/v1/sessions")
    assert [s["sessionId"] for s in listing["sessions"]] == [bridge.witness]
    bridge.row.nothing_lost = True  # no session was created, so none can be half-there
    await bridge.finish("502 app_server_exited {exitCode: 1} on create, call and text turn")


@pytest.mark.parametrize(
    ("how", "expected"),
    [({"exit": 3}, {"exitCode": 3, "signal": None}), ({"exit": {"signal": "KILL"}}, None)],
    ids=["code 3", "SIGKILL"],
)
async def test_exit_mid_call(bench, write_script, how, expected):
    """Exits in the middle of a call"""
    bridge = await bench()
    script = write_script({"methods": {"x/crash": {"steps": [{"stderr": "boom\n"}, how]}}})
    session_id = await bridge.session(script)
    status, body, _ = await bridge.call(session_id, "x/crash")
    session_gone(status, body)
    expected = expected or {"exitCode": None, "signal": "SIGKILL"}
    assert body["data"] == expected
    exit_event = await bridge.exit_event(session_id)
    assert {k: exit_event["params"][k] for k in expected} == expected
    assert "boom" in exit_event["params"]["stderrTail"]
    status, body, _ = await bridge.call(session_id, "thread/start")
    assert (status, body["error"]) == (409, "session_exited")
    status, body, _ = await bridge.request(
        "POST",
        "/v1/call/x/crash",
        {"params": {}, "options": {"env": {"FAKE_CODEX_SCRIPT": script}}},
    )
    session_gone(status, body)
    await bridge.finish(
        f"502 app_server_exited {expected}; exit event; next call 409 session_exited"
    )


async def test_exit_mid_turn(bench, write_script):
    """Exits in the middle of a turn"""
    bridge = await bench()
    script = write_script({"turns": [{"steps": [{"agentMessage": "half an ans"}, {"exit": 0}]}]})
    session_id = await bridge.session(script)
    await bridge.start_turn(session_id)
    events = await bridge.log(session_id)
    methods = [e["method"] for e in events]
    assert "turn/started" in methods
    assert "turn/completed" not in methods
    assert events[-1]["params"]["exitCode"] == 0
    status, body = await bridge.text_turn(script)
    session_gone(status, body)
    await bridge.finish(
        "session: exit event {exitCode: 0} after the partial turn; text turn 502 app_server_exited"
    )


async def test_exit_while_a_server_request_awaits_its_reply(bench, write_script):
    """Exits while a server request awaits its reply"""
    bridge = await bench()
    steps = [{"request": {"method": "item/tool/call", "wait": False}}, {"exit": 4}]
    script = write_script({"turns": [{"steps": steps}]})
    session_id = await bridge.session(script)
    await bridge.start_turn(session_id)
    events = await bridge.log(session_id)
    request = next(e for e in events if e["kind"] == "request")
    assert events[-1]["params"]["exitCode"] == 4
    status, listing, _ = await bridge.request("GET", "/v1/sessions")
    summary = next(s for s in listing["sessions"] if s["sessionId"] == session_id)
    assert summary["pendingRequests"] == []
    assert (summary["state"], summary["exitCode"]) == ("exited", 4)
    path = f"/v1/sessions/{session_id}/requests/{request['requestKey']}/result"
    status, body, _ = await bridge.request("POST", path, {"result": {}})
    assert (status, body["error"]) == (409, "session_exited")
    status, body = await bridge.text_turn(script)
    session_gone(status, body)
    await bridge.finish(
        "pending request dropped; reply 409 session_exited; text turn 502 app_server_exited"
    )


# -- the process breaks the protocol ----------------------------------------------------


@pytest.mark.parametrize(
    ("step", "limits", "reason"),
    [
        ({"raw": "this is not json"}, {}, "not JSON"),
        ({"raw": '{"id": 2, "resu', "newline": False}, {}, "not JSON"),
        ({"bigLine": 300_000}, {"max_line_bytes": 100_000}, "MAX_LINE_BYTES"),
        ({"raw": "[1, 2, 3]"}, {}, "not an object"),
    ],
    ids=[
        "non-JSON line",
        "partial line then EOF",
        "line over MAX_LINE_BYTES",
        "JSON not an object",
    ],
)
async def test_protocol_breaks(bench, write_script, step, limits, reason):
    """Writes a line that breaks the protocol"""
    bridge = await bench(**limits)
    steps = [step] if step.get("newline", True) else [step, {"exit": 0}]
    script = write_script({"methods": {"x/bad": {"steps": steps, "noReply": True}}})
    session_id = await bridge.session(script)
    status, body, _ = await bridge.call(session_id, "x/bad")
    session_gone(status, body, "protocol_error")
    exit_event = await bridge.exit_event(session_id)
    assert reason in exit_event["params"]["protocolError"]
    await bridge.finish(f"502 protocol_error; exit event with protocolError ({reason})")


async def test_response_to_an_unknown_id_is_ignored(bench, write_script):
    """Answers an id the bridge never used"""
    bridge = await bench()
    steps = [{"respondUnknownId": {"id": 987654321, "result": {"stray": True}}}]
    script = write_script({"methods": {"x/stray": {"steps": steps, "result": {"ok": 1}}}})
    session_id = await bridge.session(script)
    for _ in range(3):
        status, body, _ = await bridge.call(session_id, "x/stray")
        assert (status, body) == (200, {"result": {"ok": 1}})
    status, body, _ = await bridge.call(session_id, "thread/start")
    assert status == 200
    bridge.row.nothing_lost = True
    await bridge.finish("ignored (logged); the call and the next ones answer 200")


async def test_duplicate_response_is_ignored(bench, write_script):
    """Answers the same call twice"""
    bridge = await bench()
    steps = [{"respondTwice": {"result": {"n": 1}}}]
    script = write_script({"methods": {"x/twice": {"steps": steps}}})
    session_id = await bridge.session(script)
    status, body, _ = await bridge.call(session_id, "x/twice")
    assert (status, body) == (200, {"result": {"n": 1}})
    # The duplicate must not answer anybody else's call.
    status, body, _ = await bridge.call(session_id, "thread/start")
    assert status == 200
    assert "thread" in body["result"]
    bridge.row.nothing_lost = True
    await bridge.finish("the second response is ignored; the next call gets its own answer")


async def test_stderr_flood_of_50_mb(bench, write_script):
    """Floods stderr with 50 MB"""
    bridge = await bench()
    flood = 50 * 1024 * 1024
    script = write_script(
        {"methods": {"x/noisy": {"steps": [{"stderrFlood": flood}], "result": {}}}}
    )
    session_id = await bridge.session(script)
    rss_before = resident_kib()
    status, body, _ = await bridge.call(session_id, "x/noisy", timeoutMs=120_000)
    assert (status, body) == (200, {"result": {}})
    rss_after = resident_kib()
    exit_event = await bridge.delete(session_id)
    tail = exit_event["params"]["stderrTail"]
    assert 0 < len(tail.encode()) <= 8192
    bridge.row.figures.update(
        {
            "stderrBytes": flood,
            "stderrTailBytes": len(tail.encode()),
            "rssGrowthKiB": rss_after - rss_before,
        }
    )
    await bridge.finish("the call answers 200 while 50 MB pass through; an 8 KiB tail is kept")


# -- the process stops answering -------------------------------------------------------


async def test_stall_in_initialize_is_a_spawn_timeout(bench, write_script):
    """Stalls before answering `initialize`, ignoring SIGTERM"""
    bridge = await bench(spawn_timeout_ms=500)
    script = write_script({"initialize": {"steps": [{"stall": {"ignoreTerm": True}}]}})
    status, body = await bridge.create(script)
    assert (status, body["error"]) == (504, "timeout"), body
    bridge.row.nothing_lost = True
    await bridge.finish("504 timeout at SPAWN_TIMEOUT_MS; the process is killed")


async def test_stall_past_every_deadline(bench, write_script):
    """Stalls mid-call and ignores stdin EOF and SIGTERM"""
    bridge = await bench(shutdown_grace_ms=400)
    script = write_script({"methods": {"x/stall": {"steps": [{"stall": {"ignoreTerm": True}}]}}})
    session_id = await bridge.session(script)
    status, body, _ = await bridge.call(session_id, "x/stall", timeoutMs=300)
    assert (status, body["error"]) == (504, "timeout")
    status, body, _ = await bridge.call(session_id, "thread/start", timeoutMs=300)
    assert (status, body["error"]) == (504, "timeout")
    exit_event = await bridge.delete(session_id)
    assert exit_event["params"]["signal"] == "SIGKILL"
    options = {"env": {"FAKE_CODEX_SCRIPT": script}}
    status, body, _ = await bridge.request(
        "POST", "/v1/call/x/stall", {"params": {}, "options": options, "timeoutMs": 300}
    )
    assert (status, body["error"]) == (504, "timeout")
    turn_script = write_script({"turns": [{"steps": [{"stall": {"ignoreTerm": True}}]}]})
    status, body = await bridge.text_turn(turn_script, timeoutMs=800)
    assert (status, body["error"], body["data"]) == (504, "timeout", {"reason": "deadline"})
    await bridge.finish(
        "504 timeout for calls, sessionless calls and text turns; delete ends it with SIGKILL"
    )


async def test_overloaded_is_503_everywhere(bench, write_script):
    """Answers `-32001` (overloaded)"""
    bridge = await bench()
    overloaded = {"error": {"code": -32001, "message": "Server overloaded; retry later."}}
    script = write_script({"methods": {"x/busy": overloaded, "thread/start": overloaded}})
    session_id = await bridge.session(script)
    options = {"env": {"FAKE_CODEX_SCRIPT": script}}
    cases = [
        ("POST", f"/v1/sessions/{session_id}/call/x/busy", {"params": {}}),
        ("POST", "/v1/call/x/busy", {"params": {}, "options": options}),
        ("POST", "/v1/text-turn", {"text": "hi", "options": options}),
    ]
    for method, path, body in cases:
        status, payload, headers = await bridge.request(method, path, body)
        assert status == 503, payload
        assert headers["Retry-After"] == "1"
        assert payload == {
            "error": "app_server_overloaded",
            "message": "Server overloaded; retry later.",
            "code": -32001,
        }
    busy_init = write_script({"initialize": overloaded})
    status, payload = await bridge.create(busy_init)
    assert (status, payload["error"]) == (503, "app_server_overloaded")
    status, body, _ = await bridge.call(session_id, "model/list")
    assert status == 200, body
    bridge.row.nothing_lost = True
    await bridge.finish(
        "503 app_server_overloaded, code -32001, Retry-After: 1; the session lives on"
    )


# -- the command -----------------------------------------------------------------------


async def test_command_missing_or_not_executable(bench, tmp_path):
    """The app-server command does not exist, or is not executable"""
    not_executable = tmp_path / "codex"
    not_executable.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(not_executable, stat.S_IRUSR | stat.S_IWUSR)
    outcomes = []
    for command in (["/nonexistent/bin/codex", "app-server"], [str(not_executable), "app-server"]):
        bridge = await bench(command=command)
        for path, body in (
            ("/v1/sessions", {}),
            ("/v1/call/model/list", {}),
            ("/v1/text-turn", {"text": "hi"}),
        ):
            status, payload, _ = await bridge.request("POST", path, body)
            assert (status, payload["error"]) == (502, "app_server_spawn_failed"), payload
            assert command[0] not in payload["message"]
            outcomes.append(payload["message"])
        status, compat, _ = await bridge.request("GET", "/v1/compatibility")
        assert status == 200
        assert compat["appServer"]["version"] is None
        assert command[0] not in compat["appServer"]["versionError"]
        status, body, _ = await bridge.request("GET", "/health")
        assert status == 200
        bridge.row.survived = True
        bridge.row.nothing_lost = True
        await bridge.no_leak()
    bridge.row.outcome = (
        "502 app_server_spawn_failed without the path (" + "; ".join(sorted(set(outcomes))) + ")"
    )


async def test_bad_cwd_fails_only_that_spawn(bench, tmp_path):
    """A session asks for a working directory that does not exist"""
    bridge = await bench()
    status, body = await bridge.create(None, cwd=str(tmp_path / "missing"))
    assert (status, body["error"]) == (502, "app_server_spawn_failed"), body
    assert str(tmp_path) not in body["message"]
    bridge.row.nothing_lost = True
    await bridge.finish("502 app_server_spawn_failed; other sessions unaffected")


ECHO_EXPECTED = {
    # The echoed `initialize` looks like a server request. A session records it and
    # waits for the answer that never comes; a sessionless call and a text turn refuse
    # it at once, and the refusal, echoed back, answers `initialize` with an error.
    "/v1/sessions": (504, "timeout"),
    "/v1/call/x": (502, "app_server_error"),
    "/v1/text-turn": (502, "app_server_error"),
}


@pytest.mark.parametrize(
    ("command", "limits", "expected"),
    [
        (["/bin/true"], {}, (502, "app_server_exited")),
        (["/bin/cat"], {"spawn_timeout_ms": 500}, ECHO_EXPECTED),
        (["/bin/sh", "-c", "echo hello; exec cat"], {}, (502, "protocol_error")),
    ],
    ids=["exits at once", "echoes its input", "prints text"],
)
async def test_command_that_is_not_an_app_server(bench, command, limits, expected):
    """The command runs, but is not an app-server"""
    bridge = await bench(command=command, **limits)
    outcomes = []
    for path, body in (
        ("/v1/sessions", {}),
        ("/v1/call/x", {"params": {}}),
        ("/v1/text-turn", {"text": "hi"}),
    ):
        wanted = expected[path] if isinstance(expected, dict) else expected
        got, payload, _ = await bridge.request("POST", path, body)
        assert (got, payload["error"]) == wanted, payload
        outcomes.append(f"{path} {got} {payload['error']}")
    status, body, _ = await bridge.request("GET", "/health")
    assert status == 200, body
    bridge.row.survived = True
    bridge.row.nothing_lost = True
    await bridge.no_leak()
    bridge.row.outcome = "; ".join(outcomes)


# -- turns that never end ----------------------------------------------------------------


async def test_text_turn_without_turn_completed_ends_at_its_deadline(bench, write_script):
    """Never sends `turn/completed` (nor an idle status)"""
    bridge = await bench()
    script = write_script({"turns": [{"noCompletion": True, "steps": [{"agentMessage": "hi"}]}]})
    status, body = await bridge.text_turn(script, timeoutMs=700)
    assert (status, body["error"], body["data"]) == (504, "timeout", {"reason": "deadline"})
    bridge.row.nothing_lost = True
    await bridge.finish("504 timeout, data.reason = deadline")


async def test_text_turn_without_turn_completed_ends_when_the_thread_is_idle(bench, write_script):
    """Never sends `turn/completed`, but reports the thread idle"""
    bridge = await bench()
    idle = {
        "notify": {
            "method": "thread/status/changed",
            "params": {"threadId": "${threadId}", "status": {"type": "idle"}},
        }
    }
    script = write_script(
        {"turns": [{"noCompletion": True, "steps": [{"agentMessage": "hi"}, idle]}]}
    )
    status, body = await bridge.text_turn(script, timeoutMs=60_000)
    assert status == 504, body
    assert (body["error"], body["data"]) == ("timeout", {"reason": "idle_without_completion"})
    bridge.row.nothing_lost = True
    await bridge.finish(
        "504 timeout, data.reason = idle_without_completion (2 s after idle, not 60 s)"
    )


async def test_idle_reported_before_the_turn_start_answer_is_read(bench, write_script):
    """Reports the turn started and the thread idle before the bridge reads the turn's id"""
    bridge = await bench()
    idle = {"threadId": "${threadId}", "status": {"type": "idle"}}
    turn = {"id": "turn-1", "status": "inProgress", "items": [], "error": None}
    script = write_script(
        {
            "methods": {
                # Written before the answer: whatever the timing, the notifications are
                # dispatched before the text turn learns its turn id.
                "turn/start": {
                    "steps": [
                        {"notify": {"method": "turn/started", "params": {"turn": turn}}},
                        {"notify": {"method": "thread/status/changed", "params": idle}},
                    ],
                    "result": {"turn": turn},
                }
            }
        }
    )
    status, body = await bridge.text_turn(script, timeoutMs=60_000)
    assert status == 504, body
    assert body["data"] == {"reason": "idle_without_completion"}
    bridge.row.nothing_lost = True
    await bridge.finish("504 idle_without_completion 2 s after idle (was: the 60 s deadline)")


# -- processes the app-server starts ------------------------------------------------------


async def test_grandchild_dies_with_the_session(bench, write_script):
    """Spawns a grandchild, then the session is deleted, or the app-server exits"""
    bridge = await bench()
    fork = {"steps": [{"spawnChild": {"command": ["sleep", "1000"]}}], "result": {}}
    fork_and_exit = {"steps": [{"spawnChild": {"command": ["sleep", "1000"]}}, {"exit": 0}]}
    script = write_script({"methods": {"x/fork": fork, "x/forkexit": fork_and_exit}})
    deleted = await bridge.session(script)
    status, _, _ = await bridge.call(deleted, "x/fork")
    assert status == 200
    exited = await bridge.session(script)
    status, body, _ = await bridge.call(exited, "x/forkexit")
    session_gone(status, body)
    assert (await bridge.delete(deleted))["kind"] == "exit"
    assert (await bridge.exit_event(exited))["params"]["exitCode"] == 0
    turn_script = write_script(
        {
            "turns": [
                {"steps": [{"spawnChild": {"command": ["sleep", "1000"]}}, {"agentMessage": "ok"}]}
            ]
        }
    )
    status, body = await bridge.text_turn(turn_script)
    assert status == 200, body
    # no_leak compares the processes carrying this test's mark with the baseline:
    # a surviving `sleep 1000` would be one of them.
    await bridge.finish("grandchildren killed with their app-server's process group")


async def test_killed_by_someone_else_is_noticed_at_once(bench):
    """SIGKILL of the app-server by someone else"""
    bridge = await bench()
    bridge.row.theme = "Shutdown"  # the issue lists it there
    before = bridge.resources.snapshot().processes
    session_id = await bridge.session()
    (target,) = bridge.resources.snapshot().processes - before
    async with bridge.http.get(f"{bridge.base}/v1/sessions/{session_id}/events/stream") as stream:
        assert stream.status == 200
        reader = SseReader(stream)
        os.kill(target, signal.SIGKILL)
        frames = await reader.until(lambda f: f.event == "exit", timeout=10)
    assert frames[-1].json()["params"]["signal"] == "SIGKILL"
    status, body, _ = await bridge.call(session_id, "thread/start")
    assert (status, body["error"]) == (409, "session_exited")
    await bridge.log(session_id)
    await bridge.finish("exit event {signal: SIGKILL} on the open stream, with no request needed")


@pytest.mark.parametrize("depth", [300, 1020])
async def test_deeply_nested_notification_is_delivered(bench, write_script, depth):
    """Notifies with JSON nested deeper than orjson writes (254), up to what it reads"""
    bridge = await bench()
    line = '{"method": "x/deep", "params": ' + "[" * depth + '"bottom"' + "]" * depth + "}"
    script = write_script({"methods": {"x/deep": {"steps": [{"raw": line}], "result": {}}}})
    session_id = await bridge.session(script)
    status, body, _ = await bridge.call(session_id, "x/deep")
    assert status == 200, body
    events = await bridge.log(session_id, until="x/deep")
    value, found = events[-1]["params"], 0
    while isinstance(value, list):
        value, found = value[0], found + 1
    assert (found, value) == (depth, "bottom")
    async with bridge.http.get(
        f"{bridge.base}/v1/sessions/{session_id}/events/stream?after={events[-2]['seq']}"
    ) as stream:
        frame = await SseReader(stream).next()
    assert frame is not None
    assert frame.json()["method"] == "x/deep"
    await bridge.finish("the event reaches long-poll and SSE readers intact")


# -- the wire itself -------------------------------------------------------------------

PROBE = [sys.executable, str(Path(__file__).with_name("wire_probe.py"))]


async def probe_bench(bench: Any) -> Bench:
    bridge = await bench(command=PROBE)
    bridge.witness = await bridge.session()
    return bridge


async def raw_json(bridge: Bench, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """A request whose answer is parsed by the standard library: big integers stay exact."""
    async with bridge.http.request(method, bridge.base + path, json=body) as response:
        text = await response.text()
        return response.status, (json.loads(text) if text else None)


@pytest.mark.parametrize("pipe", ["stdout", "stdin"])
async def test_a_pipe_closed_while_alive(bench, pipe):
    """Closes its stdout (or its stdin) but stays alive"""
    bridge = await probe_bench(bench)
    session_id = await bridge.session()
    method = "probe/closeStdout" if pipe == "stdout" else "probe/closeStdin"
    status, body, _ = await bridge.call(session_id, method, timeoutMs=60_000)
    session_gone(status, body, "protocol_error")
    exit_event = await bridge.exit_event(session_id)
    assert f"closed its {pipe}" in exit_event["params"]["protocolError"]
    assert exit_event["params"]["signal"] == "SIGKILL"
    status, body, _ = await bridge.call(session_id, "x/after")
    assert (status, body["error"]) == (409, "session_exited")
    await bridge.finish(
        "the pending call is a 502 protocol_error within a second, not at its timeout; "
        "the process group is killed and the log ends with its exit event"
    )


#: Request ids JSON-RPC allows, as the app-server writes them, and the keys they get.
GOOD_IDS = {
    "1": "1",
    '"1"': '"1"',
    '""': '""',
    '"abc"': "abc",
    '"a/b c"': "a/b c",
    '"\\"q"': '"\\"q"',
    "-7": "-7",
    "123456789012345678901234567890": "123456789012345678901234567890",
}
BIG = 123456789012345678901234567890


async def test_request_ids_each_get_their_own_key(bench):
    """Sends server requests with ids `1`, `"1"`, `""`, `"a/b c"` and one past 64 bits"""
    bridge = await probe_bench(bench)
    session_id = await bridge.session()
    lines = [
        json.dumps({"id": json.loads(text), "method": "item/tool/call", "params": {"n": BIG}})
        for text in GOOD_IDS
    ]
    lines.append(json.dumps({"method": "x/big", "params": {"n": BIG, "m": -BIG}}))
    status, body, _ = await bridge.call(session_id, "probe/send", {"lines": lines})
    assert status == 200, body
    events = await bridge.log(session_id, until="x/big")
    requests = [e for e in events if e["kind"] == "request"]
    assert [e["requestKey"] for e in requests] == list(GOOD_IDS.values())
    # Big integers pass through unchanged, in requests and notifications alike.
    status, notified = await raw_json(
        bridge, "GET", f"/v1/sessions/{session_id}/events?after={events[-2]['seq']}&waitMs=0"
    )
    assert notified["params"] == {"n": BIG, "m": -BIG}
    status, request = await raw_json(
        bridge, "GET", f"/v1/sessions/{session_id}/events?after={requests[-1]['seq'] - 1}"
    )
    assert request["params"] == {"n": BIG}
    for text, key in GOOD_IDS.items():
        path = f"/v1/sessions/{session_id}/requests/{quote(key, safe='')}/result"
        status, body = await raw_json(bridge, "POST", path, {"result": {"echo": key}})
        assert (status, body) == (200, {"status": "sent", "requestKey": key}), text
    # The probe reads its stdin in order: once it has written x/done, every reply is in.
    done = [json.dumps({"method": "x/done"})]
    assert (await bridge.call(session_id, "probe/send", {"lines": done}))[0] == 200
    replies = await bridge.log(session_id, until="x/done")
    raw = [json.loads(e["params"]["raw"]) for e in replies if e["method"] == "probe/reply"]
    # Each reply carries its id back exactly as the app-server sent it (type and value).
    assert [(type(r["id"]), r["id"]) for r in raw] == [
        (type(json.loads(t)), json.loads(t)) for t in GOOD_IDS
    ]
    bridge.row.figures["ids"] = len(GOOD_IDS)
    await bridge.finish(
        "each id its own key, every reply routed with the id as sent; "
        "integers past 64 bits unchanged in params"
    )


@pytest.mark.parametrize("bad_id", ["null", "true", '{"o": 1}', "1.5", "[1]"])
async def test_request_id_json_rpc_does_not_allow(bench, bad_id):
    """Sends a server request whose id JSON-RPC does not allow"""
    bridge = await probe_bench(bench)
    session_id = await bridge.session()
    line = f'{{"id": {bad_id}, "method": "item/tool/call", "params": {{}}}}'
    status, body, _ = await bridge.call(session_id, "probe/send", {"lines": [line]})
    session_gone(status, body, "protocol_error")
    exit_event = await bridge.exit_event(session_id)
    assert "neither a string nor an integer" in exit_event["params"]["protocolError"]
    await bridge.finish("a protocol error, like any broken line: 502, the process is stopped")


async def test_a_request_id_reused_while_pending(bench):
    """Sends a second server request with the id of one still awaiting its reply"""
    bridge = await probe_bench(bench)
    session_id = await bridge.session()
    line = json.dumps({"id": 5, "method": "item/tool/call", "params": {}})
    status, body, _ = await bridge.call(session_id, "probe/send", {"lines": [line, line]})
    session_gone(status, body, "protocol_error")
    exit_event = await bridge.exit_event(session_id)
    assert "reused the id" in exit_event["params"]["protocolError"]
    await bridge.finish("a protocol error: two requests with one id could not both be answered")


async def test_stdin_closed_right_after_answering_initialize(bench):
    """Answers `initialize`, then closes its stdin at once"""
    bridge = await probe_bench(bench)
    status, body, _ = await bridge.request(
        "POST",
        "/v1/sessions",
        {"options": {"env": {"WIRE_PROBE_CLOSE_STDIN_AFTER_INITIALIZE": "1"}}},
    )
    if status == 201:
        # `initialized` was taken before the pipe closed: the session ends on its own.
        exit_event = await bridge.exit_event(body["sessionId"])
        assert "closed its stdin" in exit_event["params"]["protocolError"]
    else:
        # `initialized` could not be sent: never a session, and never "did not start".
        assert (status, body["error"]) == (502, "protocol_error"), body
        assert "after answering `initialize`" in body["message"]
        bridge.row.nothing_lost = True
    await bridge.finish(
        "502 protocol_error at creation, or a session whose exit event names the closed "
        "stdin; the process is stopped either way"
    )
