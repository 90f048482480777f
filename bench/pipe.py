"""The baseline: the same work done directly over fake-codex's stdio, no bridge.

A deliberately lean client (blocking ``os.read``/``os.write`` on the pipes, bytes
templates for requests, newline counting for replies) so that what it measures is
the fake and the pipe, not the client.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import orjson

from bench.common import fake_argv, fake_env

READ_SIZE = 1 << 20
INITIALIZE = {"clientInfo": {"name": "bench", "title": None, "version": "0"}}


class Pipe:
    """One fake-codex process spoken to over its stdio."""

    def __init__(self, argv: list[str] | None = None) -> None:
        """fake-codex, or the app-server ``argv`` starts (with fake-codex's environment)."""
        self.proc = subprocess.Popen(
            argv or fake_argv(),
            env=fake_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
            start_new_session=True,
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.fd_in = self.proc.stdin.fileno()
        self.fd_out = self.proc.stdout.fileno()
        self.buffer = bytearray()
        self.next_id = 1

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> float:
        """Close stdin and wait for the exit; returns how long that took."""
        start = time.perf_counter()
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        return time.perf_counter() - start

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd_in, view) :]

    def send(self, message: dict[str, Any]) -> None:
        self.write(orjson.dumps(message) + b"\n")

    def read_line(self, deadline: float = 30.0) -> bytes:
        limit = time.monotonic() + deadline
        while True:
            newline = self.buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self.buffer[:newline])
                del self.buffer[: newline + 1]
                return line
            if time.monotonic() > limit:
                raise TimeoutError("fake-codex did not answer")
            chunk = os.read(self.fd_out, READ_SIZE)
            if not chunk:
                raise EOFError("fake-codex closed its stdout")
            self.buffer += chunk

    def call(self, method: str, params: Any = None) -> Any:
        """A request, then lines until its response (notifications are skipped)."""
        request_id = self.next_id
        self.next_id += 1
        self.send({"id": request_id, "method": method, "params": params or {}})
        for _ in range(1_000_000):
            message = orjson.loads(self.read_line())
            if message.get("id") == request_id and "method" not in message:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
        raise RuntimeError(f"{method}: no response")

    def initialize(self) -> Any:
        result = self.call("initialize", INITIALIZE)
        self.send({"method": "initialized"})
        return result

    # -- the measured loops ---------------------------------------------------------

    def latencies(self, method: str, count: int) -> list[float]:
        """Sequential calls (concurrency 1): each round trip in seconds."""
        out = []
        fd_in, fd_out = self.fd_in, self.fd_out
        clock = time.perf_counter
        for request_id in range(self.next_id, self.next_id + count):
            request = b'{"id":%d,"method":"%s","params":{}}\n' % (request_id, method.encode())
            start = clock()
            os.write(fd_in, request)
            chunk = os.read(fd_out, READ_SIZE)
            while not chunk.endswith(b"\n"):
                chunk += os.read(fd_out, READ_SIZE)
            out.append(clock() - start)
        self.next_id += count
        return out

    def throughput(self, method: str, in_flight: int, count: int) -> float:
        """``count`` calls keeping ``in_flight`` outstanding: calls per second."""
        template = b'{"id":%d,"method":"' + method.encode() + b'","params":{}}\n'
        first = self.next_id
        sent = received = 0

        def batch(n: int) -> bytes:
            nonlocal sent
            data = b"".join(template % (first + sent + k) for k in range(n))
            sent += n
            return data

        start = time.perf_counter()
        self.write(batch(in_flight))
        while received < count:
            chunk = os.read(self.fd_out, READ_SIZE)
            if not chunk:
                raise EOFError("fake-codex closed its stdout")
            done = chunk.count(b"\n")
            received += done
            more = min(done, count - sent)
            if more > 0:
                self.write(batch(more))
        elapsed = time.perf_counter() - start
        self.next_id = first + sent
        return count / elapsed

    def flood(self, notifications: int) -> float:
        """Call bench/flood and read every notification and the reply: seconds."""
        start = time.perf_counter()
        self.send({"id": self.next_id, "method": "bench/flood", "params": {}})
        self.next_id += 1
        lines = 0
        while lines < notifications + 1:
            chunk = os.read(self.fd_out, READ_SIZE)
            if not chunk:
                raise EOFError("fake-codex closed its stdout")
            lines += chunk.count(b"\n")
        return time.perf_counter() - start
