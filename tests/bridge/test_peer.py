"""The JSON-RPC peer in-process: over a WebSocket channel to a server in the test.

The other end is an aiohttp WebSocket server on a unix socket in the same event loop
(real sockets, real frames), driven frame by frame by the test: what the peer does with
each message, its flow control and its ends are provable here without a child process.
The peer over a child's stdio is tests/bridge/test_rpc.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from bridge.process.peer import JsonRpcPeer, ProcessGone, RpcError
from bridge.process.tenancy import Tenant
from bridge.process.websocket import CLOSED_BY_BRIDGE, CLOSED_BY_SERVER, WebSocketChannel

pytestmark = pytest.mark.asyncio

WAIT = 10.0
MAX_FRAME = 64 * 1024
THREAD = "0b7c4f7e-5a0e-4c43-9f7e-4a1d6a8e0c11"
OTHER = "5f0e8d3a-2b7c-4d7e-8c6a-9e1f2a3b4c5d"


class Pair:
    """A peer, and the server end of its connection (``server``), frame by frame."""

    def __init__(self, peer: JsonRpcPeer, server: web.WebSocketResponse) -> None:
        self.peer = peer
        self.server = server

    async def receive(self) -> dict[str, Any]:
        message = await asyncio.wait_for(self.server.receive(), WAIT)
        assert message.type is aiohttp.WSMsgType.TEXT
        value: dict[str, Any] = orjson.loads(message.data)
        return value

    async def send(self, value: Any) -> None:
        await self.server.send_str(orjson.dumps(value).decode())


@pytest_asyncio.fixture
async def connect(tmp_path: Path) -> AsyncIterator[Any]:
    """``await connect(tenant=False)`` → a :class:`Pair`; everything is closed after."""
    accepted: asyncio.Queue[web.WebSocketResponse] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        accepted.put_nowait(ws)
        await done.wait()
        return ws

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    path = str(tmp_path / "app-server.sock")
    await web.UnixSite(runner, path).start()
    client = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path))
    pairs: list[Pair] = []

    async def open_pair(tenant: bool = False) -> Pair:
        ws = await client.ws_connect("http://localhost/", max_msg_size=MAX_FRAME, autoclose=False)
        channel = WebSocketChannel(ws, max_frame_bytes=MAX_FRAME)
        peer = JsonRpcPeer(channel, message_filter=Tenant() if tenant else None)
        pairs.append(Pair(peer, await asyncio.wait_for(accepted.get(), WAIT)))
        return pairs[-1]

    try:
        yield open_pair
    finally:
        for pair in pairs:
            # The server reads on to the peer's close frame, and answers it.
            closing = asyncio.create_task(pair.peer.shutdown(WAIT))
            while not pair.server.closed:
                await asyncio.wait_for(pair.server.receive(), WAIT)
            await closing
        done.set()
        await client.close()
        await runner.cleanup()


async def test_a_call_is_answered_by_its_id_and_errors_keep_code_message_and_data(connect):
    pair = await connect()
    first = asyncio.create_task(pair.peer.call("a", {"x": 1}, WAIT))
    second = asyncio.create_task(pair.peer.call("b", None, WAIT))
    asked = [await pair.receive(), await pair.receive()]
    assert asked == [{"id": 1, "method": "a", "params": {"x": 1}}, {"id": 2, "method": "b"}]
    # Answered out of order: each call gets its own answer.
    await pair.send({"id": 2, "error": {"code": -32000, "message": "no", "data": [1]}})
    await pair.send({"id": 1, "result": "yes"})
    assert await first == "yes"
    with pytest.raises(RpcError) as error:
        await second
    assert (error.value.code, error.value.message, error.value.data) == (-32000, "no", [1])


async def test_a_message_with_a_method_is_a_server_request_even_with_a_pending_id(connect):
    pair = await connect()
    requests: list[tuple[Any, str]] = []
    pair.peer.on_request = lambda i, m, p: requests.append((i, m))
    call = asyncio.create_task(pair.peer.call("go", None, WAIT))
    asked = await pair.receive()
    await pair.send({"id": asked["id"], "method": "item/tool/call", "params": {}})
    await pair.send({"id": asked["id"], "result": "answer"})
    assert await call == "answer"
    assert requests == [(1, "item/tool/call")]
    pair.peer.respond(1, {"ok": True})
    assert await pair.receive() == {"id": 1, "result": {"ok": True}}


async def test_a_result_hook_runs_before_the_next_message_is_dispatched(connect):
    """What a call's answer means (a thread now owned) is known before the notification
    that follows it in the stream is handled, not once the caller resumes."""
    pair = await connect()
    seen = Seen()
    pair.peer.on_notification = lambda m, p: seen.add(m)
    future = asyncio.create_task(
        pair.peer.request("thread/start", {}, WAIT, lambda result: seen.add("result"))
    )
    asked = await pair.receive()
    await pair.send({"id": asked["id"], "result": {"thread": {"id": THREAD}}})
    await pair.send({"method": "thread/started", "params": {}})
    await future
    await seen.reach(2)
    assert seen == ["result", "thread/started"]


async def test_the_flow_gate_holds_frames_back_in_order_and_resume_delivers_them(connect):
    pair = await connect()
    delivered = Seen()
    asked = Seen()
    holding = True

    def gate(size: int) -> bool:
        asked.add(size)
        return holding

    pair.peer.on_notification = lambda m, p: delivered.add(p)
    pair.peer.flow_gate = gate
    for n in range(5):
        await pair.send({"method": "n", "params": n})
    await asked.reach(1)
    assert pair.peer.paused
    assert delivered == []
    holding = False
    pair.peer.resume()
    await delivered.reach(5)
    assert delivered == [0, 1, 2, 3, 4]
    assert not pair.peer.paused


async def test_a_frame_that_is_not_json_ends_the_conversation_as_a_protocol_error(connect):
    pair = await connect()
    call = asyncio.create_task(pair.peer.call("go", None, WAIT))
    await pair.receive()
    await pair.server.send_str("this is not json")
    with pytest.raises(ProcessGone) as gone:
        await call
    info = gone.value.exit_info
    assert info.protocol_error == "the app-server wrote a line that is not JSON"
    assert info.connection == CLOSED_BY_BRIDGE
    assert not pair.peer.running
    with pytest.raises(ProcessGone):
        pair.peer.notify("late")


async def test_a_frame_over_the_limit_ends_the_conversation(connect):
    pair = await connect()
    call = asyncio.create_task(pair.peer.call("go", None, WAIT))
    await pair.receive()
    await pair.server.send_str('"' + "x" * (2 * MAX_FRAME) + '"')
    with pytest.raises(ProcessGone) as gone:
        await call
    assert "unreadable frame" in (gone.value.exit_info.protocol_error or "")


async def test_a_request_id_that_is_neither_string_nor_integer_is_a_protocol_error(connect):
    pair = await connect()
    await pair.send({"id": 1.5, "method": "item/tool/call", "params": {}})
    info = await asyncio.wait_for(pair.peer.wait(), WAIT)
    assert "neither a string nor an integer" in (info.protocol_error or "")


async def test_a_short_deadline_fires_first_and_a_late_answer_is_dropped(connect):
    pair = await connect()
    long = asyncio.create_task(pair.peer.call("slow", None, 600))
    await pair.receive()
    with pytest.raises(TimeoutError):
        await pair.peer.call("short", None, 0.05)
    late = await pair.receive()
    await pair.send({"id": late["id"], "result": "too late"})  # nobody waits: dropped
    assert not long.done()
    echo = asyncio.create_task(pair.peer.call("x", None, WAIT))
    await pair.send({"id": (await pair.receive())["id"], "result": 3})
    assert await echo == 3


async def test_a_cancelled_call_is_forgotten_at_once(connect):
    pair = await connect()
    call = asyncio.create_task(pair.peer.call("go", None, 600))
    asked = await pair.receive()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert pair.peer._pending == {}
    await pair.send({"id": asked["id"], "result": "nobody waits"})  # dropped
    echo = asyncio.create_task(pair.peer.call("x", None, WAIT))
    await pair.send({"id": (await pair.receive())["id"], "result": 3})
    assert await echo == 3


async def test_a_connection_the_server_closes_ends_every_waiting_call(connect):
    pair = await connect()
    call = asyncio.create_task(pair.peer.call("go", None, WAIT))
    await pair.receive()
    await pair.server.close()
    with pytest.raises(ProcessGone) as gone:
        await call
    assert gone.value.exit_info.connection == CLOSED_BY_SERVER
    assert gone.value.exit_info.exit_code == 0  # a normal closure, like a clean exit


async def test_shutdown_ends_the_conversation_once(connect):
    pair = await connect()
    ended: list[Any] = []
    pair.peer.exit_callbacks.append(ended.append)
    closing = asyncio.create_task(pair.peer.shutdown(WAIT))
    farewell = await asyncio.wait_for(pair.server.receive(), WAIT)
    assert farewell.type is aiohttp.WSMsgType.CLOSE
    info = await closing
    assert (info.exit_code, info.connection) == (0, CLOSED_BY_BRIDGE)
    assert await pair.peer.shutdown(1) is info
    assert ended == [info]


async def test_a_tenant_sees_only_its_threads_and_a_sub_agent_held_until_named(connect):
    pair = await connect(tenant=True)
    seen = Seen()
    pair.peer.on_notification = lambda m, p: seen.add((m, p))
    start = asyncio.create_task(pair.peer.call("thread/start", {}, WAIT))
    asked = await pair.receive()
    await pair.send({"id": asked["id"], "result": {"thread": {"id": THREAD}}})
    assert await start == {"thread": {"id": THREAD}}
    # Another connection's thread; then news of a sub-agent before its parent names it.
    await pair.send({"method": "thread/started", "params": {"thread": {"id": OTHER}}})
    await pair.send({"method": "thread/status/changed", "params": {"threadId": OTHER}})
    spawn = {
        "threadId": THREAD,
        "item": {
            "type": "collabAgentToolCall",
            "tool": "spawnAgent",
            "receiverThreadIds": [OTHER],
        },
    }
    await pair.send({"method": "item/started", "params": spawn})
    await seen.reach(2)
    assert seen == [("item/started", spawn), ("thread/status/changed", {"threadId": OTHER})]


async def test_a_tenant_call_on_a_thread_it_does_not_own_names_another_thread(connect):
    pair = await connect(tenant=True)
    call = asyncio.create_task(pair.peer.call("thread/read", {"threadId": OTHER}, WAIT))
    asked = await pair.receive()
    disguised = asked["params"]["threadId"]
    assert disguised != OTHER
    message = f"thread not found: {disguised}"
    await pair.send({"id": asked["id"], "error": {"code": -32600, "message": message}})
    with pytest.raises(RpcError) as error:
        await call
    assert error.value.message == f"thread not found: {OTHER}"


class Seen(list[Any]):
    """What a handler was given, and a way to wait until it holds ``n`` entries."""

    def __init__(self) -> None:
        super().__init__()
        self._grew = asyncio.Event()

    def add(self, entry: Any) -> None:
        self.append(entry)
        self._grew.set()

    async def reach(self, n: int) -> None:
        async with asyncio.timeout(WAIT):
            while len(self) < n:
                self._grew.clear()
                await self._grew.wait()
