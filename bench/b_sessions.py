"""3. Sessions: 200 created concurrently (spawn + initialize), then deleted.

Baseline: the same 200 fake-codex processes spawned and initialized directly by an
asyncio client, then stopped by closing their stdin.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import time
from typing import Any

import orjson

from bench.common import (
    Bridge,
    Section,
    children_cpu,
    client_process,
    fake_argv,
    fake_env,
    http_json,
    log,
    thread_count,
)
from bench.pipe import INITIALIZE

COUNT = 200
TARGET_OVERHEAD = 0.10
TARGET_KB_PER_SESSION = 100
SEQUENTIAL = 5
#: The bridge's stop: SIGTERM when the process has not exited this long after its stdin
#: closed (a quarter of SHUTDOWN_GRACE_MS, at most 0.5 s).
STOP_GRACE = 0.5
LIMITS = {"max_sessions": COUNT + 16, "spawn_timeout_ms": 120_000}


async def _spawn_one(env: dict[str, str], start: float) -> tuple[float, asyncio.subprocess.Process]:
    """Spawn and initialize one fake; the time since ``start`` (the batch's start)."""
    proc = await asyncio.create_subprocess_exec(
        *fake_argv(),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(orjson.dumps({"id": 1, "method": "initialize", "params": INITIALIZE}) + b"\n")
    line = await proc.stdout.readline()
    if b'"result"' not in line:
        raise RuntimeError(f"initialize failed: {line[:200]!r}")
    proc.stdin.write(b'{"method":"initialized"}\n')
    return time.perf_counter() - start, proc


async def _stop_one(proc: asyncio.subprocess.Process) -> float:
    """Stop it as the bridge does: close stdin, SIGTERM the group after 0.5 s, then wait."""
    start = time.perf_counter()
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        async with asyncio.timeout(STOP_GRACE):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        await proc.wait()
    return time.perf_counter() - start


async def direct(count: int) -> dict[str, Any]:
    """``count`` fakes spawned at once, each timed from the start of the batch, as the
    bridge's client times each of its concurrent requests from when it sent them all."""
    env = fake_env(script=False)
    children = children_cpu()
    start = time.perf_counter()
    async with asyncio.timeout(120):
        spawned = await asyncio.gather(*(_spawn_one(env, start) for _ in range(count)))
    create_wall = time.perf_counter() - start
    start = time.perf_counter()
    async with asyncio.timeout(60):
        stopped = await asyncio.gather(*(_stop_one(proc) for _, proc in spawned))
    return {
        "create": [t for t, _ in spawned],
        "create_wall": create_wall,
        "delete": stopped,
        "delete_wall": time.perf_counter() - start,
        # Each fake's whole life (start, initialize, exit), once they are all reaped.
        "fake_cpu": (children_cpu() - children) / count,
    }


async def direct_sequential(count: int) -> list[float]:
    """One fake at a time: spawn + initialize, timed, then stopped."""
    env = fake_env(script=False)
    out = []
    for _ in range(count):
        elapsed, proc = await _spawn_one(env, time.perf_counter())
        out.append(elapsed)
        await _stop_one(proc)
    return out


def bridge_sequential(bridge: Bridge, count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        status, body = http_json(bridge.port, "POST", "/v1/sessions", {})
        out.append(time.perf_counter() - start)
        if status != 201:
            raise RuntimeError(f"create: {status} {body}")
        bridge.delete_session(body["sessionId"])
    return out


def run(repeats: int, options: dict[str, Any]) -> Section:
    section = Section("sessions", f"3. Sessions: {COUNT} created concurrently, then deleted")
    log("sessions: direct spawn + initialize and through the bridge, interleaved")
    asyncio.run(direct(8))  # warm-up: page cache, bytecode
    pipe: list[dict[str, Any]] = []
    pipe_one: list[float] = []
    runs: list[dict[str, Any]] = []
    one: list[float] = []
    with Bridge(LIMITS, loop=options.get("loop"), script=False) as bridge:
        bridge_sequential(bridge, 3)  # warm-up: imports and allocations of a first session
        for _ in range(repeats):
            pipe.append(asyncio.run(direct(COUNT)))
            pipe_one.append(statistics.median(asyncio.run(direct_sequential(SEQUENTIAL))))
            rss_before = bridge.rss()
            threads_before = thread_count(bridge.pid)
            cpu_before = bridge.cpu()
            with client_process(["sessions", str(bridge.port), str(COUNT)], timeout=180) as client:
                created = client.read()
                time.sleep(0.5)
                rss_live = bridge.rss()
                threads_live = thread_count(bridge.pid)
                client.send("delete")
                deleted = client.read()
                bridge_cpu = (bridge.cpu() - cpu_before) / COUNT
            if created["created"] != COUNT or deleted["deleted"] != COUNT:
                failures = created.get("failures")
                raise RuntimeError(f"sessions: {created['created']} created {failures}")
            runs.append(
                {
                    "create": created["latencies"],
                    "create_wall": created["wall"],
                    "delete": deleted["latencies"],
                    "delete_wall": deleted["wall"],
                    "kb_per_session": (rss_live - rss_before) / 1024 / COUNT,
                    "threads": threads_live - threads_before,
                    "rss_after": bridge.rss(),
                    "bridge_cpu": bridge_cpu,
                }
            )
            one.append(statistics.median(bridge_sequential(bridge, SEQUENTIAL)))

    def med(runs: list[dict[str, Any]], key: str) -> list[float]:
        return [statistics.median(r[key]) * 1000 for r in runs]

    def wall(runs: list[dict[str, Any]], key: str) -> list[float]:
        return [r[key] * 1000 for r in runs]

    create, create_base = med(runs, "create"), med(pipe, "create")
    overhead = statistics.median(create) / statistics.median(create_base) - 1
    section.add(
        f"create {COUNT} at once: per-session latency, median",
        "ms",
        create,
        baseline=create_base,
        baseline_name="direct spawn",
        target=f"< {TARGET_OVERHEAD:.0%} over a bare spawn + initialize ({overhead:+.1%})",
        met=overhead < TARGET_OVERHEAD,
    )
    section.add(
        f"create {COUNT} at once: wall clock until all are live",
        "ms",
        wall(runs, "create_wall"),
        baseline=wall(pipe, "create_wall"),
        baseline_name="direct spawn",
    )
    section.add(
        "create one at a time: latency, median",
        "ms",
        [t * 1000 for t in one],
        baseline=[t * 1000 for t in pipe_one],
        baseline_name="direct spawn",
        note=f"{SEQUENTIAL} sequential creates per repeat, each deleted before the next",
    )
    section.add(
        f"delete {COUNT} at once: per-session latency, median",
        "ms",
        med(runs, "delete"),
        baseline=med(pipe, "delete"),
        baseline_name="direct stop",
    )
    section.add(
        f"delete {COUNT} at once: wall clock",
        "ms",
        wall(runs, "delete_wall"),
        baseline=wall(pipe, "delete_wall"),
        baseline_name="direct stop",
    )
    section.add(
        "bridge CPU per session (create + delete) vs fake-codex CPU per life",
        "ms",
        [r["bridge_cpu"] * 1000 for r in runs],
        baseline=[r["fake_cpu"] * 1000 for r in pipe],
        baseline_name="fake-codex",
        note="what the bridge adds in CPU, whatever the load: the ratio is its overhead over"
        " a bare spawn + initialize + exit",
    )
    per_session = [r["kb_per_session"] for r in runs]
    section.add(
        "bridge RSS per live session (child process aside)",
        "KiB",
        per_session,
        target=f"< {TARGET_KB_PER_SESSION} KB",
        met=statistics.median(per_session) * 1.024 < TARGET_KB_PER_SESSION,
    )
    threads = statistics.median(r["threads"] for r in runs) / COUNT
    section.notes.append(
        f"Bridge threads per live session: {threads:.2f}. RSS after the last delete:"
        f" {runs[-1]['rss_after'] / 2**20:.1f} MiB. fake-codex runs without a script here (its"
        " fast start: no pydantic, no YAML)."
    )
    section.notes.append(
        f"Clients: the {COUNT} creates and deletes come from an asyncio raw-socket client in its"
        " own process, one connection each, all sent at once and each timed from then; the"
        " baseline spawns from the driver with asyncio, each timed from the batch's start,"
        " and stops each process as the bridge does (close stdin; SIGTERM to its group if it"
        " has not exited 0.5 s later)."
    )
    return section
