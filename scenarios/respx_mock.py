"""respx mocks of the bridge, for host code that calls it with httpx: no process at all.

Two routers, both `respx.MockRouter`s (use them as context managers, or through the
pytest plugin's `respx_scenario` and `bridge_respx` fixtures):

- :func:`scenario_router` answers with the responses a scenario's steps describe (see
  `scenarios.mock_plan` for how they are made and checked). Calls to the same route are
  answered in scenario order; events are served from each session's log with the
  bridge's cursor, `?after=` and `Last-Event-ID` semantics, and only once the host has
  made the request that, in the scenario, came before them.
- :func:`openapi_router` has one route per operation of an OpenAPI document (by
  default a preset's, as `bridge.openapi.build_openapi` writes it), answering with a
  schema-valid example, or what `overrides` says per operationId.

Both check each request as the bridge's front would (`scenarios.mock_bridge`): bearer
auth (401), request bodies against the bridge's wire models (400), the body limit (413),
ClientOptions a preset refuses (403). A request no route matches raises
:class:`UnmatchedRequest` listing the method, the URL and every known route; a scenario
step the host never made fails `assert_all_called` (on by default for scenario routers,
run when the router stops).

    with scenario_router("approval.scenario.yaml") as bridge:
        client = MyBridgeClient(bridge.base_url, token=bridge.token)
        ...
"""

from __future__ import annotations

import contextvars
import os
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic.alias_generators import to_snake

try:
    import httpx
    import respx
    from respx.models import AllMockedAssertionError
    from respx.patterns import Lookup, Match, Pattern
except ModuleNotFoundError as exc:  # the `harness` extra alone does not bring them
    raise ModuleNotFoundError(
        f"the respx mocks of the bridge need respx and httpx (no module named {exc.name!r}): "
        "install codex-rest-bridge with its `respx` extra, e.g. from a clone: "
        'pip install "/path/to/codex-rest-bridge[respx]"',
        name=exc.name,
    ) from None

from bridge.errors import RestError
from bridge.limits import RestLimits
from bridge.routes import parse_sse_position
from scenarios.expectations import NO_JSON
from scenarios.format import LoadedScenario, load_scenario, parse_scenario
from scenarios.matching import MISSING, diff, match
from scenarios.mock_bridge import (
    PRESETS,
    SSE_HEADERS,
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
    sse_frame,
    text_turn_body,
)
from scenarios.mock_plan import (
    DEFAULT_BASE_URL,
    Entry,
    MockBuildError,
    PlannedEvent,
    Reply,
    ScenarioPlan,
    SessionPlan,
    plan,
)
from scenarios.synth import Values, conform

__all__ = [
    "DEFAULT_BASE_URL",
    "BridgeMockRouter",
    "MockBuildError",
    "OpenApiRouter",
    "ScenarioMockError",
    "ScenarioRouter",
    "UnmatchedRequest",
    "openapi_router",
    "scenario_router",
]


class ScenarioMockError(AssertionError):
    """The host made a request the mock has no answer for (beyond what it planned)."""


class UnmatchedRequest(AllMockedAssertionError, ScenarioMockError):
    """No mocked route matches the request; the message lists every known route."""


#: Set while respx resolves a request for an async client: waits may then await.
_ASYNC: contextvars.ContextVar[bool] = contextvars.ContextVar("bridge_mock_async", default=False)


class _Target(Pattern):
    """Matches method, origin and the decoded path (`%2F` is `/`, as the bridge routes)."""

    key = "codex_bridge_target"
    lookups = (Lookup.EQUAL,)

    def __init__(self, method: str, origin: tuple[str, str, int], path: Any) -> None:
        super().__init__((method, origin, path))

    def parse(self, request: httpx.Request) -> Any:
        url = request.url
        return request.method, _origin(url), url.path

    def _eq(self, value: Any) -> Match:
        method, origin, path = self.value
        got_method, got_origin, got_path = value
        if (method, origin) != (got_method, got_origin):
            return Match(False)
        if isinstance(path, str):
            return Match(path == got_path)
        return Match(bool(path.match(got_path)))


def _origin(url: httpx.URL) -> tuple[str, str, int]:
    port = url.port or (443 if url.scheme == "https" else 80)
    return url.scheme, url.host, port


