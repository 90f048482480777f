"""A host that does exactly what a scenario's steps do, over httpx: the tests' stand-in
for host code, run against the respx mocks (and comparable with the runner's run).

Each step's response is checked with the runner's own expectation code and, as the
runner does, against the bridge's OpenAPI document; the outcome of each step is kept
so tests can compare it with what the real bridge answered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from scenarios import format as f
from scenarios.expectations import (
    NO_JSON,
    Exchange,
    Problem,
    ReadGoal,
    StepRequest,
    default_status,
    error_problems,
    events_problems,
    http_problems,
    int_or_none,
    step_request,
    substitute,
)
from scenarios.format import LoadedScenario
from scenarios.matching import find_jsonpath
from scenarios.openapi_check import ContractViolation, OpenApiChecker

#: Long-polls one poll step may make before the driver gives up (the mock never waits).
MAX_POLLS = 200


@dataclass
class StepOutcome:
    """What one step got: the last HTTP status and JSON body, the events read."""

    index: int
    title: str
    status: int | None = None
    body: Any = NO_JSON
    events: list[Any] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


class _Stream:
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.lines: AsyncIterator[str] = response.aiter_lines()
        self.ended = False

    async def next_frame(self) -> dict[str, Any] | None:
        """The next frame as {id, event, data}, None at the end of the stream."""
        frame: dict[str, Any] = {}
        data: list[str] = []
        async for line in self.lines:
            if line == "":
                if frame or data:
                    frame["data"] = "\n".join(data)
                    return frame
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            else:
                frame[name] = value
        self.ended = True
        return None


class Driver:
    """Runs the steps of `loaded` with `client` (its base URL is the bridge's)."""

    def __init__(
        self,
        loaded: LoadedScenario,
        client: httpx.AsyncClient,
        *,
        token: str | None,
        checker: OpenApiChecker | None = None,
    ) -> None:
        self.loaded = loaded
        self.client = client
        self.token = token
        self.checker = checker
        self.variables: dict[str, Any] = {
            "base": str(client.base_url).rstrip("/"),
            "token": token,
            "tmp": "/tmp/codex-bridge-mock",
        }
        self.streams: dict[str, _Stream] = {}
        self.background: dict[str, asyncio.Task[Exchange]] = {}

    def sub(self, value: Any) -> Any:
        return substitute(value, self.variables.__getitem__)

    async def send(self, request: StepRequest) -> Exchange:
        headers, params, content = request.encoded(self.token)
        method, path = request.method, request.path
        response = await self.client.request(
            method, path, headers=headers, params=params, content=content
        )
        self._check_contract(method, response, response.content)
        return _exchange(method, path, response)

    def _check_contract(self, method: str, response: httpx.Response, body: bytes | None) -> None:
        if self.checker is None:
            return
        content_type = response.headers.get("Content-Type", "")
        streaming = content_type.startswith("text/event-stream")
        self.checker.check(
            method,
            response.request.url.path,
            response.status_code,
            content_type,
            None if streaming else body,
        )

    async def run(self) -> list[StepOutcome]:
        outcomes = []
        try:
            for index, step in enumerate(self.loaded.scenario.steps):
                outcome = StepOutcome(index, step.title())
                try:
                    await self._step(step, outcome)
                except ContractViolation as exc:
                    outcome.problems.append(Problem((), f"contract: {exc}"))
                outcomes.append(outcome)
        finally:
            for task in self.background.values():
                task.cancel()
            for stream in self.streams.values():
                await stream.response.aclose()
        return outcomes

    async def _step(self, step: Any, outcome: StepOutcome) -> None:
        if isinstance(step, f.HttpStep | f.CallStep | f.CreateSessionStep | f.ReplyStep):
            send = self.send(step_request(step, self.sub))
            if getattr(step, "background", None) is not None:
                self.background[step.background] = asyncio.ensure_future(send)
                return
            ex = await send
            self._check(step.expect, ex, default_status(step), outcome)
            created = isinstance(step, f.CreateSessionStep) and ex.status == 201
            if created and isinstance(ex.json, dict):
                self.variables[step.create_session.as_] = ex.json.get("sessionId")
            self._capture(step, ex.json, ex)
        elif isinstance(step, f.AwaitStep):
            ex = await self.background.pop(step.await_.request)
            self._check(step.expect, ex, "2xx", outcome)
            self._capture(step, ex.json, ex)
        elif isinstance(step, f.PollStep):
            await self._poll(step, outcome)
        elif isinstance(step, f.StreamStep):
            await self._stream(step, outcome)
        elif isinstance(step, f.ReadStep):
            await self._read(step, outcome)
        elif isinstance(step, f.CloseStep):
            stream = self.streams.pop(step.close, None)
            if stream is not None:
                await stream.response.aclose()

    def _check(self, expect: Any, ex: Exchange, default: Any, outcome: StepOutcome) -> None:
        outcome.status, outcome.body = ex.status, ex.json
        outcome.problems += http_problems(expect, ex, default, self.sub)

    def _capture(self, step: Any, document: Any, ex: Exchange | None = None) -> None:
        for name, spec in step.capture.items():
            if isinstance(spec, dict) and "header" in spec:
                assert ex is not None
                self.variables[name] = ex.headers.get(spec["header"])
                continue
            expression = spec["jsonPath"] if isinstance(spec, dict) else spec
            found = find_jsonpath(expression, document) if document is not NO_JSON else []
            self.variables[name] = found[0] if len(found) == 1 else found

    async def _poll(self, step: f.PollStep, outcome: StepOutcome) -> None:
        spec = step.poll
        expect = step.expect or f.EventsExpect()
        path = f"/v1/sessions/{self.sub(spec.session)}/events"
        after = int_or_none(self.sub(spec.after))
        goal = ReadGoal.of(spec, self.sub)
        auth = self.sub(spec.auth)
        events: list[Any] = []
        failed: Exchange | None = None
        reached = goal.want == 0
        polls = 0
        while not reached and polls < MAX_POLLS:
            polls += 1
            query: dict[str, Any] = {"waitMs": spec.wait_ms}
            if after is not None:
                query["after"] = after
            ex = await self.send(StepRequest("GET", path, auth, query=query))
            outcome.status = ex.status
            if ex.status == 204:
                continue
            if ex.status != 200:
                failed = ex
                break
            events.append(ex.json)
            if after is not None:
                after = ex.json.get("seq", after)
            reached = goal.reached(events)
        outcome.events = events
        if failed is not None or expect.error is not None:
            if failed is None:
                outcome.problems.append(Problem(("expect", "error"), "the poll did not fail"))
            else:
                outcome.body = failed.json
                outcome.problems += error_problems(self.sub(expect.error), failed)
            return
        if not reached:
            outcome.problems.append(Problem(("poll",), f"gave up after {polls} polls"))
        outcome.problems += events_problems(expect, events, sub=self.sub)
        if expect.quiet_ms is not None:
            query = {"waitMs": expect.quiet_ms}
            if after is not None:
                query["after"] = after
            ex = await self.send(StepRequest("GET", path, auth, query=query))
            if ex.status not in (204, 409):
                outcome.problems.append(Problem(("expect", "quietMs"), f"got {ex.status}"))
        self._capture(step, events[-1] if events else NO_JSON)

    async def _stream(self, step: f.StreamStep, outcome: StepOutcome) -> None:
        spec = step.stream
        request = step_request(step, self.sub)
        path = request.path
        headers, params, _ = request.encoded(self.token)
        built = self.client.build_request("GET", path, headers=headers, params=params)
        response = await self.client.send(built, stream=True)
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            self._check_contract("GET", response, response.content)
            ex = _exchange("GET", path, response)
            self._check(step.expect, ex, 200, outcome)
            await response.aclose()
            return
        self._check_contract("GET", response, None)
        ex = Exchange("GET", path, 200, CIMultiDictProxy(CIMultiDict(response.headers.items())), "")
        outcome.problems += http_problems(step.expect, ex, 200, self.sub)
        self.streams[spec.as_] = _Stream(response)

    async def _read(self, step: f.ReadStep, outcome: StepOutcome) -> None:
        spec = step.read
        expect = step.expect or f.EventsExpect()
        stream = self.streams[spec.stream]
        goal = ReadGoal.of(spec, self.sub)
        frames: list[dict[str, Any]] = []
        events: list[Any] = []
        reached = goal.want == 0
        while not reached and not stream.ended:
            async with asyncio.timeout(10):
                frame = await stream.next_frame()
            if frame is None:
                break
            frames.append(frame)
            event = orjson.loads(frame["data"])
            events.append(event)
            reached = goal.reached(events)
        outcome.events = events
        if spec.to_end and not stream.ended:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    if await stream.next_frame() is not None:
                        outcome.problems.append(Problem(("read",), "more after the end"))
        elif not spec.to_end and not reached:
            outcome.problems.append(Problem(("read",), f"the stream ended; read {len(frames)}"))
        ids = [frame.get("id") for frame in frames]
        kinds = [frame.get("event", "message") for frame in frames]
        outcome.problems += events_problems(expect, events, ids, kinds, self.sub)
        if expect.ended and not stream.ended:
            async with asyncio.timeout(10):
                if await stream.next_frame() is not None:
                    outcome.problems.append(Problem(("expect", "ended"), "the stream goes on"))
        self._capture(step, events[-1] if events else NO_JSON)


def _exchange(method: str, path: str, response: httpx.Response) -> Exchange:
    parsed: Any = NO_JSON
    if response.content:
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(response.content)
    headers = CIMultiDictProxy(CIMultiDict(response.headers.items()))
    return Exchange(method, path, response.status_code, headers, response.text, parsed)


async def drive(
    loaded: LoadedScenario,
    client: httpx.AsyncClient,
    *,
    token: str | None,
    checker: OpenApiChecker | None = None,
) -> tuple[list[StepOutcome], dict[str, Any]]:
    """Run the steps; returns each step's outcome and the variables as the host saw them."""
    driver = Driver(loaded, client, token=token, checker=checker)
    outcomes = await driver.run()
    return outcomes, driver.variables
