"""`--listen unix://[PATH]` and `--listen ws://IP:PORT`: one process, many connections.

As the real `codex app-server` 0.169.0 does (observed; see the README, "Listening"):

- The transport is WebSocket (an HTTP/1.1 upgrade on any path), one JSON-RPC message
  per text frame. A frame that is not one message (two lines, not JSON, ...) is logged
  on stderr and ignored; a binary frame is ignored.
- Each connection has its own `initialize`/`initialized` and its own play of the
  script, as a separate stdio process would. Under a seed, connection 0 gets the ids a
  stdio process would get, connection k ids from a seed derived from k (so thread ids
  stay unique in the process).
- The threads are the process's, not a connection's: any connection can read, list,
  resume, name, archive or start a turn on any thread. A thread's news goes to the
  connections subscribed to it (the one that started, forked or resumed it), and
  `thread/started`, `thread/status/changed`, `thread/name/updated`, `thread/archived`,
  `thread/unarchived`, `thread/deleted` and `thread/closed` go to every initialized
  connection, whoever's thread they are about. Server requests stay with the connection
  whose turn raised them.
- `unix://PATH`: PATH becomes a symlink to a socket (mode 0600) in a private directory
  (mode 0700) under the temporary directory, named after PATH's hash; `unix://` alone
  means `$CODEX_HOME/app-server-control/app-server-control.sock`. Both go when the
  server exits on SIGTERM/SIGINT. A plain HTTP request on the socket is closed unanswered.
- `ws://IP:PORT`: a banner on stderr names the address (PORT 0 picks a free port and
  the banner gives it); GET `/readyz` and `/healthz` answer 200; another method 405,
  a GET without upgrade 400, a request with an `Origin` header 403; with
  `--ws-auth capability-token` an upgrade without the right `Authorization: Bearer`
  token is refused with 401.
- stdin is not read; SIGTERM or SIGINT stop the server with status 0.

Script steps that end a process end their connection only: `exit: N` closes it with a
WebSocket close frame (1000 for 0, else 1011 and reason `exit N`); `exit: {signal: S}`
drops it without one, as a crash would. `exit: {server: true, ...}` ends the whole
process: with a code, after closing every connection (and removing the socket); with a
signal, by dying from it at once (the socket file stays behind, as after a crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import os
import signal
import socket
import tempfile
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

from fakes.app_server.ids import IdFactory
from fakes.app_server.replies import Call, Reply
from fakes.app_server.server import AppServer
from fakes.app_server.wire import Message, encode, log, use_virtual_clock

if TYPE_CHECKING:
    from fakes.app_server.script import AppServerScript

#: What the real server announces in its upgrade reply over a unix socket (and allows).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_MAX_HEADER = "x-codex-websocket-max-unfragmented-message-bytes"
_HIGH_WATER = 1 << 20  # bytes queued for a connection before `drain()` waits
_SEED_STRIDE = 1_000_003  # connection k plays under seed + k * stride
#: What the real server sends every initialized connection, whoever's thread it names.
BROADCAST = frozenset(
    {
        "thread/started",
        "thread/status/changed",
        "thread/name/updated",
        "thread/archived",
        "thread/unarchived",
        "thread/deleted",
        "thread/closed",
    }
)
#: Calls whose answer subscribes the caller to the thread it names.
_SUBSCRIBING = frozenset({"thread/start", "thread/fork", "thread/resume"})


class ListenError(Exception):
    """A `--listen` or `--ws-*` value the fake cannot serve; exit status 2."""


@dataclass(frozen=True)
class Endpoint:
    """Where to listen: a unix socket (`path`) or a TCP address (`host`, `port`)."""

    kind: str  # "unix" | "ws"
    path: str | None = None
    host: str = ""
    port: int = 0

    @property
    def url(self) -> str:
        if self.kind == "unix":
            return f"unix://{self.path or ''}"
        return f"ws://{self.host}:{self.port}"


def parse_listen(url: str) -> Endpoint | None:
    """The endpoint of a `--listen` URL; None for `stdio://`."""
    if url == "stdio://":
        return None
    if url.startswith("unix://"):
        return Endpoint("unix", path=url.removeprefix("unix://") or None)
    if url.startswith("ws://"):
        host, sep, port = url.removeprefix("ws://").rstrip("/").rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ListenError(
                f"error: invalid value '{url}' for '--listen <URL>': expected ws://IP:PORT"
            )
        return Endpoint("ws", host=host, port=int(port))
    raise ListenError(
        f"error: invalid value '{url}' for '--listen <URL>': "
        "fake-codex supports `stdio://`, `unix://`, `unix://PATH` and `ws://IP:PORT`"
    )


def token_digest(
    auth: str | None, token_file: str | None, token_sha256: str | None
) -> bytes | None:
    """The SHA-256 of the capability token a WebSocket client must present, or None."""
    if auth is None:
        if token_file or token_sha256:
            raise ListenError("error: --ws-token-file and --ws-token-sha256 need --ws-auth")
        return None
    if auth != "capability-token":
        raise ListenError(
            f"error: fake-codex supports only `--ws-auth capability-token`, not {auth!r}"
        )
    if token_sha256:
        try:
            digest = bytes.fromhex(token_sha256)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ListenError("error: --ws-token-sha256 must be 64 hex digits")
        return digest
    if not token_file or not os.path.isabs(token_file):
        raise ListenError("error: --ws-auth capability-token needs an absolute --ws-token-file")
    try:
        with open(token_file, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise ListenError(f"error: cannot read --ws-token-file {token_file}: {exc}") from None
    if not token:
        raise ListenError(f"error: --ws-token-file {token_file} is empty")
    return hashlib.sha256(token.encode()).digest()


def default_socket_path() -> str:
    """Where `unix://` alone listens, as the real server: under `$CODEX_HOME`."""
    home = os.environ.get("CODEX_HOME") or os.path.join(os.path.expanduser("~"), ".codex")
    return os.path.join(home, "app-server-control", "app-server-control.sock")


def _private_socket(path: str) -> str:
    """The socket PATH links to: in a 0700 directory of ours, named after PATH's hash
    (so that a long PATH never meets the 108-byte limit of socket addresses)."""
    directory = os.path.join(tempfile.gettempdir(), f"fake-codex-daemon-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    info = os.lstat(directory)
    if (
        not os.path.isdir(directory)
        or os.path.islink(directory)
        or info.st_uid != os.getuid()
        or info.st_mode & 0o077
    ):
        raise ListenError(f"error: {directory} is not a private directory of this user")
    name = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()
    return os.path.join(directory, name)


def _claim(link: str) -> str:
    """Make room for a socket linked from `link`; returns the socket's own path."""
    os.makedirs(os.path.dirname(os.path.abspath(link)), exist_ok=True)
    if os.path.lexists(link):
        if _in_use(link):
            raise ListenError(f"error: another app-server is already listening on {link}")
        if not (os.path.islink(link) or _is_socket(link)):
            raise ListenError(f"error: {link} exists and is not a socket")
        os.unlink(link)
    target = _private_socket(link)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(target)
    return target


