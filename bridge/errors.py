"""The one error family of the bridge, and how it becomes an HTTP response.

Every failure the bridge reports is a :class:`RestError`. Handlers raise;
:func:`failure_response` renders the spec's error payload ``{"error", "message",
"code"?, "data"?}`` in exactly one place, called by the middleware of every
application (:func:`bridge.server.head_middleware`). aiohttp's own HTTP exceptions
(404, 405, 413...) are translated there too, so no response body ever takes another shape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from bridge.wire import dumps

log = logging.getLogger("bridge")

JSON_CONTENT_TYPE = "application/json"


class RestError(Exception):
    """An error with an HTTP status and a short machine-readable kind."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        code: int | None = None,
        data: Any = None,
        headers: Mapping[str, str] | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.code = code
        self.data = data
        self.headers = dict(headers or {})
        #: The connection cannot carry another request (`Connection: close`).
        self.close_connection = close_connection

    def payload(self) -> dict[str, Any]:
        """The spec's error payload; ``code`` and ``data`` only when set."""
        body: dict[str, Any] = {"error": self.kind, "message": self.message}
        if self.code is not None:
            body["code"] = self.code
        if self.data is not None:
            body["data"] = self.data
        return body

    def to_response(self) -> web.Response:
        response = web.Response(
            status=self.status,
            body=dumps(self.payload()),
            content_type=JSON_CONTENT_TYPE,
            headers=self.headers,
        )
        if self.close_connection:
            response.force_close()
        return response

    def __repr__(self) -> str:
        return f"RestError({self.status}, {self.kind!r}, {self.message!r})"


# Constructors for every kind of docs/API.md's error table, so a kind is spelled once.


def bad_request(message: str, data: Any = None, *, close_connection: bool = False) -> RestError:
    return RestError(400, "bad_request", message, data=data, close_connection=close_connection)


def unauthorized() -> RestError:
    return RestError(
        401,
        "unauthorized",
        "A valid `Authorization: Bearer <token>` header is required.",
        headers={"WWW-Authenticate": "Bearer"},
    )


def options_not_allowed(fields: list[str]) -> RestError:
    return RestError(
        403,
        "options_not_allowed",
        "This router does not allow these client options: " + ", ".join(fields),
        data={"fields": fields},
    )


def reserved_variables(names: list[str]) -> RestError:
    """403 ``options_not_allowed``: ``options.env`` names ``REST_ADAPTER_*`` variables."""
    return RestError(
        403,
        "options_not_allowed",
        "options.env may not set the bridge's own REST_ADAPTER_* variables: " + ", ".join(names),
        data={"fields": ["env"], "variables": names},
    )


def not_found(message: str = "No such route.") -> RestError:
    return RestError(404, "not_found", message)


def session_not_found(session_id: str) -> RestError:
    return RestError(404, "session_not_found", f"No session with id {session_id!r}.")


def request_not_found(request_key: str) -> RestError:
    return RestError(
        404, "request_not_found", f"No pending server request with key {request_key!r}."
    )


def method_not_allowed(method: str, allowed: set[str]) -> RestError:
    allow = ", ".join(sorted(allowed))
    return RestError(
        405,
        "method_not_allowed",
        f"Method {method} is not allowed here; allowed: {allow}.",
        headers={"Allow": allow},
    )


def method_refused(method: str, params: list[str] | None = None) -> RestError:
    """403 for an app-server method the router's method policy refuses (bridge.policy).

    The same kind as the 405 above, told apart by the status: here the HTTP method is
    right and the app-server method named in the path is not allowed; ``data.method``
    names it as the caller spelt it, ``data.params`` the params refused, when the method
    is allowed but not with them.
    """
    if params:
        return RestError(
            403,
            "method_not_allowed",
            f"This router does not allow the app-server method {method!r} with these "
            "params: " + ", ".join(params),
            data={"method": method, "params": params},
        )
    return RestError(
        403,
        "method_not_allowed",
        f"This router does not allow the app-server method {method!r}.",
        data={"method": method},
    )


def session_exited(session_id: str, *, shared: bool = False) -> RestError:
    """409 for a session that has ended: its process exited, or in shared mode its
    connection to the shared app-server ended (the app-server may well serve on)."""
    if shared:
        message = f"The connection of session {session_id!r} to the shared app-server has ended."
    else:
        message = f"The app-server process of session {session_id!r} has exited."
    return RestError(409, "session_exited", message)


def request_already_answered(request_key: str) -> RestError:
    return RestError(
        409,
        "request_already_answered",
        f"The server request {request_key!r} has already been answered.",
    )


def request_timeout(limit_ms: int) -> RestError:
    """The request body did not arrive in time; the connection cannot be used again."""
    return RestError(
        408,
        "request_timeout",
        f"The request body did not arrive within {limit_ms} ms.",
        data={"limitMs": limit_ms},
        close_connection=True,
    )


def unsupported_media_type(encoding: str) -> RestError:
    return RestError(
        415,
        "unsupported_media_type",
        "The request body's Content-Encoding is not one the bridge decodes "
        "(identity, gzip, deflate).",
        data={"contentEncoding": encoding[:100]},
    )


def payload_too_large(limit: int) -> RestError:
    return RestError(
        413,
        "payload_too_large",
        f"The request body exceeds the limit of {limit} bytes.",
        data={"limitBytes": limit},
    )


