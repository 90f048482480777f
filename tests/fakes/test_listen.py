"""fake-codex `--listen unix://PATH` and `--listen ws://IP:PORT`: one process, each
WebSocket connection a session of its own, framed as the real codex frames it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio

FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
WAIT = 30.0
CLIENT_INFO = {"name": "listen", "title": "Listen", "version": "1.0.0"}

SCRIPT = """
version: 1
methods:
  test/leave: {steps: [{exit: 3}]}
  test/crash: {steps: [{exit: {signal: KILL}}]}
  test/die: {steps: [{exit: {code: 4, server: true}}]}
  test/raw: {steps: [{raw: "not json"}, {respond: {result: {ok: true}}}]}
"""


class Server:
    """A listening fake-codex process and where it listens."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, link: Path | None) -> None:
        self.proc = proc
        self.url = url
        self.link = link

    def session(self, **kwargs: Any) -> aiohttp.ClientSession:
        if self.link is not None:
            # Through the link's target: a socket address holds at most 107 bytes, and
            # pytest's temporary paths can be longer.
            target = os.readlink(self.link)
            connector = aiohttp.UnixConnector(path=target)
            return aiohttp.ClientSession(connector=connector, **kwargs)
        return aiohttp.ClientSession(**kwargs)

    async def connect(self, session: aiohttp.ClientSession, **kwargs: Any) -> Client:
        ws = await session.ws_connect(self.url, **kwargs)
        return Client(ws)

    async def wait(self) -> int:
        return await asyncio.wait_for(self.proc.wait(), WAIT)


class Client:
    """One connection: JSON-RPC requests over text frames, everything received kept."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.received: list[dict[str, Any]] = []
        self._next_id = 0

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(message))

    async def next_message(self) -> dict[str, Any]:
        frame = await asyncio.wait_for(self.ws.receive(), WAIT)
        assert frame.type == aiohttp.WSMsgType.TEXT, frame
        message: dict[str, Any] = json.loads(frame.data)
        self.received.append(message)
        return message

    async def wait_for(self, method: str) -> dict[str, Any]:
        while True:
            message = await self.next_message()
            if message.get("method") == method:
                return message

    async def request(self, method: str, params: Any = None) -> dict[str, Any]:
        self._next_id += 1
        request_id = self._next_id
        await self.send({"id": request_id, "method": method, "params": params or {}})
        while True:
            message = await self.next_message()
            if message.get("id") == request_id and "method" not in message:
                return message

    async def open(self) -> None:
        assert "result" in await self.request("initialize", {"clientInfo": CLIENT_INFO})
        await self.send({"method": "initialized"})

    async def end(self) -> aiohttp.WSMessage:
        """The frame that ends the connection (close, or closed without one)."""
        while True:
            frame = await asyncio.wait_for(self.ws.receive(), WAIT)
            if frame.type != aiohttp.WSMsgType.TEXT:
                return frame


@pytest_asyncio.fixture
async def start(tmp_path: Path) -> AsyncIterator[Any]:
    procs: list[asyncio.subprocess.Process] = []
    script = tmp_path / "script.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODEX_", "FAKE_CODEX"))}
    env["CODEX_HOME"] = str(tmp_path / "home")

    async def starter(listen: str, *args: str, script_text: str = SCRIPT) -> Server:
        script.write_text(script_text)
        command = [FAKE_CODEX, "app-server", "--listen", listen, *args, "--script", str(script)]
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        procs.append(proc)
        if listen.startswith("ws://"):
            assert proc.stderr is not None
            while line := await asyncio.wait_for(proc.stderr.readline(), WAIT):
                found = re.search(rb"listening on: (ws://\S+)", line)
                if found:
                    return Server(proc, found.group(1).decode(), None)
            raise AssertionError(f"no banner; exit {await proc.wait()}")
        path = listen.removeprefix("unix://")
        home = Path(env["CODEX_HOME"])
        link = Path(path) if path else home / "app-server-control" / "app-server-control.sock"
        await _until(lambda: _listening(link) or proc.returncode is not None)
        assert proc.returncode is None, await proc.stderr.read() if proc.stderr else b""
        return Server(proc, "http://localhost/", link)

    yield starter
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def _until(condition: Any) -> None:
    """Wait for `condition()`, a filesystem fact: nothing announces a unix socket (the
    real codex prints nothing either), so it is polled."""
    async with asyncio.timeout(WAIT):
        while not condition():  # noqa: ASYNC110 (a condition without an event)
            await asyncio.sleep(0.01)  # sync-ok: polled, see above


def _listening(link: Path) -> bool:
    """Whether a server accepts connections on the socket `link` points to."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(os.readlink(link))
        except OSError:
            return False
    return True


