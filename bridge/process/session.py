"""A session: one app-server conversation, its event log and its open server requests."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bridge import errors
from bridge.events import Event, EventLog, LogReader, rfc3339
from bridge.process.channel import ExitInfo
from bridge.process.outcomes import request_key, rpc_failure
from bridge.process.peer import JsonRpcPeer, ProcessGone, RpcError, StdinFull

if TYPE_CHECKING:  # loaded only where metrics are on
    from bridge.metrics import Metrics

log = logging.getLogger("bridge")

#: How many answered request keys a session remembers, to tell "already answered"
#: from "never existed".
ANSWERED_MEMORY = 1024


class Session:
    """A live (or exited) app-server conversation, addressed by its ``sessionId``."""

    def __init__(
        self,
        peer: JsonRpcPeer,
        *,
        session_id: str,
        event_buffer: int,
        event_buffer_bytes: int,
        reader_stall: float,
    ) -> None:
        self.id = session_id
        self.peer = peer
        self.events = EventLog(event_buffer, event_buffer_bytes)
        self.created_at = time.time()
        self.last_activity_at = self.created_at
        self.initialize_result: Any = None
        #: Why the bridge ended it (bridge.logs.END_REASONS); None while it lives, or
        #: when its app-server ended by itself.
        self.end_reason: str | None = None
        #: Readers (SSE streams, long-polls) currently attached; a read session is not idle.
        self.readers = 0
        #: Calls waiting for the app-server's answer; a session with one is not idle.
        self.calls = 0
        #: The app-server's requests awaiting a reply: request key → (JSON-RPC id, when
        #: it arrived, for the wait the metrics observe).
        self._pending: dict[str, tuple[str | int, float]] = {}
        #: Where gaps, cut-loose readers and answered requests are reported (bridge.metrics).
        self.metrics: Metrics | None = None
        self._answered: OrderedDict[str, None] = OrderedDict()
        self._reader_stall = reader_stall
        self._stall_timer: asyncio.TimerHandle | None = None
        peer.on_notification = self._on_notification
        peer.on_request = self._on_request
        peer.flow_gate = self._flow_gate
        peer.exit_callbacks.append(self._on_exit)
        self.events.on_progress = self._on_reader_progress

    # -- state -----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.peer.running

    def touch(self) -> None:
        self.last_activity_at = time.time()

    @property
    def pending_requests(self) -> int:
        return len(self._pending)

    def busy(self) -> bool:
        """True while something waits on the session: a call, a reader, or the server."""
        return bool(self.calls or self.readers or self._pending)

    def exited_error(self) -> errors.RestError:
        """409 ``session_exited``, worded for what ended: a process or a connection."""
        return errors.session_exited(self.id, shared=self.peer.shared)

    def summary(self) -> dict[str, Any]:
        info = self.peer.exit_info
        return {
            "sessionId": self.id,
            "createdAt": rfc3339(self.created_at),
            "lastActivityAt": rfc3339(self.last_activity_at),
            "state": "running" if info is None else "exited",
            "exitCode": None if info is None else info.exit_code,
            "pendingRequests": list(self._pending),
            "nextSeq": self.events.next_seq,
            "bufferedEvents": len(self.events),
        }

    # -- calls and replies -----------------------------------------------------

    async def call(self, method: str, params: Any, timeout: float) -> Any:
        # touch() and running written out: three Python calls fewer on every session call.
        peer = self.peer
        self.last_activity_at = time.time()
        if not peer.running:
            raise self.exited_error()
        self.calls += 1
        try:
            return await peer.call(method, params, timeout)
        except (RpcError, ProcessGone, StdinFull, TimeoutError) as exc:
            raise rpc_failure(exc, f"The call to {method!r}") from None
        finally:
            self.calls -= 1
            self.last_activity_at = time.time()

    def reply(self, key: str, *, result: Any = None, error: dict[str, Any] | None = None) -> None:
        """Answer a pending server request with a result, or with ``error``."""
        self.touch()
        if not self.running:
            raise self.exited_error()
        pending = self._pending.get(key)
        if pending is None:
            if key in self._answered:
                message = f"The server request {key!r} has already been answered."
                raise errors.of_kind("request_already_answered", message)
            raise errors.request_not_found(key)
        request_id = pending[0]
        try:
            if error is None:
                self.peer.respond(request_id, result)
            else:
                self.peer.respond_error(
                    request_id, error["code"], error["message"], error.get("data")
                )
        except (ProcessGone, StdinFull) as exc:
            raise rpc_failure(exc, "The reply") from None
        self._settle(key, "replied")

    def _settle(self, key: str, outcome: str) -> None:
        request = self._pending.pop(key, None)
        if request is not None and self.metrics is not None:
            self.metrics.answered(outcome, time.monotonic() - request[1])
        self._answered[key] = None
        if len(self._answered) > ANSWERED_MEMORY:
            self._answered.popitem(last=False)

    # -- events ----------------------------------------------------------------

    async def read_events(self, after: int | None, wait: float, limit: int) -> list[Event]:
        """Events after ``after``, or from the session's cursor (advancing it) when None,
        waiting up to ``wait`` seconds; ``session_exited`` once the reader is past the end."""
        log = self.events
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        self.readers += 1
        try:
            while True:
                position = log.cursor if after is None else after
                batch = log.read(position, limit)
                if batch:
                    if after is None:
                        log.cursor = batch[-1].seq
                    self.count_gap(batch)
                    return batch
                if log.closed:
                    raise self.exited_error()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return []
                await log.wait(position, remaining)
        finally:
            self.readers -= 1
            self.touch()

    def count_gap(self, batch: list[Event]) -> None:
        if batch and batch[0].kind == "gap" and self.metrics is not None:
            self.metrics.gaps.inc()

    def _on_notification(self, method: str, params: Any) -> None:
        if method == "serverRequest/resolved" and isinstance(params, dict):
            # The server settled one of its requests itself (e.g. the turn ended).
            resolved = params.get("requestId")
            if resolved is not None:
                key = request_key(resolved)
                if key in self._pending:
                    self._settle(key, "resolved")
        self.events.append("notification", method, params, None, self.peer.received_at)

    def _on_request(self, request_id: Any, method: str, params: Any) -> None:
        key = request_key(request_id)
        if key in self._pending:
            # Two requests with one id: a reply could only ever reach one of them.
            self.peer.break_protocol(
                "the app-server reused the id of a request still awaiting its reply"
            )
            return
        self._pending[key] = (request_id, time.monotonic())
        self._answered.pop(key, None)
        self.events.append("request", method, params, key, self.peer.received_at)

    def open_stream(self, after: int | None) -> SessionStream:
        """An SSE reader from ``after``, or from the cursor (which it then moves)."""
        return SessionStream(self, after)

    # -- flow control ----------------------------------------------------------------

    def _flow_gate(self, incoming: int) -> bool:
        """Hold the app-server's output back while an attached stream would lose events."""
        if not self.events.must_wait(incoming):
            return False
        if self._stall_timer is None:
            self._stall_timer = asyncio.get_running_loop().call_later(
                self._reader_stall, self._check_stalled
            )
        return True

    def _on_reader_progress(self) -> None:
        if self.peer.paused:
            self.peer.resume()
            if not self.peer.paused and self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

    def _check_stalled(self) -> None:
        """Cut loose the streams that have not read for the stall time, then read on."""
        self._stall_timer = None
        if not self.peer.paused:
            return
        now = time.monotonic()
        cut = self.events.cut_loose(now - self._reader_stall)
        if cut and self.metrics is not None:
            self.metrics.cut_loose.inc(cut)
        if cut:
            log.info(
                "session %s: %d event stream(s) stopped reading for %g s; reading on, "
                "their connections ended (resumed, they get a gap)",
                self.id,
                cut,
                self._reader_stall,
            )
        self.peer.resume()
        if self.peer.paused:
            oldest = self.events.oldest_progress()
            delay = self._reader_stall if oldest is None else oldest + self._reader_stall - now
            self._stall_timer = asyncio.get_running_loop().call_later(
                max(delay, 0.01), self._check_stalled
            )

    def _on_exit(self, info: ExitInfo) -> None:
        if self.metrics is not None:
            for key in list(self._pending):
                self._settle(key, "abandoned")
        self._pending.clear()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self.events.on_progress = None
        self.events.close(info.to_event_params())


