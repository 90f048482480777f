"""Memory and limits under churn: deleted sessions, big events, slots, and the idle reaper.

Each test drives a real bridge (in this process, or `rest-bridge serve` in its own) on
fake-codex and checks a bound the docs promise: memory within the formula of the
limits, a deleted session gone at once, never more app-servers alive than
MAX_SESSIONS, and no session reaped while something waits on it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from typing import Any

import aiohttp
import pytest
from processes import live_children, resident_kib

from bridge.app import trusted_bridge_app
from bridge.limits import RestLimits
from bridge.process.backend import ProcessBackend
from bridge.routes import BACKEND
from bridge.settings import LimitVariables
from scenarios.sse import SseReader

pytestmark = pytest.mark.asyncio

THEME = "Memory, limits and the life of a session"
MIB = 1024 * 1024


async def json_request(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[int, Any]:
    async with http.request(method, url, json=body) as response:
        payload = await response.json() if response.status != 204 else None
        return response.status, payload


def script_env(script: str) -> dict[str, Any]:
    return {"options": {"env": {"FAKE_CODEX_SCRIPT": script}}}


# -- memory ----------------------------------------------------------------------------


@pytest.mark.timeout(900)  # 36 cycles of 80 MB each at full size, on a shared machine
async def test_memory_stays_within_the_formula_under_churn_of_big_events(
    bridge_process, http, report, write_script, eventually
):
    """Create → ten 8 MiB notifications → DELETE, over and over, with MAX_SESSIONS=1"""
    cycles = 36 if os.environ.get("RELIABILITY_SOAK", "").lower() == "full" else 6
    env = {
        "REST_ADAPTER_MAX_SESSIONS": "1",
        "REST_ADAPTER_EVENT_BUFFER_BYTES": str(24 * MIB),
        "REST_ADAPTER_MAX_LINE_BYTES": str(9 * MIB),
        "REST_ADAPTER_MAX_CONCURRENT_TEXT_TURNS": "1",
    }
    limits = LimitVariables.from_env(env).limits()
    served = bridge_process(env=env)
    big = {"steps": [{"bigLine": 8 * MIB} for _ in range(10)], "result": {}}
    script = write_script({"methods": {"x/big": big}})
    baseline = resident_kib(served.pid)
    samples: list[int] = []
    for _ in range(cycles):
        status, created = await json_request(
            http, "POST", f"{served.base}/v1/sessions", script_env(script)
        )
        assert status == 201, created
        session = f"{served.base}/v1/sessions/{created['sessionId']}"
        status, body = await json_request(http, "POST", f"{session}/call/x/big", {"params": {}})
        assert status == 200, body
        samples.append(resident_kib(served.pid))
        status, body = await json_request(http, "DELETE", session)
        assert status == 200, body
        samples.append(resident_kib(served.pid))
    bound_kib = limits.memory_bound() // 1024
    growth = max(samples) - baseline
    report.figures.update(
        {
            "cycles": cycles,
            "baselineMiB": round(baseline / 1024),
            "peakGrowthMiB": round(growth / 1024),
            "lastMiB": round(samples[-1] / 1024),
            "boundMiB": round(bound_kib / 1024),
        }
    )
    assert growth <= bound_kib, (samples, bound_kib)
    # No growth from cycle to cycle: the last cycles peak no higher than the first ones.
    assert max(samples[-4:]) <= max(samples[:4]) + 16 * 1024, samples
    report.survived = True
    report.no_leak = True
    report.outcome = "resident memory stays within the documented bound of the limits"


async def test_a_deleted_session_is_released_at_once(serve, http, report, write_script, eventually):
    """A deleted session's memory goes at once, with the garbage collector off"""
    # The idle reaper looks at the sessions every 0.3 s meanwhile (a stream keeps this one
    # busy): nothing it looked at may stay alive in its frame either. A decoy session,
    # created first and left idle, is reaped in a round that looked at this one last.
    limits = RestLimits(shutdown_grace_ms=1000, session_idle_timeout_ms=1200)
    from scenarios.harness import fake_codex_command

    app = trusted_bridge_app([*fake_codex_command(), "app-server"], limits)
    base = await serve(app)
    backend = app[BACKEND]
    assert isinstance(backend, ProcessBackend)
    status, decoy = await json_request(http, "POST", f"{base}/v1/sessions", {})
    assert status == 201, decoy
    flood = {"steps": [{"flood": {"count": 500, "method": "x/tick"}}], "result": {}}
    script = write_script({"methods": {"x/flood": flood}})
    status, created = await json_request(http, "POST", f"{base}/v1/sessions", script_env(script))
    assert status == 201, created
    session_id = created["sessionId"]
    url = f"{base}/v1/sessions/{session_id}"
    assert (await json_request(http, "POST", f"{url}/call/x/flood", {"params": {}}))[0] == 200
    # A stream reads to the end across the delete; then nothing may hold the session.
    async with http.get(f"{url}/events/stream?after=0") as response:
        reader = SseReader(response)
        await reader.until(lambda f: f.event == "notification" and f.json()["seq"] > 100)
        assert list(backend.sessions()) == [decoy["sessionId"], session_id]
        await eventually(lambda: decoy["sessionId"] not in backend.sessions(), 60, what="reaping")
        session = weakref.ref(backend.session(session_id))
        log = weakref.ref(backend.session(session_id).events)
        gc.disable()
        try:
            status, _ = await json_request(http, "DELETE", url)
            assert status == 200
            frames = await reader.rest(timeout=60)
            assert frames[-1].event == "exit"
            response.release()
        finally:
            gc.enable()
    # Checked outside the stream's context: the response object is the client's.
    gc.disable()
    try:
        await asyncio.sleep(0)  # sync-ok: one turn of the loop for the handler to return
        assert session() is None, gc.get_referrers(session())
        assert log() is None
    finally:
        gc.enable()
    report.nothing_lost = True
    report.no_leak = True
    report.survived = True
    report.outcome = "no reference cycle keeps a deleted session or its log"


