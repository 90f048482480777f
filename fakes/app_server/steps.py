"""The step interpreter: what each script step puts on the wire.

Steps run in order inside a context: a client request being answered (method steps),
a turn (turn steps), or neither (`onInitialized`). String values in `notify`,
`request`, `respond*` and `raw` may use `${threadId}`, `${turnId}`, `${itemId}`,
`${requestId}` and `${cwd}`; a value that is exactly one placeholder keeps its type.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from string import Template
from typing import TYPE_CHECKING, Any

from fakes.app_server import script as s
from fakes.app_server import shapes
from fakes.app_server.invented import Invented
from fakes.app_server.server_requests import (
    RequestContext,
    command_approval_params,
    default_params,
    file_change_approval_params,
)
from fakes.app_server.turns import ThreadState, TurnRun
from fakes.app_server.wire import (
    Message,
    RequestId,
    advance_clock,
    encode,
    log,
    notification,
    now_ms,
    write_all,
)

if TYPE_CHECKING:
    from fakes.app_server.host import StepHost
    from fakes.app_server.replies import Call, Reply

_ACCEPTING = frozenset(
    {"accept", "acceptForSession", "acceptWithExecpolicyAmendment", "applyNetworkPolicyAmendment"}
)
_FLOOD_CHUNK = 1 << 20
_STDERR_CHUNK = 1 << 16
_FAILED_TURN_MESSAGE = (
    "We\u2019re currently experiencing high demand, which may cause temporary errors."
)


@dataclass(frozen=True)
class Pending:
    """A server request on the wire, awaiting the client's reply."""

    request_id: RequestId
    future: asyncio.Future[Message]


class TurnEnded(Exception):
    """The turn was cancelled by an approval reply; its remaining steps are skipped."""


