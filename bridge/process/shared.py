"""Shared mode: one app-server for every session, each session a connection to it.

``codex app-server --listen unix://PATH`` (or ``ws://IP:PORT``) serves many clients from
one process, each connection a WebSocket that does its own ``initialize``. Each
conversation of :class:`ConnectShared` is a :class:`~bridge.process.peer.JsonRpcPeer` over
a :class:`~bridge.process.websocket.WebSocketChannel`, filtered by a
:class:`~bridge.process.tenancy.Tenant`; its "exit" is the end of the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from bridge import __version__, credentials, errors, logs, watchdog
from bridge.events import rfc3339
from bridge.limits import AppServerSettings, RestLimits
from bridge.models import ClientOptions, Compatibility, SharedAppServerState
from bridge.process import startup
from bridge.process.channel import SERVER_WEDGED, ExitInfo
from bridge.process.peer import JsonRpcPeer, ProcessGone, RpcError, StdinFull
from bridge.process.stdio import StdioChannel
from bridge.process.tenancy import Tenant
from bridge.process.websocket import WebSocketChannel

log = logging.getLogger("bridge")

#: After a connection the app-server closed, how long to wait for the shared process's
#: own exit, so that a session ended by a crash says so rather than "closed".
_CLOSE_TO_EXIT_SECONDS = 3.0
#: Once it has exited, how long its pipes may take to close (stdio.py waits 0.5 s).
_EXIT_TO_FINISH_SECONDS = 2.0
#: Restart backoff of the supervised app-server: first delay, cap, and how long it must
#: have run for the next failure to start over from the first delay.
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
BACKOFF_RESET_AFTER = 60.0
#: Connection attempts of one request when the supervised app-server dies under them
#: (each waits for its restart; one that keeps dying backs off past SPAWN_TIMEOUT_MS).
_CONNECT_ATTEMPTS = 3
#: The liveness probe's question: answered from memory by codex 0.169.0 (and fake-codex);
#: any answer, an error too, means the app-server reads and answers.
LIVENESS_METHOD = "thread/loaded/list"
_LIVENESS_PARAMS = {"limit": 1}
#: The probe connection's ``clientInfo`` (how the app-server's logs tell it from sessions).
PROBE_CLIENT_INFO = {
    "name": "codex_rest_bridge_liveness",
    "title": "Codex REST Bridge liveness probe",
    "version": __version__,
}
_SOCKET_NAME = "app-server.sock"
#: The version (and why none, and no kind) ``/v1/compatibility`` gives of an app-server it
#: did not start.
NOT_STARTED = (
    None,
    "the bridge connects to an app-server it did not start; "
    "appServer.shared.userAgent names the one that answered",
    None,
)


def _real_path(path: str) -> str | None:
    """Where a symlink leads (codex's ``unix://PATH`` is a link to its own socket); a
    function of its own, as the loop must not make blocking path calls inline."""
    try:
        return os.path.realpath(path, strict=True)
    except OSError:
        return None


def connect_failure(exc: BaseException) -> str:
    """Why a connection to the app-server failed: the system's words ("Connection refused")
    or the handshake's status; never a class name, an address or a header."""
    if isinstance(exc, aiohttp.WSServerHandshakeError):
        return f"the WebSocket handshake was answered {exc.status}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the app-server closed the connection during the handshake"
    error: BaseException | None = exc
    if isinstance(exc, aiohttp.ClientConnectorError):
        error = exc.os_error
    if isinstance(error, OSError) and error.errno:
        return os.strerror(error.errno)
    return "the connection failed"


#: ClientOptions that shape a process of one's own, refused in shared mode (403), with why.
PROCESS_OPTIONS = {
    "env": "the shared app-server's environment is the bridge's, set when it starts",
    "cwd": "the process's working directory is shared; give `cwd` per thread in thread/start",
    "configOverrides": "`-c` arguments belong to the shared app-server's command line",
}


class ConnectShared:
    """The launcher of shared mode: every session, sessionless call and text turn is a
    connection to one app-server, seeing its own threads only (tenancy.py). It starts and
    supervises that process (on a unix socket in a private 0700 directory), restarting it
    with a backoff when it dies; or, given a URL, connects to one that runs already."""

    starting = "Opening a connection to the shared app-server"

    def __init__(
        self, command: str | Sequence[str], limits: RestLimits, settings: AppServerSettings
    ) -> None:
        self.command = startup.parse_command(command)
        self.url = settings.url
        self._token = settings.token
        self._max_line_bytes = limits.max_line_bytes
        self._spawn_timeout = limits.spawn_timeout_ms / 1000
        self._shutdown_grace = limits.shutdown_grace_ms / 1000
        self.version = startup.VersionProbe(self.command)
        self.process: StdioChannel | None = None
        self._client: aiohttp.ClientSession | None = None
        #: The private (0700) directory of the supervised app-server's socket.
        self.socket_dir: str | None = None
        self._socket: str | None = None
        #: The socket codex really listens on (PATH is a symlink to it), removed at exit.
        self._socket_target: str | None = None
        self._lock = asyncio.Lock()
        self._connections: set[WebSocketChannel] = set()
        self.state = "idle" if self.url is None else "external"
        self.restarts = 0
        self.last_exit: dict[str, Any] | None = None
        self._started_at = 0.0
        self._backoff = BACKOFF_FIRST
        #: Not started again before this (loop time), after it died or failed to start.
        self._next_start = 0.0
        self._restart_task: asyncio.Task[None] | None = None
        self._closing = False
        #: The liveness probe of the supervised process (:meth:`_watch`), one per start.
        self._liveness_interval = limits.liveness_interval_ms / 1000
        self._liveness_timeout = limits.liveness_timeout_ms / 1000
        self._watchers: set[asyncio.Task[None]] = set()
        #: The process the probe found wedged and killed (said so in ``lastExit``).
        self._wedged_process: StdioChannel | None = None

    @property
    def supervised(self) -> bool:
        return self.url is None

    # -- connections -----------------------------------------------------------

    async def open(self, options: ClientOptions | None) -> JsonRpcPeer:
        """A conversation of its own; 403 ``options_not_allowed`` for the options that
        would need a process of its own."""
        refused = sorted(f for f in options.set_fields() if f in PROCESS_OPTIONS) if options else []
        if refused:
            raise errors.of_kind(
                "options_not_allowed",
                "In shared mode every session is a connection to one app-server, so options "
                "that shape a process of its own cannot apply: "
                + "; ".join(f"{field}: {PROCESS_OPTIONS[field]}" for field in refused),
                data={"fields": refused, "mode": "shared"},
            )
        return JsonRpcPeer(await self.connect(), message_filter=Tenant())

    async def connect(self) -> WebSocketChannel:
        """A new connection (starting the app-server first if it is not running); 502
        ``app_server_spawn_failed`` (or ``app_server_exited``) when there is none."""
        if self._closing:
            raise errors.of_kind("app_server_spawn_failed", "The bridge is shutting down.")
        ws = await self._handshake()
        connection = self._channel(ws)
        self._connections.add(connection)
        if self._closing:
            await connection.close(self._shutdown_grace)
            raise errors.of_kind("app_server_spawn_failed", "The bridge is shutting down.")
        return connection

    async def _handshake(self) -> aiohttp.ClientWebSocketResponse:
        """A WebSocket to the app-server; a supervised one found dead on the way (before the
        bridge saw it go) is waited for in its restart, as in the restart's backoff."""
        for attempt in range(1, _CONNECT_ATTEMPTS + 1):
            process = None
            if self.supervised:
                await self._ensure_running()
                process = self.process
            try:
                async with asyncio.timeout(self._spawn_timeout):
                    return await self._ws_connect()
            except TimeoutError:
                raise startup.spawn_timed_out(
                    "Connecting to the shared app-server",
                    round(self._spawn_timeout * 1000),
                    "no connection accepted",
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                if attempt < _CONNECT_ATTEMPTS and await self._died(process):
                    continue
                reason = connect_failure(exc)
                # The operator's log names where; the client's payload only why (no path,
                # no host: see docs/SECURITY.md, "Errors say little").
                log.error(
                    "could not connect to the app-server at %s: %s",
                    self.url or f"unix://{self._socket}",
                    reason,
                )
                raise errors.of_kind(
                    "app_server_spawn_failed",
                    f"Could not connect to the shared app-server: {reason}; check the "
                    "bridge's app-server settings.",
                ) from None
        raise AssertionError("unreachable")  # the last attempt returns or raises

    async def _ws_connect(self) -> aiohttp.ClientWebSocketResponse:
        url = self.url or f"unix://{self._socket}"
        if self._client is None or self._client.closed:
            connector: aiohttp.BaseConnector = (
                aiohttp.UnixConnector(path=url[len("unix://") :], limit=0)
                if url.startswith("unix://")
                else aiohttp.TCPConnector(limit=0)
            )
            self._client = aiohttp.ClientSession(connector=connector)
        headers: dict[str, str] = {}
        if url.startswith("ws://") and self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return await self._client.ws_connect(
            url if url.startswith("ws://") else "http://localhost/",
            headers=headers,
            max_msg_size=self._max_line_bytes,
            autoclose=False,
            autoping=True,
            timeout=aiohttp.ClientWSTimeout(ws_close=self._shutdown_grace),
        )

    def _channel(self, ws: aiohttp.ClientWebSocketResponse) -> WebSocketChannel:
        return WebSocketChannel(
            ws,
            max_frame_bytes=self._max_line_bytes,
            # A dropped connection may be the process's death: wait for it, so that a
            # crash ends the session as a crash (WebSocketChannel.server_exited).
            dropped=lambda: self._died(self.process),
            on_end=self._connections.discard,
        )

    async def _died(self, process: StdioChannel | None) -> bool:
        """Whether the supervised ``process`` has died, waiting a moment for it (a refused or
        dropped connection can come first), then until its sessions end, its restart scheduled."""
        if process is None:
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CLOSE_TO_EXIT_SECONDS):
                await process.dead.wait()
        if not process.dead.is_set():
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_EXIT_TO_FINISH_SECONDS):
                await process.wait()
        return True

    # -- the supervised process ------------------------------------------------

    async def _ensure_running(self) -> None:
        if self.process is not None and self.process.running and self.state == "running":
            return
        async with self._lock:
            if self.process is not None and self.process.running and self.state == "running":
                return
            if self._closing:
                raise errors.of_kind("app_server_spawn_failed", "The bridge is shutting down.")
            loop = asyncio.get_running_loop()
            wait = self._next_start - loop.time()
            if wait > self._spawn_timeout:
                raise errors.of_kind(
                    "app_server_spawn_failed",
                    f"The shared app-server is restarting after a failure; retry in {wait:.0f} s.",
                    headers={"Retry-After": str(max(1, round(wait)))},
                )
            if wait > 0:
                await asyncio.sleep(wait)
            await self._start()

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self.state = "starting"
        if self.socket_dir is None:
            # Removed at close; if the bridge is killed, by its watchdog.
            self.socket_dir = watchdog.make_folder("rest-bridge-app-server-")
        self._remove_socket()
        self._socket = os.path.join(self.socket_dir, _SOCKET_NAME)
        if self._client is not None:
            await self._client.close()
            self._client = None
        argv = [*self.command, "--listen", f"unix://{self._socket}"]
        # It speaks on its socket: its stdout is only a log.
        process = StdioChannel(
            max_line_bytes=self._max_line_bytes,
            stdout_is_log=True,
            on_end=lambda info: self._exited(process, info),
        )
        try:
            # Never the bridge's secrets (the app-server token, meant for an app-server
            # the bridge connects to, is one of them).
            await process.spawn(argv, env=credentials.child_environment())
        except OSError as exc:
            self._failed(loop)
            raise startup.spawn_failed(self.command, exc, None) from None
        self.process = process
        if self._closing:
            # close() ran while this was starting: it must not outlive the bridge.
            await process.close(self._shutdown_grace)
            raise errors.of_kind("app_server_spawn_failed", "The bridge is shutting down.")
        deadline = loop.time() + self._spawn_timeout
        delay = 0.005
        while True:
            if not process.running:
                self._failed(loop)
                assert process.exit_info is not None
                raise startup.exited_at_startup(self.command, process.exit_info)
            if await self._listening():
                break
            if loop.time() > deadline:
                await process.close(self._shutdown_grace)
                self._failed(loop)
                raise startup.spawn_timed_out(
                    "Starting the app-server",
                    round(self._spawn_timeout * 1000),
                    f"the shared app-server `{shlex.join(argv)}` did not listen",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        self._socket_target = _real_path(self._socket)
        self._started_at = loop.time()
        self.state = "running"
        watcher = loop.create_task(self._watch(process))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        log.info(
            "shared app-server started (pid %s, restart %d): %s",
            process.pid,
            self.restarts,
            shlex.join(self.command),
        )

    async def _listening(self) -> bool:
        assert self._socket is not None
        try:
            _, writer = await asyncio.open_unix_connection(self._socket)
        except OSError:
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    # -- liveness ----------------------------------------------------------------

    def _watching(self, process: StdioChannel) -> bool:
        return (
            process is self.process
            and self.state == "running"
            and not process.dead.is_set()
            and not self._closing
        )

    async def _watch(self, process: StdioChannel) -> None:
        """The liveness probe of ``process``: every LIVENESS_INTERVAL_MS one
        :data:`LIVENESS_METHOD` over a connection of the bridge's own. A stopped or
        deadlocked process still accepts connections into its backlog, and never
        answers: once none has come for LIVENESS_TIMEOUT_MS, it is wedged (:meth:`_wedged`).
        """
        loop = asyncio.get_running_loop()
        probe: JsonRpcPeer | None = None
        unanswered_since: float | None = None
        try:
            while True:
                await asyncio.sleep(self._liveness_interval)
                if not self._watching(process):
                    return
                asked_at = loop.time()
                try:
                    async with asyncio.timeout(self._liveness_timeout):
                        probe = await self._ask(probe)
                    unanswered_since = None
                    continue
                except (TimeoutError, ProcessGone, StdinFull, aiohttp.ClientError, OSError):
                    pass
                except Exception as exc:  # a probe must not end the watch: count it a miss
                    log.error("the liveness probe failed: %s", type(exc).__name__)
                if probe is not None:
                    stale, probe = probe, None
                    await stale.shutdown(0)
                if not self._watching(process):
                    return
                if unanswered_since is None:
                    unanswered_since = asked_at
                if loop.time() - unanswered_since >= self._liveness_timeout:
                    self._wedged(process)
                    return
        finally:
            if probe is not None:
                await probe.shutdown(0)

    async def _ask(self, probe: JsonRpcPeer | None) -> JsonRpcPeer | None:
        """One question over the probe connection, opened (and initialized) if there is
        none; returns it (None if it is no use), on any answer, an error too."""
        if probe is None or not probe.running:
            ws = await self._ws_connect()
            probe = JsonRpcPeer(self._channel(ws))
            try:
                params = {"clientInfo": PROBE_CLIENT_INFO}
                await probe.call("initialize", params, self._liveness_timeout)
                probe.notify("initialized")
            except RpcError:
                # An answer, on a connection that is no use: a new one next time.
                await probe.shutdown(0)
                return None
            except BaseException:
                await probe.shutdown(0)
                raise
        with contextlib.suppress(RpcError):
            await probe.call(LIVENESS_METHOD, _LIVENESS_PARAMS, self._liveness_timeout)
        return probe

    def _wedged(self, process: StdioChannel) -> None:
        """``process`` stopped answering: kill it (its exit restarts it, as any death
        does), and end its sessions now, saying why."""
        log.error(
            "shared app-server (pid %s) did not answer the liveness probe within %g s: "
            "wedged; killing it (SIGKILL) with its descendants and ending its %d connections",
            process.pid,
            self._liveness_timeout,
            len(self._connections),
        )
        self._wedged_process = process
        process.kill()
        info = ExitInfo(None, signal.SIGKILL.name, "")
        for connection in list(self._connections):
            connection.server_exited(info, SERVER_WEDGED)

    def _failed(self, loop: asyncio.AbstractEventLoop, state: str = "failed") -> None:
        """Not started again for the backoff, which doubles for the next failure."""
        self.state = state
        self._next_start = loop.time() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)

    def _exited(self, process: StdioChannel, info: ExitInfo) -> None:
        if process is not self.process:
            return
        loop = asyncio.get_running_loop()
        was_running = self.state == "running"
        self._remove_socket()
        for connection in list(self._connections):
            connection.server_exited(info)
        if self._closing:
            self.state = "stopped"
            return
        if not was_running:
            return  # failed while starting: _start reports it
        self.restarts += 1
        self.last_exit = {
            "exitCode": info.exit_code,
            "signal": info.signal,
            "at": rfc3339(time.time()),
            "wedged": process is self._wedged_process,
        }
        if loop.time() - self._started_at > BACKOFF_RESET_AFTER:
            self._backoff = BACKOFF_FIRST
        delay = self._backoff
        self._failed(loop, "restarting")
        log.error(
            "shared app-server (pid %s) %s; its sessions ended; restarting it in %g s for "
            "new sessions; stderr: %s",
            process.pid,
            info.describe().removeprefix("the app-server "),
            delay,
            logs.stderr_summary(info.stderr_tail),
        )
        self._restart_task = loop.create_task(self._restart_later())

    async def _restart_later(self) -> None:
        with contextlib.suppress(errors.RestError):
            await self._ensure_running()

    def _remove_socket(self) -> None:
        """What a dead app-server left: its socket (and codex's lock beside it)."""
        target = self._socket_target
        for path in (self._socket, target, target and target + ".lock"):
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._socket_target = None

    # -- state and shutdown ------------------------------------------------------

    def describe(self, user_agent: str | None) -> dict[str, Any]:
        """What ``/v1/compatibility`` says about the shared app-server."""
        retry_in: float | None = None
        if self.state in ("restarting", "failed"):
            retry_in = max(0.0, self._next_start - asyncio.get_running_loop().time())
        process = self.process
        return {
            "source": "supervised" if self.supervised else "url",
            "state": self.state,
            "pid": process.pid if process is not None and process.running else None,
            "connections": len(self._connections),
            "restarts": self.restarts,
            "lastExit": self.last_exit,
            "restartInMs": None if retry_in is None else int(retry_in * 1000),
            "userAgent": user_agent,
        }

    async def compatibility(self, user_agent: str | None) -> Compatibility:
        state = SharedAppServerState.model_validate(self.describe(user_agent))
        if not self.supervised:
            return startup.compatibility([], NOT_STARTED, user_agent, mode="shared", shared=state)
        version = await self.version.get()
        return startup.compatibility(self.command, version, user_agent, mode="shared", shared=state)

    async def close(self) -> None:
        self._closing = True
        for watcher in list(self._watchers):
            watcher.cancel()
        if self._watchers:
            await asyncio.wait(list(self._watchers))
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
        await asyncio.gather(
            *(c.close(self._shutdown_grace) for c in list(self._connections)),
            return_exceptions=True,
        )
        if self.process is not None:
            await self.process.close(self._shutdown_grace)
        self.state = "stopped" if self.supervised else self.state
        if self._client is not None:
            await self._client.close()
            self._client = None
        self._remove_socket()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None
