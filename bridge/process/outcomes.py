"""A JSON-RPC exchange's outcome in the HTTP API's terms, for sessions and text turns.

The peer knows JSON-RPC only; what its ids and failures become for a caller of the
bridge (a request key, an error kind of :mod:`bridge.errors`) is said here, once.
"""

from __future__ import annotations

import json
import re

from bridge import errors
from bridge.process.peer import ProcessGone, RpcError, StdinFull

_INTEGER_TEXT = re.compile(r"-?[0-9]+")


def request_key(request_id: str | int) -> str:
    """The HTTP-facing key of a JSON-RPC id, one key per id: an integer's decimal digits;
    a string itself, unless it could be taken for another id's key or cannot be a path
    segment (empty, integer digits, a leading double quote): then its JSON text, quotes
    included. So ``1`` and ``"1"`` are two keys, ``"abc"`` is ``abc``.
    """
    if isinstance(request_id, str):
        if request_id and request_id[0] != '"' and not _INTEGER_TEXT.fullmatch(request_id):
            return request_id
        return json.dumps(request_id, ensure_ascii=False)
    return str(request_id)


def rpc_failure(exc: Exception, what: str) -> errors.RestError:
    """Map a failed JSON-RPC exchange to the contract's error kinds."""
    if isinstance(exc, RpcError):
        # -32001 is codex's "overloaded"
        kind = "app_server_overloaded" if exc.code == -32001 else "app_server_error"
        return errors.of_kind(kind, exc.message, code=exc.code, data=exc.data)
    if isinstance(exc, ProcessGone):
        info = exc.exit_info
        if info.protocol_error:
            return errors.of_kind("protocol_error", info.describe())
        return errors.of_kind(
            "app_server_exited",
            info.describe(),
            data={"exitCode": info.exit_code, "signal": info.signal},
        )
    if isinstance(exc, StdinFull):
        return errors.of_kind("busy", "The app-server is not reading its input; retry later.")
    if isinstance(exc, TimeoutError):
        return errors.of_kind("timeout", f"{what} did not complete before its deadline.")
    raise exc
