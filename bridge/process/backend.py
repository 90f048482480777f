"""The bundled backend: every session is a conversation with a real app-server.

How the app-server is reached is the launcher's (:mod:`bridge.process.startup`): a child
process per session by default, a connection to one shared app-server in shared mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from bridge import __version__, errors, logs
from bridge.backend import Backend, EventStream, new_session_id
from bridge.events import Event, rfc3339
from bridge.labels import exit_reason
from bridge.limits import RestLimits
from bridge.models import (
    ClientOptions,
    Compatibility,
    SessionCreated,
    SessionSummary,
    TextTurnRequest,
    TextTurnResponse,
)
from bridge.process import startup
from bridge.process.channel import ExitInfo
from bridge.process.outcomes import rpc_failure
from bridge.process.peer import JsonRpcPeer, ProcessGone, RpcError, StdinFull
from bridge.process.session import Session
from bridge.process.startup import DEFAULT_COMMAND, AppServerLauncher, SpawnStdio, parse_command
from bridge.process.text_turn import TextTurn

if TYPE_CHECKING:  # loaded only where metrics are on
    from bridge.metrics import Metrics

log = logging.getLogger("bridge")

DEFAULT_CLIENT_INFO = {
    "name": "codex_rest_bridge",
    "title": "Codex REST Bridge",
    "version": __version__,
}


class ProcessBackend(Backend):
    """One app-server conversation per session, sessionless call and text turn, reached
    as ``launcher`` says (default: :class:`SpawnStdio`, a child process of ``command``
    each); ``replica_id`` (REST_ADAPTER_REPLICA_ID) prefixes session ids."""

    def __init__(
        self,
        command: str | Sequence[str] = DEFAULT_COMMAND,
        limits: RestLimits | None = None,
        *,
        launcher: AppServerLauncher | None = None,
        replica_id: str | None = None,
    ) -> None:
        self.limits = limits or RestLimits()
        self.launcher = launcher or SpawnStdio(parse_command(command), self.limits)
        self.command = self.launcher.command
        self._sessions: dict[str, Session] = {}
        #: Slots of MAX_SESSIONS held by sessions being created and sessionless calls...
        self._reserved = 0
        #: ...and by deleted (or reaped) sessions whose processes are not gone yet.
        self._stopping = 0
        self._reaper: asyncio.Task[None] | None = None
        #: REST_ADAPTER_REPLICA_ID: session ids are then `<replica>.<uuid4>`.
        self.replica_id = replica_id
        #: A draining replica takes no new work (start_drain).
        self.draining = False
        #: Set while draining once nothing is held any more.
        self.drained = asyncio.Event()
        self._turns_active = 0
        self._background: set[asyncio.Task[Any]] = set()
        #: Every running conversation: sessions', sessionless calls' and text turns'.
        self._processes: set[JsonRpcPeer] = set()
        #: The conversations the bridge is stopping, and the sessions of those that have
        #: one: what an exit's log lines say (bridge.logs).
        self._asked_to_stop: set[JsonRpcPeer] = set()
        self._session_of: dict[JsonRpcPeer, Session] = {}
        self._closing = False
        #: Where events are reported (bridge.metrics), when metrics are on.
        self.metrics: Metrics | None = None
        self.mode = "process" if isinstance(self.launcher, SpawnStdio) else "shared"
        #: The userAgent of the last `initialize` answered (fake-codex or codex).
        self.user_agent: str | None = None
        #: Late replies (to finished calls) of the conversations already ended, and the
        #: events appended to the logs of the sessions already removed (bridge.ops).
        self.late_replies_ended = 0
        self.events_ended = 0

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_idle_sessions())

    async def close(self) -> None:
        """Stop every process, those of calls and text turns in flight included; spawn no
        more. Sessions stay listed until then, so that their readers get the ``exit``."""
        self._closing = True
        for session in self._sessions.values():
            session.end_reason = session.end_reason or ("drain" if self.draining else "shutdown")
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        await asyncio.gather(*(self._stop_fully(p) for p in list(self._processes)))
        self._sessions.clear()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.launcher.close()

    async def _reap_idle_sessions(self) -> None:
        idle = self.limits.session_idle_timeout_ms / 1000
        interval = max(0.05, min(idle / 4, 30.0))
        while True:
            await asyncio.sleep(interval)
            self._reap_once(idle)

    def _reap_once(self, idle: float) -> None:
        # A function of its own: a loop variable left in the reaper's frame would keep the
        # last session it looked at (and its whole log) alive until the next round.
        now = time.time()
        for session in list(self._sessions.values()):
            if not session.busy() and now - session.last_activity_at > idle:
                session.end_reason = "idle_timeout"
                self._run_in_background(self._remove(session))

    def _run_in_background(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- processes -------------------------------------------------------------

    def _initialize_params(self, options: ClientOptions | None) -> dict[str, Any]:
        client_info: dict[str, Any] = dict(DEFAULT_CLIENT_INFO)
        capabilities: dict[str, Any] = {}
        if options:
            if options.client_info:
                client_info = options.client_info.model_dump(exclude_none=True)
            if options.experimental_api is not None:
                capabilities["experimentalApi"] = options.experimental_api
            if options.opt_out_notification_methods is not None:
                capabilities["optOutNotificationMethods"] = options.opt_out_notification_methods
        params: dict[str, Any] = {"clientInfo": client_info}
        if capabilities:
            params["capabilities"] = capabilities
        return params

    async def _spawn(self, options: ClientOptions | None) -> JsonRpcPeer:
        if self._closing:
            raise errors.of_kind("app_server_spawn_failed", "The bridge is shutting down.")
        metrics = self.metrics
        try:
            process = await self.launcher.open(options)
        except errors.RestError as exc:
            if metrics is not None and exc.status >= 500:
                metrics.start_failed(self.mode, exc.kind, options)
            raise
        self._processes.add(process)
        process.exit_callbacks.append(lambda info: self._ended(process, info))
        if metrics is not None:
            metrics.spawned(self.mode)
        if self._closing:
            await process.shutdown(self.limits.shutdown_grace_ms / 1000)
            raise errors.of_kind("app_server_spawn_failed", "The bridge is shutting down.")
        return process

    def _ended(self, process: JsonRpcPeer, info: ExitInfo) -> None:
        """A conversation ended: counted, its app-server's line, and its session's end."""
        self._processes.discard(process)
        self.late_replies_ended += process.late_replies
        if self.metrics is not None:
            reason = exit_reason(
                info.exit_code, info.signal, bool(info.protocol_error), bool(info.connection)
            )
            self.metrics.exited(self.mode, reason)
        asked = process in self._asked_to_stop
        self._asked_to_stop.discard(process)
        session = self._session_of.pop(process, None)
        session_id = session.id if session is not None else None
        logs.app_server_exited(session_id, self.replica_id, info, asked=asked)
        if session is not None:
            reason = session.end_reason or "app_server_exit"
            logs.session_ended(
                session.id, reason, self.replica_id, time.time() - session.created_at
            )

    async def _initialize(self, process: JsonRpcPeer, options: ClientOptions | None) -> Any:
        """``initialize`` + ``initialized``; stops the process when it fails."""
        try:
            result = await process.call(
                "initialize",
                self._initialize_params(options),
                self.limits.spawn_timeout_ms / 1000,
            )
        except (RpcError, ProcessGone, StdinFull, TimeoutError) as exc:
            await self._stop_fully(process)
            if isinstance(exc, ProcessGone) and not self._closing:
                fail = startup.exited_at_startup(self.command, process.exit_info or exc.exit_info)
            elif isinstance(exc, TimeoutError):
                own = self.command if self.mode == "process" else ()
                ms = self.limits.spawn_timeout_ms
                fail = startup.spawn_timed_out(self.launcher.starting, ms, command=own)
            elif isinstance(exc, RpcError):
                fail = startup.initialize_refused(self.command, exc, options)
            else:
                fail = rpc_failure(exc, self.launcher.starting)
            if self.metrics is not None and not self._closing:
                self.metrics.start_failed(self.mode, fail.kind, options)
            raise fail from None
        except BaseException:
            await self._stop_fully(process)
            raise
        try:
            process.notify("initialized")
            self.user_agent = startup.user_agent(result) or self.user_agent
            if self.metrics is not None:
                self.metrics.started(options)
            return result
        except (ProcessGone, StdinFull) as exc:
            # It answered `initialize`, then stopped taking input: broken, not unstarted.
            await self._stop_fully(process)
            if isinstance(exc, StdinFull):
                raise rpc_failure(exc, self.launcher.starting) from None
            raise errors.of_kind(
                "protocol_error", "the app-server stopped taking input after answering `initialize`"
            ) from None

    async def _stop_fully(self, process: JsonRpcPeer) -> None:
        """Stop ``process`` and wait until it is gone, even when the caller is cancelled
        (a client that disconnects cancels its handler): the cancellation is re-raised
        then, so the slot is held until the process is gone."""
        if process.running:
            self._asked_to_stop.add(process)
        stopping = asyncio.ensure_future(process.shutdown(self.limits.shutdown_grace_ms / 1000))
        cancelled = False
        while not stopping.done():
            try:
                await asyncio.shield(stopping)
            except asyncio.CancelledError:
                cancelled = True
        stopping.result()
        if cancelled:
            raise asyncio.CancelledError

    async def _remove(self, session: Session) -> None:
        """Forget ``session`` at once; its slot is free when its process is gone."""
        if self._sessions.pop(session.id, None) is None:
            return
        self.events_ended += session.events.next_seq - 1
        self._stopping += 1
        try:
            await self._stop_fully(session.peer)
        finally:
            self._stopping -= 1
            self.check_drained()

    def late_replies(self) -> int:
        """Replies of the app-servers to unknown or finished request ids, so far."""
        return self.late_replies_ended + sum(p.late_replies for p in self._processes)

    def held(self) -> int:
        return len(self._sessions) + self._reserved + self._stopping + self._turns_active

    def check_drained(self) -> None:
        if self.draining and not self.held():
            self.drained.set()

    async def wait_drained(self) -> None:
        self.check_drained()
        await self.drained.wait()

    @contextlib.contextmanager
    def _slot(self) -> Iterator[None]:
        """One of MAX_SESSIONS held for a session being created or a sessionless call."""
        if self.draining:
            raise errors.replica_draining()
        limit = self.limits.max_sessions
        if len(self._sessions) + self._reserved + self._stopping >= limit:
            message = f"The bridge already holds its maximum of {limit} sessions."
            raise errors.of_kind("session_limit_reached", message)
        self._reserved += 1
        try:
            yield
        finally:
            self._reserved -= 1
            self.check_drained()

    async def probe(self) -> None:
        """Open an app-server conversation, initialize it and stop it: raises the error
        a new session would meet now (readiness, bridge.ops)."""
        process = await self._spawn(None)
        try:
            await self._initialize(process, None)
        finally:
            await self._stop_fully(process)

    # -- compatibility ---------------------------------------------------------

    async def compatibility(self) -> Compatibility:
        return await self.launcher.compatibility(self.user_agent)

    # -- sessionless calls -----------------------------------------------------

    async def call(
        self, method: str, params: Any, *, options: ClientOptions | None, timeout_ms: int | None
    ) -> Any:
        with self._slot():
            process = await self._spawn(options)
            try:
                # Outside a session nobody can answer the server's requests: say so at once.
                process.on_request = lambda request_id, method, params: process.refuse(
                    request_id, f"{method} cannot be answered: the bridge call has no session"
                )
                await self._initialize(process, options)
                timeout = (timeout_ms or self.limits.call_timeout_ms) / 1000
                try:
                    return await process.call(method, params, timeout)
                except (RpcError, ProcessGone, StdinFull, TimeoutError) as exc:
                    raise rpc_failure(exc, f"The call to {method!r}") from None
            finally:
                await self._stop_fully(process)

    # -- sessions --------------------------------------------------------------

    async def create_session(self, options: ClientOptions | None) -> SessionCreated:
        with self._slot():
            process = await self._spawn(options)
            session = Session(
                process,
                session_id=new_session_id(self.replica_id, str(uuid.uuid4())),
                event_buffer=self.limits.event_buffer,
                event_buffer_bytes=self.limits.event_buffer_bytes,
                reader_stall=self.limits.reader_stall_ms / 1000,
            )
            session.metrics = self.metrics
            session.initialize_result = await self._initialize(process, options)
            self._sessions[session.id] = session
            if process.running:
                self._session_of[process] = session
                logs.session_started(
                    session.id, self.replica_id, "shared" if process.shared else "process"
                )
        return SessionCreated.model_construct(
            session_id=session.id,
            created_at=rfc3339(session.created_at),
            initialize=session.initialize_result,
        )

    def sessions(self) -> dict[str, Session]:
        """The sessions held now, by id (a copy)."""
        return dict(self._sessions)

    def session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise errors.session_not_found(session_id)
        return session

    async def list_sessions(self) -> Sequence[SessionSummary]:
        return [SessionSummary.model_validate(s.summary()) for s in self._sessions.values()]

    async def delete_session(self, session_id: str) -> None:
        """Gone at once: every new request on the id is a 404; open streams read on to
        the ``exit`` event. Answers once the process is gone."""
        session = self.session(session_id)
        session.end_reason = session.end_reason or "deleted"
        await self._remove(session)

    def session_call(
        self, session_id: str, method: str, params: Any, *, timeout_ms: int | None
    ) -> Coroutine[Any, Any, Any]:
        # The session's call itself, not a coroutine around it (one frame less per call).
        timeout = (timeout_ms or self.limits.call_timeout_ms) / 1000
        return self.session(session_id).call(method, params, timeout)

    async def read_events(
        self, session_id: str, *, after: int | None, wait_ms: int, limit: int
    ) -> Sequence[Event]:
        wait = min(wait_ms, self.limits.max_wait_ms) / 1000
        return await self.session(session_id).read_events(after, wait, limit)

    async def open_stream(self, session_id: str, after: int | None) -> EventStream:
        return self.session(session_id).open_stream(after)

    async def reply_result(self, session_id: str, request_key: str, result: Any) -> None:
        self.session(session_id).reply(request_key, result=result)

    async def reply_error(
        self, session_id: str, request_key: str, code: int, message: str, data: Any
    ) -> None:
        error = {"code": code, "message": message, "data": data}
        self.session(session_id).reply(request_key, error=error)

    # -- text turns ------------------------------------------------------------

    async def text_turn(self, request: TextTurnRequest) -> TextTurnResponse:
        if self.draining:
            raise errors.replica_draining()
        limit = self.limits.max_concurrent_text_turns
        if self._turns_active >= limit:
            raise errors.of_kind(
                "busy", f"The bridge is already running {limit} text turns; retry later."
            )
        self._turns_active += 1
        began, outcome = time.monotonic(), "failed"
        try:
            deadline = (request.timeout_ms or self.limits.text_turn_timeout_ms) / 1000
            process = await self._spawn(request.options)
            try:
                turn = TextTurn(
                    process, request, self.limits.event_buffer, self.limits.event_buffer_bytes
                )
                async with asyncio.timeout(deadline):
                    await self._initialize(process, request.options)
                    response = await turn.run(self.limits.call_timeout_ms / 1000)
                    outcome = "completed"
                    return response
            except TimeoutError:
                outcome = "timeout"
                data: dict[str, Any] = {"reason": "deadline"}
                if turn.last_error is not None:
                    data["lastError"] = turn.last_error  # e.g. codex retrying its model
                message = f"The text turn did not complete within {deadline:g} s."
                raise errors.of_kind("timeout", message, data=data) from None
            except errors.RestError as exc:
                # Counted as the client is answered: a 504 of the spawn's deadline, or of
                # a turn that went idle or cannot reach its model, is a timeout too.
                outcome = "timeout" if exc.kind == "timeout" else outcome
                raise
            finally:
                await self._stop_fully(process)
                if self.metrics is not None:
                    first = turn.first_event_at
                    self.metrics.text_turn(
                        outcome, time.monotonic() - began, None if first is None else first - began
                    )
        finally:
            self._turns_active -= 1
            self.check_drained()
