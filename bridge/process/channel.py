"""What carries JSON-RPC messages to and from an app-server: a channel.

A channel moves whole messages (frames) and knows nothing of JSON-RPC: a child process's
stdio, one message per line (:mod:`bridge.process.stdio`), or a WebSocket connection to a
shared app-server, one per text frame (:mod:`bridge.process.websocket`). It pushes what it
reads to its :class:`Receiver` (a :class:`~bridge.process.peer.JsonRpcPeer`) as it
arrives, a batch of frames at a time, with no task or await per frame, and never buffers
more of a frame than the size it was given.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol


class ChannelClosed(Exception):
    """Nothing more can be sent: the channel has ended, or is ending."""


class ChannelFull(Exception):
    """The other end is not reading: more than
    :data:`~bridge.limits.MAX_STDIN_BUFFER` bytes wait for it."""


#: How a connection to the shared app-server ends when the bridge killed that
#: app-server for not answering its liveness probe (``params.connection``; the bridge's
#: exit line says it killed it).
SERVER_WEDGED = "the shared app-server stopped answering and was killed"


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """How a channel (and the conversation over it) ended."""

    exit_code: int | None
    signal: str | None
    stderr_tail: str
    #: Set when the bridge ended it because the app-server broke the protocol.
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


class Receiver(Protocol):
    """What a channel delivers to."""

    #: When the frames being delivered were read (``time.time()``); the channel sets it
    #: as it reads (once per read, not per frame).
    received_at: float

    def frames_received(self, frames: list[bytes]) -> int:
        """Whole messages, in order; returns how many were taken. The channel holds the
        rest and stops reading until :meth:`Channel.resume_reading`."""

    def channel_broken(self, reason: str) -> None:
        """The stream can no longer be read as messages (a frame over the size limit,
        an unreadable frame, a pipe closed by a child that lives on)."""

    def channel_ended(self, info: ExitInfo) -> None:
        """The channel is over; called once, last."""


class Channel(Protocol):
    """A message stream to one app-server conversation."""

    #: True when each message goes out as one line (stdio); False for one frame each.
    newline_delimited: bool
    #: True when the other end serves other clients too (a connection to a shared
    #: app-server): its end is a connection's, not a process's.
    shared: bool
    #: The longest frame it reads (MAX_LINE_BYTES); a longer one breaks the protocol.
    max_frame_bytes: int

    def attach(self, receiver: Receiver) -> None:
        """Deliver what is read to ``receiver`` from now on."""

    def send(self, frame: bytes, coalesce: bool) -> None:
        """Send one message (``coalesce``: more are likely this turn of the loop, so it may
        wait for them, one write for all); raises :class:`ChannelClosed` or :class:`ChannelFull`."""

    @property
    def paused(self) -> bool:
        """True while a frame the receiver did not take holds reading back."""

    def resume_reading(self) -> None:
        """Offer the held frames again, and read on if they are all taken."""

    def abort(self, reason: str) -> None:
        """Stop now, unread output dropped: the app-server broke the protocol (``reason``,
        for the log)."""

    def end_info(self) -> ExitInfo:
        """How the channel ended (or is ending), for a write that comes too late."""

    async def close(self, grace: float) -> None:
        """End it in order, within ``grace`` seconds; returns once it has ended."""


class ChannelState:
    """What both channels keep: their receiver, whether reading is held back, whether the
    bridge is stopping or aborted them, and how they ended."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._receiver: Receiver | None = None
        self._loop = asyncio.get_running_loop()
        self._paused = False
        #: Set once the bridge itself is stopping the channel, or aborted it.
        self._stopping = False
        self._aborted = False
        self._exit_info: ExitInfo | None = None

    def attach(self, receiver: Receiver) -> None:
        self._receiver = receiver

    @property
    def running(self) -> bool:
        return self._exit_info is None

    @property
    def paused(self) -> bool:
        return self._paused
