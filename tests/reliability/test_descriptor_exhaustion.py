"""`rest-bridge serve` out of file descriptors: a few log lines, a clean 502, and recovery.

The bridge runs with RLIMIT_NOFILE 100 (soft) / 200 (hard): it raises the soft limit
to 200 at start, which idle connections then exhaust. asyncio used to log a traceback
for every failed accept() (tens of thousands over 20 s, the retries multiplying every
second); now one line says it started and one per interval says how many failed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from bridge.descriptors import REPORT_SECONDS

THEME = "Misbehaving clients"
SOFT, HARD = 100, 200
#: Idle connections beyond the limit (288 in all at 200, as reported), fewer than the
#: listen backlog (128) holds, so that every connect() completes.
BEYOND = 88
SHORTAGE = "out of file descriptors"
#: Descriptors left free for the spawn that must fail.
LEFT = 3


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def soft_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as limits:
        for line in limits:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no descriptor limit in /proc")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def idle_connections(base: str, count: int) -> list[asyncio.StreamWriter]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    opened = []
    for _ in range(count):
        _, writer = await asyncio.open_connection(host, int(port))
        opened.append(writer)
    return opened


@pytest.mark.asyncio
@pytest.mark.parametrize("loop", ["default", "asyncio", "uvloop"])
async def test_descriptor_exhaustion_is_reported_not_flooded_and_survived(
    bridge_process, report, eventually, loop
):
    """288 idle connections against descriptor limits 100/200 (soft/hard)

    On the default loop, and on each loop by name."""
    extra_args = [] if loop == "default" else ["--loop", loop]
    served = bridge_process(nofile=(SOFT, HARD), extra_args=extra_args)
    pid = served.pid
    http = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=60),
        connector=aiohttp.TCPConnector(force_close=True, limit=0),
    )
    idle: list[asyncio.StreamWriter] = []
    try:
        async with http.post(served.base + "/v1/sessions", json={}) as response:
            assert response.status == 201, await response.text()
            witness = (await response.json())["sessionId"]

        # A few descriptors left: the request gets one, the app-server's pipes (eight
        # descriptors, two at a time) cannot all be had.
        limit = soft_limit(pid)
        idle += await idle_connections(served.base, limit - LEFT - descriptors(pid))
        # (less one if the connection of the request before was still closing)
        await eventually(lambda: descriptors(pid) >= limit - LEFT - 1, what="all but a few taken")
        async with http.post(served.base + "/v1/sessions", json={}) as response:
            spawn = (response.status, await response.json())
        assert spawn[0] == 502, spawn
        assert spawn[1] == {
            "error": "app_server_spawn_failed",
            "message": (
                "Could not start the app-server (Too many open files); "
                "the bridge is out of resources, retry later."
            ),
        }

        # The flood: every descriptor taken, the backlog full, accept() failing.
        before = len(served.output)
        idle += await idle_connections(served.base, limit + BEYOND - len(idle))
        await eventually(
            lambda: SHORTAGE in served.output[before:] or "Traceback" in served.output[before:],
            what="the shortage",
        )
        flooded_at = asyncio.get_running_loop().time()
        cpu = cpu_seconds(pid)
        assert "Traceback" not in served.output[before:], served.output[before:][:2000]
        # The second line comes an interval later, with the count of that interval.
        summary = f"{SHORTAGE}: "
        await eventually(
            lambda: served.output[before:].count(summary) >= 2,
            REPORT_SECONDS * 3,
            what="the interval's summary",
        )
        elapsed = asyncio.get_running_loop().time() - flooded_at
        flood_log = served.output[before:]
        lines = [line for line in flood_log.splitlines() if SHORTAGE in line]
        assert "Traceback" not in flood_log, flood_log[:2000]
        assert len(lines) <= 2 + int(elapsed / REPORT_SECONDS), lines
        assert f"limit {limit}" in lines[0], lines
        failures = int(lines[1].split(f"{SHORTAGE}: ", 1)[1].split()[0])
        cpu = cpu_seconds(pid) - cpu

        # Descriptors free again: new connections are served, the witness still answers.
        for writer in idle:
            writer.close()
        idle.clear()
        async with http.get(served.base + "/health") as response:
            assert response.status == 200
        path = f"/v1/sessions/{witness}/call/thread/start"
        async with http.post(served.base + path, json={"params": {}}) as response:
            assert response.status == 200, await response.text()
    finally:
        for writer in idle:
            writer.close()
        await http.close()
    assert "Traceback" not in served.output, served.output[-2000:]
    startup = served.output.split("rest-bridge: stopping")[0]
    assert f"file descriptors: soft limit {HARD} (raised from {SOFT}), hard limit {HARD}" in (
        startup
    )
    report.outcome = (
        f"502 app_server_spawn_failed at the limit; {len(lines)} log lines over "
        f"{elapsed:.0f} s of exhaustion, no traceback; served again once freed"
    )
    report.figures = {
        "limit": limit,
        "idleConnections": limit + BEYOND,
        "shortageLines": len(lines),
        "acceptFailuresInInterval": failures,
        "floodLogBytes": len(flood_log.encode()),
        "bridgeCpuSeconds": round(cpu, 2),
        "seconds": round(elapsed, 1),
    }
    report.survived = True
    report.nothing_lost = True
    served.signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.wait, 60) == 0
    report.no_leak = True


@pytest.mark.asyncio
@pytest.mark.parametrize("loop", ["default", "asyncio", "uvloop"])
async def test_a_connection_that_waits_for_a_descriptor_is_served_once_one_is_free(
    bridge_process, eventually, loop
):
    """Every descriptor taken and accept() failing: a request sent on a connection that
    waits in the backlog is answered once descriptors are free, on either loop (libuv's
    own accept loop closed such connections unanswered)."""
    extra_args = [] if loop == "default" else ["--loop", loop]
    served = bridge_process(nofile=(SOFT, HARD), extra_args=extra_args)
    pid = served.pid
    limit = soft_limit(pid)
    before = len(served.output)
    idle = await idle_connections(served.base, limit + 10 - descriptors(pid))
    host, port = served.base.removeprefix("http://").rsplit(":", 1)
    try:
        await eventually(lambda: SHORTAGE in served.output[before:], what="the shortage")
        reader, waiting = await asyncio.open_connection(host, int(port))
        idle.append(waiting)
        waiting.write(b"GET /health HTTP/1.1\r\nHost: bridge\r\nConnection: close\r\n\r\n")
        await waiting.drain()
        for writer in idle[:40]:  # accepted ones: their descriptors come free
            writer.close()
        answer = await asyncio.wait_for(reader.read(), 30)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    finally:
        for writer in idle:
            writer.close()
    served.signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.wait, 60) == 0
    assert "Traceback" not in served.output, served.output[-2000:]


ONE_PASS = """
import asyncio, os, resource, socket, sys
from bridge.descriptors import Acceptor, is_accept_shortage, listening_sockets
from bridge.runtime import event_loop_factory

