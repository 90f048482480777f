"""From a scenario to the answers its mock owes: the plan `scenarios.respx_mock` serves.

The steps are interpreted once, in order, without any process, the way the runner
would meet them: each request a step makes goes through the bridge's front
(`scenarios.mock_bridge.BridgeFront`); what the front rejects (401, 403, 404, 405, 413,
400) is answered as the bridge would, and everything else gets a response made from the
step's `expect:` on top of what the bridge plausibly sends (`scenarios.synth`). Every
response is then checked with the runner's own expectation code
(`scenarios.expectations`) and the bridge's OpenAPI document, so a plan that exists
satisfies its scenario; what cannot be satisfied fails here, at build time, naming the
step and its line (:class:`MockBuildError`).

Events: each session gets one log, built from what the `poll` and `read` steps expect
(`events`, `subsequence`, `through`, `count`, ...), with seq numbers by position. Where
a read allows other events in between, the notifications codex sends around a turn are
filled in (`thread/status/changed`, the user message item, `item/started`, token usage,
rate limits). Every event remembers the request that, in the scenario, came last before
it was first read (not counting GETs and 4xx answers, which change nothing): the mock
releases it only once the host has made that request.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from bridge.errors import RestError
from bridge.wire import dumps
from fakes.app_server.known_methods import KNOWN_METHODS
from fakes.app_server.script import (
    AppServerScript,
    BigLineStep,
    ExitStep,
    MethodBehavior,
    RawStep,
    RespondStep,
    StallStep,
)
from scenarios import format as f
from scenarios.expectations import (
    NO_JSON,
    Exchange,
    Problem,
    ReadGoal,
    StepRequest,
    as_text,
    default_status,
    error_problems,
    event_matcher,
    events_problems,
    http_problems,
    int_or_none,
    step_request,
    substitute,
)
from scenarios.format import LoadedScenario, ScenarioError
from scenarios.matching import MISSING, find_jsonpath, is_matcher, match, render
from scenarios.mock_bridge import (
    APP_SERVER_VERSION,
    JSON_CONTENT_TYPE,
    KIND_STATUS,
    SSE_HEADERS,
    STATUS_KIND,
    BridgeFront,
    Incoming,
    Operation,
    TurnContext,
    Verdict,
    call_result,
    compatibility_body,
    error_of_kind,
    event_params,
    health_body,
    session_created,
    sse_frame,
    text_turn_body,
)
from scenarios.openapi_check import ContractViolation, OpenApiChecker
from scenarios.synth import Schemas, SynthesisError, Values, conform, write_jsonpath

__all__ = ["Entry", "MockBuildError", "PlannedEvent", "ScenarioPlan", "SessionPlan", "plan"]

DEFAULT_BASE_URL = "http://bridge.test"


class MockBuildError(ScenarioError):
    """A scenario (or a step of it) that the mock cannot answer as the scenario expects."""


# -- what the mock owes ------------------------------------------------------------------


@dataclass
class Reply:
    """A complete response."""

    status: int
    headers: dict[str, str]
    body: bytes = b""

    @classmethod
    def of_json(cls, status: int, value: Any, headers: dict[str, str] | None = None) -> Reply:
        return cls(status, {"Content-Type": JSON_CONTENT_TYPE, **(headers or {})}, dumps(value))

    @classmethod
    def of_error(cls, error: RestError) -> Reply:
        return cls.of_json(error.status, error.payload(), error.headers)

    def json(self) -> Any:
        if not self.body:
            return NO_JSON
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return NO_JSON

    def exchange(self, method: str, path: str) -> Exchange:
        headers = CIMultiDictProxy(CIMultiDict(self.headers))
        text = self.body.decode("utf-8", "replace")
        return Exchange(method, path, self.status, headers, text, self.json())


class Release:
    """Set once the host made a request; events wait on it (threads and event loops)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        with self._lock:
            self._event.set()
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # a loop already closed
                loop.call_soon_threadsafe(event.set)

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    async def wait_async(self, timeout: float) -> bool:
        event = asyncio.Event()
        with self._lock:
            if self._event.is_set():
                return True
            self._waiters.append((asyncio.get_running_loop(), event))
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return self._event.is_set()
        return True


@dataclass(eq=False)
class Entry:
    """One answer a step owes one request (or, `layer`, one the bridge's front gives)."""

    index: int
    title: str
    where: str
    method: str
    path: str
    reply: Reply | None = None
    request_json: Any = NO_JSON
    layer: bool = False
    stream: StreamInfo | None = None
    served: int = 0
    release: Release = field(default_factory=Release)

    def describe(self) -> str:
        return f"step {self.index + 1} ({self.title}, {self.where})"

    def mark_served(self) -> None:
        self.served += 1
        self.release.set()


@dataclass(eq=False)
class StreamInfo:
    """What an SSE stream step opened: its session, where it starts, what it read."""

    session: SessionPlan
    start: int | None
    stop: int
    error: bool = False
    #: Where a stream without a position found the cursor, and where it last set it.
    cursor_from: int = 0
    cursor_set: int | None = None


@dataclass(eq=False)
class PlannedEvent:
    """An event of a session's log and the request that releases it."""

    event: dict[str, Any]
    trigger: Entry | None

    @property
    def seq(self) -> int:
        return int(self.event["seq"])

    def released(self) -> bool:
        return self.trigger is None or self.trigger.release.is_set()

    def frame(self) -> bytes:
        return sse_frame(self.event)


@dataclass
class ReadCheck:
    """A `poll`/`read` step: which events it read, so the end check sees them delivered."""

    index: int
    title: str
    where: str
    session: SessionPlan
    last_seq: int


