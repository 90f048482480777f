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
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from bridge.wire import dumps

log = logging.getLogger("bridge")

#: The error kind of a response that is the error payload (read by the access log).
#: aiohttp 3.14 types a response's keys (and warns about plain strings); 3.13, the
#: lowest this package allows, has no ResponseKey and takes a plain string.
ERROR_KIND: Any = (
    web.ResponseKey("error_kind", str) if hasattr(web, "ResponseKey") else "error_kind"
)

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
        response[ERROR_KIND] = self.kind
        if self.close_connection:
            response.force_close()
        return response

    def __repr__(self) -> str:
        return f"RestError({self.status}, {self.kind!r}, {self.message!r})"


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """One row of the error table: a kind, at its status."""

    status: int
    kind: str
    #: What it means, one line: the OpenAPI document's response descriptions are made
    #: of these, and docs/API.md's error table has a row for it.
    description: str
    #: The message, where the bridge always gives the same one.
    message: str | None = None
    #: Answered with ``Retry-After: 1``.
    retry_after: bool = False
    #: The connection is closed after it.
    closes_connection: bool = False
    #: The values its ``data.reason`` may take.
    reasons: tuple[str, ...] = ()
    #: The kind aiohttp's own HTTP exceptions of this status become.
    for_http_exception: bool = False
    #: In the description of its status on every route that may answer it (else only
    #: where it applies: the method policy's routes, or nowhere for a kind no route of
    #: the bridge's raises).
    on_every_route: bool = True
    #: Answered only by the nginx front (docs/SCALING.md), never by a replica.
    front_only: bool = False


#: Every error kind the bridge (and its nginx front) answers: the routes raise them
#: through the constructors below, the OpenAPI document describes each status from it,
#: and docs/API.md's error table is checked against it (tests/bridge/test_errors.py).
ERROR_KINDS: tuple[ErrorKind, ...] = (
    ErrorKind(400, "bad_request", "Bad request", for_http_exception=True),
    ErrorKind(
        401,
        "unauthorized",
        "Missing or wrong bearer token",
        message="A valid `Authorization: Bearer <token>` header is required.",
        for_http_exception=True,
    ),
    ErrorKind(403, "options_not_allowed", "Client options refused by this router"),
    ErrorKind(
        403,
        "method_not_allowed",
        "App-server method refused by this router's method policy",
        on_every_route=False,
    ),
    ErrorKind(
        403,
        "forbidden",
        "aiohttp's own refusal, which no route of the bridge raises",
        for_http_exception=True,
        on_every_route=False,
    ),
    ErrorKind(404, "not_found", "Unknown route", message="No such route.", for_http_exception=True),
    ErrorKind(404, "session_not_found", "unknown session"),
    ErrorKind(404, "request_not_found", "unknown server request"),
    ErrorKind(
        404,
        "not_recorded",
        "The replay server (`rest-bridge-scenarios replay`) has no recorded answer for it",
        on_every_route=False,
    ),
    ErrorKind(405, "method_not_allowed", "Method not allowed", for_http_exception=True),
    ErrorKind(
        408,
        "request_timeout",
        "The request head or body did not arrive in time",
        closes_connection=True,
        for_http_exception=True,
    ),
    ErrorKind(409, "session_exited", "Session exited"),
    ErrorKind(409, "request_already_answered", "request already answered"),
    ErrorKind(413, "payload_too_large", "Body over MAX_BODY_BYTES", for_http_exception=True),
    ErrorKind(414, "uri_too_long", "Request line too long", closes_connection=True),
    ErrorKind(415, "unsupported_media_type", "A `Content-Encoding` the bridge does not decode"),
    ErrorKind(
        417,
        "expectation_failed",
        "An `Expect` header other than `100-continue`, never repeated back",
        message="The only expectation the bridge meets is `Expect: 100-continue`.",
        closes_connection=True,
    ),
    ErrorKind(
        429,
        "session_limit_reached",
        "Sessions and sessionless calls at MAX_SESSIONS",
        retry_after=True,
    ),
    ErrorKind(
        429,
        "busy",
        "text turns at MAX_CONCURRENT_TEXT_TURNS, or the app-server not reading its input",
        retry_after=True,
        for_http_exception=True,
    ),
    ErrorKind(
        431, "headers_too_large", "Request head over MAX_HEADER_BYTES", closes_connection=True
    ),
    ErrorKind(500, "internal_error", "Internal error", message="The bridge hit an internal error."),
    ErrorKind(502, "app_server_error", "The app-server answered with a JSON-RPC error"),
    ErrorKind(502, "app_server_exited", "it exited"),
    ErrorKind(502, "app_server_spawn_failed", "it could not be started"),
    ErrorKind(502, "protocol_error", "it wrote something that is not JSON-RPC"),
    ErrorKind(503, "app_server_overloaded", "The app-server is overloaded", retry_after=True),
    ErrorKind(
        503,
        "replica_unavailable",
        "the replica is draining, or (at the front) cannot be reached",
        retry_after=True,
    ),
    ErrorKind(
        504,
        "timeout",
        "Deadline passed",
        reasons=("deadline", "idle_without_completion"),
    ),
    ErrorKind(411, "length_required", "A request body without a length", front_only=True),
    ErrorKind(
        501, "not_implemented", "A `Transfer-Encoding` other than `chunked`", front_only=True
    ),
    ErrorKind(
        505, "http_version_not_supported", "An HTTP version but 1.0 and 1.1", front_only=True
    ),
)
#: The kind each of aiohttp's own HTTP exceptions becomes, by status.
HTTP_EXCEPTION_KINDS = {e.status: e.kind for e in ERROR_KINDS if e.for_http_exception}


