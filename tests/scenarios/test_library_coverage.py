"""The scenario library covers the HTTP contract, cell by cell.

The coverage matrix is derived from the code wherever the code holds the list: the
presets and the routes each one mounts (`bridge.app`), each route's success statuses
and query parameters (`Route`), the error kinds (the error table of `bridge.errors`,
with the `data.reason`s each may carry), the approval policies and the kinds of approval request
(`bridge.models`, `bridge.process.text_turn`), the event kinds, the health paths
exempt from auth and every field of `RestLimits`. The header variants of spec
section 5 are listed here, and checked against the bridge's own parser.

The library is read, not run: each step of each scenario becomes the request it
makes and what it expects back (or, for `poll` and `read`, the events it expects),
and a cell is covered only by a step that would fail if the bridge got that cell
wrong. So a new route, preset, error kind, limit or policy fails this test, naming
the cell, until a scenario in `scenarios/library/` exercises it, or `ALLOWED_GAPS`
says why none can.

`python tests/scenarios/test_library_coverage.py` prints the matrix and where each
cell is covered.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic.alias_generators import to_camel

import bridge
import bridge.app
from bridge import errors as bridge_errors
from bridge.app import PRESETS, ROUTES, Route, mounted_routes
from bridge.auth import HEALTH_PATHS, presented_token
from bridge.events import EventKind
from bridge.limits import RestLimits
from bridge.models import ApprovalPolicy, TextTurnRequest
from bridge.openapi import openapi_path
from bridge.process.text_turn import LEGACY_APPROVALS, PERMISSIONS_APPROVAL, V2_APPROVALS
from bridge.route_paths import path_pattern, route_path
from scenarios import format as f
from scenarios.expectations import step_request

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "scenarios" / "library"

#: Cells no scenario can exercise, and why. A listed cell that the library does cover
#: fails the test too, so the list cannot go stale.
ALLOWED_GAPS: dict[str, str] = {
    # The format builds its bridge from `bridge.preset` (trusted, default, text-turn).
    # tests/bridge/test_host_backend.py covers a host backend.
    "preset backend_app": "a caller-provided backend is host Python code; YAML cannot supply one",
    # Spec section 5 rule 2 is about configuring, not serving: there is no bridge to send
    # requests to, and the format refuses `token: " "` when it loads a scenario.
    # tests/bridge/test_auth.py covers it.
    "auth a blank configured token fails at construction": "no bridge exists to send requests to",
    # The error middleware's last line of defence: no request reaches it by design, and
    # tests/reliability/test_fuzz.py checks that none of its cases does.
    "error 500 internal_error": "only a bug in the bridge produces it",
    # Kinds `from_http_exception` gives to aiohttp's own exceptions, which aiohttp does
    # not raise for these routes (it does raise 400, 404, 405 and 413, all covered).
    "error 403 forbidden": "aiohttp never raises HTTPForbidden for the bridge's routes",
    # Answered by the replay server (rest-bridge-scenarios replay), never by the bridge;
    # tests/scenarios/test_replay_server.py covers it.
    "error 404 not_recorded": "only the replay server answers it, never a bridge",
    # A step sends its whole body at once; tests/reliability/test_misbehaving_clients.py
    # sends one that never completes.
    "error 408 request_timeout": "a scenario cannot send a body slowly",
    # A draining replica (SIGUSR1) or a front whose replica is down: a scenario runs one
    # bridge and cannot signal it. tests/bridge/test_replica.py (draining) and
    # tests/reliability/test_cluster.py (nginx, a replica killed or drained) cover it.
    "error 503 replica_unavailable": "a scenario cannot drain its bridge or stop a replica",
    "limit bodyTimeoutMs": "a scenario cannot send a body slowly",
    # tests/bridge/test_server.py sends a head that never completes.
    "limit headerTimeoutMs": "a scenario cannot send a request head slowly",
    # tests/reliability/test_streams.py has a client that stops reading its socket.
    "limit readerStallMs": "a scenario's streams are always read as fast as they come",
    # The probe watches the supervised shared app-server only; a scenario names no mode
    # (test_library_shared_mode.py runs the library in shared mode from outside), and a
    # scripted stall stops one connection, never the process the probe asks.
    # tests/bridge/test_shared_supervised.py and tests/e2e/test_shared_mode.py SIGSTOP it.
    "limit livenessIntervalMs": "a scenario cannot choose shared mode nor stop the process",
    "limit livenessTimeoutMs": "a scenario cannot choose shared mode nor stop the process",
}

ANY_STATUS = frozenset(range(100, 600))
SUCCESS = frozenset(range(200, 300))
#: What a `${variable}` in a path stands for: one path segment.
PLACEHOLDER = "VAR"


# -- reading the library ----------------------------------------------------------------


@dataclass
class Request:
    """One request a step makes, and what the step expects of its response."""

    scenario: f.Scenario
    where: str
    method: str
    path: str
    query: frozenset[str]
    #: Lower-case names; `authorization` as the runner sends it.
    headers: dict[str, str]
    body: Any
    #: The statuses the step accepts.
    statuses: frozenset[int]
    expect: f.HttpExpect | f.EventsExpect | None
    #: The route `method path` reaches, whether or not the preset mounts it.
    route: Route | None
    #: Some route has this path (for this method or another).
    path_known: bool

    @property
    def preset(self) -> str:
        return self.scenario.bridge.preset

    @property
    def token(self) -> str | None:
        return self.scenario.bridge.token

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")

    @property
    def kind(self) -> str | None:
        """The error kind the step expects, if it names one."""
        expect = self.expect
        if expect is None:
            return None
        if isinstance(expect.error, str):
            return expect.error
        if isinstance(expect.error, dict) and isinstance(expect.error.get("error"), str):
            return str(expect.error["error"])
        if isinstance(expect, f.HttpExpect):
            for body in (expect.json_body, expect.json_subset):
                if isinstance(body, dict) and isinstance(body.get("error"), str):
                    return str(body["error"])
        return None

    def named(self, *names: str) -> bool:
        return self.route is not None and self.route.name in names

    def succeeds(self) -> bool:
        return bool(self.statuses) and self.statuses <= SUCCESS

    def only(self, status: int) -> bool:
        return self.statuses == {status}


@dataclass
class Read:
    """A `poll` or `read` step: the events it expects, by long-poll or from a stream."""

    scenario: f.Scenario
    where: str
    transport: str  # long-poll | sse
    expect: f.EventsExpect | None

    def expects_kind(self, kind: str) -> bool:
        values = dump(self.expect)
        return kind in values.get("kinds", []) or any(
            isinstance(v, dict) and v.get("kind") == kind for v in walk(values)
        )


@dataclass
class Library:
    #: (file, scenario)
    scenarios: list[tuple[str, f.Scenario]]
    requests: list[Request]
    reads: list[Read]


def statuses(
    expect: f.HttpExpect | f.EventsExpect | None, default: frozenset[int]
) -> frozenset[int]:
    """The statuses a step accepts: its `status`, or non-2xx with `error`, or its default."""
    if expect is None:
        return default
    status = getattr(expect, "status", None)
    if status is None:
        return ANY_STATUS - SUCCESS if expect.error is not None else default
    if isinstance(status, int):
        return frozenset({status})
    if isinstance(status, list):
        return frozenset(status)
    first = int(status[0]) * 100
    return frozenset(range(first, first + 100))


def resolve(text: str, token: str | None) -> str:
    """`${token}` is known; every other variable stands for a path segment."""
    if token is not None:
        text = text.replace("${token}", token)
    return f.VARIABLE.sub(PLACEHOLDER, text)


def sent_headers(
    headers: dict[str, str] | None, auth: f.AuthSpec, token: str | None
) -> dict[str, str]:
    """A request's headers (lower-case names), `Authorization` as the runner sends it."""
    sent = {name.lower(): resolve(value, token) for name, value in (headers or {}).items()}
    if "authorization" not in sent and auth is not False:
        presented = resolve(auth, token) if isinstance(auth, str) else token
        if presented:
            sent["authorization"] = f"Bearer {presented}"
    return sent


