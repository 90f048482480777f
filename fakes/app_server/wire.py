"""JSON-RPC framing on stdio, as `codex app-server` does it: the messages and the clock.

Free of asyncio, so that the synchronous fast start (`fast.py`) can use it; the
asyncio side of stdio is `stdio.py`.

One compact JSON object per line, no `"jsonrpc"` field. Key order follows the real
server's output (`{"error", "id"}` for errors, `{"method", "id", "params"}` for server
requests), and notifications carry the real top-level `emittedAtMs`.
"""

from __future__ import annotations

import os
import random
import select
import time
from collections.abc import Iterable
from typing import Any, BinaryIO, Protocol

import orjson

Message = dict[str, Any]
RequestId = int | str


class Sink(Protocol):
    """Where the server's protocol lines go: stdout (`stdio.Output`) or a WebSocket
    connection (`listen.FrameOutput`)."""

    def send(self, message: Message) -> None: ...
    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    async def close(self) -> None: ...


READ_CHUNK = 1 << 18  # bytes per read of stdin


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


#: How many objects and arrays a client message may nest inside each other. A deeper one
#: is logged as undecodable and ignored, like a line that is not JSON: the real server
#: does that past 127 (its JSON reader's recursion limit); the fake reads further, so
#: that tests can send deep values through a bridge, but not so far that a reply
#: echoing the message (a thread's `model`, a turn's input) would be too deep to write.
MAX_MESSAGE_DEPTH = 200
TOO_DEEP = "Failed to deserialize JSONRPCMessage: recursion limit exceeded"


def too_deep(line: bytes, message: Any) -> bool:
    """Whether `message` (parsed from `line`) nests more than MAX_MESSAGE_DEPTH objects
    and arrays. The length, then a count of brackets, keep the walk off every ordinary
    message (so deep a line opens and closes more than MAX_MESSAGE_DEPTH of them)."""
    if (
        len(line) <= 2 * MAX_MESSAGE_DEPTH
        or line.count(b"{") + line.count(b"[") <= MAX_MESSAGE_DEPTH
    ):
        return False
    stack: list[tuple[Any, int]] = [(message, 1)]
    while stack:
        value, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_MESSAGE_DEPTH:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def request_id_of(message: Message) -> RequestId | None:
    """The message's id if it is a valid JSON-RPC id (string or integer)."""
    value = message.get("id")
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    return value


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


WIRE_LOG_ENV = "FAKE_CODEX_WIRE_LOG"


def open_wire_log(suffix: str = ".out") -> BinaryIO | None:
    """With ``$FAKE_CODEX_WIRE_LOG=DIR``, every byte written to stdout is also appended
    to ``DIR/fake-codex-<pid>.out``, whole, and every line read from stdin to
    ``DIR/fake-codex-<pid>.in`` (``suffix``): tests check each line against the real
    JSON Schema, each answer against the result type of the request it answers.
    """
    directory = os.environ.get(WIRE_LOG_ENV)
    if not directory:
        return None
    return open(os.path.join(directory, f"fake-codex-{os.getpid()}{suffix}"), "ab", buffering=0)
