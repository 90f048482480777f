"""The bridge's HTTP connections: request heads bounded, unreadable requests answered.

aiohttp bounds each header line (8190 bytes) and the number of headers (128), but not
their total, and waits for a head that never completes until the keep-alive timeout.
Its answer to a request it cannot parse is a plain-text 400 quoting the offending bytes
(an ``Authorization`` header among them), logged at ERROR with a traceback.

:class:`BridgeRunner` is ``web.AppRunner`` with connections that

- refuse a head over ``MAX_HEADER_BYTES`` in all (431), and one that is not complete
  ``HEADER_TIMEOUT_MS`` after its first byte (408), closing the connection;
- answer every request the parser refuses with the error payload (400, 414 or 431),
  never echoing what was sent, and log it as one WARNING line without the bytes, at
  most one such line every :data:`LOG_INTERVAL` seconds (with a count of the rest);
- answer a request whose target is not a path (``CONNECT host:port``, ``OPTIONS *``),
  which no route can match, with the error payload: the 401 first when the token is
  required, else a 404 (aiohttp's router would answer a plain-text 404).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from bridge import errors
from bridge.limits import RestLimits
from bridge.routes import CONFIG
from bridge.wire import dumps

log = logging.getLogger("bridge")

#: aiohttp's own bounds on one head, kept: one line, and the number of headers.
MAX_LINE_SIZE = 8190
MAX_HEADERS = 128
#: At most one log line about refused requests this often (seconds).
LOG_INTERVAL = 10.0
_HEAD_END = b"\r\n\r\n"

#: What aiohttp's parser says about a refused request, up to its first colon, when it
#: quotes none of the request's bytes: the reason is then safe to pass on.
_KNOWN_REASONS = frozenset(
    {
        "Invalid header value char",
        "Invalid header token",
        "Invalid header name char",
        "Duplicate Content-Length",
        "Invalid character in Content-Length",
        "Transfer-Encoding can't be present with Content-Length",
        "Invalid method encountered",
        "Received HTTPS traffic on an HTTP port",
        "Bad status line",
        "Invalid URL",
        "Invalid HTTP version",
        "Invalid chunk size",
        "Data after `Connection: close`",
        "Missing expected CR after header value",
        "Missing expected LF after header value",
    }
)


def headers_too_large(limit: int) -> errors.RestError:
    return errors.RestError(
        431,
        "headers_too_large",
        f"The request head is over the limits: {limit} bytes in all (MAX_HEADER_BYTES), "
        f"{MAX_LINE_SIZE} bytes a line, {MAX_HEADERS} headers.",
        data={"limitBytes": limit},
        close_connection=True,
    )


def uri_too_long(limit: int) -> errors.RestError:
    """The request line did not end within ``limit`` bytes (the head's or a line's)."""
    return errors.RestError(
        414,
        "uri_too_long",
        f"The request line is over {min(limit, MAX_LINE_SIZE)} bytes.",
        data={"limitBytes": min(limit, MAX_LINE_SIZE)},
        close_connection=True,
    )


def head_timeout(limit_ms: int) -> errors.RestError:
    return errors.RestError(
        408,
        "request_timeout",
        f"The request head did not arrive within {limit_ms} ms.",
        data={"limitMs": limit_ms},
        close_connection=True,
    )


def not_http(reason: str | None) -> errors.RestError:
    detail = f" ({reason})" if reason else ""
    return errors.bad_request(f"The request is not valid HTTP/1.1{detail}.", close_connection=True)


def parser_reason(exc: BaseException | None) -> str | None:
    """The parser's reason for refusing a request, if it is one of the known phrases."""
    if not isinstance(exc, HttpProcessingError):
        return None
    reason = (exc.message or "").split(":", 1)[0].strip()
    return reason if reason in _KNOWN_REASONS else None


