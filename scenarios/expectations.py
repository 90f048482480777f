"""Expectations: what a response or a run of events must look like, and the problems.

They take plain values (an `Exchange`, a list of events) and a `sub` filling in
`${variables}`; with what a step sends (`step_request`) and where a read stops
(`ReadGoal`), they let the runner, the respx mock and the tests read steps alike.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from multidict import CIMultiDictProxy

from bridge.route_paths import route_path
from scenarios import format as f
from scenarios.harness import bearer
from scenarios.matching import MISSING, Mismatch, diff, match, match_jsonpath, render
from scenarios.sse import SseFrame

#: A body that is not JSON (or no body).
NO_JSON: Any = object()
Sub = Callable[[Any], Any]


def _same(value: Any) -> Any:
    return value


@dataclass
class Problem:
    """One failed expectation: where in the file, what, and a diff when one helps."""

    loc: tuple[Any, ...]
    message: str
    diff: str | None = None
    detail: str | None = None


@dataclass
class Exchange:
    """A complete HTTP response."""

    method: str
    path: str
    status: int
    headers: CIMultiDictProxy[str]
    text: str
    json: Any = NO_JSON


def http_problems(
    expect: f.HttpExpect | None, ex: Exchange, default_status: Any, sub: Sub = _same
) -> list[Problem]:
    """How `ex` fails `expect` (status defaults to `default_status`, or non-2xx with `error`)."""
    expect = expect or f.HttpExpect()
    problems: list[Problem] = []
    status = expect.status if expect.status is not None else default_status
    if expect.status is None and expect.error is not None:
        status = "non-2xx"
    if not _status_ok(status, ex.status):
        wrong = f"expected status {status}, received {ex.status}"
        problems.append(Problem(("expect", "status"), wrong, detail=f"body: {cut(ex.text, 2000)}"))
    for name, expected in (expect.headers or {}).items():
        found = match(sub(expected), ex.headers.get(name, MISSING), subset=False, path=name)
        problems += [Problem(("expect", "headers", name), f"header {m}") for m in found]
    body_json = ex.json
    needs_json = expect.given("json_body") or expect.json_subset is not None or expect.json_path
    if needs_json and body_json is NO_JSON:
        text = cut(ex.text, 500) or "(empty)"
        return [*problems, Problem(("expect",), f"the body is not JSON: {text}")]
    if expect.given("json_body"):
        problems += _compare(("expect", "json"), sub(expect.json_body), body_json, False)
    if expect.json_subset is not None:
        problems += _compare(("expect", "jsonSubset"), sub(expect.json_subset), body_json, True)
    for expression, expected in (expect.json_path or {}).items():
        found = match_jsonpath(sub(expression), sub(expected), body_json)
        problems += [Problem(("expect", "jsonPath", expression), str(m)) for m in found]
    if expect.body is not None:
        found = match(sub(expect.body), ex.text, subset=False, path="body")
        problems += [Problem(("expect", "body"), str(m)) for m in found]
    if expect.error is not None:
        problems += error_problems(sub(expect.error), ex)
    return problems


def error_problems(expected: Any, ex: Exchange) -> list[Problem]:
    """`ex` must carry the bridge's error payload, matching `expected` (a kind or a subset)."""
    loc = ("expect", "error")
    payload = ex.json
    if not isinstance(payload, dict) or not all(
        isinstance(payload.get(key), str) for key in ("error", "message")
    ):
        received = f"{ex.status} {cut(ex.text, 500)}"
        return [
            Problem(
                loc,
                f"expected the error payload {{error, message, code?, data?}}, received {received}",
            )
        ]
    if 200 <= ex.status < 300:
        return [Problem(loc, f"expected an error status, received {ex.status}")]
    if isinstance(expected, str):
        expected = {"error": expected}
    return _compare(loc, expected, payload, True)