@cache
def route_patterns() -> tuple[tuple[Route, re.Pattern[str]], ...]:
    return tuple((route, path_pattern(route.path)) for route in ROUTES)


def find_route(method: str, path: str) -> tuple[Route | None, bool]:
    """The route `method path` reaches, and whether any route has that path."""
    path = re.sub("%2f", "/", path, flags=re.IGNORECASE)
    on_path = [route for route, pattern in route_patterns() if pattern.match(path)]
    same = [route for route in on_path if route.method == method]
    return (same[0] if same else None), bool(on_path)


def unchanged(value: Any) -> Any:
    """No substitution: the library's requests as written, `${...}` and all."""
    return value


def read_file(path: Path, library: Library) -> None:
    source = str(path.relative_to(ROOT))
    loaded = f.parse_scenario_text(path.read_text(encoding="utf-8"), source, path)
    scenario = loaded.scenario
    token = scenario.bridge.token
    library.scenarios.append((source, scenario))
    background: dict[str, Request] = {}

    def request(
        index: int,
        method: str,
        target: str,
        expect: f.HttpExpect | f.EventsExpect | None,
        default: frozenset[int],
        headers: dict[str, str],
        query: set[str] | None = None,
        body: Any = None,
    ) -> Request:
        target, _, raw_query = resolve(target, token).partition("?")
        names = set(query or ()) | {p.split("=")[0] for p in raw_query.split("&") if p}
        route, known = find_route(method.upper(), target)
        return Request(
            scenario,
            loaded.where(("steps", index)),
            method.upper(),
            target,
            frozenset(names),
            headers,
            body,
            statuses(expect, default),
            expect,
            route,
            known,
        )

    for index, step in enumerate(scenario.steps):
        made: Request | None = None
        if isinstance(step, f.HttpStep):
            http = step.http
            headers = sent_headers(http.headers, http.auth, token)
            query = set(http.query or ())
            target = http.path
            made = request(index, http.method, target, step.expect, SUCCESS, headers, query)
            made.body = http.json_body
        elif isinstance(step, f.CallStep):
            call = step.call
            target = step_request(step, unchanged).path
            body = {"params": call.params, "options": call.options}
            headers = sent_headers(None, call.auth, token)
            made = request(index, "POST", target, step.expect, SUCCESS, headers, None, body)
        elif isinstance(step, f.CreateSessionStep):
            create = step.create_session
            headers = sent_headers(None, create.auth, token)
            body = {"options": create.options}
            target = step_request(step, unchanged).path
            made = request(
                index, "POST", target, step.expect, frozenset({201}), headers, None, body
            )
        elif isinstance(step, f.ReplyStep):
            reply = step.reply
            target = step_request(step, unchanged).path
            body = {"result": reply.result} if reply.error is None else reply.error.model_dump()
            headers = sent_headers(None, reply.auth, token)
            made = request(
                index, "POST", target, step.expect, frozenset({200}), headers, None, body
            )
        elif isinstance(step, f.PollStep):
            poll = step.poll
            library.reads.append(
                Read(scenario, loaded.where(("steps", index)), "long-poll", step.expect)
            )
            if poll.count == 0 and (step.expect is None or step.expect.quiet_ms is None):
                continue  # it sends nothing
            query = {"waitMs"} | ({"after"} if poll.after is not None else set())
            target = route_path("events", sessionId=poll.session)
            headers = sent_headers(None, poll.auth, token)
            # It passes once it has read its events (200s; a 204 only means "ask again"),
            # or, reading none, on a quiet 204.
            default = frozenset({204} if poll.count == 0 else {200})
            made = request(index, "GET", target, step.expect, default, headers, query)
        elif isinstance(step, f.StreamStep):
            stream = step.stream
            headers = sent_headers(stream.headers, stream.auth, token)
            if stream.last_event_id is not None:
                headers["last-event-id"] = str(stream.last_event_id)
            target = step_request(step, unchanged).path
            query = {"after"} if stream.after is not None else set()
            made = request(index, "GET", target, step.expect, frozenset({200}), headers, query)
        elif isinstance(step, f.ReadStep):
            library.reads.append(Read(scenario, loaded.where(("steps", index)), "sse", step.expect))
        elif isinstance(step, f.AwaitStep):
            made = background.pop(step.await_.request)
            made.expect = step.expect
            made.statuses = statuses(step.expect, SUCCESS)
            made.where = loaded.where(("steps", index))
        if made is None:
            continue
        if isinstance(step, f.HttpStep | f.CallStep) and step.background is not None:
            background[step.background] = made
        else:
            library.requests.append(made)


