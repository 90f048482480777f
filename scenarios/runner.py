"""Running one scenario: a bridge in-process, fake-codex (or the real codex) behind it.

Each run gets its own temporary directory, bridge, port, client, variables and
streams, so runs can go in parallel (xdist workers, or threads with their own event
loops). The fake writes its reports into the run's directory (`$FAKE_CODEX_REPORT`),
read by the end-of-run checks once the bridge has stopped every process. Against a
bridge already running (`RunOptions.target`) none is started and those checks are not
made. `_Run` holds a run's state; each step kind is a function of it (`run_step`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yarl
from multidict import CIMultiDict, CIMultiDictProxy

from bridge import TOKEN_VARIABLE
from bridge.app import PRESET_ROUTES
from bridge.route_paths import route_path
from fakes.app_server.report import read_reports, report_problems
from scenarios import format as f
from scenarios.expectations import (
    NO_JSON,
    Exchange,
    Problem,
    ReadGoal,
    StepRequest,
    cut,
    default_status,
    error_problems,
    event_line,
    event_list,
    events_problems,
    frame_event,
    http_problems,
    int_or_none,
    step_request,
    substitute,
)
from scenarios.format import LoadedScenario
from scenarios.harness import (
    NO_CODEX,
    CodexNotFound,
    RunningBridge,
    TargetError,
    app_server_command,
    connect_bridge,
    required_codex,
    start_bridge,
)
from scenarios.matching import find_jsonpath, match, render
from scenarios.openapi_check import ContractViolation
from scenarios.sse import SseFrame, SseReader


@dataclass
class Failure:
    """Why a scenario failed: a step (or setup / the end checks) and its problems."""

    title: str
    loc: tuple[Any, ...]
    problems: list[Problem]


@dataclass
class Transcript:
    """What happened, in order: HTTP, SSE frames, bridge logs; then each fake's wire."""

    started: float = field(default_factory=time.monotonic)
    entries: list[tuple[float, str, str]] = field(default_factory=list)
    fakes: list[dict[str, Any]] = field(default_factory=list)

    def add(self, source: str, text: str) -> None:
        self.entries.append((time.monotonic() - self.started, source, text))


@dataclass
class ScenarioResult:
    """The outcome of one run."""

    loaded: LoadedScenario
    outcome: str  # passed | failed | skipped
    duration: float = 0.0
    failures: list[Failure] = field(default_factory=list)
    skip_reason: str | None = None
    transcript: Transcript = field(default_factory=Transcript)
    tmp: Path | None = None

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    def fail(self, title: str, problems: list[Problem], loc: tuple[Any, ...] = ()) -> None:
        self.outcome = "failed"
        self.failures.append(Failure(title, loc, problems))

    def skip(self, reason: str) -> None:
        self.outcome, self.skip_reason = "skipped", reason


@dataclass
class RunOptions:
    """How scenarios are run."""

    #: The real codex, for scenarios that script the model (found when None).
    codex: str | None = None
    #: How the user gave `codex`, for messages: `--codex` (the CLI), `--codex-bin` (pytest).
    codex_option: str = "--codex"
    #: Where run directories go (default: the system's temporary directory).
    tmp_root: Path | None = None
    #: Keep each run's directory (it is removed after a passing run otherwise).
    keep_tmp: bool = False
    #: A missing real codex fails instead of skipping (default: when `CI=true`).
    require_codex: bool = field(default_factory=lambda: os.environ.get("CI", "").lower() == "true")
    #: Put before the app-server command (e.g. `scenarios.wire_tee`, to record the wire).
    app_server_prefix: list[str] | None = None
    #: A bridge already running (`http://host:port`) to run against instead of one of
    #: our own (`--codex-target`); its token, and the script its fake-codex runs, if any.
    target: str | None = None
    target_token: str | None = None
    target_script: Path | None = None


