"""JSON-RPC over a child process's stdio: the app-server wire of PROTOCOL.md.

One JSON object per line, no ``"jsonrpc"`` field. The reader is an
:class:`asyncio.SubprocessProtocol` that splits and dispatches lines as bytes
arrive, without a task or an await per line. Memory is bounded whatever the
child writes: a line longer than ``max_line_bytes`` ends the conversation with a
protocol error, and of stderr only a short tail is kept.

A message with a ``method`` is a notification or a request from the server,
never a response, even when its ``id`` equals one of our pending calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from bridge.limits import MAX_STDIN_BUFFER
from bridge.process import descendants
from bridge.wire import JSONDecodeError, dumps_line, loads

log = logging.getLogger("bridge.process")

STDERR_TAIL_BYTES = 8192
#: How long to wait for the pipes to close after the child itself exited.
_PIPE_DRAIN_SECONDS = 0.5
#: How long a child may live on after closing its stdout before it counts as broken.
_EOF_GRACE_SECONDS = 1.0
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")

NotificationHandler = Callable[[str, Any], None]
RequestHandler = Callable[[Any, str, Any], None]
#: Asked before each line from the child is taken, with its size: True holds it back.
FlowGate = Callable[[int], bool]


def _ignore_notification(method: str, params: Any) -> None:
    pass


def _ignore_request(request_id: Any, method: str, params: Any) -> None:
    pass


class RpcError(Exception):
    """The server answered a call with a JSON-RPC error."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.data = data


class ProcessGone(Exception):
    """The process exited (or was stopped) before the call was answered."""

    def __init__(self, exit_info: ExitInfo) -> None:
        super().__init__(exit_info.describe())
        self.exit_info = exit_info


class StdinFull(Exception):
    """The child is not reading its stdin; more data would only pile up in memory."""


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """How the process ended."""

    exit_code: int | None
    signal: str | None
    stderr_tail: str
    #: Set when the bridge ended the process because it broke the protocol.
    protocol_error: str | None = None
    #: Shared mode: how the session's connection to the shared app-server ended (the
    #: code and signal are then the shared process's, when it was its exit that ended it).
    connection: str | None = None

    def describe(self) -> str:
        if self.protocol_error:
            return f"the app-server broke the protocol: {self.protocol_error}"
        if self.connection:
            return f"the connection to the shared app-server ended: {self.connection}"
        if self.signal:
            return f"the app-server process was killed by {self.signal}"
        return f"the app-server process exited with code {self.exit_code}"

    def to_event_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "exitCode": self.exit_code,
            "signal": self.signal,
            "stderrTail": self.stderr_tail,
        }
        if self.protocol_error:
            params["protocolError"] = self.protocol_error
        if self.connection:
            params["connection"] = self.connection
        return params