def events_problems(
    expect: f.EventsExpect,
    events: list[Any],
    ids: list[Any] | None = None,
    kinds: list[Any] | None = None,
    sub: Sub = _same,
) -> list[Problem]:
    """How the events read fail `expect`; `ids` and `kinds` are the SSE frames' (by
    default the events' own `seq` and `kind`, as a long-poll reads them)."""
    if ids is None:
        ids = [event.get("seq") for event in events]
    if kinds is None:
        kinds = [event.get("kind") for event in events]
    problems: list[Problem] = []
    listing = event_list(events)
    length = None if expect.events is None else len(expect.events)
    for key, want in (("count", expect.count), ("events", length)):
        if want is not None and len(events) != want:
            counted = f"expected {want} events, read {len(events)}"
            problems.append(Problem(("expect", key), counted, detail=listing))
    for index, (item, event) in enumerate(zip(expect.events or [], events, strict=False)):
        expected = event_matcher(sub(item))
        if mismatches := match(expected, event, subset=True, path=f"events[{index}]"):
            line = f"event {index + 1} ({event_line(event, 80)}) does not match: {mismatches[0]}"
            shown = diff(expected, event, subset=True)
            problems.append(Problem(("expect", "events", index), line, diff=shown))
            break
    if expect.subsequence is not None:
        position = start = 0
        for index, item in enumerate(expect.subsequence):
            expected = event_matcher(sub(item))
            while position < len(events) and match(expected, events[position], subset=True):
                position += 1
            if position >= len(events):
                message = f"no event matching {render(expected)}"
                if index:
                    matched = event_name(events[start - 1]).split(" ")[0]
                    message += f" after {matched} (the event subsequence[{index - 1}] matched)"
                else:
                    message += " was read"
                near, nearest = _nearest(expected, events[start:])
                loc = ("expect", "subsequence", index)
                problems.append(Problem(loc, message + near, diff=nearest, detail=listing))
                break
            position += 1
            start = position
    for index, item in enumerate(expect.absent or []):
        expected = event_matcher(sub(item))
        hits = [event for event in events if not match(expected, event, subset=True)]
        if hits:
            hit = f"expected no event matching {render(expected)}, read {event_line(hits[0])}"
            problems.append(Problem(("expect", "absent", index), hit))
    methods = [event.get("method") if isinstance(event, dict) else None for event in events]
    listed: tuple[tuple[str, list[Any] | None, list[Any]], ...] = (
        ("kinds", expect.kinds, kinds),
        ("methods", expect.methods, methods),
    )
    for key, names, read in listed:
        if names is not None and list(names) != read:
            found = f"expected {key} {render(list(names), 600)}, read {render(read, 600)}"
            problems.append(Problem(("expect", key), found))
    if expect.ids is not None:
        problems += ids_problems(expect.ids, ids, sub)
    return problems


def ids_problems(spec: Any, raw_ids: list[Any], sub: Sub = _same) -> list[Problem]:
    """`ids:` a list of ids, `consecutive`, or `{first, after, consecutive}`."""
    loc = ("expect", "ids")
    ids = [int_or_none(value) for value in raw_ids]
    if isinstance(spec, list):
        wanted = [int_or_none(sub(value)) for value in spec]
        return [] if wanted == ids else [Problem(loc, f"expected ids {wanted}, read {ids}")]
    if spec == "consecutive":
        spec = f.IdsSpec()
    if any(value is None for value in ids):
        return [Problem(loc, f"every frame needs a numeric id; read {raw_ids}")]
    problems = []
    first = int_or_none(sub(spec.first))
    after = int_or_none(sub(spec.after))
    if ids and first is not None and ids[0] != first:
        problems.append(Problem(loc, f"expected the first id {first}, read {ids[0]}"))
    if ids and after is not None and ids[0] != after + 1:
        problems.append(Problem(loc, f"expected the first id right after {after}, read {ids[0]}"))
    gaps = [(a, b) for a, b in itertools.pairwise(ids) if b != a + 1]  # type: ignore[operator]
    if spec.consecutive and gaps:
        (a, b), *_ = gaps
        problems.append(Problem(loc, f"ids are not consecutive: {a} then {b} ({ids})"))
    return problems