class BridgeMockRouter(respx.MockRouter):
    """A `respx.MockRouter` for one bridge at `base_url` whose unmatched calls fail loudly."""

    def __init__(self, base_url: str, *, assert_all_called: bool) -> None:
        super().__init__(assert_all_called=assert_all_called, assert_all_mocked=True)
        self.base_url = base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL, not {base_url!r}")
        self._origin = _origin(httpx.URL(self.base_url))
        self._base_path = parts.path.rstrip("/")
        self._lock = threading.RLock()
        #: Requests no route matched, in order.
        self.unmatched: list[httpx.Request] = []

    # -- routes

    def _add(self, method: str, path: Any, name: str, side_effect: Callable[..., Any]) -> None:
        if isinstance(path, str):
            path = self._base_path + path
        route = respx.Route(_Target(method, self._origin, path))
        route.side_effect = side_effect
        self.add(route, name=name)

    def known_routes(self) -> list[str]:
        """One line per route, for messages."""
        return [str(route.name) for route in self.routes]

    def incoming(self, request: httpx.Request) -> Incoming:
        """`request` as the bridge's front sees it: the path relative to the bridge."""
        path = request.url.path
        if self._base_path and path.startswith(self._base_path):
            path = path[len(self._base_path) :] or "/"
        return Incoming(
            request.method,
            path,
            dict(request.headers),
            dict(request.url.params),
            request.read(),
        )

    # -- unmatched requests fail loudly

    def resolve(self, request: httpx.Request) -> Any:
        try:
            return super().resolve(request)
        except UnmatchedRequest:
            raise
        except AllMockedAssertionError:
            raise self._unmatched(request) from None

    async def aresolve(self, request: httpx.Request) -> Any:
        token = _ASYNC.set(True)
        try:
            return await super().aresolve(request)
        except UnmatchedRequest:
            raise
        except AllMockedAssertionError:
            raise self._unmatched(request) from None
        finally:
            _ASYNC.reset(token)

    def _unmatched(self, request: httpx.Request) -> UnmatchedRequest:
        with self._lock:
            self.unmatched.append(request)
        lines = [
            f"no route of the mocked bridge matches {request.method} {request.url} "
            f"({self.describe()}); known routes:"
        ]
        lines += [f"  {line}" for line in self.known_routes()] or ["  (none)"]
        return UnmatchedRequest("\n".join(lines))

    def describe(self) -> str:
        return f"bridge mock at {self.base_url}"

    def assert_all_called(self) -> None:
        """Fail, naming them, when some routes were never called."""
        missing = [str(route.name) for route in self.routes if not route.called]
        if missing:
            lines = [f"{self.describe()}: {len(missing)} route(s) never called:"]
            raise AssertionError("\n".join(lines + [f"  {name}" for name in missing]))


def _response(reply: Reply) -> httpx.Response:
    return httpx.Response(reply.status, headers=reply.headers, content=reply.body)


def _error_response(error: RestError) -> httpx.Response:
    return _response(Reply.of_error(error))


# -- from a scenario ------------------------------------------------------------------------


