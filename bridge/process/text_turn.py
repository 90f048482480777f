"""The one-shot text turn: spawn, start a thread and a turn, collect it, stop.

Server requests are answered as they arrive, approvals by the approval policy, others
with a JSON-RPC error: a turn never hangs waiting for a human.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bridge import errors
from bridge.events import EventLog
from bridge.models import ApprovalPolicy, TextTurnRequest, TextTurnResponse
from bridge.process.outcomes import request_key, rpc_failure
from bridge.process.peer import JsonRpcPeer, ProcessGone, RpcError, StdinFull

#: v2 approvals take the policy's name as their decision.
V2_APPROVALS = frozenset(
    {"item/commandExecution/requestApproval", "item/fileChange/requestApproval"}
)
#: Legacy approvals answer with a ReviewDecision.
LEGACY_APPROVALS = frozenset({"execCommandApproval", "applyPatchApproval"})
PERMISSIONS_APPROVAL = "item/permissions/requestApproval"
_LEGACY_DECISIONS: dict[str, Any] = {
    "accept": "approved",
    "acceptForSession": "approved_for_session",
    "decline": {"denied": {"rejection": "declined by the bridge's approval policy"}},
    "cancel": "abort",
}
#: After the thread reports idle, how long turn/completed may still take to arrive.
IDLE_GRACE_SECONDS = 2.0
#: How much of an `error` notification's message a timed-out text turn repeats.
MAX_ERROR_CHARS = 1000
#: What codex (0.169.0) says in an `error` notification, `willRetry: true`, when it cannot
#: connect to its model at all (no network, a closed port): it then waits for the network
#: without end, up to the turn's deadline (10 minutes by default). A text turn stops there.
OFFLINE_MARK = "waiting for network"


def approval_answer(method: str, params: Any, policy: ApprovalPolicy) -> Any | None:
    """The result that answers an approval request under ``policy``; None if not one."""
    if method in V2_APPROVALS:
        return {"decision": policy}
    if method in LEGACY_APPROVALS:
        return {"decision": _LEGACY_DECISIONS[policy]}
    if method == PERMISSIONS_APPROVAL:
        if policy in ("accept", "acceptForSession"):
            requested = params.get("permissions") if isinstance(params, dict) else None
            scope = "session" if policy == "acceptForSession" else "turn"
            return {"permissions": requested or {}, "scope": scope}
        return {"permissions": {}}
    return None


class TextTurn:
    """One text turn on its own process (see :meth:`run`)."""

    def __init__(
        self,
        peer: JsonRpcPeer,
        request: TextTurnRequest,
        event_buffer: int,
        event_buffer_bytes: int,
    ):
        self.peer = peer
        self.request = request
        self.policy: ApprovalPolicy = request.approval_policy
        self.events = EventLog(event_buffer, event_buffer_bytes) if request.include_events else None
        #: Bounds on what a turn keeps of the deltas (bytes) and of the approvals (entries).
        self.max_delta_bytes = event_buffer_bytes
        self.max_approvals = event_buffer
        self.delta_bytes = 0
        self.thread_id: str | None = None
        self.turn_id: str | None = None
        self.last_agent_text: str | None = None
        self.deltas: dict[str, list[str]] = {}
        self.usage: dict[str, Any] | None = None
        self.approvals: list[dict[str, str]] = []
        self.completed: dict[str, Any] | None = None
        self.done = asyncio.Event()
        self.idle = asyncio.Event()
        #: `turn/started` was seen: it can come (with the whole turn) before the bridge has
        #: read the turn id out of the `turn/start` response.
        self.started = False
        #: The message of the last `error` notification (codex retrying its model, say):
        #: what a turn that never completes tells of why.
        self.last_error: str | None = None
        #: When the app-server's first notification came (``time.monotonic()``).
        self.first_event_at: float | None = None
        #: Set when codex says it waits for the network to reach its model (OFFLINE_MARK).
        self.offline = asyncio.Event()
        peer.on_notification = self._on_notification
        peer.on_request = self._on_request

    def _on_notification(self, method: str, params: Any) -> None:
        if self.first_event_at is None:
            self.first_event_at = time.monotonic()
        if self.events is not None:
            self.events.append("notification", method, params)
        if not isinstance(params, dict):
            return
        if method == "item/agentMessage/delta":
            delta = str(params.get("delta", ""))
            self.delta_bytes += len(delta)
            if self.delta_bytes <= self.max_delta_bytes:
                # Only a fallback for an item/completed without text: bounded like the log.
                self.deltas.setdefault(str(params.get("itemId")), []).append(delta)
        elif method == "item/completed":
            item = params.get("item")
            if isinstance(item, dict) and item.get("type") == "agentMessage":
                text = item.get("text")
                if not isinstance(text, str):
                    text = "".join(self.deltas.get(str(item.get("id")), []))
                self.last_agent_text = text
        elif method == "thread/tokenUsage/updated":
            usage = params.get("tokenUsage")
            self.usage = usage if isinstance(usage, dict) else None
        elif method == "turn/completed":
            turn = params.get("turn")
            if isinstance(turn, dict) and self.turn_id in (None, turn.get("id")):
                self.completed = turn
                self.done.set()
        elif method == "turn/started":
            self.started = True
        elif method == "error":
            error = params.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            if isinstance(message, str) and message:
                self.last_error = message[:MAX_ERROR_CHARS]
                if params.get("willRetry") is True and OFFLINE_MARK in message.lower():
                    self.offline.set()
        elif method == "thread/status/changed":
            status = params.get("status")
            turn_begun = self.started or self.turn_id is not None
            if isinstance(status, dict) and status.get("type") == "idle" and turn_begun:
                self.idle.set()

    def _on_request(self, request_id: Any, method: str, params: Any) -> None:
        key = request_key(request_id)
        if self.events is not None:
            self.events.append("request", method, params, key)
        answer = approval_answer(method, params, self.policy)
        if answer is None:
            self.peer.refuse(
                request_id, f"{method} is not answered by a one-shot text turn; use a session"
            )
            return
        try:
            self.peer.respond(request_id, answer)
        except (ProcessGone, StdinFull):
            return
        if len(self.approvals) < self.max_approvals:
            self.approvals.append({"method": method, "requestKey": key, "decision": self.policy})

    async def run(self, call_timeout: float) -> TextTurnResponse:
        """Start the thread and the turn, then wait for ``turn/completed``.

        The caller bounds the whole with its deadline and stops the process.
        """
        request = self.request
        try:
            thread = await self.peer.call("thread/start", request.thread_params or {}, call_timeout)
            self.thread_id = _nested_id(thread, "thread")
            turn_params = {
                **(request.turn_params or {}),
                "threadId": self.thread_id,
                "input": [{"type": "text", "text": request.text}],
            }
            turn = await self.peer.call("turn/start", turn_params, call_timeout)
        except (RpcError, ProcessGone, StdinFull, TimeoutError) as exc:
            raise rpc_failure(exc, "Starting the turn") from None
        self.turn_id = _nested_id(turn, "turn")
        if self.completed is not None and self.completed.get("id") != self.turn_id:
            self.completed = None
            self.done.clear()
        await self._wait_for_completion()
        return self._response()

    async def _wait_for_completion(self) -> None:
        exited = asyncio.ensure_future(self.peer.wait())
        done = asyncio.ensure_future(self.done.wait())
        idle = asyncio.ensure_future(self.idle.wait())
        offline = asyncio.ensure_future(self.offline.wait())
        try:
            await asyncio.wait((exited, done, idle, offline), return_when=asyncio.FIRST_COMPLETED)
            if offline.done() and not done.done():
                raise errors.RestError(
                    504,
                    "timeout",
                    "The app-server cannot reach its model: it is waiting for the network "
                    "(no network, or nothing listening at the model provider's address). "
                    "The text turn was stopped rather than wait for its deadline.",
                    data={"reason": "model_unreachable", "lastError": self.last_error},
                )
            if not done.done() and idle.done() and not exited.done():
                # The thread says it is idle: give turn/completed a moment, no more.
                await asyncio.wait(
                    (exited, done), timeout=IDLE_GRACE_SECONDS, return_when=asyncio.FIRST_COMPLETED
                )
            if done.done():
                return
            if exited.done():
                raise rpc_failure(ProcessGone(exited.result()), "The turn")
            raise errors.of_kind(
                "timeout",
                "The thread went idle but the app-server never sent turn/completed.",
                data={"reason": "idle_without_completion"},
            )
        finally:
            for waiter in (exited, done, idle, offline):
                waiter.cancel()

    def _response(self) -> TextTurnResponse:
        turn = self.completed or {}
        text = self.last_agent_text
        if text is None:
            for item in turn.get("items") or []:
                if isinstance(item, dict) and item.get("type") == "agentMessage":
                    text = str(item.get("text", ""))
        status = turn.get("status")
        if status not in ("completed", "interrupted", "failed"):
            status = "failed"
        error = turn.get("error")
        payload: dict[str, Any] = {
            "text": text or "",
            "threadId": self.thread_id or "",
            "turnId": self.turn_id or "",
            "status": status,
            "error": error if isinstance(error, dict) else None,
            "usage": self.usage,
            "approvals": self.approvals,
        }
        if self.events is not None:
            payload["events"] = [e.to_wire() for e in self.events.read(0, len(self.events) + 1)]
        return TextTurnResponse.model_validate(payload)


def _nested_id(result: Any, key: str) -> str:
    if isinstance(result, dict):
        inner = result.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("id"), str):
            return str(inner["id"])
    raise errors.of_kind("protocol_error", f"The app-server's answer has no {key}.id.")