def _gone(path: Path) -> bool:
    return not path.exists() and not path.is_symlink()


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


async def _conversation(client: Client) -> str:
    await client.open()
    started = await client.request("thread/start", {})
    thread_id = started["result"]["thread"]["id"]
    reply = await client.request(
        "turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": "hi"}]}
    )
    assert reply["result"]["turn"]["status"] == "inProgress"
    completed = await client.wait_for("turn/completed")
    assert completed["params"]["turn"]["status"] == "completed"
    texts = [
        m["params"]["item"].get("text")
        for m in client.received
        if m.get("method") == "item/completed" and m["params"]["item"]["type"] == "agentMessage"
    ]
    assert texts == ["Hello from fake-codex. You said: hi"]
    return str(thread_id)


async def test_a_conversation_over_a_unix_socket(start: Any, tmp_path: Path) -> None:
    server = await start(f"unix://{tmp_path / 'app.sock'}")
    target = Path(os.readlink(server.link))
    assert _mode(target) == 0o600
    assert _mode(target.parent) == 0o700
    assert target.name == hashlib.sha256(str(server.link).encode()).hexdigest()
    # The upgrade reply's headers, as aiohttp's request tracing hands them over.
    replies: list[aiohttp.ClientResponse] = []

    async def on_request_end(_: Any, __: Any, params: aiohttp.TraceRequestEndParams) -> None:
        replies.append(params.response)

    tracing = aiohttp.TraceConfig()
    tracing.on_request_end.append(on_request_end)
    async with server.session(trace_configs=[tracing]) as session:
        ws = await session.ws_connect(server.url)
        [upgrade] = replies
        assert upgrade.status == 101
        assert upgrade.headers["x-codex-websocket-max-unfragmented-message-bytes"] == str(
            16 * 1024 * 1024
        )
        await _conversation(Client(ws))
        await ws.close()


async def test_unix_without_a_path_listens_under_codex_home(start: Any, tmp_path: Path) -> None:
    server = await start("unix://")
    assert server.link == tmp_path / "home" / "app-server-control" / "app-server-control.sock"
    async with server.session() as session:
        await _conversation(await server.connect(session))


async def test_a_conversation_over_ws(start: Any) -> None:
    server = await start("ws://127.0.0.1:0")
    async with server.session() as session:
        await _conversation(await server.connect(session))
        base = server.url.replace("ws://", "http://")
        for path in ("/readyz", "/healthz"):
            async with session.get(base + path) as response:
                assert response.status == 200
        async with session.get(base + "/") as response:
            assert response.status == 400
        async with session.post(base + "/") as response:
            assert response.status == 405
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(server.url, headers={"Origin": "http://elsewhere.example"})
        assert refused.value.status == 403


async def test_connections_have_their_own_handshake_and_share_the_threads(
    start: Any, tmp_path: Path
) -> None:
    """As codex 0.169.0: each connection initializes on its own, but the threads are the
    process's. Another connection's thread can be resumed and turned; its turn's news
    reaches every connection subscribed to it, and every thread's `thread/started` and
    `thread/status/changed` reach every connection."""
    server = await start(f"unix://{tmp_path / 'app.sock'}")
    async with server.session() as session:
        first, second = await server.connect(session), await server.connect(session)
        thread_id = await _conversation(first)
        # Initialized on the first connection only: the second is not.
        refused = await second.request("thread/start", {})
        assert refused["error"] == {"code": -32600, "message": "Not initialized"}
        await second.open()
        read = await second.request("thread/read", {"threadId": thread_id})
        assert read["result"]["thread"]["id"] == thread_id
        resumed = await second.request("thread/resume", {"threadId": thread_id})
        assert resumed["result"]["thread"]["id"] == thread_id
        reply = await second.request(
            "turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": "x"}]}
        )
        turn_id = reply["result"]["turn"]["id"]
        await second.wait_for("turn/completed")
        # The first started the thread, so it hears the second's turn on it.
        heard = await first.wait_for("turn/completed")
        assert (heard["params"]["threadId"], heard["params"]["turn"]["id"]) == (thread_id, turn_id)
        own = await second.request("thread/start", {})
        own_id = own["result"]["thread"]["id"]
        assert own_id != thread_id
        announced = await first.wait_for("thread/started")
        assert announced["params"]["thread"]["id"] == own_id
        again = await first.request("initialize", {"clientInfo": CLIENT_INFO})
        assert again["error"]["message"] == "Already initialized"


