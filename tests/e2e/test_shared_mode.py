"""Shared mode end to end: one real ``codex app-server --listen``, each session a connection.

The bridge starts the pinned codex itself (``--listen unix://PATH`` appended to the
command), with its ``CODEX_HOME``, working directory and scripted model in the command:
in shared mode those ClientOptions are refused, so they cannot come per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from processes import exited, live_children

from bridge.app import trusted_bridge_app
from bridge.limits import AppServerSettings, RestLimits
from bridge.routes import BACKEND
from fakes.model_provider import ModelProviderServer
from scenarios.sse import SseReader
from tests.e2e.test_real_codex import (
    COMMAND_APPROVAL,
    WAIT,
    call,
    command_items,
    create_session,
    events,
    method_is,
    start_thread,
    start_turn,
    untrusted_thread,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.real_codex]

SHARED = AppServerSettings(mode="shared")


@pytest_asyncio.fixture
async def shared_bridge(
    model: ModelProviderServer,
    codex_home: Path,
    workspace: Path,
    serve: Callable[[web.Application], Any],
    codex_bin: str,
) -> str:
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    return str(await serve(trusted_bridge_app(command, RestLimits(), SHARED)))


def process_groups(pids: set[int]) -> set[int]:
    """The process groups of ``pids``: one per app-server (codex runs helpers in its own)."""
    return {os.getpgid(pid) for pid in pids}


async def shared_state(http, base) -> dict[str, Any]:
    async with http.get(f"{base}/v1/compatibility") as response:
        assert response.status == 200
        body = await response.json()
    assert body["appServer"]["mode"] == "shared"
    return body["appServer"]["shared"]


async def test_sessions_calls_and_text_turns_share_one_codex_process(
    shared_bridge, http, model, workspace
):
    before = live_children()
    assert (await shared_state(http, shared_bridge))["state"] == "idle"
    sessions = [await create_session(http, shared_bridge, None) for _ in range(3)]
    state = await shared_state(http, shared_bridge)
    assert state["state"] == "running"
    assert state["connections"] == 3
    assert process_groups(live_children() - before) == {state["pid"]}
    # Each session is its own connection with its own threads.
    threads = {await start_thread(http, shared_bridge, s, cwd=str(workspace)) for s in sessions}
    assert len(threads) == 3
    # A sessionless call and a text turn are connections too: no process is spawned.
    body = {"params": {}}
    async with http.post(f"{shared_bridge}/v1/call/model/list", json=body) as response:
        payload = await response.json()
        assert response.status == 200, payload
    assert payload["result"]["data"]
    model.model.add({"text": "Shared hello."})
    turn = {"text": "Say hello.", "threadParams": {"cwd": str(workspace)}, "timeoutMs": 30000}
    async with http.post(f"{shared_bridge}/v1/text-turn", json=turn) as response:
        payload = await response.json()
        assert response.status == 200, payload
    assert payload["text"] == "Shared hello."
    assert payload["status"] == "completed"
    assert process_groups(live_children() - before) == {state["pid"]}
    state = await shared_state(http, shared_bridge)
    assert state["connections"] == 3
    assert state["userAgent"].startswith("codex_rest_bridge/0.169.0")


async def events_of(http, base, session_id) -> list[dict[str, Any]]:
    """Every event the session's log holds now (long-polls with `after`, cursor kept)."""
    seen: list[dict[str, Any]] = []
    while True:
        after = seen[-1]["seq"] if seen else 0
        url = f"{base}/v1/sessions/{session_id}/events?after={after}&waitMs=1"
        async with http.get(url) as response:
            if response.status == 204:
                return seen
            seen.append(await response.json())


async def test_a_session_hears_of_its_own_threads_only(shared_bridge, http, workspace):
    """codex 0.169.0 sends every connection a `thread/started` for every new thread; the
    bridge keeps other sessions' thread ids from a session (and its event log)."""
    sessions = [await create_session(http, shared_bridge, None) for _ in range(4)]
    threads = [await start_thread(http, shared_bridge, s, cwd=str(workspace)) for s in sessions]
    # A thread/start on the last session, answered after every other: all are announced.
    for session_id, thread_id in zip(sessions, threads, strict=True):
        started = [
            e["params"]["thread"]["id"]
            for e in await events_of(http, shared_bridge, session_id)
            if e["method"] == "thread/started"
        ]
        assert started == [thread_id]


