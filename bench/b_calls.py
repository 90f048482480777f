"""1. Raw session calls of ``bench/ping``, which fake-codex answers at once."""

from __future__ import annotations

import contextlib
import statistics
import subprocess
from typing import Any

from bench import profile, wrk
from bench.common import Bridge, CpuMeter, Section, child_pids, children_cpu, log, percentile
from bench.pipe import Pipe

METHOD = "bench/ping"
LATENCY_CALLS = 5000
THROUGHPUT_CALLS = 40000
WRK_SECONDS = 2
TARGET_RATE = 15_000
TARGET_ADDED_P50_US = 150


class BridgeRuns:
    """One bridge (one event loop) under wrk: its figures over the repeats."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        session = bridge.create_session()
        self.fake = child_pids(bridge.pid)[0]
        self.url = f"{bridge.base}/v1/sessions/{session}/call/{METHOD}"
        self.lua = wrk.lua_post({"params": {}})
        self.p50: list[float] = []
        self.p99: list[float] = []
        self.rate: dict[int, list[float]] = {16: [], 64: []}
        self.shares: list[dict[str, float]] = []
        self.errors = 0
        wrk.run(self.url, connections=16, seconds=1, lua=self.lua)  # warm-up

    def repeat(self) -> None:
        result, _ = wrk.run(self.url, connections=1, seconds=WRK_SECONDS, lua=self.lua)
        self.errors += result.errors + result.status_errors
        self.p50.append(result.p50_us)
        self.p99.append(result.p99_us)
        for in_flight in (16, 64):
            meter: list[CpuMeter] = []
            pids = {"bridge": self.bridge.pid, "fake-codex": self.fake}

            def sample(
                proc: subprocess.Popen[str],
                meter: list[CpuMeter] = meter,
                pids: dict[str, int] = pids,
            ) -> None:
                meter.append(CpuMeter(pids))

            before = children_cpu()
            result, _ = wrk.run(
                self.url, connections=in_flight, seconds=WRK_SECONDS, lua=self.lua, on_start=sample
            )
            self.errors += result.errors + result.status_errors
            self.rate[in_flight].append(result.rate)
            if in_flight == 64:
                share = meter[0].shares()
                share["wrk"] = (children_cpu() - before) / result.seconds
                share["calls/s"] = result.rate
                self.shares.append(share)

    def health(self) -> tuple[float, float]:
        """GET /health: (p50 µs at concurrency 1, requests/s at 64 in flight)."""
        url = f"{self.bridge.base}/health"
        one, _ = wrk.run(url, connections=1, seconds=WRK_SECONDS, lua=wrk.lua_get())
        many, _ = wrk.run(url, connections=64, seconds=WRK_SECONDS, lua=wrk.lua_get())
        return one.p50_us, many.rate

    def profile(self) -> str:
        handle = profile.start(self.bridge.pid, WRK_SECONDS)
        wrk.run(self.url, connections=64, seconds=WRK_SECONDS + 1, lua=self.lua)
        return profile.finish(handle)


def run(repeats: int, options: dict[str, Any]) -> Section:
    section = Section("calls", "1. Raw session calls")
    loops: list[str] = options["loops"]
    pipe_p50: list[float] = []
    pipe_p99: list[float] = []
    pipe_rate: dict[int, list[float]] = {16: [], 64: []}
    log(f"calls: pipe baseline and bridge ({', '.join(loops)}), interleaved")
    with contextlib.ExitStack() as stack:
        pipe = stack.enter_context(Pipe())
        pipe.initialize()
        pipe.latencies(METHOD, 500)
        pipe.throughput(METHOD, 64, 5000)
        runs = {loop: BridgeRuns(stack.enter_context(Bridge(loop=loop))) for loop in loops}
        for _ in range(repeats):
            latencies = sorted(pipe.latencies(METHOD, LATENCY_CALLS))
            pipe_p50.append(percentile(latencies, 50) * 1e6)
            pipe_p99.append(percentile(latencies, 99) * 1e6)
            for in_flight in (16, 64):
                pipe_rate[in_flight].append(pipe.throughput(METHOD, in_flight, THROUGHPUT_CALLS))
            for bridge_runs in runs.values():
                bridge_runs.repeat()
        health = {loop: r.health() for loop, r in runs.items()}
        if options.get("profile", True):
            log(f"calls: profiling the bridge ({loops[0]}) at 64 in flight")
            section.profile = runs[loops[0]].profile()

    for loop, r in runs.items():
        suffix = f" ({loop})"
        added = statistics.median(r.p50) - statistics.median(pipe_p50)
        section.add(
            "latency p50, concurrency 1" + suffix,
            "µs",
            r.p50,
            baseline=pipe_p50,
            target=f"≤ pipe + {TARGET_ADDED_P50_US} µs (added: {added:.0f} µs)",
            met=added <= TARGET_ADDED_P50_US,
        )
        section.add("latency p99, concurrency 1" + suffix, "µs", r.p99, baseline=pipe_p99)
        section.add("calls/s, 16 in flight" + suffix, "calls/s", r.rate[16], baseline=pipe_rate[16])
        section.add(
            "calls/s, 64 in flight" + suffix,
            "calls/s",
            r.rate[64],
            baseline=pipe_rate[64],
            target=f"≥ {TARGET_RATE:,}",
            met=statistics.median(r.rate[64]) >= TARGET_RATE,
        )
    for loop in runs:
        section.add(
            f"reference: GET /health, latency p50, concurrency 1 ({loop})",
            "µs",
            [health[loop][0]],
        )
        section.add(f"reference: GET /health, 64 in flight ({loop})", "req/s", [health[loop][1]])
    section.notes.append(
        "reference: GET /health is aiohttp answering with no work behind it (one run each):"
        " the floor of the HTTP stack's latency and the ceiling of its rate on this machine."
    )
    for loop, r in runs.items():
        names = [name for name in r.shares[0] if name != "calls/s"]
        cpu = {name: statistics.median(s[name] for s in r.shares) for name in names}
        per_call = statistics.median(s["fake-codex"] / s["calls/s"] * 1e6 for s in r.shares)
        section.notes.append(
            f"CPU at 64 in flight, {loop} (1.00 = one core): "
            + ", ".join(f"{name} {value:.2f}" for name, value in cpu.items())
            + f"; fake-codex spends {per_call:.0f} µs of CPU per call here."
            f" Errors or non-2xx: {r.errors}."
        )
    section.notes.append(
        f"wrk: 1 thread, 1, 16 or 64 connections, {WRK_SECONDS} s per run. The pipe baseline"
        " and each bridge run one after the other in every repeat."
    )
    return section