@cache
def library() -> Library:
    files = sorted(LIBRARY.glob("*.scenario.yaml"))
    assert files, f"no scenarios in {LIBRARY}"
    found = Library([], [], [])
    for path in files:
        read_file(path, found)
    return found


def walk(value: Any) -> Iterator[Any]:
    """`value` and everything nested in it."""
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)


def dump(expect: Any) -> dict[str, Any]:
    return expect.model_dump(by_alias=True, exclude_none=True) if expect is not None else {}


def mentions(expect: Any, **pairs: Any) -> bool:
    """Some mapping in the expectations has all these keys and values."""
    return any(
        isinstance(v, dict) and all(k in v and v[k] == want for k, want in pairs.items())
        for v in walk(dump(expect))
    )


# -- cells ---------------------------------------------------------------------------------


@dataclass
class Cell:
    """One thing the library must exercise, and how to find the steps that do."""

    section: str
    name: str
    find: Callable[[Library], list[str]]

    @property
    def key(self) -> str:
        return f"{self.section} {self.name}"


def on_requests(section: str, name: str, covers: Callable[[Request], bool]) -> Cell:
    return Cell(section, name, lambda lib: [r.where for r in lib.requests if covers(r)])


def on_reads(section: str, name: str, covers: Callable[[Read], bool]) -> Cell:
    return Cell(section, name, lambda lib: [r.where for r in lib.reads if covers(r)])


