"""Load clients that run in their own processes: ``python -m bench.clients KIND ...``.

Each speaks raw HTTP/1.1 over loopback sockets (no client library on the hot path)
and reports JSON lines on stdout, including its own CPU time, so RESULTS.md can show
that the client was not the bottleneck. Every loop is bounded by a deadline.

    sse       PORT SESSION AFTER TARGET     one SSE reader until event TARGET
    longpoll  PORT SESSION TARGET SECONDS   one long-poll reader until event TARGET
    idle      PORT SSE LONGPOLL SESSION...  hold idle streams and long-polls open
    sessions  PORT COUNT                    COUNT concurrent creates, then deletes
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import selectors
import socket
import sys
import time
from typing import Any

HOST = "127.0.0.1"
# Every client gives up after this long (BENCH_CLIENT_SECONDS overrides it).
DEADLINE = float(os.environ.get("BENCH_CLIENT_SECONDS", "120"))
READ_SIZE = 1 << 20


def emit(**fields: Any) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    fields["client_cpu"] = usage.ru_utime + usage.ru_stime
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=DEADLINE)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()


def read_head(sock: socket.socket, buffer: bytearray) -> tuple[int, int | None]:
    """Read a response head into ``buffer``; (status, content-length) and the head consumed."""
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        chunk = sock.recv(READ_SIZE)
        if not chunk:
            raise EOFError("the bridge closed the connection")
        buffer += chunk
    head = bytes(buffer[:end]).lower()
    del buffer[: end + 4]
    status = int(head[9:12])
    length = None
    at = head.find(b"\r\ncontent-length:")
    if at >= 0:
        stop = head.find(b"\r\n", at + 2)
        length = int(head[at + 17 : stop if stop >= 0 else len(head)])
    return status, length


# -- SSE --------------------------------------------------------------------------------


def sse(port: int, session: str, after: int, target: int, pause: float = 0.0) -> None:
    """Read one event stream until the event with seq ``target`` has arrived.

    With ``pause``, stop reading for that many seconds first (a reader that stalls).
    """
    sock = connect(port)
    sock.sendall(get(f"/v1/sessions/{session}/events/stream?after={after}"))
    buffer = bytearray()
    status, _ = read_head(sock, buffer)
    if status != 200:
        emit(error=f"status {status}")
        return
    emit(ready=True)
    if pause:
        time.sleep(pause)
    events = gaps = 0
    last_seq = after
    pending = b"\n" + bytes(buffer)  # frames start after a newline: "\nid: N\nevent: K\n"
    limit = time.monotonic() + DEADLINE
    first_at = None
    while last_seq < target and time.monotonic() < limit:
        cut = pending.rfind(b"\n\n")
        if cut >= 0:
            complete, pending = pending[: cut + 1], pending[cut + 1 :]
            events += complete.count(b"\nevent: ")
            gaps += complete.count(b"\nevent: gap\n")
            at = complete.rfind(b"\nid: ")
            if at >= 0:
                last_seq = int(complete[at + 5 : complete.find(b"\n", at + 5)])
                if first_at is None:
                    first_at = time.monotonic()
            if last_seq >= target:
                break
        chunk = sock.recv(READ_SIZE)
        if not chunk:
            break
        pending += chunk
    done_at = time.monotonic()
    sock.close()
    emit(done_at=done_at, first_at=first_at, events=events, gaps=gaps, last_seq=last_seq)


# -- long-poll ----------------------------------------------------------------------------


def longpoll(port: int, session: str, target: int, seconds: float) -> None:
    """Long-poll the session's cursor, one event per request, until seq ``target``, or
    until ``seconds`` have passed since the first event."""
    sock = connect(port)
    request = get(f"/v1/sessions/{session}/events?waitMs=10000")
    buffer = bytearray()
    emit(ready=True)
    events = empty = requests = 0
    last_seq = 0
    first_at = None
    limit = time.monotonic() + DEADLINE
    while last_seq < target and time.monotonic() < limit:
        if first_at is not None and time.monotonic() - first_at > seconds:
            break
        sock.sendall(request)
        requests += 1
        status, length = read_head(sock, buffer)
        length = length or 0
        while len(buffer) < length:
            chunk = sock.recv(READ_SIZE)
            if not chunk:
                raise EOFError("the bridge closed the connection")
            buffer += chunk
        body = bytes(buffer[:length])
        del buffer[:length]
        if status == 204:
            empty += 1
            continue
        if status != 200:
            emit(error=f"status {status}: {body[:200]!r}")
            return
        events += 1
        if first_at is None:
            first_at = time.monotonic()
        # {"seq":N,...}: orjson writes seq first.
        last_seq = int(body[7 : body.index(b",")])
    done_at = time.monotonic()
    sock.close()
    emit(
        done_at=done_at,
        first_at=first_at,
        events=events,
        empty=empty,
        requests=requests,
        last_seq=last_seq,
    )


# -- idle connections -----------------------------------------------------------------------


def idle(port: int, streams: int, polls: int, sessions: list[str]) -> None:
    """Open ``streams`` SSE streams and ``polls`` long-polls, hold them until stdin closes."""
    socks: list[socket.socket] = []
    selector = selectors.DefaultSelector()
    for index in range(streams + polls):
        session = sessions[index % len(sessions)]
        if index < streams:
            path = f"/v1/sessions/{session}/events/stream"
        else:
            path = f"/v1/sessions/{session}/events?waitMs=600000"
        for attempt in range(50):
            try:
                sock = connect(port)
                break
            except OSError:
                time.sleep(0.05 * (attempt + 1))
        else:
            emit(error=f"could not open connection {index}")
            return
        sock.sendall(get(path))
        sock.setblocking(False)
        socks.append(sock)
        if index < streams:
            selector.register(sock, selectors.EVENT_READ, index)
    # Every stream has answered 200 with its headers before we call it idle.
    waiting = set(range(streams))
    heads: dict[int, bytes] = {}
    limit = time.monotonic() + 60
    while waiting and time.monotonic() < limit:
        for key, _ in selector.select(1.0):
            index = key.data
            heads[index] = heads.get(index, b"") + key.fileobj.recv(65536)  # type: ignore[union-attr]
            if b"\r\n\r\n" in heads[index]:
                if not heads[index].startswith(b"HTTP/1.1 200"):
                    emit(error=f"stream {index}: {heads[index][:100]!r}")
                    return
                waiting.discard(index)
                selector.unregister(key.fileobj)
    if waiting:
        emit(error=f"{len(waiting)} streams did not start")
        return
    emit(ready=True, open=len(socks))
    sys.stdin.readline()  # the driver closes our stdin when it has measured
    for sock in socks:
        sock.close()
    emit(closed=len(socks))


# -- concurrent session creation ------------------------------------------------------------


async def _request(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        writer.write(head + body)
        raw = await reader.read()
    finally:
        writer.close()
    status = int(raw[9:12])
    return status, raw[raw.find(b"\r\n\r\n") + 4 :]


async def _timed(port: int, method: str, path: str, body: bytes = b"") -> tuple[float, int, bytes]:
    start = time.perf_counter()
    status, payload = await _request(port, method, path, body)
    return time.perf_counter() - start, status, payload


async def _sessions(port: int, count: int) -> None:
    start = time.perf_counter()
    async with asyncio.timeout(DEADLINE):
        created = await asyncio.gather(
            *(_timed(port, "POST", "/v1/sessions", b"{}") for _ in range(count))
        )
    wall = time.perf_counter() - start
    failures = [p[:200].decode() for _, s, p in created if s != 201]
    ids = [json.loads(p)["sessionId"] for _, s, p in created if s == 201]
    emit(created=len(ids), failures=failures[:3], latencies=[t for t, _, _ in created], wall=wall)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    start = time.perf_counter()
    async with asyncio.timeout(DEADLINE):
        deleted = await asyncio.gather(
            *(_timed(port, "DELETE", f"/v1/sessions/{sid}") for sid in ids)
        )
    wall = time.perf_counter() - start
    emit(
        deleted=sum(1 for _, s, _ in deleted if s == 200),
        latencies=[t for t, _, _ in deleted],
        wall=wall,
    )


def main(argv: list[str]) -> None:
    kind, port = argv[0], int(argv[1])
    if kind == "sse":
        sse(port, argv[2], int(argv[3]), int(argv[4]), float(argv[5]) if len(argv) > 5 else 0.0)
    elif kind == "longpoll":
        longpoll(port, argv[2], int(argv[3]), float(argv[4]))
    elif kind == "idle":
        idle(port, int(argv[2]), int(argv[3]), argv[4:])
    elif kind == "sessions":
        asyncio.run(_sessions(port, int(argv[2])))
    else:
        raise SystemExit(f"unknown client {kind!r}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