async def test_command_approval_answered_over_http_in_shared_mode(
    shared_bridge, http, model, workspace
):
    model.model.add({"execCommand": {"cmd": "touch shared.txt"}}, {"text": "Touched it."})
    session_id = await create_session(http, shared_bridge, None)
    async with http.get(f"{shared_bridge}/v1/sessions/{session_id}/events/stream") as stream:
        reader = SseReader(stream)
        thread_params = untrusted_thread(workspace)
        thread_id = await start_thread(http, shared_bridge, session_id, **thread_params)
        turn_id = await start_turn(http, shared_bridge, session_id, thread_id, "Touch the file.")
        before = await reader.until(lambda f: f.event == "request", timeout=WAIT)
        request = before[-1].json()
        assert request["method"] == COMMAND_APPROVAL
        assert request["params"]["turnId"] == turn_id
        key = request["requestKey"]
        url = f"{shared_bridge}/v1/sessions/{session_id}/requests/{key}/result"
        async with http.post(url, json={"result": {"decision": "accept"}}) as answered:
            assert answered.status == 200, await answered.text()
        async with http.post(url, json={"result": {"decision": "accept"}}) as again:
            assert again.status == 409
            assert (await again.json())["error"] == "request_already_answered"
        after = await reader.until(method_is("turn/completed"), timeout=WAIT)
    seen = events(before + after)
    assert seen[-1]["params"]["turn"]["status"] == "completed"
    assert [item["status"] for item in command_items(seen)] == ["completed"]
    assert (workspace / "shared.txt").exists()


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({"env": {"A": "b"}}, ["env"]),
        ({"cwd": "/"}, ["cwd"]),
        ({"configOverrides": ["model=x"]}, ["configOverrides"]),
        (
            {"env": {"A": "b"}, "cwd": "/", "clientInfo": {"name": "n", "version": "1"}},
            ["cwd", "env"],
        ),
    ],
)
async def test_options_that_need_a_process_of_their_own_are_403(
    shared_bridge, http, options, refused
):
    for path, body in (
        ("/v1/sessions", {"options": options}),
        ("/v1/call/model/list", {"params": {}, "options": options}),
        ("/v1/text-turn", {"text": "hi", "options": options}),
    ):
        async with http.post(f"{shared_bridge}{path}", json=body) as response:
            payload = await response.json()
            assert response.status == 403, (path, payload)
        assert payload["error"] == "options_not_allowed"
        assert payload["data"] == {"fields": refused, "mode": "shared"}
    assert (await shared_state(http, shared_bridge))["connections"] == 0


async def test_per_connection_options_still_apply(shared_bridge, http):
    options = {"clientInfo": {"name": "host_app", "version": "7.1"}, "experimentalApi": True}
    async with http.post(f"{shared_bridge}/v1/sessions", json={"options": options}) as response:
        payload = await response.json()
        assert response.status == 201, payload
    assert "host_app; 7.1" in payload["initialize"]["userAgent"]


async def test_delete_closes_that_connection_alone(shared_bridge, http, workspace):
    first = await create_session(http, shared_bridge, None)
    second = await create_session(http, shared_bridge, None)
    pid = (await shared_state(http, shared_bridge))["pid"]
    async with http.get(f"{shared_bridge}/v1/sessions/{first}/events/stream") as stream:
        reader = SseReader(stream)
        async with http.delete(f"{shared_bridge}/v1/sessions/{first}") as response:
            assert response.status == 200
        frames = await reader.until(lambda f: f.event == "exit", timeout=WAIT)
    exit_event = frames[-1].json()
    assert exit_event["params"] == {
        "exitCode": 0,
        "signal": None,
        "stderrTail": "",
        "connection": "closed by the bridge",
    }
    status, body = await call(http, shared_bridge, first, "thread/start", {})
    assert status == 404, body
    assert await start_thread(http, shared_bridge, second, cwd=str(workspace))
    state = await shared_state(http, shared_bridge)
    assert state["pid"] == pid
    assert state["connections"] == 1


async def test_a_killed_codex_ends_every_session_and_is_restarted(shared_bridge, http, workspace):
    sessions = [await create_session(http, shared_bridge, None) for _ in range(2)]
    pid = (await shared_state(http, shared_bridge))["pid"]
    streams = [
        await http.get(f"{shared_bridge}/v1/sessions/{s}/events/stream").__aenter__()
        for s in sessions
    ]
    try:
        os.kill(pid, signal.SIGKILL)
        for stream in streams:
            frames = await SseReader(stream).until(lambda f: f.event == "exit", timeout=WAIT)
            assert frames[-1].json()["params"] == {
                "exitCode": None,
                "signal": "SIGKILL",
                "stderrTail": "",
                "connection": "the shared app-server exited",
            }
    finally:
        for stream in streams:
            stream.release()
    for session_id in sessions:
        status, body = await call(http, shared_bridge, session_id, "thread/start", {})
        assert status == 409, body
        assert body["error"] == "session_exited"
    # New sessions get a new codex once the backoff has passed.
    fresh = await create_session(http, shared_bridge, None)
    assert await start_thread(http, shared_bridge, fresh, cwd=str(workspace))
    state = await shared_state(http, shared_bridge)
    assert state["restarts"] == 1
    assert state["lastExit"]["signal"] == "SIGKILL"
    assert state["state"] == "running"
    assert state["pid"] not in (None, pid)