def preset_functions() -> dict[str, Callable[..., Any]]:
    """Every preset `bridge.app` offers: its public `*_app` builders."""
    return {
        name: function
        for name, function in inspect.getmembers(bridge.app, inspect.isfunction)
        if name.endswith("_app") and name != "create_app" and function.__module__ == "bridge.app"
    }


def preset_cells() -> list[Cell]:
    names = {function: preset for preset, function in PRESETS.items()}
    cells = []
    for name, function in preset_functions().items():

        def uses(lib: Library, preset: str | None = names.get(function)) -> list[str]:
            return [source for source, s in lib.scenarios if s.bridge.preset == preset]

        cells.append(Cell("preset", name, uses))
    return cells


def route_cells() -> list[Cell]:
    """Each route of each preset: served when mounted, else a 404 not_found."""
    cells = []
    for preset, build in PRESETS.items():
        mounted = {route.name for route in mounted_routes(build(["codex", "app-server"], None))}
        for route in ROUTES:
            label = f"{preset}: {route.method} {openapi_path(route.path)}"
            if route.name in mounted:

                def served(r: Request, route: Route = route, preset: str = preset) -> bool:
                    return r.preset == preset and r.route is route and r.succeeds()

                cells.append(on_requests("route", f"{label} served", served))
            else:

                def refused(r: Request, route: Route = route, preset: str = preset) -> bool:
                    return (
                        r.preset == preset
                        and r.route is route
                        and r.only(404)
                        and r.kind == "not_found"
                    )

                cells.append(on_requests("route", f"{label} not mounted (404)", refused))
    return cells


