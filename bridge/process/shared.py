"""Shared mode: one app-server for every session, each session a connection to it.

``codex app-server --listen unix://PATH`` (or ``ws://IP:PORT``) serves many clients from
one process: each connection speaks WebSocket, one JSON-RPC message per text frame, and
does its own ``initialize``. Here:

- :class:`AppServerConnection` is one such conversation. It is an
  :class:`~bridge.process.rpc.AppServerProcess` whose transport is a WebSocket instead of
  a child's stdio: calls, replies, the id rules, the flow gate and the exit callbacks are
  the same code, so :class:`~bridge.process.session.Session` and the text turn run on it
  unchanged. Its "exit" is the end of the connection.
- :class:`SharedAppServer` starts and supervises the one process (on a unix socket in a
  private 0700 directory), restarts it with a backoff when it dies, and opens the
  connections; or, given a URL, only connects to an app-server that runs already.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import aiohttp

from bridge import __version__, credentials, errors
from bridge.events import rfc3339
from bridge.limits import (
    APP_SERVER_TOKEN_VARIABLE,
    MAX_STDIN_BUFFER,
    AppServerSettings,
    RestLimits,
)
from bridge.models import AppServerInfo, ClientOptions, Compatibility, SharedAppServerState
from bridge.process import startup, tenancy
from bridge.process.backend import DEFAULT_COMMAND, SECRET_ENV, ProcessBackend
from bridge.process.rpc import (
    AppServerProcess,
    ExitInfo,
    NotificationHandler,
    ProcessGone,
    RequestHandler,
    RpcError,
    StdinFull,
)
from bridge.wire import dumps

log = logging.getLogger("bridge")

#: After a connection the app-server closed, how long to wait for the shared process's
#: own exit, so that a session ended by a crash says so rather than "closed".
_CLOSE_TO_EXIT_SECONDS = 3.0
#: Once it has exited, how long its pipes may take to close (rpc.py waits 0.5 s).
_EXIT_TO_FINISH_SECONDS = 2.0
#: Restart backoff of the supervised app-server: first delay, cap, and how long it must
#: have run for the next failure to start over from the first delay.
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
BACKOFF_RESET_AFTER = 60.0
#: Connection attempts of one request when the supervised app-server dies under them
#: (each waits for its restart; one that keeps dying backs off past SPAWN_TIMEOUT_MS).
_CONNECT_ATTEMPTS = 3
#: How the ends of a connection are told in the ``exit`` event (``params.connection``).
#: Calls whose answer is a thread this connection then owns (tenancy.py).
THREAD_OPENERS = frozenset(tenancy.OPENERS)
#: Thread-opening calls remembered at most (those in flight are always kept).
_MAX_OPENING = 1024
#: Frames about threads a connection does not own, kept (the newest, up to this many
#: bytes, by a connection that owns a thread) in case one is about a sub-agent of its
#: own not yet named (see _notify). A sub-agent's first frames are a few hundred bytes.
_LIMBO_BYTES = 16 * 1024
CLOSED_BY_BRIDGE = "closed by the bridge"
CLOSED_BY_SERVER = "closed by the app-server"
SERVER_EXITED = "the shared app-server exited"
SERVER_WEDGED = "the shared app-server stopped answering and was killed"
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


#: Closes in flight, kept so that none is collected before it is done.
_closing_tasks: set[asyncio.Task[None]] = set()


async def _close_quietly(ws: aiohttp.ClientWebSocketResponse) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError, TimeoutError):
        await ws.close()


def _close_soon(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Close ``ws`` without waiting for it (from a callback)."""
    task = asyncio.get_running_loop().create_task(_close_quietly(ws))
    _closing_tasks.add(task)
    task.add_done_callback(_closing_tasks.discard)