@dataclass(eq=False)
class SessionPlan:
    """One session's log and what the steps did to it."""

    id: str
    ctx: TurnContext
    known: bool = True
    created_at: str = ""
    events: list[PlannedEvent] = field(default_factory=list)
    cursor: int = 0
    deleted: bool = False
    #: What a read past the end of the log answers (besides 409 after the exit event).
    end_error: Reply | None = None
    pending: list[str] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)
    next_request_id: int = 0
    behaviors: dict[str, list[MethodBehavior]] = field(default_factory=dict)
    in_turn: bool = False
    need_user: bool = False
    # Runtime state (the mock serving host requests).
    rt_cursor: int = 0
    delivered: int = 0
    idle_polls: int = 0

    @property
    def exit_seq(self) -> int | None:
        for planned in self.events:
            if planned.event["kind"] == "exit":
                return planned.seq
        return None

    @property
    def last_seq(self) -> int:
        return len(self.events)

    def after(self, position: int) -> PlannedEvent | None:
        return self.events[position] if 0 <= position < len(self.events) else None

    def summary(self) -> dict[str, Any]:
        exit_seq = self.exit_seq
        exit_code = self.events[exit_seq - 1].event["params"] if exit_seq else None
        return {
            "sessionId": self.id,
            "createdAt": self.created_at,
            "lastActivityAt": self.created_at,
            "state": "exited" if exit_seq else "running",
            "exitCode": exit_code.get("exitCode") if isinstance(exit_code, dict) else None,
            "pendingRequests": list(self.pending),
            "nextSeq": len(self.events) + 1,
            "bufferedEvents": len(self.events),
        }


@dataclass
class ScenarioPlan:
    """Everything a scenario's mock serves, built by :func:`plan`."""

    loaded: LoadedScenario
    base_url: str
    front: BridgeFront
    token: str | None
    variables: dict[str, Any]
    routes: dict[tuple[str, str], list[Entry]]
    sessions: dict[str, SessionPlan]
    reads: list[ReadCheck]
    #: Sessions whose events routes are served (long-poll and SSE).
    event_sessions: dict[str, SessionPlan]

    @property
    def name(self) -> str:
        return self.loaded.name


# -- building the plan ------------------------------------------------------------------


def plan(
    loaded: LoadedScenario, *, base_url: str = DEFAULT_BASE_URL, seed: int = 0
) -> ScenarioPlan:
    """Interpret `loaded`'s steps into the answers its mock owes; MockBuildError if it
    cannot."""
    return _Planner(loaded, base_url.rstrip("/"), seed).run()


