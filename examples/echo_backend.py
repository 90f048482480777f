"""A host-provided backend written only against ``bridge.backend.Backend``.

It answers every call by echoing it and keeps one event log per session, so the
whole sessions/events surface works without any app-server process. Serve it with
``backend_app(EchoBackend())``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from bridge import errors
from bridge.backend import Backend
from bridge.events import Event, EventLog, rfc3339
from bridge.models import ClientOptions, SessionCreated, SessionSummary


class EchoBackend(Backend):
    def __init__(self) -> None:
        self.logs: dict[str, EventLog] = {}
        self.created: dict[str, float] = {}

    def _log(self, session_id: str) -> EventLog:
        if session_id not in self.logs:
            raise errors.session_not_found(session_id)
        return self.logs[session_id]

    async def create_session(self, options: ClientOptions | None) -> SessionCreated:
        session_id = uuid.uuid4().hex
        self.logs[session_id] = EventLog(capacity=1000)
        self.created[session_id] = time.time()
        return SessionCreated(
            session_id=session_id,
            created_at=rfc3339(self.created[session_id]),
            initialize={"echo": True},
        )

    async def list_sessions(self) -> Sequence[SessionSummary]:
        return [
            SessionSummary(
                session_id=sid,
                created_at=rfc3339(self.created[sid]),
                last_activity_at=rfc3339(self.created[sid]),
                state="exited" if log.closed else "running",
                exit_code=0 if log.closed else None,
                pending_requests=[],
                next_seq=log.next_seq,
                buffered_events=len(log),
            )
            for sid, log in self.logs.items()
        ]

    async def delete_session(self, session_id: str) -> None:
        self._log(session_id).close({"exitCode": 0, "signal": None, "stderrTail": ""})
        del self.logs[session_id]

    async def session_call(
        self, session_id: str, method: str, params: Any, *, timeout_ms: int | None
    ) -> Any:
        log = self._log(session_id)
        log.append("notification", "echo/called", {"method": method, "params": params})
        return {"method": method, "params": params}

    async def read_events(
        self, session_id: str, *, after: int | None, wait_ms: int, limit: int
    ) -> Sequence[Event]:
        log = self._log(session_id)
        position = log.cursor if after is None else after
        await log.wait(position, wait_ms / 1000)
        batch = log.read(position, limit)
        if not batch and log.closed:
            raise errors.session_exited(session_id)
        if batch and after is None:
            log.cursor = batch[-1].seq
        return batch
