"""The fake app-server: JSON-RPC over stdio, answering like `codex app-server` 0.169.0.

Without a script it is a friendly server: it initializes, starts threads and answers
every turn with a short deterministic message. A script (see `script.py`) overrides
method replies and turns step by step.

This module stays free of pydantic, YAML and Faker so that a script-less start is fast;
the step interpreter (`steps.py`) is imported only when a script is given.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import orjson

from fakes.app_server import protocol, report, shapes
from fakes.app_server.fast import FastStart, remote_control_line
from fakes.app_server.ids import IdFactory
from fakes.app_server.replies import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    Call,
    Reply,
    invalid,
    missing_field,
)
from fakes.app_server.stdio import Output, read_lines
from fakes.app_server.threads import ThreadMethods, check_input
from fakes.app_server.turns import ThreadState, TurnRun, Usage
from fakes.app_server.wire import (
    TOO_DEEP,
    Message,
    RequestId,
    Sink,
    encode,
    log,
    notification,
    open_wire_log,
    request_id_of,
    rpc_error,
    server_request,
    too_deep,
    use_virtual_clock,
)

if TYPE_CHECKING:
    from typing import BinaryIO

    from fakes.app_server.script import AppServerScript, MethodBehavior, ReplySpec, TurnScript
    from fakes.app_server.steps import StepRunner

__all__ = ["INTERNAL_ERROR", "INVALID_REQUEST", "AppServer", "Call", "Reply", "Sink", "serve"]


def default_reply_text(inputs: list[Any]) -> str:
    """What the fake answers when no script says otherwise."""
    said = " ".join(
        str(entry.get("text", ""))
        for entry in inputs
        if isinstance(entry, dict) and entry.get("type") == "text"
    )
    return f"Hello from fake-codex. You said: {said}"


def _matches(match: dict[str, Any] | None, params: Any) -> bool:
    """Whether `params` has every key of `match` with an equal value (shallow)."""
    if not match:
        return True
    if not isinstance(params, dict):
        return False
    return all(key in params and params[key] == value for key, value in match.items())


class AppServer:
    """One fake app-server process: a connection's state and its request handlers.

    The only class that knows the whole server. The steps (`steps.py`) and the thread
    methods (`threads.py`) see it through the narrow protocols of `host.py`; its report
    (`report.py`, only with `$FAKE_CODEX_REPORT`) is told what happens through a few
    hooks.
    """

    def __init__(
        self,
        script: AppServerScript | None,
        *,
        seed: int | None,
        version_output: str,
        resume: FastStart | None = None,
        ids: IdFactory | None = None,
    ) -> None:
        self.script = script
        self.seed = seed
        self.version = shapes.cli_version(version_output)
        # The protocol of the release it reports (protocol.py: the default's otherwise).
        self.protocol = protocol.profile(self.version)
        # Fits what the fake builds to that release's schema (conform.py).
        self.fit = protocol.fitting(self.version)
        self._known = frozenset(self.protocol.client_requests)
        self.out: Sink
        self.report: report.Report | None = None
        self.initialized = False
        self.client_info: dict[str, Any] = {}
        self._saw_initialized = False
        self._unread = b""
        if ids is not None:
            # One connection of a listening server (listen.py): the server owns the clock.
            self.ids = ids
        elif resume is None:
            use_virtual_clock(seed)
            self.ids = IdFactory(seed)
        else:
            # Where the synchronous fast start (fast.py) stopped: same ids, same clock.
            self.ids = resume.ids
            self.initialized = resume.initialized
            self.client_info = resume.client_info
            self._saw_initialized = resume.saw_initialized
            self._unread = resume.unread
        self.threads: dict[str, ThreadState] = {}
        self.pending: dict[RequestId, asyncio.Future[Message]] = {}
        self._stalled = False
        self._exit_on_eof = True
        self._next_request_id = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._exit_code: asyncio.Future[int]
        self._reader: asyncio.Task[None]
        self._behaviors: dict[str, list[MethodBehavior]] = {}
        self._turn_scripts: list[TurnScript] = []
        self._runner: StepRunner | None = None
        if script is not None:
            # Imported here: it pulls in pydantic, which a script-less start never needs.
            from fakes.app_server.steps import StepRunner

            self._runner = StepRunner(self, script)
            self._behaviors = {name: list(entries) for name, entries in script.methods.items()}
            self._turn_scripts = list(script.turns)
        self._builtins: dict[str, Callable[[Call], Reply]] = {
            "initialize": self._initialize,
            "turn/start": self._turn_start,
            "turn/interrupt": self._turn_interrupt,
            "model/list": lambda call: Reply(shapes.model_list_result()),
            **ThreadMethods(self).handlers(),
        }

    async def run(self) -> int:
        """Serve stdin/stdout until EOF, an `exit` step or the client going away."""
        self._exit_code = asyncio.get_running_loop().create_future()
        out = await Output.open(1, on_lost=lambda: self.exit(0))
        return await self.serve(out, read_lines(0, self._unread))

    async def serve(
        self, out: Sink, messages: AsyncIterator[bytes], report_name: str | None = None
    ) -> int:
        """Serve `messages` (one JSON-RPC message each), writing to `out`, until they end,
        an `exit` step or the client going away; returns the exit status."""
        if not hasattr(self, "_exit_code"):
            self._exit_code = asyncio.get_running_loop().create_future()
        self.report = report.attach(self.script, report_name)  # see report.py
        self.out = out if self.report is None else self.report.watch(out)
        self._reader = self.spawn(self._read_loop(messages))
        code = await self._exit_code
        for task in list(self._tasks):
            task.cancel()
        await self.out.close()
        return code

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` as a task the server cancels when it exits."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # A bug in the fake must not pass for a quiet server: report and fail.
            exc = task.exception()
            log(f"internal error: {exc!r}")
            self.exit(70)

    def exit(self, code: int) -> None:
        """Stop serving with exit status `code` (after flushing stdout)."""
        if self.report is not None:
            self.report.exiting(code)
        if not self._exit_code.done():
            self._exit_code.set_result(code)

    async def kill_self(self, signame: str) -> None:
        """Die by signal `signame`, after flushing what was already written."""
        if self.report is not None:
            self.report.killed(signame)
        await self.die(signame)

    async def die(self, signame: str) -> None:
        """How `kill_self` ends a stdio server: the process dies by the signal."""
        await self.out.close()
        os.kill(os.getpid(), signal.Signals[signame])
        self.exit(128 + signal.Signals[signame])

    async def end_process(self, code: int, signame: str | None) -> None:
        """The `exit` step with `server: true`: on stdio the process is the connection."""
        if signame is not None:
            await self.kill_self(signame)
        else:
            self.exit(code)

    async def stall(self, *, ignore_term: bool, exit_on_eof: bool) -> None:
        """Stop everything else and never do anything again."""
        if ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._stalled = True
        self._exit_on_eof = exit_on_eof
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current and task is not self._reader:
                task.cancel()
        # Announced only now, so that a client seeing it knows the stall is in force.
        log("stalled")
        await asyncio.get_running_loop().create_future()

    async def _read_loop(self, messages: AsyncIterator[bytes]) -> None:
        tee = open_wire_log(".in")
        try:
            await self._read_all(messages, tee)
        finally:
            if tee is not None:
                tee.close()

    async def _read_all(self, messages: AsyncIterator[bytes], tee: BinaryIO | None) -> None:
        async for line in messages:
            if tee is not None:
                tee.write(line + b"\n")
            if not self._stalled:
                if self.report is not None:
                    self.report.received(line)
                self._dispatch(line)
        if self._exit_on_eof:
            self.exit(0)
        else:
            log("stdin closed; stalled, so not exiting")

    def _dispatch(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            message = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            log(f"Failed to deserialize JSONRPCMessage: {exc}")
            return
        if too_deep(line, message):
            log(TOO_DEEP)
            return
        if not isinstance(message, dict):
            log("Failed to deserialize JSONRPCMessage: not an object")
            return
        request_id = request_id_of(message)
        method = message.get("method")
        if isinstance(method, str) and "id" not in message:
            self._on_notification(method)
        elif isinstance(method, str) and request_id is not None:
            self._on_request(message, method, request_id)
        elif (
            "method" not in message
            and request_id is not None
            and ("result" in message or "error" in message)
        ):
            self._on_response(request_id, message)
        else:
            log("Failed to deserialize JSONRPCMessage: not a request, response or notification")

    def _on_notification(self, method: str) -> None:
        if method != "initialized" or not self.initialized or self._saw_initialized:
            return
        self._saw_initialized = True
        if self._runner is not None:
            self.spawn(self._runner.run_initialized())

    def _on_response(self, request_id: RequestId, message: Message) -> None:
        if self.report is not None:
            awaited = request_id in self.pending
            self.report.response_received(request_id, message, awaited=awaited)
        future = self.pending.pop(request_id, None)
        if future is None or future.done():
            log(f"ignoring a response to unknown request id {request_id!r}")
            return
        future.set_result(message)

    def _on_request(self, message: Message, method: str, request_id: RequestId) -> None:
        call = Call(request_id, method, message.get("params"))
        if method not in self._known and method not in self._behaviors:
            unknown = self.script.unknown_methods if self.script else None
            if unknown is not None and self._runner is not None:
                self.spawn(self._runner.run_behavior(call, unknown))
                return
            known = ", ".join(f"`{name}`" for name in self.protocol.client_requests)
            message_text = f"Invalid request: unknown variant `{method}`, expected one of {known}"
            self.answer(call, invalid(message_text))
        elif "params" not in message:
            self.answer(call, invalid("Invalid request: missing field `params`"))
        elif not self.initialized and method != "initialize":
            self.answer(call, invalid("Not initialized"))
        elif method == "initialize" and self.initialized:
            self.answer(call, invalid("Already initialized"))
        elif (behavior := self._next_behavior(method, call.params)) is not None and self._runner:
            self.spawn(self._runner.run_behavior(call, behavior))
        else:
            self.answer(call, self.builtin_reply(call))

    def _next_behavior(self, method: str, params: Any) -> MethodBehavior | None:
        if method == "initialize":
            behavior = self.script.initialize if self.script else None
            # With a `match`, only for the clients it fits (the others get the built-in).
            if behavior is None or not _matches(behavior.match, params):
                return None
            if self.report is not None:
                self.report.used(method, behavior)
            return behavior
        entries = self._behaviors.get(method, [])
        # The first entry whose `match` fits; it is used up unless it repeats or is
        # the last one left (the last entry of a list keeps answering).
        for index, behavior in enumerate(entries):
            if _matches(behavior.match, params):
                if not behavior.repeat and len(entries) > 1:
                    del entries[index]
                if self.report is not None:
                    self.report.used(method, behavior)
                return behavior
        return None

    def _next_turn_script(self, params: Any) -> TurnScript | None:
        # The first turn whose `match` fits; used up unless it repeats.
        for index, script in enumerate(self._turn_scripts):
            if _matches(script.match, params):
                if not script.repeat:
                    del self._turn_scripts[index]
                if self.report is not None:
                    self.report.used(None, script)
                return script
        return None

    def answer(self, call: Call, reply: Reply) -> None:
        """Send `reply` to `call`, then run what must follow it."""
        data = encode(reply.message(call.id))
        call.answered = True
        if call.method == "initialize" and reply.error is None and not self.initialized:
            # Whoever produced it, a successful initialize reply is what initializes.
            self.initialized = True
            params = call.params if isinstance(call.params, dict) else {}
            client_info = params.get("clientInfo")
            self.client_info = client_info if isinstance(client_info, dict) else {}
            # Written with the reply, in one write: a client that reads whole chunks sees
            # both before it acts on the reply, rather than racing the second line.
            data += remote_control_line(self.ids, self.fit)
        self.out.write(data)
        if reply.after is not None:
            reply.after()

    def scripted_reply(self, call: Call, spec: ReplySpec) -> Reply:
        """The reply a script gives: its result or error, else the built-in reply."""
        if spec.error is not None:
            return Reply(error=spec.error.to_wire())
        if spec.has_result:
            return Reply(spec.result)
        if call.method not in self._builtins and isinstance(call.params, dict):
            return Reply(
                error=rpc_error(
                    INTERNAL_ERROR,
                    f"fake-codex has no built-in reply to `{call.method}`, and its script "
                    "gives it none: add `result:` or `error:` beside its `steps:`",
                )
            )
        return self.builtin_reply(call)

    def builtin_reply(self, call: Call) -> Reply:
        """The friendly default answer to `call`."""
        if not isinstance(call.params, dict):
            return invalid("Invalid request: invalid type: expected a map for `params`")
        handler = self._builtins.get(call.method)
        if handler is None:
            return Reply(
                error=rpc_error(
                    INTERNAL_ERROR,
                    f"fake-codex does not implement `{call.method}`; script it under `methods:`",
                )
            )
        reply = handler(call)
        if reply.error is None:
            reply.result = self.fit.result(call.method, reply.result)
        return reply

    def send_request(
        self,
        method: str,
        params: Any,
        request_id: RequestId | None = None,
        turn: TurnRun | None = None,
    ) -> tuple[RequestId, asyncio.Future[Message]]:
        """Send a server request; the future resolves with the client's response."""
        if request_id is None:
            request_id = self._next_request_id
            self._next_request_id += 1
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        if turn is not None:
            turn.pending_requests.add(request_id)
            future.add_done_callback(lambda _: turn.pending_requests.discard(request_id))
        self.out.send(server_request(request_id, method, params))
        if self.report is not None:
            self.report.request_sent(request_id, method)
        return request_id, future

    def resolved(self, thread_id: str | None, request_id: RequestId) -> None:
        """Announce that a server request is settled (only thread-scoped ones carry this)."""
        if thread_id is not None:
            params = {"threadId": thread_id, "requestId": request_id}
            self.out.send(
                notification(
                    "serverRequest/resolved",
                    self.fit.notification("serverRequest/resolved", params),
                )
            )

    def _initialize(self, call: Call) -> Reply:
        missing = missing_field(call.params, "clientInfo")
        if missing:
            return missing
        client_info = call.params["clientInfo"]
        info = client_info if isinstance(client_info, dict) else {}
        return Reply(shapes.initialize_result(info, self.version))

    def _turn_start(self, call: Call) -> Reply:
        params = call.params
        missing = missing_field(params, "threadId", "input")
        if missing:
            return missing
        inputs = params["input"]
        bad_input = check_input(inputs)
        if bad_input:
            return bad_input
        thread = self.threads.get(str(params["threadId"]))
        if thread is None or not thread.loaded:
            return invalid(f"thread not found: {params['threadId']}")
        active = thread.active_turn
        if active is not None:
            # Real behaviour: the input joins the turn in flight; no new turn starts.
            return Reply({"turn": active.snapshot()}, after=lambda: active.add_user_input(inputs))
        script = self._next_turn_script(params)
        usage = Usage()
        if script is not None and script.usage is not None:
            usage = Usage(**script.usage.model_dump())
        turn = TurnRun(self.out, self.ids, thread, usage, self.fit)
        thread.active_turn = turn

        def start() -> None:
            turn.task = self.spawn(self._run_turn(turn, script, inputs))

        return Reply({"turn": turn.snapshot()}, after=start)

    async def _run_turn(self, turn: TurnRun, script: TurnScript | None, inputs: list[Any]) -> None:
        turn.begin(inputs)
        if script is None or self._runner is None:
            await turn.agent_message(default_reply_text(inputs))
        else:
            await self._runner.run_turn(turn, script)
        if not turn.completed and not (script is not None and script.no_completion):
            turn.complete("completed")

    def _turn_interrupt(self, call: Call) -> Reply:
        missing = missing_field(call.params, "threadId", "turnId")
        if missing:
            return missing
        thread = self.threads.get(str(call.params["threadId"]))
        if thread is None:
            return invalid(f"thread not found: {call.params['threadId']}")
        turn = thread.active_turn
        if turn is None or turn.id != call.params["turnId"]:
            return invalid("no active turn to interrupt")
        return Reply({}, after=lambda: self.interrupt(turn))

    def interrupt(self, turn: TurnRun) -> None:
        """Stop `turn` now: it completes as interrupted, its server requests are dropped."""
        if self.report is not None:
            self.report.requests_dropped(list(turn.pending_requests))
        if turn.task is not None:
            turn.task.cancel()
        turn.complete("interrupted", usage=False)
        for request_id in list(turn.pending_requests):
            future = self.pending.pop(request_id, None)
            if future is not None:
                future.cancel()
            self.resolved(turn.thread.id, request_id)


def serve(
    script: AppServerScript | None,
    *,
    seed: int | None,
    version_output: str,
    resume: FastStart | None = None,
) -> int:
    """Run the fake on this process's stdio; returns the exit status.

    ``resume`` takes over from the synchronous fast start (see `fast.py`).
    """
    # Die from SIGINT like from SIGTERM, without a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    server = AppServer(script, seed=seed, version_output=version_output, resume=resume)
    return asyncio.run(server.run())
