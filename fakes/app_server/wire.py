"""JSON-RPC framing on stdio, as `codex app-server` does it.

One compact JSON object per line, no `"jsonrpc"` field. Key order follows the real
server's output (`{"error", "id"}` for errors, `{"method", "id", "params"}` for server
requests), and notifications carry the real top-level `emittedAtMs`.
"""

from __future__ import annotations

import asyncio
import os
import random
import select
import selectors
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, BinaryIO

import orjson

Message = dict[str, Any]
RequestId = int | str

_READ_CHUNK = 1 << 18


# Seeded runs must not depend on the clock, so their time counts up from here
# (2026-01-01T00:00:00Z) instead, by a few seeded milliseconds per reading.
SEEDED_EPOCH_MS = 1_767_225_600_000


class _VirtualClock:
    """Time for seeded runs: a pure function of the seed and the number of readings."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(f"clock:{seed}")
        self._ms = SEEDED_EPOCH_MS

    def __call__(self) -> int:
        self._ms += self._rng.choice((0, 0, 1, 1, 2, 3, 5, 8))
        return self._ms

    def advance(self, ms: int) -> None:
        self._ms += ms


_virtual_clock: _VirtualClock | None = None


def use_virtual_clock(seed: int | None) -> None:
    """With a seed, every timestamp the fake sends comes from a seeded virtual clock."""
    global _virtual_clock
    _virtual_clock = None if seed is None else _VirtualClock(seed)


def advance_clock(ms: int) -> None:
    """Let `ms` pass on the virtual clock (real time passes by itself)."""
    if _virtual_clock is not None:
        _virtual_clock.advance(ms)


def now_ms() -> int:
    """The time in epoch milliseconds, the unit of `*AtMs` fields (virtual when seeded)."""
    if _virtual_clock is not None:
        return _virtual_clock()
    return time.time_ns() // 1_000_000


def now_s() -> int:
    """The time in epoch seconds, the unit of `createdAt`, `startedAt`, ..."""
    return now_ms() // 1000


def encode(message: Message) -> bytes:
    """One protocol line, newline included."""
    return orjson.dumps(message) + b"\n"


def response(request_id: RequestId, result: Any) -> Message:
    """A success response."""
    return {"id": request_id, "result": result}


def error_response(request_id: RequestId, error: Message) -> Message:
    """An error response; `error` is `{"code", "message", "data"?}`."""
    return {"error": error, "id": request_id}


def rpc_error(code: int, message: str) -> Message:
    """The error object the real server sends: no `data` key at all."""
    return {"code": code, "message": message}


def notification(method: str, params: Any) -> Message:
    """A server notification, stamped like the real server's."""
    return {"method": method, "params": params, "emittedAtMs": now_ms()}


def server_request(request_id: RequestId, method: str, params: Any) -> Message:
    """A request from the server to the client."""
    return {"method": method, "id": request_id, "params": params}


