"""A channel over a WebSocket connection to a shared app-server: one message per text frame.

The connection (aiohttp's client) is opened by :class:`~bridge.process.shared.ConnectShared`;
this channel reads and writes it, holds a frame back while its receiver does not take it,
and says how the connection ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import aiohttp

from bridge.limits import MAX_STDIN_BUFFER
from bridge.process.channel import ChannelClosed, ChannelFull, ChannelState, ExitInfo, Receiver

log = logging.getLogger("bridge")

#: How the ends of a connection are told in the ``exit`` event (``params.connection``).
CLOSED_BY_BRIDGE = "closed by the bridge"
CLOSED_BY_SERVER = "closed by the app-server"
SERVER_EXITED = "the shared app-server exited"

#: Closes in flight, kept so that none is collected before it is done.
_closing_tasks: set[asyncio.Task[None]] = set()


async def close_quietly(ws: aiohttp.ClientWebSocketResponse) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError, TimeoutError):
        await ws.close()


def _close_soon(ws: aiohttp.ClientWebSocketResponse) -> None:
    """Close ``ws`` without waiting for it (from a callback)."""
    task = asyncio.get_running_loop().create_task(close_quietly(ws))
    _closing_tasks.add(task)
    task.add_done_callback(_closing_tasks.discard)


class WebSocketChannel(ChannelState):
    """One conversation with the shared app-server over its own WebSocket connection.

    ``dropped`` is awaited when the app-server drops the connection without a close frame
    (perhaps its process died), so the caller may end it as an exit (:meth:`server_exited`)
    before the end is reported; ``on_end`` is called with the channel as it ends.
    """

    newline_delimited = False
    shared = True

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        *,
        max_frame_bytes: int,
        dropped: Callable[[], Awaitable[object]] | None = None,
        on_end: Callable[[WebSocketChannel], None] | None = None,
    ) -> None:
        super().__init__(max_frame_bytes)
        self._ws = ws
        self._dropped = dropped
        self._on_end = on_end
        #: Frames waiting for the writer (bounded by the peer, like a child's stdin).
        self._frames: deque[bytes] = deque()
        self._frames_bytes = 0
        self._writer: asyncio.Task[None] | None = None
        #: The frame the receiver held back, and what wakes the reader once it is taken.
        self._held_frame: bytes | None = None
        self._readable = asyncio.Event()
        self._readable.set()
        self._reader: asyncio.Task[None] | None = None

    def attach(self, receiver: Receiver) -> None:
        super().attach(receiver)
        if self._reader is None:
            self._reader = self._loop.create_task(self._read())

    # -- state -------------------------------------------------------------------

    def end_info(self) -> ExitInfo:
        how = CLOSED_BY_BRIDGE if self._stopping else CLOSED_BY_SERVER
        return self._exit_info or ExitInfo(None, None, "", None, how)

    # -- outgoing ----------------------------------------------------------------

    def send(self, frame: bytes, coalesce: bool) -> None:
        if self._exit_info is not None or self._stopping or self._ws.closed:
            raise ChannelClosed
        if self._frames_bytes > MAX_STDIN_BUFFER:
            raise ChannelFull
        # JSON text as UTF-8 bytes, sent as a text frame as is (send_str would encode a
        # str again); the bound counts bytes, as the wire does. The writer task already
        # sends what queues up while it waits: nothing to coalesce here.
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

    # -- incoming ----------------------------------------------------------------

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
                    if self._receiver is not None:
                        reason = f"the app-server sent an unreadable frame ({message.data.code})"
                        self._receiver.channel_broken(reason)
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
        if self._aborted:
            self._end(ExitInfo(None, None, "", None, CLOSED_BY_BRIDGE))
            return
        if ended_by_server and not farewell and self._dropped is not None:
            # Dropped without a close frame: perhaps the whole process died.
            await self._dropped()
        if self._exit_info is None:
            if not ended_by_server:
                self._end(ExitInfo(0, None, "", None, CLOSED_BY_BRIDGE))
                return
            # A normal closure is what a clean exit of a process of its own would be.
            clean = self._ws.close_code == aiohttp.WSCloseCode.OK
            self._end(ExitInfo(0 if clean else None, None, "", None, CLOSED_BY_SERVER))

    def _take(self, data: bytes) -> bool:
        """One frame from the app-server: deliver it, or hold it back; False to stop."""
        receiver = self._receiver
        if receiver is None:
            return False
        receiver.received_at = time.time()
        if not receiver.frames_received([data]):
            self._held_frame = data
            self._paused = True
            self._readable.clear()
            return True
        return not self._aborted

    def resume_reading(self) -> None:
        if not self._paused:
            return
        self._paused = False
        held, self._held_frame = self._held_frame, None
        if held is not None and not self._take(held):
            self._readable.set()
            return
        if not self._paused:
            self._readable.set()

    def abort(self, reason: str) -> None:
        if not self._aborted:
            self._aborted = True
            log.warning("closing a connection to the shared app-server: %s", reason)
            self._readable.set()
            _close_soon(self._ws)

    # -- lifecycle ---------------------------------------------------------------

    def _end(self, info: ExitInfo) -> None:
        """The conversation is over: tell the receiver and let go of it."""
        if self._exit_info is not None:
            return
        self._exit_info = info
        self._frames.clear()
        self._frames_bytes = 0
        self._held_frame = None
        self._readable.set()
        if not self._ws.closed:
            _close_soon(self._ws)
        if self._on_end is not None:
            self._on_end(self)
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.channel_ended(info)

    def server_exited(self, info: ExitInfo, how: str = SERVER_EXITED) -> None:
        """The shared process died: the conversation ends with its exit code and signal."""
        self._end(ExitInfo(info.exit_code, info.signal, "", None, how))

    async def close(self, grace: float) -> None:
        """Close the connection (the app-server keeps running for the others)."""
        if self._exit_info is not None:
            return
        self._stopping = True
        self.resume_reading()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                if self._writer is not None:
                    await asyncio.shield(self._writer)
                await close_quietly(self._ws)
        if self._exit_info is None and self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._end(ExitInfo(0, None, "", None, CLOSED_BY_BRIDGE))