def target_skip_reason(loaded: LoadedScenario, options: RunOptions) -> str | None:
    """Why `loaded` cannot run against `options.target`, which is built already (None: it
    can). The preset and auth are compared with the target's once connected."""
    scenario = loaded.scenario
    spec = scenario.bridge
    if scenario.model is not None:
        return "scripts the model (`model:`): it needs a bridge and a codex of its own"
    if scenario.app_server is not None and not _same_file(loaded.path, options.target_script):
        return (
            "scripts the app-server (`appServer:`), and the target runs another "
            "(--codex-target-script names the scenario file its fake-codex runs)"
        )
    if any(value is not None for _, value in spec.limits):
        return "sets limits (`bridge.limits`): the target has limits of its own"
    if not spec.exempt_health:
        return "needs health behind auth (`exemptHealth: false`)"
    if spec.token is not None and not options.target_token:
        return (
            f"turns auth on: set {TOKEN_VARIABLE} (or {TOKEN_VARIABLE}_FILE) to the target's token"
        )
    return None


def _target_mismatch(spec: f.BridgeSpec, target: RunningBridge) -> str | None:
    """How the target is built otherwise than the scenario asks (None: as asked). Auth
    must agree: a scenario without a token may check that a request without one passes."""
    if target.auth and spec.token is None:
        return (
            "the target has auth on, and the scenario is written for a bridge without it "
            "(give it a `bridge.token`, which then stands for the target's, to run it there)"
        )
    if not target.auth and spec.token is not None:
        return "the scenario turns auth on (`bridge.token`); the target has auth off"
    if target.preset != spec.preset:
        return (
            f"the scenario wants the {spec.preset} preset; the target's routes are those "
            f"of {target.preset}"
        )
    return None


def _on_origin(url: str, base: str) -> bool:
    """Whether `url` has `base`'s scheme, host and port, and no user info."""
    try:
        parsed, origin = yarl.URL(url), yarl.URL(base)
        return (
            parsed.user is None
            and parsed.password is None
            and (parsed.scheme, parsed.host, parsed.port)
            == (origin.scheme, origin.host, origin.port)
        )
    except (ValueError, TypeError):  # no URL at all (a port out of range, say)
        return False


REDACTED = "[the target's token]"


def _redact(result: ScenarioResult, token: str) -> None:
    """The target's token, should the target ever send it back, out of what a run
    reports (the transcript, the failures, a skip's reason)."""
    transcript = result.transcript
    transcript.entries = [
        (at, source, text.replace(token, REDACTED)) for at, source, text in transcript.entries
    ]
    for failure in result.failures:
        failure.title = failure.title.replace(token, REDACTED)
        for problem in failure.problems:
            problem.message = problem.message.replace(token, REDACTED)
            if problem.diff is not None:
                problem.diff = problem.diff.replace(token, REDACTED)
            if problem.detail is not None:
                problem.detail = problem.detail.replace(token, REDACTED)
    if result.skip_reason is not None:
        result.skip_reason = result.skip_reason.replace(token, REDACTED)


def _same_file(path: Path | None, other: Path | None) -> bool:
    return path is not None and other is not None and path.resolve() == other.resolve()


def _broken_contract(exc: ContractViolation) -> StepFailed:
    return _failed((), f"the response breaks the bridge's contract: {exc}")