async def test_whether_connections_resume_each_others_threads(
    shared_bridge, http, model, workspace
):
    """What codex 0.169.0 does (docs/API.md, shared mode): a thread without a turn has no
    rollout, so another connection cannot resume it; once a turn has run, it can, and
    from then on both connections hear the thread's events, whoever starts the turn."""
    owner = await create_session(http, shared_bridge, None)
    other = await create_session(http, shared_bridge, None)
    thread_id = await start_thread(http, shared_bridge, owner, cwd=str(workspace))
    status, body = await call(http, shared_bridge, other, "thread/resume", {"threadId": thread_id})
    assert status == 502, body
    assert body["error"] == "app_server_error"
    assert body["code"] == -32600
    assert body["message"] == f"no rollout found for thread id {thread_id}"
    model.model.add({"text": "First turn."})
    async with http.get(f"{shared_bridge}/v1/sessions/{owner}/events/stream") as stream:
        reader = SseReader(stream)
        await start_turn(http, shared_bridge, owner, thread_id, "Hello.")
        await reader.until(method_is("turn/completed"), timeout=WAIT)
    status, body = await call(http, shared_bridge, other, "thread/resume", {"threadId": thread_id})
    assert status == 200, body
    assert body["result"]["thread"]["id"] == thread_id
    # A turn started by the other connection: who hears it?
    model.model.add({"text": "Second turn."})
    async with http.get(f"{shared_bridge}/v1/sessions/{other}/events/stream") as stream:
        reader = SseReader(stream)
        await start_turn(http, shared_bridge, other, thread_id, "Again.")
        await reader.until(method_is("turn/completed"), timeout=WAIT)
    url = f"{shared_bridge}/v1/sessions/{owner}/events?after=0&waitMs=1"
    seen = []
    while True:
        async with http.get(url) as response:
            if response.status == 204:
                break
            event = await response.json()
        seen.append(event["method"])
        url = f"{shared_bridge}/v1/sessions/{owner}/events?after={event['seq']}&waitMs=1"
    # Both connections are subscribed to the thread now: the owner hears the other's turn.
    assert seen.count("turn/completed") == 2
    assert seen.count("turn/started") == 2