class AppServerConnection(AppServerProcess):
    """One session's (or call's, or text turn's) connection to the shared app-server."""

    is_connection = True

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        *,
        max_line_bytes: int,
        server: SharedAppServer,
    ) -> None:
        super().__init__(max_line_bytes=max_line_bytes)
        self._ws = ws
        self._server = server
        #: Frames waiting for the writer (bounded like a child's stdin).
        self._frames: deque[bytes] = deque()
        self._frames_bytes = 0
        self._writer: asyncio.Task[None] | None = None
        #: The frame the flow gate held back, and what wakes the reader once it is taken.
        self._held_frame: bytes | None = None
        self._readable = asyncio.Event()
        self._readable.set()
        #: The threads this connection owns (tenancy.py), and the ids (and methods) of
        #: its calls that open one; see :meth:`_notify`.
        self._threads = tenancy.Threads()
        self._opening: dict[int, str] = {}
        #: How many notifications and server requests about other connections' threads
        #: were kept from this one.
        self.foreign_threads_hidden = 0
        #: The frame being dispatched, and the latest frames about threads not owned.
        self._frame = b""
        self._limbo: deque[tuple[str, bytes]] = deque()
        self._limbo_bytes = 0
        self._reader = self._loop.create_task(self._read())

    # -- other connections' threads (tenancy.py) -----------------------------------

    @property
    def on_notification(self) -> NotificationHandler:
        return self._notify

    @on_notification.setter
    def on_notification(self, handler: NotificationHandler) -> None:
        self._notification_handler = handler

    @property
    def on_request(self) -> RequestHandler:
        return self._request

    @on_request.setter
    def on_request(self, handler: RequestHandler) -> None:
        self._request_handler = handler

    def _notify(self, method: str, params: Any) -> None:
        """codex tells every connection of every thread (`thread/started`, status, name,
        archive, ...): pass on only what concerns this connection's own threads (codex
        answers a `thread/start` before it announces it).

        codex may tell of a sub-agent (its status) before the parent's `spawnAgent` item
        names it: the latest such frames are kept, and passed on once it is named."""
        threads = self._threads
        if method == "thread/started":
            if not threads.announced(params):
                self.foreign_threads_hidden += 1
                return
        elif (foreign := threads.foreign_thread(params)) is not None:
            self.foreign_threads_hidden += 1
            self._keep_in_limbo(foreign)
            return
        self._notification_handler(method, params)
        spawned = threads.spawned(method, params)
        if spawned and self._limbo:
            self._release_from_limbo(spawned)

    def _keep_in_limbo(self, thread_id: str) -> None:
        frame = self._frame
        if len(frame) > _LIMBO_BYTES or not self._threads:
            return  # too big for it, or no thread of its own to have a sub-agent
        self._limbo.append((thread_id, frame))
        self._limbo_bytes += len(frame)
        while self._limbo_bytes > _LIMBO_BYTES:
            self._limbo_bytes -= len(self._limbo.popleft()[1])

    def _release_from_limbo(self, thread_ids: list[str]) -> None:
        owned = set(thread_ids)
        kept = [entry for entry in self._limbo if entry[0] not in owned]
        released = [frame for thread_id, frame in self._limbo if thread_id in owned]
        self._limbo = deque(kept)
        self._limbo_bytes = sum(len(frame) for _, frame in kept)
        for frame in released:
            self.foreign_threads_hidden -= 1
            self._dispatch_line(frame)

    def _request(self, request_id: Any, method: str, params: Any) -> None:
        """A server request about another connection's thread is not this one's to
        answer: it is left to the owner (an answer from here would settle it)."""
        foreign = self._threads.foreign_thread(params)
        if foreign is not None:
            self.foreign_threads_hidden += 1
            self._keep_in_limbo(foreign)
            return
        self._request_handler(request_id, method, params)

    def _resolve(self, message: dict[str, Any]) -> None:
        method = self._opening.pop(message["id"], None)
        if method is not None and "result" in message:
            self._threads.opened(method, message["result"])
        super()._resolve(message)

    async def call(self, method: str, params: Any, timeout: float) -> Any:
        """A call on a thread this connection does not own is answered by codex as for
        a thread that does not exist; a listing shows this connection's threads only."""
        if method in tenancy.LISTINGS:
            return await self._list_owned(method, params, timeout)
        disguised, substitutes = self._threads.disguise(method, params)
        if not substitutes:
            return await super().call(method, params, timeout)
        try:
            result = await super().call(method, disguised, timeout)
        except RpcError as exc:
            undo = tenancy.Threads.undisguise
            raise RpcError(
                exc.code, undo(exc.message, substitutes), undo(exc.data, substitutes)
            ) from None
        return tenancy.Threads.undisguise(result, substitutes)

    async def _list_owned(self, method: str, params: Any, timeout: float) -> Any:
        """Read codex's pages until one page of owned threads is full (or codex has no
        more, or :data:`tenancy.MAX_LIST_ROUNDS` pages were read); cursors are tokens."""
        threads = self._threads
        deadline = self._loop.time() + timeout
        asked = dict(params) if isinstance(params, dict) else {}
        #: A token of this connection's, and codex's cursor behind it, to put back.
        back: dict[str, str] = {}
        if "cursor" in asked:
            token = asked["cursor"]
            asked["cursor"] = threads.cursor_for(method, token)
            if isinstance(token, str) and asked["cursor"] != token:
                back[asked["cursor"]] = token
        limit = asked.get("limit")
        #: How many owned threads make a page (codex's own page size if none is asked).
        wanted = limit if isinstance(limit, int) and not isinstance(limit, bool) else -1
        first: dict[str, Any] | None = None
        kept: list[Any] = []
        cursor: Any = None
        for _ in range(tenancy.MAX_LIST_ROUNDS):
            try:
                result = await super().call(
                    method, asked if asked or params is not None else None, timeout
                )
            except RpcError as exc:
                if first is None:
                    # codex may quote its cursor, which names a thread: quote the token.
                    undo = tenancy.Threads.undisguise
                    message, data = undo(exc.message, back), undo(exc.data, back)
                    raise RpcError(exc.code, message, data) from None
                break  # what was read so far is a page, and its cursor goes on from there
            except TimeoutError:
                if first is None:
                    raise
                break
            if not isinstance(result, dict):
                result = {}
            page = result.get("data")
            kept += threads.owned_items(method, page)
            if first is None:
                first = result
                if wanted < 0:
                    wanted = len(page) if isinstance(page, list) else 0
            cursor = result.get("nextCursor")
            timeout = deadline - self._loop.time()
            if not isinstance(cursor, str) or len(kept) >= wanted or timeout <= 0:
                break
            asked["cursor"] = cursor
            asked["limit"] = wanted - len(kept)
        assert first is not None
        return threads.only_owned(method, first, kept, cursor)

    # -- outgoing --------------------------------------------------------------

    def _write(self, message: dict[str, Any]) -> None:
        if self._exit_info is not None or self._stopping or self._ws.closed:
            raise ProcessGone(self._gone_info())
        if self._frames_bytes > MAX_STDIN_BUFFER:
            raise StdinFull("the app-server is not reading its input")
        # JSON text as UTF-8 bytes, sent as a text frame as is (send_str would encode a
        # str again); the bound below counts bytes, as the wire does.
        frame = dumps(message)
        method = message.get("method")
        if method in THREAD_OPENERS and "id" in message:
            if len(self._opening) >= _MAX_OPENING:
                # Calls that were never answered (timed out): forget them.
                pending = self._pending
                self._opening = {i: m for i, m in self._opening.items() if i in pending}
            self._opening[message["id"]] = method
        self._frames.append(frame)
        self._frames_bytes += len(frame)
        if self._writer is None:
            self._writer = self._loop.create_task(self._send_frames())

    async def _send_frames(self) -> None:
        """Send the queued frames in order; exits when the queue is empty (no idle task)."""
        try:
            while self._frames:
                frame = self._frames.popleft()
                self._frames_bytes -= len(frame)
                await self._ws.send_frame(frame, aiohttp.WSMsgType.TEXT)
        except (ConnectionError, RuntimeError, aiohttp.ClientError):
            self._frames.clear()
            self._frames_bytes = 0
        finally:
            self._writer = None

    # -- incoming --------------------------------------------------------------

    async def _read(self) -> None:
        ended_by_server = False
        #: The app-server said goodbye (a close frame): it is alive, not crashed.
        farewell = False
        try:
            while True:
                if not self._readable.is_set():
                    await self._readable.wait()
                message = await self._ws.receive()
                if message.type is aiohttp.WSMsgType.TEXT:
                    data: bytes = message.data.encode()
                elif message.type is aiohttp.WSMsgType.BINARY:
                    data = message.data
                elif message.type is aiohttp.WSMsgType.ERROR and isinstance(
                    message.data, aiohttp.WebSocketError
                ):
                    # A frame over max_msg_size (MAX_LINE_BYTES), or one that is not
                    # WebSocket: the conversation cannot go on.
                    problem = message.data.code
                    self._break_protocol(f"the app-server sent an unreadable frame ({problem})")
                    break
                else:
                    ended_by_server = not self._stopping
                    farewell = message.type is aiohttp.WSMsgType.CLOSE
                    break
                if not self._take(data):
                    break
        except (ConnectionError, aiohttp.ClientError):
            ended_by_server = not self._stopping
        except asyncio.CancelledError:
            pass
        if self._exit_info is not None:
            return
        if self._protocol_error is not None:
            self._end(ExitInfo(None, None, "", self._protocol_error, CLOSED_BY_BRIDGE))
            return
        if ended_by_server and not farewell:
            # Dropped without a close frame: perhaps the whole process died.
            await self._server.closed_by_server(self)
        if self._exit_info is None:
            if not ended_by_server:
                self._end(ExitInfo(0, None, "", None, CLOSED_BY_BRIDGE))
                return
            # A normal closure is what a clean exit of a process of its own would be.
            clean = self._ws.close_code == aiohttp.WSCloseCode.OK
            self._end(ExitInfo(0 if clean else None, None, "", None, CLOSED_BY_SERVER))

    def _take(self, data: bytes) -> bool:
        """One frame from the app-server: dispatch it, or hold it back; False to stop."""
        if len(data) > self._max_line_bytes:
            self._break_protocol(f"a message of {len(data)} bytes exceeds MAX_LINE_BYTES")
            return False
        self.received_at = time.time()
        gate = self.flow_gate
        if gate is not None and gate(len(data)):
            self._held_frame = data
            self._paused = True
            self._readable.clear()
            return True
        self._frame = data
        self._dispatch_line(data)
        return self._protocol_error is None

    def resume(self) -> None:
        if not self._paused:
            return
        self._paused = False
        held, self._held_frame = self._held_frame, None
        if held is not None and not self._take(held):
            self._readable.set()
            return
        if not self._paused:
            self._readable.set()

    def _gone_info(self) -> ExitInfo:
        how = CLOSED_BY_BRIDGE if self._stopping else CLOSED_BY_SERVER
        return self._exit_info or ExitInfo(None, None, "", self._protocol_error, how)

    def _break_protocol(self, reason: str) -> None:
        if self._protocol_error is None:
            self._protocol_error = reason
            log.warning("closing a connection to the shared app-server: %s", reason)
            self._readable.set()
            _close_soon(self._ws)

    # -- lifecycle -------------------------------------------------------------

    def _end(self, info: ExitInfo) -> None:
        """The conversation is over: fail what waits, tell the owners, let go of them."""
        if self._exit_info is not None:
            return
        self._exit_info = info
        self._exited = True
        self._conclude(info)
        self._frames.clear()
        self._frames_bytes = 0
        self._held_frame = None
        self._frame = b""
        self._limbo.clear()
        self._limbo_bytes = 0
        self._readable.set()
        if not self._ws.closed:
            _close_soon(self._ws)

    def server_exited(self, info: ExitInfo, how: str = SERVER_EXITED) -> None:
        """The shared process died: the session ends with its exit code and signal."""
        self._end(ExitInfo(info.exit_code, info.signal, "", None, how))

    async def shutdown(self, grace: float) -> ExitInfo:
        """Close the connection (the app-server keeps running for the others)."""
        if self._exit_info is not None:
            return self._exit_info
        self._stopping = True
        self.release_flow()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                if self._writer is not None:
                    await asyncio.shield(self._writer)
                await _close_quietly(self._ws)
        if self._exit_info is None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._end(ExitInfo(0, None, "", None, CLOSED_BY_BRIDGE))
        return await self.wait()