def substitute(value: Any, lookup: Callable[[str], Any]) -> Any:
    """`value` with each `${name}` replaced by `lookup(name)` (`$${` stands for `${`); a
    string that is one placeholder keeps the variable's type."""
    if isinstance(value, str):
        if "$" not in value:
            return value
        whole = f.VARIABLE.fullmatch(value)
        if whole:
            return lookup(whole.group(1))
        text = f.VARIABLE.sub(lambda m: as_text(lookup(m.group(1))), value)
        return text.replace("$${", "${")
    if isinstance(value, dict):
        return {key: substitute(item, lookup) for key, item in value.items()}
    if isinstance(value, list):
        return [substitute(item, lookup) for item in value]
    return value


@dataclass
class StepRequest:
    """An HTTP request a step sends, `${variables}` filled in; `auth` as a step gives it
    (True: the bridge's token, False: none, a string: that token)."""

    method: str
    path: str
    auth: Any = True
    query: dict[str, Any] | None = None
    headers: dict[str, str] | None = None
    json_body: Any = NO_JSON
    body: str | None = None

    def encoded(self, token: str | None) -> tuple[dict[str, str], dict[str, str], bytes | None]:
        """The headers, query parameters and body bytes sent (`token`: the bridge's)."""
        headers = {**bearer(self.auth, token), **(self.headers or {})}
        query = {key: as_text(value) for key, value in (self.query or {}).items()}
        content = None
        if self.json_body is not NO_JSON:
            content = orjson.dumps(self.json_body)
            headers.setdefault("Content-Type", "application/json")
        elif self.body is not None:
            content = self.body.encode()
        return headers, query, content


def step_request(step: Any, sub: Sub) -> StepRequest:
    """The request an `http`, `call`, `createSession`, `reply` or `stream` step sends."""
    if isinstance(step, f.HttpStep):
        http = step.http
        return StepRequest(
            http.method.upper(),
            as_text(sub(http.path)),
            sub(http.auth),
            query=sub(http.query),
            headers=sub(http.headers),
            json_body=sub(http.json_body) if http.given("json_body") else NO_JSON,
            body=sub(http.body),
        )
    if isinstance(step, f.CallStep):
        call = step.call
        session = sub(call.session)
        method = as_text(sub(call.method))
        path = (
            route_path("session_call", sessionId=as_text(session), method=method)
            if session
            else route_path("call", method=method)
        )
        body: dict[str, Any] = {}
        if call.given("params"):
            body["params"] = sub(call.params)
        if call.timeout_ms is not None:
            body["timeoutMs"] = call.timeout_ms
        if call.options is not None:
            body["options"] = sub(call.options)
        return StepRequest("POST", path, sub(call.auth), json_body=body)
    if isinstance(step, f.CreateSessionStep):
        create = step.create_session
        body = {"options": sub(create.options)} if create.options is not None else {}
        return StepRequest("POST", route_path("create_session"), sub(create.auth), json_body=body)
    if isinstance(step, f.ReplyStep):
        reply = step.reply
        key = {"sessionId": reply.session, "requestKey": reply.request_key}
        key = {name: as_text(sub(value)) for name, value in key.items()}
        if reply.error is not None:
            route, body = "reply_error", sub(reply.error.model_dump(exclude_unset=True))
        else:
            route, body = "reply_result", {"result": sub(reply.result)}
        return StepRequest("POST", route_path(route, **key), sub(reply.auth), json_body=body)
    if isinstance(step, f.StreamStep):
        stream = step.stream
        if stream.session is not None:
            path = route_path("events_stream", sessionId=as_text(sub(stream.session)))
        else:
            path = sub(stream.path)
        headers = dict(sub(stream.headers or {}))
        if stream.last_event_id is not None:
            headers["Last-Event-ID"] = as_text(sub(stream.last_event_id))
        query = {"after": as_text(sub(stream.after))} if stream.after is not None else {}
        return StepRequest("GET", as_text(path), sub(stream.auth), query=query, headers=headers)
    raise TypeError(f"a {type(step).__name__} sends no single request")


def default_status(step: Any) -> Any:
    """The status a request step's response has when its `expect` names none."""
    if isinstance(step, f.CreateSessionStep):
        return 201
    return 200 if isinstance(step, f.ReplyStep) else "2xx"