class SessionStream:
    """One SSE stream's hold on a session: it reads on after a delete, to the ``exit`` event.

    Attached to the session's log, it loses nothing while it keeps reading (the
    app-server is held back instead: :meth:`EventLog.must_wait`). Without a position it
    starts at the session's cursor and moves it as it writes to the connection; if it
    ends before its ``exit`` event (the client went away), the cursor goes back to where
    it started, unless another reader moved it since, so events in flight are read again.
    """

    def __init__(self, session: Session, after: int | None) -> None:
        self.session = session
        log = session.events
        self._moves_cursor = after is None
        self._start = log.cursor if after is None else after
        self._cursor_set: int | None = None
        self._reader: LogReader | None = log.attach(self._start)
        #: Whether a batch was read before the log closed: the stream is then open and
        #: owed its ``exit`` event, wherever its position is.
        self._open = False
        session.readers += 1

    @property
    def position(self) -> int:
        return self._reader.position if self._reader is not None else 0

    async def next_batch(self, wait: float, limit: int) -> list[Event]:
        """Events after the position (a ``gap`` first if some were dropped), waiting up to ``wait``.

        Raises ``session_exited`` once the log has ended and the stream is past its end,
        unless the stream was open before: that one still ends with the ``exit`` event.
        """
        log = self.session.events
        position = self.position
        batch = log.read(position, limit)
        if not batch and not log.closed:
            self._open = True
            await log.wait(position, wait)
            batch = log.read(position, limit)
        if not batch and log.closed:
            if not self._open:
                raise self.session.exited_error()
            # The exit event is the newest, always kept; its seq is next_seq - 1.
            return log.read(log.next_seq - 2, 1)
        self._open = True
        self.session.count_gap(batch)
        return batch

    def delivered(self, seq: int) -> None:
        """Everything through ``seq`` has been written to the client."""
        if self._reader is not None:
            self._reader.advance(seq)
        log = self.session.events
        if self._moves_cursor and seq > log.cursor:
            log.cursor = seq
            self._cursor_set = seq

    def on_cut_loose(self, end: Callable[[], None]) -> None:
        """Call ``end`` when the stream is cut loose (:meth:`EventLog.cut_loose`)."""
        if self._reader is not None:
            self._reader.on_loose = end

    def close(self, completed: bool = False) -> None:
        """The stream ended: at its ``exit`` event (``completed``), or cut short."""
        if self._reader is None:
            return
        log = self.session.events
        if not completed and self._cursor_set is not None and log.cursor == self._cursor_set:
            log.cursor = self._start
        self._reader.detach()
        self._reader = None
        self.session.readers -= 1
        self.session.touch()
