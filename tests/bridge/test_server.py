"""The bridge's HTTP connections (bridge/server.py), as raw bytes on a real socket.

Every test talks to a real `rest-bridge serve` (bearer auth on, the fake app-server),
alone or behind its nginx front (bridge_ops/front.py), with bytes no HTTP client would send:
request heads over the bounds, heads that never end, requests the parser refuses,
pipelined requests. What the bridge refuses itself is answered with the error payload;
what aiohttp's parser refuses before any of the bridge's code runs gets aiohttp's own
400, and the front answers all of it with the error payload. The token in the request
never comes back nor reaches the log.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from processes import start_nginx

from bridge.limits import RestLimits
from bridge_ops.front import FrontSettings, Replica, render

TOKEN = "s3cret-bridge-token-0fd2"
AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
FAKE = str(Path(sys.executable).with_name("fake-codex")) + " app-server"
#: How long a test waits on the bridge for anything (it answers in milliseconds).
WAIT = 60.0


@dataclass
class Bridge:
    process: subprocess.Popen[str]
    port: int
    stderr: Path

    def stop(self) -> str:
        """Stop the bridge; its whole stderr."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=WAIT)
        return self.stderr.read_text()


def start_bridge(tmp: Path, **limits: int) -> Bridge:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    env["REST_ADAPTER_TOKEN"] = TOKEN
    env.update({f"REST_ADAPTER_{name.upper()}": str(value) for name, value in limits.items()})
    stderr = tmp / f"bridge-{len(list(tmp.glob('bridge-*')))}.stderr"
    with stderr.open("w") as err:
        process = subprocess.Popen(
            [REST_BRIDGE, "serve", "--port", "0", "--app-server", FAKE],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    assert process.stdout is not None
    for line in process.stdout:  # waits on the bridge's own words
        found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if found:
            # The rest of stdout is not read: close it so the bridge never blocks on it.
            return Bridge(process, int(found.group(1)), stderr)
    process.wait(timeout=WAIT)
    pytest.fail(f"the bridge did not start: {stderr.read_text()}")


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bridge]:
    served = start_bridge(tmp_path_factory.mktemp("server"))
    yield served
    served.stop()
    assert served.process.returncode == 0


@dataclass
class Front:
    """nginx before a bridge, configured by `bridge_ops.front`."""

    process: subprocess.Popen[str]
    port: int

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=WAIT)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_front(tmp: Path, bridge: Bridge, **limits: int) -> Front:
    """nginx on a free port before ``bridge``, its bounds from ``limits``."""
    port = free_port()
    config = render(
        [Replica("bridge-0", f"127.0.0.1:{bridge.port}")],
        RestLimits(**limits),
        FrontSettings(listen=f"127.0.0.1:{port}", runtime_dir=str(tmp)),
    )
    return Front(start_nginx(tmp, config), port)


