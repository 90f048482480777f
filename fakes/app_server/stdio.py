"""Stdio for the asyncio server: stdout as a flow-controlled line sink, stdin as lines."""

from __future__ import annotations

import asyncio
import os
import selectors
from collections.abc import AsyncIterator, Awaitable, Callable

from fakes.app_server.wire import READ_CHUNK, Message, encode, open_wire_log, write_all


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
        self._tee = open_wire_log()

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


async def read_lines(fd: int, unread: bytes = b"") -> AsyncIterator[bytes]:
    """Yield the lines of `fd` without their newline, however long; end at EOF.

    ``unread``: bytes already read from `fd` by someone else, which come first.
    """
    read = await _chunk_reader(fd)
    pending = bytearray()
    chunk = unread
    while chunk or (chunk := await read()):
        # Look for newlines only in the new chunk: rescanning `pending` would make a
        # many-megabyte line quadratic.
        first = chunk.find(b"\n")
        if first < 0:
            pending += chunk
        else:
            pending += chunk[:first]
            yield bytes(pending)
            pending.clear()
            *complete, rest = chunk[first + 1 :].split(b"\n")
            for line in complete:
                yield line
            pending += rest
        chunk = b""
    if pending:
        yield bytes(pending)


async def _chunk_reader(fd: int) -> Callable[[], Awaitable[bytes]]:
    """A coroutine function returning the next chunk of `fd` (b"" at EOF)."""
    if not _pollable(fd, selectors.EVENT_READ):

        async def read_file() -> bytes:
            return os.read(fd, READ_CHUNK)

        return read_file
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ_CHUNK, loop=loop)
    pipe = os.fdopen(fd, "rb", buffering=0, closefd=False)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)

    async def read_pipe() -> bytes:
        return await reader.read(READ_CHUNK)

    return read_pipe