def _publish(target: str, link: str) -> None:
    """Point `link` at the listening socket `target`, in one step: the link's existence
    means "ready"."""
    staging = f"{link}.{os.getpid()}.tmp"
    os.symlink(target, staging)
    os.replace(staging, link)


def _in_use(path: str) -> bool:
    """Whether a server answers on the unix socket at `path` (through a symlink too)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


class FrameOutput:
    """A connection's `Sink`: every protocol line becomes one text frame.

    `write` is synchronous, as on stdout: lines are queued and a writer task sends them.
    A line written in pieces (a `raw` step without its newline) goes out once complete,
    or at close. `drain` waits while more than a megabyte is queued, so a client that
    stops reading stalls its connection instead of growing the fake's memory.
    """

    def __init__(self, ws: web.WebSocketResponse, on_lost: Any) -> None:
        self._ws = ws
        self._on_lost = on_lost
        self._frames: deque[bytes] = deque()
        self._partial = bytearray()
        self._queued = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._flushed = asyncio.Event()
        self._flushed.set()
        self._closing = False
        self._writer = asyncio.get_running_loop().create_task(self._write_frames())

    def send(self, message: Message) -> None:
        self.write(encode(message))

    def write(self, data: bytes) -> None:
        if self._closing:
            return
        *lines, rest = data.split(b"\n")
        if lines:
            lines[0] = bytes(self._partial) + lines[0]
            self._partial.clear()
            for line in lines:
                self._push(line)
        self._partial += rest

    def _push(self, frame: bytes) -> None:
        self._frames.append(frame)
        self._queued += len(frame)
        self._flushed.clear()
        self._wake.set()
        if self._queued > _HIGH_WATER:
            self._room.clear()

    async def drain(self) -> None:
        await self._room.wait()

    async def _write_frames(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._frames:
                    frame = self._frames.popleft()
                    self._queued -= len(frame)
                    await self._ws.send_frame(frame, WSMsgType.TEXT)
                    if self._queued <= _HIGH_WATER // 2:
                        self._room.set()
                self._flushed.set()
        except (ConnectionError, RuntimeError):
            # The client went away (aiohttp raises one or the other): end the session.
            self._room.set()
            self._flushed.set()
            self._on_lost()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Send what is queued (a pending partial line as a frame of its own), then a
        close frame."""
        if self._partial:
            self._push(bytes(self._partial))
            self._partial.clear()
        self._closing = True
        await self._flushed.wait()
        await self.stop()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._ws.close(code=code, message=reason.encode())

    async def abort(self, transport: asyncio.BaseTransport | None) -> None:
        """Send what is queued, then drop the connection without a close frame, as a
        crashed process would."""
        if self._partial:
            self._push(bytes(self._partial))
            self._partial.clear()
        self._closing = True
        await self._flushed.wait()
        await self.stop()
        if isinstance(transport, asyncio.Transport):
            transport.abort()

    async def stop(self) -> None:
        """End the writer task and wait until it has ended (what is queued is dropped).

        Every path out of a connection comes here, so no writer is left pending for the
        garbage collector to find ("Task was destroyed but it is pending!")."""
        self._closing = True
        if not self._writer.done():
            self._writer.cancel()
            # asyncio.wait, not `await task`: the writer's CancelledError stays its own,
            # and a cancellation of this task still propagates.
            await asyncio.wait([self._writer])