class ScenarioRouter(BridgeMockRouter):
    """The bridge as a scenario describes it (built by :func:`scenario_router`).

    `variables` holds what the scenario's `${...}` stand for here (session ids, captures);
    `token` is the scenario's bearer token (None without auth).
    """

    def __init__(
        self,
        planned: ScenarioPlan,
        *,
        assert_all_called: bool = True,
        strict_bodies: bool = False,
        max_idle_polls: int = 20,
        release_timeout: float = 5.0,
    ) -> None:
        super().__init__(planned.base_url, assert_all_called=assert_all_called)
        self.plan = planned
        self.front = planned.front
        self.token = planned.token
        self.variables = planned.variables
        self.strict_bodies = strict_bodies
        self.max_idle_polls = max_idle_polls
        self.release_timeout = release_timeout
        self._lines: list[str] = []
        events_paths: dict[tuple[str, str], tuple[SessionPlan, bool]] = {}
        for session_id, session in planned.event_sessions.items():
            events_paths[("GET", f"/v1/sessions/{session_id}/events")] = (session, False)
            events_paths[("GET", f"/v1/sessions/{session_id}/events/stream")] = (session, True)
        for key in events_paths:
            planned.routes.setdefault(key, [])

        for (method, path), entries in planned.routes.items():
            label = f"{method} {self.base_url}{path}"
            if (method, path) in events_paths:
                session, stream = events_paths[(method, path)]
                handler = self._stream if stream else self._poll
                kind = "Server-Sent Events" if stream else "long-poll"
                self._lines.append(f"{label}  — {kind}: session {session.id}'s event log")
                self._add(method, path, label, _bind(handler, session, entries))
                continue
            steps = "; ".join(f"step {e.index + 1} ({e.title})" for e in entries)
            self._lines.append(f"{label}  — {steps}")
            self._add(method, path, label, _bind(self._static, entries))

    def known_routes(self) -> list[str]:
        return list(self._lines)

    def describe(self) -> str:
        return f"mock of scenario {self.plan.name} at {self.base_url}"

    # -- answers

    def _admit(
        self, request: httpx.Request, entries: list[Entry]
    ) -> tuple[Incoming, httpx.Response | None]:
        """`request` as the front sees it, and the front's rejection (None: it lets it in),
        which serves the first step that planned it."""
        incoming = self.incoming(request)
        error = self.front.check(incoming).error
        if error is None:
            return incoming, None
        with self._lock:
            for entry in entries:
                planned = entry.reply
                if entry.layer and entry.served == 0 and planned and planned.status == error.status:
                    entry.mark_served()
                    break
        return incoming, _error_response(error)

    def _static(self, request: httpx.Request, entries: list[Entry]) -> httpx.Response:
        incoming, rejected = self._admit(request, entries)
        if rejected is not None:
            return rejected
        with self._lock:
            entry = _unserved(entries)
            if entry is None:
                answered = [e.describe() for e in entries if not e.layer]
                raise ScenarioMockError(
                    f"{request.method} {request.url}: the scenario {self.plan.name} answers "
                    f"this route {len(answered)} time(s) ({'; '.join(answered) or 'never'}), "
                    "and the host asks again"
                )
            if self.strict_bodies:
                self._check_body(entry, incoming)
            entry.mark_served()
            reply = entry.reply
        assert reply is not None  # planned for every entry
        return _response(reply)

    def _check_body(self, entry: Entry, incoming: Incoming) -> None:
        if entry.request_json is NO_JSON:
            return
        sent = incoming.json()
        if match(entry.request_json, sent, subset=False):
            raise ScenarioMockError(
                f"{incoming.method} {incoming.path}: the body differs from "
                f"{entry.describe()}'s (strict_bodies):\n"
                + diff(entry.request_json, sent, subset=False)
            )

    # -- events

    def _poll(
        self, request: httpx.Request, session: SessionPlan, entries: list[Entry]
    ) -> httpx.Response | Any:
        incoming, rejected = self._admit(request, entries)
        if rejected is not None:
            return rejected
        after_raw = incoming.query.get("after")
        after = int(after_raw) if after_raw is not None else None
        limits = self.front.limits
        wait_raw = incoming.query.get("waitMs")
        wait_ms = min(
            int(wait_raw) if wait_raw is not None else limits.max_wait_ms, limits.max_wait_ms
        )
        answer, waiting = self._next_event(session, after)
        if answer is not None:
            return answer
        if waiting is not None and _ASYNC.get():
            timeout = min(wait_ms / 1000, self.release_timeout)
            return self._poll_later(session, after, waiting, timeout)
        return self._idle(session, after, waiting)

    async def _poll_later(
        self, session: SessionPlan, after: int | None, waiting: PlannedEvent, timeout: float
    ) -> httpx.Response:
        if waiting.trigger is not None:
            await waiting.trigger.release.wait_async(timeout)
        answer, still = self._next_event(session, after)
        return answer if answer is not None else self._idle(session, after, still)

    def _next_event(
        self, session: SessionPlan, after: int | None
    ) -> tuple[httpx.Response | None, PlannedEvent | None]:
        """The answer if there is one now, else the event the poll would wait for."""
        with self._lock:
            position = after if after is not None else session.rt_cursor
            planned = session.after(position)
            if planned is not None:
                if not planned.released():
                    return None, planned
                if after is None:
                    session.rt_cursor = planned.seq
                session.delivered = max(session.delivered, planned.seq)
                session.idle_polls = 0
                return _response(Reply.of_json(200, planned.event)), None
            exit_seq = session.exit_seq
            if exit_seq is not None and position >= exit_seq:
                return _error_response(error_of_kind("session_exited", session_id=session.id)), None
            if session.end_error is not None:
                return _response(session.end_error), None
            return None, None

    def _idle(
        self, session: SessionPlan, after: int | None, waiting: PlannedEvent | None
    ) -> httpx.Response:
        with self._lock:
            session.idle_polls += 1
            if session.idle_polls <= self.max_idle_polls:
                return httpx.Response(204)
            session.idle_polls = 0
        position = after if after is not None else session.rt_cursor
        if waiting is not None and waiting.trigger is not None:
            what = waiting.event.get("method") or waiting.event["kind"]
            why = (
                f"its next event (#{waiting.seq} {what}) "
                f"comes only after {waiting.trigger.describe()}: {waiting.trigger.method} "
                f"{waiting.trigger.path}, which the host has not made"
            )
        else:
            why = f"the scenario has no event after #{position} in it"
        raise ScenarioMockError(
            f"the host long-polled session {session.id} {self.max_idle_polls + 1} times in a "
            f"row without an event: {why} (scenario {self.plan.name})"
        )

    def _stream(
        self, request: httpx.Request, session: SessionPlan, entries: list[Entry]
    ) -> httpx.Response:
        incoming, rejected = self._admit(request, entries)
        if rejected is not None:
            return rejected
        with self._lock:
            entry = _unserved(entries)
            if entry is not None:
                entry.mark_served()
                if entry.stream is not None and entry.stream.error and entry.reply is not None:
                    return _response(entry.reply)
            position = parse_sse_position(
                incoming.query.get("after"), incoming.header("Last-Event-ID")
            )
            start = session.rt_cursor if position is None else position
            stop = entry.stream.stop if entry is not None and entry.stream else session.last_seq
            frames = [planned for planned in session.events if start < planned.seq <= stop]
            # A stream from the cursor moves it for good only if it ends with the exit
            # event: one its client cuts short gives the cursor back (the bridge's rule).
            advance = position is None and bool(frames) and frames[-1].event["kind"] == "exit"
        return httpx.Response(
            200, headers=SSE_HEADERS, stream=_SseStream(self, session, frames, advance)
        )

    def _delivered(self, session: SessionPlan, planned: PlannedEvent, advance: bool) -> None:
        with self._lock:
            session.delivered = max(session.delivered, planned.seq)
            if advance:
                session.rt_cursor = max(session.rt_cursor, planned.seq)

    def _unreleased(self, session: SessionPlan, planned: PlannedEvent) -> ScenarioMockError:
        trigger = planned.trigger
        assert trigger is not None
        return ScenarioMockError(
            f"the event stream of session {session.id} waits for event #{planned.seq} "
            f"({planned.event.get('method') or planned.event['kind']}), which comes only after "
            f"{trigger.describe()}: {trigger.method} {trigger.path}; the host did not make it "
            f"within {self.release_timeout} s (scenario {self.plan.name})"
        )

    # -- the end check

    def unserved(self) -> list[str]:
        """The steps the host never made (requests never sent, events never read)."""
        found: dict[int, str] = {}
        for (method, path), entries in self.plan.routes.items():
            for entry in entries:
                if entry.served == 0 and entry.index not in found:
                    found[entry.index] = f"{entry.describe()}: {method} {path} never requested"
        for read in self.plan.reads:
            if read.session.delivered < read.last_seq and read.index not in found:
                found[read.index] = (
                    f"step {read.index + 1} ({read.title}, {read.where}): events up to "
                    f"#{read.last_seq} of session {read.session.id} never read (read: "
                    f"{read.session.delivered})"
                )
        return [found[index] for index in sorted(found)]

    def assert_all_called(self) -> None:
        missing = self.unserved()
        if missing:
            lines = [
                f"scenario {self.plan.name}: {len(missing)} step(s) the host never made "
                "(assert_all_called):"
            ]
            lines += [f"  {line}" for line in missing]
            raise AssertionError("\n".join(lines))