async def test_a_running_codex_over_ws_with_its_token(
    model, codex_home, workspace, serve, codex_bin, http, tmp_path
):
    """`--app-server-url ws://...`: the bridge connects to a codex it did not start, with
    the token of `--ws-auth capability-token`; a wrong token is a 502, never shown."""
    token = "capability-" + os.urandom(8).hex()
    token_file = tmp_path / "ws-token"
    token_file.write_text(token)
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    listen = ["--listen", "ws://127.0.0.1:0", "--ws-auth", "capability-token"]
    codex = await asyncio.create_subprocess_exec(
        *command,
        *listen,
        "--ws-token-file",
        str(token_file),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert codex.stderr is not None
        url = None
        async with asyncio.timeout(WAIT):
            while url is None:
                line = (await codex.stderr.readline()).decode()
                assert line, "codex ended before it listened"
                if "listening on: ws://" in line:
                    url = line.split("listening on: ", 1)[1].strip()
        good = AppServerSettings(mode="shared", url=url, token=token)
        base = await serve(trusted_bridge_app(["unused"], RestLimits(), good))
        session_id = await create_session(http, base, None)
        assert await start_thread(http, base, session_id, cwd=str(workspace))
        state = await shared_state(http, base)
        assert (state["source"], state["state"], state["connections"]) == ("url", "external", 1)
        wrong = AppServerSettings(mode="shared", url=url, token="not-" + token)
        refused = await serve(trusted_bridge_app(["unused"], RestLimits(), wrong))
        async with http.post(f"{refused}/v1/sessions", json={}) as response:
            body = await response.text()
            assert response.status == 502, body
        assert "app_server_spawn_failed" in body
        assert token not in body
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(codex.pid, signal.SIGKILL)
        await codex.wait()


async def test_what_codex_listens_on_is_removed_and_only_its_directory_stays(
    model, codex_home, workspace, codex_bin, http, tmp_path, monkeypatch
):
    """codex 0.169.0 makes `--listen unix://PATH` a link to a socket of its own in
    `/tmp/codex-daemon-<uid>/` (a private TMPDIR does not move it). When the bridge stops,
    its own socket directory is gone, and so are codex's socket and lock; the directory
    `/tmp/codex-daemon-<uid>` is codex's, shared by every codex of the user, and stays."""
    from scenarios.harness import serve_app

    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    app = trusted_bridge_app(command, RestLimits(), SHARED)
    runner, base = await serve_app(app)
    try:
        await create_session(http, base, None)
        socket_dir = app[BACKEND].server.socket_dir
        assert socket_dir is not None
        target = os.readlink(os.path.join(socket_dir, "app-server.sock"))
        assert os.path.dirname(target) == f"/tmp/codex-daemon-{os.getuid()}"
        assert _present(target)
    finally:
        await runner.cleanup()
    assert not _present(socket_dir)
    assert not _present(target)
    assert not _present(target + ".lock")
    assert not list(private_tmp.iterdir())  # nothing in the TMPDIR codex was given either


def _present(path: str) -> bool:
    return os.path.lexists(path)


def _dead(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


#: A probe every 0.2 s; the real codex answers `thread/loaded/list` in milliseconds, and
#: has 5 s (it shares two cores with whatever else runs).
PROBED = RestLimits(liveness_interval_ms=200, liveness_timeout_ms=5000)
WEDGED = {
    "exitCode": None,
    "signal": "SIGKILL",
    "stderrTail": "",
    "connection": "the shared app-server stopped answering and was killed",
}


async def test_a_stopped_codex_is_found_wedged_killed_and_restarted(
    model, codex_home, workspace, serve, codex_bin, http
):
    """SIGSTOP of the shared codex (its whole group): the socket still accepts, nothing
    answers. The liveness probe finds it: every session ends with an `exit` event that
    says so, a call waiting on it fails, codex is killed and a new one serves."""
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    base = await serve(trusted_bridge_app(command, PROBED, SHARED))
    sessions = [await create_session(http, base, None) for _ in range(2)]
    await start_thread(http, base, sessions[0], cwd=str(workspace))
    first = await shared_state(http, base)
    pid = first["pid"]
    assert (first["connections"], first["restarts"]) == (2, 0)
    streams = [
        await http.get(f"{base}/v1/sessions/{s}/events/stream?after=0").__aenter__()
        for s in sessions
    ]
    try:
        os.killpg(pid, signal.SIGSTOP)
        waiting = asyncio.ensure_future(call(http, base, sessions[1], "thread/start", {}))
        for stream in streams:
            frames = await SseReader(stream).until(lambda f: f.event == "exit", timeout=WAIT)
            assert frames[-1].json()["params"] == WEDGED
        status, body = await waiting
        assert (status, body["error"]) == (502, "app_server_exited"), body
        await exited([pid], WAIT)
        assert _dead(pid)
    finally:
        for stream in streams:
            stream.release()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)
    fresh = await create_session(http, base, None)
    assert await start_thread(http, base, fresh, cwd=str(workspace))
    state = await shared_state(http, base)
    assert (state["state"], state["restarts"], state["connections"]) == ("running", 1, 1)
    assert state["pid"] not in (None, pid)
    assert (state["lastExit"]["signal"], state["lastExit"]["wedged"]) == ("SIGKILL", True)


async def test_a_session_that_stops_its_codex_with_command_exec_does_not_hang_the_others(
    model, codex_home, workspace, serve, codex_bin, http
):
    """A session's `command/exec` of `kill -STOP $PPID` stops the shared codex itself
    (trusted preset: the method is allowed). The others are not left hanging: the probe
    finds it wedged, their sessions end, and a new codex serves new ones."""
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    base = await serve(trusted_bridge_app(command, PROBED, SHARED))
    attacker, bystander = [await create_session(http, base, None) for _ in range(2)]
    pid = (await shared_state(http, base))["pid"]
    async with http.get(f"{base}/v1/sessions/{bystander}/events/stream?after=0") as stream:
        try:
            params = {
                "command": ["sh", "-c", "kill -STOP $PPID"],
                "sandboxPolicy": {"type": "dangerFullAccess"},
            }
            status, body = await call(http, base, attacker, "command/exec", params)
            assert (status, body["error"]) == (502, "app_server_exited"), body
            frames = await SseReader(stream).until(lambda f: f.event == "exit", timeout=WAIT)
            assert frames[-1].json()["params"] == WEDGED
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)
    fresh = await create_session(http, base, None)
    assert await start_thread(http, base, fresh, cwd=str(workspace))
    state = await shared_state(http, base)
    assert (state["restarts"], state["lastExit"]["wedged"]) == (1, True)
