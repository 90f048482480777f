"""2. Events: fake-codex writes 100,000 notifications as fast as the pipe takes them.

SSE: one reader on a bridge with the default ``EVENT_BUFFER`` (4096); the same session
is flooded ``repeats + 2`` times so the bridge's resident memory can be compared after
100,000 and after several hundred thousand events.

Long-poll: one reader taking one event per request from the session's cursor. It is
far slower than the flood, so this bridge keeps every event
(``REST_ADAPTER_EVENT_BUFFER=131072``); otherwise it would get a ``gap``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

from bench import profile
from bench.common import Bridge, CpuMeter, Section, client_process, log
from bench.pipe import Pipe

COUNT = 100_000
TARGET_RATE = 150_000
EXTRA_FLOODS = 2
LONG_POLL_BUFFER = 131_072
#: One event per request makes a long-poll drain 30-100 times slower than SSE: two runs,
#: each on a fresh session and cut off after LONG_POLL_SECONDS, keep `make bench` within
#: its time on a busy machine. A run cut off reports the drain time its rate projects.
LONG_POLL_RUNS = 2
LONG_POLL_SECONDS = 25
#: A reader that stops reading for STALL_PAUSE seconds against READER_STALL_MS: it is
#: cut loose, the flood's call answers, and the reader is told what it missed by a gap.
STALL_MS = 1000
STALL_PAUSE = 3.0


def flood_through(bridge: Bridge, session: str, client: str, pause: float = 0.0) -> dict[str, Any]:
    """Flood once with one reader attached; the reader's report plus timings.

    ``pause``: the SSE reader stops reading that long first (a stalled reader).
    """
    after = bridge.next_seq(session) - 1
    target = after + COUNT
    args = [client, str(bridge.port), session]
    if client == "sse":
        args += [str(after), str(target), str(pause)]
    else:
        args += [str(target), str(LONG_POLL_SECONDS)]
    with client_process(args) as reader:
        ready = reader.read()
        if not ready.get("ready"):
            raise RuntimeError(f"{client} reader: {ready}")
        time.sleep(0.2)  # the long-poll is waiting, the stream is attached
        meter = CpuMeter({"bridge": bridge.pid})
        start = time.monotonic()
        bridge.call(session, "bench/flood")
        replied = time.monotonic() - start
        report = reader.read()
        cpu = meter.shares()["bridge"]
    if "error" in report:
        raise RuntimeError(f"{client} reader: {report['error']}")
    report["seconds"] = report["done_at"] - start
    report["replied"] = replied
    report["bridge_cpu"] = cpu
    report["complete"] = report["last_seq"] >= target
    report["rate"] = report["events"] / report["seconds"]
    # A long-poll reader cut off by its time box: the time all would have taken at its rate.
    report["drain"] = report["seconds"] if report["complete"] else COUNT / report["rate"]
    return report


def run(repeats: int, options: dict[str, Any]) -> Section:
    section = Section("events", f"2. Events: {COUNT:,} notifications")
    loops: list[str] = options["loops"]
    log(f"events: pipe baseline and SSE ({', '.join(loops)}), interleaved")
    pipe_times: list[float] = []
    sse: dict[str, list[dict[str, Any]]] = {loop: [] for loop in loops}
    rss: dict[str, list[int]] = {loop: [] for loop in loops}
    with contextlib.ExitStack() as stack:
        pipe = stack.enter_context(Pipe())
        pipe.initialize()
        pipe.flood(COUNT)
        bridges = {loop: stack.enter_context(Bridge(loop=loop)) for loop in loops}
        sessions = {loop: bridge.create_session() for loop, bridge in bridges.items()}
        for loop, bridge in bridges.items():
            flood_through(bridge, sessions[loop], "sse")  # warm-up
            rss[loop].append(bridge.rss())
        for index in range(repeats + EXTRA_FLOODS):
            if index < repeats:
                pipe_times.append(pipe.flood(COUNT))
            for loop, bridge in bridges.items():
                handle = None
                if index == repeats and loop == loops[0] and options.get("profile", True):
                    handle = profile.start(bridge.pid, 2)
                report = flood_through(bridge, sessions[loop], "sse")
                if handle is not None:
                    section.profile = profile.finish(handle)
                rss[loop].append(bridge.rss())
                if index < repeats:
                    sse[loop].append(report)

    log("events: a reader that stops reading")
    stall_ms = STALL_MS
    with Bridge({"reader_stall_ms": stall_ms}, loop=loops[0]) as bridge:
        session = bridge.create_session()
        stalled = flood_through(bridge, session, "sse", pause=STALL_PAUSE)

    log("events: long-poll")
    polls: list[dict[str, Any]] = []
    with Bridge({"event_buffer": LONG_POLL_BUFFER}, loop=loops[0]) as bridge:
        rss_before_poll = bridge.rss()
        rss_poll = 0
        for _ in range(min(repeats, LONG_POLL_RUNS)):
            session = bridge.create_session()
            polls.append(flood_through(bridge, session, "longpoll"))
            # The first session's growth: a deleted session's log stays readable a while.
            rss_poll = rss_poll or bridge.rss() - rss_before_poll
            bridge.delete_session(session)

    for loop in loops:
        runs = sse[loop]
        suffix = f" ({loop})"
        section.add(
            "SSE: time until the reader has all" + suffix,
            "ms",
            [r["seconds"] * 1000 for r in runs],
            baseline=[t * 1000 for t in pipe_times],
        )
        rates = [COUNT / r["seconds"] for r in runs]
        section.add(
            "SSE: delivery rate to one reader" + suffix,
            "events/s",
            rates,
            baseline=[COUNT / t for t in pipe_times],
            target=f"≥ {TARGET_RATE:,} events/s",
            met=statistics.median(rates) >= TARGET_RATE,
        )
        gaps = sum(r["gaps"] for r in runs)
        incomplete = sum(1 for r in runs if not r["complete"])
        section.add(
            "SSE: events lost by a reader that keeps reading (gap events)" + suffix,
            "events",
            [float(r["gaps"]) for r in runs],
            target="0, no reader cut off",
            met=gaps == 0 and incomplete == 0,
        )
        if loop == loops[0]:
            section.add(
                f"SSE: a reader that stops reading for {STALL_PAUSE:g} s: the flood's call "
                f"answers after (READER_STALL_MS {stall_ms})" + suffix,
                "ms",
                [stalled["replied"] * 1000],
                target=f"≈ READER_STALL_MS, then a gap ({stalled['gaps']} received)",
                met=stalled["gaps"] >= 1 and stalled["complete"],
            )
        total = COUNT * (repeats + EXTRA_FLOODS + 1)
        growth = (rss[loop][-1] - rss[loop][1]) / 1024
        section.add(
            f"SSE: bridge RSS growth from {2 * COUNT:,} to {total:,} events" + suffix,
            "KiB",
            [growth],
            target="flat (≤ 1 MiB)",
            met=growth <= 1024,
            note="RSS after the warm-up flood and after each flood: "
            + ", ".join(f"{r / 2**20:.1f}" for r in rss[loop])
            + " MiB",
        )
        share = statistics.median(r["bridge_cpu"] for r in runs)
        per_event = statistics.median(r["bridge_cpu"] * r["seconds"] for r in runs) / COUNT
        reader = statistics.median(r["client_cpu"] / r["seconds"] for r in runs)
        replied = statistics.median(r["replied"] for r in runs)
        section.notes.append(
            f"SSE, {loop}: bridge CPU while flooding {share:.2f} (1.00 = one core),"
            f" {per_event * 1e6:.1f} µs per event; reader CPU {reader:.2f}; the flood call"
            f" itself returned after {replied * 1000:.0f} ms (the bridge had read every line"
            " by then)."
        )
    projected = sum(1 for r in polls if not r["complete"])
    section.add(
        f"Long-poll: time until the reader has drained all ({loops[0]})",
        "ms",
        [r["drain"] * 1000 for r in polls],
        baseline=[t * 1000 for t in pipe_times],
        note=f"{projected} of {len(polls)} runs cut off after {LONG_POLL_SECONDS} s and"
        " projected from their rate"
        if projected
        else "",
    )
    section.add(
        f"Long-poll: events per second, one per request ({loops[0]})",
        "events/s",
        [r["rate"] for r in polls],
        baseline=[COUNT / t for t in pipe_times],
    )
    section.notes.append(
        f"Long-poll: bridge CPU {statistics.median(r['bridge_cpu'] for r in polls):.2f}, reader"
        f" CPU {statistics.median(r['client_cpu'] / r['seconds'] for r in polls):.2f} (one"
        " request at a time on one keep-alive connection). This bridge keeps every event"
        f" (EVENT_BUFFER={LONG_POLL_BUFFER}): its RSS grew by {rss_poll / 2**20:.0f} MiB with"
        f" {COUNT:,} events buffered. {len(polls)} run(s), each on a fresh session and cut off"
        f" after {LONG_POLL_SECONDS} s: a drain takes tens of seconds."
    )
    section.notes.append(
        "Readers: raw-socket Python clients in their own processes; the SSE reader counts frames"
        " with bytes.count, so it is never the bottleneck."
    )
    return section
