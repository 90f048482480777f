"""The bridge's HTTP server: how aiohttp runs it, and the bounds on a request head.

Everything here goes through aiohttp's public hooks, so a host that embeds an
application of :mod:`bridge.app` in its own runner gets the same:

- :data:`SERVER_SETTINGS`, the keyword arguments of ``web.AppRunner`` (aiohttp's
  ``RequestHandler`` parameters): among them aiohttp's own bounds on a head before it is
  parsed, a line (8190 bytes) and the number of headers (128), stated explicitly.
- :func:`head_middleware`, installed by :func:`bridge.app.create_app`: a head over
  ``MAX_HEADER_BYTES`` in all is a 431, a request line over it a 414; a request whose
  target is not a path (``CONNECT host:port``, ``OPTIONS *``), which no route can
  match, is a 404; every failure below it becomes the error payload. Each closes the
  connection where what follows the head cannot be trusted.
- :class:`ParserRefusals`, a ``logging.Filter`` on aiohttp's server logger: a request
  aiohttp's parser refused is one WARNING line without the request's bytes or a
  traceback, at most one every :data:`LOG_INTERVAL` seconds (with a count of the rest).

What aiohttp offers no public hook for: the body of its answer to a request its parser
refuses (its own plain-text 400, before any application code runs), and a deadline on
the arrival of a head (a head that never ends is closed at ``keepalive_timeout``). The
nginx front (:mod:`bridge_ops.front`) reads every head first and gives both: its own
refusals are the error payload, and a head must arrive within ``HEADER_TIMEOUT_MS``.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from bridge import errors, logs

log = logging.getLogger("bridge")

#: aiohttp's own bounds on one head, before the bridge sees it: one line (the request
#: line, a header line), and the number of headers.
MAX_LINE_SIZE = 8190
MAX_HEADERS = 128
#: At most one log line about refused requests this often (seconds).
LOG_INTERVAL = 10.0

#: How the bridge's HTTP server is run (``web.AppRunner(app, **SERVER_SETTINGS)``), by
#: `rest-bridge serve` and the test harness alike. Embedding a preset in your own runner,
#: pass the same:
#:
#: - ``handler_cancellation``: a client that disconnects stops its handler at once (a
#:   long-poll does not wait out its ``waitMs``, a call's process is not left behind);
#: - ``auto_decompress=False``: the bridge decodes request bodies itself, bounded by
#:   MAX_BODY_BYTES, and answers a coding it does not decode with 415 after
#:   authentication (aiohttp's own decoder answers ``br`` and ``zstd`` with a plain-text
#:   400 before any application code runs);
#: - ``keepalive_timeout``: a connection that sends no complete request is closed after
#:   75 s (aiohttp's default is an hour);
#: - ``max_line_size``, ``max_field_size``, ``max_headers``: aiohttp's bounds on a head
#:   (a line, and the number of headers), which the bridge keeps.
SERVER_SETTINGS: dict[str, Any] = {
    "handler_cancellation": True,
    "auto_decompress": False,
    "keepalive_timeout": 75.0,
    "max_line_size": MAX_LINE_SIZE,
    "max_field_size": MAX_LINE_SIZE,
    "max_headers": MAX_HEADERS,
}


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
    """The request line is over ``limit`` bytes (the head's, or a line's if smaller)."""
    return errors.RestError(
        414,
        "uri_too_long",
        f"The request line is over {min(limit, MAX_LINE_SIZE)} bytes.",
        data={"limitBytes": min(limit, MAX_LINE_SIZE)},
        close_connection=True,
    )


#: ``"  HTTP/1.1\r\n"``: what a request line holds besides its method and target (the
#: two spaces, the version of one digit each side, as aiohttp's parsers take it, the CRLF).
_LINE_EXTRA = len("  HTTP/1.1\r\n")
_chain = itertools.chain.from_iterable


def head_sizes(request: web.BaseRequest) -> tuple[int, int]:
    """The bytes of ``request``'s request line and of its whole head, as parsed (each
    line with its CRLF, the empty line ending the head included)."""
    major, minor = request.version
    line = len(request.method) + len(request.raw_path) + _LINE_EXTRA
    if major > 9 or minor > 9:
        line += len(str(major)) + len(str(minor)) - 2
    headers = request.raw_headers
    # ": " and CRLF per header; the names and values counted in one pass in C.
    return line, line + len(b"".join(_chain(headers))) + 4 * len(headers) + 2


def head_problem(request: web.BaseRequest, max_header_bytes: int) -> errors.RestError | None:
    """Why ``request``'s head is refused (414, 431), or None."""
    line, total = head_sizes(request)
    if line > max_header_bytes:
        return uri_too_long(max_header_bytes)
    if total > max_header_bytes:
        return headers_too_large(max_header_bytes)
    return None


