"""JSON-RPC with an app-server over a channel: one JSON object per message, no ``"jsonrpc"``.

The peer numbers its calls, keeps their futures and deadlines, dispatches what the
app-server sends, holds its output back while its owner's flow gate says so, and stops
the channel when the app-server breaks the protocol (a message that is not JSON-RPC, or
longer than MAX_LINE_BYTES). How messages travel is the
:class:`~bridge.process.channel.Channel`'s: the peer knows no process, socket, session
or HTTP.

A message with a ``method`` is a notification or a request from the server, never a
response, even when its ``id`` equals one of our pending calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from bridge.process.channel import Channel, ChannelClosed, ChannelFull, ExitInfo
from bridge.wire import JSONDecodeError, dumps, dumps_line, loads

log = logging.getLogger("bridge.process")

NotificationHandler = Callable[[str, Any], None]
RequestHandler = Callable[[Any, str, Any], None]
#: Asked before each message from the app-server is taken, with its size: True holds it back.
FlowGate = Callable[[int], bool]
#: Called with a call's result as soon as it is read (before anything read after it).
ResultHook = Callable[[Any], None]
#: Calls whose result hook is remembered at most, answered or not (those in flight stay).
_MAX_RESULT_HOOKS = 1024


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
    """The app-server (or the connection to it) ended before the call was answered."""

    def __init__(self, exit_info: ExitInfo) -> None:
        super().__init__(exit_info.describe())
        self.exit_info = exit_info


class StdinFull(Exception):
    """The app-server is not reading its input; more would only pile up in memory."""


class MessageFilter(Protocol):
    """One seam for what a conversation shows its owner and how it asks (shared mode's
    tenancy, :class:`~bridge.process.tenancy.Tenant`)."""

    def call(self, peer: JsonRpcPeer, method: str, params: Any, timeout: float) -> Awaitable[Any]:
        """Make the call (through :meth:`JsonRpcPeer.request`)."""

    def admit_notification(self, method: str, params: Any, frame: bytes) -> bool:
        """Whether the owner is told of this notification."""

    def delivered(self, method: str, params: Any) -> list[bytes]:
        """After a notification was passed on: frames held back before to dispatch now."""

    def admit_request(self, params: Any, frame: bytes) -> bool:
        """Whether the owner is asked this server request."""


class JsonRpcPeer:
    """The client end of one JSON-RPC conversation with an app-server; its channel's
    :class:`~bridge.process.channel.Receiver`."""

    def __init__(self, channel: Channel, *, message_filter: MessageFilter | None = None) -> None:
        self.channel = channel
        self.filter = message_filter
        self.on_notification: NotificationHandler = _ignore_notification
        self.on_request: RequestHandler = _ignore_request
        self.exit_callbacks: list[Callable[[ExitInfo], None]] = []
        #: Replies to unknown or finished request ids (counted: bridge.metrics).
        self.late_replies = 0
        #: Flow control: asked before each message is taken (see :meth:`resume`).
        self.flow_gate: FlowGate | None = None
        self._loop = asyncio.get_running_loop()
        self._encode = dumps_line if channel.newline_delimited else dumps
        self._max_frame_bytes = channel.max_frame_bytes
        self._frame_word = "line" if channel.newline_delimited else "message"
        #: When the message being dispatched was read (set by the channel).
        self.received_at = 0.0
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._result_hooks: dict[int, ResultHook] = {}
        #: (deadline, request id) of calls, earliest first, and one timer for the earliest
        #: call still in flight: a heap push per call instead of a timer handle per call.
        #: An answered call's entry stays until it comes up or the heap is compacted.
        self._deadlines: list[tuple[float, int]] = []
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._protocol_error: str | None = None
        self._exit_info: ExitInfo | None = None
        self._finished: asyncio.Future[ExitInfo] = self._loop.create_future()
        channel.attach(self)

    # -- state -----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._exit_info is None

    @property
    def paused(self) -> bool:
        """True while the flow gate holds the app-server's output back."""
        return self.channel.paused

    @property
    def shared(self) -> bool:
        """True when the conversation is a connection to a shared app-server (its end
        is then a connection's, not a process's)."""
        return self.channel.shared

    @property
    def exit_info(self) -> ExitInfo | None:
        return self._exit_info

    async def wait(self) -> ExitInfo:
        """Wait until the conversation is over (its channel has ended)."""
        return await asyncio.shield(self._finished)

    # -- outgoing --------------------------------------------------------------

    async def call(self, method: str, params: Any, timeout: float) -> Any:
        """Send a request and wait for its result. Raises :class:`RpcError`,
        :class:`ProcessGone`, :class:`StdinFull` or ``TimeoutError``."""
        if self.filter is not None:
            return await self.filter.call(self, method, params, timeout)
        # request()'s body, not a call to it: no second coroutine per call.
        request_id = self._send_request(method, params, timeout, None)
        try:
            return await self._pending[request_id]
        except asyncio.CancelledError:
            self._pending.pop(request_id, None)
            raise

    async def request(
        self, method: str, params: Any, timeout: float, on_result: ResultHook | None = None
    ) -> Any:
        """Send a request past the filter and wait for its result. ``on_result`` (which
        must not raise) is called with the result as it is read, before anything read
        after it is dispatched, even when it comes after the deadline."""
        request_id = self._send_request(method, params, timeout, on_result)
        try:
            return await self._pending[request_id]
        except asyncio.CancelledError:
            self._pending.pop(request_id, None)
            raise

    def _send_request(
        self, method: str, params: Any, timeout: float, on_result: ResultHook | None
    ) -> int:
        """Write a request and register its future and deadline; its id."""
        if self._exit_info is not None:
            raise ProcessGone(self._exit_info)
        request_id = next(self._ids)
        message: dict[str, Any] = {"id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self._write(message)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[request_id] = future
        if on_result is not None:
            hooks = self._result_hooks
            if len(hooks) >= _MAX_RESULT_HOOKS:
                # Calls that were never answered (timed out): forget them.
                self._result_hooks = hooks = {
                    i: hook for i, hook in hooks.items() if i in self._pending
                }
            hooks[request_id] = on_result
        self._add_deadline(self._loop.time() + timeout, request_id)
        return request_id

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
            if future is not None:
                if not future.done():
                    if deadline > now:
                        self._deadline_timer = self._loop.call_at(deadline, self._expire_due)
                        return
                    future.set_exception(TimeoutError())
                del pending[request_id]
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

    def refuse(self, request_id: Any, message: str) -> None:
        """Answer a server request nobody here can answer (JSON-RPC -32601), unless the
        app-server has stopped reading."""
        with contextlib.suppress(ProcessGone, StdinFull):
            self.respond_error(request_id, -32601, message)

    def _write(self, message: dict[str, Any]) -> None:
        if self._exit_info is not None:
            raise ProcessGone(self._exit_info)
        try:
            # With calls in flight, others are likely to follow: one write for them all.
            self.channel.send(self._encode(message), bool(self._pending))
        except ChannelClosed:
            info = dataclasses.replace(self.channel.end_info(), protocol_error=self._protocol_error)
            raise ProcessGone(info) from None
        except ChannelFull:
            raise StdinFull("the app-server is not reading its input") from None

    # -- incoming (the channel's Receiver) ---------------------------------------

    def frames_received(self, frames: list[bytes]) -> int:
        """Dispatch ``frames`` in order, up to one the flow gate holds back (its index),
        or up to a broken one (then all count as taken: there is no more reading)."""
        limit = self._max_frame_bytes
        gate = self.flow_gate
        dispatch = self._dispatch
        for index, frame in enumerate(frames):
            if len(frame) > limit:
                word = self._frame_word
                self.break_protocol(f"a {word} of {len(frame)} bytes exceeds MAX_LINE_BYTES")
                return len(frames)
            if gate is not None and gate(len(frame)):
                return index
            dispatch(frame)
            if self._protocol_error is not None:
                return len(frames)
        return len(frames)

    def _dispatch(self, frame: bytes) -> None:
        try:
            message = loads(frame)
        except JSONDecodeError:
            if frame.strip():
                self.break_protocol("the app-server wrote a line that is not JSON")
            return
        if not isinstance(message, dict):
            self.break_protocol("the app-server wrote a JSON value that is not an object")
            return
        method = message.get("method")
        if method is not None:
            if not isinstance(method, str):
                self.break_protocol("the app-server wrote a message whose method is not a string")
            elif "id" in message:
                request_id = message["id"]
                if isinstance(request_id, bool) or not isinstance(request_id, str | int):
                    # JSON-RPC ids are strings or integers: nothing else can be answered.
                    self.break_protocol(
                        "the app-server wrote a request whose id is neither a string nor an integer"
                    )
                    return
                params = message.get("params")
                if self.filter is None or self.filter.admit_request(params, frame):
                    self.on_request(request_id, method, params)
            elif self.filter is None:
                self.on_notification(method, message.get("params"))
            else:
                self._filtered_notification(method, message.get("params"), frame)
            return
        if "id" in message and ("result" in message or "error" in message):
            self._resolve(message)
            return
        self.break_protocol("the app-server wrote an object that is not a JSON-RPC message")

    def _filtered_notification(self, method: str, params: Any, frame: bytes) -> None:
        message_filter = self.filter
        assert message_filter is not None
        if not message_filter.admit_notification(method, params, frame):
            return
        self.on_notification(method, params)
        for held in message_filter.delivered(method, params):
            self._dispatch(held)

    def _resolve(self, message: dict[str, Any]) -> None:
        request_id = message["id"]
        future = None
        if isinstance(request_id, int) and not isinstance(request_id, bool):
            future = self._pending.pop(request_id, None)
            if self._result_hooks:
                hook = self._result_hooks.pop(request_id, None)
                if hook is not None and "result" in message:
                    hook(message["result"])
        if future is None or future.done():
            self.late_replies += 1
            # A late answer to a call that timed out, or a response to an id we never
            # used: nobody is waiting for it, and it carries nothing to forward.
            # Expected under load (a client gone with calls in flight): one per call,
            # so not a warning.
            log.debug("app-server answered an unknown or finished request id")
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

    def channel_ended(self, info: ExitInfo) -> None:
        """The conversation is over: fail what waits, tell the owners, and let go of them."""
        if self._exit_info is not None:
            return
        if self._protocol_error is not None and info.protocol_error is None:
            info = dataclasses.replace(info, protocol_error=self._protocol_error)
        self._exit_info = info
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._deadlines.clear()
        gone = ProcessGone(info)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(gone)
        self._pending.clear()
        self._result_hooks.clear()
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
        self.filter = None

    # -- flow control and failure ------------------------------------------------

    def resume(self) -> None:
        """Take what was held back, if the flow gate now allows it, and read on."""
        self.channel.resume_reading()

    def break_protocol(self, reason: str) -> None:
        """The conversation can no longer be trusted: stop the channel."""
        if self._protocol_error is None:
            self._protocol_error = reason
            self.channel.abort(reason)

    #: What the channel calls when it can no longer read messages.
    channel_broken = break_protocol

    async def shutdown(self, grace: float) -> ExitInfo:
        """End the conversation within ``grace`` seconds (plus what the kernel takes):
        a process of its own is stopped, a connection closed."""
        if self._exit_info is not None:
            return self._exit_info
        self.flow_gate = None
        await self.channel.close(grace)
        return await self.wait()
