"""A session's event log: ordered, bounded, and honest about what it dropped.

Every event gets a ``seq`` from 1 that never repeats or skips. The log keeps the newest
``capacity`` events; a reader that asks for older ones gets one ``gap`` event naming the
dropped range, then carries on. The ``exit`` event closes the log. Each event is encoded
to JSON once, its bytes shared by every reader (a thousand SSE readers, one encoding).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from bridge.models import EventKind
from bridge.wire import dumps, loads


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
    """One entry of a session's log (the Event response record). Kept in a bounded log,
    it is *frozen*: encoded at once, its parsed ``params`` dropped (the log holds exactly
    the bytes it counts)."""

    __slots__ = (
        "_json",
        "_params",
        "end",
        "kind",
        "method",
        "received_at",
        "request_key",
        "seq",
        "size",
    )

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
        self._params = params
        self.request_key = request_key
        self.received_at = time.time() if received_at is None else received_at
        self._json: bytes | None = None
        #: The size of the JSON encoding once frozen, and the log's running total through it.
        self.size = 0
        self.end = 0

    @property
    def params(self) -> Any:
        if self._params is _FROZEN:
            return loads(self.json())["params"]
        return self._params

    def to_wire(self) -> dict[str, Any]:
        if self._params is _FROZEN:
            wire: dict[str, Any] = loads(self.json())
            return wire
        return {
            "seq": self.seq,
            "kind": self.kind,
            "method": self.method,
            "params": self._params,
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

    def freeze(self) -> int:
        """Encode now and drop the parsed params; returns the encoding's size."""
        self.size = size = len(self.json())
        self._params = _FROZEN
        return size

    def __repr__(self) -> str:
        return f"Event(seq={self.seq}, kind={self.kind!r}, method={self.method!r})"


_FROZEN: Any = object()


class LogReader:
    """An attached reader of a log (an SSE stream): where it is, and when it last moved.
    While it is behind, the producer waits (:meth:`EventLog.must_wait`) unless it is cut
    *loose* (:meth:`EventLog.cut_loose`), and then owed a ``gap`` like any other; its
    ``on_loose`` is called then (the SSE stream ends its connection)."""

    __slots__ = ("_log", "loose", "on_loose", "position", "progress_at")

    def __init__(self, log: EventLog, position: int) -> None:
        self._log = log
        self.position = position
        self.progress_at = time.monotonic()
        self.loose = False
        self.on_loose: Callable[[], None] | None = None

    def advance(self, seq: int) -> None:
        """The reader has taken every event through ``seq``."""
        if seq <= self.position:
            return
        self.position = seq
        self.progress_at = time.monotonic()
        log = self._log
        if self.loose and seq >= log.next_seq - 1:
            self.loose = False
        log._update_lowest()
        if log.on_progress is not None:
            log.on_progress()

    def detach(self) -> None:
        self._log.detach(self)