def error_kind(kind: str, status: int | None = None) -> ErrorKind:
    """The table's row for ``kind`` (at ``status``, for a kind at two statuses)."""
    rows = [e for e in ERROR_KINDS if e.kind == kind and status in (None, e.status)]
    if len(rows) != 1:
        raise LookupError(f"the error table has {len(rows)} rows for {kind!r} at {status}")
    return rows[0]


def of_kind(
    kind: str,
    message: str | None = None,
    *,
    status: int | None = None,
    code: int | None = None,
    data: Any = None,
    headers: Mapping[str, str] | None = None,
    close_connection: bool = False,
) -> RestError:
    """A :class:`RestError` of ``kind``: its status and what goes with it from the table."""
    entry = error_kind(kind, status)
    text = message if message is not None else entry.message
    if text is None:
        raise ValueError(f"{kind!r} has no message of its own: give one")
    return RestError(
        entry.status,
        entry.kind,
        text,
        code=code,
        data=data,
        headers={**({"Retry-After": "1"} if entry.retry_after else {}), **(headers or {})},
        close_connection=close_connection or entry.closes_connection,
    )


# Constructors for every kind the bridge raises: the table gives the status.


def bad_request(message: str, data: Any = None, *, close_connection: bool = False) -> RestError:
    return of_kind("bad_request", message, data=data, close_connection=close_connection)


def unauthorized() -> RestError:
    return of_kind("unauthorized", headers={"WWW-Authenticate": "Bearer"})


def reserved_variables(names: list[str]) -> RestError:
    """403 ``options_not_allowed``: ``options.env`` names ``REST_ADAPTER_*`` variables."""
    return of_kind(
        "options_not_allowed",
        "options.env may not set the bridge's own REST_ADAPTER_* variables: " + ", ".join(names),
        data={"fields": ["env"], "variables": names},
    )


def session_not_found(session_id: str) -> RestError:
    return of_kind("session_not_found", f"No session with id {session_id!r}.")


def request_not_found(request_key: str) -> RestError:
    return of_kind("request_not_found", f"No pending server request with key {request_key!r}.")


def replica_draining() -> RestError:
    """This replica is draining: a front passes the request to another."""
    return of_kind(
        "replica_unavailable", "This replica is draining: it takes no new work; retry elsewhere."
    )


def method_not_allowed(method: str, allowed: set[str]) -> RestError:
    allow = ", ".join(sorted(allowed))
    return of_kind(
        "method_not_allowed",
        f"Method {method} is not allowed here; allowed: {allow}.",
        status=405,
        headers={"Allow": allow},
    )