class Connection(AppServer):
    """One WebSocket connection: a whole fake app-server session of its own."""

    def __init__(self, listener: Listener, number: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.listener = listener
        self.number = number
        self.aborted = False
        #: The process's threads, one store for every connection.
        self.threads = listener.threads
        #: Where other connections' news for this one goes (set once it is served).
        self.output: FrameOutput | None = None

    def answer(self, call: Call, reply: Reply) -> None:
        if call.method in _SUBSCRIBING and reply.error is None:
            thread = reply.result.get("thread") if isinstance(reply.result, dict) else None
            if isinstance(thread, dict) and isinstance(thread.get("id"), str):
                self.listener.subscribe(thread["id"], self)
        super().answer(call, reply)

    async def die(self, signame: str) -> None:
        # A crash of this connection's "process": the client sees the socket drop.
        self.aborted = True
        self.exit(128 + signal.Signals[signame])

    async def end_process(self, code: int, signame: str | None) -> None:
        await self.listener.end_process(self, code, signame)


async def _messages(ws: web.WebSocketResponse) -> AsyncIterator[bytes]:
    """The text frames of `ws`, each one message, until the connection ends."""
    async for message in ws:
        if message.type == WSMsgType.TEXT:
            yield message.data.encode()
        # Binary frames are ignored, as by the real server; errors and close end the loop.


class Listener:
    """The listening server: accepts connections and runs a `Connection` for each."""

    def __init__(
        self,
        endpoint: Endpoint,
        script: AppServerScript | None,
        *,
        seed: int | None,
        version_output: str,
        token: bytes | None,
    ) -> None:
        self.endpoint = endpoint
        self.script = script
        self.seed = seed
        self.version_output = version_output
        self.token = token
        self.connections: set[Connection] = set()
        #: The threads of the process, and the connections subscribed to each.
        self.threads: dict[str, Any] = {}
        self._subscribers: dict[str, set[Connection]] = {}
        self._numbers = itertools.count()
        self._done: asyncio.Future[int]
        self._socket: str | None = None
        self._link: str | None = None

    async def run(self) -> int:
        """Listen until SIGTERM/SIGINT or an `exit` step with `server: true`."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop)
        runner = web.ServerRunner(
            web.Server(self._handle),
            handle_signals=False,
            access_log=None,
        )
        await runner.setup()
        try:
            await self._start(runner)
            code = await self._done
            for connection in list(self.connections):
                connection.exit(0)
            await runner.cleanup()
        finally:
            self._remove_socket()
        return code

    async def _start(self, runner: web.ServerRunner) -> None:
        if self.endpoint.kind == "ws":
            await web.TCPSite(runner, self.endpoint.host, self.endpoint.port).start()
            port = runner.addresses[0][1]
            log_banner(f"ws://{self.endpoint.host}:{port}")
            return
        link = self.endpoint.path or default_socket_path()
        target = _claim(link)
        old_umask = os.umask(0o177)
        try:
            await web.UnixSite(runner, target).start()
        finally:
            os.umask(old_umask)
        self._socket = target
        _publish(target, link)
        self._link = link

    def _remove_socket(self) -> None:
        if self._link is not None and os.path.islink(self._link):
            with contextlib.suppress(OSError):
                if os.readlink(self._link) == self._socket:
                    os.unlink(self._link)
        if self._socket is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._socket)

    def _stop(self, code: int = 0) -> None:
        if not self._done.done():
            self._done.set_result(code)

    async def end_process(self, connection: Connection, code: int, signame: str | None) -> None:
        """An `exit` step with `server: true` on `connection`."""
        if signame is not None:
            os.kill(os.getpid(), signal.Signals[signame])
            await asyncio.sleep(0)  # a signal that does not kill (e.g. ignored) lands here
        for other in list(self.connections):
            other.aborted = True
            other.exit(code)
        self._stop(code)

    def subscribe(self, thread_id: str, connection: Connection) -> None:
        self._subscribers.setdefault(thread_id, set()).add(connection)

    def tell_others(self, source: Connection, message: Message) -> None:
        """A notification `source` sent: the other connections that hear it too."""
        method = message.get("method")
        if not isinstance(method, str) or "id" in message:
            return
        if method in BROADCAST:
            hearers: set[Connection] = self.connections
        else:
            params = message.get("params")
            thread_id = params.get("threadId") if isinstance(params, dict) else None
            if not isinstance(thread_id, str):
                return
            hearers = self._subscribers.get(thread_id, set())
        for other in list(hearers):
            if other is not source and other.initialized and other.output is not None:
                other.output.send(message)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        ws = web.WebSocketResponse(compress=False, max_msg_size=MAX_MESSAGE_BYTES, autoping=True)
        if self.endpoint.kind == "unix":
            ws.headers[_MAX_HEADER] = str(MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        await self._serve(ws, request)
        return ws

    def _refusal(self, request: web.BaseRequest) -> web.StreamResponse | None:
        """The answer to a request that is not an acceptable upgrade, else None."""
        upgrade = "websocket" in request.headers.get("Upgrade", "").lower()
        if self.endpoint.kind == "unix":
            if not upgrade and request.transport is not None:
                # The real server closes a plain request on its socket unanswered.
                request.transport.abort()
            return None if upgrade else web.Response(status=400)
        if request.method != "GET":
            return web.Response(status=405, text="Request method must be `GET`")
        if not upgrade:
            if request.path in ("/readyz", "/healthz"):
                return web.Response(status=200)
            return web.Response(status=400, text="Connection header did not include 'upgrade'")
        if "Origin" in request.headers:
            return web.Response(status=403)
        if self.token is None:
            return None
        authorization = request.headers.get("Authorization")
        if authorization is None:
            return web.Response(status=401, text="missing websocket bearer token")
        scheme, _, presented = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return web.Response(status=401, text="invalid authorization header")
        digest = hashlib.sha256(presented.strip().encode()).digest()
        if not hmac.compare_digest(digest, self.token):
            return web.Response(status=401, text="invalid websocket bearer token")
        return None

    async def _serve(self, ws: web.WebSocketResponse, request: web.BaseRequest) -> None:
        number = next(self._numbers)
        seed = self.seed
        ids = IdFactory(None if seed is None else seed + number * _SEED_STRIDE)
        connection: Connection
        output = FrameOutput(ws, on_lost=lambda: connection.exit(0))
        connection = Connection(
            self,
            number,
            script=self.script,
            seed=seed,
            version_output=self.version_output,
            ids=ids,
        )
        connection.output = output
        self.connections.add(connection)
        try:
            try:
                report = f"fake-codex-{os.getpid()}-{number}.json"
                code = await connection.serve(_Closing(output, connection), _messages(ws), report)
            finally:
                self.connections.discard(connection)
                connection.output = None
                for subscribers in self._subscribers.values():
                    subscribers.discard(connection)
            if connection.aborted:
                await output.abort(request.transport)
            elif not ws.closed:
                await output.close(1000 if code == 0 else 1011, "" if code == 0 else f"exit {code}")
        finally:
            await output.stop()


class _Closing:
    """A connection's sink as its server sees it: `close()` (called when the session
    ends) is left to the listener, which knows whether to close or drop the connection."""

    def __init__(self, output: FrameOutput, connection: Connection) -> None:
        self._output = output
        self._connection = connection
        self.write = output.write
        self.drain = output.drain

    def send(self, message: Message) -> None:
        """To this connection, and to the others that hear it (`Listener.tell_others`)."""
        self._output.send(message)
        self._connection.listener.tell_others(self._connection, message)

    async def close(self) -> None:
        return None


def _is_socket(path: str) -> bool:
    import stat

    return stat.S_ISSOCK(os.lstat(path).st_mode)


def log_banner(address: str) -> None:
    """What the real server prints on stderr once a ws:// listener is up."""
    host_port = address.removeprefix("ws://")
    log_lines = [
        "codex app-server (WebSockets)",
        f"  listening on: {address}",
        f"  readyz: http://{host_port}/readyz",
        f"  healthz: http://{host_port}/healthz",
    ]
    os.write(2, ("\n".join(log_lines) + "\n").encode())


def serve_listen(
    endpoint: Endpoint,
    script: AppServerScript | None,
    *,
    seed: int | None,
    version_output: str,
    token: bytes | None,
) -> int:
    """Run a listening fake app-server; returns the exit status."""
    use_virtual_clock(seed)
    listener = Listener(endpoint, script, seed=seed, version_output=version_output, token=token)
    try:
        return asyncio.run(listener.run())
    except ListenError as exc:
        log(str(exc).removeprefix("error: "))
    except OSError as exc:
        log(f"cannot listen on {endpoint.url}: {exc.strerror or exc}")
    return 1
