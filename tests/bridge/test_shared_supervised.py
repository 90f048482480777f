"""Shared mode with the app-server the bridge starts itself: fake-codex `--listen`.

The bridge appends `--listen unix://PATH` to the command and supervises the process:
floods held back for a reader, the whole process dying (every session ends, a new one
starts for new sessions), what it started swept with it, and nothing left at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterable
from typing import Any

import aiohttp
import pytest
from processes import exited, live_children

from bridge.app import trusted_bridge_app
from bridge.limits import AppServerSettings, RestLimits
from bridge.process.shared import PROBE_CLIENT_INFO
from bridge.routes import BACKEND
from scenarios.harness import fake_app_server_command
from scenarios.sse import SseReader

pytestmark = pytest.mark.asyncio

SHARED = AppServerSettings(mode="shared")
WAIT = 60.0
NO_PARAMS = {"params": {}}


async def post(http: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.post(url, json=body or {}) as response:
        return response.status, await response.json()


async def shared_state(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with http.get(f"{base}/v1/compatibility") as response:
        return dict((await response.json())["appServer"]["shared"])


async def new_session(http: aiohttp.ClientSession, base: str) -> str:
    status, body = await post(http, f"{base}/v1/sessions")
    assert status == 201, body
    return str(body["sessionId"])


async def gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait (on pidfds, no polling) until every pid has exited; those still alive."""
    pids = list(pids)
    await exited(pids, timeout)
    return {pid for pid in pids if _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _exists(path: str) -> bool:
    return os.path.exists(path)


async def test_a_flood_is_held_back_for_a_reader_that_keeps_reading(serve, http, write_script):
    count = 20_000
    flood = {"steps": [{"flood": {"count": count, "method": "x/tick"}}], "result": {}}
    command = fake_app_server_command(write_script({"methods": {"x/f": flood}}))
    limits = RestLimits(event_buffer=64, event_buffer_bytes=65_536)
    base = await serve(trusted_bridge_app(command, limits, SHARED))
    session = f"{base}/v1/sessions/{await new_session(http, base)}"
    async with http.get(f"{session}/events/stream?after=0") as response:
        reader = SseReader(response)
        call = asyncio.ensure_future(
            post(http, f"{session}/call/x/f", {"params": {}, "timeoutMs": 300_000})
        )
        ticks = last = 0
        kinds: set[str] = set()
        async with asyncio.timeout(300):
            while ticks < count:
                frame = await reader.next(timeout=WAIT)
                assert frame is not None
                assert int(frame.id) == last + 1, (frame.id, last)
                last = int(frame.id)
                kinds.add(frame.event or "")
                ticks += '"x/tick"' in frame.data
        assert (await call)[0] == 200
    assert "gap" not in kinds


async def test_the_shared_process_dying_ends_every_session_and_a_new_one_starts(
    serve, http, write_script
):
    die = {"steps": [{"exit": {"code": 5, "server": True}}]}
    child = {"steps": [{"spawnChild": True}], "result": {}}
    command = fake_app_server_command(write_script({"methods": {"x/die": die, "x/child": child}}))
    base = await serve(trusted_bridge_app(command, RestLimits(), SHARED))
    before = live_children()
    sessions = [await new_session(http, base) for _ in range(3)]
    first = await shared_state(http, base)
    assert (first["state"], first["connections"], first["restarts"]) == ("running", 3, 0)
    status, body = await post(http, f"{base}/v1/sessions/{sessions[0]}/call/x/child", NO_PARAMS)
    assert status == 200, body
    started = live_children() - before
    assert first["pid"] in started
    assert len(started) >= 2  # the shared process and the child it started
    waiting = asyncio.ensure_future(
        post(http, f"{base}/v1/sessions/{sessions[1]}/call/thread/list", NO_PARAMS)
    )
    status, body = await post(http, f"{base}/v1/sessions/{sessions[2]}/call/x/die", NO_PARAMS)
    assert status == 502, body
    assert body["error"] == "app_server_exited"
    assert body["data"] == {"exitCode": 5, "signal": None}
    await waiting  # answered or failed: not left hanging
    for session in sessions:
        url = f"{base}/v1/sessions/{session}/events/stream?after=0"
        async with http.get(url) as response:
            frames = await SseReader(response).until(lambda f: f.event == "exit", timeout=WAIT)
        assert frames[-1].json()["params"] == {
            "exitCode": 5,
            "signal": None,
            "stderrTail": "",
            "connection": "the shared app-server exited",
        }
    # What the dead process started is swept with it.
    assert await gone(started, WAIT) == set()
    # New sessions get a new process, after the backoff.
    fresh = await new_session(http, base)
    status, body = await post(http, f"{base}/v1/sessions/{fresh}/call/thread/start", NO_PARAMS)
    assert status == 200, body
    state = await shared_state(http, base)
    assert state["restarts"] == 1
    assert state["lastExit"]["exitCode"] == 5
    assert state["pid"] not in (None, first["pid"])
    assert state["connections"] == 1


async def test_a_process_that_cannot_start_is_reported_and_retried(serve, http, tmp_path):
    script = tmp_path / "broken.sh"
    script.write_text("#!/bin/sh\necho 'no good' >&2\nexit 3\n")
    script.chmod(0o755)
    base = await serve(trusted_bridge_app([str(script), "app-server"], RestLimits(), SHARED))
    for _ in range(2):
        status, body = await post(http, f"{base}/v1/sessions")
        assert status == 502, body
        assert body["error"] == "app_server_exited"
        assert "no good" not in str(body)
        assert str(script) not in str(body)
    state = await shared_state(http, base)
    assert state["state"] == "failed"
    assert state["pid"] is None
    assert state["restartInMs"] is not None


async def test_a_process_that_never_listens_is_a_504_naming_the_setting(
    serve, http, tmp_path, caplog
):
    """A shared app-server that starts and never listens: 504 `timeout` whose message
    names REST_ADAPTER_SPAWN_TIMEOUT_MS, one WARNING for the operator, and the process
    is stopped."""
    script = tmp_path / "deaf.sh"
    script.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && exec echo codex-cli 0.169.0\nexec sleep 1000\n'
    )
    script.chmod(0o755)
    limits = RestLimits(spawn_timeout_ms=300)
    base = await serve(trusted_bridge_app([str(script), "app-server"], limits, SHARED))
    with caplog.at_level("WARNING", logger="bridge"):
        status, body = await post(http, f"{base}/v1/sessions")
    assert status == 504, body
    assert body == {
        "error": "timeout",
        "message": "Starting the app-server did not complete before its deadline"
        " (REST_ADAPTER_SPAWN_TIMEOUT_MS, 300 ms).",
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert warnings[0].endswith("did not listen within 300 ms"), warnings
    assert (await shared_state(http, base))["pid"] is None


async def test_nothing_is_left_when_the_bridge_stops(http, write_script):
    from scenarios.harness import serve_app

    child = {"steps": [{"spawnChild": True}], "result": {}}
    command = fake_app_server_command(write_script({"methods": {"x/child": child}}))
    app = trusted_bridge_app(command, RestLimits(), SHARED)
    runner, base = await serve_app(app)
    before = live_children()
    try:
        session = await new_session(http, base)
        status, _ = await post(http, f"{base}/v1/sessions/{session}/call/x/child", NO_PARAMS)
        assert status == 200
        socket_dir = app[BACKEND].launcher.socket_dir
        assert socket_dir is not None
        assert os.stat(socket_dir).st_mode & 0o777 == 0o700
        async with http.get(f"{base}/v1/sessions/{session}/events/stream") as stream:
            started = live_children() - before
            assert len(started) >= 2
            await runner.cleanup()
            frames = await SseReader(stream).until(lambda f: f.event == "exit", timeout=WAIT)
            assert frames[-1].json()["params"]["connection"] == "closed by the bridge"
    finally:
        await runner.cleanup()
    assert await gone(started, WAIT) == set()
    assert not _exists(socket_dir)


async def test_a_sigkilled_shared_process_is_an_exit_with_its_signal(serve, http):
    base = await serve(trusted_bridge_app(fake_app_server_command(), RestLimits(), SHARED))
    session = await new_session(http, base)
    pid = (await shared_state(http, base))["pid"]
    async with http.get(f"{base}/v1/sessions/{session}/events/stream") as stream:
        os.kill(pid, signal.SIGKILL)
        frames = await SseReader(stream).until(lambda f: f.event == "exit", timeout=WAIT)
    params = frames[-1].json()["params"]
    assert (params["signal"], params["connection"]) == ("SIGKILL", "the shared app-server exited")


async def test_concurrent_first_requests_start_one_process(serve, http):
    base = await serve(trusted_bridge_app(fake_app_server_command(), RestLimits(), SHARED))
    before = live_children()
    results = await asyncio.gather(*(post(http, f"{base}/v1/sessions") for _ in range(20)))
    assert [status for status, _ in results] == [201] * 20
    state = await shared_state(http, base)
    assert state["connections"] == 20
    assert {os.getpgid(pid) for pid in live_children() - before} == {state["pid"]}


#: Trials of the race below, and how many run at once (each on a bridge of its own, so
#: they wait out their backoffs side by side rather than one after the other).
RACE_TRIALS = 20
RACES_AT_ONCE = 4


async def test_a_create_racing_a_sigkill_restart_waits_for_the_new_process(http, contract_checkers):
    """Creates sent right after the shared process is SIGKILLed, before the bridge has
    seen it die, wait for the restart (docs/API.md) instead of a 502 "Connection
    refused". A fresh bridge per trial: each starts from the first backoff (0.5 s)."""
    from scenarios.harness import checker_for, serve_app

    at_once = asyncio.Semaphore(RACES_AT_ONCE)

    async def race(trial: int) -> None:
        async with at_once:
            app = trusted_bridge_app(fake_app_server_command(), RestLimits(), SHARED)
            runner, base = await serve_app(app)
            contract_checkers[base] = checker_for(app)
            try:
                await new_session(http, base)
                pid = (await shared_state(http, base))["pid"]
                os.kill(pid, signal.SIGKILL)
                creates = (post(http, f"{base}/v1/sessions") for _ in range(3))
                results = await asyncio.gather(*creates)
                assert [status for status, _ in results] == [201] * 3, (trial, results)
                state = await shared_state(http, base)
                assert (state["restarts"], state["connections"]) == (1, 3), (trial, state)
                assert state["pid"] not in (None, pid)
            finally:
                await runner.cleanup()

    # A failing trial cancels the others (each cleans its bridge up) and is reported.
    async with asyncio.TaskGroup() as trials:
        for trial in range(RACE_TRIALS):
            trials.create_task(race(trial))


#: A probe every 0.2 s that must be answered within 3 s (the fake answers in ms).
PROBED = RestLimits(liveness_interval_ms=200, liveness_timeout_ms=3000)
WEDGED = {
    "exitCode": None,
    "signal": "SIGKILL",
    "stderrTail": "",
    "connection": "the shared app-server stopped answering and was killed",
}


async def test_a_stopped_shared_process_is_killed_its_sessions_end_and_it_restarts(
    serve, http, write_script, caplog
):
    """SIGSTOP: the socket still accepts and nothing answers. The liveness probe finds it
    wedged: its sessions end (a call waiting on it too), it is killed with what it
    started, and it restarts; a create sent into the wedge waits for the new process."""
    caplog.set_level(logging.INFO, logger="bridge.sessions")
    child = {"steps": [{"spawnChild": True}], "result": {}}
    command = fake_app_server_command(write_script({"methods": {"x/child": child}}))
    base = await serve(trusted_bridge_app(command, PROBED, SHARED))
    before = live_children()
    sessions = [await new_session(http, base) for _ in range(2)]
    status, answer = await post(http, f"{base}/v1/sessions/{sessions[1]}/call/x/child", NO_PARAMS)
    assert status == 200, answer
    first = await shared_state(http, base)
    assert (first["connections"], first["restarts"]) == (2, 0)  # the probe is not one
    pid = first["pid"]
    started = live_children() - before
    assert pid in started
    assert len(started) >= 2  # the shared process and the child it started
    streams = [
        await http.get(f"{base}/v1/sessions/{s}/events/stream").__aenter__() for s in sessions
    ]
    try:
        os.kill(pid, signal.SIGSTOP)
        body = {"params": {}, "timeoutMs": 300_000}
        waiting = asyncio.ensure_future(
            post(http, f"{base}/v1/sessions/{sessions[0]}/call/thread/list", body)
        )
        creating = asyncio.ensure_future(post(http, f"{base}/v1/sessions"))
        for stream in streams:
            frames = await SseReader(stream).until(lambda f: f.event == "exit", timeout=WAIT)
            assert frames[-1].json()["params"] == WEDGED
        status, answer = await waiting
        assert status == 502, answer
        assert answer["error"] == "app_server_exited"
        # The operator's lines say the bridge killed it, as a WARNING (a kill needs attention).
        ended = [r for r in caplog.records if r.getMessage().startswith("app-server of session")]
        assert len(ended) == 2, [r.getMessage() for r in ended]
        for record in ended:
            assert record.levelname == "WARNING"
            assert record.getMessage().endswith(
                "stopped answering and was killed (killed by the bridge)"
            )
        assert await gone(started, WAIT) == set()
        status, answer = await creating
        assert status == 201, answer
    finally:
        for stream in streams:
            stream.release()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    fresh = await new_session(http, base)
    status, answer = await post(http, f"{base}/v1/sessions/{fresh}/call/thread/start", NO_PARAMS)
    assert status == 200, answer
    state = await shared_state(http, base)
    assert (state["state"], state["restarts"], state["connections"]) == ("running", 1, 2)
    assert state["pid"] not in (None, pid)
    assert (state["lastExit"]["signal"], state["lastExit"]["wedged"]) == ("SIGKILL", True)


async def test_a_process_busy_or_answering_the_probe_with_errors_is_alive(
    serve, http, write_script
):
    """Any answer is proof of life, an error too; and a session's long call does not
    make the process look wedged: a call of 4 s under a probe every 0.2 s with a 3 s
    deadline finishes, on the process it started on."""
    refuse = {"error": {"code": -32603, "message": "not today"}}
    slow = {"steps": [{"sleep": 4000}], "result": {"slept": True}}
    script = write_script({"methods": {"thread/loaded/list": refuse, "x/slow": slow}})
    base = await serve(trusted_bridge_app(fake_app_server_command(script), PROBED, SHARED))
    session = await new_session(http, base)
    pid = (await shared_state(http, base))["pid"]
    status, body = await post(http, f"{base}/v1/sessions/{session}/call/x/slow", NO_PARAMS)
    assert (status, body["result"]) == (200, {"slept": True})
    state = await shared_state(http, base)
    assert (state["pid"], state["restarts"], state["lastExit"]) == (pid, 0, None)


async def test_a_process_that_refuses_the_probes_initialize_is_alive_and_still_probed(
    serve, http, write_script
):
    """The probe's own `initialize` answered with an error is an answer too: the process
    lives on through a session's call of 4 s, and the probe goes on (a new connection
    each time) and finds it once it is stopped."""
    refuse = {"error": {"code": -32001, "message": "overloaded"}}
    probe = {"match": {"clientInfo": PROBE_CLIENT_INFO}, "repeat": True, **refuse}
    slow = {"steps": [{"sleep": 4000}], "result": {"slept": True}}
    script = write_script({"initialize": probe, "methods": {"x/slow": slow}})
    base = await serve(trusted_bridge_app(fake_app_server_command(script), PROBED, SHARED))
    session = await new_session(http, base)
    pid = (await shared_state(http, base))["pid"]
    status, body = await post(http, f"{base}/v1/sessions/{session}/call/x/slow", NO_PARAMS)
    assert (status, body["result"]) == (200, {"slept": True})
    state = await shared_state(http, base)
    assert (state["pid"], state["restarts"]) == (pid, 0)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert await gone([pid], WAIT) == set()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    await new_session(http, base)  # on the new process, once the bridge has seen it die
    state = await shared_state(http, base)
    assert (state["restarts"], state["lastExit"]["wedged"]) == (1, True)
