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
import contextlib
import importlib.util
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from processes import peak_resident_kib, reset_peak_resident

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


@contextlib.asynccontextmanager
async def stalled_readers(
    port: int, path: str, count: int, receive_buffer: int | None = 4096
) -> AsyncIterator[list[socket.socket]]:
    """``count`` connections that ask for ``path`` and read nothing (a receive buffer of
    ``receive_buffer`` bytes), once the bridge has begun to answer each."""
    loop = asyncio.get_running_loop()
    with contextlib.ExitStack() as stack:
        socks = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            if receive_buffer is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            socks.append(sock)
        for sock in socks:
            answered = loop.create_future()
            loop.add_reader(sock.fileno(), lambda f=answered: f.done() or f.set_result(None))
            try:
                async with asyncio.timeout(30):
                    await answered
            finally:
                loop.remove_reader(sock.fileno())
        yield socks


def dechunk(raw: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked response's bytes (its head dropped), as far as
    they go: a connection ended mid-chunk gives what arrived of it."""
    body = bytearray()
    rest = raw.split(b"\r\n\r\n", 1)[1]
    while (line_end := rest.find(b"\r\n")) > 0:
        size = int(rest[:line_end], 16)
        body += rest[line_end + 2 : line_end + 2 + size]
        rest = rest[line_end + 2 + size + 2 :]
    return bytes(body)


def last_whole_frame_id(body: bytes) -> int:
    """The id of the last frame that arrived whole (what an EventSource resumes from)."""
    whole = body[: body.rfind(b"\n\n") + 2]
    return int(re.findall(rb"^id: (\d+)$", whole, re.MULTILINE)[-1])


async def read_to_the_end(sock: socket.socket, timeout: float) -> bytes:
    """Everything ``sock`` receives until the bridge ends the connection (closed or reset)."""
    loop = asyncio.get_running_loop()
    received = bytearray()
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionResetError):
            while chunk := await loop.sock_recv(sock, 1 << 20):
                received += chunk
    return bytes(received)


async def test_a_reader_that_stops_reading_is_cut_loose(bridge_process, http, report, write_script):
    """An SSE client stops reading its socket during a flood of 100,000 notifications"""
    served = bridge_process(env={"REST_ADAPTER_READER_STALL_MS": "1000"})
    status, created = await json_request(
        http, "POST", f"{served.base}/v1/sessions", flood_script(write_script, FLOOD)
    )
    session_id = created["sessionId"]
    port = int(served.base.rsplit(":", 1)[1])
    path = f"/v1/sessions/{session_id}/events/stream?after=0"
    async with stalled_readers(port, path, 1, receive_buffer=None) as (sock,):
        # The stream's client reads nothing more: the flood's answer must still come.
        url = f"{served.base}/v1/sessions/{session_id}/call/x/f"
        status, body = await json_request(http, "POST", url, {"params": {}, "timeoutMs": 300_000})
        assert status == 200, body
        # Cut loose, its connection was ended: what it holds ends there, without the exit.
        stream = dechunk(await read_to_the_end(sock, timeout=120))
    assert b"event: exit\n" not in stream
    # Resuming from what it did receive, it is told what it missed.
    last = last_whole_frame_id(stream)
    headers = {"Last-Event-ID": str(last)}
    async with http.get(
        f"{served.base}/v1/sessions/{session_id}/events/stream", headers=headers
    ) as response:
        gap = await SseReader(response).next(timeout=30)
    assert gap is not None
    assert gap.event == "gap", gap
    assert gap.json()["params"]["fromSeq"] == last + 1
    assert "stopped reading" in served.output
    report.survived = True
    report.outcome = (
        "cut loose after READER_STALL_MS, its connection ended: the call answers, and "
        "resuming from its last event the reader gets a gap"
    )


#: What one SSE stream whose client does not read may hold in the bridge beyond the
#: connection itself (docs/API.md, "Memory, worst case"): three writes of bridge.sse.CHUNK.
STREAM_HOLDS = 3 * 64 * 1024
#: What the bridge may allocate meanwhile besides (requests, the handlers, the allocator).
SLACK = 8 * 1024 * 1024
BIG_EVENT = 2 * 1024 * 1024
LOG_BYTES = 16 * 1024 * 1024
STALLED = 20


async def next_seq(http: aiohttp.ClientSession, base: str, session_id: str) -> int:
    status, listing = await json_request(http, "GET", f"{base}/v1/sessions")
    assert status == 200, listing
    return next(s["nextSeq"] for s in listing["sessions"] if s["sessionId"] == session_id)


def big_events(write_script: Any, count: int) -> dict[str, Any]:
    steps = [{"bigLine": BIG_EVENT}] * count
    script = write_script({"methods": {"x/big": {"steps": steps, "result": {}}}})
    return {"options": {"env": {"FAKE_CODEX_SCRIPT": script}}}


async def test_readers_that_never_read_hold_what_one_write_holds(
    bridge_process, http, report, write_script
):
    """Twenty SSE clients that never read open on a session holding 16 MiB of 2 MiB events"""
    env = {"REST_ADAPTER_EVENT_BUFFER_BYTES": str(LOG_BYTES)}
    served = bridge_process(env=env)
    status, created = await json_request(
        http, "POST", f"{served.base}/v1/sessions", big_events(write_script, 10)
    )
    assert status == 201, created
    path = f"/v1/sessions/{created['sessionId']}"
    called = await json_request(http, "POST", f"{served.base}{path}/call/x/big", {"params": {}})
    assert called[0] == 200, called
    last = await next_seq(http, served.base, created["sessionId"]) - 1
    before = reset_peak_resident(served.pid)
    port = int(served.base.rsplit(":", 1)[1])
    async with stalled_readers(port, f"{path}/events/stream?after=0", STALLED):
        # Each stream wrote what it could before the bridge answered this.
        assert (await json_request(http, "GET", f"{served.base}/health"))[0] == 200
        grown = (peak_resident_kib(served.pid) - before) * 1024
    # Before, each stream copied the whole log into its connection's buffer: 16 MiB each.
    assert grown < STALLED * STREAM_HOLDS + SLACK, grown
    assert await next_seq(http, served.base, created["sessionId"]) == last + 1
    report.figures.update({"streams": STALLED, "grown MiB": round(grown / 2**20, 1)})
    report.survived = True
    report.outcome = "each stream holds about one write in the bridge, not the log it is behind"


async def test_readers_that_never_read_during_a_flood_are_ended(
    bridge_process, http, report, write_script
):
    """Twenty SSE clients that never read, attached while a session floods 2 MiB events"""
    env = {
        "REST_ADAPTER_EVENT_BUFFER_BYTES": str(LOG_BYTES),
        "REST_ADAPTER_READER_STALL_MS": "1000",
    }
    served = bridge_process(env=env)
    status, created = await json_request(
        http, "POST", f"{served.base}/v1/sessions", big_events(write_script, 20)
    )
    assert status == 201, created
    path = f"/v1/sessions/{created['sessionId']}"
    body = {"params": {}, "timeoutMs": 120_000}
    # A first flood, read by nobody, fills the log to its bound; what a second one costs
    # the bridge while nobody reads is the measure of a third, with the streams open.
    called = await json_request(http, "POST", f"{served.base}{path}/call/x/big", body)
    assert called[0] == 200, called
    before = reset_peak_resident(served.pid)
    called = await json_request(http, "POST", f"{served.base}{path}/call/x/big", body)
    assert called[0] == 200, called
    flood_alone = (peak_resident_kib(served.pid) - before) * 1024
    last = await next_seq(http, served.base, created["sessionId"]) - 1
    before = reset_peak_resident(served.pid)
    port = int(served.base.rsplit(":", 1)[1])
    stream = f"{path}/events/stream?after={last}"
    async with stalled_readers(port, stream, STALLED) as socks:
        # They hold the app-server back until they are cut loose; then it reads on.
        status, answer = await json_request(http, "POST", f"{served.base}{path}/call/x/big", body)
        assert status == 200, answer
        grown = (peak_resident_kib(served.pid) - before) * 1024 - flood_alone
        # And each was ended, what it held let go, rather than left open.
        for sock in socks:
            assert b"event: exit\n" not in await read_to_the_end(sock, timeout=30)
    assert grown < STALLED * STREAM_HOLDS + SLACK, (grown, flood_alone)
    assert "stopped reading" in served.output
    report.figures.update({"streams": STALLED, "grown MiB": round(grown / 2**20, 1)})
    report.survived = True
    report.outcome = "cut loose after READER_STALL_MS and their connections ended; the call answers"