class _ListeningProcess(AppServerProcess):
    """The supervised app-server: it speaks on its socket, so stdout is only a log."""

    def __init__(self, *, max_line_bytes: int) -> None:
        super().__init__(max_line_bytes=max_line_bytes)
        #: Set as soon as the process has exited (its exit info follows once the
        #: pipes are closed).
        self.dead = asyncio.Event()

    def _process_exited(self) -> None:
        self.dead.set()
        super()._process_exited()

    def kill(self) -> None:
        """SIGKILL to the process group now (a stopped process ignores SIGTERM until it is
        continued); what left the group is swept once it has exited (rpc.py)."""
        self.lineage.remember_tree()
        self._kill_group(signal.SIGKILL)

    def _feed_stdout(self, data: bytes) -> None:
        self._feed_stderr(data)

    def _stdout_eof(self) -> None:
        pass

    def _pipe_gone(self, name: str) -> None:
        pass


def _real_path(path: str) -> str | None:
    """Where a symlink leads (codex's ``unix://PATH`` is a link to its own socket)."""
    try:
        return os.path.realpath(path, strict=True)
    except OSError:
        return None


def connect_failure(exc: BaseException) -> str:
    """Why a connection to the app-server failed, in words: the system's reason ("No such
    file or directory", "Connection refused") or the handshake's status; never a class
    name, an address or a header."""
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