def _unserved(entries: list[Entry]) -> Entry | None:
    """The first of `entries` the host has not made yet (the front's rejections aside)."""
    return next((entry for entry in entries if not entry.layer and entry.served == 0), None)


def _bind(handler: Callable[..., Any], *args: Any) -> Callable[[httpx.Request], Any]:
    def side_effect(request: httpx.Request) -> Any:
        return handler(request, *args)

    return side_effect


class _SseStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """The frames of one stream, each sent once its event is released."""

    def __init__(
        self,
        router: ScenarioRouter,
        session: SessionPlan,
        frames: list[PlannedEvent],
        advance: bool,
    ) -> None:
        self.router = router
        self.session = session
        self.frames = frames
        self.advance = advance

    def __iter__(self) -> Iterator[bytes]:
        for planned in self.frames:
            trigger = planned.trigger
            if trigger is not None and not trigger.release.wait(self.router.release_timeout):
                raise self.router._unreleased(self.session, planned)
            self.router._delivered(self.session, planned, self.advance)
            yield planned.frame()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for planned in self.frames:
            trigger = planned.trigger
            if trigger is not None and not await trigger.release.wait_async(
                self.router.release_timeout
            ):
                raise self.router._unreleased(self.session, planned)
            self.router._delivered(self.session, planned, self.advance)
            yield planned.frame()