class _Planner:
    def __init__(self, loaded: LoadedScenario, base_url: str, seed: int) -> None:
        scenario = loaded.scenario
        self.loaded = loaded
        self.scenario = scenario
        self.base_url = base_url
        spec = scenario.bridge
        self.token = spec.token
        self.limits = spec.rest_limits()
        self.values = Values(seed)
        self.front = BridgeFront.for_preset(
            spec.preset, token=spec.token, exempt_health=spec.exempt_health, limits=self.limits
        )
        self.schemas: Schemas = self.front.schemas
        self.checker = OpenApiChecker(self.front.document) if spec.contract_check else None
        self.script: AppServerScript | None = scenario.app_server
        self.variables: dict[str, Any] = {
            "base": base_url,
            "token": spec.token,
            "tmp": "/tmp/codex-bridge-mock",
        }
        self.routes: dict[tuple[str, str], list[Entry]] = {}
        self.sessions: dict[str, SessionPlan] = {}
        self.event_sessions: dict[str, SessionPlan] = {}
        self.reads: list[ReadCheck] = []
        self.streams: dict[str, StreamInfo] = {}
        self.background: dict[str, tuple[Entry, Verdict, Incoming]] = {}
        self.trigger: Entry | None = None
        self.index = 0
        self.step: Any = None
        self.sessionless_ctx = TurnContext(self.values)

    # -- errors and variables

    def where(self) -> str:
        """Where the current step is (file and line)."""
        return self.loaded.where(("steps", self.index))

    def fail(self, message: str, problems: list[Problem] | None = None) -> MockBuildError:
        title = self.step.title() if self.step is not None else "scenario"
        lines = [
            f"cannot mock scenario {self.loaded.name}: step {self.index + 1} ({title}, "
            f"{self.where()}):",
            f"  {message}",
        ]
        for problem in problems or []:
            lines.append(f"  ✗ {problem.message}")
            if problem.diff:
                lines += ["    " + line for line in problem.diff.splitlines()]
        return MockBuildError("\n".join(lines))

    def sub(self, value: Any) -> Any:
        return substitute(value, self._variable)

    def _variable(self, name: str) -> Any:
        if name not in self.variables:
            raise self.fail(f"${{{name}}} has no value here")
        return self.variables[name]

    # -- the run

    def run(self) -> ScenarioPlan:
        handlers: dict[type[Any], Callable[[Any], None]] = {
            f.HttpStep: self._request,
            f.CallStep: self._request,
            f.CreateSessionStep: self._request,
            f.ReplyStep: self._request,
            f.PollStep: self._poll,
            f.StreamStep: self._stream,
            f.ReadStep: self._read,
            f.CloseStep: self._close,
            f.AwaitStep: self._await,
        }
        for index, step in enumerate(self.scenario.steps):
            self.index, self.step = index, step
            try:
                handlers[type(self.step)](self.step)
            except SynthesisError as exc:
                raise self.fail(str(exc)) from None
        for entry, verdict, incoming in self.background.values():
            # Sent in the background and never awaited: what the bridge would answer.
            self.index = entry.index
            self.step = self.scenario.steps[entry.index]
            entry.reply = self._respond(verdict, incoming, None, "2xx")
        return ScenarioPlan(
            loaded=self.loaded,
            base_url=self.base_url,
            front=self.front,
            token=self.token,
            variables=self.variables,
            routes=self.routes,
            sessions=self.sessions,
            reads=self.reads,
            event_sessions=self.event_sessions,
        )

    # -- requests

    def _relative(self, path: str) -> str:
        if path.startswith(("http://", "https://")):
            if not path.startswith(self.base_url):
                raise self.fail(
                    f"{path} is not on the bridge ({self.base_url}); the mock answers the "
                    "bridge only"
                )
            path = path[len(self.base_url) :] or "/"
        return path

    def _incoming(self, request: StepRequest) -> Incoming:
        """`request` as the front sees it (the path relative to the bridge, decoded)."""
        raw_path, _, raw_query = self._relative(request.path).partition("?")
        headers, query, content = request.encoded(self.token)
        for pair in filter(None, raw_query.split("&")):
            key, _, value = pair.partition("=")
            query.setdefault(unquote(key), unquote(value))
        return Incoming(request.method.upper(), unquote(raw_path), headers, query, content or b"")

    def _entry(self, incoming: Incoming, *, request_json: Any = NO_JSON) -> Entry:
        entry = Entry(
            self.index,
            self.step.title(),
            self.where(),
            incoming.method,
            incoming.path,
            request_json=request_json,
        )
        self.routes.setdefault((incoming.method, incoming.path), []).append(entry)
        return entry

    def _answer(
        self,
        incoming: Incoming,
        expect: f.HttpExpect | None,
        default_status: Any,
        *,
        request_json: Any = NO_JSON,
        background: bool = False,
    ) -> tuple[Entry, Reply]:
        """Plan the answer to one request: the front's rejection, or a made-up response."""
        verdict = self.front.check(incoming)
        entry = self._entry(incoming, request_json=request_json)
        if verdict.error is not None:
            reply = Reply.of_error(verdict.error)
            entry.layer = True
            if not background:
                problems = self._http_problems(expect, reply, incoming, default_status)
                if problems:
                    raise self.fail(
                        f"the bridge rejects this request before any app-server is involved "
                        f"({verdict.error.status} {verdict.error.kind}: "
                        f"{verdict.error.message}), which the step does not expect",
                        problems,
                    )
            entry.reply = reply
            return entry, reply
        if background:
            self.background[self.step.background] = (entry, verdict, incoming)
            self._mutated(entry, None)
            return entry, Reply(0, {})
        reply = self._respond(verdict, incoming, expect, default_status)
        entry.reply = reply
        self._mutated(entry, reply)
        return entry, reply

    def _mutated(self, entry: Entry, reply: Reply | None) -> None:
        """Remember `entry` as the request later events wait for, if it changes anything."""
        if entry.method == "GET" or entry.layer:
            return
        if reply is not None and 400 <= reply.status < 500:
            return
        self.trigger = entry

    def _http_problems(
        self,
        expect: f.HttpExpect | None,
        reply: Reply,
        incoming: Incoming,
        default_status: Any,
    ) -> list[Problem]:
        problems = http_problems(
            expect, reply.exchange(incoming.method, incoming.path), default_status, self.sub
        )
        if not problems and self.checker is not None:
            content_type = reply.headers.get("Content-Type", "")
            body = None if content_type.startswith("text/event-stream") else reply.body
            try:
                self.checker.check(incoming.method, incoming.path, reply.status, content_type, body)
            except ContractViolation as exc:
                problems.append(Problem((), f"the made-up response breaks the contract: {exc}"))
        return problems

    # -- made-up responses

    def _choose_status(
        self, expect: f.HttpExpect | None, natural: int, operation: Operation | None
    ) -> int:
        expect = expect or f.HttpExpect()
        wanted = expect.status
        kind = self._expected_kind(expect)
        if isinstance(wanted, int):
            return wanted
        if isinstance(wanted, list) and wanted:
            if natural in wanted:
                return natural
            if kind in KIND_STATUS and KIND_STATUS[kind] in wanted:
                return KIND_STATUS[kind]
            return int(wanted[0])
        if isinstance(wanted, str):
            if wanted.isdigit():
                return int(wanted)
            first = wanted[0]
            if str(natural)[0] == first:
                return natural
            if kind in KIND_STATUS and str(KIND_STATUS[kind])[0] == first:
                return KIND_STATUS[kind]
            if first == "2":
                return operation.success_status if operation else 200
            return int(first) * 100
        if expect.error is not None:
            if natural >= 400 and (kind is None or natural == KIND_STATUS.get(kind, natural)):
                return natural
            if kind is not None:
                return KIND_STATUS.get(kind, 500)
            error = expect.error if isinstance(expect.error, dict) else {}
            return 502 if "code" in error else 500
        if 200 <= natural < 300:
            return natural
        return operation.success_status if operation else 200

    def _expected_kind(self, expect: f.HttpExpect) -> str | None:
        error = self.sub(expect.error)
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and isinstance(error.get("error"), str):
            return str(error["error"])
        for candidate in (expect.json_body, expect.json_subset):
            value = self.sub(candidate)
            if isinstance(value, dict) and isinstance(value.get("error"), str):
                return str(value["error"])
        return None

    def _respond(
        self,
        verdict: Verdict,
        incoming: Incoming,
        expect: f.HttpExpect | None,
        default_status: Any,
    ) -> Reply:
        """The answer to a request the front lets in: what the bridge would plausibly
        answer, changed to satisfy `expect`, then checked against it and the contract."""
        operation = verdict.operation
        reply = self._plausible(operation, verdict.params, incoming, verdict.body, expect)
        if expect is not None:
            reply = self._apply(reply, expect, operation)
        problems = self._http_problems(expect, reply, incoming, default_status)
        if problems:
            raise self.fail("no made-up response satisfies the step", problems)
        return reply

    def _plausible(
        self,
        operation: Operation | None,
        params: dict[str, str],
        incoming: Incoming,
        body: Any,
        expect: f.HttpExpect | None,
    ) -> Reply:
        """What the bridge would plausibly answer (before the step's expectations)."""
        natural = self._natural(operation, params, incoming, body)
        status = self._choose_status(expect, natural.status, operation)
        kind = self._expected_kind(expect or f.HttpExpect())
        natural_kind = None
        if natural.status >= 400:
            payload = natural.json()
            natural_kind = payload.get("error") if isinstance(payload, dict) else None
        if status == natural.status and (kind is None or kind == natural_kind):
            return natural
        if 200 <= status < 300:
            if operation is not None and 200 <= natural.status < 300:
                return Reply(status, natural.headers, natural.body)
            return Reply.of_json(status, self._filled(operation))
        if status == 204:
            return Reply(204, {})
        kind = kind or STATUS_KIND.get(status, "internal_error")
        allowed = self.front.route(incoming.method, incoming.path)[2]
        error = error_of_kind(
            kind,
            status=status if KIND_STATUS.get(kind) != status else None,
            session_id=params.get("sessionId"),
            request_key=params.get("requestKey"),
            method=incoming.method,
            allowed=allowed,
            limits=self.limits,
            rpc_error=self._scripted_error(params.get("method")),
        )
        return Reply.of_error(error)

    def _apply(self, reply: Reply, expect: f.HttpExpect, operation: Operation | None) -> Reply:
        body = reply.json()
        if reply.status >= 400:
            schema: Any = self.schemas.named("ErrorPayload")
        else:
            schema = operation.response_schema if operation else None
        base = MISSING if body is NO_JSON else body
        if expect.given("json_body"):
            base = conform(
                self.sub(expect.json_body), base, schema, self.schemas, self.values, subset=False
            )
        if expect.json_subset is not None:
            base = conform(
                self.sub(expect.json_subset), base, schema, self.schemas, self.values, subset=True
            )
        for expression, expected in (expect.json_path or {}).items():
            root = {} if base is MISSING else base
            base = write_jsonpath(
                root, self.sub(expression), self.sub(expected), schema, self.schemas, self.values
            )
        if expect.error is not None:
            wanted = self.sub(expect.error)
            wanted = {"error": wanted} if isinstance(wanted, str) else wanted
            base = conform(wanted, base, schema, self.schemas, self.values, subset=True)
        headers = dict(reply.headers)
        for name, expected in (expect.headers or {}).items():
            current = next(
                (value for key, value in headers.items() if key.lower() == name.lower()), MISSING
            )
            value = conform(
                self.sub(expected),
                current,
                {"type": "string"},
                self.schemas,
                self.values,
                subset=False,
            )
            headers = {key: item for key, item in headers.items() if key.lower() != name.lower()}
            if value is not MISSING:
                headers[name] = as_text(value)
        if base is MISSING:
            return Reply(reply.status, headers, reply.body)
        return Reply(reply.status, headers, dumps(base))

    # -- natural answers

    def _natural(
        self, operation: Operation | None, params: dict[str, str], incoming: Incoming, body: Any
    ) -> Reply:
        name = operation.operation_id if operation is not None else ""
        status = operation.success_status if operation is not None else 200
        request = incoming.json()
        request = request if isinstance(request, dict) else {}
        session = self.sessions.get(params.get("sessionId", ""))
        if name in ("health", "v1_health"):
            return Reply.of_json(status, health_body())
        if name == "compatibility":
            return Reply.of_json(status, compatibility_body(self._app_server_version()))
        if name == "openapi":
            return Reply.of_json(status, self.front.document)
        if name == "list_sessions":
            live = [s.summary() for s in self.sessions.values() if s.known and not s.deleted]
            return Reply.of_json(status, {"sessions": live})
        if name == "create_session":
            options = getattr(body, "options", None)
            return Reply.of_json(status, session_created(self.values, options))
        if name in ("delete_session", "reply_result", "reply_error", "session_call"):
            if session is None or session.deleted:
                error = error_of_kind("session_not_found", session_id=params["sessionId"])
                return Reply.of_error(error)
            if name == "delete_session":
                return Reply.of_json(
                    status, {"status": "deleted", "sessionId": params["sessionId"]}
                )
            if name == "session_call":
                if session.exit_seq is not None:
                    return Reply.of_error(error_of_kind("session_exited", session_id=session.id))
                return self._call_outcome(session, params["method"], request.get("params"), status)
            key = params["requestKey"]
            if key in session.answered:
                return Reply.of_error(error_of_kind("request_already_answered", request_key=key))
            if key not in session.pending:
                return Reply.of_error(error_of_kind("request_not_found", request_key=key))
            return Reply.of_json(status, {"status": "sent", "requestKey": key})
        if name == "call":
            return self._call_outcome(None, params["method"], request.get("params"), status)
        if name == "text_turn":
            return Reply.of_json(status, self._text_turn(request))
        return Reply.of_json(status, self._filled(operation))

    def _filled(self, operation: Operation | None) -> Any:
        """A made-up success body of `operation`, valid against its schema."""
        schema = operation.response_schema if operation is not None else None
        return conform({}, MISSING, schema, self.schemas, self.values, subset=True)

    def _app_server_version(self) -> str:
        output = self.script.version_output if self.script is not None else None
        return output.rsplit(" ", 1)[-1] if output else APP_SERVER_VERSION

    def _behaviors(self, session: SessionPlan | None) -> dict[str, list[MethodBehavior]]:
        if self.script is None:
            return {}
        if session is None:  # a sessionless call: a fresh process, the script from its start
            return {name: list(entries) for name, entries in self.script.methods.items()}
        if not session.behaviors:
            session.behaviors = {n: list(e) for n, e in self.script.methods.items()}
        return session.behaviors

    def _next_behavior(
        self, session: SessionPlan | None, method: str, params: Any
    ) -> MethodBehavior | None:
        entries = self._behaviors(session).get(method, [])
        for index, behavior in enumerate(entries):
            wanted = behavior.match or {}
            if all(isinstance(params, dict) and params.get(k) == v for k, v in wanted.items()):
                if not behavior.repeat and len(entries) > 1:
                    del entries[index]
                return behavior
        unknown = self.script.unknown_methods if self.script is not None else None
        return unknown if method not in KNOWN_METHODS else None

    def _scripted_error(self, method: str | None) -> dict[str, Any]:
        if method is None or self.script is None:
            return {}
        for behavior in self.script.methods.get(method, []):
            if behavior.error is not None:
                return behavior.error.to_wire()
        if method not in KNOWN_METHODS:
            return {"code": -32600, "message": f"Invalid request: unknown variant `{method}`"}
        return {}

    def _call_outcome(
        self, session: SessionPlan | None, method: str, params: Any, status: int
    ) -> Reply:
        """What fake-codex, as scripted, would make the bridge answer a raw call."""
        ctx = session.ctx if session is not None else self.sessionless_ctx
        behavior = self._next_behavior(session, method, params)
        if behavior is not None:
            if behavior.no_reply:
                return Reply.of_error(error_of_kind("timeout"))
            for step in behavior.steps:
                if isinstance(step, RespondStep):
                    if step.respond.error is not None:
                        return Reply.of_error(
                            error_of_kind(
                                "app_server_error", rpc_error=step.respond.error.to_wire()
                            )
                        )
                    if step.respond.has_result:
                        return Reply.of_json(status, {"result": step.respond.result})
                    break
                if isinstance(step, ExitStep):
                    exit_params = {"exitCode": step.exit.code, "signal": step.exit.signal}
                    return Reply.of_error(
                        error_of_kind("app_server_exited", exit_params=exit_params)
                    )
                if isinstance(step, RawStep | BigLineStep):
                    return Reply.of_error(error_of_kind("protocol_error"))
                if isinstance(step, StallStep):
                    return Reply.of_error(error_of_kind("timeout"))
            if behavior.error is not None:
                error = behavior.error.to_wire()
                kind = "app_server_overloaded" if error["code"] == -32001 else "app_server_error"
                return Reply.of_error(error_of_kind(kind, rpc_error=error))
            if behavior.has_result:
                return Reply.of_json(status, {"result": behavior.result})
        if method not in KNOWN_METHODS and not (
            self.script is not None and method in self.script.methods
        ):
            rpc = self._scripted_error(method)
            return Reply.of_error(error_of_kind("app_server_error", rpc_error=rpc))
        return Reply.of_json(status, {"result": call_result(method, params, ctx)})

    def _text_turn(self, request: dict[str, Any]) -> dict[str, Any]:
        from fakes.app_server.server import default_reply_text

        text = default_reply_text([{"type": "text", "text": request.get("text", "")}])
        if self.script is not None and self.script.turns:
            for step in self.script.turns[0].steps:
                message = getattr(step, "agent_message", None)
                if message is not None and message.text:
                    text = message.text
        ctx = TurnContext(self.values)
        body = text_turn_body(text, ctx)
        if request.get("includeEvents"):
            scratch = SessionPlan("text-turn", ctx, known=False)
            specs = [
                {"method": "thread/started"},
                {"method": "turn/started"},
                {
                    "method": "item/completed",
                    "params": {"item": {"type": "agentMessage", "text": text}},
                },
                {"method": "turn/completed"},
            ]
            events = self._make_events(scratch, specs, companions=True, through=None, absent=[])
            body["events"] = [planned.event for planned in events]
        return body

    # -- steps: requests

    def _request(self, step: Any) -> None:
        """An `http`, `call`, `createSession` or `reply` step: one request, one answer."""
        request = step_request(step, self.sub)
        incoming = self._incoming(request)
        on_events = isinstance(step, f.HttpStep) and self._events_path(incoming.path) is not None
        if on_events and self.front.check(incoming).error is None:
            raise self.fail(
                "an `http` step on an events route: read events with `poll` or `stream` "
                "steps (the mock serves events from the session's log)"
            )
        background = getattr(step, "background", None) is not None
        entry, reply = self._answer(
            incoming,
            None if background else step.expect,
            default_status(step),
            request_json=request.json_body,
            background=background,
        )
        if background:
            return
        self._after(entry, reply, incoming)
        payload = reply.json()
        created = isinstance(step, f.CreateSessionStep) and reply.status == 201
        if created and isinstance(payload, dict):
            self.variables[step.create_session.as_] = payload.get("sessionId")
        self._capture(step, payload, reply.headers)

    def _await(self, step: f.AwaitStep) -> None:
        name = step.await_.request
        if name not in self.background:
            raise self.fail(f"no request {name!r} is pending")
        entry, verdict, incoming = self.background.pop(name)
        reply = self._respond(verdict, incoming, step.expect, "2xx")
        entry.reply = reply
        self._after(entry, reply, incoming)
        self._capture(step, reply.json(), reply.headers)

    def _after(self, entry: Entry, reply: Reply, incoming: Incoming) -> None:
        """What a planned answer changes: sessions created, deleted, requests answered."""
        operation, params, _ = self.front.route(incoming.method, incoming.path)
        if operation is None or not 200 <= reply.status < 300:
            return
        payload = reply.json()
        name = operation.operation_id
        session = self.sessions.get(params.get("sessionId", ""))
        if name == "create_session" and isinstance(payload, dict):
            session_id = str(payload.get("sessionId"))
            self.sessions[session_id] = SessionPlan(
                session_id, TurnContext(self.values), created_at=str(payload.get("createdAt"))
            )
        elif name == "delete_session" and session is not None:
            session.deleted = True
        elif name in ("reply_result", "reply_error") and session is not None:
            key = params["requestKey"]
            if key in session.pending:
                session.pending.remove(key)
            session.answered.add(key)
        elif name == "session_call" and session is not None and isinstance(payload, dict):
            result = payload.get("result")
            if isinstance(result, dict):
                thread = result.get("thread")
                turn = result.get("turn")
                if isinstance(thread, dict) and isinstance(thread.get("id"), str):
                    session.ctx.thread_id = thread["id"]
                if isinstance(turn, dict) and isinstance(turn.get("id"), str):
                    session.ctx.turn_id = turn["id"]

    def _capture(self, step: Any, document: Any, headers: dict[str, str] | None) -> None:
        """Set what `step` captures from a response (its JSON body and `headers`) or, with
        `headers` None, from the last event a read got (NO_JSON: none)."""
        for name, spec in step.capture.items():
            if isinstance(spec, dict) and "header" in spec:
                if headers is None:
                    raise self.fail(f"capture {name}: events have no headers")
                wanted = spec["header"].lower()
                value = next((v for k, v in headers.items() if k.lower() == wanted), None)
                if value is None:
                    raise self.fail(
                        f"capture {name}: the response has no {spec['header']} header; give it "
                        "in `expect.headers`"
                    )
                self.variables[name] = value
                continue
            expression = spec["jsonPath"] if isinstance(spec, dict) else spec
            found = find_jsonpath(expression, document) if document is not NO_JSON else []
            if not found:
                shown = render(document if document is not NO_JSON else None, 300)
                if headers is None:
                    where, advice = f"the last event read ({shown})", "the step's expectations"
                else:
                    where = f"the response {shown}"
                    advice = "`expect` (e.g. `jsonPath: {" + expression + ": {$type: string}}`)"
                raise self.fail(
                    f"capture {name}: {expression} finds nothing in {where}; say what is there "
                    f"in {advice}"
                )
            self.variables[name] = found[0] if len(found) == 1 else found

    # -- sessions and events

    def _events_path(self, path: str) -> tuple[str, bool] | None:
        """(sessionId, is_stream) when `path` is a session's events route."""
        prefix = "/v1/sessions/"
        if not path.startswith(prefix):
            return None
        rest = path[len(prefix) :]
        session_id, _, tail = rest.partition("/")
        if tail in ("events", "events/stream") and session_id:
            return session_id, tail == "events/stream"
        return None

    def _session(self, session_id: str) -> SessionPlan:
        session = self.sessions.get(session_id)
        if session is None:
            session = SessionPlan(session_id, TurnContext(self.values), known=False)
            self.sessions[session_id] = session
        self.event_sessions[session_id] = session
        return session

    def _poll(self, step: f.PollStep) -> None:
        spec = step.poll
        expect = step.expect or f.EventsExpect()
        session_id = as_text(self.sub(spec.session))
        path = f"/v1/sessions/{session_id}/events"
        query = {"waitMs": spec.wait_ms}
        incoming = self._incoming(StepRequest("GET", path, self.sub(spec.auth), query=query))
        verdict = self.front.check(incoming)
        session = self._session(session_id)
        if verdict.error is not None:
            reply = Reply.of_error(verdict.error)
            entry = self._entry(incoming)
            entry.layer, entry.reply = True, reply
            if expect.error is None:
                raise self.fail(
                    f"the bridge rejects this long-poll ({verdict.error.status} "
                    f"{verdict.error.kind}: {verdict.error.message})"
                )
            self._check_read_error(expect, reply, incoming)
            return
        after = int_or_none(self.sub(spec.after))
        start = after if after is not None else session.cursor
        goal = ReadGoal.of(spec, self.sub)
        if expect.error is not None:
            self._poll_error(session, start, expect, incoming)
            return
        events = self._read_events(session, start, goal, False, expect)
        if after is None:
            session.cursor = start + len(events)
        self._read_done(step, session, events)

    def _poll_error(
        self, session: SessionPlan, start: int, expect: f.EventsExpect, incoming: Incoming
    ) -> None:
        """A long-poll expected to fail: reads past the log answer the error."""
        if session.deleted:
            # Deleted means gone: every new request on the id is a 404.
            reply = Reply.of_error(error_of_kind("session_not_found", session_id=session.id))
            self._check_read_error(expect, reply, incoming)
            return
        exit_seq = session.exit_seq
        if start < session.last_seq:
            raise self.fail(
                f"the long-poll is expected to fail, but the session's log still holds events "
                f"#{start + 1}..#{session.last_seq} for it to read"
            )
        if exit_seq is not None:
            reply = Reply.of_error(error_of_kind("session_exited", session_id=session.id))
        else:
            wanted = self.sub(expect.error)
            wanted = {"error": wanted} if isinstance(wanted, str) else wanted
            kind = wanted.get("error") if isinstance(wanted.get("error"), str) else None
            error = error_of_kind(kind or "session_not_found", session_id=session.id)
            schema = self.schemas.named("ErrorPayload")
            payload = conform(
                wanted, error.payload(), schema, self.schemas, self.values, subset=True
            )
            reply = Reply.of_json(error.status, payload, error.headers)
            session.end_error = reply
        self._check_read_error(expect, reply, incoming)

    def _check_read_error(self, expect: f.EventsExpect, reply: Reply, incoming: Incoming) -> None:
        problems = error_problems(self.sub(expect.error), reply.exchange("GET", incoming.path))
        if problems:
            raise self.fail("the long-poll's error does not match", problems)

    def _stream(self, step: f.StreamStep) -> None:
        spec = step.stream
        request = step_request(step, self.sub)
        incoming = self._incoming(request)
        if spec.session is not None:
            session_id = as_text(self.sub(spec.session))
        else:
            found = self._events_path(incoming.path)
            if found is None or not found[1]:
                raise self.fail(
                    f"a stream of {self._relative(request.path)}: the mock streams only a "
                    "session's `/v1/sessions/{id}/events/stream`"
                )
            session_id = found[0]
        session = self._session(session_id)
        verdict = self.front.check(incoming)
        entry = self._entry(incoming)
        if verdict.error is not None:
            entry.layer, entry.reply = True, Reply.of_error(verdict.error)
            entry.stream = StreamInfo(session, None, 0, error=True)
            problems = self._http_problems(step.expect, entry.reply, incoming, 200)
            if problems:
                raise self.fail(
                    "the bridge rejects this stream, which the step does not expect", problems
                )
            return
        position = None
        last_id = incoming.header("Last-Event-ID")
        if last_id is not None and last_id.strip():
            position = int(last_id.strip())
        elif "after" in incoming.query:
            position = int(incoming.query["after"])
        expect = step.expect
        wants_error = expect is not None and (
            expect.error is not None or (isinstance(expect.status, int) and expect.status != 200)
        )
        if wants_error:
            entry.reply = self._respond(verdict, incoming, expect, 200)
            entry.stream = StreamInfo(session, position, 0, error=True)
            return
        entry.reply = Reply(200, dict(SSE_HEADERS))
        problems = self._http_problems(expect, entry.reply, incoming, 200)
        if problems:
            raise self.fail("the stream's response does not match", problems)
        start = position if position is not None else session.cursor
        info = StreamInfo(session, position, start, cursor_from=session.cursor)
        entry.stream = info
        self.streams[spec.as_] = info

    def _read(self, step: f.ReadStep) -> None:
        spec = step.read
        expect = step.expect or f.EventsExpect()
        info = self.streams.get(spec.stream)
        if info is None:
            raise self.fail(f"stream {spec.stream!r} is not open")
        session = info.session
        goal = ReadGoal.of(spec, self.sub)
        to_end = spec.to_end or bool(expect.ended)
        if expect.error is not None:
            raise self.fail("`error` applies to `poll` only")
        exit_seq = session.exit_seq
        if exit_seq is not None and info.stop >= exit_seq:
            events: list[dict[str, Any]] = []
            if goal.want not in (None, 0) or goal.through is not None:
                raise self.fail("the stream already ended (after the session's exit event)")
        else:
            events = self._read_events(session, info.stop, goal, to_end, expect)
        if info.start is None and events:
            session.cursor = info.cursor_set = info.stop + len(events)
        info.stop += len(events)
        self._read_done(step, session, events)

    def _close(self, step: f.CloseStep) -> None:
        info = self.streams.pop(step.close, None)
        if info is None or info.cursor_set is None:
            return
        # A stream cut short before the exit event gives the cursor back (the bridge's
        # SessionStream.close), unless another reader moved it since.
        session = info.session
        ended = session.exit_seq is not None and info.stop >= session.exit_seq
        if not ended and session.cursor == info.cursor_set:
            session.cursor = info.cursor_from

    def _read_done(self, step: Any, session: SessionPlan, events: list[dict[str, Any]]) -> None:
        """What a `poll` or `read` got: for the end check to see delivered, and to capture."""
        if events:
            last = int(events[-1]["seq"])
            self.reads.append(ReadCheck(self.index, step.title(), self.where(), session, last))
        self._capture(step, events[-1] if events else NO_JSON, None)

    # -- the events a read gets

    def _read_events(
        self,
        session: SessionPlan,
        start: int,
        goal: ReadGoal,
        to_end: bool,
        expect: f.EventsExpect,
    ) -> list[dict[str, Any]]:
        """The events a read from `start` gets; new ones are added to the session's log."""
        existing: list[dict[str, Any]] = []
        done = goal.want == 0
        for planned in session.events[start:]:
            if done:
                break
            existing.append(planned.event)
            done = goal.reached(existing) or planned.event.get("kind") == "exit"
        if done:
            problems = self._read_problems(existing, goal, to_end, expect)
            if problems:
                raise self.fail(
                    f"the read gets events #{start + 1}.. that earlier steps put in the log, "
                    "and they do not satisfy it",
                    problems,
                )
            return existing
        absent = [event_matcher(self.sub(item)) for item in expect.absent or []]
        problems = []
        for companions in (True, False):
            scratch = _Scratch(session)
            specs = self._specs(existing, goal, to_end, expect)
            made = self._make_events(
                session, specs, companions=companions, through=goal.through, absent=absent
            )
            candidate = existing + [planned.event for planned in made]
            problems = self._read_problems(candidate, goal, to_end, expect)
            if not problems:
                for planned in made:
                    planned.trigger = self.trigger
                session.events.extend(made)
                return candidate
            scratch.rollback()
        raise self.fail("no events satisfy the read", problems)

    def _specs(
        self,
        existing: list[dict[str, Any]],
        goal: ReadGoal,
        to_end: bool,
        expect: f.EventsExpect,
    ) -> list[Any]:
        """What the new events must match, in order (matchers, subset semantics)."""
        done = len(existing)
        specs: list[Any] = []
        if expect.events is not None:
            specs = [event_matcher(self.sub(item)) for item in expect.events][done:]
        elif expect.methods is not None or expect.kinds is not None or isinstance(expect.ids, list):
            count = max(
                len(expect.methods or []),
                len(expect.kinds or []),
                len(expect.ids) if isinstance(expect.ids, list) else 0,
            )
            for position in range(done, count):
                spec: dict[str, Any] = {}
                if expect.methods is not None and position < len(expect.methods):
                    spec["method"] = expect.methods[position]
                if expect.kinds is not None and position < len(expect.kinds):
                    spec["kind"] = expect.kinds[position]
                specs.append(spec)
        elif expect.subsequence is not None:
            items = [event_matcher(self.sub(item)) for item in expect.subsequence]
            position = 0
            for event in existing:
                if position < len(items) and not match(items[position], event, subset=True):
                    position += 1
            specs = items[position:]
        total = goal.want if goal.want is not None else expect.count
        if total is not None:
            while done + len(specs) < total:
                specs.append(_FILLER)
        through = goal.through
        if through is not None and (
            not specs or specs[-1] is _FILLER or not _implies(specs[-1], through)
        ):
            if specs and specs[-1] is _FILLER:
                specs[-1] = through
            else:
                specs.append(through)
        if to_end and not (
            specs and isinstance(specs[-1], dict) and specs[-1].get("kind") == "exit"
        ):
            if specs and isinstance(specs[-1], dict) and _could_be_exit(specs[-1]):
                specs[-1] = {**specs[-1], "kind": "exit", "method": None}
            else:
                specs.append({"kind": "exit", "method": None})
        return specs

    def _read_problems(
        self, read: list[dict[str, Any]], goal: ReadGoal, to_end: bool, expect: f.EventsExpect
    ) -> list[Problem]:
        through, want = goal.through, goal.want
        problems: list[Problem] = []
        for event in read[:-1]:
            if through is not None and not match(through, event, subset=True):
                problems.append(
                    Problem(("through",), f"the read would stop early, at #{event['seq']}")
                )
                break
            if event.get("kind") == "exit":
                problems.append(Problem((), f"the exit event #{event['seq']} ends the read early"))
                break
        if through is not None and (not read or match(through, read[-1], subset=True)):
            problems.append(Problem(("through",), f"no event matches {render(through)}"))
        if want is not None and len(read) != want:
            problems.append(Problem(("count",), f"the read gets {len(read)} events, not {want}"))
        if to_end and (not read or read[-1].get("kind") != "exit"):
            problems.append(Problem(("toEnd",), "the read does not end with the exit event"))
        return problems + events_problems(expect, read, sub=self.sub)

    def _make_events(
        self,
        session: SessionPlan,
        specs: list[Any],
        *,
        companions: bool,
        through: Any,
        absent: list[Any],
    ) -> list[PlannedEvent]:
        """New events for `specs`, appended to `session`'s numbering (not to its log)."""
        made: list[PlannedEvent] = []

        def add(spec: Any, companion: bool = False) -> None:
            event = self._event(session, spec, len(session.events) + len(made) + 1)
            if companion and (
                (through is not None and not match(through, event, subset=True))
                or any(not match(item, event, subset=True) for item in absent)
            ):
                return
            made.append(PlannedEvent(event, None))

        for spec in specs:
            method, item_type = _spec_method(spec)
            if companions:
                for extra in self._companions(session, made, method, item_type):
                    add(extra, companion=True)
            add(spec)
            self._after_event(session, method, item_type)
        return made

    def _companions(
        self,
        session: SessionPlan,
        made: list[PlannedEvent],
        method: str | None,
        item_type: str | None,
    ) -> list[dict[str, Any]]:
        """The notifications codex sends before `method` that the scenario leaves out."""
        previous = (
            made[-1].event if made else (session.events[-1].event if session.events else None)
        )
        previous_method = previous.get("method") if previous else None
        extra: list[dict[str, Any]] = []
        if previous is None and session.known:
            # What codex announces right after `initialize`: every session's first event.
            extra.append({"method": "remoteControl/status/changed"})
        if method == "turn/started":
            if previous_method != "thread/status/changed":
                extra.append({"method": "thread/status/changed"})
            return extra
        turn_event = method in _TURN_METHODS
        if session.in_turn and session.need_user and turn_event and item_type != "userMessage":
            extra.append({"method": "item/started", "_item": "userMessage"})
            extra.append({"method": "item/completed", "_item": "userMessage"})
            session.need_user = False
        opening = method == "item/agentMessage/delta" or (
            method == "item/completed" and item_type == "agentMessage"
        )
        if opening and session.ctx.agent_item is None:
            extra.append({"method": "item/started", "_item": "agentMessage", "_open": True})
        if method == "turn/completed":
            for name in ("thread/tokenUsage/updated", "account/rateLimits/updated"):
                extra.append({"method": name})
            extra.append({"method": "thread/status/changed", "_idle": True})
        return extra

    def _after_event(self, session: SessionPlan, method: str | None, item_type: str | None) -> None:
        if method == "turn/started":
            session.in_turn, session.need_user = True, True
            session.ctx.agent_item = None
        elif method in ("item/started", "item/completed") and item_type == "userMessage":
            session.need_user = False
        elif method == "item/completed" and item_type == "agentMessage":
            session.ctx.agent_item = None
        elif method == "turn/completed":
            session.in_turn = session.need_user = False

    def _event(self, session: SessionPlan, spec: Any, seq: int) -> dict[str, Any]:
        """One event matching `spec` (a subset matcher), at `seq`."""
        ctx = session.ctx
        if spec is _FILLER:
            spec = {"method": "item/agentMessage/delta"}
        hints = (
            {k: v for k, v in spec.items() if k.startswith("_")} if isinstance(spec, dict) else {}
        )
        matcher = (
            {k: v for k, v in spec.items() if not k.startswith("_")}
            if isinstance(spec, dict)
            else spec
        )
        method, item_type = _spec_method(matcher)
        item_type = hints.get("_item", item_type)
        kind = matcher.get("kind") if isinstance(matcher, dict) else None
        if not isinstance(kind, str):
            kind = "notification"
            if isinstance(matcher, dict) and matcher.get("requestKey") not in (None, MISSING):
                kind = "request"
            if isinstance(matcher, dict) and "method" in matcher and matcher["method"] is None:
                kind = "exit"
        _adopt_ids(ctx, matcher)
        if hints.get("_open"):
            ctx.agent_item = f"msg_{self.values.hex(48)}"
        params = event_params(method, kind, ctx, item_type)
        if hints.get("_idle") and isinstance(params, dict):
            params["status"] = {"type": "idle"}
        request_key = None
        if kind == "request":
            request_key = str(session.next_request_id)
        base = {
            "seq": seq,
            "kind": kind,
            "method": None if kind in ("exit", "gap") else (method or "custom/notification"),
            "params": params,
            "requestKey": request_key,
            "receivedAt": self.values.timestamp(),
        }
        schema = self.schemas.named("EventResponse")
        event = conform(matcher, base, schema, self.schemas, self.values, subset=True)
        if not isinstance(event, dict):
            raise SynthesisError(f"an event must be an object, not {render(event)}")
        ordered = {key: event.get(key) for key in base}
        ordered.update({key: value for key, value in event.items() if key not in base})
        ordered["seq"] = seq  # by position in the log, whatever the spec said
        if ordered["kind"] == "request":
            key = ordered.get("requestKey")
            if not isinstance(key, str):
                ordered["requestKey"] = key = str(session.next_request_id)
            session.next_request_id += 1
            if key not in session.pending:
                session.pending.append(key)
        return ordered


