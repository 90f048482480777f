"""Cassettes: what the real bridge answered for a scenario, in VCR.py's YAML format.

A cassette is made by running the scenario once on the real bridge (with fake-codex, or
the real codex for `model:` scenarios) and keeping every HTTP exchange the steps made:
request method, URI, headers and body; response status, headers and body, an SSE
stream's body being the bytes the client read. The respx mock (`scenarios.respx_mock`)
replays it, so what a host sees is the bridge's own bytes by construction.

The file is VCR.py's cassette (`version: 1`, `interactions: [{request, response}]`), so
vcrpy and pytest-recording read it; what replay needs beyond that sits under `codex:`
keys they ignore: the hash of the scenario document it was recorded from (a cassette
whose hash differs is stale: `StaleCassette` names the command that regenerates it),
each interaction's step, and which earlier request an event waits for.

    python -m scenarios.cassette record PATHS...   # (re)record what is missing or stale
    python -m scenarios.cassette check PATHS...    # exit 1 naming each one missing or stale
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import aiohttp
import orjson
import yaml

from scenarios import format as f
from scenarios.expectations import NO_JSON, step_request, substitute
from scenarios.format import LoadedScenario, ScenarioError, load_scenario
from scenarios.harness import RECORDER
from scenarios.reporting import format_result
from scenarios.runner import RunOptions, ScenarioResult, run_scenario

__all__ = [
    "COMMAND",
    "Cassette",
    "CassetteError",
    "Interaction",
    "StaleCassette",
    "cassette_for",
    "cassette_path",
    "record_cassette",
    "scenario_hash",
]

#: The command that (re)records cassettes, named by every message about a stale one.
COMMAND = "python -m scenarios.cassette record"
#: The origin recorded URIs use (the bridge's real port changes from run to run).
ORIGIN = "http://bridge.test"
FORMAT = 1
T = TypeVar("T")
_DROPPED_REQUEST = {"host", "user-agent", "accept", "accept-encoding", "content-length"}
_DROPPED_RESPONSE = {"date", "transfer-encoding"}
_EVENTS = re.compile(r"/v1/sessions/[^/]+/events(/stream)?")


class CassetteError(ScenarioError):
    """No cassette can be had: the scenario fails on the bridge, or the file is broken."""


class StaleCassette(CassetteError):
    """The cassette was recorded from another version of its scenario (or is missing)."""


@dataclass
class Interaction:
    """One recorded exchange, and what replay needs to know about it."""

    method: str
    path: str  # as sent, with its query
    headers: dict[str, list[str]]
    body: str | bytes | None
    status: int = 0
    reason: str = ""
    response_headers: dict[str, list[str]] = field(default_factory=dict)
    response_body: str | bytes = ""
    #: The step (index into `steps`) that made it; None when unknown.
    step: int | None = None
    #: The interaction the host must have made before this response is given (events).
    after: int | None = None
    #: SSE: [byte offset, interaction it waits for (or None)] per part of the body.
    marks: list[list[int | None]] = field(default_factory=list)
    started: float = field(default=0.0, repr=False)
    #: How many interactions had started when the response (or each SSE part) came.
    seen: int = field(default=0, repr=False)

    @property
    def route(self) -> tuple[str, str]:
        """(method, decoded path): how the bridge routes it."""
        return self.method, unquote(urlsplit(self.path).path)

    @property
    def events(self) -> bool:
        return self.method == "GET" and bool(_EVENTS.fullmatch(self.route[1]))

    def header(self, name: str) -> str | None:
        values = self.headers.get(name) or self.headers.get(name.title())
        return values[0] if values else None

    def to_vcr(self) -> dict[str, Any]:
        codex = {"step": self.step, "after": self.after, "marks": self.marks or None}
        return {
            "request": {
                "body": self.body,
                "headers": self.headers,
                "method": self.method,
                "uri": ORIGIN + self.path,
            },
            "response": {
                "status": {"code": self.status, "message": self.reason},
                "headers": self.response_headers,
                "body": {"string": self.response_body},
            },
            "codex": {key: value for key, value in codex.items() if value is not None},
        }

    @classmethod
    def from_vcr(cls, data: dict[str, Any]) -> Interaction:
        request, response = data["request"], data["response"]
        codex = data.get("codex") or {}
        uri = urlsplit(request["uri"])
        return cls(
            request["method"],
            uri.path + (f"?{uri.query}" if uri.query else ""),
            request.get("headers") or {},
            request.get("body"),
            response["status"]["code"],
            response["status"].get("message", ""),
            response.get("headers") or {},
            (response.get("body") or {}).get("string") or "",
            codex.get("step"),
            codex.get("after"),
            codex.get("marks") or [],
        )


@dataclass
class Cassette:
    """A scenario's recorded exchanges."""

    scenario: str
    hash: str
    interactions: list[Interaction]
    #: The recording run's `${tmp}` (it varies from run to run).
    tmp: str | None = None
    path: Path | None = None

    def dump(self) -> str:
        document = {
            "version": 1,
            "codex": {
                "format": FORMAT,
                "scenario": self.scenario,
                "hash": self.hash,
                "tmp": self.tmp,
            },
            "interactions": [item.to_vcr() for item in self.interactions],
        }
        return yaml.dump(
            document, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100_000
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(self.dump(), encoding="utf-8")
        os.replace(temporary, path)
        self.path = path

    @classmethod
    def load(cls, path: Path) -> Cassette:
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
            codex = data["codex"]
            items = [Interaction.from_vcr(item) for item in data["interactions"]]
            return cls(codex["scenario"], codex["hash"], items, codex.get("tmp"), path)
        except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
            raise CassetteError(
                f"{path}: not a cassette of this tool ({exc!r}); regenerate it: {COMMAND} SCENARIO"
            ) from None


_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (SSE bodies) as blocks, so a cassette reads as the wire did."""


def _text(dumper: yaml.SafeDumper, value: str) -> Any:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def scenario_hash(loaded: LoadedScenario) -> str:
    """The hash of the scenario document (as parsed: comments and layout do not count)."""
    document = loaded.data
    if document is None:
        document = loaded.scenario.model_dump(by_alias=True, exclude_unset=True, mode="json")
    encoded = orjson.dumps(document, option=orjson.OPT_SORT_KEYS, default=str)
    return "sha256:" + hashlib.sha256(encoded).hexdigest()


def cassette_path(scenario: Path) -> Path:
    """`cassettes/NAME.yaml` beside `NAME.scenario.yaml`."""
    name = scenario.name
    for suffix in (".scenario.yaml", ".scenario.yml", ".yaml", ".yml", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return scenario.parent / "cassettes" / f"{name}.yaml"


# -- recording ---------------------------------------------------------------------------


class _Recorder:
    """A client middleware keeping every exchange of the run, in the order they started."""

    def __init__(self) -> None:
        self.items: list[Interaction] = []

    async def __call__(
        self, request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        headers: dict[str, list[str]] = {}
        for name, value in request.headers.items():
            if name.lower() not in _DROPPED_REQUEST:
                headers.setdefault(str(name), []).append(value)
        payload: Any = request.body
        body = payload if isinstance(payload, bytes) else await payload.as_bytes()
        item = Interaction(request.method, request.url.raw_path_qs, headers, _decoded(body))
        item.started = time.monotonic()
        self.items.append(item)
        response = await handler(request)
        for name, value in response.headers.items():
            if name.lower() not in _DROPPED_RESPONSE:
                item.response_headers.setdefault(str(name), []).append(value)
        if response.headers.get("Content-Type", "").startswith("text/event-stream"):
            response.content = _Tee(response.content, item, self)  # type: ignore[assignment]
        else:
            item.response_body = _decoded(await response.read()) or ""
        item.seen = len(self.items)
        item.status, item.reason = response.status, response.reason or ""
        return response


def _decoded(raw: bytes) -> str | bytes | None:
    if not raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


class _Tee:
    """An SSE response's content: what the client reads is kept, with when it was read."""

    def __init__(self, inner: Any, item: Interaction, recorder: _Recorder) -> None:
        self._inner, self._item, self._recorder = inner, item, recorder
        self._buffer = bytearray()

    def _keep(self, data: bytes) -> bytes:
        if data:
            self._item.marks.append([len(self._buffer), len(self._recorder.items)])
            self._buffer += data
            self._item.response_body = bytes(self._buffer)
        return data

    async def readline(self) -> bytes:
        return self._keep(await self._inner.readline())

    async def read(self, n: int = -1) -> bytes:
        return self._keep(await self._inner.read(n))

    async def readany(self) -> bytes:
        return self._keep(await self._inner.readany())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def record_cassette(
    loaded: LoadedScenario, options: RunOptions | None = None
) -> tuple[Cassette, ScenarioResult]:
    """Run `loaded` on the real bridge and keep what its steps exchanged.

    Raises `CassetteError` (with the run's report) when the scenario does not pass.
    """
    recorder = _Recorder()
    options = options or RunOptions()
    root = Path(tempfile.mkdtemp(prefix="cassette-", dir=options.tmp_root))
    token = RECORDER.set(recorder)
    try:
        result = await run_scenario(loaded, dataclasses.replace(options, tmp_root=root))
    finally:
        RECORDER.reset(token)
        shutil.rmtree(root, ignore_errors=True)
    if not result.passed:
        why = result.skip_reason or format_result(result)
        raise CassetteError(
            f"{loaded.source}: no cassette: the scenario must pass on the bridge to be "
            f"recorded ({result.outcome}):\n{why}"
        )
    items = _kept(loaded, result, recorder.items)
    # The run's `${tmp}` varies from run to run: replay takes any path in its place.
    found = re.search(
        re.escape(str(root)) + r"/scenario-[^/\s\"]+", result.transcript.entries[0][2]
    )
    tmp = found.group(0) if found else None
    return Cassette(loaded.name, scenario_hash(loaded), items, tmp=tmp), result


def _kept(
    loaded: LoadedScenario, result: ScenarioResult, items: list[Interaction]
) -> list[Interaction]:
    """The interactions replay serves: answered ones of the steps, with their triggers."""
    scenario = loaded.scenario
    started = result.transcript.started
    step_times = [
        (started + offset, int(text.split(":", 1)[0].split()[1]) - 1)
        for offset, source, text in result.transcript.entries
        if source == "step"
    ]
    patterns = [_pattern(step) for step in scenario.steps]
    times = dict((i, t) for t, i in step_times)
    background = [i for i, step in enumerate(scenario.steps) if getattr(step, "background", None)]
    for i in background:  # its request starts once a later step has begun
        pattern = patterns[i]
        first = next(
            (
                item
                for item in items
                if item.step is None
                and item.started >= times.get(i, 0.0)
                and _matches(pattern, item)
            ),
            None,
        )
        if first is not None:
            first.step = i
    for item in items:
        if item.step is not None:
            continue
        current = max((i for t, i in step_times if t <= item.started), default=0)
        item.step = next(
            (
                i
                for i in range(current, -1, -1)
                if i not in background and _matches(patterns[i], item)
            ),
            current,
        )
    # With `model:`, the runner's end check lists the sessions: no step made that request.
    end_check = scenario.model is not None and scenario.checks.requests_answered
    if end_check and items and items[-1].route == ("GET", "/v1/sessions"):
        items = items[:-1]
    idle: set[tuple[str, str]] = set()
    last_of_until = {
        item.step: item
        for item in items
        if item.step is not None and getattr(scenario.steps[item.step], "until", None)
    }
    keep = [
        item
        for item in items
        if item.status
        and not (item.events and item.status == 204 and _idle_seen(item, idle))
        and (item.step not in last_of_until or last_of_until[item.step] is item)
    ]
    index = {id(item): position for position, item in enumerate(keep)}
    changers = [(items.index(item), index[id(item)]) for item in keep if _changes(item)]

    def trigger(seen: int, own: int) -> int | None:
        found = [kept for original, kept in changers if original < seen and kept != own]
        return found[-1] if found else None

    for item in keep:
        own = index[id(item)]
        if item.events and item.route[1].endswith("/events"):
            item.after = trigger(item.seen, own)
        marks: list[list[int | None]] = []
        for offset, seen in item.marks:
            after = trigger(seen or 0, own)
            if not marks or marks[-1][1] != after:
                marks.append([offset, after])
        item.marks = marks
    return keep


def _idle_seen(item: Interaction, seen: set[tuple[str, str]]) -> bool:
    """Whether a long-poll's 204 like this one is kept already (one per path and query)."""
    query = "&".join(p for p in urlsplit(item.path).query.split("&") if not p.startswith("waitMs="))
    key = (item.route[1], query)
    if key in seen:
        return True
    seen.add(key)
    return False


def _changes(item: Interaction) -> bool:
    """A request that may cause events: not a read, not refused."""
    return item.method != "GET" and 200 <= item.status < 400


_ANY = "\x00any\x00"


def _pattern(step: Any) -> tuple[str, re.Pattern[str], Any] | None:
    """The method, path (a regex) and JSON body (`_ANY` for variables) of the requests
    `step` makes; None: it makes none."""
    if isinstance(step, f.PollStep):
        return "GET", re.compile(r"/v1/sessions/.+/events"), NO_JSON
    try:
        request = step_request(step, lambda value: substitute(value, lambda name: _ANY))
    except TypeError:
        return None
    path = unquote(urlsplit(request.path).path if "://" in request.path else request.path)
    regex = re.escape(path).replace(re.escape(_ANY), ".*?")
    return request.method, re.compile(regex), request.json_body


def _matches(pattern: tuple[str, re.Pattern[str], Any] | None, item: Interaction) -> bool:
    method, path = item.route
    if pattern is None or pattern[0] != method or not pattern[1].fullmatch(path):
        return False
    if pattern[2] is NO_JSON or not isinstance(item.body, str):
        return True
    try:
        return _fits(pattern[2], orjson.loads(item.body))
    except orjson.JSONDecodeError:
        return True


def _fits(template: Any, value: Any) -> bool:
    if isinstance(template, dict):
        return (
            isinstance(value, dict)
            and template.keys() == value.keys()
            and all(_fits(template[key], value[key]) for key in template)
        )
    if isinstance(template, list):
        return (
            isinstance(value, list)
            and len(template) == len(value)
            and all(_fits(a, b) for a, b in zip(template, value, strict=True))
        )
    if isinstance(template, str) and _ANY in template:
        if template == _ANY:
            return True
        pattern = ".*?".join(re.escape(part) for part in template.split(_ANY))
        return isinstance(value, str) and bool(re.fullmatch(pattern, value, re.S))
    return bool(template == value)


# -- finding one -------------------------------------------------------------------------


def _ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def cassette_for(
    loaded: LoadedScenario, *, record: str | None = None, options: RunOptions | None = None
) -> Cassette:
    """The cassette of `loaded`, recorded as `record` says.

    `record`: `"once"` records a missing cassette (the default; `"none"` when
    `CI=true`), `"none"` never records, `"refresh"` also re-records a stale one. A
    stale cassette is otherwise a `StaleCassette` naming the command to run. A
    scenario not read from a file is recorded each time (nowhere to keep it).
    """
    record = record or ("none" if _ci() else "once")
    if record not in ("none", "once", "refresh"):
        raise ValueError(f"record must be none, once or refresh, not {record!r}")
    if loaded.path is None:
        return run_sync(lambda: record_cassette(loaded, options))[0]
    path = cassette_path(loaded.path)
    regenerate = f"{COMMAND} {loaded.source}"
    if path.exists():
        cassette = Cassette.load(path)
        if cassette.hash == scenario_hash(loaded):
            return cassette
        if record != "refresh":
            raise StaleCassette(
                f"{path} is older than its scenario {loaded.source} (the scenario changed "
                f"since it was recorded); regenerate it: {regenerate}"
            )
    elif record == "none":
        raise StaleCassette(f"{loaded.source} has no cassette ({path}); record it: {regenerate}")
    cassette = run_sync(lambda: record_cassette(loaded, options))[0]
    cassette.save(path)
    return cassette


def run_sync(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to its end from sync code, even inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, asyncio.run(make())))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name="cassette-recorder")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


