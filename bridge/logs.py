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

import atexit
import contextlib
import json
import logging
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TextIO

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from bridge.process.channel import SERVER_WEDGED, ExitInfo

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


def utc_stamp(created: float) -> str:
    """``created`` (``time.time()``) as a JSON line's ``time``: UTC, RFC 3339, ms."""
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
            "time": utc_stamp(record.created),
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
#: "0" to "1023": the numbers of a line (status, bytes, whole milliseconds) up to 1023,
#: looked up: an int formatted in an f-string costs several times a tuple's index.
_NUMBERS = tuple(str(i) for i in range(1024))
#: "0.0" to "102.3": a duration in tenths of a millisecond, as a line shows it.
_TENTHS = tuple(f"{i // 10}.{i % 10}" for i in range(1024))
#: How a line names its session.
SESSION_PART = " session="

#: The clock of an access line's record (monotonic): when its request began and ended.
clock = time.perf_counter


class LineRoute:
    """What an access line says of a route and a method, found once for all their
    requests: the route's template (``-``: none) and the method shown (None: each
    request's own, made safe, for a method without a label of its own)."""

    __slots__ = ("head", "route", "shown")

    def __init__(self, route: str, shown: str | None) -> None:
        self.route = route
        self.shown = shown
        #: ``METHOD route `` when the method is known: the start of the line's message.
        self.head = None if shown is None else f"{shown} {route} "


#: A request's access line, not formatted yet: its route, its method (the request's own,
#: used when the route shows none), the path's session id (None: none, else as the
#: caller wrote it: checked when the line is formatted), status, bytes written (head
#: included), error kind, and when it began and ended (:data:`clock`).
Record = tuple[LineRoute, str, "str | None", int, int, "str | None", float, float]

#: A request aiohttp's parser refused: no route.
UNROUTED = LineRoute(NO_ROUTE, None)


class AccessLines:
    """The access lines of `rest-bridge serve`, formatted here and written to ``stream``:
    one write per batch of records (the observing middleware's, :mod:`bridge.observe`:
    at most :data:`BATCH_LINES` lines or :data:`FLUSH_SECONDS` apart, and at exit).

    What ``logging`` costs per record (a record object, the handler's lock, a formatter,
    a write and a flush each) is several times what the bridge spends on a call; this is
    one loop over the batch, an f-string a line, and one write. The lines are those the
    formatters would write, and the ``bridge.access`` logger's level still decides
    whether there are any.
    """

    def __init__(self, log_format: str, stream: TextIO) -> None:
        self.json = log_format == "json"
        self.stream = stream
        self._second = -1
        self._stamp = ""

    def write(self, records: Sequence[Record], replica: str | None) -> None:
        """The lines of ``records``, written at once."""
        lines = self.lines(records, replica)
        with contextlib.suppress(OSError, ValueError):  # stderr closed: nobody to tell
            self.stream.write(lines)
            self.stream.flush()

    def lines(
        self, records: Sequence[Record], replica: str | None, through: logging.Logger | None = None
    ) -> str:
        """The lines of ``records``, each ending in a newline; or, ``through`` a logger,
        a record each with its message and fields (its handler formats them).

        Records come in the order their requests ended. A line's time is when its request
        ended, on the wall clock: its text is made once per millisecond (``start`` to
        ``stop`` on the records' clock), not once per line.
        """
        out: list[str] = []
        append = out.append
        json = self.json or through is not None
        offset = time.time() - clock()
        second, stamp = self._second, self._stamp
        numbers, tenths_shown, shown_ids = _NUMBERS, _TENTHS, _safe_ids
        start = stop = 0.0
        prefix = when = ""
        end = "" if replica is None else f" replica={replica}"
        for where, method, raw_id, status, size, kind, began, ended in records:
            if not start <= ended < stop:
                now = int((ended + offset) * 1000)
                at = now // 1000
                if at != second:
                    second = at
                    if json:
                        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at))
                    else:
                        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
                if json:
                    when = f"{stamp}.{_MILLIS[now - at * 1000]}Z"
                else:
                    prefix = f"{stamp},{_MILLIS[now - at * 1000]} INFO bridge.access "
                start = now / 1000 - offset
                stop = start + 0.001
            tenths = int((ended - began) * 10000.0 + 0.5)
            session = ""
            if raw_id is not None:
                session = shown_ids.get(raw_id) or session_part(raw_id)
            line = (
                f"{prefix}{where.head or f'{safe_method(method)} {where.route} '}"
                f"{numbers[status] if 0 <= status < 1024 else status} "
                f"{tenths_shown[tenths] if tenths < 1024 else f'{tenths // 10}.{tenths % 10}'}ms "
                f"{numbers[size] if size < 1024 else size}B{session}{end}"
                f"{'' if kind is None else ' error=' + kind}\n"
            )
            if not json:
                append(line)
                continue
            text = line[:-1]
            shown = session[len(SESSION_PART) :] if session else None
            if through is not None:
                fields = fields_of(where, method, shown, status, size, kind, tenths, replica)
                through.info(text, extra={FIELDS: fields})
                continue
            head = {"time": when, "level": "INFO", "logger": "bridge.access", "message": text}
            record = fields_of(where, method, shown, status, size, kind, tenths, replica, head)
            append(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE).decode())
        self._second, self._stamp = second, stamp
        return "".join(out)


