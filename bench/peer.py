"""The bridge side by side with the Go peer, on the same machine, in interleaved rounds.

    .venv/bin/python -m bench.peer --go-peer PATH/TO/proxy [--rounds 6] [--seconds 5]

The Go peer is regexboi/codex-app-server-proxy (a public HTTP + SSE wrapper of
``codex app-server``), built from its source outside this repository (bench/README.md
says how). Both run in front of the same lean app-server (``bench/lean``), each with one
session, 64 calls in flight on it. Each round runs four measures in turns, the order
reversed every other round, and prints for each the proxy process's CPU per call
(``/proc/<pid>/task/*/schedstat``, the app-server not included), calls/s and the load
average; the end prints medians (min-max).

What "a call" is differs with the two APIs:

- the bridge: ``POST /v1/sessions/S/call/bench/ping`` answered with the app-server's
  result, in its default configuration (uvloop, access lines on, metrics off, no
  token), as ``python -m bench.ab`` starts it;
- the Go peer: ``POST /v1/sessions/S/rpc`` with a whole JSON-RPC request, answered 202
  once written to the app-server, whose answer reaches the client on the session's SSE
  stream (``GET /v1/sessions/S/events``). Its policy allows a fixed list of methods
  (not ``bench/ping``): the calls are ``model/list``, which the lean app-server answers
  with a one-line error, relayed as any answer is. It always checks an API key (a
  SHA-256 per request) and logs a line per request to stdout.

The four measures:

- ``bridge`` and ``Go peer``: this module's client (:class:`Driver`) keeps 64 calls in
  flight, each connection sending its next call when its last one's answer has arrived
  (for the Go peer, on the stream, by its id). The same client for both: a call counts
  when the client has its answer.
- ``bridge, wrk``: :func:`bench.ab.calls`, as ``bench.ab`` measures the bridge.
- ``Go peer, wrk``: wrk on a second session of the Go peer that has no reader, so
  each call is done at its 202 and its answer is read by the peer and dropped: the
  least work the peer can do per call. (wrk cannot wait for an answer on the stream,
  and the peer closes a reader that falls 128 events behind, which wrk's unbounded
  stream of 202s soon makes it.)

How the Go peer is made to run offline, with no change to it: its config file (own
port, API key, workspace, data directory, ``codex_binary_path``) is written to a
temporary directory, and ``codex_binary_path`` is a two-branch shell script there. The
peer runs ``BIN app-server --listen stdio://``: at start-up once with its service
``CODEX_HOME``, to check that the account there is signed in with the required plan
(``initialize``, then ``account/read`` must answer ``planType`` ``pro``), where the
script prints those two answers and waits; then once per session (with a copy of the
service home's ``auth.json``, so a stub ``{}`` is there), where it runs the lean
app-server, which takes no ``--listen`` argument.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import selectors
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import lean, wrk
from bench.ab import calls, load_average
from bench.common import (
    HOST,
    Bridge,
    child_pids,
    cpu_ns,
    free_port,
    http_json,
    log,
    raise_fd_limit,
    stop_process,
    wait_until_healthy,
)

ANSWER = re.compile(rb'\ndata: \{"id":(\d+),')  # a JSON-RPC answer on the Go peer's stream
END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked response: the stream is over
LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)

CONNECTIONS = 64
#: The four runs of a round: each proxy under this module's client (a call is answered
#: when its answer reaches the client), then under wrk (for the Go peer: 202s on a
#: session whose answers nobody reads, the least work it can do per call).
COLUMNS = ("bridge", "Go peer", "bridge, wrk", "Go peer, wrk")
#: What the Go peer's session is sent in each call (its policy refuses ``bench/ping``).
GO_CALL = {"jsonrpc": "2.0", "id": 1, "method": "model/list", "params": {}}

WRAPPER = """#!/bin/sh
# codex_binary_path of the Go peer under bench.peer: answers its start-up plan check,
# runs the app-server of its sessions (the lean one takes no --listen argument).
if [ "$CODEX_HOME" = {service_home} ]; then
  printf '%s\\n' '{{"id":"probe-init","result":{{}}}}' \\
    '{{"id":"probe-account","result":{{"planType":"pro"}}}}'
  exec cat >/dev/null