@dataclass
class StepContext:
    """What the running steps refer to."""

    call: Call | None = None
    thread: ThreadState | None = None
    turn: TurnRun | None = None
    item_id: str | None = None
    request_id: RequestId | None = None

    def variables(self) -> dict[str, Any]:
        """Values of the `${name}` placeholders."""
        params = self.call.params if self.call and isinstance(self.call.params, dict) else {}
        thread_id = self.thread.id if self.thread else params.get("threadId", "")
        return {
            "threadId": thread_id,
            "turnId": self.turn.id if self.turn else "",
            "itemId": self.item_id or "",
            "requestId": self.request_id if self.request_id is not None else "",
            "cwd": self.thread.cwd if self.thread else os.getcwd(),
            "method": self.call.method if self.call else "",
        }

    def substitute(self, value: Any) -> Any:
        """`value` with placeholders filled in, recursively."""
        if isinstance(value, str):
            if "$" not in value:
                return value
            variables = self.variables()
            if value.startswith("${") and value.endswith("}") and value[2:-1] in variables:
                return variables[value[2:-1]]
            return Template(value).safe_substitute(variables)
        if isinstance(value, dict):
            return {key: self.substitute(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.substitute(item) for item in value]
        return value


def reply_key(reply: Message) -> str:
    """The `onReply` branch a client response selects.

    `error` for an error response; else the `decision` (or elicitation `action`), a
    decision object counting as its single key; else a permissions grant's `scope`
    (`turn`, `session`); else `result`.
    """
    if "error" in reply:
        return "error"
    result = reply.get("result")
    if isinstance(result, dict):
        for name in ("decision", "action"):
            value = result.get(name)
            if isinstance(value, str):
                return value
            if isinstance(value, dict) and len(value) == 1:
                return str(next(iter(value)))
        scope = result.get("scope")
        if "permissions" in result and isinstance(scope, str):
            return scope
    return "result"


def approval_status(key: str) -> str:
    """The item status an approval reply leads to, as the real server reports it."""
    if key in _ACCEPTING:
        return "completed"
    if key in ("decline", "cancel"):
        return "declined"
    return "failed"


class StepRunner:
    """Runs script steps against one server."""

    def __init__(self, server: StepHost, script: s.AppServerScript) -> None:
        self.server = server
        self.script = script
        self.invented = Invented(server.seed)
        self._children: list[subprocess.Popen[bytes]] = []
        self._handlers: dict[type[Any], Callable[[Any, StepContext], Awaitable[None]]] = {
            s.AgentMessageStep: self._agent_message,
            s.CommandApprovalStep: self._command_approval,
            s.FileChangeApprovalStep: self._file_change_approval,
            s.RequestStep: self._request,
            s.NotifyStep: self._notify,
            s.SleepStep: self._sleep,
            s.StderrStep: self._stderr,
            s.StderrFloodStep: self._stderr_flood,
            s.RawStep: self._raw,
            s.BigLineStep: self._big_line,
            s.FloodStep: self._flood,
            s.RespondStep: self._respond,
            s.RespondTwiceStep: self._respond_twice,
            s.RespondUnknownIdStep: self._respond_unknown_id,
            s.ExitStep: self._exit,
            s.StallStep: self._stall,
            s.SpawnChildStep: self._spawn_child,
            s.CompleteTurnStep: self._complete_turn,
        }

    async def run(self, steps: list[s.Step], ctx: StepContext) -> None:
        """Run `steps` in order."""
        for step in steps:
            await self._handlers[type(step)](step, ctx)
            await self.server.out.drain()

    async def run_initialized(self) -> None:
        """The `onInitialized` steps, run when the client sends `initialized`."""
        await self.run(self.script.on_initialized, StepContext())

    async def run_behavior(self, call: Call, behavior: s.MethodBehavior) -> None:
        """A scripted method: its steps, then its reply unless one was sent already."""
        params = call.params if isinstance(call.params, dict) else {}
        thread = self.server.threads.get(str(params.get("threadId")))
        ctx = StepContext(call=call, thread=thread, turn=thread.active_turn if thread else None)
        with contextlib.suppress(TurnEnded):
            await self.run(behavior.steps, ctx)
        if not call.answered and not behavior.no_reply:
            self.server.answer(call, self._substituted(ctx, call, behavior))

    def _substituted(self, ctx: StepContext, call: Call, spec: s.ReplySpec) -> Reply:
        """The scripted reply with placeholders filled in."""
        reply = self.server.scripted_reply(call, spec)
        if spec.has_result:
            reply.result = ctx.substitute(reply.result)
        elif spec.error is not None:
            reply.error = ctx.substitute(reply.error)
        return reply

    async def run_turn(self, turn: TurnRun, script: s.TurnScript) -> None:
        """A scripted turn's steps (the server frames them with the turn's envelope)."""
        with contextlib.suppress(TurnEnded):
            await self.run(script.steps, StepContext(thread=turn.thread, turn=turn))

    def _turn(self, ctx: StepContext, kind: str) -> TurnRun | None:
        if ctx.turn is None:
            log(f"`{kind}` needs a turn in progress; skipped")
        return ctx.turn

    def _request_context(self, ctx: StepContext, cwd: str | None = None) -> RequestContext:
        """The ids a new server request refers to, with a fresh item (call) id."""
        return RequestContext(
            thread_id=ctx.thread.id if ctx.thread else "",
            turn_id=ctx.turn.id if ctx.turn else "",
            item_id=self.server.ids.call_id(),
            cwd=cwd or (ctx.thread.cwd if ctx.thread else os.getcwd()),
            started_ms=now_ms(),
        )

    def _send(
        self, ctx: StepContext, method: str, params: Any, request_id: RequestId | None
    ) -> Pending:
        request_id, future = self.server.send_request(method, params, request_id, ctx.turn)
        ctx.request_id = request_id
        return Pending(request_id, future)

    async def _await_reply(self, ctx: StepContext, pending: Pending) -> str:
        """Wait for the client's reply and announce it settled; returns its branch key."""
        reply = await pending.future
        self.server.resolved(ctx.thread.id if ctx.thread else None, pending.request_id)
        return reply_key(reply)

    async def _settle(
        self, ctx: StepContext, pending: Pending, branches: dict[str, list[s.Step]] | None
    ) -> None:
        with contextlib.suppress(TurnEnded):
            await self._branch(branches, await self._await_reply(ctx, pending), ctx)

    async def _branch(
        self, branches: dict[str, list[s.Step]] | None, key: str, ctx: StepContext
    ) -> None:
        if branches:
            await self.run(branches.get(key) or branches.get("default") or [], ctx)

    async def _agent_message(self, step: s.AgentMessageStep, ctx: StepContext) -> None:
        turn = self._turn(ctx, step.KIND)
        if turn is None:
            return
        spec = step.agent_message
        text = spec.text if spec.text is not None else self.invented.sentences(spec.sentences)
        ctx.item_id = await turn.agent_message(
            text,
            item_id=spec.id,
            deltas=spec.deltas,
            delta_delay_ms=spec.delta_delay_ms,
            events=spec.events,
        )

    async def _command_approval(self, step: s.CommandApprovalStep, ctx: StepContext) -> None:
        turn = self._turn(ctx, step.KIND)
        if turn is None:
            return
        spec = step.command_approval
        command = spec.command or self.invented.command()
        request_ctx = self._request_context(ctx, spec.cwd)

        def item(status: str = "inProgress", **done: Any) -> shapes.Json:
            return shapes.command_execution_item(
                request_ctx.item_id,
                command=command,
                cwd=request_ctx.cwd,
                started_ms=request_ctx.started_ms,
                status=status,
                **done,
            )

        def finish(status: str) -> shapes.Json:
            if status != "completed":
                return item(status, completed_ms=now_ms())
            if spec.touch:
                _touch(spec.touch)
            if spec.output:
                turn.notify(
                    "item/commandExecution/outputDelta",
                    {
                        "threadId": turn.thread.id,
                        "turnId": turn.id,
                        "itemId": request_ctx.item_id,
                        "delta": spec.output,
                    },
                )
            return item(
                "completed" if spec.exit_code == 0 else "failed",
                output=spec.output,
                exit_code=spec.exit_code,
                completed_ms=now_ms(),
                process_id=self.server.ids.process_id(),
            )

        await self._approval(
            ctx,
            turn,
            request_ctx,
            item(),
            "item/commandExecution/requestApproval",
            command_approval_params(request_ctx, command, spec.reason),
            spec.id,
            step.on_reply,
            finish,
        )

    async def _file_change_approval(self, step: s.FileChangeApprovalStep, ctx: StepContext) -> None:
        turn = self._turn(ctx, step.KIND)
        if turn is None:
            return
        spec = step.file_change_approval
        request_ctx = self._request_context(ctx)
        path = spec.path or self.invented.path(request_ctx.cwd)
        changes = [{"path": path, "kind": {"type": spec.kind}, "diff": spec.content}]

        def finish(status: str) -> shapes.Json:
            if status == "completed" and spec.write:
                _apply_change(path, spec)
            return shapes.file_change_item(request_ctx.item_id, changes, status)

        await self._approval(
            ctx,
            turn,
            request_ctx,
            shapes.file_change_item(request_ctx.item_id, changes),
            "item/fileChange/requestApproval",
            file_change_approval_params(request_ctx, spec.reason),
            spec.id,
            step.on_reply,
            finish,
        )

    async def _approval(
        self,
        ctx: StepContext,
        turn: TurnRun,
        request_ctx: RequestContext,
        item: shapes.Json,
        method: str,
        params: shapes.Json,
        request_id: RequestId | None,
        branches: dict[str, list[s.Step]] | None,
        finish: Callable[[str], shapes.Json],
    ) -> None:
        """An item that waits on the client's approval, in the real server's order.

        `finish(status)` carries out the decision and returns the completed item. The
        tool call ended a model response, so its usage follows. After the reply's
        branch, `cancel` ends the turn as interrupted, as it does for real.
        """
        ctx.item_id = request_ctx.item_id
        params = self.server.fit.request(method, params)
        turn.set_status("waitingOnApproval")
        turn.item_started(item, request_ctx.started_ms)
        pending = self._send(ctx, method, params, request_id)
        await self.server.out.drain()
        key = await self._await_reply(ctx, pending)
        status = approval_status(key)
        if status == "completed":
            # Real order: the thread is active again, then the command runs.
            turn.set_status()
            turn.item_completed(finish(status))
        else:
            # Real order (mostly; the real server sometimes swaps these two).
            turn.item_completed(finish(status))
            turn.set_status()
        turn.report_usage()
        await self._branch(branches, key, ctx)
        if key == "cancel":
            turn.complete("interrupted", usage=False)
            raise TurnEnded

    async def _request(self, step: s.RequestStep, ctx: StepContext) -> None:
        spec = step.request
        defaults = default_params(spec.method, self._request_context(ctx))
        if defaults is not None:
            # What the fake makes up fits the release; what the script says is sent as said.
            defaults = self.server.fit.request(spec.method, defaults)
        params = {**(defaults or {}), **ctx.substitute(spec.params or {})}
        pending = self._send(ctx, spec.method, params, spec.id)
        if spec.wait:
            await self._branch(step.on_reply, await self._await_reply(ctx, pending), ctx)
        else:
            background = StepContext(ctx.call, ctx.thread, ctx.turn, ctx.item_id, ctx.request_id)
            self.server.spawn(self._settle(background, pending, step.on_reply))

    async def _notify(self, step: s.NotifyStep, ctx: StepContext) -> None:
        self.server.out.send(notification(step.notify.method, ctx.substitute(step.notify.params)))

    async def _sleep(self, step: s.SleepStep, ctx: StepContext) -> None:
        await asyncio.sleep(step.sleep / 1000)
        advance_clock(step.sleep)

    async def _stderr(self, step: s.StderrStep, ctx: StepContext) -> None:
        write_all(2, step.stderr.encode())

    async def _stderr_flood(self, step: s.StderrFloodStep, ctx: StepContext) -> None:
        # Blocking writes on purpose: a real server whose stderr is not drained blocks too.
        line = b"fake-codex: stderr flood " + b"." * 1000 + b"\n"
        chunk = line * (_STDERR_CHUNK // len(line))
        remaining = step.stderr_flood
        while remaining > 0:
            piece = chunk[:remaining]
            write_all(2, piece)
            remaining -= len(piece)

    async def _raw(self, step: s.RawStep, ctx: StepContext) -> None:
        text = str(ctx.substitute(step.raw))
        self.server.out.write(text.encode() + (b"\n" if step.newline else b""))

    async def _big_line(self, step: s.BigLineStep, ctx: StepContext) -> None:
        params = self._delta_params(ctx, "")
        message = notification("item/agentMessage/delta", params)
        padding = step.big_line - (len(encode(message)) - 1)
        params["delta"] = "x" * max(padding, 0)
        self.server.out.send(message)

    async def _flood(self, step: s.FloodStep, ctx: StepContext) -> None:
        spec = step.flood
        params = (
            ctx.substitute(spec.params) if spec.params is not None else self._delta_params(ctx, "x")
        )
        line = encode(notification(spec.method, params))
        per_chunk = max(1, _FLOOD_CHUNK // len(line))
        chunk = line * per_chunk
        full, rest = divmod(spec.count, per_chunk)
        for _ in range(full):
            self.server.out.write(chunk)
            await self.server.out.drain()
        self.server.out.write(line * rest)

    def _delta_params(self, ctx: StepContext, delta: str) -> dict[str, Any]:
        params = {
            "threadId": ctx.thread.id if ctx.thread else "",
            "turnId": ctx.turn.id if ctx.turn else "",
            "itemId": ctx.item_id or self.server.ids.message_id(),
            "delta": delta,
        }
        fitted: dict[str, Any] = self.server.fit.notification("item/agentMessage/delta", params)
        return fitted

    async def _respond(self, step: s.RespondStep, ctx: StepContext) -> None:
        self._reply(ctx, step.respond, copies=1)

    async def _respond_twice(self, step: s.RespondTwiceStep, ctx: StepContext) -> None:
        self._reply(ctx, step.respond_twice, copies=2)

    def _reply(self, ctx: StepContext, spec: s.ReplySpec, copies: int) -> None:
        call = ctx.call
        if call is None:
            log("`respond` has no client request to answer here; skipped")
            return
        reply = self._substituted(ctx, call, spec)
        for _ in range(copies - 1):
            self.server.out.send(reply.message(call.id))
        self.server.answer(call, reply)

    async def _respond_unknown_id(self, step: s.RespondUnknownIdStep, ctx: StepContext) -> None:
        spec = step.respond_unknown_id
        if spec.error is not None:
            message: Message = {"error": spec.error.to_wire(), "id": spec.id}
        else:
            message = {"id": spec.id, "result": spec.result if spec.has_result else {}}
        self.server.out.send(ctx.substitute(message))

    async def _exit(self, step: s.ExitStep, ctx: StepContext) -> None:
        if step.exit.server:
            await self.server.end_process(step.exit.code, step.exit.signal)
        elif step.exit.signal is not None:
            await self.server.kill_self(step.exit.signal)
        else:
            self.server.exit(step.exit.code)
        # Nothing after an exit may reach the wire; the server cancels this task.
        await asyncio.get_running_loop().create_future()

    async def _stall(self, step: s.StallStep, ctx: StepContext) -> None:
        await self.server.stall(
            ignore_term=step.stall.ignore_term, exit_on_eof=step.stall.exit_on_eof
        )

    async def _spawn_child(self, step: s.SpawnChildStep, ctx: StepContext) -> None:
        stdio = None if step.spawn_child.inherit_stdio else subprocess.DEVNULL
        # Plain Popen: it returns at once, and unlike an asyncio subprocess transport it
        # does not kill the child when the fake exits, which is the point of this step.
        child = subprocess.Popen(  # noqa: ASYNC220
            step.spawn_child.command, stdin=stdio, stdout=stdio, stderr=stdio
        )
        log(f"child pid {child.pid}")
        if step.spawn_child.wait:
            log(f"child pid {child.pid} exited: {await asyncio.to_thread(child.wait)}")
        else:
            self._children.append(child)

    async def _complete_turn(self, step: s.CompleteTurnStep, ctx: StepContext) -> None:
        turn = self._turn(ctx, step.KIND)
        if turn is None:
            return
        spec = step.complete_turn
        error = None
        if spec.error is not None:
            error = shapes.turn_error(
                spec.error.message, spec.error.codex_error_info, spec.error.additional_details
            )
        elif spec.status == "failed":
            error = shapes.turn_error(_FAILED_TURN_MESSAGE, "internalServerError")
        turn.complete(spec.status, error, usage=spec.status != "failed")


def _touch(path: str) -> None:
    """The harmless side effect of an accepted command: tests look for the file."""
    with open(path, "a", encoding="utf-8"):
        pass


def _apply_change(path: str, spec: s.FileChangeApproval) -> None:
    """Carry out an accepted file change."""
    if spec.kind == "delete":
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(spec.content)
