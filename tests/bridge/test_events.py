import asyncio

import orjson
import pytest

from bridge.events import EventLog

pytestmark = pytest.mark.quick


def test_seq_starts_at_one_and_never_skips():
    log = EventLog(10)
    for i in range(5):
        log.append("notification", f"m{i}", {"i": i})
    assert [e.seq for e in log.read(0, 100)] == [1, 2, 3, 4, 5]
    assert log.next_seq == 6


def test_read_after_returns_only_newer_events_up_to_limit():
    log = EventLog(10)
    for i in range(6):
        log.append("notification", "m", i)
    assert [e.seq for e in log.read(2, 3)] == [3, 4, 5]
    assert log.read(6, 3) == []


def test_reader_behind_retention_gets_one_gap_then_the_rest():
    log = EventLog(3)
    for i in range(7):
        log.append("notification", "m", i)
    batch = log.read(1, 10)
    gap = batch[0]
    assert gap.kind == "gap"
    assert gap.params == {"dropped": 3, "fromSeq": 2, "toSeq": 4}
    assert gap.seq == 4
    assert [e.seq for e in batch[1:]] == [5, 6, 7]


def test_gap_counts_against_the_limit():
    log = EventLog(2)
    for i in range(5):
        log.append("notification", "m", i)
    batch = log.read(0, 1)
    assert [e.kind for e in batch] == ["gap"]
    assert [e.seq for e in log.read(batch[0].seq, 10)] == [4, 5]


def test_exit_closes_the_log():
    log = EventLog(5)
    log.append("notification", "m", None)
    log.close({"exitCode": 0, "signal": None, "stderrTail": ""})
    assert log.closed
    assert log.append("notification", "late", None) is None
    assert [e.kind for e in log.read(0, 10)] == ["notification", "exit"]


def test_event_json_is_the_event_record():
    log = EventLog(5)
    event = log.append("request", "item/tool/call", {"a": 1}, request_key="7")
    assert event is not None
    wire = orjson.loads(event.json())
    assert wire["seq"] == 1
    assert wire["kind"] == "request"
    assert wire["method"] == "item/tool/call"
    assert wire["params"] == {"a": 1}
    assert wire["requestKey"] == "7"
    assert wire["receivedAt"].endswith("Z")


def test_memory_is_bounded_by_capacity():
    log = EventLog(100)
    for i in range(10_000):
        log.append("notification", "m", i)
    assert len(log) == 100


@pytest.mark.asyncio
async def test_wait_returns_when_an_event_arrives():
    log = EventLog(5)
    waiter = asyncio.create_task(log.wait(0, 30))
    await asyncio.sleep(0)  # sync-ok: let the waiter block first
    assert not waiter.done()
    log.append("notification", "m", None)
    await asyncio.wait_for(waiter, 5)
    assert [e.seq for e in log.read(0, 5)] == [1]


@pytest.mark.asyncio
async def test_wait_times_out_without_events():
    log = EventLog(5)
    await log.wait(0, 0.01)
    assert log.read(0, 5) == []


def test_the_byte_bound_drops_the_oldest_and_keeps_the_newest():
    log = EventLog(100, max_bytes=1000)
    for _ in range(10):
        log.append("notification", "m", "x" * 200)
    assert log.retained_bytes <= 1000
    assert 1 <= len(log) < 10
    gap = log.read(0, 1)[0]
    assert gap.kind == "gap"
    assert gap.params["toSeq"] == 10 - len(log)
    huge = log.append("notification", "m", "y" * 5000)
    assert huge is not None
    assert [e.seq for e in log.read(10, 5)] == [11]  # alone, over the bound, but kept


def test_a_frozen_event_holds_only_its_json():
    log = EventLog(5, max_bytes=10_000)
    event = log.append("notification", "m", {"n": 123456789012345678901234567890})
    assert event is not None
    assert event.params == {"n": 123456789012345678901234567890}
    assert event.size == len(event.json())
    assert b"123456789012345678901234567890" in event.json()


def test_an_attached_reader_holds_the_producer_back_until_it_moves_or_is_cut_loose():
    log = EventLog(4, max_bytes=10_000)
    reader = log.attach(0)
    moved: list[int] = []
    log.on_progress = lambda: moved.append(reader.position)
    for _ in range(3):
        assert not log.must_wait(10)
        log.append("notification", "m", None)
    assert not log.must_wait(10)
    log.append("notification", "m", None)
    assert log.must_wait(10)  # a fifth event would drop one the reader lacks
    reader.advance(2)
    assert moved == [2]
    assert not log.must_wait(10)
    assert log.must_wait(20_000)  # the byte bound counts too
    assert log.cut_loose(stalled_since=reader.progress_at) == 1
    assert not log.must_wait(20_000)
    reader.advance(log.next_seq - 1)  # caught up: held for again
    assert not reader.loose
    reader.detach()
    assert log.readers == 0
