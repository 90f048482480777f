"""How an SSE stream's events become writes: bounded in size, whatever the events' size,
and the same bytes as one frame per event."""

from __future__ import annotations

import pytest

from bridge import sse
from bridge.events import EventLog

pytestmark = pytest.mark.quick


def frame(seq: int, kind: str, data: bytes) -> bytes:
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (seq, kind.encode(), data)


def test_writes_are_bounded_and_carry_each_event_once_as_its_frame():
    log = EventLog(100, max_bytes=10_000_000)
    for size in (10, 3000, 50, 250_000, 1, 70_000, 20, 20, 65_536 - 80):
        log.append("notification", "m", {"text": "x" * size})
    log.append("request", "r", {"n": 1}, "k1")
    log.close({"exitCode": 0})
    batch = log.read(0, 100)
    writes = list(sse.chunks(batch, size=4096))
    expected = b"".join(frame(e.seq, e.kind, e.json()) for e in batch)
    assert b"".join(bytes(data) for data, _ in writes) == expected
    # No write carries more than the size (but for one frame's id and event lines):
    # never a large event whole.
    assert max(len(data) for data, _ in writes) <= 4096 + 64
    # Each write names the last event it ends, in order; a slice of a large event none.
    ended = [seq for _, seq in writes if seq]
    assert ended == sorted(ended)
    assert ended[-1] == batch[-1].seq
    written = b""
    for data, seq in writes:
        written += bytes(data)
        if seq:
            # Everything through that event is written, and nothing of a later one.
            through = b"".join(frame(e.seq, e.kind, e.json()) for e in batch if e.seq <= seq)
            assert written.startswith(through)
            assert len(written) - len(through) <= 4096 + 64  # at most the next one's head


def test_a_large_event_is_written_in_slices_of_its_own_bytes():
    log = EventLog(10, max_bytes=100_000_000)
    event = log.append("notification", "m", {"text": "y" * 5_000_000})
    assert event is not None
    writes = list(sse.chunks([event]))
    slices = [data for data, seq in writes if isinstance(data, memoryview)]
    assert len(slices) == -(-len(event.json()) // sse.CHUNK)
    # Views of the event's encoding, not copies of it.
    assert all(view.obj is event.json() for view in slices)
    assert writes[-1] == (b"\n\n", event.seq)


def test_a_reader_cut_loose_is_told():
    log = EventLog(2)
    told: list[str] = []
    reader = log.attach(0)
    reader.on_loose = lambda: told.append("loose")
    log.append("notification", "m", None)
    assert log.cut_loose(stalled_since=reader.progress_at) == 1
    assert told == ["loose"]
    assert log.cut_loose(stalled_since=reader.progress_at) == 0  # told once
    assert told == ["loose"]
