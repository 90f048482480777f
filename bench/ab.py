"""Before/after: the bridge of a git revision against the working tree, interleaved.

    .venv/bin/python -m bench.ab [--before HEAD] [--rounds 8] [--loop asyncio]
    .venv/bin/python -m bench.ab --before main --after i22-merge   # two revisions
    .venv/bin/python -m bench.ab --loops [--rounds 8]   # this tree, asyncio against uvloop
    .venv/bin/python -m bench.ab --metrics [--rounds 8]   # this tree, metrics off against on
    .venv/bin/python -m bench.ab --observed   # this tree, access lines and metrics both off/on
    .venv/bin/python -m bench.ab --before-args="--log-level warning"   # access lines off/on

Both bridges run side by side (an old one from ``git archive REV bridge`` on
PYTHONPATH) and are measured in turns, the order reversed every other round, so that
other work on a shared machine hits both alike. Besides rates, it reports CPU time per
call and per event, read from /proc: on a busy machine those move far less than
wall-clock rates do.

The app-server behind both is the lean one (``bench/lean``, C when there is a
compiler), as in the issue's side-by-side measure, unless ``--app-server fake``.
``--loop default`` passes no ``--loop``: each bridge runs its own default.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import lean, wrk
from bench.b_events import COUNT, flood_through
from bench.common import ROOT, Bridge, child_pids, cpu_ns, fake_argv, log, raise_fd_limit


def checkout(revision: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "archive", revision, "bridge"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def calls(bridge: Bridge, url: str, connections: int, seconds: int) -> dict[str, float]:
    app_server = child_pids(bridge.pid)[0]
    bridge0, app_server0 = cpu_ns(bridge.pid), cpu_ns(app_server)
    lua = wrk.lua_post({"params": {}})
    result, _ = wrk.run(url, connections=connections, seconds=seconds, lua=lua)
    return {
        "calls/s": result.rate,
        "p50 µs": result.p50_us,
        "bridge CPU µs/call": (cpu_ns(bridge.pid) - bridge0) / result.requests / 1e3,
        "app-server CPU µs/call": (cpu_ns(app_server) - app_server0) / result.requests / 1e3,
    }


def sse(bridge: Bridge, session: str) -> dict[str, float]:
    bridge0 = cpu_ns(bridge.pid)
    report = flood_through(bridge, session, "sse")
    return {
        "events/s": COUNT / report["seconds"],
        "bridge CPU µs/event": (cpu_ns(bridge.pid) - bridge0) / COUNT / 1e3,
        "gaps": report["gaps"],
    }


def load_average() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default="HEAD", help="git revision of the old bridge")
    parser.add_argument(
        "--after", default=None, help="git revision of the new bridge (default: this tree)"
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=2, help="of each wrk run")
    parser.add_argument("--loop", choices=["default", "asyncio", "uvloop"], default="asyncio")
    parser.add_argument(
        "--loops", action="store_true", help="compare the loops instead: asyncio, then uvloop"
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="compare this tree with its operations listener (and so its metrics) off and on",
    )
    parser.add_argument(
        "--observed",
        action="store_true",
        help="compare this tree with access lines and metrics both off (--log-level warning) "
        "and both on (its operations listener on)",
    )
    parser.add_argument("--app-server", choices=["lean", "fake"], default="lean")
    parser.add_argument(
        "--before-args", default="", help="more arguments of the before bridge's `serve`"
    )
    parser.add_argument(
        "--after-args", default="", help="more arguments of the after bridge's `serve`"
    )
    parser.add_argument(
        "--only",
        default="c1,c64,sse",
        help="comma-separated figures: c1 (one call at a time), c64 (64 in flight), sse",
    )
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    raise_fd_limit()
    app_server = lean.argv("auto") if args.app_server == "lean" else fake_argv()
    results: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    loads = [load_average()]
    with contextlib.ExitStack() as stack:
        if args.loops:
            bridges = {
                "before": stack.enter_context(Bridge(loop="asyncio", app_server=app_server)),
                "after": stack.enter_context(Bridge(loop="uvloop", app_server=app_server)),
            }
        elif args.observed:
            loop = None if args.loop == "default" else args.loop
            off = Bridge(loop=loop, app_server=app_server, args=["--log-level", "warning"])
            on = Bridge(loop=loop, env={"REST_ADAPTER_OPS_PORT": "0"}, app_server=app_server)
            bridges = {"before": stack.enter_context(off), "after": stack.enter_context(on)}
        elif args.metrics:
            loop = None if args.loop == "default" else args.loop
            bridges = {
                "before": stack.enter_context(Bridge(loop=loop, app_server=app_server)),
                "after": stack.enter_context(
                    Bridge(loop=loop, env={"REST_ADAPTER_OPS_PORT": "0"}, app_server=app_server)
                ),
            }
        else:
            loop = None if args.loop == "default" else args.loop
            revisions = {"before": args.before, "after": args.after}
            bridges = {}
            for name, revision in revisions.items():
                env = {}
                if revision is not None:
                    old = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ab-"))
                    checkout(revision, Path(old))
                    env["PYTHONPATH"] = old
                extra = shlex.split(getattr(args, f"{name}_args"))
                bridge = Bridge(loop=loop, env=env, app_server=app_server, args=extra)
                bridges[name] = stack.enter_context(bridge)
        targets: dict[str, tuple[str, str]] = {}
        for name, bridge in bridges.items():
            session = bridge.create_session()
            url = f"{bridge.base}/v1/sessions/{session}/call/bench/ping"
            calls(bridge, url, 16, 1)  # warm-up
            if "sse" in parts:
                flood_through(bridge, session, "sse")
            targets[name] = (url, session)
        for index in range(args.rounds):
            log(f"round {index + 1}/{args.rounds} (load average {load_average()})")
            order = list(bridges.items())
            if index % 2:
                order.reverse()
            for name, bridge in order:
                url, session = targets[name]
                figures: dict[str, Any] = {}
                if "c1" in parts:
                    found = calls(bridge, url, 1, args.seconds)
                    figures.update({f"c1 {k}": v for k, v in found.items()})
                if "c64" in parts:
                    found = calls(bridge, url, 64, args.seconds)
                    figures.update({f"c64 {k}": v for k, v in found.items()})
                if "sse" in parts:
                    figures.update({f"SSE {k}": v for k, v in sse(bridge, session).items()})
                for key, value in figures.items():
                    results[name].setdefault(key, []).append(value)
        loads.append(load_average())
    what = f"{args.rounds} rounds, {args.app_server} app-server"
    if args.loops:
        print(f"| this tree, {what} | asyncio | uvloop | change |")
    elif args.observed:
        columns = "access lines and metrics off | both on"
        print(f"| this tree, {args.loop} loop, {what} | {columns} | change |")
    elif args.metrics:
        print(f"| this tree, {args.loop} loop, {what} | metrics off | metrics on | change |")
    else:
        after = args.after or "this tree"
        before_name = " ".join([args.before, args.before_args]).strip()
        after_name = " ".join([after, args.after_args]).strip()
        columns = f"before ({before_name}) | after ({after_name})"
        print(f"| {args.loop} loop, {what} | {columns} | change |")
    print("|---|---|---|---|")
    for key in results["before"]:
        cells = []
        for name in ("before", "after"):
            values = results[name][key]
            median = statistics.median(values)
            cells.append(f"{median:,.1f} ({min(values):,.1f}-{max(values):,.1f})")
        before = statistics.median(results["before"][key])
        after_value = statistics.median(results["after"][key])
        change = f"{(after_value / before - 1) * 100:+.0f}%" if before else "n/a"
        print(f"| {key} | {cells[0]} | {cells[1]} | {change} |")
    print(f"\nload average (1, 5, 15 min) at start: {loads[0]}; at end: {loads[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
