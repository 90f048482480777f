"""Writing an SSE stream: its events framed, in bounded writes, each one awaited.

A client that does not read fills its connection's buffer, and what the bridge holds
for it is what it wrote there and has not sent. So no write carries more than
:data:`CHUNK` bytes: the frames of small events are joined up to that size, and an
event whose JSON is larger goes out as its head, slices of its JSON (views of the
bytes the log holds, not copies) and its tail. Each write is awaited, and the
connection's buffer has no high-water mark: once more than 64 KiB were written since
it last did, aiohttp's ``StreamResponse.write`` waits until that buffer has all gone
to the kernel. A stream whose client stops reading stops there, holding at most about
three writes (``3 * CHUNK``): what was written since the last wait, the write in hand
and the copy aiohttp makes of it. A stream cut loose (it stopped reading while the
app-server waited for it, :meth:`bridge.backend.EventStream.on_cut_loose`) has its
connection reset, which frees that too, in the kernel as well.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator, Sequence

from aiohttp import web

from bridge import errors
from bridge.backend import EventStream
from bridge.events import Event

#: Events read from the log at a time.
BATCH = 512
#: The most bytes one write carries (but for the head of one large event).
CHUNK = 64 * 1024
#: The comment an idle stream writes every ``SSE_KEEPALIVE_MS``.
KEEPALIVE = b": keep-alive\n\n"

_KINDS = ("notification", "request", "exit", "gap")
#: An event's whole frame, and the head of one written in slices.
_FRAME = {kind: b"id: %d\nevent: " + kind.encode() + b"\ndata: %s\n\n" for kind in _KINDS}
_HEAD = {kind: b"id: %d\nevent: " + kind.encode() + b"\ndata: " for kind in _KINDS}
_TAIL = b"\n\n"
#: The most a frame adds to its event's JSON (a 19-digit id, the longest kind).
_FRAMING = 64
#: SO_LINGER on, with no time: closing the socket resets the connection.
_RESET = struct.pack("ii", 1, 0)


def chunks(batch: Sequence[Event], size: int = CHUNK) -> Iterator[tuple[bytes | memoryview, int]]:
    """The frames of ``batch`` as writes of at most ``size`` bytes (one large event's head
    may add its few), each with the seq of the last event it ends (0 when it ends none:
    a slice of a large event)."""
    frame = _FRAME
    parts: list[bytes] = []
    append = parts.append
    held = 0
    last = 0
    for event in batch:
        data = event.json()
        held += len(data) + _FRAMING
        if held > size:
            if len(data) > size:
                append(_HEAD[event.kind] % event.seq)
            if parts:
                # The frames are let go before the write: only the joined copy is held.
                chunk = b"".join(parts)
                parts = []
                append = parts.append
                yield chunk, last
            held = len(data) + _FRAMING
            if len(data) > size:
                view = memoryview(data)
                for start in range(0, len(data), size):
                    yield view[start : start + size], 0
                append(_TAIL)
                held = len(_TAIL)
                last = event.seq
                continue
        append(frame[event.kind] % (event.seq, data))
        last = event.seq
    if parts:
        yield b"".join(parts), last


async def write_events(
    request: web.Request,
    response: web.StreamResponse,
    stream: EventStream,
    batch: Sequence[Event],
    keepalive: float,
) -> bool:
    """Write ``batch`` and every later event of ``stream`` to ``response``, reporting each
    one written (:meth:`EventStream.delivered`); a keep-alive comment after ``keepalive``
    seconds without one. True once the ``exit`` event is written; False when the client
    went away or the stream was cut loose (its connection is then ended)."""
    transport = request.transport
    ended = False

    def end() -> None:
        nonlocal ended
        ended = True
        if transport is not None:
            # Reset rather than closed: the kernel then drops what it still holds for
            # the client as well, instead of waiting for a reader that does not read.
            sock = transport.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            transport.abort()

    # A host's own stream written before the method existed has none: it is never cut loose.
    on_cut_loose = getattr(stream, "on_cut_loose", None)
    if on_cut_loose is not None:
        on_cut_loose(end)
    if transport is not None:
        # A wait for the buffer to drain is a wait for it to be empty: a client that
        # stops reading leaves a write or two here, not one beyond a 64 KiB mark.
        transport.set_write_buffer_limits(high=0)
    with contextlib.suppress(ConnectionError, errors.RestError):
        while True:
            if batch:
                for data, seq in chunks(batch):
                    await response.write(data)
                    if ended:
                        return False
                    if seq:
                        stream.delivered(seq)
                if batch[-1].kind == "exit":
                    return True
            else:
                await response.write(KEEPALIVE)
            batch = await stream.next_batch(keepalive, BATCH)
    return False
