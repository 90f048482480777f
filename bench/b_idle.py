"""4. Idle connections: 1,000 SSE streams and 1,000 long-polls held open on 10 sessions.

The bridge's CPU and RSS over a quiet window are compared with the same bridge and
sessions with no connection open; then one call's latency is measured meanwhile.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench import wrk
from bench.common import Bridge, Section, client_process, log

STREAMS = 1000
POLLS = 1000
SESSIONS = 10
WINDOW = 3.0
LATENCY_SECONDS = 2
# Long-polls wait up to 10 minutes: they stay open for the whole measurement.
LIMITS = {"max_wait_ms": 600_000}


def quiet_cpu(bridge: Bridge) -> float:
    start = bridge.cpu()
    time.sleep(WINDOW)
    return (bridge.cpu() - start) / WINDOW


def run(repeats: int, options: dict[str, Any]) -> Section:
    section = Section("idle", f"4. Idle connections: {STREAMS:,} SSE + {POLLS:,} long-polls")
    runs: list[dict[str, float]] = []
    log("idle: opening and holding connections")
    with Bridge(LIMITS, loop=options.get("loop")) as bridge:
        sessions = [bridge.create_session() for _ in range(SESSIONS)]
        url = f"{bridge.base}/v1/sessions/{sessions[0]}/call/bench/ping"
        lua = wrk.lua_post({"params": {}})
        wrk.run(url, connections=1, seconds=1, lua=lua)  # warm-up
        # Memory freed when connections close stays with the process: every repeat is
        # compared with the RSS before the first connection was ever opened.
        rss_initial = bridge.rss()
        for _ in range(repeats):
            run: dict[str, float] = {}
            run["cpu_none"] = quiet_cpu(bridge)
            run["rss_none"] = rss_initial
            result, _ = wrk.run(url, connections=1, seconds=LATENCY_SECONDS, lua=lua)
            run["p50_none"], run["p99_none"] = result.p50_us, result.p99_us
            args = ["idle", str(bridge.port), str(STREAMS), str(POLLS), *sessions]
            with client_process(args) as client:
                started = time.monotonic()
                ready = client.read()
                if not ready.get("ready"):
                    raise RuntimeError(f"idle client: {ready}")
                run["open_seconds"] = time.monotonic() - started
                time.sleep(0.5)
                run["rss_open"] = bridge.rss()
                run["cpu_open"] = quiet_cpu(bridge)
                result, _ = wrk.run(url, connections=1, seconds=LATENCY_SECONDS, lua=lua)
                run["p50_open"], run["p99_open"] = result.p50_us, result.p99_us
                client.send("close")
                client.read()
            runs.append(run)
            time.sleep(0.5)

    def values(key: str, scale: float = 1.0) -> list[float]:
        return [r[key] * scale for r in runs]

    cpu_open = statistics.median(values("cpu_open"))
    section.add(
        "bridge CPU while idle (share of one core)",
        "%",
        values("cpu_open", 100),
        baseline=values("cpu_none", 100),
        baseline_name="no connections",
        target=f"no measurable CPU (< 1 tick in {WINDOW:.0f} s)",
        met=cpu_open * WINDOW < 1.5 / 100,
    )
    section.add(
        "bridge RSS",
        "MiB",
        values("rss_open", 1 / 2**20),
        baseline=values("rss_none", 1 / 2**20),
        baseline_name="before any connection",
    )
    per_connection = [(r["rss_open"] - r["rss_none"]) / (STREAMS + POLLS) / 1024 for r in runs]
    section.add("bridge RSS per open connection", "KiB", per_connection)
    section.add(
        "one call meanwhile: latency p50",
        "µs",
        values("p50_open"),
        baseline=values("p50_none"),
        baseline_name="no connections",
    )
    section.add(
        "one call meanwhile: latency p99",
        "µs",
        values("p99_open"),
        baseline=values("p99_none"),
        baseline_name="no connections",
    )
    section.notes.append(
        f"CPU is read from /proc/<pid>/stat over a {WINDOW:.0f} s window (10 ms ticks)"
        f" starting 0.5 s after the last connection opened; opening all {STREAMS + POLLS:,} took"
        f" {statistics.median(values('open_seconds')):.1f} s. SSE keep-alives"
        " (every 15 s) are the only timed work; long-polls wait with MAX_WAIT_MS=600000."
        " Connections are held by one raw-socket Python client in its own process; latency by"
        " wrk, 1 connection."
    )
    return section