class StepFailed(Exception):
    """A step's expectations did not hold."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(problems[0].message if problems else "step failed")
        self.problems = problems


def _failed(loc: tuple[Any, ...], message: str) -> StepFailed:
    return StepFailed([Problem(loc, message)])


@dataclass
class OpenStream:
    """An SSE response kept open between steps."""

    name: str
    response: aiohttp.ClientResponse
    reader: SseReader
    ended: bool = False
    #: Why reading it failed (a broken connection), until a `read` reports it.
    failed: str | None = None
    #: The keep-alive comments read so far.
    keep_alives: int = 0


class _LogCapture(logging.Handler):
    """Bridge and aiohttp log records of one thread (one run) into its transcript."""

    def __init__(self, transcript: Transcript) -> None:
        super().__init__(logging.DEBUG)
        self.transcript = transcript
        self.thread = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            with contextlib.suppress(Exception):
                self.transcript.add(
                    "log", f"{record.levelname} {record.name}: {record.getMessage()}"
                )


_LOGGERS = ("bridge", "aiohttp")


class _Run:
    """One scenario's run: variables, streams, the bridge and its client; the steps are
    the functions below."""

    def __init__(
        self, scenario: f.Scenario, bridge: RunningBridge, tmp: Path, transcript: Transcript
    ) -> None:
        self.scenario, self.bridge, self.transcript = scenario, bridge, transcript
        #: The token the file writes (`bridge.token`, also `${token}`): the one every step
        #: carries. Against a target it stands for the target's, which replaces it in the
        #: `Authorization` header of a request to the target and nowhere else.
        self.written_token = scenario.bridge.token
        self.variables: dict[str, Any] = {
            "base": bridge.url,
            "token": self.written_token,
            "tmp": str(tmp),
        }
        self.streams: dict[str, OpenStream] = {}
        self.background: dict[str, asyncio.Task[Exchange]] = {}
        self.client = bridge.client(
            auth=False,
            contract_check=self.scenario.bridge.contract_check,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )

    def sub(self, value: Any) -> Any:
        """`value` with `${name}` replaced; a string that is one placeholder keeps its type."""
        return substitute(value, self._variable)

    def _variable(self, name: str) -> Any:
        if name not in self.variables:
            raise _failed((), f"${{{name}}} has no value")
        return self.variables[name]

    async def exchange(
        self, request: StepRequest, timeout_ms: int = 30_000, loc: tuple[Any, ...] = ()
    ) -> Exchange:
        """Send one request and read the whole response (`loc`: where the file gives
        its path, for a path that is not the bridge's)."""
        method, path = request.method, request.path
        url = self._url(path, loc)
        headers, params, content = request.encoded(self.written_token)
        headers = self.authorized(headers)
        shown = path + (f"?{'&'.join(f'{k}={v}' for k, v in params.items())}" if params else "")
        body = request.json_body
        sent = render(body, 500) if body is not NO_JSON else (request.body or "")
        self.transcript.add("http", f"→ {method} {shown} {sent}".rstrip())
        try:
            async with (
                asyncio.timeout(timeout_ms / 1000),
                self.client.request(
                    method,
                    url,
                    params=params,
                    headers=headers,
                    data=content,
                    allow_redirects=False,
                ) as response,
            ):
                raw = await response.read()
                status, response_headers = response.status, response.headers
        except ContractViolation as exc:
            self.transcript.add("http", f"← contract violation: {exc}")
            raise _broken_contract(exc) from None
        except TimeoutError:
            self.transcript.add("http", f"← no response within {timeout_ms} ms")
            raise _failed((), f"{method} {shown}: no response within {timeout_ms} ms") from None
        except aiohttp.ClientError as exc:
            self.transcript.add("http", f"← {type(exc).__name__}: {exc}")
            raise _failed((), f"{method} {shown} failed: {exc}") from None
        return self.received(method, shown, status, response_headers, raw)

    def received(self, method: str, path: str, status: int, headers: Any, raw: bytes) -> Exchange:
        """The exchange of a response read whole (into the transcript too)."""
        text = raw.decode("utf-8", "replace")
        parsed: Any = NO_JSON
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(raw) if raw else NO_JSON
        self.transcript.add("http", f"← {status} {cut(text, 1500)}".rstrip())
        return Exchange(method, path, status, headers, text, parsed)

    def _url(self, path: str, loc: tuple[Any, ...] = ()) -> str:
        """The URL of a step's `path`: from the bridge's root, or a full URL on the bridge's
        origin. Anywhere else (another host or port, user info, a path that would run into
        the port) fails the step: what a step sends goes to the bridge only."""
        url = path if path.startswith(("http://", "https://")) else f"{self.bridge.url}{path}"
        if not _on_origin(url, self.bridge.url):
            raise _failed(
                loc,
                f"{cut(path, 200)!r} is not on the bridge ({self.bridge.url}): a step's path "
                "starts with / (or is a full URL on the bridge's scheme, host and port)",
            )
        return url

    def authorized(self, headers: dict[str, str]) -> dict[str, str]:
        """`headers` with the written token in `Authorization` replaced by the bridge's
        (a target's own token; the same token otherwise): only there, never in a path,
        query, other header or body, and only on a request to the bridge (`_url`)."""
        written, real = self.written_token, self.bridge.token
        if not written or not real or written == real:
            return headers
        return {
            name: value.replace(written, real)
            if name.lower() == "authorization" and isinstance(value, str)
            else value
            for name, value in headers.items()
        }

    async def close_streams(self) -> None:
        for task in self.background.values():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self.background.clear()
        for stream in self.streams.values():
            stream.response.close()
        self.streams.clear()


async def run_step(run: _Run, step: Any) -> None:
    """Run one step; a failed expectation raises StepFailed."""
    handlers: dict[type[Any], Callable[[_Run, Any], Awaitable[None]]] = {
        f.PollStep: _poll,
        f.StreamStep: _stream,
        f.ReadStep: _read,
        f.CloseStep: _close,
        f.AwaitStep: _await,
    }
    await handlers.get(type(step), _request)(run, step)


async def _repeat(
    run: _Run, background: str | None, attempt: Callable[[], Awaitable[Exchange]], until: Any
) -> Exchange:
    """Run `attempt` (returns an exchange, raises StepFailed) until it passes; a
    `background` step only starts it (its `await` step checks the response)."""
    if background is not None:
        run.background[background] = asyncio.ensure_future(attempt())
        return Exchange("", "", 0, CIMultiDictProxy(CIMultiDict()), "")
    if until is None:
        return await attempt()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + until.deadline_ms / 1000
    attempts = 0
    while True:
        attempts += 1
        try:
            return await attempt()
        except StepFailed as failed:
            if loop.time() + until.interval_ms / 1000 > deadline:
                last = f"the last: {failed}"
                late = f"still failing after {attempts} attempts in {until.deadline_ms} ms; {last}"
                failed.problems.insert(0, Problem(("until",), late))
                raise
        await asyncio.sleep(until.interval_ms / 1000)


async def _request(
    run: _Run, step: f.HttpStep | f.CallStep | f.CreateSessionStep | f.ReplyStep
) -> None:
    """A step that sends one request (a call may take long: it waits up to 10 minutes)."""
    timeout_ms = step.http.timeout_ms if isinstance(step, f.HttpStep) else 30_000
    timeout_ms = 600_000 if isinstance(step, f.CallStep) else timeout_ms
    background = getattr(step, "background", None)

    async def attempt() -> Exchange:
        where = ("http", "path") if isinstance(step, f.HttpStep) else ()
        ex = await run.exchange(step_request(step, run.sub), timeout_ms, where)
        if background is None:
            _check_http(run, step.expect, ex, default_status(step))
        return ex

    ex = await _repeat(run, background, attempt, getattr(step, "until", None))
    if isinstance(step, f.CreateSessionStep) and ex.status == 201 and isinstance(ex.json, dict):
        run.variables[step.create_session.as_] = ex.json.get("sessionId")
    _capture(run, step, ex.json, ex.headers)


async def _poll(run: _Run, step: f.PollStep) -> None:
    spec, expect = step.poll, step.expect or f.EventsExpect()
    path = route_path("events", sessionId=str(run.sub(spec.session)))
    after = int_or_none(run.sub(spec.after))
    goal, auth = ReadGoal.of(spec, run.sub), run.sub(spec.auth)

    async def get(wait_ms: int, timeout_ms: int = 30_000) -> Exchange:
        query = {"waitMs": wait_ms, **({"after": after} if after is not None else {})}
        return await run.exchange(StepRequest("GET", path, auth, query=query), timeout_ms)

    events: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + spec.timeout_ms / 1000
    failed: Exchange | None = None
    reached = goal.want == 0
    while not reached and (remaining := deadline - loop.time()) > 0:
        ex = await get(max(1, min(spec.wait_ms, int(remaining * 1000))), 60_000)
        if ex.status == 204:
            continue
        if ex.status != 200 or not isinstance(ex.json, dict):
            failed = ex
            break
        events.append(ex.json)
        after = ex.json.get("seq", after) if after is not None else None
        reached = goal.reached(events)
    problems: list[Problem] = []
    if expect.keep_alives is not None:
        problems.append(Problem(("expect", "keepAlives"), "`keepAlives` applies to `read` only"))
    if failed is None and expect.error is not None:
        wanted = render(expect.error)
        problems.append(
            Problem(
                ("expect", "error"), f"expected the read to fail with {wanted}, but it succeeded"
            )
        )
    elif failed is not None and expect.error is None:
        answer = f"{failed.status} {cut(failed.text, 500)}"
        problems.append(Problem((), f"GET {failed.path} answered {answer}"))
    elif failed is not None:
        problems += error_problems(run.sub(expect.error), failed)
    elif not reached:
        wanted = f"{goal.wanted('event')}; read {len(events)}"
        problems.append(
            Problem(("poll",), f"waited {spec.timeout_ms} ms for {wanted}", event_list(events))
        )
    if failed is None:
        problems += events_problems(expect, events, sub=run.sub)
        if expect.quiet_ms is not None and not problems:
            ex = await get(expect.quiet_ms)
            if ex.status == 200:
                problems.append(_not_quiet(expect.quiet_ms, ex.json))
            elif ex.status not in (204, 409):
                why = f"a quiet long-poll answered {ex.status} {cut(ex.text, 300)}"
                problems.append(Problem(("expect", "quietMs"), why))
    if problems:
        raise StepFailed(problems)
    _capture(run, step, events[-1] if events else None)


def _not_quiet(quiet_ms: int, event: Any) -> Problem:
    received = event_line(event)
    return Problem(
        ("expect", "quietMs"), f"expected nothing more within {quiet_ms} ms, received {received}"
    )


async def _stream(run: _Run, step: f.StreamStep) -> None:
    spec, expect = step.stream, step.expect
    request = step_request(step, run.sub)
    path = request.path
    url = run._url(path, ("stream", "path"))
    headers, params, _ = request.encoded(run.written_token)
    last_id = render(headers.get("Last-Event-ID", ""))
    headers = run.authorized(headers)
    run.transcript.add("http", f"→ GET {path} (stream {spec.as_}) {last_id}")
    try:
        async with asyncio.timeout(spec.timeout_ms / 1000):
            response = await run.client.get(
                url, headers=headers, params=params, allow_redirects=False
            )
    except ContractViolation as exc:
        raise _broken_contract(exc) from None
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise _failed((), f"opening the stream failed: {exc!r}") from None
    if response.status != 200:
        raw = await response.read()
        response.release()
        ex = run.received("GET", path, response.status, response.headers, raw)
        return _check_http(run, expect, ex, default_status=200)
    run.transcript.add("http", f"← 200 {response.headers.get('Content-Type', '')}")
    try:
        if expect is not None and (expect.given("json_body") or expect.json_subset):
            raise _failed(("expect",), "a stream has no JSON body to match")
        _check_http(run, expect, Exchange("GET", path, 200, response.headers, ""), 200)
        # Comments come through so that `read` can count keep-alives (then skips them).
        reader = SseReader(response, comments=True)
    except ValueError as exc:  # not an event stream
        response.close()
        raise _failed((), str(exc)) from None
    except StepFailed:
        response.close()
        raise
    if (previous := run.streams.pop(spec.as_, None)) is not None:
        previous.response.close()
    run.streams[spec.as_] = OpenStream(spec.as_, response, reader)


async def _read(run: _Run, step: f.ReadStep) -> None:
    spec, expect = step.read, step.expect or f.EventsExpect()
    stream = run.streams.get(spec.stream)
    if stream is None:
        raise _failed(("read", "stream"), f"stream {spec.stream!r} is not open")
    goal = ReadGoal.of(spec, run.sub)
    frames: list[SseFrame] = []
    events: list[Any] = []
    problems: list[Problem] = []
    reached, keep_alives = goal.want == 0, stream.keep_alives
    loop = asyncio.get_running_loop()
    deadline = loop.time() + spec.timeout_ms / 1000
    while not reached and not stream.ended:
        if (frame := await _next_event_frame(run, stream, (deadline - loop.time()) * 1000)) is None:
            break
        frames.append(frame)
        events.append(frame_event(frame))
        reached = goal.reached(events)
    if stream.failed is not None:
        problems.append(Problem(("read",), stream.failed))
        stream.failed = None
    if spec.to_end and not stream.ended:
        why = f"the stream was still open after {spec.timeout_ms} ms"
        problems.append(Problem(("read", "toEnd"), why, detail=event_list(events)))
    elif not spec.to_end and not reached:
        why = "the stream ended" if stream.ended else f"waited {spec.timeout_ms} ms"
        read = f"{why} before {goal.wanted('frame')}; read {len(frames)}"
        problems.append(Problem(("read",), read, detail=event_list(events)))
    for index, event in enumerate(events):
        if event is NO_JSON:
            data = f"frame {index + 1} has data that is not JSON: {cut(frames[index].data, 300)}"
            problems.append(Problem(("read",), data))
    if not problems:
        ids, kinds = [frame.id for frame in frames], [frame.event for frame in frames]
        problems += events_problems(expect, events, ids, kinds, run.sub)
    quiet = expect.quiet_ms if not problems and not stream.ended else None
    if quiet and (late := await _next_event_frame(run, stream, quiet)) is not None:
        problems.append(_not_quiet(quiet, frame_event(late)))
    if not problems and expect.ended is not None:
        loc = ("expect", "ended")
        if expect.ended and not stream.ended:
            if (frame := await _next_event_frame(run, stream, spec.timeout_ms)) is not None:
                received = event_line(frame_event(frame))
                problems.append(Problem(loc, f"expected the stream to end, received {received}"))
            elif not stream.ended:
                problems.append(Problem(loc, "expected the stream to end; it stays open"))
        elif not expect.ended and stream.ended:
            problems.append(Problem(loc, "the stream ended"))
    if expect.keep_alives is not None:
        seen = stream.keep_alives - keep_alives
        found = match(run.sub(expect.keep_alives), seen, subset=False, path="keepAlives")
        problems += [
            Problem(("expect", "keepAlives"), f"keep-alive comments seen: {m}") for m in found
        ]
    if expect.error is not None:
        problems.append(Problem(("expect", "error"), "`error` applies to `poll` only"))
    if problems:
        raise StepFailed(problems)
    _capture(run, step, events[-1] if events else None)


async def _next_event_frame(run: _Run, stream: OpenStream, within_ms: float) -> SseFrame | None:
    """The next event frame within `within_ms` (None: quiet, or the stream ended or failed:
    `stream.ended`); keep-alive comments read meanwhile are counted in the stream."""
    deadline = asyncio.get_running_loop().time() + within_ms / 1000
    while True:
        try:
            left = deadline - asyncio.get_running_loop().time()
            frame = await stream.reader.next(timeout=max(0.0, left))
        except TimeoutError:
            return None
        except aiohttp.ClientError as exc:
            stream.failed, frame = f"the stream failed: {exc!r}", None
        if frame is None:
            stream.ended = True
            run.transcript.add("sse", f"⇠ [{stream.name}] (end of stream)")
            return None
        if frame.comment is None:
            shown = f"id={frame.id} {frame.event} {cut(frame.data, 1000)}"
            run.transcript.add("sse", f"⇠ [{stream.name}] {shown}")
            return frame
        stream.keep_alives += 1


async def _close(run: _Run, step: f.CloseStep) -> None:
    stream = run.streams.pop(step.close, None)
    if stream is not None:
        stream.response.close()
        run.transcript.add("sse", f"⇠ [{stream.name}] closed by the client")


async def _await(run: _Run, step: f.AwaitStep) -> None:
    spec = step.await_
    task = run.background.pop(spec.request, None)
    if task is None:
        raise _failed(("await",), f"no request {spec.request!r} is pending")
    try:
        async with asyncio.timeout(spec.timeout_ms / 1000):
            ex = await asyncio.shield(task)
    except TimeoutError:
        task.cancel()
        late = f"no response to {spec.request!r} within {spec.timeout_ms} ms"
        raise _failed(("await",), late) from None
    _check_http(run, step.expect, ex, default_status="2xx")
    _capture(run, step, ex.json, ex.headers)


def _check_http(run: _Run, expect: f.HttpExpect | None, ex: Exchange, default_status: Any) -> None:
    problems = http_problems(expect, ex, default_status, run.sub)
    if problems:
        raise StepFailed(problems)


def _capture(run: _Run, step: Any, document: Any, headers: Any = None) -> None:
    """Set the step's `capture` variables from a response (JSON and headers) or, without
    headers, from the last event read."""
    document = None if document is NO_JSON else document
    for name, spec in step.capture.items():
        if isinstance(spec, dict) and "header" in spec:
            value = headers.get(spec["header"]) if headers is not None else None
            if value is None:
                why = f"no header {spec['header']!r} to capture" if headers is not None else ""
                raise _failed(("capture", name), why or "events have no headers")
            run.variables[name] = value
            continue
        expression = spec["jsonPath"] if isinstance(spec, dict) else spec
        values = find_jsonpath(expression, document) if document is not None else []
        if not values:
            found = f"{expression} found nothing to capture in {render(document, 500)}"
            raise _failed(("capture", name), found)
        run.variables[name] = values[0] if len(values) == 1 else values


async def run_scenario(loaded: LoadedScenario, options: RunOptions | None = None) -> ScenarioResult:
    """Run one scenario from start to end checks; never raises for a failing scenario."""
    options = options or RunOptions()
    scenario = loaded.scenario
    result = ScenarioResult(loaded, "passed")
    started = time.monotonic()
    codex = None
    if options.target is not None:
        reason = target_skip_reason(loaded, options)
        if reason is not None:
            result.skip(f"not against a target: {reason}")
            return result
    if scenario.real_codex:
        try:
            codex = required_codex(options.codex, options.codex_option, options.require_codex)
        except CodexNotFound as exc:
            result.fail("setup", [Problem((), str(exc))])
            return result
        if codex is None:
            result.skip(NO_CODEX)
            return result
    if options.tmp_root is not None:
        options.tmp_root.mkdir(parents=True, exist_ok=True)
    slug = "".join(ch if ch.isalnum() else "-" for ch in loaded.name)[:40] or "scenario"
    result.tmp = tmp = Path(tempfile.mkdtemp(prefix=f"scenario-{slug}-", dir=options.tmp_root))
    capture = _LogCapture(result.transcript)
    for name in _LOGGERS:
        logging.getLogger(name).addHandler(capture)
    try:
        await _run(loaded, options, tmp, codex, result)
    finally:
        for name in _LOGGERS:
            logging.getLogger(name).removeHandler(capture)
        result.duration = time.monotonic() - started
        if options.target is not None and options.target_token:
            _redact(result, options.target_token)
        if result.outcome == "passed" and not options.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
            result.tmp = None
    return result


async def _run(
    loaded: LoadedScenario,
    options: RunOptions,
    tmp: Path,
    codex: str | None,
    result: ScenarioResult,
) -> None:
    scenario = loaded.scenario
    model_server = None
    run: _Run | None = None
    bridge: RunningBridge | None = None
    try:
        if options.target is not None:
            bridge = await connect_bridge(options.target, options.target_token)
            reason = _target_mismatch(scenario.bridge, bridge)
            if reason is not None:
                result.skip(f"not against a target: {reason}")
                return
            result.transcript.add("run", f"the target bridge at {bridge.url}")
        else:
            command, model_server = await app_server_command(
                tmp, _script_file(loaded, tmp), model=scenario.model if codex else None, codex=codex
            )
            command = [*(options.app_server_prefix or ()), *command]
            spec = scenario.bridge
            bridge = await start_bridge(
                command,
                preset=spec.preset,
                limits=spec.rest_limits(),
                token=spec.token,
                exempt_health=spec.exempt_health,
            )
            shown = f"bridge {spec.preset} at {bridge.url}: {' '.join(command)}"
            result.transcript.add("run", shown)
        run = _Run(loaded.scenario, bridge, tmp, result.transcript)
        await _steps(run, result)
        if not result.failures and model_server is not None:
            await _model_checks(run, model_server, result)
    except TargetError as exc:
        result.fail("the target", [Problem((), str(exc))])
    except Exception as exc:  # a bug or an environment problem, not a failed expectation
        result.fail("setup", [Problem((), f"the run could not go on: {exc!r}")])
    finally:
        if run is not None:
            await run.close_streams()
        if bridge is not None:
            await bridge.close()
        if model_server is not None:
            await model_server.close()
    if model_server is None and options.target is None:
        result.transcript.fakes = found = read_reports(tmp / "fake-reports")
        checks = scenario.checks.model_dump()
        problems = [
            Problem(*each) for each in report_problems(scenario.app_server, found, **checks)
        ]
        if problems and not result.failures:
            result.fail("end of run checks", problems)


async def _steps(run: _Run, result: ScenarioResult) -> None:
    scenario = run.scenario
    index = -1
    try:
        async with asyncio.timeout(scenario.timeout_ms / 1000):
            for index, step in enumerate(scenario.steps):
                run.transcript.add("step", f"step {index + 1}: {step.title()}")
                try:
                    await run_step(run, step)
                except StepFailed as failed:
                    title = _step_title(index, step, scenario)
                    result.fail(title, failed.problems, ("steps", index))
                    return
    except TimeoutError:
        late = f"the scenario ran past its timeoutMs ({scenario.timeout_ms} ms)"
        if index < 0:
            return result.fail("scenario", [Problem((), late)], ("timeoutMs",))
        step = scenario.steps[index]
        late += f" in step {index + 1}, {_waiting_for(step, run.sub)}"
        result.fail(_step_title(index, step, scenario), [Problem((), late)], ("steps", index))


def _waiting_for(step: Any, sub: Any) -> str:
    """What a step was waiting for when the scenario's time ran out, in words."""
    if getattr(step, "until", None) is not None:
        return f"repeating {step.title()} until its expectations held"
    if isinstance(step, f.PollStep | f.ReadStep):
        poll = isinstance(step, f.PollStep)
        goal = ReadGoal.of(step.poll if isinstance(step, f.PollStep) else step.read, sub)
        return f"{step.title()}, waiting for {goal.wanted('event' if poll else 'frame')}"
    if isinstance(step, f.AwaitStep):
        return f"waiting for the response to {step.await_.request!r}"
    return f"{step.title()}, waiting for its response"


def _step_title(index: int, step: Any, scenario: f.Scenario) -> str:
    return f"step {index + 1} of {len(scenario.steps)}: {step.title()}"


async def _model_checks(run: _Run, model_server: Any, result: ScenarioResult) -> None:
    problems: list[Problem] = []
    scenario = run.scenario
    if scenario.checks.script_used and scenario.model is not None:
        total, pending = len(scenario.model.replies), len(model_server.model.pending)
        for index in range(total - pending, total):
            message = f"scripted model reply {index} was never requested"
            problems.append(Problem(("model", "replies", index), message))
    if scenario.checks.requests_answered and "list_sessions" in PRESET_ROUTES[run.bridge.preset]:
        with contextlib.suppress(StepFailed):
            ex = await run.exchange(StepRequest("GET", route_path("list_sessions")))
            for session in ex.json.get("sessions", []) if isinstance(ex.json, dict) else []:
                for key in session.get("pendingRequests", []):
                    never = f"server request {key} was never answered"
                    never = f"session {session.get('sessionId')}: {never}"
                    problems.append(Problem(("checks", "requestsAnswered"), never))
    if problems:
        result.fail("end of run checks", problems)


def _script_file(loaded: LoadedScenario, tmp: Path) -> Path | None:
    """The file fake-codex reads: the scenario file itself, else one written for the run."""
    if loaded.scenario.app_server is None or loaded.path is not None:
        return loaded.path if loaded.scenario.app_server is not None else None
    path = tmp / "app-server.yaml"
    path.write_text(f.dump_yaml({"appServer": loaded.data["appServer"]}), encoding="utf-8")
    return path


def run_scenario_sync(loaded: LoadedScenario, options: RunOptions | None = None) -> ScenarioResult:
    """`run_scenario` in a fresh event loop (for threads and synchronous callers)."""
    return asyncio.run(run_scenario(loaded, options))
