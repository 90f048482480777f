"""A lean app-server for the benchmarks: the least CPU per call a bridge can be given.

Not shipped, not a fake for tests (that is fake-codex): just enough of ``codex
app-server``'s stdio protocol for the bridge to spawn it, initialize it and send it
the benchmarks' calls, at a few µs of CPU per call, so that a benchmark measures the
bridge (and nginx) rather than the app-server behind them.

- ``initialize`` answers the real result's shape; ``initialized`` is taken; a request
  before it gets the real ``-32600 Not initialized``, a second ``initialize``
  ``Already initialized``, a request without ``params`` ``missing field `params```.
- ``bench/ping`` answers ``{"ok":true}`` at once.
- ``bench/flood`` writes 100,000 ``item/agentMessage/delta`` notifications, then
  answers ``{"flooded":100000}`` (as ``bench/fake_script.yaml`` has fake-codex do).
- Any other request gets the real ``-32600 Invalid request: unknown variant`` error;
  notifications and responses from the client are read and dropped.

One blocking loop: a large ``os.read``, the lines split at once, the answers of a read
joined and written with one ``os.write``. Each request line is parsed (orjson) so that
any id the client chooses comes back as it was sent. It exits when stdin closes.

Run: ``python bench/lean/lean_app_server.py`` (``app-server`` as an argument is
accepted and ignored, so that it can stand where ``codex app-server`` stands).
"""

from __future__ import annotations

import os
import sys

import orjson

READ_SIZE = 1 << 20
FLOOD = 100_000
FLOOD_CHUNK = 1 << 20
VERSION = "0.169.0"
INVALID_REQUEST = -32600


def _initialize_result(params: object) -> bytes:
    info = params.get("clientInfo") if isinstance(params, dict) else None
    name = str(info.get("name", "")) if isinstance(info, dict) else ""
    client_version = str(info.get("version", "")) if isinstance(info, dict) else ""
    uname = os.uname()
    agent = (
        f"{name}/{VERSION} ({uname.sysname} {uname.release}; {uname.machine}) "
        f"{os.environ.get('TERM', 'unknown')} ({name}; {client_version})"
    )
    home = os.environ.get("CODEX_HOME") or os.path.join(os.path.expanduser("~"), ".codex")
    return orjson.dumps(
        {"userAgent": agent, "codexHome": home, "platformFamily": "unix", "platformOs": "linux"}
    )


def _error(request_id: bytes, message: str) -> bytes:
    error = orjson.dumps({"code": INVALID_REQUEST, "message": message})
    return b'{"id":' + request_id + b',"error":' + error + b"}\n"


def _unknown(method: str) -> str:
    """The real server's text, with its list of methods when fake-codex's copy is at hand."""
    text = f"Invalid request: unknown variant `{method}`"
    try:
        from fakes.app_server.protocol import DEFAULT_VERSION, profile
    except ImportError:
        return text
    known = profile(DEFAULT_VERSION).client_requests
    return text + ", expected one of " + ", ".join(f"`{m}`" for m in known)


def _flood_chunks() -> list[bytes]:
    line = (
        b'{"method":"item/agentMessage/delta","params":{"threadId":"","turnId":"",'
        b'"itemId":"msg_lean","delta":"x"}}\n'
    )
    per_chunk = max(1, FLOOD_CHUNK // len(line))
    full, rest = divmod(FLOOD, per_chunk)
    return [line * per_chunk] * full + [line * rest]


def write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(1, view) :]


def serve() -> int:
    initialized = False
    pending = b""
    loads = orjson.loads
    dumps = orjson.dumps
    ping_result = b',"result":{"ok":true}}\n'
    while True:
        try:
            chunk = os.read(0, READ_SIZE)
        except InterruptedError:  # pragma: no cover - PEP 475 retries already
            continue
        if not chunk:
            return 0
        lines = (pending + chunk).split(b"\n") if pending else chunk.split(b"\n")
        pending = lines.pop()
        out: list[bytes] = []
        for line in lines:
            if not line:
                continue
            try:
                message = loads(line)
            except orjson.JSONDecodeError:
                continue  # the real server logs a parse error and carries on
            if not isinstance(message, dict):
                continue
            method = message.get("method")
            if "id" not in message or not isinstance(method, str):
                if method == "initialized":
                    initialized = True
                continue  # a notification, or the client's answer to a request
            request_id = dumps(message["id"])
            if method == "bench/ping" and initialized and "params" in message:
                out.append(b'{"id":' + request_id + ping_result)
            elif "params" not in message:
                out.append(_error(request_id, "Invalid request: missing field `params`"))
            elif method == "initialize":
                if initialized:
                    out.append(_error(request_id, "Already initialized"))
                else:
                    result = _initialize_result(message["params"])
                    out.append(b'{"id":' + request_id + b',"result":' + result + b"}\n")
            elif not initialized:
                out.append(_error(request_id, "Not initialized"))
            elif method == "bench/flood":
                write_all(b"".join(out))
                out.clear()
                for piece in _flood_chunks():
                    write_all(piece)
                out.append(b'{"id":' + request_id + b',"result":{"flooded":100000}}\n')
            else:
                out.append(_error(request_id, _unknown(method)))
        if out:
            write_all(out[0] if len(out) == 1 else b"".join(out))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] not in ("app-server",):
        print(f"lean app-server: unexpected arguments {args}", file=sys.stderr)
        return 2
    try:
        return serve()
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
