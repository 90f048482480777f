"""The bridge's log lines: two formats, one access line per request, and the events of
sessions and app-servers.

- :func:`configure` sets the format (``text`` or ``json``) and the level of every log
  line the process writes to stderr. In ``json`` each line is one object with the keys
  ``time``, ``level``, ``logger``, ``message`` and, for the lines below, their fields.
  No line carries a traceback: an exception is named by its type only.
- :class:`AccessLog` writes the access lines: one INFO line on the ``bridge.access``
  logger when a request ends (an SSE stream or a long-poll when it closes), with the
  route's template, never the raw path, a query, a header or a body. The observing
  middleware (:mod:`bridge.observe`) feeds it.
- :func:`session_started`, :func:`session_ended` and :func:`app_server_exited` write the
  INFO lines of the ``bridge.sessions`` logger.
- :func:`say` writes the start-up banner to stdout in the chosen format, whatever the
  level: hosts read the ``listening on http://...`` line from it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import re
import sys
import time
from typing import Any, ClassVar, TextIO

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from bridge.wire import dumps

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_FORMAT = "text"
DEFAULT_LEVEL = "info"

#: The access lines' logger; INFO, so ``--log-level warning`` turns them off.
ACCESS = logging.getLogger("bridge.access")
#: Sessions' starts and ends, and app-server exits.
SESSIONS = logging.getLogger("bridge.sessions")

#: The key of a record's structured fields (``extra={FIELDS: {...}}``).
FIELDS = "fields"
#: What a session id looks like when the bridge made it (a UUID, maybe a replica's
#: prefix); anything else a caller put in a path is not repeated.
_SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
#: The status of a request whose handler was cancelled before it answered in full (the
#: client went away, or the bridge stopped): nginx's "client closed request".
CLIENT_GONE = 499
#: A request that matched no route (404, 405, or refused before routing).
NO_ROUTE = "-"

_format = DEFAULT_FORMAT


def _utc(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


class TextFormatter(logging.Formatter):
    """``time LEVEL logger message``, as the bridge has always written; an exception is
    named by its type, without a traceback (which may quote anything it touched)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatException(self, ei: Any) -> str:
        return f"({ei[0].__name__})" if ei and ei[0] is not None else ""

    def formatStack(self, stack_info: str) -> str:
        return ""


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, RFC 3339, milliseconds), ``level``,
    ``logger``, ``message``, the record's fields, and ``exception`` (its type's name)
    when it carries one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info and record.exc_info[0] is not None:
            line["exception"] = record.exc_info[0].__name__
        return json.dumps(line, ensure_ascii=False, default=str)


#: "000" to "999": the milliseconds of a line's time, looked up (formatting each took
#: as long as the rest of the stamp).
_MILLIS = tuple(f"{i:03d}" for i in range(1000))


class AccessLines:
    """The access lines of `rest-bridge serve`, formatted here and written to ``stream``
    in batches: one write per :data:`BATCH_LINES` lines or :data:`FLUSH_SECONDS`,
    whichever comes first, and at exit.

    What ``logging`` costs per record (a record object, the handler's lock, a formatter,
    a write and a flush each) is several times what the bridge spends on a call; this is
    one formatted string and a list append. The lines are those the formatters would
    write, and the ``bridge.access`` logger's level still decides whether there are any.
    """

    def __init__(self, log_format: str, stream: TextIO) -> None:
        self.json = log_format == "json"
        self.stream = stream
        self._pending: list[str] = []
        self._timer: asyncio.TimerHandle | None = None
        self._second = -1
        self._stamp = ""

    def _time(self, now: float) -> str:
        second, millis = divmod(int(now * 1000), 1000)
        if second != self._second:
            self._second = second
            if self.json:
                self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            else:
                self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        if self.json:
            return f"{self._stamp}.{_MILLIS[millis]}Z"
        return f"{self._stamp},{_MILLIS[millis]}"

    def add(self, text: str, fields: dict[str, Any] | None) -> None:
        """One line: ``text`` is its message, ``fields`` its JSON keys (json only)."""
        stamp = self._time(time.time())
        if self.json:
            line = {"time": stamp, "level": "INFO", "logger": ACCESS.name, "message": text}
            line.update(fields or {})
            self._pending.append(dumps(line).decode() + "\n")
        else:
            self._pending.append(f"{stamp} INFO bridge.access {text}\n")
        if len(self._pending) >= BATCH_LINES:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending:
            batch, self._pending = "".join(self._pending), []
            with contextlib.suppress(OSError, ValueError):  # stderr closed: nobody to tell
                self.stream.write(batch)
                self.stream.flush()


