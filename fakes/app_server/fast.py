"""The fast start: the opening of a script-less session, answered without asyncio.

A bridge spawns an app-server, sends `initialize` and `initialized`, and often does
nothing else for a while (or closes it). Importing asyncio and the server costs a
fake-codex start several times a bare interpreter's CPU, which is what a benchmark of
200 concurrent spawns measures. So a script-less fake-codex first serves stdin with
blocking reads: blank lines, the first well-formed `initialize` request, and the
`initialized` notification are answered here, byte for byte as the asyncio server
answers them (same ids, same clock, seeded or not). The first message of any other
kind ends the fast start with the bytes read so far and the state reached, which the
caller hands to the asyncio server (`server.serve(resume=...)`); end of input before
that exits 0, as the server does.

`FAKE_CODEX_FAST=0` turns the fast start off (tests compare both paths).
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

import orjson

from fakes.app_server import protocol, shapes
from fakes.app_server.ids import IdFactory
from fakes.app_server.wire import (
    READ_CHUNK,
    encode,
    notification,
    open_wire_log,
    request_id_of,
    response,
    too_deep,
    use_virtual_clock,
    write_all,
)

if TYPE_CHECKING:
    from fakes.app_server.protocol import Fit


class FastStart:
    """Where the fast start stopped: what the asyncio server resumes from.

    A plain class: importing `dataclasses` alone costs a start about 13 ms.
    """

    def __init__(self, ids: IdFactory) -> None:
        self.ids = ids
        self.initialized = False
        self.saw_initialized = False
        self.client_info: dict[str, Any] = {}
        self.unread = b""


class _StdoutGone(Exception):
    """The client closed our stdout: the server would exit 0."""


def serve_fast(*, seed: int | None, version_output: str) -> int | FastStart:
    """Serve stdio until a message needs the asyncio server.

    Returns the exit status if the session ended here, else where it stopped: what
    the asyncio server resumes from."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    use_virtual_clock(seed)
    state = FastStart(ids=IdFactory(seed))
    version = shapes.cli_version(version_output)
    buffer = bytearray()
    tee = open_wire_log()
    tee_in = open_wire_log(".in")
    try:
        while True:
            newline = buffer.find(b"\n")
            if newline < 0:
                chunk = os.read(0, READ_CHUNK)
                if not chunk:
                    if buffer.strip():
                        break  # a last line without a newline: the server's to judge
                    return 0
                buffer += chunk
                continue
            out = _answer(bytes(buffer[:newline]), state, version)
            if out is None:
                break
            if tee_in is not None:
                tee_in.write(bytes(buffer[: newline + 1]))
            if out:
                if tee is not None:
                    tee.write(out)
                write_all(1, out)
            del buffer[: newline + 1]
    except (BrokenPipeError, _StdoutGone):
        return 0
    finally:
        for file in (tee, tee_in):
            if file is not None:
                file.close()
    state.unread = bytes(buffer)
    return state


def _answer(line: bytes, state: FastStart, version: str) -> bytes | None:
    """The bytes that answer ``line`` (b"" for none), or None: the server's to answer."""
    if not line.strip():
        return b""
    try:
        message = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if too_deep(line, message) or not isinstance(message, dict):
        return None
    method = message.get("method")
    if method == "initialized" and "id" not in message:
        if state.initialized:
            state.saw_initialized = True
            return b""
        return None
    request_id = request_id_of(message)
    params = message.get("params")
    if (
        method != "initialize"
        or state.initialized
        or request_id is None
        or not isinstance(params, dict)
        or "clientInfo" not in params
    ):
        return None
    client_info = params["clientInfo"]
    info = client_info if isinstance(client_info, dict) else {}
    state.initialized = True
    state.client_info = info
    # As AppServer.answer writes it: the reply and the remote control status, one write.
    fit = protocol.fitting(version)
    result = fit.result("initialize", shapes.initialize_result(info, version))
    return encode(response(request_id, result)) + remote_control_line(state.ids, fit)


def remote_control_line(ids: IdFactory, fit: Fit) -> bytes:
    """What follows a successful `initialize` reply at once, as from the real server:
    its remote control status (off)."""
    status = shapes.remote_control_status(ids.uuid4())
    method = "remoteControl/status/changed"
    return encode(notification(method, fit.notification(method, status)))