async def main():
    [sock] = listening_sockets("127.0.0.1", 0)
    clients = [socket.create_connection(sock.getsockname()) for _ in range(10)]
    loop = asyncio.get_running_loop()
    failures = []
    failed = asyncio.Event()

    def handler(loop, context):
        if not is_accept_shortage(context):
            loop.default_exception_handler(context)
            return
        failures.append(context)
        failed.set()

    loop.set_exception_handler(handler)
    # No descriptor to spare: the lowest free one is at the soft limit.
    lowest = os.dup(0)
    os.close(lowest)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
    acceptor = Acceptor(asyncio.Protocol, [sock])
    await failed.wait()  # the first accept() failed; the next is a second away
    await asyncio.sleep(0)  # sync-ok: one loop turn, so a second failure would count
    print(len(failures), flush=True)
    await acceptor.close()
    for client in clients:
        client.close()

with asyncio.Runner(loop_factory=event_loop_factory(sys.argv[1])) as runner:
    runner.run(main())
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_accept_pass_stops_at_its_first_shortage(loop):
    """Ten connections wait; no descriptor is free: the pass fails once (one report, one
    retry scheduled), not once per waiting connection, on either loop."""
    done = subprocess.run(
        [sys.executable, "-c", ONE_PASS, loop], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1", done.stdout