def method_refused(method: str, params: list[str] | None = None) -> RestError:
    """403 for an app-server method the router's method policy refuses (bridge.policy):
    the 405's kind, for the method named in the path (``data.method``, as the caller spelt
    it), or for its params (``data.params``) when the method is allowed but not with them.
    """
    message = f"This router does not allow the app-server method {method!r}"
    data: dict[str, Any] = {"method": method}
    if params:
        message += " with these params: " + ", ".join(params)
        data["params"] = params
    else:
        message += "."
    return of_kind("method_not_allowed", message, status=403, data=data)


def session_exited(session_id: str, *, shared: bool = False) -> RestError:
    """409 for a session that has ended: its process exited, or in shared mode its
    connection to the shared app-server ended (the app-server may well serve on)."""
    if shared:
        message = f"The connection of session {session_id!r} to the shared app-server has ended."
    else:
        message = f"The app-server process of session {session_id!r} has exited."
    return of_kind("session_exited", message)


def request_timeout(limit_ms: int) -> RestError:
    """The request body did not arrive in time; the connection cannot be used again."""
    return of_kind(
        "request_timeout",
        f"The request body did not arrive within {limit_ms} ms.",
        data={"limitMs": limit_ms},
    )


def payload_too_large(limit: int) -> RestError:
    return of_kind(
        "payload_too_large",
        f"The request body exceeds the limit of {limit} bytes.",
        data={"limitBytes": limit},
    )


def from_http_exception(exc: web.HTTPException, max_body_bytes: int | None) -> RestError:
    """Translate one of aiohttp's own HTTP exceptions into the error payload."""
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return method_not_allowed(exc.method, set(exc.allowed_methods))
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return payload_too_large(max_body_bytes or 0)
    if isinstance(exc, web.HTTPNotFound):
        return of_kind("not_found")
    fallback = "internal_error" if exc.status >= 500 else "bad_request"
    kind = HTTP_EXCEPTION_KINDS.get(exc.status, fallback)
    return RestError(exc.status, kind, exc.reason)


async def answer_and_close(request: web.BaseRequest, error: RestError) -> web.StreamResponse:
    """Send ``error`` and close the connection at once, unread body or not (aiohttp would
    otherwise linger up to ten seconds reading the rest of a body nobody wants)."""
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
    """The error payload for a failure raised while handling ``request``; an
    :class:`aiohttp.web.HTTPException` below 400 (a redirect) is raised again."""
    if isinstance(exc, RestError):
        if exc.close_connection:
            return await answer_and_close(request, exc)
        return exc.to_response()
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        return from_http_exception(exc, max_body_bytes).to_response()
    # The last line of defence: no traceback leaves the bridge.
    # The route's template, not the path: a path holds what the caller wrote.
    resource = request.match_info.route.resource
    where = resource.canonical if resource is not None else "-"
    log.error("internal error on %s %s: %s", request.method, where, type(exc).__name__)
    return of_kind("internal_error").to_response()


ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


def expect_handler(refusal: Callable[[web.Request], RestError | None]) -> ExpectHandler:
    """What a route does with an ``Expect`` header, before its handler runs.

    A request ``refusal`` refuses (no token, a head over its bound) gets that error and
    no ``100 Continue``, so a client that waits for it never sends the body. Then, on
    HTTP/1.1 (HTTP/1.0 has no interim responses: it ignores the header), ``100-continue``
    is met and any other expectation is a 417 that does not repeat the header.
    """

    async def handle_expect(request: web.Request) -> web.StreamResponse | None:
        # Either answer closes the connection: the body may be on its way, or never come.
        refused = refusal(request)
        if refused is not None:
            return await answer_and_close(request, refused)
        if request.version < (1, 1):
            return None
        if request.headers.get("Expect", "").strip().lower() != "100-continue":
            return await answer_and_close(request, of_kind("expectation_failed"))
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # The interim response is not part of the response that follows.
        request.writer.output_size = 0
        return None

    return handle_expect
