"""respx mocks of the bridge for host code that calls it with httpx: no process at all.

:func:`scenario_router` replays a scenario's cassette (`scenarios.cassette`): what the
real bridge, with fake-codex behind it, answered when the scenario ran. Each request the
host makes is matched with a recorded one of the same method and path: the same query
(`waitMs` aside, it is the client's choice), `Authorization` and `Last-Event-ID`, and
the same JSON body (values that vary from run to run, UUIDs and timestamps, match any
of their kind). Its recorded response is sent once, byte for byte, SSE bodies included.
A recorded event is only given once the host has made the request that, in the
recording, came before it. A request no route matches raises :class:`UnmatchedRequest`
listing every recorded route with its steps; a step the host never made fails when the
router stops (`assert_all_called`).

    with scenario_router("approval.scenario.yaml") as bridge:
        client = MyBridgeClient(bridge.base_url, token=bridge.token)
        ...
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
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

from scenarios.cassette import Cassette, CassetteError, Interaction, StaleCassette, cassette_for
from scenarios.format import LoadedScenario, load_scenario, parse_scenario

__all__ = [
    "DEFAULT_BASE_URL",
    "BridgeMockRouter",
    "CassetteError",
    "ScenarioMockError",
    "ScenarioRouter",
    "StaleCassette",
    "UnmatchedRequest",
    "scenario_router",
]

DEFAULT_BASE_URL = "http://bridge.test"


class ScenarioMockError(AssertionError):
    """The host made a request the recording has no answer for."""


class UnmatchedRequest(AllMockedAssertionError, ScenarioMockError):
    """No mocked route matches the request; the message lists every known route."""


#: Set while respx resolves a request for an async client: waits may then await.
_ASYNC: contextvars.ContextVar[bool] = contextvars.ContextVar("bridge_mock_async", default=False)
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:?\d\d)?")
_MATCHED_HEADERS = ("Authorization", "Last-Event-ID")


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

    def _add(self, method: str, path: str, name: str, side_effect: Callable[..., Any]) -> None:
        route = respx.Route(_Target((method, self._origin, self._base_path + path)))
        route.side_effect = side_effect
        self.add(route, name=name)

    def known_routes(self) -> list[str]:
        return [str(route.name) for route in self.routes]

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


class _Gate:
    """Opens once the host has made an interaction; sync and async waits."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def wait(self, timeout: float) -> bool:
        return self.event.wait(timeout)

    async def wait_async(self, timeout: float) -> bool:
        if self.event.is_set():
            return True
        return await asyncio.to_thread(self.event.wait, timeout)