def status_cells() -> list[Cell]:
    """Each route's success status and its other documented ones (the long-poll's 204)."""
    cells = []
    for route in ROUTES:
        for status in (route.status, *route.extra_statuses):

            def answers(r: Request, route: Route = route, status: int = status) -> bool:
                return r.route is route and r.only(status)

            cells.append(on_requests("status", f"{route.method} {route.path} {status}", answers))
    return cells


def parameter_cells() -> list[Cell]:
    """Each query parameter and header a route documents (waitMs, after, Last-Event-ID)."""
    cells = []
    for route in ROUTES:
        for parameter in route.query:
            header = parameter.header

            def sends(
                r: Request, route: Route = route, name: str = parameter.name, header: bool = header
            ) -> bool:
                sent = name.lower() in r.headers if header else name in r.query
                return r.route is route and sent and r.succeeds()

            where = "header" if header else "query"
            name = f"{route.method} {route.path} {where} {parameter.name}"
            cells.append(on_requests("parameter", name, sends))
    return cells


def error_kinds() -> dict[tuple[int, str], tuple[str, ...]]:
    """(status, kind) → its `data.reason`s, from the error table (`bridge.errors`); the
    kinds only the nginx front answers are not the bridge's to cover."""
    return {
        (entry.status, entry.kind): entry.reasons
        for entry in sorted(bridge_errors.ERROR_KINDS, key=lambda e: (e.status, e.kind))
        if not entry.front_only
    }


def error_cells() -> list[Cell]:
    cells = []
    for (status, kind), reasons in error_kinds().items():

        def expects(r: Request, status: int = status, kind: str = kind) -> bool:
            return r.kind == kind and status in r.statuses

        cells.append(on_requests("error", f"{status} {kind}", expects))
        for reason in reasons:

            def gives(
                r: Request, status: int = status, kind: str = kind, reason: str = reason
            ) -> bool:
                return expects(r, status, kind) and mentions(r.expect, reason=reason)

            cells.append(on_requests("error", f"{status} {kind} data.reason={reason}", gives))
    return cells


# -- auth ----------------------------------------------------------------------------------

#: The header variants of spec section 5: whether each presents the token, and an example
#: for the token "t0ken" (checked against the bridge's own parser).
AUTH_VARIANTS: dict[str, tuple[bool, str | None]] = {
    "no Authorization header": (False, None),
    "another scheme": (False, "Basic t0ken"),
    "no space after the scheme": (False, "Bearert0ken"),
    "a tab instead of the space": (False, "Bearer\tt0ken"),
    "the scheme alone": (False, "Bearer"),
    "an empty token": (False, "Bearer "),
    "a blank token": (False, "Bearer    "),
    "the token without a scheme": (False, "t0ken"),
    "a wrong token of the same length": (False, "Bearer t0kem"),
    "the token in another letter case": (False, "Bearer T0KEN"),
    "the token with characters more": (False, "Bearer t0kenx"),
    "the token with characters less": (False, "Bearer t0ke"),
    "a wrong token of another length": (False, "Bearer x"),
    "the token": (True, "Bearer t0ken"),
    "lower-case scheme": (True, "bearer t0ken"),
    "upper-case scheme": (True, "BEARER t0ken"),
    "mixed-case scheme": (True, "bEaReR t0ken"),
    "spaces around the token": (True, "Bearer   t0ken  "),
}