#: A new event the scenario says nothing about (to reach a `count`).
_FILLER: Any = {"_filler": True}
_TURN_METHODS = frozenset(
    {
        "item/started",
        "item/completed",
        "item/agentMessage/delta",
        "turn/completed",
        "thread/tokenUsage/updated",
    }
)


def _spec_method(spec: Any) -> tuple[str | None, str | None]:
    if not isinstance(spec, dict):
        return None, None
    method = spec.get("method")
    params = spec.get("params")
    item_type = None
    if isinstance(params, dict) and isinstance(params.get("item"), dict):
        item = params["item"]
        if isinstance(item.get("type"), str):
            item_type = item["type"]
        elif "text" in item:
            item_type = "agentMessage"
    if spec.get("_item"):
        item_type = spec["_item"]
    if method in ("item/started", "item/completed") and item_type is None:
        item_type = "agentMessage"
    return (method if isinstance(method, str) else None), item_type


def _adopt_ids(ctx: TurnContext, matcher: Any) -> None:
    """Take the thread and turn ids an event spec names literally."""
    if not isinstance(matcher, dict) or not isinstance(matcher.get("params"), dict):
        return
    params = matcher["params"]
    if isinstance(params.get("threadId"), str):
        ctx.thread_id = params["threadId"]
    turn = params.get("turn")
    if isinstance(turn, dict) and isinstance(turn.get("id"), str):
        ctx.turn_id = turn["id"]
    if isinstance(params.get("turnId"), str):
        ctx.turn_id = params["turnId"]


