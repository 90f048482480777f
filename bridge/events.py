"""A session's event log: ordered, bounded, and honest about what it dropped.

Every event gets a ``seq`` from 1 that never repeats or skips. The log keeps the
newest ``capacity`` events; a reader that asks for something older receives one
synthesized ``gap`` event that names the dropped range, then carries on. The
``exit`` event closes the log.

Each event is encoded to JSON once, when first read, and the bytes are shared by
every reader, so a thousand SSE readers cost one encoding per event.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import UTC, datetime
from typing import Any, Literal

from bridge.wire import dumps

EventKind = Literal["notification", "request", "exit", "gap"]


class _SecondText:
    """The last whole second formatted, and the last timestamp: events come in bursts."""

    second = -1
    text = ""
    last = -1.0
    last_text = ""


def rfc3339(epoch_seconds: float) -> str:
    """UTC timestamp with milliseconds, e.g. ``2026-11-21T23:44:45.123Z``.

    The same text as ``datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")``
    (microseconds rounded half-even, then cut to milliseconds), in a third of the time.
    """
    cache = _SecondText
    if epoch_seconds == cache.last:
        return cache.last_text
    fraction, whole = math.modf(epoch_seconds)
    micros = round(fraction * 1e6)
    second = int(whole)
    if micros >= 1_000_000:
        second, micros = second + 1, micros - 1_000_000
    elif micros < 0:
        second, micros = second - 1, micros + 1_000_000
    if second != cache.second:
        cache.text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        cache.second = second
    cache.last = epoch_seconds
    cache.last_text = f"{cache.text}.{micros // 1000:03d}Z"
    return cache.last_text


class Event:
    """One entry of a session's log (the Event response record)."""

    __slots__ = ("_json", "kind", "method", "params", "received_at", "request_key", "seq")

    def __init__(
        self,
        seq: int,
        kind: EventKind,
        method: str | None,
        params: Any,
        request_key: str | None = None,
        received_at: float | None = None,
    ) -> None:
        self.seq = seq
        self.kind = kind
        self.method = method
        self.params = params
        self.request_key = request_key
        self.received_at = time.time() if received_at is None else received_at
        self._json: bytes | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "kind": self.kind,
            "method": self.method,
            "params": self.params,
            "requestKey": self.request_key,
            "receivedAt": rfc3339(self.received_at),
        }

    def json(self) -> bytes:
        """The event's JSON encoding, computed once."""
        if self._json is None:
            encoded = dumps(self.to_wire())
            # Kept as a copy: orjson shrinks its ~4 KB output buffer in place, and the
            # freed tail of every event kept in the log would stay behind as a hole
            # (4.1 KB of resident memory per buffered event instead of 0.3 KB).
            self._json = bytes(memoryview(encoded))
        return self._json

    def __repr__(self) -> str:
        return f"Event(seq={self.seq}, kind={self.kind!r}, method={self.method!r})"


class EventLog:
    """Ordered, bounded log of one session's events, with waiting readers."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self._capacity = capacity
        # A list read by slicing, its dropped head skipped by an offset and cut off
        # every ``_compact_at`` drops: reading k events costs O(k) wherever they are
        # (a deque walks from its end to the reader's position on every read).
        self._events: list[Event] = []
        self._head = 0
        self._compact_at = max(32, capacity // 16)
        self._next_seq = 1
        self._closed = False
        self._changed: asyncio.Future[None] | None = None
        #: The last seq handed to a cursor reader (long-poll or SSE without a position).
        self.cursor = 0

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def closed(self) -> bool:
        """True once the ``exit`` event is in the log."""
        return self._closed

    def __len__(self) -> int:
        return len(self._events) - self._head

    def append(
        self,
        kind: EventKind,
        method: str | None,
        params: Any,
        request_key: str | None = None,
        received_at: float | None = None,
    ) -> Event | None:
        """Add an event; nothing is added after the log is closed."""
        if self._closed:
            return None
        event = Event(self._next_seq, kind, method, params, request_key, received_at)
        self._next_seq += 1
        self._events.append(event)
        if len(self._events) - self._head > self._capacity:
            self._head += 1
            if self._head >= self._compact_at:
                del self._events[: self._head]
                self._head = 0
        if kind == "exit":
            self._closed = True
        self._wake()
        return event

    def close(self, params: Any) -> Event | None:
        """Append the ``exit`` event that ends the log."""
        return self.append("exit", None, params)

    def read(self, after: int, limit: int) -> list[Event]:
        """Up to ``limit`` events with ``seq > after``, a ``gap`` first if some were dropped."""
        out: list[Event] = []
        events, head = self._events, self._head
        first = events[head].seq if head < len(events) else self._next_seq
        if after + 1 < first:
            out.append(
                Event(
                    first - 1,
                    "gap",
                    None,
                    {"dropped": first - 1 - after, "fromSeq": after + 1, "toSeq": first - 1},
                )
            )
            after = first - 1
        start = head + after + 1 - first
        wanted = limit - len(out)
        if wanted > 0 and start < len(events):
            out.extend(events[start : start + wanted])
        return out

    def has_after(self, after: int) -> bool:
        return after + 1 < self._next_seq

    async def wait(self, after: int, timeout: float) -> None:
        """Return when an event with ``seq > after`` exists, the log closes, or on timeout."""
        if self.has_after(after) or self._closed or timeout <= 0:
            return
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        # asyncio.wait neither cancels the shared future nor creates a task.
        await asyncio.wait((self._changed,), timeout=timeout)

    def _wake(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)
