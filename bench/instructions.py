"""Instructions per call of the bridge process, counted by callgrind: a measure the load
of a shared machine does not move (CPU time moves by ±15% there).

    .venv/bin/python -m bench.instructions                    # off, then both, asyncio
    .venv/bin/python -m bench.instructions --loop uvloop off lines metrics both
    .venv/bin/python -m bench.instructions --in-flight 1 --warm 256 --calls 1024

Modes: ``off`` (``--log-level warning``: no access lines; no operations listener, so no
metrics), ``lines`` (access lines only), ``metrics`` (the operations listener on, no
lines), ``both`` (what ``bench.ab --observed`` compares with ``off``).

Each mode runs ``rest-bridge serve`` before the lean C app-server under ``valgrind
--tool=callgrind --instr-atstart=no``; one session; the warm-up calls, then counting
switched on and zeroed (callgrind takes a command when the process next runs: a few
health requests make sure it has), the counted calls, a dump. The calls are
``bench/ping`` on keep-alive connections, each sending its next call when the last is
answered. Two things are left out because their cost depends on time, which valgrind
stretches, not on calls: the subreaper's once-a-second sweep, and the access lines'
flush timer (a batch is written when full, as it is at the benchmark's rate: 10,000
calls/s fill one in 25 ms). What is still not like the real rate: under valgrind the
requests of a batch end in fewer per millisecond, so a line's time text is made more
often (about 2.6k instructions a line), and fewer requests are handled per loop
iteration. Compare counts of one run of this tool, and repeat a count before trusting a
difference under 1.5k.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import lean
from bench.common import HOST, fake_env, free_port, http_json

MODES = ("off", "lines", "metrics", "both")

#: The bridge as `rest-bridge serve` runs it, without the two timers (module docstring).
BOOT = """
import sys
import bridge.observe
import bridge.runtime
bridge.observe.FLUSH_SECONDS = 1e6
bridge.runtime.become_subreaper = lambda: False
from bridge.console import main
sys.exit(main())
"""


async def calls(port: int, request: bytes, count: int, in_flight: int) -> None:
    """``count`` calls, ``in_flight`` at a time, each connection its own sequence."""

    async def connection(share: int) -> None:
        reader, writer = await asyncio.open_connection(HOST, port)
        for _ in range(share):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"a call failed: {head[:200]!r}")
            length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
            await reader.readexactly(int(length.group(1)) if length else 0)
        writer.close()

    shares = [count // in_flight + (1 if k < count % in_flight else 0) for k in range(in_flight)]
    await asyncio.gather(*(connection(share) for share in shares if share))


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], capture_output=True, check=True)


def count(mode: str, loop: str, in_flight: int, warm: int, counted: int, into: Path) -> float:
    """Instructions per call of the bridge in ``mode``."""
    port = free_port()
    argv = [sys.executable, "-c", BOOT, "serve", "--host", HOST, "--port", str(port)]
    argv += ["--app-server", " ".join(lean.argv("c")), "--loop", loop]
    extra = {"PYTHONHASHSEED": "0"}
    if mode in ("off", "metrics"):
        argv += ["--log-level", "warning"]
    if mode in ("metrics", "both"):
        extra["REST_ADAPTER_OPS_PORT"] = "0"
    out = into / f"callgrind.{mode}"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
    valgrind.append(f"--callgrind-out-file={out}")
    with open(into / f"bridge.{mode}.log", "wb") as log:
        proc = subprocess.Popen(
            valgrind + argv,
            env=fake_env(extra, script=False),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the bridge did not start: see {log.name}")
                try:
                    if http_json(port, "GET", "/health", timeout=30)[0] == 200:
                        break
                except OSError:
                    time.sleep(0.2)
            status, body = http_json(port, "POST", "/v1/sessions", {}, timeout=120)
            if status != 201:
                raise RuntimeError(f"creating a session: {status} {body}")
            payload = json.dumps({"params": {}}).encode()
            request = (
                f"POST /v1/sessions/{body['sessionId']}/call/bench/ping HTTP/1.1\r\n"
                f"Host: {HOST}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n"
            ).encode() + payload
            asyncio.run(calls(port, request, warm, in_flight))
            control(proc.pid, "-i", "on")
            control(proc.pid, "-z")
            for _ in range(8):
                http_json(port, "GET", "/health", timeout=30)
            control(proc.pid, "-z")
            asyncio.run(calls(port, request, counted, in_flight))
            control(proc.pid, "-d")
            control(proc.pid, "-i", "off")
        finally:
            proc.terminate()
            proc.wait(120)
    dump = Path(f"{out}.1").read_text()
    summary = re.search(r"^summary: (\d+)$", dump, re.MULTILINE)
    if summary is None:
        raise RuntimeError(f"no summary in {out}.1")
    return int(summary.group(1)) / counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("modes", nargs="*", help=f"of {', '.join(MODES)} (default: off both)")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--warm", type=int, default=512, help="calls before counting")
    parser.add_argument("--calls", type=int, default=2048, help="calls counted")
    parser.add_argument("--keep", action="store_true", help="keep the callgrind files")
    args = parser.parse_args(argv)
    modes = args.modes or ["off", "both"]
    if not set(modes) <= set(MODES):
        parser.error(f"modes are {', '.join(MODES)}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench.instructions needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    into = Path(tempfile.mkdtemp(prefix="bench-instructions-"))
    try:
        first = None
        for mode in modes:
            found = count(mode, args.loop, args.in_flight, args.warm, args.calls, into)
            change = "" if first is None else f" ({(found / first - 1) * 100:+.1f}%)"
            first = first or found
            print(
                f"{mode}: {found / 1000:.1f}k instructions a call{change} "
                f"({args.loop}, {args.in_flight} in flight, {args.calls} calls)",
                flush=True,
            )
    finally:
        if args.keep:
            print(f"callgrind files in {into}")
        else:
            shutil.rmtree(into, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