def head_middleware(max_header_bytes: int, max_body_bytes: int | None) -> Middleware:
    """The middleware of every application of :mod:`bridge.app` (module docstring):
    bounded heads, path targets only, and every failure as the error payload."""

    @web.middleware
    async def bridge_head(request: web.Request, handler: Handler) -> web.StreamResponse:
        problem = None
        if head_sizes(request)[1] > max_header_bytes:  # the line is part of the head
            problem = head_problem(request, max_header_bytes)
        elif not request.raw_path.startswith("/") and not request.path.startswith("/"):
            # CONNECT host:port, OPTIONS *: no route takes them. Closed: after a
            # CONNECT, what follows the head would be a tunnel's bytes.
            problem = errors.of_kind(
                "not_found", "No such route: the request target is not a path."
            )
            problem.close_connection = True
        if problem is not None:
            return await errors.answer_and_close(request, problem)
        try:
            return await handler(request)
        except Exception as exc:
            return await errors.failure_response(request, exc, max_body_bytes)

    return bridge_head


_REMOTE = re.compile(r"\bfrom (\S+)")


class ParserRefusals(logging.Filter):
    """aiohttp's server log, without the bytes of a request or a traceback.

    aiohttp logs a request its parser refused at ERROR, with a traceback whose message
    quotes the offending bytes (an ``Authorization`` header, and so a token, among
    them). Such a record becomes one WARNING line naming the refusal, at most one per
    ``interval`` seconds (the next one counts the others); any other record that carries
    an exception keeps its level and loses its traceback. ``install()`` adds the filter
    to aiohttp's server logger, once per process.
    """

    def __init__(
        self, interval: float = LOG_INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        #: The one throttle of lines callers can repeat (bridge.logs), one kind here.
        self.throttle = logs.Throttle(self._held, interval, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        message = record.getMessage()
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        if not isinstance(exc, HttpProcessingError):
            record.msg, record.args = f"{message}: {type(exc).__name__}", ()
            return True
        held = self.throttle.admit("refused")
        if held is None:
            return False
        found = _REMOTE.search(message)
        record.msg = "refused a request from %s: %s (%s)%s"
        record.args = (found.group(1) if found else "?", type(exc).__name__, exc.code)
        record.args += (logs.more_since(held),)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True

    @staticmethod
    def _held(kind: str, count: int) -> None:
        logging.getLogger("aiohttp.server").warning(
            "refused %d more request%s since the last such line", count, "s"[: count - 1]
        )

    def flush(self) -> None:
        """Write the count of the refusals held back since the last line, if any (when
        the application stops, so that no refusal goes uncounted)."""
        self.throttle.flush()

    @classmethod
    def install(cls) -> ParserRefusals:
        """The filter on aiohttp's server logger (added the first time only)."""
        logger = logging.getLogger("aiohttp.server")
        for existing in logger.filters:
            if isinstance(existing, cls):
                return existing
        added = cls()
        logger.addFilter(added)
        return added
