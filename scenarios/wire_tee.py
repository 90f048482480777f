"""`python -m scenarios.wire_tee LOG_DIR -- COMMAND [ARG...]` runs COMMAND with its stdin
and stdout piped through this process, appending each line to ``LOG_DIR/wire-<pid>.jsonl``
before passing it on (a reply is logged after the line that caused it), for
`scenarios.record`: ``{"argv": [...], "started": <monotonic ns>}``, ``{"dir": "c"|"s",
"line": "..."}`` per line from the client (the bridge) or the server, ``{"dir": "c",
"eof": true}`` when stdin ends, last ``{"exit": <status>}`` (negative: a signal).

It exits with COMMAND's status, or dies by the same signal. SIGTERM and SIGINT are left
to COMMAND (the bridge signals the whole group): this process relays until COMMAND's
stdout ends, so nothing it wrote is lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import orjson


class _Log:
    """One process's log file; lines from both threads, in the order they came."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in main
        self.lock = threading.Lock()

    def write(self, entry: dict[str, object]) -> None:
        with self.lock:
            if not self.file.closed:  # the stdin thread may outlive the log
                self.file.write(orjson.dumps(entry) + b"\n")


def _pump(source: IO[bytes], sink: IO[bytes] | None, log: _Log, direction: str) -> None:
    """Copy lines from `source` to `sink`, logging each; close `sink` at EOF.

    The stdin pump is a daemon thread that may still be blocked in a read when this
    process ends: it reads through a reader of its own, never `sys.stdin` (which the
    interpreter flushes on its way out), and the process ends by `os._exit`.
    """
    try:
        for raw in source:
            log.write({"dir": direction, "line": raw.rstrip(b"\n").decode("utf-8", "replace")})
            if sink is not None:
                try:
                    sink.write(raw)
                    sink.flush()
                except OSError:  # the reader is gone (EPIPE)
                    sink = None
    finally:
        if direction == "c":
            log.write({"dir": "c", "eof": True})
        if sink is not None:
            with contextlib.suppress(OSError):
                sink.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m scenarios.wire_tee LOG_DIR -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    log_dir, command = Path(args[0]), args[2:]
    log_dir.mkdir(parents=True, exist_ok=True)
    log = _Log(log_dir / f"wire-{os.getpid()}.jsonl")
    log.write({"argv": command, "started": time.monotonic_ns()})
    # The group's SIGTERM reaches COMMAND too; this process relays until it ends.
    # A handler rather than SIG_IGN: COMMAND must not inherit an ignored signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    except OSError as exc:
        print(f"wire_tee: cannot start {command[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    assert child.stdin is not None
    assert child.stdout is not None
    stdin = open(sys.stdin.fileno(), "rb", closefd=False)  # noqa: SIM115 - read till the end
    threading.Thread(target=_pump, args=(stdin, child.stdin, log, "c"), daemon=True).start()
    stdout = open(sys.stdout.fileno(), "wb")  # noqa: SIM115 - closed at EOF: the client sees it
    _pump(child.stdout, stdout, log, "s")
    code = child.wait()
    log.write({"exit": code})
    with log.lock:
        log.file.close()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    status = main()  # sys.stdout is never written: the relay writes a file of its own
    # Not sys.exit: the stdin thread may still be blocked in a read (holding its reader's
    # lock), and nothing of the interpreter's shutdown must wait on it.
    os._exit(status)