class ScenarioRouter(BridgeMockRouter):
    """The bridge replaying a scenario's cassette (built by :func:`scenario_router`).

    `token` is the scenario's bearer token (None without auth); `cassette` what is replayed.
    """

    def __init__(
        self,
        loaded: LoadedScenario,
        cassette: Cassette,
        *,
        base_url: str = DEFAULT_BASE_URL,
        assert_all_called: bool = True,
        check_bodies: bool = True,
        max_idle_polls: int = 20,
        release_timeout: float = 5.0,
    ) -> None:
        super().__init__(base_url, assert_all_called=assert_all_called)
        self.loaded = loaded
        self.cassette = cassette
        self.token = loaded.scenario.bridge.token
        self.check_bodies = check_bodies
        self.max_idle_polls = max_idle_polls
        self.release_timeout = release_timeout
        items = cassette.interactions
        self._gates = [_Gate() for _ in items]
        self._used = [False] * len(items)
        self._read = [0] * len(items)  # SSE bytes the host read
        self._idle: dict[str, int] = {}
        self._cursor: dict[str, int] = {}  # per events path: the last event read by cursor
        routes: dict[tuple[str, str], list[int]] = {}
        for index, item in enumerate(items):
            routes.setdefault(item.route, []).append(index)
        self._lines: list[str] = []
        for (method, path), indexes in routes.items():
            label = f"{method} {self.base_url}{path}"
            steps = sorted({step for i in indexes if (step := items[i].step) is not None})
            self._lines.append(f"{label}  — {'; '.join(self._step(i) for i in steps)}")
            self._add(method, path, label, _bind(self._answer, indexes))

    def known_routes(self) -> list[str]:
        return list(self._lines)

    def describe(self) -> str:
        return f"mock of scenario {self.cassette.scenario} at {self.base_url}"

    def _step(self, index: int | None) -> str:
        if index is None:
            return "no step"
        step = self.loaded.scenario.steps[index]
        return f"step {index + 1} ({step.title()}, {self.loaded.where(('steps', index))})"

    def _what(self, index: int) -> str:
        item = self.cassette.interactions[index]
        return f"{self._step(item.step)}: {item.method} {item.path}"

    # -- answers

    def _answer(self, request: httpx.Request, indexes: list[int]) -> Any:
        items = self.cassette.interactions
        if items[indexes[0]].events and not items[indexes[0]].route[1].endswith("/stream"):
            return self._poll(request, indexes)
        with self._lock:
            unused = [i for i in indexes if not self._used[i]]
            differences = [(i, self._differences(items[i], request)) for i in unused]
            chosen = next((i for i, why in differences if not why), None)
            if chosen is not None:
                return self._serve(chosen)
            if not differences:
                raise ScenarioMockError(
                    f"{request.method} {request.url}: the scenario {self.cassette.scenario} "
                    f"answers this route {len(indexes)} time(s) "
                    f"({'; '.join(self._step(items[i].step) for i in indexes)}), "
                    "and the host asks again"
                )
            nearest, why = differences[0]
            raise ScenarioMockError(
                f"{request.method} {request.url} is not what the scenario "
                f"{self.cassette.scenario} sends on this route; the next recorded request, "
                f"{self._what(nearest)}, differs: " + "; ".join(why)
            )

    def _poll(self, request: httpx.Request, indexes: list[int]) -> Any:
        """A long-poll gets the next recorded event after its position (`after`, else the
        session's cursor here), however the scenario read it; else a recorded answer to a
        poll like it (409 past the exit, 400, ...); else 204."""
        items = self.cassette.interactions
        after = request.url.params.get("after")
        path = items[indexes[0]].route[1]
        with self._lock:
            position = self._cursor.get(path, 0) if after is None else _int(after)
            auth = request.headers.get("Authorization")
            events = [
                i
                for i in indexes
                if position is not None
                and not self._used[i]
                and items[i].status == 200
                and items[i].header("Authorization") == auth
                and _seq(items[i]) > position
            ]
            waiting = min(events, key=lambda i: (_seq(items[i]), i), default=None)
            if waiting is not None and self._released(items[waiting].after):
                if after is None:
                    self._cursor[path] = _seq(items[waiting])
                return self._serve(waiting)
            if waiting is None:
                for i in indexes:
                    answered = items[i].status not in (200, 204) and not self._used[i]
                    if answered and not self._differences(items[i], request):
                        return self._serve(i)
        if waiting is not None and _ASYNC.get():
            return self._poll_later(request, path, waiting)
        return self._nothing(request, waiting)

    def _serve(self, index: int) -> httpx.Response:
        item = self.cassette.interactions[index]
        self._used[index] = True
        self._gates[index].event.set()
        self._idle.pop(item.route[1], None)
        headers = [
            (name, value) for name, values in item.response_headers.items() for value in values
        ]
        body = _raw(item.response_body)
        if not item.marks:
            return httpx.Response(item.status, headers=headers, content=body)
        return httpx.Response(item.status, headers=headers, stream=_Replay(self, index, body))

    async def _poll_later(self, request: httpx.Request, path: str, index: int) -> httpx.Response:
        wait_ms = _int(request.url.params.get("waitMs", "")) or 30_000
        after = self.cassette.interactions[index].after
        if after is not None:
            await self._gates[after].wait_async(min(wait_ms / 1000, self.release_timeout))
        with self._lock:
            if not self._used[index] and self._released(after):
                if request.url.params.get("after") is None:
                    self._cursor[path] = _seq(self.cassette.interactions[index])
                return self._serve(index)
        return self._nothing(request, index)

    def _nothing(self, request: httpx.Request, waiting: int | None) -> httpx.Response:
        """A long-poll with no event for it yet: 204, until the host has looped too long."""
        path = request.url.path
        with self._lock:
            self._idle[path] = self._idle.get(path, 0) + 1
            if self._idle[path] <= self.max_idle_polls:
                return httpx.Response(204)
            self._idle.pop(path)
        if waiting is not None:
            after = self.cassette.interactions[waiting].after
            why = (
                f"its next recorded answer ({self._what(waiting)}) comes only after "
                f"{self._what(after) if after is not None else 'nothing'}, which the host has "
                "not made"
            )
        else:
            why = f"the recording has no more answers on it for {request.url.query.decode()!r}"
        raise ScenarioMockError(
            f"the host long-polled {path} {self.max_idle_polls + 1} times in a row without an "
            f"event: {why} (scenario {self.cassette.scenario})"
        )

    def _idle_poll(self, index: int) -> bool:
        """A recorded long-poll that found nothing: any poll like it gets a 204."""
        item = self.cassette.interactions[index]
        return item.events and item.status == 204

    def _released(self, after: int | None) -> bool:
        return after is None or self._used[after]

    def _differences(self, item: Interaction, request: httpx.Request) -> list[str]:
        why = []
        # `waitMs` is the client's choice, unless the bridge refused it.
        recorded = _query(urlsplit(item.path).query, item.status == 400)
        sent = _query(request.url.query.decode(), item.status == 400)
        if recorded != sent:
            why.append(f"query {sent} instead of {recorded}")
        for name in _MATCHED_HEADERS:
            if item.header(name) != request.headers.get(name):
                shown = "(none)" if request.headers.get(name) is None else "another value"
                why.append(f"{name}: {shown} instead of {_shown(name, item.header(name))}")
        if self.check_bodies:
            difference = _body_difference(item.body, request.read(), self.cassette.tmp)
            if difference:
                why.append(f"the body {difference}")
        return why

    # -- the end check

    def unserved(self) -> list[str]:
        """The steps the host never made (requests never sent, streams not read to the end)."""
        missing = []
        for index, item in enumerate(self.cassette.interactions):
            if not self._used[index] and not self._idle_poll(index):
                missing.append(f"{self._what(index)} never requested")
            elif item.marks and self._read[index] < len(_raw(item.response_body)):
                body = _raw(item.response_body)
                left = body[self._read[index] :].count(b"\n\n")
                missing.append(f"{self._what(index)}: {left} recorded SSE frame(s) never read")
        return missing

    def assert_all_called(self) -> None:
        missing = self.unserved()
        if missing:
            lines = [
                f"scenario {self.cassette.scenario}: {len(missing)} recorded exchange(s) the "
                "host never made (assert_all_called):"
            ]
            raise AssertionError("\n".join(lines + [f"  {line}" for line in missing]))