# -- the command -------------------------------------------------------------------------


def _scenario_files(paths: Sequence[str]) -> Iterator[Path]:
    for name in paths:
        path = Path(name)
        if path.is_dir():
            for found in sorted([*path.rglob("*.scenario.yaml"), *path.rglob("*.scenario.yml")]):
                if not any(part.startswith(".") for part in found.relative_to(path).parts):
                    yield found
        else:
            yield path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scenarios.cassette",
        description="Record the cassettes the respx mocks replay (cassettes/NAME.yaml beside "
        "each NAME.scenario.yaml), or check that none is missing or stale.",
    )
    parser.add_argument("action", choices=("record", "check"))
    parser.add_argument("paths", nargs="+", help="scenario files or folders")
    parser.add_argument("--all", action="store_true", help="record: also the fresh ones")
    parser.add_argument("--codex", help="the real codex, for scenarios with `model:`")
    args = parser.parse_args(argv)
    status = 0
    for path in _scenario_files(args.paths):
        try:
            loaded = load_scenario(path)
            if args.action == "check":
                cassette_for(loaded, record="none")
                continue
            target = cassette_path(path)
            if args.all and target.exists():
                target.unlink()
            fresh = target.exists() and Cassette.load(target).hash == scenario_hash(loaded)
            cassette_for(loaded, record="refresh", options=RunOptions(codex=args.codex))
            word = "fresh" if fresh else "recorded"
            print(f"{word:8}  {target}  ({len(Cassette.load(target).interactions)} exchanges)")
        except ScenarioError as exc:
            print(f"FAILED    {path}: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
