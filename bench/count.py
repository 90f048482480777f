"""Instructions and system calls per session call of a bridge: counts the load does not move.

    .venv/bin/python -m bench.count [--rev REV] [--tool callgrind|strace] [--args "..."]
    .venv/bin/python -m bench.count --args "--loop uvloop" off lines metrics both
    .venv/bin/python -m bench.count --in-flight 1 --warm 256 --calls 1024 off both

CPU time per call moves by ±15% on a shared machine; the number of instructions a call
executes (valgrind's callgrind) and the system calls it makes (strace) do not. This
runs ``rest-bridge serve`` (its default loop, or ``--args "--loop asyncio"``) before the
lean C app-server, with the bridge/ of this tree or of a git revision (``--rev``, as
``bench.ab`` does), creates one session and drives ``bench/ping`` calls at 64 in flight
on it (64 keep-alive connections, each sending its next call when its last one is
answered; ``--in-flight``): ``--warm`` calls first, then ``--calls`` counted ones.

Modes, each counted in turn and compared with the first: ``off`` (``--log-level
warning``: no access lines; no operations listener, so no metrics), ``lines`` (access
lines only: ``serve``'s default), ``metrics`` (the operations listener on, no lines),
``both`` (what ``bench.ab --observed`` compares with ``off``). Without a mode, one count
of the bridge as ``--args`` has it.

- ``--tool callgrind``: the bridge runs under ``valgrind --tool=callgrind
  --instr-atstart=no``; counting is switched on after the warm-up and the profile
  dumped after the counted calls (``callgrind_control``). Prints instructions per call;
  the profile is kept with ``--out`` (read it with ``callgrind_annotate``). Two timers
  are left out, since their cost follows the time valgrind stretches, not the calls:
  the subreaper's once-a-second sweep and the access lines' flush timer (a batch is
  written when full, as at the benchmark's rate: 10,000 calls/s fill one in 25 ms).
  Runs of one tree agree within about 0.5% with access lines off, about 1.5k
  instructions with them on (under valgrind fewer requests end in one millisecond, so a
  line's time text is made more often, about 2.6k instructions a line).
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
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import lean
from bench.ab import checkout
from bench.common import HOST, child_pids, fake_env, free_port, http_json, log, stop_process
from bench.peer import Driver, post

_TOTALS = re.compile(rb"^totals: (\d+)", re.MULTILINE)
_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$", re.MULTILINE)
CONNECTIONS = 64


def drive(port: int, path: str, calls: int, connections: int = CONNECTIONS) -> None:
    """``calls`` calls of ``POST path`` with ``{"params":{}}``, ``connections`` in flight
    (``bench.peer``'s client, given a number of calls rather than a time)."""
    request = post(port, path, {"params": {}}, {})
    driver = Driver(port, [request] * min(connections, calls), b"200", None)
    try:
        driver.run(calls=calls, patience=120)  # valgrind is slow
    finally:
        driver.close()


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(user, system) clock ticks of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


MODES = ("off", "lines", "metrics", "both")

#: ``rest-bridge serve`` without the two timers (module docstring); a revision that has
#: no such timer or console module is run as it is.
BOOT = """
import contextlib, sys
with contextlib.suppress(ImportError):
    import bridge.observe
    bridge.observe.FLUSH_SECONDS = 1e6
with contextlib.suppress(ImportError):
    import bridge.runtime
    bridge.runtime.become_subreaper = lambda: False
try:
    from bridge.console import main
except ImportError:
    from bridge.cli import main
sys.exit(main())
"""


def mode_settings(mode: str | None) -> tuple[list[str], dict[str, str]]:
    """The arguments of ``serve`` and the environment that make ``mode``."""
    if mode is None:
        return [], {}
    arguments = ["--log-level", "warning"] if mode in ("off", "metrics") else []
    return arguments, {"REST_ADAPTER_OPS_PORT": "0"} if mode in ("metrics", "both") else {}


def count(args: argparse.Namespace, mode: str | None, scratch: Path, env: dict[str, str]) -> float:
    """One count of the bridge in ``mode``: instructions per call (callgrind), or system
    calls per call (strace; each printed too)."""
    calls = args.calls or (2000 if args.tool == "callgrind" else 10000)
    arguments, more = mode_settings(mode)
    profile = args.out or str(scratch / "callgrind.out")
    if mode is not None:
        profile += f".{mode}"
    port = free_port()
    command = [sys.executable, "-c", BOOT, "serve", "--host", HOST, "--port", str(port)]
    command += ["--app-server", shlex.join(lean.argv("auto")), *arguments]
    command += shlex.split(args.args)
    if args.tool == "callgrind":
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        command = [*valgrind, f"--callgrind-out-file={profile}", *command]
    output = (scratch / f"bridge.{mode or 'log'}.log").open("wb")
    proc = subprocess.Popen(
        command,
        env={**env, **more},
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
        drive(port, path, args.warm, args.in_flight)
        tracer = None
        summary = scratch / "strace.txt"
        if args.tool == "callgrind":
            for switch in (["-i", "on"], ["-z"]):
                control = ["callgrind_control", *switch, str(proc.pid)]
                subprocess.run(control, check=True, capture_output=True)
            # callgrind takes a command when the process next runs: a few requests make
            # sure it has, then the count starts from zero.
            for _ in range(8):
                http_json(port, "GET", "/health")
            subprocess.run(
                ["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True
            )
        else:
            trace = ["strace", "-f", "-c", "-o", str(summary), "-p", str(proc.pid)]
            tracer = subprocess.Popen(trace, stderr=subprocess.PIPE)
            assert tracer.stderr is not None
            tracer.stderr.readline()  # "strace: Process N attached": it counts from now
        user0, system0 = cpu_ticks(proc.pid)
        began = time.monotonic()
        drive(port, path, calls, args.in_flight)
        seconds = time.monotonic() - began
        user1, system1 = cpu_ticks(proc.pid)
        tick = os.sysconf("SC_CLK_TCK")
        log(
            f"{calls} calls at {args.in_flight} in flight in {seconds:.1f} s; bridge CPU per "
            f"call: user {(user1 - user0) / tick / calls * 1e6:.1f} µs, system "
            f"{(system1 - system0) / tick / calls * 1e6:.1f} µs"
        )
        if args.tool == "callgrind":
            for switch in (["-d"], ["-i", "off"]):
                control = ["callgrind_control", *switch, str(proc.pid)]
                subprocess.run(control, check=True, capture_output=True)
            dumped = Path(f"{profile}.1").read_bytes()
            found = _TOTALS.search(dumped)
            assert found is not None, "callgrind's profile has no totals"
            if args.out:
                log(f"profile: {profile}.1")
            return int(found.group(1)) / calls
        assert tracer is not None
        tracer.send_signal(signal.SIGINT)
        tracer.wait()
        rows = _STRACE_ROW.findall(summary.read_text())
        per_call = sorted(
            ((int(n) / calls, name) for n, name in rows if name != "total"), reverse=True
        )
        for found_count, name in per_call:
            print(f"  {name}: {found_count:.3f}")
        return sum(n for n, _ in per_call)
    finally:
        children = child_pids(proc.pid)
        stop_process(proc)
        for pid in children:  # nothing the bridge spawned may outlive the count
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        output.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", help=f"of {', '.join(MODES)} (default: none)")
    parser.add_argument("--rev", help="the bridge/ of this git revision (default: this tree)")
    parser.add_argument("--tool", choices=["callgrind", "strace"], default="callgrind")
    parser.add_argument("--warm", type=int, default=1000, help="calls before counting")
    parser.add_argument("--calls", type=int, default=None, help="calls counted")
    parser.add_argument("--in-flight", type=int, default=CONNECTIONS, help="calls at a time")
    parser.add_argument("--args", default="", help="more arguments of `rest-bridge serve`")
    parser.add_argument("--out", help="where to keep callgrind's profiles")
    args = parser.parse_args(argv)
    if not set(args.modes) <= set(MODES):
        parser.error(f"modes are {', '.join(MODES)}")
    needed = ["valgrind", "callgrind_control"] if args.tool == "callgrind" else ["strace"]
    if any(shutil.which(tool) is None for tool in needed):
        parser.error(f"--tool {args.tool} needs {' and '.join(needed)} on PATH")
    what = "instructions" if args.tool == "callgrind" else "system calls"
    with tempfile.TemporaryDirectory(prefix="bench-count-") as scratch:
        env = fake_env({"PYTHONHASHSEED": "0"})
        if args.rev:
            try:
                checkout(args.rev, Path(scratch))
            except subprocess.CalledProcessError as exc:
                reason = exc.stderr.decode().strip()
                raise SystemExit(f"no bridge/ at {args.rev!r}: {reason}") from None
            env["PYTHONPATH"] = scratch
        first = None
        for mode in args.modes or [None]:
            found = count(args, mode, Path(scratch), env)
            change = "" if first is None else f" ({(found / first - 1) * 100:+.1f}%)"
            first = first or found
            print(f"{mode or 'bridge'}: {found:,.2f} {what} per call{change}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