def auth_variant(header: str | None, token: str) -> str:
    """Which of `AUTH_VARIANTS` `header` is, for a bridge whose token is `token`."""
    if header is None:
        return "no Authorization header"
    if " " not in header:
        if "\t" in header and header.split("\t", 1)[0].lower() == "bearer":
            return "a tab instead of the space"
        if header.lower() == "bearer":
            return "the scheme alone"
        if header.lower().startswith("bearer"):
            return "no space after the scheme"
        return "the token without a scheme" if header == token else "something else"
    scheme, _, rest = header.partition(" ")
    presented = rest.strip()
    if scheme.lower() != "bearer":
        return "another scheme"
    if not presented:
        return "a blank token" if rest else "an empty token"
    if presented == token:
        if presented != rest:
            return "spaces around the token"
        cases = {
            "Bearer": "the token",
            "bearer": "lower-case scheme",
            "BEARER": "upper-case scheme",
        }
        return cases.get(scheme, "mixed-case scheme")
    if presented.lower() == token.lower():
        return "the token in another letter case"
    if len(presented) == len(token):
        return "a wrong token of the same length"
    if presented.startswith(token):
        return "the token with characters more"
    if token.startswith(presented):
        return "the token with characters less"
    return "a wrong token of another length"


def exempt(r: Request) -> bool:
    return r.scenario.bridge.exempt_health and r.method == "GET" and r.path in HEALTH_PATHS


def rejected(r: Request) -> bool:
    """The auth layer must reject it, and the step expects exactly that: 401 unauthorized."""
    if r.token is None or exempt(r) or presented_token(r.authorization) == r.token:
        return False
    # A long-poll's expectation names the kind only: unauthorized is always a 401.
    return r.kind == "unauthorized" and 401 in r.statuses and not r.statuses & SUCCESS


def auth_cells() -> list[Cell]:
    cells = []
    for variant, (accepted, _) in AUTH_VARIANTS.items():

        def shows(r: Request, variant: str = variant, accepted: bool = accepted) -> bool:
            if r.token is None or exempt(r) or auth_variant(r.authorization, r.token) != variant:
                return False
            return r.succeeds() if accepted else rejected(r)

        cells.append(on_requests("auth", variant, shows))
    for path in sorted(HEALTH_PATHS):

        def open_(r: Request, path: str = path) -> bool:
            return r.path == path and exempt(r) and r.token is not None and r.succeeds()

        def closed(r: Request, path: str = path) -> bool:
            return r.path == path and not r.scenario.bridge.exempt_health and rejected(r)

        cells.append(on_requests("auth", f"GET {path} is exempt (exemptHealth: true)", open_))
        cells.append(on_requests("auth", f"GET {path} needs it (exemptHealth: false)", closed))

    def near_health(r: Request) -> bool:
        near = r.path not in HEALTH_PATHS and r.path.startswith(tuple(HEALTH_PATHS))
        return near and rejected(r)

    def other_method(r: Request) -> bool:
        return r.path in HEALTH_PATHS and r.method != "GET" and rejected(r)

    cells.append(on_requests("auth", "only the exact health paths are exempt", near_health))
    cells.append(on_requests("auth", "only GET on the health paths is exempt", other_method))
    for route in ROUTES:
        if route.method == "GET" and route.path in HEALTH_PATHS:
            continue

        def needs(r: Request, route: Route = route) -> bool:
            return r.route is route and rejected(r)

        cells.append(on_requests("auth", f"{route.method} {route.path} needs the token", needs))

    def no_route(r: Request) -> bool:
        return not r.path_known and rejected(r)

    def wrong_method(r: Request) -> bool:
        return r.route is None and r.path_known and rejected(r)

    cells.append(on_requests("auth", "an unknown path is 401, not 404", no_route))
    cells.append(on_requests("auth", "a wrong method is 401, not 405", wrong_method))
    rejection = bridge_errors.unauthorized()

    def in_full(r: Request) -> bool:
        expect = r.expect
        header = rejection.headers["WWW-Authenticate"]
        return (
            rejected(r)
            and isinstance(expect, f.HttpExpect)
            and (expect.headers or {}).get("WWW-Authenticate") == header
            and expect.json_body == rejection.payload()
        )

    cells.append(on_requests("auth", "the 401 in full: WWW-Authenticate, exact payload", in_full))
    cells.append(Cell("auth", "a blank configured token fails at construction", lambda lib: []))
    return cells


