"""A session: one app-server process, its event log and its open server requests."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from bridge import errors
from bridge.events import Event, EventLog, rfc3339
from bridge.process.rpc import AppServerProcess, ExitInfo, ProcessGone, RpcError, StdinFull

#: How many answered request keys a session remembers, to tell "already answered"
#: from "never existed".
ANSWERED_MEMORY = 1024


@dataclass(slots=True)
class ServerRequest:
    """A request the app-server sent to the client and that awaits a reply."""

    key: str
    request_id: Any
    method: str
    params: Any


def request_key(request_id: Any) -> str:
    """The HTTP-facing key of a JSON-RPC id: the id as a string."""
    if isinstance(request_id, str):
        return request_id
    return str(request_id) if not isinstance(request_id, bool) else str(request_id).lower()


def rpc_failure(exc: Exception, what: str) -> errors.RestError:
    """Map a failed JSON-RPC exchange to the contract's error kinds."""
    if isinstance(exc, RpcError):
        return errors.app_server_error(exc.code, exc.message, exc.data)
    if isinstance(exc, ProcessGone):
        info = exc.exit_info
        if info.protocol_error:
            return errors.protocol_error(info.describe())
        return errors.app_server_exited(
            info.describe(), data={"exitCode": info.exit_code, "signal": info.signal}
        )
    if isinstance(exc, StdinFull):
        return errors.busy("The app-server is not reading its input; retry later.")
    if isinstance(exc, TimeoutError):
        return errors.timeout(f"{what} did not complete before its deadline.")
    raise exc


class Session:
    """A live (or exited) app-server process, addressed by its ``sessionId``."""

    def __init__(self, process: AppServerProcess, *, event_buffer: int) -> None:
        self.id = str(uuid.uuid4())
        self.process = process
        self.events = EventLog(event_buffer)
        self.created_at = time.time()
        self.last_activity_at = self.created_at
        self.initialize_result: Any = None
        #: Readers (SSE streams, long-polls) currently attached; a read session is not idle.
        self.readers = 0
        self._pending: dict[str, ServerRequest] = {}
        self._answered: OrderedDict[str, None] = OrderedDict()
        process.on_notification = self._on_notification
        process.on_request = self._on_request
        process.exit_callbacks.append(self._on_exit)

    # -- state -----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.process.running

    def touch(self) -> None:
        self.last_activity_at = time.time()

    def pending_request_keys(self) -> list[str]:
        return list(self._pending)

    def summary(self) -> dict[str, Any]:
        info = self.process.exit_info
        return {
            "sessionId": self.id,
            "createdAt": rfc3339(self.created_at),
            "lastActivityAt": rfc3339(self.last_activity_at),
            "state": "running" if info is None else "exited",
            "exitCode": None if info is None else info.exit_code,
            "pendingRequests": self.pending_request_keys(),
            "nextSeq": self.events.next_seq,
            "bufferedEvents": len(self.events),
        }

    # -- calls and replies -----------------------------------------------------

    async def call(self, method: str, params: Any, timeout: float) -> Any:
        self.touch()
        if not self.running:
            raise errors.session_exited(self.id)
        try:
            return await self.process.call(method, params, timeout)
        except (RpcError, ProcessGone, StdinFull, TimeoutError) as exc:
            raise rpc_failure(exc, f"The call to {method!r}") from None
        finally:
            self.touch()

    def reply(self, key: str, *, result: Any = None, error: dict[str, Any] | None = None) -> None:
        """Answer a pending server request with a result, or with ``error``."""
        self.touch()
        if not self.running:
            raise errors.session_exited(self.id)
        request = self._pending.get(key)
        if request is None:
            if key in self._answered:
                raise errors.request_already_answered(key)
            raise errors.request_not_found(key)
        try:
            if error is None:
                self.process.respond(request.request_id, result)
            else:
                self.process.respond_error(
                    request.request_id, error["code"], error["message"], error.get("data")
                )
        except (ProcessGone, StdinFull) as exc:
            raise rpc_failure(exc, "The reply") from None
        self._settle(key)

    def _settle(self, key: str) -> None:
        self._pending.pop(key, None)
        self._answered[key] = None
        if len(self._answered) > ANSWERED_MEMORY:
            self._answered.popitem(last=False)

    # -- events ----------------------------------------------------------------

    async def read_events(self, after: int | None, wait: float, limit: int) -> list[Event]:
        """Events after ``after``, or from the session's cursor (advancing it) when None.

        Waits up to ``wait`` seconds for one to arrive. Raises ``session_exited``
        when the log is closed and the reader is past its end.
        """
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
                    return batch
                if log.closed:
                    raise errors.session_exited(self.id)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return []
                await log.wait(position, remaining)
        finally:
            self.readers -= 1
            self.touch()

    def _on_notification(self, method: str, params: Any) -> None:
        if method == "serverRequest/resolved" and isinstance(params, dict):
            # The server settled one of its requests itself (e.g. the turn ended).
            resolved = params.get("requestId")
            if resolved is not None:
                key = request_key(resolved)
                if key in self._pending:
                    self._settle(key)
        self.events.append("notification", method, params, None, self.process.received_at)

    def _on_request(self, request_id: Any, method: str, params: Any) -> None:
        key = request_key(request_id)
        self._pending[key] = ServerRequest(key, request_id, method, params)
        self._answered.pop(key, None)
        self.events.append("request", method, params, key, self.process.received_at)

    def _on_exit(self, info: ExitInfo) -> None:
        self._pending.clear()
        self.events.close(info.to_event_params())