def scenario_router(
    scenario: str | os.PathLike[str] | Mapping[str, Any] | LoadedScenario,
    *,
    base_url: str = DEFAULT_BASE_URL,
    seed: int = 0,
    assert_all_called: bool = True,
    strict_bodies: bool = False,
    max_idle_polls: int = 20,
    release_timeout: float = 5.0,
) -> ScenarioRouter:
    """A respx router answering as `scenario` (a file, a mapping or a loaded scenario) says.

    Raises `MockBuildError` (a `ScenarioError`) naming the step and line when a step
    cannot be answered as it expects. `seed` varies the made-up ids (the same seed, the
    same ids). `strict_bodies`: a request whose JSON body differs from the step's fails.
    `max_idle_polls`: empty long-polls in a row before the mock fails the host's loop.
    `release_timeout`: how long a stream or async long-poll waits for the request an
    event comes after.
    """
    if isinstance(scenario, LoadedScenario):
        loaded = scenario
    elif isinstance(scenario, Mapping):
        loaded = parse_scenario({"scenario": 1, **scenario}, source="<scenario>")
    else:
        loaded = load_scenario(Path(scenario))
    return ScenarioRouter(
        plan(loaded, base_url=base_url, seed=seed),
        assert_all_called=assert_all_called,
        strict_bodies=strict_bodies,
        max_idle_polls=max_idle_polls,
        release_timeout=release_timeout,
    )


# -- from an OpenAPI document ------------------------------------------------------------------

Override = httpx.Response | Callable[..., Any] | Any