# -- approvals, events, limits, crashes -------------------------------------------------------

APPROVAL_METHODS = sorted(V2_APPROVALS | LEGACY_APPROVALS | {PERMISSIONS_APPROVAL})
DEFAULT_POLICY = TextTurnRequest.model_fields["approval_policy"].default


def approval_cells() -> list[Cell]:
    """Decisions a client sends in a session; each text-turn policy on each approval kind."""
    cells = []
    for policy in get_args(ApprovalPolicy):

        def answers(r: Request, policy: str = policy) -> bool:
            result = r.body.get("result") if isinstance(r.body, dict) else None
            decided = isinstance(result, dict) and result.get("decision") == policy
            return r.named("reply_result") and decided and r.succeeds()

        cells.append(on_requests("approval", f"session: the client answers {policy}", answers))
        for method in APPROVAL_METHODS:

            def applies(r: Request, policy: str = policy, method: str = method) -> bool:
                given = isinstance(r.body, dict) and r.body.get("approvalPolicy") == policy
                return (
                    r.named("text_turn")
                    and given
                    and mentions(r.expect, method=method, decision=policy)
                )

            cells.append(on_requests("approval", f"text turn: {policy} answers {method}", applies))

    def by_default(r: Request) -> bool:
        unset = isinstance(r.body, dict) and "approvalPolicy" not in r.body
        return r.named("text_turn") and unset and mentions(r.expect, decision=DEFAULT_POLICY)

    name = f"text turn: no policy given is {DEFAULT_POLICY}"
    cells.append(on_requests("approval", name, by_default))
    return cells


def event_cells() -> list[Cell]:
    """Each kind of event, expected by a long-poll and by a stream."""
    cells = []
    for kind in get_args(EventKind):
        for transport in ("long-poll", "sse"):

            def reads(read: Read, kind: str = kind, transport: str = transport) -> bool:
                return read.transport == transport and read.expects_kind(kind)

            cells.append(on_reads("event", f"{kind} read by {transport}", reads))
    return cells


def limit_cells() -> list[Cell]:
    """Every `RestLimits` field, set to a small value by some scenario."""
    cells = []
    for limit in dataclasses.fields(RestLimits):

        def sets(lib: Library, name: str = limit.name) -> list[str]:
            return [source for source, s in lib.scenarios if getattr(s.bridge.limits, name)]

        cells.append(Cell("limit", to_camel(limit.name), sets))
    return cells


def exits_mid_turn(scenario: f.Scenario) -> bool:
    """The fake's script ends its process inside a turn."""
    if scenario.app_server is None:
        return False
    turns = scenario.app_server.model_dump(by_alias=True, exclude_none=True).get("turns", [])
    return any(isinstance(v, dict) and "exit" in v for v in walk(turns))


def crash_cells() -> list[Cell]:
    def call_fails(r: Request) -> bool:
        died = r.kind == "app_server_exited" and r.only(502)
        return exits_mid_turn(r.scenario) and r.named("session_call") and died

    def log_ends(read: Read) -> bool:
        return exits_mid_turn(read.scenario) and read.expects_kind("exit")

    def turn_fails(r: Request) -> bool:
        died = r.kind == "app_server_exited" and r.only(502)
        return exits_mid_turn(r.scenario) and r.named("text_turn") and died

    def reply_refused(r: Request) -> bool:
        gone = r.kind == "session_exited" and r.only(409)
        return exits_mid_turn(r.scenario) and r.named("reply_result", "reply_error") and gone

    return [
        on_requests(
            "crash", "mid-turn: a waiting session call is 502 app_server_exited", call_fails
        ),
        on_reads("crash", "mid-turn: the log ends with the exit event", log_ends),
        on_requests("crash", "mid-turn: a pending request is gone (409)", reply_refused),
        on_requests("crash", "mid-turn: a text turn is 502 app_server_exited", turn_fails),
    ]