#: Set by :func:`configure`: where the access lines of this process go.
_access_lines: AccessLines | None = None
#: At most this many access lines wait to be written, at most this long (seconds).
BATCH_LINES = 256
FLUSH_SECONDS = 0.1


def configure(log_format: str = DEFAULT_FORMAT, level: str = DEFAULT_LEVEL) -> None:
    """Every log line of the process to stderr, in ``log_format``, from ``level`` up."""
    global _format, _access_lines
    if log_format not in LOG_FORMATS:
        raise ValueError(f"{log_format!r} is not a log format ({', '.join(LOG_FORMATS)})")
    if level not in LOG_LEVELS:
        raise ValueError(f"{level!r} is not a log level ({', '.join(LOG_LEVELS)})")
    _format = log_format
    if _access_lines is not None:
        _access_lines.flush()
    _access_lines = AccessLines(log_format, sys.stderr)
    atexit.register(_access_lines.flush)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def say(message: str, stream: TextIO | None = None, **fields: Any) -> None:
    """A line of the start-up banner (or of stopping and draining), to stdout whatever
    the level: the text itself, or in ``json`` the object a log line would be, logger
    ``bridge.banner``, with ``fields`` as keys."""
    out = stream or sys.stdout
    if _format == "json":
        line = {
            "time": _utc(time.time()),
            "level": "INFO",
            "logger": "bridge.banner",
            "message": message.strip(),
            **fields,
        }
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
    else:
        out.write(message + "\n")
    out.flush()


def safe_session_id(raw: str | None) -> str | None:
    """``raw`` when it could be a session id, else ``"?"``: a path holds what the caller
    wrote (a newline, a megabyte), which a log line does not repeat."""
    if raw is None:
        return None
    if raw in _safe_ids:
        return raw
    if _SESSION_ID.fullmatch(raw) is None:
        return "?"
    if len(_safe_ids) >= SAFE_IDS_KEPT:
        _safe_ids.clear()
    _safe_ids.add(raw)
    return raw


#: The ids :func:`safe_session_id` has found safe lately (each at most 128 characters),
#: so that the requests of a session do not match the pattern again each time.
SAFE_IDS_KEPT = 4096
_safe_ids: set[str] = set()


def _match_info(request: web.BaseRequest) -> web.UrlMappingMatchInfo | None:
    """The route ``request`` matched; None for one that never reached routing (aiohttp's
    parser refused it), whose ``match_info`` asserts that it is set."""
    if not isinstance(request, web.Request):
        return None
    try:
        return request.match_info
    except AssertionError:
        return None


def safe_method(method: str) -> str:
    """``method`` when it is a token of letters (as every known method is), else ``"?"``."""
    return method if method.isalpha() else "?"