class OpenApiRouter(BridgeMockRouter):
    """One route per operation of an OpenAPI document (built by :func:`openapi_router`)."""

    def __init__(
        self,
        front: BridgeFront,
        *,
        base_url: str = DEFAULT_BASE_URL,
        token: str | None = None,
        overrides: Mapping[str, Override] | None = None,
        assert_all_called: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(base_url, assert_all_called=assert_all_called)
        self.front = front
        self.document = front.document
        self.token = token
        self.values = Values(seed)
        self.overrides = dict(overrides or {})
        known = {operation.operation_id for operation in front.operations}
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ValueError(
                f"overrides for unknown operations {unknown}; the document has {sorted(known)}"
            )
        for operation in front.operations:
            label = f"{operation.method} {self.base_url}{operation.path} ({operation.operation_id})"
            self._add(
                operation.method,
                _regex_for(self._base_path, operation),
                label,
                _bind(self._answer, operation),
            )

    def describe(self) -> str:
        return f"mock of the bridge's OpenAPI document at {self.base_url}"

    def _answer(self, request: httpx.Request, operation: Operation) -> Any:
        incoming = self.incoming(request)
        verdict = self.front.check(incoming)
        if verdict.error is not None:
            return _error_response(verdict.error)
        override = self.overrides.get(operation.operation_id)
        if override is not None:
            result = override(request, **verdict.params) if callable(override) else override
            if isinstance(result, httpx.Response):
                return result
            return _response(Reply.of_json(operation.success_status, result))
        with self._lock:
            return self.example(operation, verdict.params, incoming)

    def example(
        self, operation: Operation, params: Mapping[str, str], incoming: Incoming
    ) -> httpx.Response:
        """The example response of `operation` (schema-valid, plausibly the bridge's)."""
        name = operation.operation_id
        status = operation.success_status
        request = incoming.json()
        request = request if isinstance(request, dict) else {}
        ctx = TurnContext(self.values)
        body: Any
        if operation.event_stream:
            return httpx.Response(200, headers=SSE_HEADERS, content=self._example_frames(ctx))
        if name in ("health", "v1_health"):
            body = health_body()
        elif name == "compatibility":
            body = compatibility_body()
        elif name == "openapi":
            body = self.document
        elif name == "create_session":
            body = session_created(self.values, request.get("options"))
        elif name == "list_sessions":
            body = {"sessions": [self._summary()]}
        elif name == "delete_session":
            body = {"status": "deleted", "sessionId": params.get("sessionId")}
        elif name in ("reply_result", "reply_error"):
            body = {"status": "sent", "requestKey": params.get("requestKey")}
        elif name in ("call", "session_call"):
            body = {"result": call_result(params.get("method", ""), request.get("params"), ctx)}
        elif name == "text_turn":
            body = self._text_turn(request, ctx)
        elif name == "events":
            after = incoming.query.get("after")
            body = self._event(ctx, int(after) + 1 if after is not None else 1)
        else:
            schema = operation.response_schema
            body = conform({}, MISSING, schema, self.front.schemas, self.values, subset=True)
        return _response(Reply.of_json(status, body))

    def _summary(self) -> dict[str, Any]:
        """A running session's, with no events yet."""
        created = self.values.timestamp()
        session_id = self.values.uuid4()
        return SessionPlan(session_id, TurnContext(self.values), created_at=created).summary()

    def _event(self, ctx: TurnContext, seq: int, kind: str = "notification") -> dict[str, Any]:
        method = None if kind == "exit" else "thread/status/changed"
        return {
            "seq": seq,
            "kind": kind,
            "method": method,
            "params": event_params(method, kind, ctx, None),
            "requestKey": None,
            "receivedAt": self.values.timestamp(),
        }

    def _example_frames(self, ctx: TurnContext) -> bytes:
        kinds = ((1, "notification"), (2, "exit"))
        return b"".join(sse_frame(self._event(ctx, seq, kind)) for seq, kind in kinds)

    def _text_turn(self, request: dict[str, Any], ctx: TurnContext) -> dict[str, Any]:
        from fakes.app_server.server import default_reply_text

        text = default_reply_text([{"type": "text", "text": request.get("text", "")}])
        body = text_turn_body(text, ctx)
        if request.get("includeEvents"):
            body["events"] = [self._event(ctx, 1)]
        return body


def _regex_for(base_path: str, operation: Operation) -> re.Pattern[str]:
    return re.compile(re.escape(base_path) + operation.pattern.pattern.removeprefix("^"))


def openapi_router(
    source: str | Mapping[str, Any] = "trusted",
    *,
    token: str | None = None,
    exempt_health: bool = True,
    limits: RestLimits | Mapping[str, Any] | None = None,
    base_url: str = DEFAULT_BASE_URL,
    overrides: Mapping[str, Override] | None = None,
    assert_all_called: bool = False,
    seed: int = 0,
) -> OpenApiRouter:
    """A respx router with one route per operation of an OpenAPI document.

    `source` is a preset name (`trusted`, `default`, `text-turn`: the document that
    preset serves, with bearer auth when `token` is given) or an OpenAPI document (as
    `bridge.openapi.build_openapi` returns it; give `token` when it requires one).
    `overrides` maps operationIds to a response: an `httpx.Response`, a JSON value
    (sent with the documented success status) or a callable
    `(request, **path_params) -> either`.
    """
    rest_limits = _limits(limits)
    if isinstance(source, str):
        if source not in PRESETS:
            raise ValueError(f"unknown preset {source!r}; use one of {sorted(PRESETS)}")
        front = BridgeFront.for_preset(
            source, token=token, exempt_health=exempt_health, limits=rest_limits
        )
    else:
        front = BridgeFront(source, token=token, limits=rest_limits)
    return OpenApiRouter(
        front,
        base_url=base_url,
        token=token,
        overrides=overrides,
        assert_all_called=assert_all_called,
        seed=seed,
    )


def _limits(limits: RestLimits | Mapping[str, Any] | None) -> RestLimits | None:
    if limits is None or isinstance(limits, RestLimits):
        return limits
    return RestLimits(**{to_snake(key): value for key, value in dict(limits).items()})
