"""A respx mock of the bridge for host code that calls it with httpx, no process at all:
`scenario_router(path)` replays the scenario's cassette (`scenarios.cassette`), what the
real bridge answered, byte for byte. scenarios/README.md ("respx: no process at all")
says how requests are matched and what fails loudly.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import re
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import orjson

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

from scenarios.cassette import (
    Cassette,
    CassetteError,
    Interaction,
    StaleCassette,
    cassette_for,
    json_difference,
)
from scenarios.format import LoadedScenario, load_scenario, parse_scenario
from scenarios.scrub import fill, has_placeholder, replay_values
from scenarios.scrub import pattern as placeholder_pattern

__all__ = ["CassetteError", "ScenarioMockError", "ScenarioRouter", "StaleCassette"]
__all__ += ["UnmatchedRequest", "scenario_router"]


class ScenarioMockError(AssertionError):
    """The host made a request the recording has no answer for."""


class UnmatchedRequest(AllMockedAssertionError, ScenarioMockError):
    """No mocked route matches the request; the message lists every known route."""


#: Set while respx resolves a request for an async client: waits may then await.
#: The longest value of a host's taken for a placeholder (a path is at most 4096 bytes).
MAX_PLACEHOLDER_CHARS = 4096
_ASYNC: contextvars.ContextVar[bool] = contextvars.ContextVar("bridge_mock_async", default=False)
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:?\d\d)?")


class _Target(Pattern):
    """Matches method, origin and the decoded path (`%2F` is `/`, as the bridge routes)."""

    key = "codex_bridge_target"
    lookups = (Lookup.EQUAL,)

    def parse(self, request: httpx.Request) -> Any:
        return request.method, _origin(request.url), request.url.path

    def _eq(self, value: Any) -> Match:
        return Match(bool(self.value == value))


def _origin(url: httpx.URL) -> tuple[str, str, int]:
    return url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80)


class ScenarioRouter(respx.MockRouter):
    """The bridge at `base_url` replaying `cassette` (see `scenario_router`); `token` is the
    scenario's bearer token (None without auth), `unmatched` the requests no route matched."""

    def __init__(
        self,
        loaded: LoadedScenario,
        cassette: Cassette,
        *,
        base_url: str = "http://bridge.test",
        assert_all_called: bool = True,
        check_bodies: bool = True,
        max_idle_polls: int = 20,
        release_timeout: float = 5.0,
    ) -> None:
        parts = urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL, not {base_url!r}")
        # Routes a test adds itself (`bridge.get("/v1/...")`) are relative to the bridge.
        super().__init__(assert_all_called=assert_all_called, base_url=base_url.rstrip("/"))
        self.base_url = base_url.rstrip("/")
        self.loaded, self.cassette, self.token = loaded, cassette, loaded.scenario.bridge.token
        self.check_bodies, self.max_idle_polls = check_bodies, max_idle_polls
        self.release_timeout = release_timeout
        self.unmatched: list[httpx.Request] = []
        self._lock = threading.RLock()
        items = cassette.interactions
        self._made = [threading.Event() for _ in items]  # set once the host made it
        self._read = [0] * len(items)  # SSE bytes the host read
        self._idle: dict[str, int] = {}  # empty long-polls in a row, per path
        self._cursor: dict[str, int] = {}  # per events path: the replay's cursor
        #: What the placeholders are served as (the host's own values, once it sent them).
        self.placeholders = replay_values(loaded.path)
        self._bound: set[str] = set()
        self._seqs = [_seq(item) if item.events and item.status == 200 else 0 for item in items]
        routes: dict[tuple[str, str], list[int]] = {}
        for index, item in enumerate(items):
            routes.setdefault(item.route, []).append(index)
        origin = _origin(httpx.URL(self.base_url))
        for (method, path), indexes in routes.items():
            steps = sorted({step for i in indexes if (step := items[i].step) is not None})
            label = f"{method} {self.base_url}{path}  — {'; '.join(map(self._step, steps))}"
            route = respx.Route(_Target((method, origin, parts.path.rstrip("/") + path)))
            route.side_effect = functools.partial(self._answer, indexes=indexes)
            self.add(route, name=label)

    def resolve(self, request: httpx.Request) -> Any:
        try:
            return super().resolve(request)
        except AllMockedAssertionError:
            raise self._unmatched(request) from None

    async def aresolve(self, request: httpx.Request) -> Any:
        token = _ASYNC.set(True)
        try:
            return await super().aresolve(request)
        except AllMockedAssertionError:
            raise self._unmatched(request) from None
        finally:
            _ASYNC.reset(token)

    def _unmatched(self, request: httpx.Request) -> UnmatchedRequest:
        with self._lock:
            self.unmatched.append(request)
        routes = [f"  {route.name}" for route in self.routes] or ["  (none)"]
        return UnmatchedRequest(
            f"no route of the mocked bridge matches {request.method} {request.url} (mock of "
            f"scenario {self.cassette.scenario} at {self.base_url}); known routes:\n"
            + "\n".join(routes)
        )

    def _step(self, index: int | None) -> str:
        if index is None:
            return "no step"
        step = self.loaded.scenario.steps[index]
        return f"step {index + 1} ({step.title()}, {self.loaded.where(('steps', index))})"

    def _what(self, index: int) -> str:
        item = self.cassette.interactions[index]
        return f"{self._step(item.step)}: {item.method} {item.path}"

    def _answer(self, request: httpx.Request, indexes: list[int]) -> Any:
        items = self.cassette.interactions
        if items[indexes[0]].events and not items[indexes[0]].route[1].endswith("/stream"):
            return self._poll(request, indexes)
        with self._lock:
            unused = [i for i in indexes if not self._made[i].is_set()]
            differences = [(i, self._differences(items[i], request)) for i in unused]
            chosen = next((i for i, why in differences if not why), None)
            if chosen is not None:
                self._learn(items[chosen], request)
                return self._serve(chosen)
        if not differences:
            raise ScenarioMockError(
                f"{request.method} {request.url}: the scenario {self.cassette.scenario} answers "
                f"this route {len(indexes)} time(s) ({'; '.join(self._what(i) for i in indexes)})"
                ", and the host asks again"
            )
        nearest, why = differences[0]
        raise ScenarioMockError(
            f"{request.method} {request.url} is not what the scenario {self.cassette.scenario} "
            f"sends on this route; the next recorded request, {self._what(nearest)}, differs: "
            + "; ".join(why)
        )

    def _poll(self, request: httpx.Request, indexes: list[int]) -> Any:
        """A long-poll gets the next recorded event after its position (`after`, else the
        replay's cursor), however the scenario read it; else a recorded answer to a poll
        like it (409 past the exit, 400, ...); else 204."""
        items = self.cassette.interactions
        after, path = request.url.params.get("after"), items[indexes[0]].route[1]
        auth = request.headers.get("Authorization")
        with self._lock:
            position = self._cursor.get(path, 0) if after is None else _int(after)
            unread = [i for i in indexes if items[i].status == 200 and not self._made[i].is_set()]
            events = [
                i
                for i in unread
                if position is not None
                and items[i].header("Authorization") == auth
                and self._seqs[i] > position
            ]
            waiting = min(events, key=lambda i: (self._seqs[i], i), default=None)
            if waiting is not None and self._released(waiting):
                return self._serve(waiting, None if after is not None else path)
            for i in indexes if waiting is None else ():
                answered = items[i].status not in (200, 204) and not self._made[i].is_set()
                if answered and not self._differences(items[i], request):
                    return self._serve(i)
        if waiting is not None and _ASYNC.get():
            return self._poll_later(request, path if after is None else None, waiting)
        hint = "; ".join(self._differences(items[unread[0]], request)) if unread else ""
        return self._nothing(request, waiting, hint)

    async def _poll_later(self, request: httpx.Request, path: str | None, index: int) -> Any:
        after = self.cassette.interactions[index].after
        if after is not None and not self._made[after].is_set():
            wait = (_int(request.url.params.get("waitMs", "")) or 30_000) / 1000
            await asyncio.to_thread(self._made[after].wait, min(wait, self.release_timeout))
        with self._lock:
            if not self._made[index].is_set() and self._released(index):
                return self._serve(index, path)
        return self._nothing(request, index)

    def _serve(self, index: int, cursor: str | None = None) -> httpx.Response:
        item = self.cassette.interactions[index]
        self._made[index].set()
        self._idle.pop(item.route[1], None)
        if cursor is not None:
            self._cursor[cursor] = self._seqs[index]
        headers = [(key, value) for key, vs in item.response_headers.items() for value in vs]
        body = _raw(item.response_body)
        if not item.marks:
            return httpx.Response(item.status, headers=headers, content=self._filled(body))
        return httpx.Response(item.status, headers=headers, stream=_Replay(self, index, body))

    def _nothing(self, request: httpx.Request, waiting: int | None, hint: str = "") -> Any:
        """A long-poll with no event for it yet: 204, until the host has looped too long."""
        path = request.url.path
        with self._lock:
            self._idle[path] = self._idle.get(path, 0) + 1
            if self._idle[path] <= self.max_idle_polls:
                return httpx.Response(204)
            self._idle.pop(path)
        why = f"the recording has no more answers on it for {request.url.query.decode()!r}"
        if hint and waiting is None:  # e.g. another token than the recorded events'
            why += f"; its next recorded event's request differs: {hint}"
        after = self.cassette.interactions[waiting].after if waiting is not None else None
        if waiting is not None and after is not None:
            why = (
                f"its next recorded answer ({self._what(waiting)}) comes only after "
                f"{self._what(after)}, which the host has not made"
            )
        raise ScenarioMockError(
            f"the host long-polled {path} {self.max_idle_polls + 1} times in a row without an "
            f"event: {why} (scenario {self.cassette.scenario})"
        )

    def _filled(self, recorded: bytes) -> bytes:
        """A recorded answer with its placeholders filled in (bytes that are not UTF-8 as
        they are)."""
        try:
            text = recorded.decode("utf-8")
        except UnicodeDecodeError:
            return recorded
        return fill(text, self.placeholders).encode()

    def _learn(self, item: Interaction, request: httpx.Request) -> None:
        """The host's values of the placeholders in the recorded body it matched (the
        first value each one got stays; one over `MAX_PLACEHOLDER_CHARS` is not taken, so
        that a host cannot make every answer that holds it as long as its request)."""
        try:
            recorded, sent = orjson.loads(_raw(item.body)), orjson.loads(request.read())
        except orjson.JSONDecodeError:
            return
        for text, value in _strings(recorded, sent):
            if (found := placeholder_pattern(text).fullmatch(value)) is not None:
                for name, bound in found.groupdict().items():
                    if name not in self._bound and len(bound) <= MAX_PLACEHOLDER_CHARS:
                        self._bound.add(name)
                        self.placeholders[name] = bound

    def _released(self, index: int) -> bool:
        after = self.cassette.interactions[index].after
        return after is None or self._made[after].is_set()

    def _differences(self, item: Interaction, request: httpx.Request) -> list[str]:
        why = []
        # `waitMs` is the client's choice, unless the bridge refused it.
        recorded = _query(urlsplit(item.path).query, item.status == 400)
        sent = _query(request.url.query.decode(), item.status == 400)
        if recorded != sent:
            why.append(f"query {sent} instead of {recorded}")
        for name in ("Authorization", "Last-Event-ID"):
            value, expected = request.headers.get(name), item.header(name)
            if value != expected:
                shown = "the scenario's token" if name == "Authorization" else repr(expected)
                why.append(
                    f"{name}: {'(none)' if value is None else 'another value'} instead of "
                    f"{'none' if expected is None else shown}"
                )
        difference = _body_difference(item.body, request.read())
        if difference and self.check_bodies:
            why.append(f"the body {difference}")
        return why

    def unserved(self) -> list[str]:
        """The exchanges the host never made (requests never sent, streams not read)."""
        missing = []
        for index, item in enumerate(self.cassette.interactions):
            body = _raw(item.response_body)
            if not self._made[index].is_set() and not (item.events and item.status == 204):
                missing.append(f"{self._what(index)} never requested")
            elif item.marks and self._read[index] < len(body):
                left = body[self._read[index] :].count(b"\n\n")
                missing.append(f"{self._what(index)}: {left} recorded SSE frame(s) never read")
        return missing

    def release(self) -> None:
        """Wake every wait on a request the host has not made: the replay is over (the
        replay server's stop; `unserved` no longer tells what was made)."""
        for made in self._made:
            made.set()

    def assert_all_called(self) -> None:
        if missing := self.unserved():
            raise AssertionError(
                f"scenario {self.cassette.scenario}: {len(missing)} recorded exchange(s) the "
                "host never made (assert_all_called):\n"
                + "\n".join(f"  {line}" for line in missing)
            )


