"""0. fake-codex alone, measured first: is the fake the bottleneck of its own benchmarks?

Start-up: spawn, write `initialize`, read its answer, close stdin, reap. Timed to the
answer (what a bridge waits for) and in CPU for the whole life (from ``wait4``), for
fake-codex without a script (its fast start: no pydantic, no YAML), with the
benchmarks' script, and, as the baseline, the same interpreter answering one line and
doing nothing else: the floor of any Python app-server.

Calls: fake-codex's own CPU per answered call over the pipe, at concurrency 1 and with
64 in flight, read from ``/proc`` around the loop.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.common import Section, cpu_seconds, fake_argv, fake_env, log
from bench.pipe import Pipe

STARTS = 15  # per kind and repeat
CALLS = 5_000
INITIALIZE = (
    b'{"id":1,"method":"initialize","params":{"clientInfo":'
    b'{"name":"bench","title":null,"version":"0"}}}\n'
)
# The baseline app-server: read one line, answer it, wait for stdin to close.
BARE = (
    "import sys; sys.stdin.buffer.readline(); "
    'sys.stdout.buffer.write(b\'{"id":1,"result":{}}\\n\'); sys.stdout.flush(); '
    "sys.stdin.buffer.read()"
)


def start_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds until the initialize answer, CPU seconds of the whole life)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(INITIALIZE)
    proc.stdin.flush()
    answer = proc.stdout.readline()
    answered = time.perf_counter() - start
    proc.stdin.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    if not answer.startswith(b'{"id":1'):
        raise RuntimeError(f"{argv[0]}: no initialize answer ({answer[:80]!r})")
    return answered, usage.ru_utime + usage.ru_stime


def starts(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Medians over STARTS starts: (ms to the answer, ms of CPU per life)."""
    results = [start_once(argv, env) for _ in range(STARTS)]
    return (
        statistics.median(r[0] for r in results) * 1000,
        statistics.median(r[1] for r in results) * 1000,
    )


def call_cpu(in_flight: int) -> float:
    """fake-codex's CPU per call, µs, over CALLS calls of `bench/ping`."""
    with Pipe() as pipe:
        pipe.initialize()
        pipe.latencies("bench/ping", 200)  # warm
        before = cpu_seconds(pipe.proc.pid)
        if in_flight == 1:
            pipe.latencies("bench/ping", CALLS)
        else:
            pipe.throughput("bench/ping", in_flight, CALLS)
        return (cpu_seconds(pipe.proc.pid) - before) / CALLS * 1e6


def run(repeats: int, options: dict[str, Any]) -> Section:
    section = Section("fake", "0. fake-codex alone (measured first)", subject="fake-codex")
    log("fake: start-up and CPU per call, without a bridge")
    bare_argv = [sys.executable, "-c", BARE]
    kinds = {
        "no script": fake_env(script=False),
        "bench script": fake_env(),
    }
    bare: list[tuple[float, float]] = []
    fake: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    for _ in range(repeats):
        bare.append(starts(bare_argv, fake_env(script=False)))
        for kind, env in kinds.items():
            fake[kind].append(starts(fake_argv(), env))
    figures = ("spawn until the initialize answer", "CPU per life (spawn, initialize, exit)")
    for kind in kinds:
        for index, figure in enumerate(figures):
            section.add(
                f"start-up ({kind}): {figure}",
                "ms",
                [r[index] for r in fake[kind]],
                baseline=[r[index] for r in bare],
                baseline_name="bare interpreter",
            )
    for in_flight in (1, 64):
        section.add(
            f"fake-codex CPU per call, {in_flight} in flight (bench script)",
            "µs",
            [call_cpu(in_flight) for _ in range(repeats)],
        )
    section.notes.append(
        f"Start-up: {STARTS} starts per kind and repeat, one after the other; the bare "
        "interpreter is the same Python reading one line and answering it. The sessions "
        "benchmark (3.) spawns fake-codex without a script, so its fake-side cost is the "
        "`no script` row; the others use the script."
    )
    return section
