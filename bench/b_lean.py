"""The app-servers behind the benchmarks, alone: CPU per call over the pipe.

fake-codex (the project's fake, Python and asyncio), the lean app-server in Python and
the lean app-server in C (``bench/lean``), each spoken to directly over its stdio by
the lean client of ``bench/pipe.py``, at concurrency 1 and with 64 calls in flight.
CPU is the scheduler's count for the app-server's process (``/proc/<pid>/task/*/
schedstat``, ns), read around the loop, so other work on the machine does not enter it.

    .venv/bin/python -m bench.b_lean --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench import lean
from bench.common import cpu_ns, fake_argv, log
from bench.pipe import Pipe

CALLS = {1: 20_000, 64: 200_000}


def call_cpu(argv: list[str], in_flight: int) -> float:
    """The app-server's CPU per call, µs, over CALLS[in_flight] calls of `bench/ping`."""
    calls = CALLS[in_flight]
    with Pipe(argv) as pipe:
        pipe.initialize()
        pipe.latencies("bench/ping", 500)  # warm
        before = cpu_ns(pipe.proc.pid)
        if in_flight == 1:
            pipe.latencies("bench/ping", calls)
        else:
            pipe.throughput("bench/ping", in_flight, calls)
        return (cpu_ns(pipe.proc.pid) - before) / calls / 1000


def app_servers() -> dict[str, list[str]]:
    servers = {"fake-codex": fake_argv(), "lean (Python)": lean.argv("python")}
    compiled = lean.argv("auto")
    if lean.kind_of(compiled) == "c":
        servers["lean (C)"] = compiled
    return servers


def measure(repeats: int) -> dict[tuple[str, int], list[float]]:
    """CPU per call for every app-server and concurrency, interleaved over ``repeats``."""
    servers = app_servers()
    results: dict[tuple[str, int], list[float]] = {}
    for index in range(repeats):
        log(f"lean: repeat {index + 1} of {repeats}")
        for name, argv in servers.items():
            for in_flight in CALLS:
                results.setdefault((name, in_flight), []).append(call_cpu(argv, in_flight))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results = measure(args.repeats)
    print(f"{'app-server':<16} {'in flight':>9}  CPU µs/call: median (range)")
    for (name, in_flight), values in results.items():
        print(
            f"{name:<16} {in_flight:>9}  {statistics.median(values):6.2f}"
            f" ({min(values):.2f}-{max(values):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