def raw_response(error: errors.RestError) -> bytes:
    """The error as the bytes of an HTTP/1.1 response that closes the connection."""
    body = dumps(error.payload())
    phrase = HTTPStatus(error.status).phrase
    head = (
        f"HTTP/1.1 {error.status} {phrase}\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class RefusalLog:
    """One WARNING line for a refused request, then at most one per ``interval``."""

    def __init__(self, interval: float = LOG_INTERVAL) -> None:
        self.interval = interval
        self._next_at = 0.0
        self._unlogged = 0

    def note(self, now: float, what: str, remote: str | None) -> None:
        if now < self._next_at:
            self._unlogged += 1
            return
        more = f" (and {self._unlogged} more since the last such line)" if self._unlogged else ""
        log.warning("refused a request from %s: %s%s", remote or "?", what, more)
        self._unlogged = 0
        self._next_at = now + self.interval


REFUSALS = RefusalLog()


class BoundedRequestHandler(RequestHandler):
    """aiohttp's connection protocol with a bounded, timed request head."""

    def __init__(
        self, manager: web.Server, *, max_header_bytes: int, header_timeout: float, **kwargs: Any
    ) -> None:
        super().__init__(
            manager,
            max_line_size=MAX_LINE_SIZE,
            max_headers=MAX_HEADERS,
            max_field_size=MAX_LINE_SIZE,
            **kwargs,
        )
        self._max_header_bytes = max_header_bytes
        self._header_timeout = header_timeout
        #: Bytes of the request head being received, or None between requests.
        self._head_bytes: int | None = None
        self._first_line_ended = False
        self._head_deadline: asyncio.TimerHandle | None = None
        self._last_payload: Any = None
        self._refused = False

    # Reading

    def data_received(self, data: bytes) -> None:
        if self._refused or self._upgraded or not data:
            super().data_received(data)
            return
        if self._head_bytes is None and self._between_requests():
            self._start_head(0)
        if self._head_bytes is not None:
            self._note_first_line(data)
            if not self._head_fits(data):
                return
        parsed = self._request_count
        super().data_received(data)
        if self._request_count == parsed:
            if self._head_bytes is not None:
                self._head_bytes += len(data)
            return
        self._end_head()
        if self._messages:
            message, payload = self._messages[-1]
            self._last_payload = payload
            self._count_pipelined(data, message, payload)

    def _note_first_line(self, data: bytes) -> None:
        """Whether the request line ended within its bound (else a 414): aiohttp's for a
        line, or the head's when that is smaller."""
        assert self._head_bytes is not None
        room = min(MAX_LINE_SIZE + 2, self._max_header_bytes) - self._head_bytes
        if not self._first_line_ended and room > 0:
            self._first_line_ended = data.find(b"\n", 0, room) != -1

    def _between_requests(self) -> bool:
        payload = self._last_payload
        return payload is None or bool(payload.is_eof())

    def _head_fits(self, data: bytes) -> bool:
        """False (and the connection refused) if ``data`` takes the head over its bound."""
        assert self._head_bytes is not None
        room = self._max_header_bytes - self._head_bytes
        if len(data) <= room:
            return True
        # The head may end within the room left, a body or the next request following.
        end = data.find(_HEAD_END, 0, room + len(_HEAD_END))
        if end != -1 and end + len(_HEAD_END) <= room:
            return True
        error = headers_too_large(self._max_header_bytes)
        self._refuse(
            error if self._first_line_ended else uri_too_long(self._max_header_bytes),
            "request head too big",
        )
        return False

    def _count_pipelined(self, data: bytes, message: Any, payload: Any) -> None:
        """A chunk that ended a request may begin the next one: count that part."""
        if not payload.is_eof():
            return
        end = data.rfind(_HEAD_END)
        after = len(data) - (end + len(_HEAD_END)) if end != -1 else 0
        length = getattr(message, "headers", {}).get("Content-Length", "")
        if length.isascii() and length.isdigit():
            after -= int(length)
        if after > 0:
            self._start_head(after)

    def _start_head(self, received: int) -> None:
        self._head_bytes = received
        self._first_line_ended = False
        if self._head_deadline is None:
            self._head_deadline = self._loop.call_later(self._header_timeout, self._head_timed_out)

    def _end_head(self) -> None:
        self._head_bytes = None
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self._head_bytes is None:
            return
        limit_ms = round(self._header_timeout * 1000)
        self._refuse(head_timeout(limit_ms), "request head not complete in time")

    def _refuse(self, error: errors.RestError, what: str) -> None:
        """Answer ``error`` at once (unless a response is under way) and close."""
        self._refused = True
        self._end_head()
        REFUSALS.note(self._loop.time(), what, _remote(self.peername))
        transport = self.transport
        if transport is not None and not self._request_in_progress and not self._messages:
            transport.write(raw_response(error))
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._end_head()
        self._last_payload = None
        super().connection_lost(exc)

    # Answering what the parser refused, and the last-resort 500

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("the response has begun: no error can be sent")
        if status >= 500:
            # The error middleware handles every application failure: this is aiohttp's.
            log.error("internal error in the HTTP server: %s", type(exc).__name__)
            return errors.internal_error().to_response()
        error = self._refusal(exc)
        what = f"{type(exc).__name__ if exc else 'error'} ({error.status})"
        REFUSALS.note(self._loop.time(), what, request.remote)
        response = error.to_response()
        response.force_close()
        return response

    def _refusal(self, exc: BaseException | None) -> errors.RestError:
        if isinstance(exc, LineTooLong):
            if not self._first_line_ended:
                return uri_too_long(self._max_header_bytes)
            return headers_too_large(self._max_header_bytes)
        if isinstance(exc, HttpProcessingError) and "Too many headers" in (exc.message or ""):
            return headers_too_large(self._max_header_bytes)
        return not_http(parser_reason(exc))


def _remote(peername: Any) -> str | None:
    if isinstance(peername, (tuple, list)) and peername:
        return str(peername[0])
    return None


RequestHandlerFunction = Callable[[BaseRequest], Awaitable[web.StreamResponse]]


def paths_only(
    handler: RequestHandlerFunction, guard: errors.Guard | None
) -> RequestHandlerFunction:
    """``handler`` for requests whose target is a path; the error payload for the others.

    ``CONNECT host:port`` (authority form) and ``OPTIONS *`` have no path, so no route
    of the router matches them, not even the catch-all. They get the 401 when ``guard``
    does not admit them (no token is exempt there), else a 404 ``not_found``. A plain
    function returning ``handler``'s coroutine: no extra coroutine per request.
    """

    async def no_path(request: BaseRequest) -> web.StreamResponse:
        admits = guard.admits if guard is not None else None
        if admits is not None and not admits(request):  # type: ignore[arg-type]
            error = errors.unauthorized()
        else:
            error = errors.not_found("No such route: the request target is not a path.")
        # Closed: after a CONNECT, what follows the head would be a tunnel's bytes.
        return await errors.answer_and_close(request, error)

    def handle(request: BaseRequest) -> Awaitable[web.StreamResponse]:
        if request.path.startswith("/"):
            return handler(request)
        return no_path(request)

    return handle


class BridgeServer(web.Server):
    """``web.Server`` making :class:`BoundedRequestHandler` connections."""

    def __init__(
        self, *args: Any, max_header_bytes: int, header_timeout: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout

    @classmethod
    def like(
        cls, server: web.Server, limits: RestLimits, guard: errors.Guard | None = None
    ) -> BridgeServer:
        """A server with ``server``'s handler and settings, and ``limits``' head bounds;
        requests whose target is not a path answered by :func:`paths_only` (``guard``:
        the application's, whose bearer token they need)."""
        return cls(
            paths_only(server.request_handler, guard),
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            max_header_bytes=limits.max_header_bytes,
            header_timeout=limits.header_timeout_ms / 1000,
            **server._kwargs,
        )

    def __call__(self) -> RequestHandler:
        return BoundedRequestHandler(
            self,
            loop=self._loop,
            max_header_bytes=self.max_header_bytes,
            header_timeout=self.header_timeout,
            **self._kwargs,
        )


class BridgeRunner(web.AppRunner):
    """``web.AppRunner`` whose connections bound request heads (module docstring).

    The bounds are the application's limits (``MAX_HEADER_BYTES``,
    ``HEADER_TIMEOUT_MS``) for an application built by :func:`bridge.app.create_app`,
    else ``limits``, else the defaults. Use it with ``**SERVER_SETTINGS``.
    """

    def __init__(
        self, app: web.Application, *, limits: RestLimits | None = None, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        config = app.get(CONFIG)
        self._limits = limits or (config.limits if config is not None else RestLimits())

    async def _make_server(self) -> web.Server:
        # aiohttp builds the application's server (and starts the application) in
        # AppRunner._make_server; the bridge's is built from it, with the same handler
        # and settings, and differs only in the connections it makes. Nothing else
        # holds the first one, which has no connections yet.
        return BridgeServer.like(
            await super()._make_server(), self._limits, self.app.get(errors.GUARD)
        )