SECTIONS: dict[str, Callable[[], list[Cell]]] = {
    "preset": preset_cells,
    "route": route_cells,
    "status": status_cells,
    "parameter": parameter_cells,
    "error": error_cells,
    "auth": auth_cells,
    "approval": approval_cells,
    "event": event_cells,
    "limit": limit_cells,
    "crash": crash_cells,
}


@cache
def matrix() -> tuple[tuple[Cell, tuple[str, ...]], ...]:
    """Every cell and where the library covers it."""
    lib = library()
    return tuple((cell, tuple(cell.find(lib))) for build in SECTIONS.values() for cell in build())


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("section", list(SECTIONS))
def test_the_library_covers_every_cell(section: str) -> None:
    missing = [
        cell.key
        for cell, found in matrix()
        if cell.section == section and not found and cell.key not in ALLOWED_GAPS
    ]
    assert not missing, (
        f"no scenario in {LIBRARY.relative_to(ROOT)} covers:\n  "
        + "\n  ".join(missing)
        + "\nadd a step that would fail if the bridge got it wrong, or, if no scenario can "
        "express it, list it in ALLOWED_GAPS with the reason"
    )


def test_the_allowed_gaps_are_real_cells_and_still_gaps() -> None:
    found = {cell.key: where for cell, where in matrix()}
    for key, reason in ALLOWED_GAPS.items():
        assert key in found, f"ALLOWED_GAPS names {key!r}, which is no cell of the matrix"
        assert not found[key], (
            f"{key!r} is covered now ({found[key][0]}): drop it from ALLOWED_GAPS"
        )
        assert reason


def test_the_auth_variants_agree_with_the_bridge() -> None:
    for variant, (accepted, example) in AUTH_VARIANTS.items():
        assert auth_variant(example, "t0ken") == variant
        assert (presented_token(example) == "t0ken") is accepted, variant
    for r in library().requests:
        if r.token is not None:
            variant = auth_variant(r.authorization, r.token)
            if variant in AUTH_VARIANTS:
                accepted = presented_token(r.authorization) == r.token
                assert accepted is AUTH_VARIANTS[variant][0], (r.where, variant)


def test_every_request_of_the_library_is_understood() -> None:
    """Each request reaches a route, or is expected to fail as one that reaches none."""
    for r in library().requests:
        if r.route is None:
            assert r.statuses & {401, 404, 405}, f"{r.where}: {r.method} {r.path} is no route"
            assert r.statuses <= ANY_STATUS - SUCCESS, f"{r.where}: {r.method} {r.path} succeeds?"


def test_the_matrix_is_derived_from_the_code() -> None:
    keys = {cell.key for cell, _ in matrix()}
    assert {"preset trusted_bridge_app", "preset default_app", "preset text_turn_app"} <= keys
    assert "route default: POST /v1/call/{method} not mounted (404)" in keys
    assert "status GET /v1/sessions/{sessionId}/events 204" in keys
    assert "parameter GET /v1/sessions/{sessionId}/events/stream header Last-Event-ID" in keys
    assert "error 429 busy" in keys
    assert "error 504 timeout data.reason=idle_without_completion" in keys
    assert "limit maxConcurrentTextTurns" in keys
    assert "approval text turn: acceptForSession answers item/permissions/requestApproval" in keys
    assert len([k for k in keys if k.startswith("route trusted:")]) == len(ROUTES)


def print_matrix() -> None:
    for section in SECTIONS:
        print(f"\n{section}")
        for cell, where in matrix():
            if cell.section != section:
                continue
            if where:
                state = f"covered   {where[0]}" + (
                    f" (+{len(where) - 1})" if len(where) > 1 else ""
                )
            elif cell.key in ALLOWED_GAPS:
                state = f"allowed   {ALLOWED_GAPS[cell.key]}"
            else:
                state = "MISSING"
            print(f"  {cell.name:<70} {state}")


if __name__ == "__main__":
    print_matrix()