def _env_without(secrets: Sequence[str]) -> dict[str, str]:
    # Never the bridge's secrets (bridge.credentials), whatever ``secrets`` says.
    return {k: v for k, v in credentials.child_environment().items() if k not in secrets}


class SharedAppServer:
    """The one app-server of shared mode: started, supervised and connected to here."""

    def __init__(
        self,
        command: Sequence[str],
        settings: AppServerSettings,
        *,
        max_line_bytes: int,
        spawn_timeout: float,
        shutdown_grace: float,
        secret_env: Sequence[str] = (),
        liveness_interval: float = 10.0,
        liveness_timeout: float = 20.0,
    ) -> None:
        self.command = list(command)
        self.url = settings.url
        self._token = settings.token
        self._max_line_bytes = max_line_bytes
        self._spawn_timeout = spawn_timeout
        self._shutdown_grace = shutdown_grace
        self._secret_env = tuple(secret_env)
        self.process: AppServerProcess | None = None
        self._client: aiohttp.ClientSession | None = None
        self._dir: str | None = None
        self._socket: str | None = None
        #: The socket codex really listens on (PATH is a symlink to it), removed at exit.
        self._socket_target: str | None = None
        self._lock = asyncio.Lock()
        self._connections: set[AppServerConnection] = set()
        self.state = "idle" if self.url is None else "external"
        self.restarts = 0
        self.last_exit: dict[str, Any] | None = None
        self._started_at = 0.0
        self._backoff = BACKOFF_FIRST
        #: Not started again before this (loop time), after it died or failed to start.
        self._next_start = 0.0
        self._restart_task: asyncio.Task[None] | None = None
        self.last_user_agent: str | None = None
        self._closing = False
        #: The liveness probe of the supervised process (:meth:`_watch`), one per start.
        self._liveness_interval = liveness_interval
        self._liveness_timeout = liveness_timeout
        self._watchers: set[asyncio.Task[None]] = set()
        #: The process the probe found wedged and killed (said so in ``lastExit``).
        self._wedged_process: AppServerProcess | None = None

    @property
    def supervised(self) -> bool:
        return self.url is None

    @property
    def socket_dir(self) -> str | None:
        """The private (0700) directory of the supervised app-server's socket."""
        return self._dir

    # -- connections -----------------------------------------------------------

    async def connect(self) -> AppServerConnection:
        """A new connection (starting the app-server first if it is not running).

        Raises the bridge's 502 ``app_server_spawn_failed`` (or ``app_server_exited``)
        when there is no app-server to connect to.
        """
        if self._closing:
            raise errors.app_server_spawn_failed("The bridge is shutting down.")
        ws = await self._handshake()
        connection = AppServerConnection(ws, max_line_bytes=self._max_line_bytes, server=self)
        self._connections.add(connection)
        connection.exit_callbacks.append(lambda _: self._connections.discard(connection))
        if self._closing:
            await connection.shutdown(self._shutdown_grace)
            raise errors.app_server_spawn_failed("The bridge is shutting down.")
        return connection

    async def _handshake(self) -> aiohttp.ClientWebSocketResponse:
        """A WebSocket to the app-server; a supervised one found dead on the way (killed,
        crashed, before the bridge saw it go) is waited for in its restart, as a request
        arriving in the restart's backoff waits for it."""
        for attempt in range(1, _CONNECT_ATTEMPTS + 1):
            process = None
            if self.supervised:
                await self._ensure_running()
                process = self.process
            try:
                async with asyncio.timeout(self._spawn_timeout):
                    return await self._ws_connect()
            except TimeoutError:
                log.error("the shared app-server did not accept a connection in time")
                raise errors.timeout(
                    "Connecting to the shared app-server did not complete before its deadline."
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
                raise errors.app_server_spawn_failed(
                    f"Could not connect to the shared app-server: {reason}; check the "
                    "bridge's app-server settings."
                ) from None
        raise AssertionError("unreachable")  # the last attempt returns or raises

    async def _ws_connect(self) -> aiohttp.ClientWebSocketResponse:
        client, url, headers = self._target()
        return await client.ws_connect(
            url,
            headers=headers,
            max_msg_size=self._max_line_bytes,
            autoclose=False,
            autoping=True,
            timeout=aiohttp.ClientWSTimeout(ws_close=self._shutdown_grace),
        )

    async def _died(self, process: AppServerProcess | None) -> bool:
        """Whether the supervised ``process`` has died: waited for a moment (a refused
        connection can come before the bridge learns of the exit), and then until the
        bridge has taken note of it (its restart is scheduled)."""
        if not isinstance(process, _ListeningProcess):
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

    def _target(self) -> tuple[aiohttp.ClientSession, str, dict[str, str]]:
        if self._client is None or self._client.closed:
            if self.url is not None and self.url.startswith("unix://"):
                connector: aiohttp.BaseConnector = aiohttp.UnixConnector(
                    path=self.url[len("unix://") :], limit=0
                )
            elif self.url is not None:
                connector = aiohttp.TCPConnector(limit=0)
            else:
                assert self._socket is not None
                connector = aiohttp.UnixConnector(path=self._socket, limit=0)
            self._client = aiohttp.ClientSession(connector=connector)
        headers: dict[str, str] = {}
        if self.url is not None and self.url.startswith("ws://"):
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            return self._client, self.url, headers
        return self._client, "http://localhost/", headers

    async def closed_by_server(self, connection: AppServerConnection) -> None:
        """A connection the app-server closed: wait a moment for the process's exit, so
        that a crash ends the session as a crash (:meth:`AppServerConnection.server_exited`)."""
        process = self.process
        if not isinstance(process, _ListeningProcess) or not process.running:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CLOSE_TO_EXIT_SECONDS):
                await process.dead.wait()
        if process.dead.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_EXIT_TO_FINISH_SECONDS):
                    await process.wait()

    def note_initialize(self, result: Any) -> None:
        if isinstance(result, dict) and isinstance(result.get("userAgent"), str):
            self.last_user_agent = str(result["userAgent"])[:200]

    # -- the supervised process ------------------------------------------------

    async def _ensure_running(self) -> None:
        if self.process is not None and self.process.running and self.state == "running":
            return
        async with self._lock:
            if self.process is not None and self.process.running and self.state == "running":
                return
            if self._closing:
                raise errors.app_server_spawn_failed("The bridge is shutting down.")
            loop = asyncio.get_running_loop()
            wait = self._next_start - loop.time()
            if wait > self._spawn_timeout:
                raise errors.RestError(
                    502,
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
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="rest-bridge-app-server-")
        self._remove_socket()
        self._socket = os.path.join(self._dir, _SOCKET_NAME)
        if self._client is not None:
            await self._client.close()
            self._client = None
        argv = [*self.command, "--listen", f"unix://{self._socket}"]
        try:
            process = await _ListeningProcess.spawn(
                argv, max_line_bytes=self._max_line_bytes, env=_env_without(self._secret_env)
            )
        except OSError as exc:
            self._failed(loop)
            raise startup.spawn_failed(self.command, exc, None) from None
        self.process = process
        process.exit_callbacks.append(lambda info: self._exited(process, info))
        if self._closing:
            # close() ran while this was starting: it must not outlive the bridge.
            await process.shutdown(self._shutdown_grace)
            raise errors.app_server_spawn_failed("The bridge is shutting down.")
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
                await process.shutdown(self._shutdown_grace)
                self._failed(loop)
                log.error("the shared app-server `%s` did not listen in time", shlex.join(argv))
                raise errors.timeout(
                    "Starting the app-server did not complete before its deadline."
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        self._socket_target = _real_path(self._socket)
        self._started_at = loop.time()
        self.state = "running"
        assert isinstance(process, _ListeningProcess)
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

    def _watching(self, process: _ListeningProcess) -> bool:
        return (
            process is self.process
            and self.state == "running"
            and not process.dead.is_set()
            and not self._closing
        )

    async def _watch(self, process: _ListeningProcess) -> None:
        """The liveness probe of ``process``: every LIVENESS_INTERVAL_MS one
        :data:`LIVENESS_METHOD` over a connection of the bridge's own (not a session's).

        A stopped or deadlocked process still has its socket: connections are accepted
        into its backlog and calls are written, and nothing ever comes back. Once no
        answer has come for LIVENESS_TIMEOUT_MS (one probe that times out, or probes that
        fail at once for that long), it is wedged (:meth:`_wedged`).
        """
        loop = asyncio.get_running_loop()
        probe: AppServerConnection | None = None
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

    async def _ask(self, probe: AppServerConnection | None) -> AppServerConnection | None:
        """One question over the probe connection, opened (and initialized) first if there
        is none; returns it (None if it cannot be asked again). Any answer, an error too,
        returns; raises what a call or a connection raises."""
        if probe is None or not probe.running:
            ws = await self._ws_connect()
            probe = AppServerConnection(ws, max_line_bytes=self._max_line_bytes, server=self)
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

    def _wedged(self, process: _ListeningProcess) -> None:
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

    def _failed(self, loop: asyncio.AbstractEventLoop) -> None:
        self.state = "failed"
        self._next_start = loop.time() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)

    def _exited(self, process: AppServerProcess, info: ExitInfo) -> None:
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
        self._next_start = loop.time() + delay
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        self.state = "restarting"
        log.error(
            "shared app-server (pid %s) %s; its sessions ended; restarting it in %g s for "
            "new sessions; stderr: %s",
            process.pid,
            info.describe().removeprefix("the app-server "),
            delay,
            startup.stderr_summary(info.stderr_tail),
        )
        self._restart_task = loop.create_task(self._restart_later())

    async def _restart_later(self) -> None:
        with contextlib.suppress(errors.RestError):
            await self._ensure_running()

    def _remove_socket(self) -> None:
        """What a dead app-server left: its socket (and codex's lock beside it)."""
        for path in (self._socket, self._socket_target):
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if self._socket_target:
            with contextlib.suppress(OSError):
                os.unlink(self._socket_target + ".lock")
        self._socket_target = None

    # -- state and shutdown ------------------------------------------------------

    def describe(self) -> dict[str, Any]:
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
            "userAgent": self.last_user_agent,
        }

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
            *(c.shutdown(self._shutdown_grace) for c in list(self._connections)),
            return_exceptions=True,
        )
        if self.process is not None:
            await self.process.shutdown(self._shutdown_grace)
        self.state = "stopped" if self.supervised else self.state
        if self._client is not None:
            await self._client.close()
            self._client = None
        self._remove_socket()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