async def test_ws_auth_refuses_an_upgrade_without_the_token(start: Any, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    server = await start(
        "ws://127.0.0.1:0", "--ws-auth", "capability-token", "--ws-token-file", str(token_file)
    )
    async with server.session() as session:
        for headers, body in (
            ({}, "missing websocket bearer token"),
            ({"Authorization": "Bearer wrong"}, "invalid websocket bearer token"),
            ({"Authorization": "Basic s3cret"}, "invalid authorization header"),
        ):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(server.url, headers=headers)
            assert refused.value.status == 401
            upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", **headers}
            upgrade |= {
                "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                "Sec-WebSocket-Version": "13",
            }
            async with session.get(server.url.replace("ws://", "http://"), headers=upgrade) as r:
                assert (r.status, await r.text()) == (401, body)
        client = await server.connect(session, headers={"Authorization": "Bearer s3cret"})
        await _conversation(client)


async def test_an_exit_step_closes_its_connection_only(start: Any, tmp_path: Path) -> None:
    server = await start(f"unix://{tmp_path / 'app.sock'}")
    async with server.session() as session:
        leaving, crashing, staying = [await server.connect(session) for _ in range(3)]
        for client in (leaving, crashing):
            await client.open()
        await leaving.send({"id": 9, "method": "test/leave", "params": {}})
        closed = await leaving.end()
        assert (closed.type, closed.data, closed.extra) == (aiohttp.WSMsgType.CLOSE, 1011, "exit 3")
        await crashing.send({"id": 9, "method": "test/crash", "params": {}})
        dropped = await crashing.end()
        # Dropped without a close frame, as when a process dies.
        assert dropped.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR)
        assert crashing.ws.close_code == 1006
        await _conversation(staying)
        assert server.proc.returncode is None


async def test_an_exit_step_with_server_ends_the_process(start: Any, tmp_path: Path) -> None:
    server = await start(f"unix://{tmp_path / 'app.sock'}")
    async with server.session() as session:
        dying, other = await server.connect(session), await server.connect(session)
        await dying.open()
        await other.open()
        await dying.send({"id": 9, "method": "test/die", "params": {}})
        assert await server.wait() == 4
        for client in (dying, other):
            assert (await client.end()).type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR)
    assert _gone(server.link)


async def test_sigterm_stops_the_server_and_removes_the_socket(start: Any, tmp_path: Path) -> None:
    server = await start(f"unix://{tmp_path / 'app.sock'}")
    target = Path(os.readlink(server.link))
    server.proc.send_signal(signal.SIGTERM)
    assert await server.wait() == 0
    assert _gone(server.link)
    assert _gone(target)


async def test_a_stale_link_is_replaced_and_a_live_one_refused(start: Any, tmp_path: Path) -> None:
    link = tmp_path / "app.sock"
    first = await start(f"unix://{link}")
    first.proc.kill()
    await first.wait()
    assert not _gone(link)  # a killed server leaves its socket behind
    second = await start(f"unix://{link}")
    async with second.session() as session:
        await _conversation(await second.connect(session))
    third = await start(f"unix://{link}")
    assert await third.wait() == 1
    assert second.proc.returncode is None
    async with second.session() as session:
        await _conversation(await second.connect(session))