class AccessLog(AbstractAccessLogger):
    """One INFO line per request, when it ends.

    Text: ``GET /v1/sessions/{sessionId} 404 0.4ms 118B session=... error=...``. JSON
    fields: ``method``, ``route``, ``status``, ``durationMs``, ``bytes``, and, when they
    apply, ``sessionId``, ``replicaId``, ``errorKind``. ``route`` is the template of the
    route that matched (``-`` for none); the method is one aiohttp parsed (a token of
    letters), never a header's or a query's value.

    The lines of the requests an application handles come from its observing middleware
    (:mod:`bridge.observe`), which calls :meth:`write`. This is also aiohttp's public
    access-log hook, for the one kind of request no application code sees: one its
    parser refused (aiohttp's own 400), whose line has no route.
    """

    #: REST_ADAPTER_REPLICA_ID; set on a subclass by :func:`access_log_class`.
    replica_id: ClassVar[str | None] = None

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        # Every request that reached routing has its line from the middleware already.
        if response.status >= 400 and _match_info(request) is None:
            method = safe_method(request.method)
            self.write(method, NO_ROUTE, None, response.status, response.body_length, None, time)

    def write(
        self,
        method: str,
        route: str,
        session_id: str | None,
        status: int,
        size: int,
        kind: str | None,
        seconds: float,
    ) -> None:
        """The line of a request to ``route`` (a template), answered ``status`` in
        ``size`` bytes (head included) after ``seconds``."""
        session = "" if session_id is None else f" session={session_id}"
        error = "" if kind is None else f" error={kind}"
        replica = self.replica_id
        shown = "" if replica is None else f" replica={replica}"
        text = f"{method} {route} {status} {seconds * 1000:.1f}ms {size}B{session}{shown}{error}"
        lines = _access_lines
        if lines is not None and not lines.json:
            lines.add(text, None)
            return
        fields: dict[str, Any] = {
            "method": method,
            "route": route,
            "status": status,
            "durationMs": round(seconds * 1000, 1),
            "bytes": size,
        }
        if session_id is not None:
            fields["sessionId"] = session_id
        if replica is not None:
            fields["replicaId"] = replica
        if kind is not None:
            fields["errorKind"] = kind
        if lines is not None:
            lines.add(text, fields)
        else:
            self.logger.info(text, extra={FIELDS: fields})


def access_log_class(replica_id: str | None = None) -> type[AccessLog]:
    """:class:`AccessLog` naming ``replica_id`` in each line when set, for an observer
    (:meth:`bridge.observe.Observer.log_access`) and a runner (``web.AppRunner(app,
    access_log=ACCESS, access_log_class=...)``)."""
    return type("AccessLog", (AccessLog,), {"replica_id": replica_id})


# -- sessions and app-servers ---------------------------------------------------------

#: Why a session ended, as its line says.
END_REASONS = ("deleted", "idle_timeout", "app_server_exit", "drain", "shutdown")


def _with_replica(fields: dict[str, Any], replica_id: str | None) -> dict[str, Any]:
    if replica_id is not None:
        fields["replicaId"] = replica_id
    return fields


def session_started(session_id: str, replica_id: str | None, mode: str) -> None:
    fields = {"event": "session_started", "sessionId": session_id, "mode": mode}
    SESSIONS.info(
        "session %s started (%s)",
        session_id,
        mode,
        extra={FIELDS: _with_replica(fields, replica_id)},
    )


def session_ended(
    session_id: str, reason: str, replica_id: str | None, lived_seconds: float
) -> None:
    fields = {
        "event": "session_ended",
        "sessionId": session_id,
        "reason": reason,
        "livedMs": round(lived_seconds * 1000),
    }
    SESSIONS.info(
        "session %s ended: %s",
        session_id,
        reason,
        extra={FIELDS: _with_replica(fields, replica_id)},
    )


def app_server_exited(
    session_id: str | None,
    replica_id: str | None,
    exit_code: int | None,
    signal: str | None,
    described: str,
    *,
    asked: bool,
) -> None:
    """An app-server (or a session's connection to the shared one) ended: INFO for a
    session's, and for any the bridge did not stop itself; DEBUG for the app-server of a
    sessionless call or text turn stopped when it was done (one per such request)."""
    level = logging.INFO if session_id is not None or not asked else logging.DEBUG
    if not SESSIONS.isEnabledFor(level):
        return
    fields: dict[str, Any] = {
        "event": "app_server_exited",
        "exitCode": exit_code,
        "signal": signal,
        "stoppedByBridge": asked,
    }
    if session_id is not None:
        fields["sessionId"] = session_id
    whose = f"session {session_id}" if session_id is not None else "a sessionless request"
    SESSIONS.log(
        level,
        "app-server of %s ended: %s%s",
        whose,
        described,
        "" if asked else " (not stopped by the bridge)",
        extra={FIELDS: _with_replica(fields, replica_id)},
    )