#: ClientOptions that shape a process of one's own, refused in shared mode (403), with why.
PROCESS_OPTIONS = {
    "env": "the shared app-server's environment is the bridge's, set when it starts",
    "cwd": "the process's working directory is shared; give `cwd` per thread in thread/start",
    "configOverrides": "`-c` arguments belong to the shared app-server's command line",
}


def refuse_process_options(options: ClientOptions | None) -> None:
    """403 ``options_not_allowed`` for the fields that would need a process of their own."""
    if options is None:
        return
    refused = sorted(f for f in options.set_fields() if f in PROCESS_OPTIONS)
    if refused:
        raise errors.RestError(
            403,
            "options_not_allowed",
            "In shared mode every session is a connection to one app-server, so options "
            "that shape a process of its own cannot apply: "
            + "; ".join(f"{field}: {PROCESS_OPTIONS[field]}" for field in refused),
            data={"fields": refused, "mode": "shared"},
        )


class SharedBackend(ProcessBackend):
    """Every session, sessionless call and text turn is a connection to one app-server.

    Everything else (slots, the idle reaper, drain, sessions, streams, replies, text turns)
    is :class:`ProcessBackend`'s, on :class:`AppServerConnection` instead of a process.
    """

    STARTING = "Opening a connection to the shared app-server"

    def __init__(
        self,
        command: str | Sequence[str] = DEFAULT_COMMAND,
        limits: RestLimits | None = None,
        settings: AppServerSettings | None = None,
    ) -> None:
        super().__init__(command, limits)
        settings = settings or AppServerSettings(mode="shared")
        self.server = SharedAppServer(
            self.command,
            settings,
            max_line_bytes=self.limits.max_line_bytes,
            spawn_timeout=self.limits.spawn_timeout_ms / 1000,
            shutdown_grace=self.limits.shutdown_grace_ms / 1000,
            secret_env=(*SECRET_ENV, APP_SERVER_TOKEN_VARIABLE),
            liveness_interval=self.limits.liveness_interval_ms / 1000,
            liveness_timeout=self.limits.liveness_timeout_ms / 1000,
        )

    async def _spawn(self, options: ClientOptions | None) -> AppServerProcess:
        refuse_process_options(options)
        if self._closing:
            raise errors.app_server_spawn_failed("The bridge is shutting down.")
        connection = await self.server.connect()
        self._processes.add(connection)
        connection.exit_callbacks.append(lambda _: self._processes.discard(connection))
        return connection

    async def _initialize(self, process: AppServerProcess, options: ClientOptions | None) -> Any:
        result = await super()._initialize(process, options)
        self.server.note_initialize(result)
        return result

    async def close(self) -> None:
        await super().close()
        await self.server.close()

    async def compatibility(self) -> Compatibility:
        if self.server.supervised:
            compatibility = await super().compatibility()
            info = compatibility.app_server
        else:
            compatibility = Compatibility(
                bridge_version=__version__,
                app_server=AppServerInfo(
                    command=[],
                    version=None,
                    version_error="the bridge connects to an app-server it did not start; "
                    "appServer.shared.userAgent names the one that answered",
                ),
            )
            info = compatibility.app_server
        info.mode = "shared"
        info.shared = SharedAppServerState.model_validate(self.server.describe())
        return compatibility