async def test_bad_frames_are_ignored_like_the_real_server(start: Any, tmp_path: Path) -> None:
    server = await start(f"unix://{tmp_path / 'app.sock'}")
    async with server.session() as session:
        client = await server.connect(session)
        await client.open()
        two = json.dumps({"id": 50, "method": "model/list", "params": {}})
        await client.ws.send_str(f"{two}\n{two}")  # two messages in one frame: neither
        await client.ws.send_str("not json")
        await client.ws.send_str("")
        await client.ws.send_bytes(
            json.dumps({"id": 51, "method": "model/list", "params": {}}).encode()
        )
        # 201 objects and arrays inside each other: more than the fake reads.
        deep = "[" * 199 + "]" * 199
        await client.ws.send_str(f'{{"id": 52, "method": "model/list", "params": {{"a": {deep}}}}}')
        listed = await client.request("model/list")
        assert "result" in listed
        assert not any(m.get("id") in (50, 51, 52) for m in client.received)
        # A `raw` step's line is a frame of its own, whatever it holds.
        await client.send({"id": 60, "method": "test/raw", "params": {}})
        frame = await asyncio.wait_for(client.ws.receive(), WAIT)
        assert frame.data == "not json"
        assert (await client.next_message())["result"] == {"ok": True}


async def test_a_client_vanishing_mid_message_ends_only_its_session(
    start: Any, tmp_path: Path
) -> None:
    server = await start(f"unix://{tmp_path / 'app.sock'}")
    reader, writer = await asyncio.open_unix_connection(os.readlink(server.link))
    writer.write(
        b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    assert b" 101 " in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    writer.write(bytes([0x81, 0x80 | 100, 1, 2, 3, 4]) + b"x" * 10)  # 10 of 100 bytes
    await writer.drain()
    writer.close()
    async with server.session() as session:
        await _conversation(await server.connect(session))
    assert server.proc.returncode is None


async def test_a_plain_request_on_the_socket_is_closed_unanswered(
    start: Any, tmp_path: Path
) -> None:
    server = await start(f"unix://{tmp_path / 'app.sock'}")
    reader, writer = await asyncio.open_unix_connection(os.readlink(server.link))
    writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await asyncio.wait_for(reader.read(), WAIT) == b""
    writer.close()


async def test_under_a_seed_connection_0_plays_like_a_stdio_process(
    start: Any, tmp_path: Path
) -> None:
    server = await start(f"unix://{tmp_path / 'app.sock'}", script_text="version: 1\nseed: 7\n")
    async with server.session() as session:
        ids = []
        for _ in range(2):
            client = await server.connect(session)
            await client.open()
            ids.append((await client.request("thread/start", {}))["result"]["thread"]["id"])
    assert ids[0] != ids[1]
    stdio = await asyncio.create_subprocess_exec(
        FAKE_CODEX,
        "app-server",
        "--script",
        str(tmp_path / "script.yaml"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    lines = [
        {"id": 1, "method": "initialize", "params": {"clientInfo": CLIENT_INFO}},
        {"method": "initialized"},
        {"id": 2, "method": "thread/start", "params": {}},
    ]
    out, _ = await asyncio.wait_for(
        stdio.communicate("".join(json.dumps(m) + "\n" for m in lines).encode()), WAIT
    )
    replies = [json.loads(line) for line in out.splitlines()]
    assert next(m for m in replies if m.get("id") == 2)["result"]["thread"]["id"] == ids[0]


async def test_connections_that_come_and_go_leave_no_task_behind(
    start: Any, tmp_path: Path
) -> None:
    """Every connection's writer task is owned, and ended with it: asyncio reports a task
    collected while still pending ("Task was destroyed but it is pending!") on stderr."""
    server = await start(f"unix://{tmp_path / 'app.sock'}")
    async with server.session() as session:
        for round_ in range(30):
            client = await server.connect(session)
            await client.open()
            await client.request("thread/start", {})
            if round_ % 2 == 0:
                await client.send({"id": 99, "method": "test/leave", "params": {}})
                await client.end()
            else:
                await client.ws.close()
        for _ in range(10):
            # Connections dropped mid-frame, without a close frame.
            reader, writer = await asyncio.open_unix_connection(os.readlink(server.link))
            writer.write(
                b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            assert b" 101 " in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
            writer.write(bytes([0x81, 0x80 | 100, 1, 2, 3, 4]) + b"x" * 10)
            await writer.drain()
            writer.close()
            await writer.wait_closed()
    server.proc.send_signal(signal.SIGTERM)
    assert await server.wait() == 0
    assert server.proc.stderr is not None
    stderr = (await server.proc.stderr.read()).decode(errors="replace")
    assert "Task was destroyed" not in stderr, stderr
    assert "Traceback" not in stderr, stderr
