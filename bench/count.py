"""Instructions and system calls per session call of a bridge: counts the load does not move.

    .venv/bin/python -m bench.count [--rev REV] [--tool callgrind|strace] [--args "..."]

CPU time per call moves by ±15% on a shared machine; the number of instructions a call
executes (valgrind's callgrind) and the system calls it makes (strace) do not. This
runs ``rest-bridge serve`` (its default loop, or ``--args "--loop asyncio"``) before the
lean C app-server, with the bridge/ of this tree or of a git revision (``--rev``, as
``bench.ab`` does), creates one session and drives ``bench/ping`` calls at 64 in flight
on it (64 keep-alive connections, each sending its next call when its last one is
answered): ``--warm`` calls first, then ``--calls`` counted ones.

- ``--tool callgrind``: the bridge runs under ``valgrind --tool=callgrind
  --instr-atstart=no``; counting is switched on after the warm-up and the profile
  dumped after the counted calls (``callgrind_control``). Prints instructions per call;
  the profile is kept with ``--out`` (read it with ``callgrind_annotate``). Runs of one
  tree agree within about 0.5% with access lines off (``--args "--log-level warning"``),
  a few per cent with them on (how many lines a batch settles moves with the speed).
- ``--tool strace``: ``strace -f -c`` attached to the bridge over the counted calls;
  prints each system call's count per call.

Both print the bridge's user and system CPU per counted call from ``/proc`` as well,
for orientation only (under valgrind it is valgrind's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import lean
from bench.ab import checkout
from bench.common import HOST, child_pids, fake_env, free_port, http_json, log, stop_process

_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)
_TOTALS = re.compile(rb"^totals: (\d+)", re.MULTILINE)
_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$", re.MULTILINE)
CONNECTIONS = 64


def drive(port: int, path: str, calls: int, connections: int = CONNECTIONS) -> None:
    """``calls`` calls of ``POST path`` with ``{"params":{}}``, ``connections`` in flight."""
    body = b'{"params":{}}'
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    conns = [socket.create_connection((HOST, port)) for _ in range(min(connections, calls))]
    selector = selectors.DefaultSelector()
    buffers = [b""] * len(conns)
    sent = answered = 0
    try:
        for index, conn in enumerate(conns):
            conn.setblocking(False)
            selector.register(conn, selectors.EVENT_READ, index)
            conn.send(request)  # a few hundred bytes into an empty buffer: all of it
            sent += 1
        while answered < calls:
            ready = selector.select(timeout=120)
            if not ready:
                raise RuntimeError(f"no answer within 120 s ({sent - answered} in flight)")
            for key, _ in ready:
                index = key.data
                data = conns[index].recv(1 << 16)
                if not data:
                    raise RuntimeError("the bridge closed a connection")
                buffer = buffers[index] + data
                while (head := buffer.find(b"\r\n\r\n")) >= 0:
                    length = _LENGTH.search(buffer, 0, head)
                    end = head + 4 + (int(length.group(1)) if length else 0)
                    if len(buffer) < end:
                        break
                    if buffer[9:12] != b"200":
                        raise RuntimeError(f"unexpected answer: {buffer[:end]!r}")
                    buffer = buffer[end:]
                    answered += 1
                    if sent < calls:
                        conns[index].send(request)
                        sent += 1
                buffers[index] = buffer
    finally:
        selector.close()
        for conn in conns:
            conn.close()


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(user, system) clock ticks of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="the bridge/ of this git revision (default: this tree)")
    parser.add_argument("--tool", choices=["callgrind", "strace"], default="callgrind")
    parser.add_argument("--warm", type=int, default=1000, help="calls before counting")
    parser.add_argument("--calls", type=int, default=None, help="calls counted")
    parser.add_argument("--args", default="", help="more arguments of `rest-bridge serve`")
    parser.add_argument("--out", help="where to keep callgrind's profile")
    args = parser.parse_args(argv)
    calls = args.calls or (2000 if args.tool == "callgrind" else 10000)
    with tempfile.TemporaryDirectory(prefix="bench-count-") as scratch:
        env = fake_env({"PYTHONHASHSEED": "0"})
        if args.rev:
            try:
                checkout(args.rev, Path(scratch))
            except subprocess.CalledProcessError as exc:
                reason = exc.stderr.decode().strip()
                raise SystemExit(f"no bridge/ at {args.rev!r}: {reason}") from None
            env["PYTHONPATH"] = scratch
        profile = args.out or str(Path(scratch) / "callgrind.out")
        port = free_port()
        command = [sys.executable, "-m", "bridge.cli", "serve", "--host", HOST]
        command += ["--port", str(port), "--app-server", shlex.join(lean.argv("auto"))]
        command += shlex.split(args.args)
        if args.tool == "callgrind":
            valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
            command = [*valgrind, f"--callgrind-out-file={profile}", *command]
        output = (Path(scratch) / "bridge.log").open("wb")
        proc = subprocess.Popen(
            command,
            env=env,
            cwd=scratch,  # the checkout's bridge/ first on the path, not this tree's
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            session = ""
            deadline = time.monotonic() + 120  # valgrind takes its time to start
            while not session:
                try:
                    status, body = http_json(port, "POST", "/v1/sessions", {})
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the bridge did not start") from None
                    time.sleep(0.2)
                    continue
                if status != 201:
                    raise RuntimeError(f"creating a session: {status} {body}")
                session = str(body["sessionId"])
            path = f"/v1/sessions/{session}/call/bench/ping"
            drive(port, path, args.warm)
            tracer = None
            summary = Path(scratch) / "strace.txt"
            if args.tool == "callgrind":
                for switch in (["-z"], ["-i", "on"]):
                    control = ["callgrind_control", *switch, str(proc.pid)]
                    subprocess.run(control, check=True, capture_output=True)
            else:
                trace = ["strace", "-f", "-c", "-o", str(summary), "-p", str(proc.pid)]
                tracer = subprocess.Popen(trace, stderr=subprocess.PIPE)
                assert tracer.stderr is not None
                tracer.stderr.readline()  # "strace: Process N attached": it counts from now
            user0, system0 = cpu_ticks(proc.pid)
            began = time.monotonic()
            drive(port, path, calls)
            seconds = time.monotonic() - began
            user1, system1 = cpu_ticks(proc.pid)
            tick = os.sysconf("SC_CLK_TCK")
            log(
                f"{calls} calls at {CONNECTIONS} in flight in {seconds:.1f} s; bridge CPU per "
                f"call: user {(user1 - user0) / tick / calls * 1e6:.1f} µs, system "
                f"{(system1 - system0) / tick / calls * 1e6:.1f} µs"
            )
            if args.tool == "callgrind":
                for switch in (["-i", "off"], ["-d"]):
                    control = ["callgrind_control", *switch, str(proc.pid)]
                    subprocess.run(control, check=True, capture_output=True)
                dumped = Path(f"{profile}.1").read_bytes()
                found = _TOTALS.search(dumped)
                assert found is not None, "callgrind's profile has no totals"
                print(f"instructions per call: {int(found.group(1)) / calls:,.0f}", flush=True)
                if args.out:
                    log(f"profile: {profile}.1")
            else:
                assert tracer is not None
                tracer.send_signal(signal.SIGINT)
                tracer.wait()
                rows = _STRACE_ROW.findall(summary.read_text())
                per_call = sorted(
                    ((int(n) / calls, name) for n, name in rows if name != "total"), reverse=True
                )
                print(f"system calls per call: {sum(n for n, _ in per_call):.2f}")
                for count, name in per_call:
                    print(f"  {name}: {count:.3f}")
        finally:
            children = child_pids(proc.pid)
            stop_process(proc)
            for pid in children:  # nothing the bridge spawned may outlive the count
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            output.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
