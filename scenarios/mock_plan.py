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
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from bridge.errors import RestError
from bridge.wire import dumps as wire_dumps
from fakes.app_server.script import AppServerScript, MethodBehavior
from scenarios import format as f
from scenarios.expectations import (
    NO_JSON,
    Exchange,
    Problem,
    as_text,
    error_problems,
    event_matcher,
    events_problems,
    http_problems,
    int_or_none,
)
from scenarios.format import LoadedScenario, ScenarioError
from scenarios.matching import MISSING, find_jsonpath, is_matcher, match, render
from scenarios.mock_bridge import (
    APP_SERVER_VERSION,
    JSON_CONTENT_TYPE,
    KIND_STATUS,
    STATUS_KIND,
    BridgeFront,
    Incoming,
    Operation,
    TurnContext,
    call_result,
    compatibility_body,
    error_of_kind,
    event_params,
    health_body,
    session_created,
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


def dumps(value: Any) -> bytes:
    """JSON as the bridge writes it."""
    return wire_dumps(value)


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
        data = dumps(self.event)
        return b"id: %d\nevent: %s\ndata: %s\n\n" % (self.seq, self.event["kind"].encode(), data)


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
        self.base_path = urlsplit(base_url).path.rstrip("/")
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
        self.background: dict[str, tuple[Entry, Operation | None, dict[str, str], Incoming]] = {}
        self.trigger: Entry | None = None
        self.index = 0
        self.step: Any = None
        self.sessionless_ctx = TurnContext(self.values)

    # -- errors and variables

    def fail(self, message: str, problems: list[Problem] | None = None) -> MockBuildError:
        where = self.loaded.where(("steps", self.index))
        title = self.step.title() if self.step is not None else "scenario"
        lines = [
            f"cannot mock scenario {self.loaded.name}: step {self.index + 1} ({title}, {where}):",
            f"  {message}",
        ]
        for problem in problems or []:
            lines.append(f"  ✗ {problem.message}")
            if problem.diff:
                lines += ["    " + line for line in problem.diff.splitlines()]
        return MockBuildError("\n".join(lines))

    def sub(self, value: Any) -> Any:
        if isinstance(value, str):
            if "$" not in value:
                return value
            whole = f.VARIABLE.fullmatch(value)
            if whole:
                return self._variable(whole.group(1))
            text = f.VARIABLE.sub(lambda m: as_text(self._variable(m.group(1))), value)
            return text.replace("$${", "${")
        if isinstance(value, dict):
            return {key: self.sub(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.sub(item) for item in value]
        return value

    def _variable(self, name: str) -> Any:
        if name not in self.variables:
            raise self.fail(f"${{{name}}} has no value here")
        return self.variables[name]

    # -- the run

    def run(self) -> ScenarioPlan:
        handlers: dict[type[Any], Callable[[Any], None]] = {
            f.HttpStep: self._http,
            f.CallStep: self._call,
            f.CreateSessionStep: self._create_session,
            f.ReplyStep: self._reply,
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
        for entry, operation, params, incoming in self.background.values():
            # Sent in the background and never awaited: what the bridge would answer.
            self.index = entry.index
            self.step = self.scenario.steps[entry.index]
            verdict = self.front.check(incoming)
            reply = self._respond(operation, params, incoming, verdict.body, None)
            entry.reply = self._finish(reply, None, "2xx", incoming, operation)
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

    def _incoming(
        self,
        method: str,
        path: str,
        *,
        auth: Any = True,
        headers: dict[str, str] | None = None,
        query: dict[str, Any] | None = None,
        json_body: Any = NO_JSON,
        body: str | None = None,
    ) -> tuple[Incoming, str]:
        """The request as the front sees it, and the path as the host sends it."""
        path = self._relative(path)
        raw_path, _, raw_query = path.partition("?")
        all_headers: dict[str, str] = {}
        token = auth if isinstance(auth, str) else (self.token if auth else None)
        if token:
            all_headers["Authorization"] = f"Bearer {token}"
        all_headers.update(headers or {})
        params = {key: as_text(value) for key, value in (query or {}).items()}
        for pair in filter(None, raw_query.split("&")):
            key, _, value = pair.partition("=")
            params.setdefault(unquote(key), unquote(value))
        payload = b""
        if json_body is not NO_JSON:
            payload = dumps(json_body)
        elif body is not None:
            payload = body.encode()
        decoded = unquote(raw_path)
        incoming = Incoming(method.upper(), decoded, all_headers, params, payload)
        return incoming, decoded

    def _entry(self, incoming: Incoming, *, request_json: Any = NO_JSON) -> Entry:
        step = self.step
        entry = Entry(
            self.index,
            step.title(),
            self.loaded.where(("steps", self.index)),
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
            self.background[self.step.background] = (
                entry,
                verdict.operation,
                verdict.params,
                incoming,
            )
            self._mutated(entry, None)
            return entry, Reply(0, {})
        reply = self._respond(verdict.operation, verdict.params, incoming, verdict.body, expect)
        reply = self._finish(reply, expect, default_status, incoming, verdict.operation)
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
        self, expect: f.HttpExpect | None, natural: int, default: Any, operation: Operation | None
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
        if default == "2xx":
            return (
                natural
                if 200 <= natural < 300
                else (operation.success_status if operation else 200)
            )
        return int(default)

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
        operation: Operation | None,
        params: dict[str, str],
        incoming: Incoming,
        body: Any,
        expect: f.HttpExpect | None,
    ) -> Reply:
        """What the bridge would plausibly answer (before the step's expectations)."""
        natural = self._natural(operation, params, incoming, body)
        status = self._choose_status(expect, natural.status, "2xx", operation)
        kind = self._expected_kind(expect or f.HttpExpect())
        natural_kind = None
        if natural.status >= 400:
            payload = natural.json()
            natural_kind = payload.get("error") if isinstance(payload, dict) else None
        if status == natural.status and (kind is None or kind == natural_kind):
            return natural
        if 200 <= status < 300:
            schema = operation.response_schema if operation else None
            if operation is not None and 200 <= natural.status < 300:
                return Reply(status, natural.headers, natural.body)
            filled = conform({}, MISSING, schema, self.schemas, self.values, subset=True)
            return Reply.of_json(status, filled)
        if status == 204:
            return Reply(204, {})
        kind = kind or STATUS_KIND.get(status, "internal_error")
        allowed = self.front.route(incoming.method, incoming.path)[2]
        session = self.sessions.get(params.get("sessionId", ""))
        error = error_of_kind(
            kind,
            status=status if KIND_STATUS.get(kind) != status else None,
            session_id=params.get("sessionId"),
            request_key=params.get("requestKey"),
            method=incoming.method,
            allowed=allowed,
            limits=self.limits,
            rpc_error=self._scripted_error(session, params.get("method")),
            exit_params=None,
        )
        return Reply.of_error(error)

    def _finish(
        self,
        reply: Reply,
        expect: f.HttpExpect | None,
        default_status: Any,
        incoming: Incoming,
        operation: Operation | None,
    ) -> Reply:
        """`reply` changed to satisfy `expect`, then checked against it and the contract."""
        if expect is not None:
            reply = self._apply(reply, expect, operation)
        problems = self._http_problems(expect, reply, incoming, default_status)
        if problems:
            raise self.fail("no made-up response satisfies the step", problems)
        return reply

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
        if name == "delete_session":
            if session is None or session.deleted:
                return Reply.of_error(
                    error_of_kind("session_not_found", session_id=params["sessionId"])
                )
            return Reply.of_json(status, {"status": "deleted", "sessionId": params["sessionId"]})
        if name in ("reply_result", "reply_error"):
            key = params["requestKey"]
            if session is None or session.deleted:
                return Reply.of_error(
                    error_of_kind("session_not_found", session_id=params["sessionId"])
                )
            if key in session.answered:
                return Reply.of_error(error_of_kind("request_already_answered", request_key=key))
            if key not in session.pending:
                return Reply.of_error(error_of_kind("request_not_found", request_key=key))
            return Reply.of_json(status, {"status": "sent", "requestKey": key})
        if name == "session_call":
            if session is None or session.deleted:
                return Reply.of_error(
                    error_of_kind("session_not_found", session_id=params["sessionId"])
                )
            if session.exit_seq is not None:
                return Reply.of_error(error_of_kind("session_exited", session_id=session.id))
            call_params = request.get("params") if isinstance(request, dict) else None
            return self._call_outcome(session, params["method"], call_params, status)
        if name == "call":
            call_params = request.get("params") if isinstance(request, dict) else None
            return self._call_outcome(None, params["method"], call_params, status)
        if name == "text_turn":
            return Reply.of_json(
                status, self._text_turn(request if isinstance(request, dict) else {})
            )
        schema = operation.response_schema if operation is not None else None
        filled = conform({}, MISSING, schema, self.schemas, self.values, subset=True)
        return Reply.of_json(status, filled)

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
        if self.script is not None and self.script.unknown_methods is not None:
            from fakes.app_server.known_methods import KNOWN_METHODS

            if method not in KNOWN_METHODS:
                return self.script.unknown_methods
        return None

    def _scripted_error(self, session: SessionPlan | None, method: str | None) -> dict[str, Any]:
        if method is None or self.script is None:
            return {}
        for behavior in self.script.methods.get(method, []):
            if behavior.error is not None:
                return behavior.error.to_wire()
        if method not in _known_methods():
            return {
                "code": -32600,
                "message": f"Invalid request: unknown variant `{method}`",
            }
        return {}

    def _call_outcome(
        self, session: SessionPlan | None, method: str, params: Any, status: int
    ) -> Reply:
        """What fake-codex, as scripted, would make the bridge answer a raw call."""
        ctx = session.ctx if session is not None else self.sessionless_ctx
        behavior = self._next_behavior(session, method, params)
        if behavior is not None:
            from fakes.app_server import script as s

            if behavior.no_reply:
                return Reply.of_error(error_of_kind("timeout"))
            for step in behavior.steps:
                if isinstance(step, s.RespondStep):
                    if step.respond.error is not None:
                        return Reply.of_error(
                            error_of_kind(
                                "app_server_error", rpc_error=step.respond.error.to_wire()
                            )
                        )
                    if step.respond.has_result:
                        return Reply.of_json(status, {"result": step.respond.result})
                    break
                if isinstance(step, s.ExitStep):
                    exit_params = {"exitCode": step.exit.code, "signal": step.exit.signal}
                    return Reply.of_error(
                        error_of_kind("app_server_exited", exit_params=exit_params)
                    )
                if isinstance(step, s.RawStep | s.BigLineStep):
                    return Reply.of_error(error_of_kind("protocol_error"))
                if isinstance(step, s.StallStep):
                    return Reply.of_error(error_of_kind("timeout"))
            if behavior.error is not None:
                error = behavior.error.to_wire()
                kind = "app_server_overloaded" if error["code"] == -32001 else "app_server_error"
                return Reply.of_error(error_of_kind(kind, rpc_error=error))
            if behavior.has_result:
                return Reply.of_json(status, {"result": behavior.result})
        if method not in _known_methods() and not (
            self.script is not None and method in self.script.methods
        ):
            rpc = self._scripted_error(session, method)
            return Reply.of_error(error_of_kind("app_server_error", rpc_error=rpc))
        return Reply.of_json(status, {"result": call_result(method, params, ctx)})

    def _text_turn(self, request: dict[str, Any]) -> dict[str, Any]:
        from fakes.app_server import shapes
        from fakes.app_server.server import default_reply_text

        text = default_reply_text([{"type": "text", "text": request.get("text", "")}])
        if self.script is not None and self.script.turns:
            for step in self.script.turns[0].steps:
                message = getattr(step, "agent_message", None)
                if message is not None and message.text:
                    text = message.text
        ctx = TurnContext(self.values)
        ctx.thread_id, ctx.turn_id = self.values.uuid7(), self.values.uuid7()
        usage = shapes.token_usage_breakdown(100, 20, 0, 0)
        body: dict[str, Any] = {
            "text": text,
            "threadId": ctx.thread_id,
            "turnId": ctx.turn_id,
            "status": "completed",
            "error": None,
            "usage": shapes.thread_token_usage(usage, usage),
            "approvals": [],
        }
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

    def _http(self, step: f.HttpStep) -> None:
        spec = step.http
        path = as_text(self.sub(spec.path))
        json_body = self.sub(spec.json_body) if spec.given("json_body") else NO_JSON
        incoming, decoded = self._incoming(
            spec.method,
            path,
            auth=self.sub(spec.auth),
            headers=self.sub(spec.headers),
            query=self.sub(spec.query),
            json_body=json_body,
            body=self.sub(spec.body),
        )
        if self._events_path(decoded) is not None:
            verdict = self.front.check(incoming)
            if verdict.error is None:
                raise self.fail(
                    "an `http` step on an events route: read events with `poll` or `stream` "
                    "steps (the mock serves events from the session's log)"
                )
        expect = step.expect if step.background is None else None
        entry, reply = self._answer(
            incoming, expect, "2xx", request_json=json_body, background=step.background is not None
        )
        if step.background is None:
            self._after(entry, reply, incoming)
            self._capture_http(step, reply)

    def _call(self, step: f.CallStep) -> None:
        spec = step.call
        session = self.sub(spec.session)
        method = as_text(self.sub(spec.method))
        path = f"/v1/sessions/{session}/call/{method}" if session else f"/v1/call/{method}"
        body: dict[str, Any] = {}
        if spec.given("params"):
            body["params"] = self.sub(spec.params)
        if spec.timeout_ms is not None:
            body["timeoutMs"] = spec.timeout_ms
        if spec.options is not None:
            body["options"] = self.sub(spec.options)
        incoming, _ = self._incoming("POST", path, auth=self.sub(spec.auth), json_body=body)
        expect = step.expect if step.background is None else None
        entry, reply = self._answer(
            incoming, expect, "2xx", request_json=body, background=step.background is not None
        )
        if step.background is None:
            self._after(entry, reply, incoming)
            self._capture_http(step, reply)

    def _create_session(self, step: f.CreateSessionStep) -> None:
        spec = step.create_session
        body = {"options": self.sub(spec.options)} if spec.options is not None else {}
        incoming, _ = self._incoming(
            "POST", "/v1/sessions", auth=self.sub(spec.auth), json_body=body
        )
        entry, reply = self._answer(incoming, step.expect, 201, request_json=body)
        self._after(entry, reply, incoming)
        payload = reply.json()
        if reply.status == 201 and isinstance(payload, dict):
            self.variables[spec.as_] = payload.get("sessionId")
        self._capture_http(step, reply)

    def _reply(self, step: f.ReplyStep) -> None:
        spec = step.reply
        base = f"/v1/sessions/{self.sub(spec.session)}/requests/{self.sub(spec.request_key)}"
        if spec.error is not None:
            body: Any = self.sub(spec.error.model_dump(exclude_unset=True))
            path = f"{base}/error"
        else:
            body = {"result": self.sub(spec.result)}
            path = f"{base}/result"
        incoming, _ = self._incoming("POST", path, auth=self.sub(spec.auth), json_body=body)
        entry, reply = self._answer(incoming, step.expect, 200, request_json=body)
        self._after(entry, reply, incoming)
        self._capture_http(step, reply)

    def _await(self, step: f.AwaitStep) -> None:
        name = step.await_.request
        if name not in self.background:
            raise self.fail(f"no request {name!r} is pending")
        entry, operation, params, incoming = self.background.pop(name)
        verdict = self.front.check(incoming)
        reply = self._respond(operation, params, incoming, verdict.body, step.expect)
        reply = self._finish(reply, step.expect, "2xx", incoming, operation)
        entry.reply = reply
        self._after(entry, reply, incoming)
        self._capture_http(step, reply)

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

    def _capture_http(self, step: Any, reply: Reply) -> None:
        body = reply.json()
        for name, spec in step.capture.items():
            if isinstance(spec, dict) and "header" in spec:
                value = next(
                    (v for k, v in reply.headers.items() if k.lower() == spec["header"].lower()),
                    None,
                )
                if value is None:
                    raise self.fail(
                        f"capture {name}: the response has no {spec['header']} header; give it "
                        "in `expect.headers`"
                    )
                self.variables[name] = value
                continue
            expression = spec["jsonPath"] if isinstance(spec, dict) else spec
            found = find_jsonpath(expression, body) if body is not NO_JSON else []
            if not found:
                raise self.fail(
                    f"capture {name}: {expression} finds nothing in the response "
                    f"{render(body if body is not NO_JSON else None, 300)}; say what is there "
                    "in `expect` (e.g. `jsonPath: {" + expression + ": {$type: string}}`)"
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
        incoming, _ = self._incoming(
            "GET", path, auth=self.sub(spec.auth), query={"waitMs": spec.wait_ms}
        )
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
        through = event_matcher(self.sub(spec.through)) if spec.through is not None else None
        want = spec.count if spec.count is not None else (None if through is not None else 1)
        if expect.error is not None:
            self._poll_error(step, session, start, expect, incoming)
            return
        events = self._read_events(session, start, through, want, False, expect)
        if after is None:
            session.cursor = start + len(events)
        if events:
            self.reads.append(
                ReadCheck(
                    self.index,
                    step.title(),
                    self.loaded.where(("steps", self.index)),
                    session,
                    int(events[-1]["seq"]),
                )
            )
        self._capture_events(step, events)

    def _poll_error(
        self,
        step: f.PollStep,
        session: SessionPlan,
        start: int,
        expect: f.EventsExpect,
        incoming: Incoming,
    ) -> None:
        """A long-poll expected to fail: reads past the log answer the error."""
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
            payload = conform(
                wanted,
                error.payload(),
                self.schemas.named("ErrorPayload"),
                self.schemas,
                self.values,
                subset=True,
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
        if spec.session is not None:
            session_id = as_text(self.sub(spec.session))
            path = f"/v1/sessions/{session_id}/events/stream"
        else:
            path = self._relative(as_text(self.sub(spec.path)))
            found = self._events_path(unquote(path.partition("?")[0]))
            if found is None or not found[1]:
                raise self.fail(
                    f"a stream of {path}: the mock streams only a session's "
                    "`/v1/sessions/{id}/events/stream`"
                )
            session_id = found[0]
        headers = dict(self.sub(spec.headers or {}))
        if spec.last_event_id is not None:
            headers["Last-Event-ID"] = as_text(self.sub(spec.last_event_id))
        query = {"after": as_text(self.sub(spec.after))} if spec.after is not None else None
        incoming, _ = self._incoming(
            "GET", path, auth=self.sub(spec.auth), headers=headers, query=query
        )
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
            reply = self._respond(verdict.operation, verdict.params, incoming, None, expect)
            reply = self._finish(reply, expect, 200, incoming, verdict.operation)
            entry.reply = reply
            entry.stream = StreamInfo(session, position, 0, error=True)
            return
        entry.reply = Reply(200, dict(_sse_headers()))
        problems = self._http_problems(expect, entry.reply, incoming, 200)
        if problems:
            raise self.fail("the stream's response does not match", problems)
        start = position if position is not None else session.cursor
        info = StreamInfo(session, position, start)
        entry.stream = info
        self.streams[spec.as_] = info

    def _read(self, step: f.ReadStep) -> None:
        spec = step.read
        expect = step.expect or f.EventsExpect()
        info = self.streams.get(spec.stream)
        if info is None:
            raise self.fail(f"stream {spec.stream!r} is not open")
        session = info.session
        through = event_matcher(self.sub(spec.through)) if spec.through is not None else None
        want = spec.count
        if want is None and through is None and not spec.to_end:
            want = 1
        to_end = spec.to_end or bool(expect.ended)
        if expect.error is not None:
            raise self.fail("`error` applies to `poll` only")
        exit_seq = session.exit_seq
        if exit_seq is not None and info.stop >= exit_seq:
            events: list[dict[str, Any]] = []
            if want not in (None, 0) or through is not None:
                raise self.fail("the stream already ended (after the session's exit event)")
        else:
            events = self._read_events(session, info.stop, through, want, to_end, expect, sse=True)
        if info.start is None:
            session.cursor = info.stop + len(events)
        info.stop += len(events)
        if events:
            self.reads.append(
                ReadCheck(
                    self.index,
                    step.title(),
                    self.loaded.where(("steps", self.index)),
                    session,
                    int(events[-1]["seq"]),
                )
            )
        self._capture_events(step, events)

    def _close(self, step: f.CloseStep) -> None:
        self.streams.pop(step.close, None)

    def _capture_events(self, step: Any, events: list[dict[str, Any]]) -> None:
        last = events[-1] if events else None
        for name, spec in step.capture.items():
            if isinstance(spec, dict) and "header" in spec:
                raise self.fail(f"capture {name}: events have no headers")
            expression = spec["jsonPath"] if isinstance(spec, dict) else spec
            found = find_jsonpath(expression, last) if last is not None else []
            if not found:
                raise self.fail(
                    f"capture {name}: {expression} finds nothing in the last event read "
                    f"({render(last, 300)}); say what is there in the step's expectations"
                )
            self.variables[name] = found[0] if len(found) == 1 else found

    # -- the events a read gets

    def _read_events(
        self,
        session: SessionPlan,
        start: int,
        through: Any,
        want: int | None,
        to_end: bool,
        expect: f.EventsExpect,
        *,
        sse: bool = False,
    ) -> list[dict[str, Any]]:
        """The events a read from `start` gets; new ones are added to the session's log."""
        existing: list[dict[str, Any]] = []
        done = want == 0
        for planned in session.events[start:]:
            if done:
                break
            existing.append(planned.event)
            done = self._stops(existing, through, want)
        if done:
            problems = self._read_problems(existing, through, want, to_end, expect)
            if problems:
                raise self.fail(
                    f"the read gets events #{start + 1}.. that earlier steps put in the log, "
                    "and they do not satisfy it",
                    problems,
                )
            return existing
        absent = [event_matcher(self.sub(item)) for item in expect.absent or []]
        attempts: list[bool] = [True, False]
        last_problems: list[Problem] = []
        for companions in attempts:
            scratch = _Scratch(session)
            specs = self._specs(existing, through, want, to_end, expect)
            if specs is None:
                break
            made = self._make_events(
                scratch.session, specs, companions=companions, through=through, absent=absent
            )
            candidate = existing + [planned.event for planned in made]
            problems = self._read_problems(candidate, through, want, to_end, expect)
            if not problems:
                for planned in made:
                    planned.trigger = self.trigger
                session.events.extend(made)
                return candidate
            last_problems = problems
            scratch.rollback()
        raise self.fail("no events satisfy the read", last_problems)

    def _stops(self, read: list[dict[str, Any]], through: Any, want: int | None) -> bool:
        last = read[-1]
        if through is not None and not match(through, last, subset=True):
            return True
        if want is not None and len(read) >= want:
            return True
        return last.get("kind") == "exit"

    def _specs(
        self,
        existing: list[dict[str, Any]],
        through: Any,
        want: int | None,
        to_end: bool,
        expect: f.EventsExpect,
    ) -> list[Any] | None:
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
        total = want if want is not None else expect.count
        if total is not None:
            while done + len(specs) < total:
                specs.append(_FILLER)
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
        self,
        read: list[dict[str, Any]],
        through: Any,
        want: int | None,
        to_end: bool,
        expect: f.EventsExpect,
    ) -> list[Problem]:
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
        seqs = [event.get("seq") for event in read]
        kinds = [event.get("kind") for event in read]
        problems += events_problems(expect, read, seqs, kinds, self.sub)
        return problems

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


def _known_methods() -> frozenset[str]:
    from fakes.app_server.known_methods import KNOWN_METHODS

    return frozenset(KNOWN_METHODS)


def _sse_headers() -> dict[str, str]:
    from scenarios.mock_bridge import SSE_HEADERS

    return SSE_HEADERS


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


class _Scratch:
    """Session state a tentative read may change, restored if the attempt is dropped."""

    def __init__(self, session: SessionPlan) -> None:
        self.session = session
        ctx = session.ctx
        self._saved = (
            list(session.pending),
            session.next_request_id,
            session.in_turn,
            session.need_user,
            ctx.thread_id,
            ctx.turn_id,
            ctx.agent_item,
        )

    def rollback(self) -> None:
        session, ctx = self.session, self.session.ctx
        (
            session.pending,
            session.next_request_id,
            session.in_turn,
            session.need_user,
            ctx.thread_id,
            ctx.turn_id,
            ctx.agent_item,
        ) = self._saved