class _Replay(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A recorded SSE body, each part sent once the request it came after was made."""

    def __init__(self, router: ScenarioRouter, index: int, body: bytes) -> None:
        self.router, self.index, self.body = router, index, body
        marks = router.cassette.interactions[index].marks
        ends = [int(offset or 0) for offset, _ in marks[1:]] + [len(body)]
        self.parts = [(int(m[0] or 0), end, m[1]) for m, end in zip(marks, ends, strict=True)]

    def _wait(self, after: int | None) -> None:  # for the request the next part comes after
        router = self.router
        if after is not None and not router._made[after].wait(router.release_timeout):
            raise ScenarioMockError(
                f"the event stream of {router._what(self.index)} goes on only after "
                f"{router._what(after)}; the host did not make it within "
                f"{router.release_timeout} s (scenario {router.cassette.scenario})"
            )

    def _sent(self, start: int, end: int) -> bytes:
        router, item = self.router, self.router.cassette.interactions[self.index]
        with router._lock:
            router._read[self.index] = max(router._read[self.index], end)
            from_cursor = "after=" not in item.path and item.header("Last-Event-ID") is None
            if end == len(self.body) and from_cursor and b"\nevent: exit\n" in self.body:
                # The bridge's rule: a stream from the cursor that ends with the exit
                # event moves the cursor past it (one cut short gives it back).
                last = int(re.findall(rb"^id: (\d+)$", self.body, re.M)[-1])
                path = item.route[1].removesuffix("/stream")
                router._cursor[path] = max(router._cursor.get(path, 0), last)
            return router._filled(self.body[start:end])

    def __iter__(self) -> Iterator[bytes]:
        for start, end, after in self.parts:
            self._wait(after)
            yield self._sent(start, end)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for start, end, after in self.parts:
            if after is not None and not self.router._made[after].is_set():
                await asyncio.to_thread(self._wait, after)
            yield self._sent(start, end)


def _raw(body: str | bytes | None) -> bytes:
    return body.encode() if isinstance(body, str) else (body or b"")


def _query(text: str, wait: bool) -> dict[str, str]:
    pairs = parse_qsl(text, keep_blank_values=True)
    return {key: value for key, value in pairs if wait or key != "waitMs"}


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _seq(item: Interaction) -> int:
    """A long-poll's event's `seq` (its SSE body, when streamed: 0)."""
    try:
        seq = orjson.loads(_raw(item.response_body)).get("seq")
    except (orjson.JSONDecodeError, AttributeError):
        return 0
    return seq if isinstance(seq, int) else 0


def _body_difference(recorded: str | bytes | None, sent: bytes) -> str | None:
    """How `sent` differs from the recorded body (None: alike), in a few words."""
    raw = _raw(recorded)
    if raw == sent:
        return None
    try:  # the bridge takes an empty body for `{}`
        recorded_json, sent_json = orjson.loads(raw or b"{}"), orjson.loads(sent or b"{}")
        return json_difference(recorded_json, sent_json, _volatile)
    except orjson.JSONDecodeError:
        return f"is {sent[:200]!r} instead of {raw[:200]!r}"


def _volatile(text: str) -> Any:
    """A recorded string as what it matches: UUIDs and date-times any of their kind, a
    placeholder (`${tmp}/work`) any value in its place, anything else itself."""
    if kind := next((k for k in (_UUID, _TIME) if k.fullmatch(text)), None):
        return {"$regex": rf"\A(?:{kind.pattern})\Z"}
    if has_placeholder(text):
        return {"$regex": placeholder_pattern(text).pattern}
    return fill(text, {}, json=False)  # escaped literals (`$${tmp}`) as the bridge said them


def _strings(recorded: Any, sent: Any) -> Iterator[tuple[str, str]]:
    """(recorded string with a placeholder, the host's string in its place), everywhere
    the two bodies have strings at the same spot."""
    if isinstance(recorded, str) and isinstance(sent, str) and has_placeholder(recorded):
        yield recorded, sent
    elif isinstance(recorded, dict) and isinstance(sent, dict):
        for key, value in recorded.items():
            if key in sent:
                yield from _strings(value, sent[key])
    elif isinstance(recorded, list) and isinstance(sent, list):
        for one, other in zip(recorded, sent, strict=False):
            yield from _strings(one, other)


def scenario_router(
    scenario: str | os.PathLike[str] | Mapping[str, Any] | LoadedScenario,
    *,
    record: str | None = None,
    **options: Any,
) -> ScenarioRouter:
    """A respx router replaying `scenario`'s cassette (a file, a mapping or a loaded one);
    `record` is `cassette_for`'s, `options` are `ScenarioRouter`'s (scenarios/README.md,
    "respx: no process at all", says what each does)."""
    if isinstance(scenario, Mapping):
        scenario = parse_scenario({"scenario": 1, **scenario}, source="<scenario>")
    loaded = scenario if isinstance(scenario, LoadedScenario) else load_scenario(Path(scenario))
    return ScenarioRouter(loaded, cassette_for(loaded, record=record), **options)
