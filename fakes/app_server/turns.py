"""Threads and turns: their state and the notifications that frame a turn.

The order of notifications is the real server's (see the README): a turn opens with
`thread/status/changed` (active), `turn/started` and the userMessage item, and closes
with token usage, rate limits, `thread/status/changed` (idle) and `turn/completed`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fakes.app_server import shapes
from fakes.app_server.ids import IdFactory
from fakes.app_server.wire import RequestId, notification, now_ms

if TYPE_CHECKING:
    from fakes.app_server.protocol import Fit
    from fakes.app_server.wire import Sink

ITEM_EVENTS: tuple[str, ...] = ("started", "deltas", "completed")
_DEFAULT_DELTAS = 4


@dataclass
class Usage:
    """Token counts one turn reports as `last`."""

    input_tokens: int = 100
    output_tokens: int = 20
    cached_input_tokens: int = 0
    reasoning_output_tokens: int = 0

    def breakdown(self) -> shapes.Json:
        """As a `TokenUsageBreakdown`."""
        return shapes.token_usage_breakdown(
            self.input_tokens,
            self.output_tokens,
            self.cached_input_tokens,
            self.reasoning_output_tokens,
        )


@dataclass
class ThreadState:
    """One thread started by `thread/start` (or `thread/fork`), and what happened in it.

    `info` is the `Thread` object as first announced; `settings` the rest of the
    `thread/start` result (model, policies), which `thread/resume` and `thread/fork`
    repeat. `history` holds the thread's finished turns with all their items.
    """

    id: str
    cwd: str
    info: shapes.Json = field(default_factory=dict)
    settings: shapes.Json = field(default_factory=dict)
    total_usage: shapes.Json = field(default_factory=lambda: Usage(0, 0).breakdown())
    last_usage: shapes.Json | None = None
    active_turn: TurnRun | None = None
    status: shapes.Json = field(default_factory=lambda: {"type": "idle"})
    preview: str = ""
    name: str | None = None
    history: list[shapes.Json] = field(default_factory=list)
    archived: bool = False
    loaded: bool = True
    updated_at: int | None = None
    read_revision: str | None = None

    def view(self, *, turns: bool = False) -> shapes.Json:
        """The `Thread` object as it stands now (`turns` with every item, or none)."""
        thread = dict(self.info)
        thread.update(
            preview=self.preview,
            name=self.name,
            status=self.status,
            turns=list(self.history) if turns else [],
        )
        if self.updated_at is not None:
            thread["updatedAt"] = self.updated_at
        return thread


def split_text(text: str, pieces: int | None) -> list[str]:
    """Cut `text` into `pieces` consecutive deltas of near-equal length."""
    count = min(_DEFAULT_DELTAS if pieces is None else pieces, len(text))
    if count <= 0:
        return []
    size, extra = divmod(len(text), count)
    cuts, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        cuts.append(text[start:end])
        start = end
    return cuts


class TurnRun:
    """A turn in flight: its ids, what it produced, and how it opens and closes."""

    def __init__(
        self,
        out: Sink,
        ids: IdFactory,
        thread: ThreadState,
        usage: Usage,
        fit: Fit | None = None,
    ) -> None:
        self.out = out
        self.fit = fit
        self.ids = ids
        self.thread = thread
        self.id = ids.uuid7()
        self.usage = usage
        self.started_ms = now_ms()
        self.started_at = self.started_ms // 1000
        self.completed = False
        self.final_message: shapes.Json | None = None
        self.items: list[shapes.Json] = []
        self.pending_requests: set[RequestId] = set()
        self.task: asyncio.Task[None] | None = None

    def snapshot(self) -> shapes.Json:
        """The turn as `turn/start` returns it: in progress, nothing loaded yet."""
        return shapes.turn_object(self.id)

    def notify(self, method: str, params: Any) -> None:
        """Send a notification (fitted to the release the fake emulates)."""
        if self.fit is not None:
            params = self.fit.notification(method, params)
        self.out.send(notification(method, params))

    def set_status(self, *flags: str) -> None:
        """Announce the thread as active, with `flags` such as `waitingOnApproval`."""
        status = {"type": "active", "activeFlags": list(flags)}
        self.thread.status = status
        self.notify("thread/status/changed", {"threadId": self.thread.id, "status": status})

    def begin(self, inputs: list[Any]) -> None:
        """Open the turn and record the user's input."""
        self.set_status()
        turn = shapes.turn_object(self.id, started_at=self.started_at)
        self.notify("turn/started", {"threadId": self.thread.id, "turn": turn})
        self.add_user_input(inputs)

    def add_user_input(self, inputs: list[Any]) -> None:
        """A userMessage item for `inputs` (none for empty input, like the real server)."""
        if not inputs:
            return
        content = shapes.user_content(inputs)
        if not self.thread.preview:
            self.thread.preview = shapes.input_preview(inputs)
        item_id = self.ids.uuid7()
        started = now_ms()
        self.item_started(shapes.user_message_item(item_id, content, started, None), started)
        self.item_completed(shapes.user_message_item(item_id, content, started, started))

    def item_started(self, item: shapes.Json, started_ms: int) -> None:
        """`item/started` for `item`."""
        self.notify(
            "item/started",
            {
                "item": item,
                "threadId": self.thread.id,
                "turnId": self.id,
                "startedAtMs": started_ms,
            },
        )

    def item_completed(self, item: shapes.Json) -> None:
        """`item/completed` for `item` (which the turn's history then holds)."""
        self.items.append(item)
        self.notify(
            "item/completed",
            {
                "item": item,
                "threadId": self.thread.id,
                "turnId": self.id,
                "contentTokenCount": None,
                "completedAtMs": now_ms(),
            },
        )

    async def agent_message(
        self,
        text: str,
        *,
        item_id: str | None = None,
        deltas: int | None = None,
        delta_delay_ms: int = 0,
        events: tuple[str, ...] = ITEM_EVENTS,
    ) -> str:
        """Stream an agentMessage item: started, deltas, completed (in `events` order)."""
        item_id = item_id or self.ids.message_id()
        started = now_ms()
        for event in events:
            if event == "started":
                self.item_started(shapes.agent_message_item(item_id, "", started, None), started)
            elif event == "deltas":
                await self._stream_deltas(item_id, split_text(text, deltas), delta_delay_ms)
            else:
                item = shapes.agent_message_item(item_id, text, started, now_ms())
                self.item_completed(item)
                self.final_message = item
        await self.out.drain()
        return item_id

    async def _stream_deltas(self, item_id: str, pieces: list[str], delay_ms: int) -> None:
        for piece in pieces:
            self.notify(
                "item/agentMessage/delta",
                {"threadId": self.thread.id, "turnId": self.id, "itemId": item_id, "delta": piece},
            )
            await self.out.drain()
            if delay_ms:
                await asyncio.sleep(delay_ms / 1000)

    def report_usage(self) -> None:
        """The end of one model response: its token usage, then the rate limits.

        The real server sends these once per response from the model, so a turn with a
        tool call (an approval) reports twice: after the tool ran, and at the end.
        """
        last = self.usage.breakdown()
        self.thread.total_usage = shapes.add_usage(self.thread.total_usage, last)
        self.thread.last_usage = last
        self.notify(
            "thread/tokenUsage/updated",
            {
                "threadId": self.thread.id,
                "turnId": self.id,
                "tokenUsage": shapes.thread_token_usage(self.thread.total_usage, last),
            },
        )
        self.notify("account/rateLimits/updated", {"rateLimits": shapes.RATE_LIMITS})

    def complete(
        self, status: str, error: shapes.Json | None = None, *, usage: bool = True
    ) -> None:
        """Close the turn with `status`; a failed turn announces its error first."""
        if self.completed:
            return
        self.completed = True
        thread_id = self.thread.id
        if error is not None and status == "failed":
            self.notify(
                "error",
                {"error": error, "willRetry": False, "threadId": thread_id, "turnId": self.id},
            )
        if usage:
            self.report_usage()
        if self.thread.active_turn is self:
            self.thread.active_turn = None
        self.thread.status = {"type": "idle"}
        self.notify("thread/status/changed", {"threadId": thread_id, "status": {"type": "idle"}})
        # Like the real server, a completed turn carries only its final agent message;
        # the thread's history (`thread/read`, `thread/resume`) keeps every item.
        final = self.final_message if status == "completed" else None
        completed_ms = now_ms()
        ended: dict[str, Any] = {
            "status": status,
            "error": error,
            "started_at": self.started_at,
            "completed_at": completed_ms // 1000,
            "duration_ms": completed_ms - self.started_ms,
        }
        turn = shapes.turn_object(
            self.id,
            items=[] if final is None else [final],
            items_view="notLoaded" if final is None else "summary",
            **ended,
        )
        self.thread.history.append(
            shapes.turn_object(self.id, items=list(self.items), items_view="full", **ended)
        )
        self.notify("turn/completed", {"threadId": thread_id, "turn": turn})