def fields_of(
    where: LineRoute,
    method: str,
    session: str | None,
    status: int,
    size: int,
    kind: str | None,
    tenths: int,
    replica: str | None,
    into: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An access line's JSON fields (``session``: the id already made safe), added to
    ``into`` when given (a whole JSON line is then one dict)."""
    fields: dict[str, Any] = {} if into is None else into
    fields["method"] = where.shown or safe_method(method)
    fields["route"] = where.route
    fields["status"] = status
    fields["durationMs"] = tenths / 10
    fields["bytes"] = size
    if session is not None:
        fields["sessionId"] = session
    if replica is not None:
        fields["replicaId"] = replica
    if kind is not None:
        fields["errorKind"] = kind
    return fields


#: What formats the fields of the lines written through ``logging``.
_UNBATCHED = AccessLines("json", sys.stderr)
#: Set by :func:`configure`: where the access lines of this process go.
_access_lines: AccessLines | None = None
#: At most this many access lines wait to be written, at most this long (seconds).
BATCH_LINES = 256
FLUSH_SECONDS = 0.1


class LogStream(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`configure` installs: before it writes a line, the access lines
    waiting in batches are written (:func:`settle_pending`), so that the log reads in
    the order its lines happened, whatever wrote them."""

    def emit(self, record: logging.LogRecord) -> None:
        settle_pending()
        super().emit(record)


#: What holds access lines not written yet (the observers of :mod:`bridge.observe`),
#: each with a ``settle()`` that writes them; and the thread they are settled on (the
#: event loop's: a line logged from another thread does not touch them).
_holders: weakref.WeakSet[Any] = weakref.WeakSet()
_holders_thread = threading.main_thread().ident
_settling = False


def holds_lines(holder: Any) -> None:
    """``holder`` keeps access lines back in batches (``holder.settle()`` writes them):
    they are written before any other line, and at exit."""
    global _holders_thread
    _holders.add(holder)
    _holders_thread = threading.get_ident()


def settle_pending() -> None:
    """Write every access line held back in a batch, now (before another line)."""
    global _settling
    if _settling or not _holders or threading.get_ident() != _holders_thread:
        return
    _settling = True
    try:
        for holder in list(_holders):
            holder.settle()
    finally:
        _settling = False


atexit.register(settle_pending)


def log_format() -> str:
    """The format :func:`configure` set for this process's lines (text until then)."""
    return _format


def configure(log_format: str = DEFAULT_FORMAT, level: str = DEFAULT_LEVEL) -> None:
    """Every log line of the process to stderr, in ``log_format``, from ``level`` up."""
    global _format, _access_lines
    if log_format not in LOG_FORMATS:
        raise ValueError(f"{log_format!r} is not a log format ({', '.join(LOG_FORMATS)})")
    if level not in LOG_LEVELS:
        raise ValueError(f"{level!r} is not a log level ({', '.join(LOG_LEVELS)})")
    _format = log_format
    _access_lines = AccessLines(log_format, sys.stderr)
    handler = LogStream(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def say(message: str, stream: TextIO | None = None, **fields: Any) -> None:
    """A line of the start-up banner, to stdout whatever
    the level: the text itself, or in ``json`` the object a log line would be, logger
    ``bridge.banner``, with ``fields`` as keys."""
    out = stream or sys.stdout
    if _format == "json":
        line = {
            "time": utc_stamp(time.time()),
            "level": "INFO",
            "logger": "bridge.banner",
            "message": message.strip(),
            **fields,
        }
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
    else:
        out.write(message + "\n")
    out.flush()


def session_part(raw: str) -> str:
    """`` session=<raw>`` when ``raw`` could be a session id, else `` session=?``: a path
    holds what the caller wrote (a newline, a megabyte), which a log line does not
    repeat. The ids found so are kept, with their text, so the requests of a session do
    not match the pattern again."""
    found = _safe_ids.get(raw)
    if found is not None:
        return found
    if _SESSION_ID.fullmatch(raw) is None:
        return _UNSAFE_PART
    if len(_safe_ids) >= SAFE_IDS_KEPT:
        _safe_ids.clear()
    found = _safe_ids[raw] = SESSION_PART + raw
    return found


_UNSAFE_PART = SESSION_PART + "?"
#: The ids :func:`session_part` has found safe lately (each at most 128 characters),
#: with the text a line shows for each.
SAFE_IDS_KEPT = 4096
_safe_ids: dict[str, str] = {}


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
    (:mod:`bridge.observe`), which hands :meth:`write_records` its batches. This is also
    aiohttp's public access-log hook, for the one kind of request no application code
    sees: one its parser refused (aiohttp's own 400), whose line has no route.
    """

    #: REST_ADAPTER_REPLICA_ID; set on a subclass by :func:`access_log_class`.
    replica_id: ClassVar[str | None] = None

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    @staticmethod
    def batched() -> bool:
        """Whether lines are written in batches (:func:`configure` was called), rather
        than through ``logging`` one by one."""
        return _access_lines is not None

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        # Every request that reached routing has its line from the middleware already: a
        # request aiohttp's parser refused has no route (``match_info`` asserts that it is
        # set; a plain ``BaseRequest`` has none).
        try:
            if request.match_info is not None:  # type: ignore[attr-defined]
                return
        except (AssertionError, AttributeError):
            pass
        now = clock()
        status, size = response.status, response.body_length
        record: Record = (UNROUTED, request.method, None, status, size, None, now - time, now)
        # After the lines of the requests that ended before it, waiting in batches.
        settle_pending()
        self.write_records((record,))

    def write_records(self, records: Sequence[Record]) -> None:
        """The lines of ``records``: to the batched writer :func:`configure` set up, else
        through the ``bridge.access`` logger, one record each."""
        lines = _access_lines
        replica = self.replica_id
        if lines is not None:
            lines.write(records, replica)
            return
        # Not configured (an application served by a host): one record each, through the
        # logger, as its handler formats them.
        _UNBATCHED.lines(records, replica, through=self.logger)


def access_log_class(replica_id: str | None = None) -> type[AccessLog]:
    """:class:`AccessLog` naming ``replica_id`` in each line when set, for an observer
    (:meth:`bridge.observe.Observer.log_access`) and a runner (``web.AppRunner(app,
    access_log=ACCESS, access_log_class=...)``)."""
    return type("AccessLog", (AccessLog,), {"replica_id": replica_id})


# -- lines a caller can repeat at will -----------------------------------------------

#: At most one line of a kind this often (seconds), by default.
THROTTLE_SECONDS = 10.0


class Throttle:
    """At most one line of each kind every ``interval`` seconds, for lines whose rate
    callers set (a request aiohttp's parser refuses, an app-server that cannot start):
    :meth:`admit` says whether a line may be written now and how many of its kind were
    held back since the last one (which that line then says); :meth:`flush` writes, for
    each kind, how many are still held back (when the application stops, so that none
    goes uncounted), by ``held``. Every throttle made is flushed by :func:`flush_held`.
    """

    def __init__(
        self,
        held: Callable[[str, int], None],
        interval: float = THROTTLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self._held_line = held
        self._clock = clock
        self._next_at: dict[str, float] = {}
        self._held: dict[str, int] = {}
        _THROTTLES.add(self)

    def admit(self, kind: str) -> int | None:
        """None: hold this line back (it is counted); else how many lines of ``kind``
        were held back since its last one."""
        now = self._clock()
        if now < self._next_at.get(kind, 0.0):
            self._held[kind] = self._held.get(kind, 0) + 1
            return None
        if len(self._next_at) >= THROTTLE_KINDS and kind not in self._next_at:
            self.flush()
        self._next_at[kind] = now + self.interval
        return self._held.pop(kind, 0)

    def flush(self) -> None:
        """The count of each kind's lines held back since its last line, if any; then the
        next line of any kind is written at once (an application started anew in this
        process has its first lines)."""
        held, self._held = self._held, {}
        self._next_at.clear()
        for kind, count in held.items():
            self._held_line(kind, count)


#: A throttle remembers at most this many kinds (a kind is a fixed word, never a
#: caller's text: far fewer in practice).
THROTTLE_KINDS = 64
_THROTTLES: weakref.WeakSet[Throttle] = weakref.WeakSet()


def more_since(count: int) -> str:
    """What a line adds about the ``count`` lines of its kind held back before it."""
    return f" (and {count} more since the last such line)" if count else ""


#: Where an app-server that could not start is told of (the operator's log).
STARTS = logging.getLogger("bridge")


def _starts_held(kind: str, count: int) -> None:
    STARTS.log(
        _start_levels.get(kind, logging.ERROR),
        "%d more app-server start failure%s like the last (%s) since the last such line",
        count,
        "s"[: count - 1],
        kind,
        extra={FIELDS: {"event": "app_server_start_failed", "failure": kind, "heldBack": count}},
    )


_starts = Throttle(_starts_held)
_start_levels: dict[str, int] = {}


def start_failed(kind: str, message: str, *args: Any, level: int = logging.ERROR) -> None:
    """The operator's line about an app-server that could not start, ``kind`` the way it
    failed (``spawn``, ``cwd``, ``resources``, ``exited``, ``connection``, ``timeout``,
    ``initialize``): callers repeat it at will (each request tries a start), so at most
    one line a kind every :data:`THROTTLE_SECONDS`, with the count of those held back."""
    if not STARTS.isEnabledFor(level):
        return
    held = _starts.admit(kind)
    if held is None:
        return
    _start_levels[kind] = level
    fields = {"event": "app_server_start_failed", "failure": kind}
    STARTS.log(level, message + "%s", *args, more_since(held), extra={FIELDS: fields})


def initialize_refused(command: str, message: str, code: Any, *, by_caller: bool) -> None:
    """The app-server (``command``, empty: one the bridge reaches by URL) answered
    ``initialize`` with an error: its ``message`` on one line. ``by_caller``: the request's
    options shaped that start, so it may be the caller's doing: a WARNING of a kind of its
    own, which a caller's refusals cannot hold back the bridge's own ERROR lines with."""
    named = f"`{command}`" if command else "(shared, by URL)"
    said = "the app-server %s refused `initialize`%s: %s (code %s)"
    how = " shaped by the request's options" if by_caller else ""
    kind, level = (
        ("initialize_options", logging.WARNING) if by_caller else ("initialize", logging.ERROR)
    )
    start_failed(kind, said, named, how, stderr_summary(message), code, level=level)


def flush_held() -> None:
    """Every throttle's counts of the lines it holds back (:meth:`Throttle.flush`)."""
    for throttle in list(_THROTTLES):
        throttle.flush()


#: How much of a start-up failure's stderr one log line carries (its end).
LOG_STDERR_CHARS = 1000


def stderr_summary(tail: str) -> str:
    """The end of a stderr tail on one line: lines joined by `` | ``, at most
    :data:`LOG_STDERR_CHARS` characters."""
    text = " | ".join(line.strip() for line in tail.splitlines() if line.strip())
    if not text:
        return "(nothing)"
    if len(text) > LOG_STDERR_CHARS:
        text = "…" + text[-LOG_STDERR_CHARS:]
    return text


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
    info: ExitInfo,
    *,
    asked: bool,
) -> None:
    """An app-server (or a session's connection to the shared one) ended.

    ``asked``: the bridge stopped it as it meant to (a delete, an idle session, the end
    of a sessionless call, shutdown): INFO for a session's, DEBUG for a sessionless
    request's (one per such request). Killed: the bridge killed it because it was broken
    (it broke the protocol, it stopped answering). Otherwise it ended by itself.
    An end that needs attention is a WARNING: one the bridge did not ask for with a
    non-zero (or unknown) exit code or a signal, or a kill. Those of sessionless requests
    are throttled like start failures (:class:`Throttle`): a broken command would write
    one a request."""
    exit_code, signal = info.exit_code, info.signal
    killed = bool(info.protocol_error) or info.connection == SERVER_WEDGED
    failed = not asked and (killed or exit_code != 0 or signal is not None)
    if failed:
        level = logging.WARNING
    else:
        level = logging.INFO if session_id is not None or not asked else logging.DEBUG
    if not SESSIONS.isEnabledFor(level):
        return
    held = 0
    if failed and session_id is None:
        admitted = _exits.admit("sessionless")
        if admitted is None:
            return
        held = admitted
    fields: dict[str, Any] = {
        "event": "app_server_exited",
        "exitCode": exit_code,
        "signal": signal,
        "stoppedByBridge": asked or killed,
    }
    if session_id is not None:
        fields["sessionId"] = session_id
    whose = f"session {session_id}" if session_id is not None else "a sessionless request"
    how = "" if asked else " (killed by the bridge)" if killed else " (not stopped by the bridge)"
    SESSIONS.log(
        level,
        "app-server of %s ended: %s%s%s",
        whose,
        info.describe(),
        how,
        more_since(held),
        extra={FIELDS: _with_replica(fields, replica_id)},
    )


def _exits_held(kind: str, count: int) -> None:
    SESSIONS.warning(
        "%d more such ends of sessionless requests' app-servers since the last such line",
        count,
        extra={FIELDS: {"event": "app_server_exited", "heldBack": count}},
    )


_exits = Throttle(_exits_held)
#: The attribute of a record (``extra={THROTTLE: kind}``) that :class:`ThrottledLines`
#: throttles: for the layers below this module, which log through ``logging`` alone.
THROTTLE = "throttle"


class ThrottledLines(logging.Filter):
    """A logger's records that name a kind of line (:data:`THROTTLE`), through one
    :class:`Throttle`: at most one of each kind every :data:`THROTTLE_SECONDS`, the next
    saying how many were held back (installed on ``bridge.process`` with this module:
    the bridge stopping an app-server that broke the protocol, which a command that is no
    app-server does at every request)."""

    def __init__(self) -> None:
        super().__init__()
        self.throttle = Throttle(self._held)
        self._last: dict[str, tuple[str, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = getattr(record, THROTTLE, None)
        if not isinstance(kind, str):
            return True
        held = self.throttle.admit(kind)
        if held is None:
            return False
        self._last[kind] = (record.name, record.levelno)
        record.msg = f"{record.msg}{more_since(held)}"
        return True

    def _held(self, kind: str, count: int) -> None:
        name, level = self._last.get(kind, ("bridge", logging.WARNING))
        fields = {"event": "held_back", "kind": kind, "heldBack": count}
        logging.getLogger(name).log(
            level,
            "%d more lines like the last (%s) since the last such line",
            count,
            kind,
            extra={FIELDS: fields},
        )


logging.getLogger("bridge.process").addFilter(ThrottledLines())