fi
exec {lean}
"""


class Driver:
    """``len(requests)`` calls in flight on keep-alive connections, each connection sending
    its next call as soon as its last is answered, for ``seconds``.

    For the bridge a call is answered by its HTTP response. For the Go peer it is answered
    by the JSON-RPC answer carrying the connection's id on the session's event stream
    (``events``, an open SSE response); the connection's own 202 is read and checked
    beside it. One thread, non-blocking sockets, a selector: it drives both proxies alike,
    and its own CPU per call (about 20 µs) is printed beside theirs.
    """

    def __init__(
        self, port: int, requests: list[bytes], status: bytes, events: socket.socket | None
    ) -> None:
        self.requests = requests
        self.status = status
        self.events = events
        self.conns = [socket.create_connection((HOST, port)) for _ in requests]
        for conn in self.conns:
            conn.setblocking(False)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()

    def _send(self, index: int) -> None:
        request = self.requests[index]
        # A few hundred bytes into an idle connection's empty buffer: all or nothing.
        if self.conns[index].send(request) != len(request):
            raise RuntimeError("a request did not fit its connection's send buffer")

    def run(
        self, seconds: float = math.inf, calls: int | None = None, patience: float = 10.0
    ) -> tuple[int, int]:
        """(calls answered within ``seconds``, calls answered in all): once the time is
        up, or ``calls`` have been sent, no call is sent, and the ones in flight are
        waited for (each answer within ``patience`` seconds of the last)."""
        budget = math.inf if calls is None else calls
        sent = min(len(self.conns), budget)
        selector = selectors.DefaultSelector()
        for index, conn in enumerate(self.conns):
            selector.register(conn, selectors.EVENT_READ, index)
        if self.events is not None:
            selector.register(self.events, selectors.EVENT_READ, -1)
        buffers = [b""] * len(self.conns)
        stream = b""
        in_flight = sent
        within = answered = 0
        deadline = time.monotonic() + seconds
        now = time.monotonic()

        def answer(index: int) -> None:
            nonlocal in_flight, within, answered, sent
            answered += 1
            if now < deadline:
                within += 1
            if now < deadline and sent < budget:
                sent += 1
                self._send(index)
            else:
                in_flight -= 1

        for index in range(int(sent)):
            self._send(index)
        try:
            while in_flight:
                ready = selector.select(timeout=patience)
                if not ready:
                    raise RuntimeError(
                        f"no answer within {patience:g} s ({in_flight} calls in flight)"
                    )
                now = time.monotonic()
                for key, _ in ready:
                    index = key.data
                    data = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
                    if not data:
                        raise RuntimeError("a connection closed during the run")
                    if index < 0:
                        stream += data
                        cut = stream.rfind(b"\n\n")
                        if cut < 0:
                            continue
                        for match in ANSWER.finditer(stream, 0, cut):
                            answer(int(match.group(1)))
                        if END in stream:
                            raise RuntimeError(
                                "the Go peer closed the event stream (it drops a reader "
                                "that falls 128 events behind)"
                            )
                        stream = stream[cut + 2 :]
                        continue
                    buffer = buffers[index] + data
                    while (head := buffer.find(b"\r\n\r\n")) >= 0:
                        length = LENGTH.search(buffer, 0, head)
                        end = head + 4 + (int(length.group(1)) if length else 0)
                        if len(buffer) < end:
                            break
                        if buffer[9:12] != self.status:
                            raise RuntimeError(f"unexpected answer: {buffer[:end]!r}")
                        buffer = buffer[end:]
                        if self.events is None:
                            answer(index)
                    buffers[index] = buffer
        finally:
            selector.close()
        return within, answered


def post(port: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    """One HTTP/1.1 request, as bytes, of the kind wrk sends."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
    for name, value in {"Content-Type": "application/json", **headers}.items():
        head += f"{name}: {value}\r\n"
    head += f"Content-Length: {len(payload)}\r\n\r\n"
    return head.encode() + payload


