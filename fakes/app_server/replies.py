"""A client request being answered, and the reply the fake gives it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fakes.app_server.wire import Message, RequestId, error_response, response, rpc_error

INVALID_REQUEST = -32600
INTERNAL_ERROR = -32603


@dataclass
class Call:
    """A client request being answered."""

    id: RequestId
    method: str
    params: Any
    answered: bool = False


@dataclass
class Reply:
    """A reply to a client request, and what must follow it once it is on the wire."""

    result: Any = None
    error: Message | None = None
    after: Callable[[], None] | None = None

    def message(self, request_id: RequestId) -> Message:
        """The reply as a JSON-RPC response to `request_id`."""
        if self.error is not None:
            return error_response(request_id, self.error)
        return response(request_id, self.result)


def invalid(message: str) -> Reply:
    """The real server's `-32600` error reply."""
    return Reply(error=rpc_error(INVALID_REQUEST, message))


def missing_field(params: dict[str, Any], *names: str) -> Reply | None:
    """The real error for the first of `names` missing from `params`, if any."""
    for name in names:
        if name not in params:
            return invalid(f"Invalid request: missing field `{name}`")
    return None