async def test_deleted_means_gone(serve, http, report, write_script):
    """Every new request on a deleted id is a 404; open streams end with `exit`"""
    from scenarios.harness import fake_codex_command

    app = trusted_bridge_app([*fake_codex_command(), "app-server"], RestLimits())
    base = await serve(app)
    ask = {"turns": [{"steps": [{"request": {"method": "item/tool/call"}}]}]}
    status, created = await json_request(
        http, "POST", f"{base}/v1/sessions", script_env(write_script(ask))
    )
    session = f"{base}/v1/sessions/{created['sessionId']}"
    status, started = await json_request(
        http, "POST", f"{session}/call/thread/start", {"params": {}}
    )
    turn = {"threadId": started["result"]["thread"]["id"], "input": []}
    assert (await json_request(http, "POST", f"{session}/call/turn/start", {"params": turn}))[
        0
    ] == 200
    async with (
        http.get(f"{session}/events/stream?after=0") as stream,
        http.get(f"{session}/events/stream") as cursor_stream,
    ):
        readers = [SseReader(stream), SseReader(cursor_stream)]
        request = (await readers[0].until(lambda f: f.event == "request"))[-1].json()
        status, _ = await json_request(http, "DELETE", session)
        assert status == 200
        for reader in readers:
            assert (await reader.rest(timeout=30))[-1].event == "exit"
    key = request["requestKey"]
    for method, path, body in [
        ("GET", "/events?waitMs=0", None),
        ("GET", "/events?after=0&waitMs=0", None),
        ("GET", "/events/stream?after=0", None),
        ("POST", "/call/thread/start", {"params": {}}),
        ("POST", f"/requests/{key}/result", {"result": {}}),
        ("POST", f"/requests/{key}/error", {"code": 1, "message": "x"}),
        ("DELETE", "", None),
    ]:
        status, body = await json_request(http, method, session + path, body)
        assert (status, body["error"]) == (404, "session_not_found"), (method, path)
    report.nothing_lost = True
    report.survived = True
    report.no_leak = True
    report.outcome = "404 session_not_found for 7 kinds of request; both open streams got `exit`"


# -- MAX_SESSIONS --------------------------------------------------------------------------


