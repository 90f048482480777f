"""Shared mode from outside: a session is a tenant, whatever another session tries.

`rest-bridge serve --app-server-mode shared` in a child process, on fake-codex
`--listen` (one store of threads for every connection and codex's broadcasts, as the
real codex 0.169.0 has; the real one is attacked in tests/e2e/test_shared_mode.py).
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from typing import Any

import pytest
from session_logs import blanked, session_log

pytestmark = pytest.mark.asyncio

THEME = "Security"
TOKEN = "tok-tenancy-reliability-SECRET"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHARED = ["--app-server-mode", "shared"]
#: Every thread-scoped call an intruder tries, with what it needs besides `threadId`.
INTRUSIONS: list[tuple[str, dict[str, Any]]] = [
    ("thread/read", {"includeTurns": True}),
    ("thread/turns/list", {}),
    ("thread/resume", {}),
    ("thread/fork", {}),
    ("turn/start", {"input": [{"type": "text", "text": "Mine now."}]}),
    ("turn/steer", {"input": [{"type": "text", "text": "x"}], "expectedTurnId": "t"}),
    ("turn/interrupt", {"turnId": "t"}),
    ("thread/name/set", {"name": "taken"}),
    ("thread/goal/get", {}),
    ("thread/compact/start", {}),
    ("thread/unsubscribe", {}),
    ("thread/archive", {}),
    ("thread/unarchive", {}),
    ("thread/delete", {}),
]


async def post(http: Any, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.post(url, json=body or {}, headers=AUTH) as response:
        return response.status, await response.json()


async def session(http: Any, base: str) -> str:
    status, body = await post(http, f"{base}/v1/sessions")
    assert status == 201, body
    return str(body["sessionId"])


async def call(http: Any, base: str, session_id: str | None, method: str, params: Any) -> Any:
    where = f"/v1/sessions/{session_id}" if session_id else "/v1"
    return await post(http, f"{base}{where}/call/{method}", {"params": params})


async def thread_with_a_turn(http: Any, base: str, session_id: str, text: str) -> str:
    status, body = await call(http, base, session_id, "thread/start", {})
    assert status == 200, body
    thread_id = str(body["result"]["thread"]["id"])
    params = {"threadId": thread_id, "input": [{"type": "text", "text": text}]}
    status, body = await call(http, base, session_id, "turn/start", params)
    assert status == 200, body
    url = f"{base}/v1/sessions/{session_id}/events?after=0&waitMs=30000"
    while True:  # long-polls: each answers as soon as there is an event
        async with http.get(url, headers=AUTH) as response:
            event = await response.json()
        if event["method"] == "turn/completed" and event["params"]["threadId"] == thread_id:
            return thread_id
        url = f"{base}/v1/sessions/{session_id}/events?after={event['seq']}&waitMs=30000"


async def test_an_intruder_with_a_leaked_thread_id_reaches_nothing_of_it(
    bridge_process, http, report
):
    """A session given another session's thread id, trying every thread-scoped call"""
    served = bridge_process(token=TOKEN, extra_args=SHARED)
    base = served.base
    victim, intruder = await session(http, base), await session(http, base)
    thread_id = await thread_with_a_turn(http, base, victim, "The vault code is 0451.")
    victim_log = len(await session_log(http, base, victim, AUTH))
    tried = 0
    for method, params in INTRUSIONS:
        for who in (intruder, None):  # a session, and a sessionless call
            stranger = str(uuid.uuid4())
            got = await call(http, base, who, method, {**params, "threadId": thread_id})
            unknown = await call(http, base, who, method, {**params, "threadId": stranger})
            assert (got[0], blanked(got[1], thread_id)) == (
                unknown[0],
                blanked(unknown[1], stranger),
            ), method
            assert "0451" not in json.dumps(got[1])
            tried += 1
    for method in ("thread/list", "thread/loaded/list"):
        status, body = await call(http, base, intruder, method, {})
        assert (status, body["result"]["data"]) == (200, [])
    # Nothing the intruder did reached the victim's thread or its log.
    assert len(await session_log(http, base, victim, AUTH)) == victim_log
    status, body = await call(
        http, base, victim, "thread/read", {"threadId": thread_id, "includeTurns": True}
    )
    assert status == 200, body
    assert body["result"]["thread"]["name"] is None
    assert "0451" in json.dumps(body)
    assert await thread_with_a_turn(http, base, victim, "Still mine?")
    assert thread_id not in json.dumps(await session_log(http, base, intruder, AUTH))
    served.signal(signal.SIGTERM)
    assert served.wait(30) == 0
    assert "Traceback" not in served.output
    assert TOKEN not in served.output
    report.figures.update({"callsTried": tried * 2})
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = (
        "every answer the same as for a thread id that never existed; the thread, its "
        "log and its next turn untouched"
    )


async def test_tenants_at_work_at_once_each_see_their_own_threads_only(
    bridge_process, http, report
):
    """Eight sessions starting threads and turns at once, each listing and reading its log"""
    served = bridge_process(token=TOKEN, extra_args=SHARED)
    base = served.base
    sessions = [await session(http, base) for _ in range(8)]

    async def work(session_id: str) -> list[str]:
        return [await thread_with_a_turn(http, base, session_id, "Hi.") for _ in range(3)]

    owned = dict(zip(sessions, await asyncio.gather(*map(work, sessions)), strict=True))
    everyone = {t for threads in owned.values() for t in threads}
    assert len(everyone) == 24
    for session_id, threads in owned.items():
        status, body = await call(http, base, session_id, "thread/list", {"limit": 100})
        assert status == 200, body
        assert sorted(t["id"] for t in body["result"]["data"]) == sorted(threads)
        told = json.dumps(await session_log(http, base, session_id, AUTH))
        assert [t for t in everyone - set(threads) if t in told] == []
        assert all(t in told for t in threads)
    served.signal(signal.SIGTERM)
    assert served.wait(30) == 0
    assert "Traceback" not in served.output
    report.figures.update({"sessions": 8, "threads": 24})
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = "each listing and each event log names that session's threads alone"