class _StdioProtocol(asyncio.SubprocessProtocol):
    """Hands the child's output to its owner; let go of it once the process is finished."""

    def __init__(self, owner: AppServerProcess) -> None:
        self.owner: AppServerProcess | None = owner

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        owner = self.owner
        if owner is None:
            return
        if isinstance(data, str):
            data = data.encode()
        if fd == 1:
            owner._feed_stdout(data)
        elif fd == 2:
            owner._feed_stderr(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if self.owner is None:
            return
        if fd == 1:
            self.owner._stdout_eof()
        elif fd == 0:
            self.owner._pipe_gone("stdin")

    def process_exited(self) -> None:
        if self.owner is not None:
            self.owner._process_exited()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.owner is not None:
            self.owner._finish()


class AppServerProcess:
    """One app-server child process and the JSON-RPC conversation over its stdio."""

    #: False for a process of its own; True for a connection to a shared app-server
    #: (shared.py), so that what a client is told names what ended.
    is_connection: ClassVar[bool] = False

    def __init__(
        self,
        *,
        max_line_bytes: int,
        on_notification: NotificationHandler | None = None,
        on_request: RequestHandler | None = None,
    ) -> None:
        self._max_line_bytes = max_line_bytes
        self.on_notification: NotificationHandler = on_notification or _ignore_notification
        self.on_request: RequestHandler = on_request or _ignore_request
        self.exit_callbacks: list[Callable[[ExitInfo], None]] = []
        #: Flow control: asked before each line is taken (see :meth:`resume`).
        self.flow_gate: FlowGate | None = None
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.SubprocessTransport | None = None
        self._protocol: _StdioProtocol | None = None
        #: Output read but held back by the flow gate, and whether reading is paused.
        self._held = b""
        self._paused = False
        self._finish_deferred = False
        #: Set once the bridge itself is stopping the process.
        self._stopping = False
        self._stdin: asyncio.WriteTransport | None = None
        #: Lines written while other calls are in flight, sent in one write at the
        #: next turn of the loop (one syscall for many calls under load).
        self._outgoing: list[bytes] = []
        self._outgoing_bytes = 0
        self._buffer = bytearray()
        self._stderr_tail = bytearray()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        #: (deadline, request id) of calls, earliest first, and one timer for the earliest
        #: call still in flight: a heap push per call instead of a timer handle per call.
        #: An answered call's entry stays until it comes up or the heap is compacted.
        self._deadlines: list[tuple[float, int]] = []
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._protocol_error: str | None = None
        self._exited = False
        self._exit_info: ExitInfo | None = None
        self._finished: asyncio.Future[ExitInfo] = self._loop.create_future()
        self.pid: int | None = None
        #: Everything this process starts, killed when it ends (descendants.py).
        self.lineage = descendants.Lineage()
        #: When the bytes being dispatched were read (one clock read per chunk).
        self.received_at = 0.0

    @classmethod
    async def spawn(
        cls,
        command: Sequence[str],
        *,
        max_line_bytes: int,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> AppServerProcess:
        """Start ``command`` in its own process group with piped stdio.

        Raises ``OSError`` when it cannot be started.
        """
        self = cls(max_line_bytes=max_line_bytes)
        with descendants.spawning() as own:
            transport, protocol = await self._loop.subprocess_exec(
                lambda: _StdioProtocol(self),
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.lineage.environment(env),
                cwd=cwd,
                start_new_session=True,
            )
            own(transport.get_pid())
        self._transport = transport
        self._protocol = protocol
        self.pid = transport.get_pid()
        self.lineage.spawned(self.pid)
        if self._exited:
            # It exited before its pid was known here: what it left is killed now.
            self._kill_group(signal.SIGKILL)
            self.lineage.end()
        stdin = transport.get_pipe_transport(0)
        assert stdin is not None
        # A WriteTransport in behaviour; uvloop's does not subclass asyncio's.
        self._stdin = cast(asyncio.WriteTransport, stdin)
        if self._protocol_error is not None:
            # It broke the protocol before its pid was known, so it is still running.
            self._kill_group(signal.SIGKILL)
        return self

    # -- state -----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._exit_info is None

    @property
    def paused(self) -> bool:
        """True while the flow gate holds the child's output back."""
        return self._paused

    @property
    def exit_info(self) -> ExitInfo | None:
        return self._exit_info

    def stderr_tail(self) -> str:
        text = bytes(self._stderr_tail).decode("utf-8", "replace")
        return _ANSI.sub("", text)

    async def wait(self) -> ExitInfo:
        """Wait until the process has exited and its pipes are closed."""
        return await asyncio.shield(self._finished)

    # -- outgoing --------------------------------------------------------------

    async def call(self, method: str, params: Any, timeout: float) -> Any:
        """Send a request and wait for its result.

        Raises :class:`RpcError`, :class:`ProcessGone`, :class:`StdinFull` or
        ``TimeoutError``.
        """
        if self._exit_info is not None:
            raise ProcessGone(self._exit_info)
        request_id = next(self._ids)
        message: dict[str, Any] = {"id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self._write(message)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[request_id] = future
        self._add_deadline(self._loop.time() + timeout, request_id)
        try:
            return await future
        finally:
            self._pending.pop(request_id, None)

    def _add_deadline(self, deadline: float, request_id: int) -> None:
        deadlines = self._deadlines
        if len(deadlines) > 2 * len(self._pending) + 64:
            # Mostly answered calls: keep those in flight (bounded, amortised O(1)).
            pending = self._pending
            deadlines[:] = [entry for entry in deadlines if entry[1] in pending]
            heapq.heapify(deadlines)
        heapq.heappush(deadlines, (deadline, request_id))
        timer = self._deadline_timer
        if timer is None or deadline < timer.when():
            if timer is not None:
                timer.cancel()
            self._deadline_timer = self._loop.call_at(deadline, self._expire_due)

    def _expire_due(self) -> None:
        """Time out the calls whose deadline has come; wait for the next in flight."""
        self._deadline_timer = None
        deadlines = self._deadlines
        pending = self._pending
        now = self._loop.time()
        while deadlines:
            deadline, request_id = deadlines[0]
            future = pending.get(request_id)
            if future is not None and not future.done():
                if deadline > now:
                    self._deadline_timer = self._loop.call_at(deadline, self._expire_due)
                    return
                future.set_exception(TimeoutError())
            heapq.heappop(deadlines)

    def notify(self, method: str, params: Any = None) -> None:
        message: dict[str, Any] = {"method": method}
        if params is not None:
            message["params"] = params
        self._write(message)

    def respond(self, request_id: Any, result: Any) -> None:
        self._write({"id": request_id, "result": result})

    def respond_error(self, request_id: Any, code: int, message: str, data: Any = None) -> None:
        error: dict[str, Any] = {"code": code, "message": message}
        if data is not None:
            error["data"] = data
        self._write({"id": request_id, "error": error})

    def _write(self, message: dict[str, Any]) -> None:
        if self._exit_info is not None or self._stdin is None:
            raise ProcessGone(self._gone_info())
        if self._stdin.is_closing():
            raise ProcessGone(self._gone_info())
        if self._stdin.get_write_buffer_size() + self._outgoing_bytes > MAX_STDIN_BUFFER:
            raise StdinFull("the app-server is not reading its input")
        line = dumps_line(message)
        if not self._outgoing and len(self._pending) == 0:
            # Nothing else in flight: no reason to wait for company.
            self._stdin.write(line)
            return
        if not self._outgoing:
            self._loop.call_soon(self._flush)
        self._outgoing.append(line)
        self._outgoing_bytes += len(line)

    def _flush(self) -> None:
        if not self._outgoing:
            return
        data = b"".join(self._outgoing)
        self._outgoing.clear()
        self._outgoing_bytes = 0
        if self._stdin is not None and not self._stdin.is_closing():
            self._stdin.write(data)

    def _gone_info(self) -> ExitInfo:
        return self._exit_info or ExitInfo(None, None, self.stderr_tail(), self._protocol_error)

    # -- incoming --------------------------------------------------------------

    def _feed_stdout(self, data: bytes) -> None:
        if self._protocol_error is not None:
            return
        if self._paused:
            self._held += data
            return
        self.received_at = time.time()
        buffer = self._buffer
        if b"\n" not in data:
            buffer += data
        else:
            lines = data.split(b"\n")
            rest = lines.pop()
            if buffer:
                buffer += lines[0]
                lines[0] = bytes(buffer)
                buffer.clear()
            limit = self._max_line_bytes
            dispatch = self._dispatch_line
            gate = self.flow_gate
            for index, line in enumerate(lines):
                if len(line) > limit:
                    self._break_protocol(f"a line of {len(line)} bytes exceeds MAX_LINE_BYTES")
                    return
                if gate is not None and gate(len(line)):
                    self._hold(b"\n".join(lines[index:]) + b"\n" + rest)
                    return
                dispatch(line)
                if self._protocol_error is not None:
                    return
            buffer += rest
        if len(buffer) > self._max_line_bytes:
            self._break_protocol(f"a line exceeds MAX_LINE_BYTES ({self._max_line_bytes} bytes)")

    def _dispatch_line(self, line: bytes) -> None:
        try:
            message = loads(line)
        except JSONDecodeError:
            if line.strip():
                self._break_protocol("the app-server wrote a line that is not JSON")
            return
        if not isinstance(message, dict):
            self._break_protocol("the app-server wrote a JSON value that is not an object")
            return
        method = message.get("method")
        if method is not None:
            if not isinstance(method, str):
                self._break_protocol("the app-server wrote a message whose method is not a string")
            elif "id" in message:
                request_id = message["id"]
                if isinstance(request_id, bool) or not isinstance(request_id, str | int):
                    # JSON-RPC ids are strings or integers: nothing else can be answered.
                    self._break_protocol(
                        "the app-server wrote a request whose id is neither a string nor an integer"
                    )
                else:
                    self.on_request(request_id, method, message.get("params"))
            else:
                self.on_notification(method, message.get("params"))
            return
        if "id" in message and ("result" in message or "error" in message):
            self._resolve(message)
            return
        self._break_protocol("the app-server wrote an object that is not a JSON-RPC message")

    def _resolve(self, message: dict[str, Any]) -> None:
        request_id = message["id"]
        future = None
        if isinstance(request_id, int) and not isinstance(request_id, bool):
            future = self._pending.get(request_id)
        if future is None or future.done():
            # A late answer to a call that timed out, or a response to an id we never
            # used: nobody is waiting for it, and it carries nothing to forward.
            log.warning("app-server answered an unknown or finished request id")
            return
        error = message.get("error")
        if error is None:
            future.set_result(message.get("result"))
            return
        if not isinstance(error, dict):
            error = {"message": str(error)}
        code = error.get("code")
        future.set_exception(
            RpcError(
                code if isinstance(code, int) else -32603,
                str(error.get("message", "")),
                error.get("data"),
            )
        )

    def _feed_stderr(self, data: bytes) -> None:
        tail = self._stderr_tail
        tail += data
        if len(tail) > STDERR_TAIL_BYTES:
            del tail[: len(tail) - STDERR_TAIL_BYTES]

    def _stdout_eof(self) -> None:
        if self._buffer and self._protocol_error is None:
            # A partial line before EOF: use it if it is a whole message.
            line = bytes(self._buffer)
            self._buffer.clear()
            self._dispatch_line(line)
        self._pipe_gone("stdout")

    def _pipe_gone(self, name: str) -> None:
        """The child closed one of its pipes: unless it is on its way out, it is broken.

        Without its stdout nothing more can be answered, without its stdin nothing more
        can be asked: such a child is as broken as one that writes garbage.
        """
        if not self._exited and not self._stopping:
            self._loop.call_later(_EOF_GRACE_SECONDS, self._check_alive_after, name)

    def _check_alive_after(self, name: str) -> None:
        if self._exited or self._stopping or self._exit_info is not None:
            return
        if self.pid is not None:
            try:
                exited = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return  # already reaped: its exit is on its way to us
            if exited is not None:
                return
        self._break_protocol(f"the app-server closed its {name} but kept running")

    # -- flow control ------------------------------------------------------------

    def _hold(self, data: bytes) -> None:
        """Keep ``data`` for later and stop reading the child's stdout."""
        self._held = data
        self._paused = True
        pipe = self._stdout_pipe()
        if pipe is not None:
            pipe.pause_reading()

    def resume(self) -> None:
        """Take what was held back, if the flow gate now allows it, and read on."""
        if not self._paused:
            return
        self._paused = False
        held, self._held = self._held, b""
        if held:
            self._feed_stdout(held)
            if self._paused:
                return
        pipe = self._stdout_pipe()
        if pipe is not None and not pipe.is_closing():
            pipe.resume_reading()
        if self._finish_deferred:
            self._finish_deferred = False
            self._loop.call_later(_PIPE_DRAIN_SECONDS, self._finish)

    def release_flow(self) -> None:
        """No more holding back: take everything (for shutdown)."""
        self.flow_gate = None
        self.resume()

    def _stdout_pipe(self) -> asyncio.ReadTransport | None:
        if self._transport is None:
            return None
        pipe = self._transport.get_pipe_transport(1)
        return cast(asyncio.ReadTransport, pipe) if pipe is not None else None

    def break_protocol(self, reason: str) -> None:
        """The owner found the conversation broken: stop the process as for a bad line."""
        self._break_protocol(reason)

    def _break_protocol(self, reason: str) -> None:
        """The stream can no longer be trusted: stop the process."""
        if self._protocol_error is None:
            self._protocol_error = reason
            self._buffer.clear()
            log.warning("stopping app-server pid %s: %s", self.pid, reason)
            self._kill_group(signal.SIGKILL)

    # -- lifecycle -------------------------------------------------------------

    def _process_exited(self) -> None:
        self._exited = True
        # The app-server's own children must not outlive it, and one of them
        # holding our pipes open would otherwise delay the end of the session.
        self._kill_group(signal.SIGKILL)
        # And so must those that left the group (setsid, a daemon's double fork).
        if self.pid is not None:
            self.lineage.end()
        self._loop.call_later(_PIPE_DRAIN_SECONDS, self._finish)

    def _finish(self) -> None:
        if self._exit_info is not None or self._transport is None:
            return
        if not self._exited and self._transport.get_returncode() is None:
            # The pipes closed before the process exited: wait for the exit itself.
            return
        if self._paused and self._protocol_error is None:
            # Its last words are still in the pipe, held back for a reader: finish once
            # they are taken (or the reader is cut loose).
            self._finish_deferred = True
            return
        code = self._transport.get_returncode()
        sig: str | None = None
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                sig = signal.Signals(-code).name
            code = None
        self._exit_info = ExitInfo(code, sig, self.stderr_tail(), self._protocol_error)
        self._transport.close()
        self._conclude(self._exit_info)
        self._held = b""
        if self._protocol is not None:
            self._protocol.owner = None
        self._protocol = None
        self._transport = None
        self._stdin = None

    def _conclude(self, info: ExitInfo) -> None:
        """The conversation is over (``info`` is set): fail what waits, tell the owners,
        and let go of them, so that nothing but plain references keeps them."""
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._deadlines.clear()
        gone = ProcessGone(info)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(gone)
        self._pending.clear()
        self._finished.set_result(info)
        for callback in self.exit_callbacks:
            try:
                callback(info)
            except Exception as exc:
                log.error("exit callback failed: %s", type(exc).__name__)
        self.exit_callbacks = []
        self.on_notification = _ignore_notification
        self.on_request = _ignore_request
        self.flow_gate = None

    def _kill_group(self, sig: signal.Signals) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def shutdown(self, grace: float) -> ExitInfo:
        """Stop the process: close stdin, then SIGTERM, then SIGKILL the whole group.

        Everything is over within ``grace`` seconds (plus the time the kernel takes).
        """
        if self._exit_info is not None:
            return self._exit_info
        self._stopping = True
        self.release_flow()
        if not self._exited:
            self.lineage.remember_tree()
        self._flush()
        if self._stdin is not None and not self._stdin.is_closing():
            self._stdin.close()
        deadline = self._loop.time() + grace
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(grace / 4, 0.5)):
                return await self.wait()
        self._kill_group(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(deadline - self._loop.time(), 0)):
                return await self.wait()
        self._kill_group(signal.SIGKILL)
        return await self.wait()