def write_all(fd: int, data: bytes) -> None:
    """Blocking write of all of `data` to `fd`."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            # `fd` shares its pipe with stdout (`2>&1`), which asyncio made
            # non-blocking: wait for room, as a blocking write would.
            select.select([], [fd], [])


def log(text: str) -> None:
    """A human log line on stderr (never parsed by clients)."""
    write_all(2, f"fake-codex: {text}\n".encode())


def _pollable(fd: int, events: int) -> bool:
    """Whether asyncio can watch `fd`.

    Pipes, sockets and ttys can be watched; regular files and /dev/null cannot (epoll
    refuses them), but reading or writing those never blocks anyway.
    """
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(fd, events)
    except (OSError, ValueError):
        return False
    return True


class _WritePipeProtocol(asyncio.Protocol):
    """Flow control for the stdout pipe: writers wait while the reader lags."""

    def __init__(self, on_lost: Callable[[], None]) -> None:
        self._resumed: asyncio.Future[None] | None = None
        self._lost = asyncio.get_running_loop().create_future()
        self._on_lost = on_lost

    def pause_writing(self) -> None:
        self._resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.resume_writing()
        if not self._lost.done():
            self._lost.set_result(None)
        self._on_lost()

    async def wait_writable(self) -> None:
        if self._resumed is not None:
            await self._resumed

    async def wait_closed(self) -> None:
        await self._lost


WIRE_LOG_ENV = "FAKE_CODEX_WIRE_LOG"


def _open_wire_log() -> BinaryIO | None:
    """With ``$FAKE_CODEX_WIRE_LOG=DIR``, every byte written to stdout is also appended
    to ``DIR/fake-codex-<pid>.out``, whole: tests check each line against the real
    JSON Schema.
    """
    directory = os.environ.get(WIRE_LOG_ENV)
    if not directory:
        return None
    return open(os.path.join(directory, f"fake-codex-{os.getpid()}.out"), "ab", buffering=0)


class Output:
    """Stdout as a line sink.

    On a pipe, writes are buffered by asyncio and `drain()` applies backpressure, so a
    client that stops reading stalls the fake instead of growing its memory. On a
    regular file or /dev/null, writes are plain and immediate.
    """

    def __init__(
        self,
        fd: int,
        transport: asyncio.WriteTransport | None,
        protocol: _WritePipeProtocol | None,
    ) -> None:
        self._fd = fd
        self._transport = transport
        self._protocol = protocol
        self._tee = _open_wire_log()

    @classmethod
    async def open(cls, fd: int, on_lost: Callable[[], None]) -> Output:
        """Wrap `fd`; `on_lost` runs if the reader goes away."""
        if not _pollable(fd, selectors.EVENT_WRITE):
            return cls(fd, None, None)
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(fd, "wb", buffering=0, closefd=False)
        transport, protocol = await loop.connect_write_pipe(
            lambda: _WritePipeProtocol(on_lost), pipe
        )
        return cls(fd, transport, protocol)

    def send(self, message: Message) -> None:
        """Queue one message as one line."""
        self.write(encode(message))

    def write(self, data: bytes) -> None:
        """Queue raw bytes (whole lines, or a deliberate partial one)."""
        if self._tee is not None:
            self._tee.write(data)
        if self._transport is None:
            write_all(self._fd, data)
        elif not self._transport.is_closing():
            self._transport.write(data)

    async def drain(self) -> None:
        """Wait until the client has read enough of what is queued."""
        if self._protocol is not None:
            await self._protocol.wait_writable()

    async def close(self) -> None:
        """Flush everything queued, then close; used before exiting."""
        if self._transport is None or self._protocol is None:
            return
        if not self._transport.is_closing():
            self._transport.close()
        await self._protocol.wait_closed()


async def read_lines(fd: int) -> AsyncIterator[bytes]:
    """Yield the lines of `fd` without their newline, however long; end at EOF."""
    read = await _chunk_reader(fd)
    pending = bytearray()
    while chunk := await read():
        # Look for newlines only in the new chunk: rescanning `pending` would make a
        # many-megabyte line quadratic.
        first = chunk.find(b"\n")
        if first < 0:
            pending += chunk
            continue
        pending += chunk[:first]
        yield bytes(pending)
        pending.clear()
        *complete, rest = chunk[first + 1 :].split(b"\n")
        for line in complete:
            yield line
        pending += rest
    if pending:
        yield bytes(pending)


async def _chunk_reader(fd: int) -> Callable[[], Awaitable[bytes]]:
    """A coroutine function returning the next chunk of `fd` (b"" at EOF)."""
    if not _pollable(fd, selectors.EVENT_READ):

        async def read_file() -> bytes:
            return os.read(fd, _READ_CHUNK)

        return read_file
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_READ_CHUNK, loop=loop)
    pipe = os.fdopen(fd, "rb", buffering=0, closefd=False)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)

    async def read_pipe() -> bytes:
        return await reader.read(_READ_CHUNK)

    return read_pipe