def _implies(spec: Any, through: Any) -> bool:
    """Whether an event made for `spec` surely matches `through` (same literal keys)."""
    if spec == through:
        return True
    if not isinstance(spec, dict) or not isinstance(through, dict):
        return False
    for key, wanted in through.items():
        if is_matcher(wanted):
            return False
        if isinstance(wanted, dict):
            if not _implies(spec.get(key), wanted):
                return False
        elif spec.get(key, MISSING) != wanted:
            return False
    return True


def _could_be_exit(spec: dict[str, Any]) -> bool:
    return spec.get("kind") in (None, "exit") and spec.get("method") is None


#: What a tentative read may change: of the session, and of its turn context.
_TENTATIVE = (
    ("pending", "next_request_id", "in_turn", "need_user"),
    ("thread_id", "turn_id", "agent_item"),
)


class _Scratch:
    """Session state a tentative read may change, restored if the attempt is dropped."""

    def __init__(self, session: SessionPlan) -> None:
        owners = (session, session.ctx)
        self._saved = [
            (owner, name, copy.copy(getattr(owner, name)))
            for owner, names in zip(owners, _TENTATIVE, strict=True)
            for name in names
        ]

    def rollback(self) -> None:
        for owner, name, value in self._saved:
            setattr(owner, name, value)