def session_limit_reached(limit: int) -> RestError:
    return RestError(
        429,
        "session_limit_reached",
        f"The bridge already holds its maximum of {limit} sessions.",
        headers={"Retry-After": "1"},
    )


def busy(message: str) -> RestError:
    return RestError(429, "busy", message, headers={"Retry-After": "1"})


def app_server_error(code: int, message: str, data: Any = None) -> RestError:
    """A JSON-RPC error reply from the app-server; ``-32001`` means overloaded."""
    if code == -32001:
        return RestError(
            503,
            "app_server_overloaded",
            message,
            code=code,
            data=data,
            headers={"Retry-After": "1"},
        )
    return RestError(502, "app_server_error", message, code=code, data=data)


def app_server_exited(message: str, data: Any = None) -> RestError:
    return RestError(502, "app_server_exited", message, data=data)


def app_server_spawn_failed(message: str) -> RestError:
    return RestError(502, "app_server_spawn_failed", message)


def protocol_error(message: str) -> RestError:
    return RestError(502, "protocol_error", message)


def timeout(message: str) -> RestError:
    return RestError(504, "timeout", message)


def internal_error() -> RestError:
    return RestError(500, "internal_error", "The bridge hit an internal error.")


_HTTP_KINDS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
    429: "busy",
}


def from_http_exception(exc: web.HTTPException, max_body_bytes: int | None) -> RestError:
    """Translate one of aiohttp's own HTTP exceptions into the error payload."""
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return method_not_allowed(exc.method, set(exc.allowed_methods))
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return payload_too_large(max_body_bytes or 0)
    if isinstance(exc, web.HTTPNotFound):
        return not_found()
    kind = _HTTP_KINDS.get(exc.status, "internal_error" if exc.status >= 500 else "bad_request")
    return RestError(exc.status, kind, exc.reason)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _answer_and_close(request: web.Request, error: RestError) -> web.StreamResponse:
    """Send ``error`` and close the connection at once.

    aiohttp would otherwise linger up to ten seconds reading the rest of a body nobody
    wants (one that never arrives, or cannot be decoded).
    """
    response = error.to_response()
    await response.prepare(request)
    await response.write_eof()
    protocol = request.protocol
    if protocol is not None:
        protocol.force_close()
    return response


async def failure_response(
    request: web.Request, exc: Exception, max_body_bytes: int | None
) -> web.StreamResponse:
    """The response for a failure raised while handling ``request``: the error payload.

    An :class:`aiohttp.web.HTTPException` below 400 (a redirect) is raised again.
    """
    if isinstance(exc, RestError):
        if exc.close_connection:
            return await _answer_and_close(request, exc)
        return exc.to_response()
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        return from_http_exception(exc, max_body_bytes).to_response()
    # The last line of defence: no traceback leaves the bridge.
    log.error("internal error on %s %s: %s", request.method, request.path, type(exc).__name__)
    return internal_error().to_response()


def make_error_middleware(max_body_bytes: int | None = None) -> Middleware:
    """A middleware that renders every failure as the spec's error payload.

    The applications of :mod:`bridge.app` render failures in their own middleware
    (:func:`bridge.server.head_middleware`); this is for a host that mounts the bridge's
    handlers in an application of its own.
    """

    @web.middleware
    async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as exc:
            return await failure_response(request, exc, max_body_bytes)

    return error_middleware


def replica_unavailable(message: str) -> RestError:
    """This replica cannot take the request: a front passes it to another."""
    return RestError(503, "replica_unavailable", message, headers={"Retry-After": "1"})


def replica_draining() -> RestError:
    return replica_unavailable("This replica is draining: it takes no new work; retry elsewhere.")


def expectation_failed() -> RestError:
    """An ``Expect`` header the bridge cannot meet (only ``100-continue`` is known).

    The header's value is never repeated: it is whatever the caller chose to send.
    """
    return RestError(
        417,
        "expectation_failed",
        "The only expectation the bridge meets is `Expect: 100-continue`.",
        close_connection=True,
    )


ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


def expect_handler(refusal: Callable[[web.Request], RestError | None]) -> ExpectHandler:
    """What a route does with an ``Expect`` header, before its handler runs.

    ``refusal`` first: a request it refuses (the 401 of a request without the token, a
    head over its bound) gets that error, and no ``100 Continue``, so a client that
    waits for it never sends the body. Then
    ``100-continue`` is met on HTTP/1.1, and any other expectation is a 417 error
    payload that does not repeat the header. HTTP/1.0 requests ignore the header
    (HTTP/1.0 has no interim responses).
    """

    async def handle_expect(request: web.Request) -> web.StreamResponse | None:
        # Either answer closes the connection: the body may be on its way, or never come.
        refused = refusal(request)
        if refused is not None:
            return await _answer_and_close(request, refused)
        if request.version < (1, 1):
            return None
        if request.headers.get("Expect", "").strip().lower() != "100-continue":
            return await _answer_and_close(request, expectation_failed())
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # The interim response is not part of the response that follows.
        request.writer.output_size = 0
        return None

    return handle_expect


async def answer_and_close(request: web.BaseRequest, error: RestError) -> web.StreamResponse:
    """Send ``error`` and close the connection, unread body or not (see failure_response)."""
    return await _answer_and_close(request, error)  # type: ignore[arg-type]