class GoPeer:
    """The Go peer on a free loopback port, with its session's app-server ``app_server``."""

    def __init__(self, binary: Path, app_server: list[str]) -> None:
        self.binary = binary
        self.app_server = app_server
        self.port = free_port()
        self.token = secrets.token_urlsafe(24)
        self.proc: subprocess.Popen[bytes] | None = None
        self.events: socket.socket | None = None
        self.session = ""
        self._dir = tempfile.TemporaryDirectory(prefix="bench-peer-")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def __enter__(self) -> GoPeer:
        root = Path(self._dir.name)
        service_home = root / "service-home"
        service_home.mkdir()
        (service_home / "auth.json").write_text("{}\n")  # copied into every session's home
        (root / "workspace").mkdir()
        wrapper = root / "codex"
        wrapper.write_text(
            WRAPPER.format(
                service_home=shlex.quote(str(service_home)), lean=shlex.join(self.app_server)
            )
        )
        wrapper.chmod(0o700)
        digest = hashlib.sha256(self.token.encode()).hexdigest()
        config = {
            "listen_addr": f"{HOST}:{self.port}",
            "workspace_root": str(root / "workspace"),
            "data_dir": str(root / "data"),
            "service_codex_home": str(service_home),
            "codex_binary_path": str(wrapper),
            "max_sessions": 4,
            "api_keys": [{"id": "bench", "hash": f"sha256:{digest}", "role": "user"}],
        }
        (root / "config.json").write_text(json.dumps(config, indent=2))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REST_ADAPTER_", "FAKE_"))}
        self.log = (root / "peer.log").open("wb")
        self.proc = subprocess.Popen(
            [str(self.binary), "-config", str(root / "config.json")],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_until_up()
        except BaseException:
            self.__exit__(None, None, None)  # not called by `with` when entering fails
            raise
        return self

    def _wait_until_up(self) -> None:
        assert self.proc is not None
        wait_until_healthy(self.proc, self.port, "/healthz", "Go peer", self.output)

    def output(self) -> str:
        """The end of what the Go peer has written (it logs to stdout)."""
        self.log.flush()
        return (Path(self._dir.name) / "peer.log").read_text(errors="replace")[-4000:]

    def create_session(self) -> str:
        """A session, its event stream open (``self.events``) and its app-server
        initialized, as a client of the peer does it."""
        status, body = http_json(self.port, "POST", "/v1/sessions", {}, headers=self.auth)
        if status != 201:
            raise RuntimeError(f"creating a Go peer session: {status} {body}")
        session = str(body["sessionId"])
        self.events = socket.create_connection((HOST, self.port), timeout=10)
        self.events.sendall(
            f"GET /v1/sessions/{session}/events HTTP/1.1\r\nHost: {HOST}:{self.port}\r\n"
            f"Authorization: Bearer {self.token}\r\nAccept: text/event-stream\r\n\r\n".encode()
        )
        initialize = {"clientInfo": {"name": "bench", "version": "0"}}
        self.rpc(session, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": initialize})
        self.rpc(session, {"jsonrpc": "2.0", "method": "initialized"})
        self.rpc(session, {**GO_CALL, "id": 1})
        seen = b""
        while b'data: {"id":1,' not in seen:
            chunk = self.events.recv(65536)
            if not chunk:
                raise RuntimeError(f"the Go peer's event stream ended: {seen!r}")
            seen += chunk
        if b'"id":1,"error":{"code":-32600,"message":"Invalid request' not in seen:
            raise RuntimeError(f"unexpected answer on the Go peer's stream: {seen!r}")
        self.session = session
        return session

    def unread_session(self) -> str:
        """A second session, initialized, whose answers nobody reads (no event stream)."""
        status, body = http_json(self.port, "POST", "/v1/sessions", {}, headers=self.auth)
        if status != 201:
            raise RuntimeError(f"creating a Go peer session: {status} {body}")
        session = str(body["sessionId"])
        initialize = {"clientInfo": {"name": "bench", "version": "0"}}
        self.rpc(session, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": initialize})
        self.rpc(session, {"jsonrpc": "2.0", "method": "initialized"})
        return session

    def rpc(self, session: str, message: dict[str, Any]) -> None:
        path = f"/v1/sessions/{session}/rpc"
        status, body = http_json(self.port, "POST", path, message, headers=self.auth)
        if status != 202:
            raise RuntimeError(f"{message.get('method')} through the Go peer: {status} {body}")

    def __exit__(self, *exc: object) -> None:
        if self.events is not None:
            self.events.close()
        if self.proc is not None:
            stop_process(self.proc)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # Its app-servers are in its process group: none outlives a run.
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc = None
            self.log.close()
        self._dir.cleanup()


def app_servers_cpu_ns(pid: int) -> int:
    return sum(cpu_ns(child) for child in child_pids(pid))


def measure(pid: int, driver: Driver, seconds: int) -> dict[str, float]:
    """One run of ``driver``: calls/s, and the CPU per call of the proxy ``pid`` and of
    its app-servers."""
    proxy0, app_servers0, client0 = cpu_ns(pid), app_servers_cpu_ns(pid), time.thread_time_ns()
    within, answered = driver.run(seconds)
    return {
        "calls/s": within / seconds,
        "proxy CPU µs/call": (cpu_ns(pid) - proxy0) / answered / 1e3,
        "app-server CPU µs/call": (app_servers_cpu_ns(pid) - app_servers0) / answered / 1e3,
        "client CPU µs/call": (time.thread_time_ns() - client0) / answered / 1e3,
    }


def unread(peer: GoPeer, url: str, seconds: int) -> dict[str, float]:
    """wrk at 64 connections on the Go peer's session that nobody reads answers from."""
    proxy0, app_servers0 = cpu_ns(peer.pid), app_servers_cpu_ns(peer.pid)
    lua = wrk.lua_post(GO_CALL, headers=peer.auth)
    result, _ = wrk.run(url, connections=CONNECTIONS, seconds=seconds, lua=lua)
    if result.errors or result.status_errors:
        raise RuntimeError(f"wrk against the Go peer: {result}")
    return {
        "calls/s": result.rate,
        "proxy CPU µs/call": (cpu_ns(peer.pid) - proxy0) / result.requests / 1e3,
        "app-server CPU µs/call": (app_servers_cpu_ns(peer.pid) - app_servers0)
        / result.requests
        / 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--go-peer", required=True, type=Path, help="the Go peer's binary")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=int, default=5, help="of each run")
    parser.add_argument("--loop", choices=["default", "asyncio", "uvloop"], default="default")
    args = parser.parse_args(argv)
    if not os.access(args.go_peer, os.X_OK):
        parser.error(f"{args.go_peer} is not an executable file (bench/README.md: the Go peer)")
    raise_fd_limit()
    app_server = lean.argv("auto")
    log(f"app-server: lean ({lean.kind_of(app_server)}); load average {load_average()}")
    results: dict[str, dict[str, list[float]]] = {name: {} for name in COLUMNS}
    loads: list[float] = []
    with contextlib.ExitStack() as stack:
        loop = None if args.loop == "default" else args.loop
        bridge = stack.enter_context(Bridge(loop=loop, app_server=app_server))
        peer = stack.enter_context(GoPeer(args.go_peer, app_server))
        call = f"/v1/sessions/{bridge.create_session()}/call/bench/ping"
        bridge_driver = Driver(
            bridge.port, [post(bridge.port, call, {"params": {}}, {})] * CONNECTIONS, b"200", None
        )
        rpc = f"/v1/sessions/{peer.create_session()}/rpc"
        go_requests = [
            post(peer.port, rpc, {**GO_CALL, "id": index}, peer.auth)
            for index in range(CONNECTIONS)
        ]
        go_driver = Driver(peer.port, go_requests, b"202", peer.events)
        stack.callback(bridge_driver.close)
        stack.callback(go_driver.close)
        bridge_url = f"{bridge.base}{call}"
        unread_url = f"http://{HOST}:{peer.port}/v1/sessions/{peer.unread_session()}/rpc"

        def bridge_wrk(seconds: int) -> dict[str, float]:
            found = calls(bridge, bridge_url, CONNECTIONS, seconds)
            cpu = found.pop("bridge CPU µs/call")
            return {"proxy CPU µs/call": cpu, **found}

        runs: dict[str, Callable[[int], dict[str, float]]] = {
            "bridge": lambda seconds: measure(bridge.pid, bridge_driver, seconds),
            "Go peer": lambda seconds: measure(peer.pid, go_driver, seconds),
            "bridge, wrk": bridge_wrk,
            "Go peer, wrk": lambda seconds: unread(peer, unread_url, seconds),
        }
        for run in runs.values():
            run(1)  # warm-up
        for index in range(args.rounds):
            loads.append(os.getloadavg()[0])
            order = list(runs.items())
            if index % 2:
                order.reverse()
            figures = {name: run(args.seconds) for name, run in order}
            for name, values in figures.items():
                for key, value in values.items():
                    results[name].setdefault(key, []).append(value)
            log(
                f"round {index + 1}/{args.rounds} (load {loads[-1]:.1f}): "
                + "; ".join(
                    f"{name} {values['proxy CPU µs/call']:.1f} µs/call, "
                    f"{values['calls/s']:,.0f} calls/s"
                    for name, values in figures.items()
                )
            )
        loads.append(os.getloadavg()[0])
    print_table(results, f"{args.rounds} rounds of {args.seconds} s, {args.loop} loop")
    print(f"\nload average (1 min) over the rounds: {min(loads):.1f}-{max(loads):.1f}")
    return 0


def print_table(results: dict[str, dict[str, list[float]]], what: str) -> None:
    """Medians (min-max) per column, and the bridge's over the Go peer's per client."""
    keys = list(dict.fromkeys(key for column in results.values() for key in column))
    print(f"| {what} | " + " | ".join(COLUMNS) + " | bridge / Go peer |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for key in keys:
        cells = []
        for name in COLUMNS:
            values = results[name].get(key)
            cells.append(
                f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"
                if values
                else "-"
            )
        ratios = []
        for bridge, peer in (("bridge", "Go peer"), ("bridge, wrk", "Go peer, wrk")):
            if results[bridge].get(key) and results[peer].get(key):
                median = statistics.median(results[peer][key])
                ratios.append(f"{statistics.median(results[bridge][key]) / median:.2f}")
            else:
                ratios.append("-")
        print(f"| {key} | " + " | ".join(cells) + " | " + " / ".join(ratios) + " |")


if __name__ == "__main__":
    sys.exit(main())