class EventLog:
    """Ordered log of one session's events, with waiting readers, bounded by ``capacity``
    events and, if set, ``max_bytes`` of their JSON (the newest is kept, whatever its size)."""

    def __init__(self, capacity: int, max_bytes: int | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes must be positive")
        self._capacity = capacity
        self._max_bytes = max_bytes
        # A list read by slicing, its dropped head skipped by an offset and cut off
        # every ``_compact_at`` drops: reading k events costs O(k) wherever they are
        # (a deque walks from its end to the reader's position on every read).
        self._events: list[Event] = []
        self._head = 0
        self._compact_at = max(32, capacity // 16)
        self._next_seq = 1
        self._closed = False
        self._changed: asyncio.Future[None] | None = None
        #: Bytes of the retained events, and the running total through the last dropped one.
        self._bytes = 0
        self._total = 0
        self._dropped_end = 0
        self._readers: list[LogReader] = []
        #: The lowest position of the readers not cut loose (-1: none), kept up to date
        #: as they move, so that the producer's question per line costs O(1).
        self._lowest = -1
        #: Called when an attached reader moves on (the producer may be waiting for it).
        self.on_progress: Callable[[], None] | None = None
        #: The last seq handed to a cursor reader (long-poll without a position).
        self.cursor = 0

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def closed(self) -> bool:
        """True once the ``exit`` event is in the log."""
        return self._closed

    @property
    def retained_bytes(self) -> int:
        return self._bytes

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
        events = self._events
        events.append(event)
        max_bytes = self._max_bytes
        if max_bytes is not None:
            size = event.freeze()
            self._bytes += size
            self._total += size
            event.end = self._total
            if self._bytes > max_bytes or len(events) - self._head > self._capacity:
                self._trim()
        elif len(events) - self._head > self._capacity:
            self._trim()
        if kind == "exit":
            self._closed = True
        self._wake()
        return event

    def _trim(self) -> None:
        """Drop the oldest events until both bounds hold (the newest always stays)."""
        events, capacity, max_bytes = self._events, self._capacity, self._max_bytes
        head = self._head
        while len(events) - head > capacity or (
            max_bytes is not None and self._bytes > max_bytes and len(events) - head > 1
        ):
            dropped = events[head]
            self._bytes -= dropped.size
            self._dropped_end = dropped.end
            head += 1
        if head >= self._compact_at:
            del events[:head]
            head = 0
        self._head = head

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

    async def wait(self, after: int, timeout: float) -> None:
        """Return when an event with ``seq > after`` exists, the log closes, or on timeout."""
        if after + 1 < self._next_seq or self._closed or timeout <= 0:
            return
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        # asyncio.wait neither cancels the shared future nor creates a task.
        await asyncio.wait((self._changed,), timeout=timeout)

    def _wake(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)

    # -- attached readers and flow control ------------------------------------------

    def attach(self, position: int) -> LogReader:
        """A reader that will read from ``position`` on and report its progress."""
        reader = LogReader(self, position)
        self._readers.append(reader)
        self._update_lowest()
        return reader

    def detach(self, reader: LogReader) -> None:
        if reader in self._readers:
            self._readers.remove(reader)
            self._update_lowest()
            if self.on_progress is not None:
                self.on_progress()

    @property
    def readers(self) -> int:
        return len(self._readers)

    def _end_through(self, seq: int) -> int:
        """The running byte total through ``seq`` (through the last dropped event if older)."""
        events, head = self._events, self._head
        first = events[head].seq if head < len(events) else self._next_seq
        if seq < first:
            return self._dropped_end
        return events[head + seq - first].end

    def _update_lowest(self) -> None:
        positions = [r.position for r in self._readers if not r.loose]
        self._lowest = min(positions) if positions else -1

    def must_wait(self, incoming: int) -> bool:
        """Would one more event of about ``incoming`` bytes drop one an attached reader
        (not cut loose) lacks? Then the producer holds it back until a reader moves on."""
        lowest = self._lowest
        if lowest < 0:
            return False
        last = self._next_seq - 1
        unread = last - lowest
        if unread <= 0:
            return False
        if unread + 1 > self._capacity:
            return True
        if self._max_bytes is None:
            return False
        return self._total - self._end_through(lowest) + incoming > self._max_bytes

    def cut_loose(self, stalled_since: float) -> int:
        """Stop waiting for readers that are behind and have not moved since ``stalled_since``;
        how many."""
        last = self._next_seq - 1
        count = 0
        for reader in self._readers:
            if not reader.loose and reader.position < last and reader.progress_at <= stalled_since:
                reader.loose = True
                count += 1
                if reader.on_loose is not None:
                    reader.on_loose()
        self._update_lowest()
        return count

    def oldest_progress(self) -> float | None:
        """When the slowest attached reader that is behind last moved, or None."""
        last = self._next_seq - 1
        times = [r.progress_at for r in self._readers if not r.loose and r.position < last]
        return min(times) if times else None
