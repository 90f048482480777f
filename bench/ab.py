"""Before/after: the bridge of a git revision against the working tree, interleaved.

    .venv/bin/python -m bench.ab [--before HEAD] [--rounds 8] [--loop asyncio]
    .venv/bin/python -m bench.ab --loops [--rounds 8]   # this tree, asyncio against uvloop

Both bridges run side by side (the old one from ``git archive REV bridge`` on
PYTHONPATH) and are measured in turns, so that other work on a shared machine hits
both alike. Besides rates, it reports CPU time per call and per event, read from
/proc: on a busy machine those move far less than wall-clock rates do.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import wrk
from bench.b_events import COUNT, flood_through
from bench.common import ROOT, Bridge, child_pids, cpu_seconds, log, raise_fd_limit


def checkout(revision: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "archive", revision, "bridge"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def calls(bridge: Bridge, url: str, connections: int) -> dict[str, float]:
    fake = child_pids(bridge.pid)[0]
    bridge0, fake0 = bridge.cpu(), cpu_seconds(fake)
    result, _ = wrk.run(url, connections=connections, seconds=2, lua=wrk.lua_post({"params": {}}))
    return {
        "calls/s": result.rate,
        "p50 µs": result.p50_us,
        "bridge CPU µs/call": (bridge.cpu() - bridge0) / result.requests * 1e6,
        "fake CPU µs/call": (cpu_seconds(fake) - fake0) / result.requests * 1e6,
    }


def sse(bridge: Bridge, session: str) -> dict[str, float]:
    report = flood_through(bridge, session, "sse")
    return {
        "events/s": COUNT / report["seconds"],
        "bridge CPU µs/event": report["bridge_cpu"] * report["seconds"] / COUNT * 1e6,
        "gaps": report["gaps"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default="HEAD", help="git revision of the old bridge")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument(
        "--loops", action="store_true", help="compare the loops instead: asyncio, then uvloop"
    )
    args = parser.parse_args(argv)
    raise_fd_limit()
    results: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as old, contextlib.ExitStack() as stack:
        if args.loops:
            bridges = {
                "before": stack.enter_context(Bridge(loop="asyncio")),
                "after": stack.enter_context(Bridge(loop="uvloop")),
            }
        else:
            checkout(args.before, Path(old))
            loop = None if args.loop == "asyncio" else args.loop  # old bridges lack --loop
            bridges = {
                "before": stack.enter_context(Bridge(loop=loop, env={"PYTHONPATH": old})),
                "after": stack.enter_context(Bridge(loop=args.loop)),
            }
        targets: dict[str, tuple[str, str]] = {}
        for name, bridge in bridges.items():
            session = bridge.create_session()
            url = f"{bridge.base}/v1/sessions/{session}/call/bench/ping"
            calls(bridge, url, 16)  # warm-up
            flood_through(bridge, session, "sse")
            targets[name] = (url, session)
        for index in range(args.rounds):
            log(f"round {index + 1}/{args.rounds}")
            for name, bridge in bridges.items():
                url, session = targets[name]
                figures: dict[str, Any] = {}
                figures.update({f"c1 {k}": v for k, v in calls(bridge, url, 1).items()})
                figures.update({f"c64 {k}": v for k, v in calls(bridge, url, 64).items()})
                figures.update({f"SSE {k}": v for k, v in sse(bridge, session).items()})
                for key, value in figures.items():
                    results[name].setdefault(key, []).append(value)
    if args.loops:
        print(f"| this tree, {args.rounds} rounds | asyncio | uvloop | change |")
    else:
        print(f"| {args.loop}, {args.rounds} rounds | before ({args.before}) | after | change |")
    print("|---|---|---|---|")
    for key in results["before"]:
        before = statistics.median(results["before"][key])
        after = statistics.median(results["after"][key])
        change = f"{(after / before - 1) * 100:+.0f}%" if before else "n/a"
        print(f"| {key} | {before:,.1f} | {after:,.1f} | {change} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