async def test_a_slot_is_held_until_the_deleted_process_is_gone(serve, http, report, write_script):
    """DELETE and create together at MAX_SESSIONS=1, the app-server lingering on its way out"""
    from scenarios.harness import fake_codex_command

    limits = RestLimits(max_sessions=1, shutdown_grace_ms=1500)
    app = trusted_bridge_app([*fake_codex_command(), "app-server"], limits)
    base = await serve(app)
    stall = {"steps": [{"stall": {"ignoreTerm": True}}]}
    script = write_script({"methods": {"x/stall": stall}})
    before = live_children()
    status, created = await json_request(http, "POST", f"{base}/v1/sessions", script_env(script))
    assert status == 201
    first = live_children() - before
    assert first
    session = f"{base}/v1/sessions/{created['sessionId']}"
    # It now ignores stdin's end and SIGTERM: only SIGKILL, at SHUTDOWN_GRACE_MS, ends it.
    status, body = await json_request(
        http, "POST", f"{session}/call/x/stall", {"params": {}, "timeoutMs": 200}
    )
    assert status == 504, body
    deleting = asyncio.ensure_future(json_request(http, "DELETE", session))
    creates: list[int] = []
    while not deleting.done():
        status, body = await json_request(http, "POST", f"{base}/v1/sessions", {})
        creates.append(status)
        if status == 201:
            assert not first & live_children(), "a second app-server while the first lives"
            break
        assert (status, body["error"]) == (429, "session_limit_reached"), body
        await asyncio.wait((deleting,), timeout=0.05)
    assert (await deleting)[0] == 200
    report.figures["createsRefused"] = creates.count(429)
    report.survived = True
    report.no_leak = True
    report.outcome = "429 until the deleted session's process is gone, never two alive"


# -- the idle reaper ---------------------------------------------------------------------


async def test_the_reaper_spares_sessions_something_waits_on(
    serve, http, report, write_script, eventually
):
    """SESSION_IDLE_TIMEOUT_MS=1500 with a call in flight, and with an unanswered request"""
    from scenarios.harness import fake_codex_command

    limits = RestLimits(session_idle_timeout_ms=1500, shutdown_grace_ms=1000)
    app = trusted_bridge_app([*fake_codex_command(), "app-server"], limits)
    base = await serve(app)
    script = write_script(
        {
            "methods": {
                "x/slow": {"steps": [{"sleep": 6000}], "result": {"slow": True}},
                "x/ask": {
                    "steps": [{"request": {"method": "item/tool/call", "wait": False}}],
                    "result": {},
                },
            }
        }
    )
    created: list[str] = []
    for method in ("x/ask", "x/slow"):
        status, session = await json_request(
            http, "POST", f"{base}/v1/sessions", script_env(script)
        )
        assert status == 201, session
        created.append(session["sessionId"])
        if method == "x/ask":
            url = f"{base}/v1/sessions/{session['sessionId']}/call/x/ask"
            assert (await json_request(http, "POST", url, {"params": {}}))[0] == 200
    # A call that takes four idle timeouts to answer is not idleness.
    status, body = await json_request(
        http,
        "POST",
        f"{base}/v1/sessions/{created[1]}/call/x/slow",
        {"params": {}, "timeoutMs": 20000},
    )
    assert (status, body) == (200, {"result": {"slow": True}})
    # A control session with nothing pending is reaped; the asking one, idle longer, is not.
    status, control = await json_request(http, "POST", f"{base}/v1/sessions", {})

    async with http.get(f"{base}/v1/sessions") as listing:
        assert listing.status == 200
    backend = app[BACKEND]
    assert isinstance(backend, ProcessBackend)
    await eventually(lambda: control["sessionId"] not in backend.sessions(), 30, what="reaping")
    assert created[0] in backend.sessions()
    status, summary = await json_request(http, "GET", f"{base}/v1/sessions")
    pending = {s["sessionId"]: s["pendingRequests"] for s in summary["sessions"]}
    assert pending[created[0]], pending
    report.survived = True
    report.nothing_lost = True
    report.no_leak = True
    report.outcome = (
        "a call answered after 5 idle timeouts is a 200; a session with an unanswered "
        "request outlives an idle control session"
    )
