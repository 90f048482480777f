"""Streams under pressure: floods, readers that vanish, readers that stop reading.

A reader that keeps reading loses nothing, at any rate: while an attached SSE stream is
behind, the bridge stops reading the app-server's stdout (which then blocks in its
writes) instead of dropping events. A stream that stops reading for READER_STALL_MS is
cut loose, so that one dead client cannot hold a turn forever; it is owed a `gap`.
A stream cut short by its client never moves the cursor past what it may not have
delivered.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import aiohttp
import pytest

from bridge.app import trusted_bridge_app
from bridge.limits import RestLimits
from scenarios.harness import fake_codex_command
from scenarios.sse import SseReader

pytestmark = pytest.mark.asyncio

THEME = "Streams under pressure"
FLOOD = 100_000


async def json_request(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None, **kwargs: Any
) -> tuple[int, Any]:
    async with http.request(method, url, json=body, **kwargs) as response:
        return response.status, (await response.json() if response.status != 204 else None)


def flood_script(write_script: Any, count: int) -> dict[str, Any]:
    flood = {"steps": [{"flood": {"count": count, "method": "x/tick"}}], "result": {}}
    return {"options": {"env": {"FAKE_CODEX_SCRIPT": write_script({"methods": {"x/f": flood}})}}}


async def test_a_stream_cut_short_loses_nothing(serve, http, report, write_script):
    """A stream without a position reads 3 of 3,000 events, then its client goes away"""
    app = trusted_bridge_app([*fake_codex_command(), "app-server"], RestLimits())
    base = await serve(app)
    status, created = await json_request(
        http, "POST", f"{base}/v1/sessions", flood_script(write_script, 3000)
    )
    session = f"{base}/v1/sessions/{created['sessionId']}"
    assert (await json_request(http, "POST", f"{session}/call/x/f", {"params": {}}))[0] == 200
    async with http.get(f"{session}/events/stream") as response:
        frames = await SseReader(response).collect(3)
        assert [int(f.id) for f in frames] == [1, 2, 3]
        response.close()
    # The stream wrote far more than 3 events before its client went: none may be lost.
    seqs: list[int] = []
    while len(seqs) < 3001:
        status, event = await json_request(http, "GET", f"{session}/events?waitMs=5000")
        assert status == 200, event
        assert event["kind"] != "gap", event
        seqs.append(event["seq"])
    assert seqs == list(range(1, 3002))
    report.nothing_lost = True
    report.survived = True
    report.outcome = "the cursor goes back to the stream's start: every event read again, none lost"


LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])


@pytest.mark.parametrize("loop", LOOPS)
async def test_a_reader_that_keeps_reading_loses_nothing(
    bridge_process, http, report, write_script, loop
):
    """100,000 notifications as fast as fake-codex writes them, one SSE reader reading"""
    served = bridge_process(extra_args=["--loop", loop])
    status, created = await json_request(
        http, "POST", f"{served.base}/v1/sessions", flood_script(write_script, FLOOD)
    )
    assert status == 201, created
    session = f"{served.base}/v1/sessions/{created['sessionId']}"
    async with http.get(f"{session}/events/stream?after=0") as response:
        reader = SseReader(response)
        call = asyncio.ensure_future(
            json_request(http, "POST", f"{session}/call/x/f", {"params": {}, "timeoutMs": 300_000})
        )
        ticks = 0
        last = 0
        kinds: set[str] = set()
        async with asyncio.timeout(300):
            while ticks < FLOOD:
                frame = await reader.next(timeout=60)
                assert frame is not None
                assert int(frame.id) == last + 1, (frame.id, last)
                last = int(frame.id)
                kinds.add(frame.event or "")
                ticks += frame.data.startswith('{"seq"') and '"x/tick"' in frame.data
        assert (await call)[0] == 200
    assert "gap" not in kinds
    report.figures.update({"events": FLOOD, "loop": loop})
    report.nothing_lost = True
    report.survived = True
    report.outcome = "every event, in order, no gap: the app-server waited for the reader"


async def test_a_reader_that_stops_reading_is_cut_loose(bridge_process, http, report, write_script):
    """An SSE client stops reading its socket during a flood of 100,000 notifications"""
    served = bridge_process(env={"REST_ADAPTER_READER_STALL_MS": "1000"})
    status, created = await json_request(
        http, "POST", f"{served.base}/v1/sessions", flood_script(write_script, FLOOD)
    )
    session_id = created["sessionId"]
    port = int(served.base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET /v1/sessions/{session_id}/events/stream?after=0 HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    )
    async with asyncio.timeout(30):
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
    # The stream's client reads nothing more: the flood's answer must still come.
    url = f"{served.base}/v1/sessions/{session_id}/call/x/f"
    status, body = await json_request(http, "POST", url, {"params": {}, "timeoutMs": 300_000})
    assert status == 200, body
    # When it reads again, it is told what it missed.
    seen = b""
    async with asyncio.timeout(120):
        while b"event: gap\n" not in seen:
            chunk = await reader.read(1 << 20)
            assert chunk, "the stream ended without a gap"
            seen = seen[-64:] + chunk
    writer.close()
    assert "stopped reading" in served.output
    report.survived = True
    report.outcome = "cut loose after READER_STALL_MS: the call answers, the reader gets a gap"
