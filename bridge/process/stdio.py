"""A channel over a child process's stdio: one message per line.

The reader is an :class:`asyncio.SubprocessProtocol` that splits lines as bytes arrive
and hands them to the receiver, with no task or await per line. Memory is bounded: a line
over ``max_line_bytes`` is reported as broken, and of stderr only a short tail is kept.
When the child ends, or the bridge stops it, its process group and whatever left the
group (descendants.py) are killed, so none of its children outlive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from bridge.limits import MAX_STDIN_BUFFER
from bridge.process import descendants
from bridge.process.channel import ChannelClosed, ChannelFull, ChannelState, ExitInfo

log = logging.getLogger("bridge.process")

STDERR_TAIL_BYTES = 8192
#: How long to wait for the pipes to close after the child itself exited.
_PIPE_DRAIN_SECONDS = 0.5
#: How long a child may live on after closing its stdout before it counts as broken.
_EOF_GRACE_SECONDS = 1.0
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


class StdioChannel(ChannelState, asyncio.SubprocessProtocol):
    """One app-server child process, and its asyncio protocol; messages are lines on its
    stdin and stdout. With ``stdout_is_log`` (an app-server that speaks on a socket)
    stdout goes with stderr's tail, and only the process's end is reported (``on_end``).
    """

    newline_delimited = True
    shared = False

    def __init__(
        self,
        *,
        max_line_bytes: int,
        stdout_is_log: bool = False,
        on_end: Callable[[ExitInfo], None] | None = None,
    ) -> None:
        super().__init__(max_line_bytes)
        self.stdout_is_log = stdout_is_log
        self._on_end = on_end
        self._transport: asyncio.SubprocessTransport | None = None
        self._stdin: asyncio.WriteTransport | None = None
        #: Output read but not taken by the receiver, and whether reading is paused.
        self._held = b""
        self._finish_deferred = False
        #: Lines written while other calls are in flight, sent in one write at the
        #: next turn of the loop (one syscall for many calls under load).
        self._outgoing: list[bytes] = []
        self._outgoing_bytes = 0
        self._buffer = bytearray()
        self._stderr_tail = bytearray()
        self._exited = False
        self._finished: asyncio.Future[ExitInfo] = self._loop.create_future()
        #: Set as soon as the process has exited (its exit info follows once the pipes
        #: are closed).
        self.dead = asyncio.Event()
        self.pid: int | None = None
        #: Everything this process starts, killed when it ends (descendants.py).
        self.lineage = descendants.Lineage()

    async def spawn(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        """Start ``command`` in its own process group with piped stdio. Raises ``OSError``
        (``ValueError`` for an unusable environment or argument)."""
        with descendants.children.spawning() as own:
            transport, _ = await self._loop.subprocess_exec(
                lambda: self,
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
        if self._aborted:
            # It broke the protocol before its pid was known, so it is still running.
            self._kill_group(signal.SIGKILL)

    # -- state -----------------------------------------------------------------

    @property
    def exit_info(self) -> ExitInfo | None:
        return self._exit_info

    def stderr_tail(self) -> str:
        text = bytes(self._stderr_tail).decode("utf-8", "replace")
        return _ANSI.sub("", text)

    async def wait(self) -> ExitInfo:
        """Wait until the process has exited and its pipes are closed."""
        return await asyncio.shield(self._finished)

    def end_info(self) -> ExitInfo:
        return self._exit_info or ExitInfo(None, None, self.stderr_tail())

    # -- outgoing --------------------------------------------------------------

    def send(self, frame: bytes, coalesce: bool) -> None:
        stdin = self._stdin
        if self._exit_info is not None or stdin is None or stdin.is_closing():
            raise ChannelClosed
        if stdin.get_write_buffer_size() + self._outgoing_bytes > MAX_STDIN_BUFFER:
            raise ChannelFull
        if not self._outgoing and not coalesce:
            # Nothing else in flight: no reason to wait for company.
            stdin.write(frame)
            return
        if not self._outgoing:
            self._loop.call_soon(self._flush)
        self._outgoing.append(frame)
        self._outgoing_bytes += len(frame)

    def _flush(self) -> None:
        if not self._outgoing:
            return
        data = b"".join(self._outgoing)
        self._outgoing.clear()
        self._outgoing_bytes = 0
        if self._stdin is not None and not self._stdin.is_closing():
            self._stdin.write(data)

    # -- incoming (asyncio's SubprocessProtocol) ----------------------------------

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode()
        if fd == 1 and not self.stdout_is_log:
            self._feed_stdout(data)
        else:
            self._feed_stderr(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if self.stdout_is_log:
            return
        if fd == 1:
            self._stdout_eof()
        elif fd == 0:
            self._pipe_gone("stdin")

    def _feed_stdout(self, data: bytes) -> None:
        if self._aborted:
            return
        if self._paused:
            self._held += data
            return
        receiver = self._receiver
        if receiver is None:
            return  # nobody to read for (never the case: a peer attaches before spawning)
        receiver.received_at = time.time()  # one clock read per chunk
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
            taken = receiver.frames_received(lines)
            if self._aborted:
                return
            if taken < len(lines):
                self._hold(b"\n".join(lines[taken:]) + b"\n" + rest)
                return
            buffer += rest
        if len(buffer) > self.max_frame_bytes:
            receiver.channel_broken(f"a line exceeds MAX_LINE_BYTES ({self.max_frame_bytes} bytes)")

    def _feed_stderr(self, data: bytes) -> None:
        tail = self._stderr_tail
        tail += data
        if len(tail) > STDERR_TAIL_BYTES:
            del tail[: len(tail) - STDERR_TAIL_BYTES]

    def _stdout_eof(self) -> None:
        if self._buffer and not self._aborted and not self._paused:
            # A partial line before EOF: offered as a line (a whole message, or broken).
            self._feed_stdout(b"\n")
        self._pipe_gone("stdout")

    def _pipe_gone(self, name: str) -> None:
        """The child closed its stdout (nothing more can be answered) or its stdin
        (nothing more asked): unless it is on its way out, it is broken."""
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
        if self._receiver is not None:
            self._receiver.channel_broken(f"the app-server closed its {name} but kept running")

    # -- flow control ------------------------------------------------------------

    def _hold(self, data: bytes) -> None:
        """Keep ``data`` for later and stop reading the child's stdout."""
        self._held = data
        self._paused = True
        pipe = self._stdout_pipe()
        if pipe is not None:
            pipe.pause_reading()

    def resume_reading(self) -> None:
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

    def _stdout_pipe(self) -> asyncio.ReadTransport | None:
        if self._transport is None:
            return None
        pipe = self._transport.get_pipe_transport(1)
        return cast(asyncio.ReadTransport, pipe) if pipe is not None else None

    def abort(self, reason: str) -> None:
        if not self._aborted:
            self._aborted = True
            self._buffer.clear()
            said = "stopping app-server pid %s: %s"
            log.warning(said, self.pid, reason, extra={"throttle": "protocol_broken"})
            self._kill_group(signal.SIGKILL)

    # -- lifecycle -------------------------------------------------------------

    def process_exited(self) -> None:
        self._exited = True
        self.dead.set()
        # The app-server's own children must not outlive it, and one of them
        # holding our pipes open would otherwise delay the end of the session.
        self._kill_group(signal.SIGKILL)
        # And so must those that left the group (setsid, a daemon's double fork).
        if self.pid is not None:
            self.lineage.end()
        self._loop.call_later(_PIPE_DRAIN_SECONDS, self._finish)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish()

    def _finish(self) -> None:
        if self._exit_info is not None or self._transport is None:
            return
        if not self._exited and self._transport.get_returncode() is None:
            # The pipes closed before the process exited: wait for the exit itself.
            return
        if self._paused and not self._aborted:
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
        info = self._exit_info = ExitInfo(code, sig, self.stderr_tail())
        self._transport.close()
        self._finished.set_result(info)
        if self._receiver is not None:
            self._receiver.channel_ended(info)
        if self._on_end is not None:
            self._on_end(info)
        self._receiver = self._on_end = None
        self._held = b""
        self._transport = None
        self._stdin = None

    def _kill_group(self, sig: signal.Signals) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL to the process group now (a stopped process ignores SIGTERM until it
        is continued); what left the group is swept once it has exited."""
        self.lineage.remember_tree()
        self._kill_group(signal.SIGKILL)

    async def close(self, grace: float) -> None:
        """Stop the process: close stdin, then SIGTERM, then SIGKILL the whole group,
        all within ``grace`` seconds (plus the time the kernel takes)."""
        if self._exit_info is not None:
            return
        self._stopping = True
        self.resume_reading()
        if not self._exited:
            self.lineage.remember_tree()
        self._flush()
        if self._stdin is not None and not self._stdin.is_closing():
            self._stdin.close()
        deadline = self._loop.time() + grace
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(grace / 4, 0.5)):
                await self.wait()
                return
        self._kill_group(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(deadline - self._loop.time(), 0)):
                await self.wait()
                return
        self._kill_group(signal.SIGKILL)
        await self.wait()