@dataclass
class ReadGoal:
    """Where a `poll` or `read` step stops: at the first event matching `through`, after
    `want` events, or (neither: `toEnd`) at the end of the stream."""

    through: Any
    want: int | None

    @classmethod
    def of(cls, spec: f.PollSpec | f.ReadSpec, sub: Sub) -> ReadGoal:
        through = event_matcher(sub(spec.through)) if spec.through is not None else None
        one = None if through is not None or getattr(spec, "to_end", False) else 1
        return cls(through, spec.count if spec.count is not None else one)

    def wanted(self, noun: str) -> str:
        """What the read waits for, in words (`noun`: event, frame)."""
        if self.want is not None:
            return f"{self.want} {noun}s"
        return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun} matching {render(self.through)}"

    def reached(self, read: list[Any]) -> bool:
        """Whether a read that got `read` (at least one event) stops there."""
        if self.through is not None and not match(self.through, read[-1], subset=True):
            return True
        return self.want is not None and len(read) >= self.want


def as_text(value: Any) -> str:
    """`value` as a path segment, a query value or a header: JSON text but for strings."""
    if isinstance(value, str):
        return value
    return "" if value is None else orjson.dumps(value).decode()


def cut(text: str, limit: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else f"{text[:limit]}... (+{len(text) - limit} characters)"


def int_or_none(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def event_matcher(value: Any) -> Any:
    """A bare string matches the event's method."""
    return {"method": value} if isinstance(value, str) else value


def frame_event(frame: SseFrame) -> Any:
    try:
        return frame.json()
    except ValueError:
        return NO_JSON


def event_name(event: Any) -> str:
    if not isinstance(event, dict):
        return render(event, 60)
    key = f" requestKey={event['requestKey']}" if event.get("requestKey") else ""
    return f"#{event.get('seq')} {event.get('kind')} {event.get('method')}{key}"


def event_line(event: Any, limit: int = 160) -> str:
    if not isinstance(event, dict):
        return render(event, limit)
    return f"{event_name(event)} {render(event.get('params'), limit)}"


def event_list(events: list[Any]) -> str:
    if not events:
        return "read: (nothing)"
    lines = [f"read {len(events)}:"]
    shown = events if len(events) <= 40 else [*events[:10], None, *events[-29:]]
    for event in shown:
        lines.append(
            f"  ... {len(events) - 39} more ..." if event is None else f"  {event_line(event)}"
        )
    return "\n".join(lines)


def _nearest(expected: Any, events: list[Any]) -> tuple[str, str | None]:
    """The closest miss among events of the expected method (or kind), diffed."""
    wanted = expected if isinstance(expected, dict) else {}
    key = next((k for k in ("method", "kind") if isinstance(wanted.get(k), str)), None)
    if key is None:
        return "", None
    name = wanted[key]
    alike = [e for e in events if isinstance(e, dict) and e.get(key) == name]
    if not alike:
        return f"; no {name} at all", None
    event = min(alike, key=lambda e: len(match(expected, e, subset=True)))  # the first of ties
    first = match(expected, event, subset=True)[0]
    return f"; the closest, {event_name(event)}, differs {first}", diff(
        expected, event, subset=True
    )


def _status_ok(expected: Any, actual: int) -> bool:
    if expected == "non-2xx":
        return not 200 <= actual < 300
    if isinstance(expected, list):
        return actual in expected
    if isinstance(expected, str):  # 404, or a class: 4xx
        return re.fullmatch(expected.replace("x", "[0-9]"), str(actual)) is not None
    return bool(actual == expected)


def _compare(loc: tuple[Any, ...], expected: Any, actual: Any, subset: bool) -> list[Problem]:
    mismatches: list[Mismatch] = match(expected, actual, subset=subset)
    if not mismatches:
        return []
    shown = "; ".join(str(m) for m in mismatches[:3])
    more = f" (and {len(mismatches) - 3} more)" if len(mismatches) > 3 else ""
    return [Problem(loc, f"{shown}{more}", diff=diff(expected, actual, subset=subset))]