@pytest.fixture(scope="module")
def front(bridge: Bridge, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    served = start_front(tmp_path_factory.mktemp("front"), bridge)
    yield served
    served.stop()


def exchange(port: int, *chunks: bytes) -> bytes:
    """Send ``chunks`` (one write each) and read until the bridge closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        for chunk in chunks:
            sock.sendall(chunk)
        received = bytearray()
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            received += data
    return bytes(received)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def responses(raw: bytes) -> list[Response]:
    """The HTTP/1.1 responses in ``raw``, each with a Content-Length."""
    out: list[Response] = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"an incomplete response: {raw[:200]!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        out.append(Response(int(status_line.split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return out


def only_response(raw: bytes) -> Response:
    [response] = responses(raw)
    return response


def assert_error_payload(response: Response, status: int, kind: str | None = None) -> None:
    assert response.status == status, response
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) <= {"error", "message", "code", "data"}
    assert isinstance(body["error"], str)
    assert isinstance(body["message"], str)
    if kind is not None:
        assert body["error"] == kind
    assert TOKEN.encode() not in response.body


def head(*headers: bytes, target: bytes = b"/health", method: bytes = b"GET") -> bytes:
    return method + b" " + target + b" HTTP/1.1\r\nHost: bridge\r\n" + b"".join(headers) + b"\r\n"


def header(name: str, size: int) -> bytes:
    """A header line of ``size`` bytes in all (CRLF included)."""
    prefix = f"{name}: ".encode()
    return prefix + b"v" * (size - len(prefix) - 2) + b"\r\n"


# -- bounded heads -----------------------------------------------------------------


def test_a_head_over_32_kib_in_all_is_431_and_closed(bridge):
    # Each line within aiohttp's own bound; five of them over MAX_HEADER_BYTES.
    lines = [header(f"X-Filler-{i}", 8000) for i in range(5)]
    raw = exchange(bridge.port, head(AUTH, *lines))
    response = only_response(raw)  # and then the connection closed
    assert_error_payload(response, 431, "headers_too_large")
    assert response.json()["data"] == {"limitBytes": 32768}
    assert response.headers["connection"] == "close"


def test_a_head_over_the_bound_sent_in_pieces_is_refused_at_the_bound(front):
    """The head is counted across reads: the front answers before the head has ended
    (the bridge sees a head only once it is whole: aiohttp has no hook before)."""
    lines = [header(f"X-Filler-{i}", 8000) for i in range(5)]
    with socket.create_connection(("127.0.0.1", front.port), timeout=WAIT) as sock:
        sock.sendall(head(AUTH)[:-2])  # not ended
        for line in lines:
            sock.sendall(line)
        response = only_response(sock.makefile("rb").read())
    assert_error_payload(response, 431, "headers_too_large")


def test_a_head_just_under_the_bound_is_served(bridge):
    request = head(header("X-Filler", 8000), header("X-Filler-2", 8000), b"Connection: close\r\n")
    assert len(request) < 32768
    response = only_response(exchange(bridge.port, request))
    assert response.status == 200
    assert response.json()["status"] == "ok"


def test_a_head_never_finished_is_closed_by_the_front_after_header_timeout(tmp_path):
    """The head's deadline is the front's (nginx's `client_header_timeout`, from
    HEADER_TIMEOUT_MS): aiohttp has no public hook for one. nginx closes the connection
    without an answer, as it does for every head that does not arrive in time."""
    bridge = start_bridge(tmp_path)
    front = start_front(tmp_path, bridge, header_timeout_ms=300)
    try:
        # The bytes arrive, the head never ends: the front closes on its own.
        assert exchange(front.port, b"GET /health HTTP/1.1\r\n" + AUTH) == b""
        # So does a second request, begun on a connection that served a first one.
        complete = head()
        raw = exchange(front.port, complete + b"GET /health HTTP/1.1\r\nHost: b")
        [first] = responses(raw)
        assert first.status == 200
    finally:
        front.stop()
        stderr = bridge.stop()
    assert TOKEN not in stderr
    assert "Traceback" not in stderr


def test_a_head_over_the_bound_waiting_for_100_continue_gets_the_431_instead(bridge):
    """No `100 Continue` for a head the bridge refuses: the client never sends the body."""
    lines = [header(f"X-Filler-{i}", 8000) for i in range(5)]
    request = head(
        AUTH,
        *lines,
        b"Expect: 100-continue\r\nContent-Type: application/json\r\nContent-Length: 2\r\n",
        target=b"/v1/sessions",
        method=b"POST",
    )
    raw = exchange(bridge.port, request)
    assert not raw.startswith(b"HTTP/1.1 100"), raw[:100]
    assert_error_payload(only_response(raw), 431, "headers_too_large")


# -- what the parser refuses ---------------------------------------------------------

CLIENT_HELLO = bytes.fromhex(
    "16030100c4010000c00303" + "ab" * 32 + "00" + "0004130113020100" + "0093" + "00" * 0x93
)

REFUSED: dict[str, tuple[bytes, int, str | None]] = {
    "10 KB header line": (head(AUTH, header("X-Big", 10_000)), 431, "headers_too_large"),
    "20 KB URL": (head(AUTH, target=b"/health?q=" + b"a" * 20_000), 414, "uri_too_long"),
    "129 headers": (
        head(AUTH, *(f"X-H{i}: v\r\n".encode() for i in range(129))),
        431,
        "headers_too_large",
    ),
    "NUL in a header": (head(AUTH, b"X-Nul: a\x00b\r\n"), 400, "bad_request"),
    "two Content-Length": (
        head(AUTH, b"Content-Length: 1\r\nContent-Length: 2\r\n", method=b"POST") + b"xy",
        400,
        "bad_request",
    ),
    "Transfer-Encoding and Content-Length": (
        head(AUTH, b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n", method=b"POST")
        + b"0\r\n\r\n",
        400,
        "bad_request",
    ),
    "method BREW": (head(AUTH, method=b"BREW"), 400, "bad_request"),
    "TLS ClientHello": (CLIENT_HELLO, 400, "bad_request"),
    "a space in the method": (head(AUTH, method=b"G ET"), 400, "bad_request"),
}


#: What aiohttp's parser refuses, before any of the bridge's code runs, and the front
#: lets through (it has no bound on the number of headers; it takes any method).
PARSER_ONLY = frozenset({"129 headers", "method BREW"})

#: What aiohttp takes for a client that speaks no HTTP (an unknown method as the first
#: request of a connection): its 400 and access line, but no WARNING line.
NOT_HTTP = frozenset({"method BREW", "TLS ClientHello", "a space in the method"})


@pytest.mark.parametrize("case", sorted(set(REFUSED) - PARSER_ONLY))
def test_refused_requests_get_the_error_payload_without_the_token(front, case):
    request, status, kind = REFUSED[case]
    raw = exchange(front.port, request)
    assert TOKEN.encode() not in raw
    response = only_response(raw)
    assert_error_payload(response, status, kind)


@pytest.mark.parametrize(
    "line",
    [
        b"Authorization: Bearer %s\x01\r\n",
        b"Authorization: Bearer %s\x7f\r\n",
        b"Authorization: Bearer %s\x1f\r\n",
        b"Authorization : Bearer %s\r\n",
        b"Authorization: Bearer\r\n %s\r\n",
        b"Authorization\x01: Bearer %s\r\n",
    ],
)
def test_a_malformed_authorization_line_never_comes_back_through_the_front(front, line):
    """aiohttp's own 400 quotes the line it refuses: a control character in the
    Authorization value is the front's 400 payload, before any replica sees it."""
    request = head(line % TOKEN.encode(), b"Connection: close\r\n", target=b"/v1/sessions")
    raw = exchange(front.port, request)
    assert TOKEN.encode() not in raw, raw
    assert_error_payload(only_response(raw), 400, "bad_request")


def test_the_front_counts_the_whitespace_of_a_head_the_bridge_alone_does_not_see(front):
    """aiohttp drops the spaces around a header's value before the bridge counts a head;
    the front counts the bytes as they arrive: 100 padded headers (800 KB) are a 431."""
    padded = [b"X-Pad-%d:%s v%s\r\n" % (i, b" " * 4000, b" " * 4000) for i in range(100)]
    raw = exchange(front.port, head(AUTH, *padded))
    assert TOKEN.encode() not in raw
    assert_error_payload(only_response(raw), 431, "headers_too_large")


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_parser_of_the_bridge_alone_refuses_with_400_and_closes(bridge, case):
    """aiohttp's own answer (plain text, before the bridge's code): the status and the
    closed connection, never the token."""
    raw = exchange(bridge.port, REFUSED[case][0])
    assert TOKEN.encode() not in raw
    assert only_response(raw).status == 400


def test_a_burst_of_refusals_is_one_warning_line_without_bytes_or_traceback(tmp_path):
    bridge = start_bridge(tmp_path)
    try:
        for _ in range(3):
            for request, _status, _kind in REFUSED.values():
                assert only_response(exchange(bridge.port, request)).status == 400
    finally:
        stderr = bridge.stop()
    assert TOKEN not in stderr
    assert "Traceback" not in stderr
    assert " ERROR " not in stderr
    warnings = [line for line in stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 2, stderr
    assert "refused a request from 127.0.0.1" in warnings[0]
    # The ones held back are counted when the bridge stops, not lost.
    # (aiohttp logs an unknown method as a connection's first request at DEBUG, as the
    # noise of a client that speaks no HTTP: those are not counted.)
    held = 3 * len(REFUSED.keys() - NOT_HTTP) - 1
    assert warnings[1].endswith(f"refused {held} more requests since the last such line")


# -- what must go on working ----------------------------------------------------------


def test_pipelined_gets_in_one_write_are_all_answered(bridge):
    requests = head() * 6 + head(b"Connection: close\r\n")
    answered = responses(exchange(bridge.port, requests))
    assert [r.status for r in answered] == [200] * 7


def test_pipelined_requests_of_many_heads_are_counted_one_by_one(bridge):
    """Twenty heads of 8 KB in one write: 160 KB in all, each under the bound."""
    one = head(header("X-Filler", 8000))
    answered = responses(exchange(bridge.port, one * 20 + head(b"Connection: close\r\n")))
    assert [r.status for r in answered] == [200] * 21


def test_a_post_with_a_body_then_a_get_in_one_write_are_both_answered(bridge):
    # The body looks like the end of a head and is bigger than the head bound.
    body = json.dumps({"params": {}, "pad": "\r\n\r\n" + "x" * 40_000}).encode()
    post = head(
        AUTH,
        b"Content-Type: application/json\r\n",
        f"Content-Length: {len(body)}\r\n".encode(),
        target=b"/v1/call/no-such-method",
        method=b"POST",
    )
    raw = exchange(
        bridge.port, post + body + head(header("X-Filler", 8000), b"Connection: close\r\n")
    )
    first, second = responses(raw)
    assert first.status != 431
    assert first.headers["content-type"].startswith("application/json")
    assert second.status == 200


def test_a_large_body_under_the_body_limit_is_read_whole(bridge):
    """A body over the head bound, sent in pieces: counted as a body, not a head."""
    body = json.dumps({"params": {}, "pad": "y" * 900_000}).encode()
    post = head(
        AUTH,
        b"Content-Type: application/json\r\n",
        f"Content-Length: {len(body)}\r\n".encode(),
        b"Connection: close\r\n",
        target=b"/v1/sessions",
        method=b"POST",
    )
    pieces = [body[i : i + 50_000] for i in range(0, len(body), 50_000)]
    response = only_response(exchange(bridge.port, post, *pieces))
    # Read and decoded whole: the bridge answers about its content, not its size.
    assert response.status in {201, 400, 422}, response
    assert response.json().get("error") not in {"payload_too_large", "headers_too_large"}
    if response.status == 201:
        session = response.json()["sessionId"]
        delete = head(AUTH, b"Connection: close\r\n", target=f"/v1/sessions/{session}".encode())
        only_response(exchange(bridge.port, delete.replace(b"GET", b"DELETE", 1)))


def test_a_long_sse_stream_is_unaffected_by_the_head_timeout(tmp_path):
    """A stream outlives HEADER_TIMEOUT_MS many times over: the timer is the head's only."""
    bridge = start_bridge(tmp_path, header_timeout_ms=200, sse_keepalive_ms=50)
    try:
        created = only_response(
            exchange(
                bridge.port,
                head(
                    AUTH,
                    b"Content-Type: application/json\r\nContent-Length: 2\r\n",
                    b"Connection: close\r\n",
                    target=b"/v1/sessions",
                    method=b"POST",
                )
                + b"{}",
            )
        )
        assert created.status == 201, created
        session = created.json()["sessionId"]
        stream = head(
            AUTH, b"Connection: close\r\n", target=f"/v1/sessions/{session}/events/stream".encode()
        )
        with socket.create_connection(("127.0.0.1", bridge.port), timeout=WAIT) as sock:
            sock.sendall(stream)
            reader = sock.makefile("rb")
            assert reader.readline().startswith(b"HTTP/1.1 200")
            # Forty keep-alive comments at 50 ms: ten header timeouts' worth of stream.
            keepalives = 0
            while keepalives < 40:
                line = reader.readline()
                assert line, "the stream ended"
                keepalives += b": keep-alive" in line
            delete = head(AUTH, b"Connection: close\r\n", target=f"/v1/sessions/{session}".encode())
            deleted = only_response(exchange(bridge.port, delete.replace(b"GET", b"DELETE", 1)))
            assert deleted.status in {200, 204}
            rest = reader.read()  # the stream ends with the exit event
            assert b"event: exit" in rest
            assert rest.endswith(b"0\r\n\r\n")
    finally:
        stderr = bridge.stop()
    assert "Traceback" not in stderr


@pytest.mark.asyncio
async def test_a_host_serving_the_app_in_its_own_runner_gets_the_head_bound(fake_codex):
    """The bound is the application's: a plain `web.AppRunner` with SERVER_SETTINGS, as a
    host would run it, refuses a head over MAX_HEADER_BYTES with the error payload."""
    import asyncio

    from aiohttp import web

    from bridge.app import SERVER_SETTINGS, trusted_bridge_app

    runner = web.AppRunner(trusted_bridge_app(fake_codex), **SERVER_SETTINGS)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        lines = [header(f"X-Filler-{i}", 8000) for i in range(5)]
        raw = await asyncio.to_thread(exchange, port, head(*lines))
    finally:
        await runner.cleanup()
    response = only_response(raw)
    assert_error_payload(response, 431, "headers_too_large")
    assert response.headers["connection"] == "close"