class _Replay(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A recorded SSE body, each part sent once the request it came after was made."""

    def __init__(self, router: ScenarioRouter, index: int, body: bytes) -> None:
        self.router, self.index, self.body = router, index, body
        marks = router.cassette.interactions[index].marks
        ends = [int(offset or 0) for offset, _ in marks[1:]] + [len(body)]
        self.parts = [
            (int(offset or 0), end, after) for (offset, after), end in zip(marks, ends, strict=True)
        ]

    def _unreleased(self, after: int) -> ScenarioMockError:
        router = self.router
        return ScenarioMockError(
            f"the event stream of {router._what(self.index)} goes on only after "
            f"{router._what(after)}; the host did not make it within {router.release_timeout} s "
            f"(scenario {router.cassette.scenario})"
        )

    def _sent(self, end: int) -> None:
        router = self.router
        with router._lock:
            router._read[self.index] = max(router._read[self.index], end)
            item = router.cassette.interactions[self.index]
            from_cursor = "after=" not in item.path and item.header("Last-Event-ID") is None
            if end == len(self.body) and from_cursor and b"\nevent: exit\n" in self.body:
                # The bridge's rule: a stream from the cursor that ends with the exit
                # event moves the cursor past it (one cut short gives it back).
                ids = re.findall(rb"^id: (\d+)$", self.body, re.M)
                path = item.route[1].removesuffix("/stream")
                router._cursor[path] = max(router._cursor.get(path, 0), int(ids[-1]))

    def __iter__(self) -> Iterator[bytes]:
        for start, end, after in self.parts:
            if after is not None and not self.router._gates[after].wait(
                self.router.release_timeout
            ):
                raise self._unreleased(after)
            self._sent(end)
            yield self.body[start:end]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for start, end, after in self.parts:
            gate = self.router._gates[after] if after is not None else None
            if gate is not None and not await gate.wait_async(self.router.release_timeout):
                raise self._unreleased(after)  # type: ignore[arg-type]
            self._sent(end)
            yield self.body[start:end]


def _bind(handler: Callable[..., Any], *args: Any) -> Callable[[httpx.Request], Any]:
    def side_effect(request: httpx.Request) -> Any:
        return handler(request, *args)

    return side_effect


def _raw(body: str | bytes | None) -> bytes:
    return body.encode() if isinstance(body, str) else (body or b"")


def _query(text: str, wait: bool) -> dict[str, str]:
    pairs = parse_qsl(text, keep_blank_values=True)
    return {key: value for key, value in pairs if wait or key != "waitMs"}


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _seq(item: Interaction) -> int:
    seq = orjson.loads(_raw(item.response_body)).get("seq")
    return seq if isinstance(seq, int) else 0


def _shown(name: str, value: str | None) -> str:
    if value is None:
        return "none"
    return "the scenario's bearer token" if name == "Authorization" else repr(value)


def _body_difference(recorded: str | bytes | None, sent: bytes, tmp: str | None) -> str | None:
    """How `sent` differs from the recorded body (None: alike), as a short sentence."""
    raw = _raw(recorded)
    if raw == sent:
        return None
    try:
        expected, received = orjson.loads(raw or b"null"), orjson.loads(sent or b"null")
    except orjson.JSONDecodeError:
        return f"is {sent[:200]!r} instead of {raw[:200]!r}"
    return _json_difference(expected, received, "$", tmp)


def _json_difference(expected: Any, received: Any, path: str, tmp: str | None) -> str | None:
    if isinstance(expected, dict) and isinstance(received, dict):
        if expected.keys() != received.keys():
            extra, lacking = sorted(received.keys() - expected), sorted(expected.keys() - received)
            return f"at {path}: keys {extra} not recorded, recorded keys {lacking} missing"
        for key in expected:
            found = _json_difference(expected[key], received[key], f"{path}.{key}", tmp)
            if found:
                return found
        return None
    if isinstance(expected, list) and isinstance(received, list):
        if len(expected) != len(received):
            return f"at {path}: {len(received)} items instead of {len(expected)}"
        for index, (a, b) in enumerate(zip(expected, received, strict=True)):
            found = _json_difference(a, b, f"{path}[{index}]", tmp)
            if found:
                return found
        return None
    if _alike(expected, received, tmp):
        return None
    shown = orjson.dumps(received)[:200].decode()
    return f"at {path}: {shown} instead of {orjson.dumps(expected)[:200].decode()}"


def _alike(expected: Any, received: Any, tmp: str | None) -> bool:
    """Equal, or both values of a kind that varies from run to run: UUIDs, date-times,
    and paths in the recording's `${tmp}` (any path may stand in its place)."""
    if type(expected) is type(received) and expected == received:
        return True
    if not (isinstance(expected, str) and isinstance(received, str)):
        return False
    if any(kind.fullmatch(expected) and kind.fullmatch(received) for kind in (_UUID, _TIME)):
        return True
    if tmp and tmp in expected:
        pattern = ".+".join(re.escape(part) for part in expected.split(tmp))
        return bool(re.fullmatch(pattern, received, re.S))
    return False


def scenario_router(
    scenario: str | os.PathLike[str] | Mapping[str, Any] | LoadedScenario,
    *,
    base_url: str = DEFAULT_BASE_URL,
    record: str | None = None,
    assert_all_called: bool = True,
    check_bodies: bool = True,
    max_idle_polls: int = 20,
    release_timeout: float = 5.0,
) -> ScenarioRouter:
    """A respx router replaying `scenario`'s cassette (a file, a mapping or a loaded one).

    The cassette is `cassettes/NAME.yaml` beside the scenario; `record` says what to do
    when it is missing or stale (`scenarios.cassette.cassette_for`: by default a missing
    one is recorded, except when `CI=true`, and a stale one raises `StaleCassette`).
    `check_bodies`: a request whose body differs from the recorded one fails.
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
        loaded,
        cassette_for(loaded, record=record),
        base_url=base_url,
        assert_all_called=assert_all_called,
        check_bodies=check_bodies,
        max_idle_polls=max_idle_polls,
        release_timeout=release_timeout,
    )
