"""Cassettes: what the real bridge answered a scenario's steps, in VCR.py's YAML format
(what `scenarios.respx_mock` needs more sits under `codex:` keys vcrpy ignores), made
and checked by `rest-bridge scenarios record-cassettes|check-cassettes` (or `python -m
scenarios.cassette record|check`). See scenarios/README.md ("Cassettes").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import aiohttp
import orjson
import yaml

from fakes.app_server.script_source import ScriptError, _compose, _mark, parse_yaml
from scenarios import format as f
from scenarios.expectations import NO_JSON, step_request, substitute
from scenarios.format import LoadedScenario, ScenarioError
from scenarios.harness import RECORDER
from scenarios.matching import is_matcher, match
from scenarios.reporting import format_result
from scenarios.runner import RunOptions, ScenarioResult, run_scenario
from scenarios.scrub import Scrubber

#: The command that (re)records cassettes, named by every message about a stale one.
COMMAND = "python -m scenarios.cassette record"
ORIGIN = "http://bridge.test"  # of recorded URIs: the bridge's port varies
T = TypeVar("T")
_DROPPED = {"host", "user-agent", "accept", "accept-encoding", "content-length", "date"}
_DROPPED |= {"transfer-encoding", "server"}  # server: the recording machine's versions
_EVENTS = re.compile(r"/v1/sessions/[^/]+/events(/stream)?")


class CassetteError(ScenarioError):
    """No cassette can be had: the scenario fails on the bridge, or the file is broken."""


class StaleCassette(CassetteError):
    """The cassette is missing, or was recorded from another version of its scenario."""


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
    step: int | None = None  # the step that made it
    after: int | None = None  # a long-poll's event waits for this interaction
    #: SSE: [byte offset, interaction it waits for (or None)] per part of the body.
    marks: list[list[int | None]] = field(default_factory=list)
    started: float = field(default=0.0, repr=False)
    seen: int = field(default=0, repr=False)  # interactions started when the answer came

    @property
    def route(self) -> tuple[str, str]:
        """(method, decoded path): how the bridge routes it."""
        return self.method, unquote(urlsplit(self.path).path)

    @property
    def events(self) -> bool:
        return self.method == "GET" and bool(_EVENTS.fullmatch(self.route[1]))

    def header(self, name: str) -> str | None:
        found = {key.lower(): values for key, values in self.headers.items()}.get(name.lower())
        return found[0] if found else None

    def to_vcr(self) -> dict[str, Any]:
        codex = {"step": self.step, "after": self.after, "marks": self.marks or None}
        request = {"body": self.body, "headers": self.headers, "method": self.method}
        return {
            "request": {**request, "uri": ORIGIN + self.path},
            "response": {
                "status": {"code": self.status, "message": self.reason},
                "headers": self.response_headers,
                "body": {"string": self.response_body},
            },
            "codex": {key: value for key, value in codex.items() if value is not None},
        }

    @classmethod
    def from_vcr(cls, data: dict[str, Any]) -> Interaction:
        request, response, codex = data["request"], data["response"], data.get("codex") or {}
        uri, status = urlsplit(request["uri"]), response["status"]
        path = uri.path + (f"?{uri.query}" if uri.query else "")
        item = cls(request["method"], path, request.get("headers") or {}, request.get("body"))
        item.status, item.reason = status["code"], status.get("message", "")
        item.response_headers = response.get("headers") or {}
        item.response_body = (response.get("body") or {}).get("string") or ""
        item.step, item.after = codex.get("step"), codex.get("after")
        item.marks = codex.get("marks") or []
        return item


#: The cassette format written: 2 has the machine's paths and host name as placeholders
#: (`scenarios.scrub`); 1 (older) named the recording run's `${tmp}` under `codex.tmp`.
FORMAT = 2


@dataclass
class Cassette:
    """A scenario's recorded exchanges, the recording machine's details as placeholders
    (`scenarios.scrub`). `tmp` is set only on a cassette being upgraded from format 1."""

    scenario: str
    hash: str
    interactions: list[Interaction]
    tmp: str | None = None

    def dump(self) -> str:
        codex = {"format": FORMAT, "scenario": self.scenario, "hash": self.hash}
        items = [item.to_vcr() for item in self.interactions]
        return yaml_text({"version": 1, "codex": codex, "interactions": items}, width=10**6)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:  # one writer per file
            file.write(self.dump())
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: Path, scenario: str = "SCENARIO") -> Cassette:
        text: str | None = None
        at: tuple[Any, ...] = ()  # the part of the text being read (for its line)
        try:
            text = path.read_text(encoding="utf-8")
            data = parse_yaml(text, str(path))
            items = []
            for index, raw in enumerate(data["interactions"]):
                at = ("interactions", index)
                item = Interaction.from_vcr(raw)
                if not all(
                    isinstance(b, str | bytes | None) for b in (item.body, item.response_body)
                ):
                    raise TypeError(f"a body of {item.method} {item.path} is not text")
                items.append(item)
            at, codex = ("codex",), data["codex"]
            if codex.get("format", 1) > FORMAT:
                raise CassetteError(
                    f"{path}: cassette format {codex['format']} is newer than this tool "
                    f"reads ({FORMAT}); upgrade codex-rest-bridge or regenerate it: "
                    f"{COMMAND} {scenario}"
                )
            if codex.get("format", 1) < 2:  # the run's folder was kept as it was: scrub it
                tmp = codex.get("tmp")
                scrub(items, Scrubber({tmp: "tmp"} if tmp else {}, hostname=""))
            return cls(codex["scenario"], codex["hash"], items)
        except CassetteError:
            raise
        except ScriptError as exc:  # names the file, line and column itself
            raise CassetteError(
                f"not a cassette of this tool ({exc}); regenerate it: {COMMAND} {scenario}"
            ) from None
        except (OSError, KeyError, TypeError, AttributeError, ValueError) as exc:
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            root = _compose(text) if text is not None else None
            where = f"{path}:{':'.join(map(str, _mark(root, at)))}" if root else str(path)
            raise CassetteError(
                f"{where}: not a cassette of this tool ({why}); regenerate it: {COMMAND} {scenario}"
            ) from None


class _Dumper(yaml.SafeDumper):
    """Block style, short flat lists and mappings on one line, multi-line strings (SSE
    bodies) as blocks, so that a file reads as the wire did."""


def _represent(dumper: _Dumper, data: Any) -> yaml.Node:
    if isinstance(data, str):
        style = "|" if "\n" in data.rstrip("\n") else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)
    items = list(data.values()) if isinstance(data, dict) else data
    flat = not any(isinstance(item, dict | list | bytes) for item in items) and (
        len(orjson.dumps(data)) <= 60
        and not any(isinstance(item, str) and ("\n" in item or len(item) > 40) for item in items)
    )
    if isinstance(data, dict):
        return dumper.represent_mapping(
            "tag:yaml.org,2002:map", data.items(), flow_style=flat or None
        )
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat or None)


for _kind in (dict, list, str):
    _Dumper.add_representer(_kind, _represent)


def yaml_text(document: Any, *, width: int) -> str:
    """`document` as YAML (a cassette, a recorded scenario), keys in their order."""
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=width)


def scenario_hash(loaded: LoadedScenario) -> str:
    """The hash of the scenario document (as parsed: comments and layout do not count)."""
    document = loaded.data
    if document is None:
        document = loaded.scenario.model_dump(by_alias=True, exclude_unset=True, mode="json")
    encoded = orjson.dumps(document, option=orjson.OPT_SORT_KEYS, default=str)
    return "sha256:" + hashlib.sha256(encoded).hexdigest()


def cassette_path(scenario: Path) -> Path:
    """`cassettes/NAME.yaml` beside `NAME.scenario.yaml`."""
    name = re.sub(r"(\.scenario)?\.(yaml|yml|json)$", "", scenario.name)
    return scenario.parent / "cassettes" / f"{name}.yaml"


class _Recorder:
    """A client middleware keeping every exchange of the run, in the order they started."""

    def __init__(self) -> None:
        self.items: list[Interaction] = []

    async def __call__(
        self, request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        payload: Any = request.body
        body = payload if isinstance(payload, bytes) else await payload.as_bytes()
        headers, started = _kept_headers(request), time.monotonic()
        item = Interaction(request.method, request.url.raw_path_qs, headers, _decoded(body))
        item.started = started
        self.items.append(item)
        response = await handler(request)
        item.response_headers = _kept_headers(response)
        if response.headers.get("Content-Type", "").startswith("text/event-stream"):
            response.content = _Tee(response.content, item, self)  # type: ignore[assignment]
        else:
            item.response_body = _decoded(await response.read()) or ""
        item.seen, item.status = len(self.items), response.status
        item.reason = response.reason or ""
        return response


def _kept_headers(message: Any) -> dict[str, list[str]]:
    kept: dict[str, list[str]] = {}
    for name, value in message.headers.items():
        if name.lower() not in _DROPPED:
            kept.setdefault(str(name), []).append(value)
    return kept


def _decoded(raw: bytes) -> str | bytes | None:
    try:
        return raw.decode("utf-8") if raw else None
    except UnicodeDecodeError:
        return raw


class _Tee:
    """An SSE response's content: what the client reads is kept, with when it was read."""

    def __init__(self, inner: Any, item: Interaction, recorder: _Recorder) -> None:
        self._inner, self._item, self._recorder = inner, item, recorder

    def _keep(self, data: bytes) -> bytes:
        if data:
            body = self._item.response_body
            kept = body.encode() if isinstance(body, str) else body
            self._item.marks.append([len(kept), len(self._recorder.items)])
            self._item.response_body = kept + data
        return data

    async def readline(self) -> bytes:  # how `scenarios.sse.SseReader` reads, the only way
        return self._keep(await self._inner.readline())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def record_cassette(
    loaded: LoadedScenario, options: RunOptions | None = None
) -> tuple[Cassette, ScenarioResult]:
    """Run `loaded` on the real bridge and keep what its steps exchanged; `CassetteError`
    (with the run's report) when it does not pass."""
    recorder, options = _Recorder(), options or RunOptions()
    root = Path(tempfile.mkdtemp(prefix="cassette-", dir=options.tmp_root))
    home = root / "home"
    prefix = options.app_server_prefix
    if loaded.scenario.real_codex and prefix is None:
        # codex runs commands in a login shell: the machine's dotfiles must not speak in
        # the cassette, so its HOME is an empty folder (as `scenarios.record` does).
        home.mkdir()
        prefix = ["env", f"HOME={home}"]
    token = RECORDER.set(recorder)
    try:
        result = await run_scenario(
            loaded,
            dataclasses.replace(options, tmp_root=root, keep_tmp=True, app_server_prefix=prefix),
        )
    finally:
        RECORDER.reset(token)
    if not result.passed:  # a failed run's directory stays, as its report says
        raise CassetteError(
            f"{loaded.source}: no cassette: the scenario must pass on the bridge to be "
            f"recorded ({result.outcome}):\n{result.skip_reason or format_result(result)}"
        )
    if not options.keep_tmp:
        shutil.rmtree(root, ignore_errors=True)
    # The machine's folders and name become placeholders (replay takes any value there).
    items = _kept(loaded, result, recorder.items)
    scrub(items, Scrubber(_machine_paths(loaded, result, root)))
    return Cassette(loaded.name, scenario_hash(loaded), items), result


def _machine_paths(loaded: LoadedScenario, result: ScenarioResult, root: Path) -> dict[str, str]:
    """The recording machine's folders a cassette may name, and their placeholders."""
    paths = {str(root / "home"): "home", str(Path.home()): "home"}
    if result.tmp is not None:
        paths[str(result.tmp)] = "tmp"
    if loaded.path is not None:
        paths[str(loaded.path.resolve().parent)] = "scenarioDir"
    if sys.prefix != sys.base_prefix:  # a virtual environment: a folder of this machine
        paths[sys.prefix] = "prefix"
    return paths


def scrub(items: list[Interaction], scrubber: Scrubber) -> None:
    """Each interaction's request and response bodies with the machine taken out."""
    for item in items:
        if isinstance(item.body, str):
            item.body = scrubber.text(item.body)
        body, item.marks = scrubber.body(item.response_body, item.marks)
        item.response_body = body if body is not None else ""


def _kept(
    loaded: LoadedScenario, result: ScenarioResult, items: list[Interaction]
) -> list[Interaction]:
    """The interactions replay serves, each with its step and what its events wait for."""
    steps = loaded.scenario.steps
    step_times = [
        (result.transcript.started + offset, int(text.split(":", 1)[0].split()[1]) - 1)
        for offset, source, text in result.transcript.entries
        if source == "step"
    ]
    patterns = [_pattern(step) for step in steps]
    background = [i for i, step in enumerate(steps) if getattr(step, "background", None)]
    for i in background:  # its request starts once a later step has begun
        since = next((t for t, index in step_times if index == i), 0.0)
        for item in items:
            if item.step is None and item.started >= since and _matches(patterns[i], item):
                item.step = i
                break
    for item in items:
        if item.step is None:
            now = max((i for t, i in step_times if t <= item.started), default=0)
            candidates = (i for i in range(now, -1, -1) if i not in background)
            item.step = next((i for i in candidates if _matches(patterns[i], item)), now)
    # With `model:`, the runner's end check lists the sessions: no step made that request.
    if loaded.scenario.model is not None and loaded.scenario.checks.requests_answered:
        items = items[:-1] if items and items[-1].route == ("GET", "/v1/sessions") else items
    # An `until` step settles on its last attempt; long-polls' 204s depend on timing: one
    # per path and query is kept (so the route exists); unanswered requests go.
    last = {item.step: item for item in items if getattr(steps[item.step or 0], "until", None)}
    idle: set[tuple[str, str]] = set()
    keep = []
    for item in items:
        key = (item.route[1], re.sub(r"waitMs=\d+&?", "", urlsplit(item.path).query))
        if not item.status or last.get(item.step, item) is not item:
            continue
        if item.events and item.status == 204:
            if key in idle:
                continue
            idle.add(key)
        if isinstance(item.response_body, bytes):  # an SSE body: text when it is UTF-8
            item.response_body = _decoded(item.response_body) or ""
        keep.append(item)
    # A request that may cause events: not a read, not refused.
    changes = [item.method != "GET" and 200 <= item.status < 400 for item in keep]
    changers = [(items.index(item), kept) for kept, item in enumerate(keep) if changes[kept]]

    def trigger(seen: int | None, own: int) -> int | None:
        return next((k for o, k in reversed(changers) if o < (seen or 0) and k != own), None)

    for own, item in enumerate(keep):
        if item.events and item.route[1].endswith("/events"):
            item.after = trigger(item.seen, own)
        marks: list[list[int | None]] = []
        for offset, seen in item.marks:
            if not marks or marks[-1][1] != trigger(seen, own):
                marks.append([offset, trigger(seen, own)])
        item.marks = marks
    return keep


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
    path = unquote(urlsplit(request.path).path)  # as `Interaction.route`: no query
    return request.method, _wildcards(path), request.json_body


def _matches(pattern: tuple[str, re.Pattern[str], Any] | None, item: Interaction) -> bool:
    method, path = item.route
    if pattern is None or pattern[0] != method or not pattern[1].fullmatch(path):
        return False
    try:
        body = orjson.loads(item.body) if isinstance(item.body, str) else NO_JSON
    except orjson.JSONDecodeError:
        body = NO_JSON
    return (
        pattern[2] is NO_JSON or body is NO_JSON or not json_difference(pattern[2], body, _variable)
    )


def _wildcards(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape(_ANY), ".*?"))


def _variable(text: str) -> Any:
    """A string of a step's template: its variables (`_ANY`) match anything."""
    if text == _ANY:
        return {"$any": True}
    return {"$regex": rf"\A(?:{_wildcards(text).pattern})\Z"} if _ANY in text else text


def json_difference(expected: Any, received: Any, template: Callable[[str], Any]) -> str | None:
    """Where and how `received` differs from `expected` (None: alike), in a few words, by
    `scenarios.matching.match`; `template` makes a string of `expected` what it matches."""

    def shaped(value: Any) -> Any:
        if isinstance(value, dict):
            return {"$eq": value} if is_matcher(value) else {k: shaped(v) for k, v in value.items()}
        if isinstance(value, list):
            return [shaped(item) for item in value]
        return template(value) if isinstance(value, str) else value

    found = match(shaped(expected), received, subset=False)
    return str(found[0]) if found else None


def cassette_for(
    loaded: LoadedScenario, *, record: str | None = None, options: RunOptions | None = None
) -> Cassette:
    """The cassette of `loaded`: `record="once"` (the default; `"none"` when `CI=true`)
    records a missing one, `"none"` never records, `"refresh"` re-records a stale one too,
    `"all"` any; a stale one is else a `StaleCassette` naming the command to run. A
    scenario not read from a file is recorded each time (there is nowhere to keep it)."""
    record = record or ("none" if os.environ.get("CI", "").lower() == "true" else "once")
    if record not in ("none", "once", "refresh", "all"):
        raise ValueError(f"record must be none, once, refresh or all, not {record!r}")
    if loaded.path is None:
        return run_sync(lambda: record_cassette(loaded, options))[0]
    path, regenerate = cassette_path(loaded.path), f"{COMMAND} {loaded.source}"
    if path.exists() and record != "all":
        try:
            cassette: Cassette | None = Cassette.load(path, loaded.source)
        except CassetteError:
            if record != "refresh":
                raise
            cassette = None
        if cassette is not None and cassette.hash == scenario_hash(loaded):
            return cassette
        if record != "refresh":
            raise StaleCassette(
                f"{path} is older than its scenario {loaded.source} (the scenario changed "
                f"since it was recorded); regenerate it: {regenerate}"
            )
    elif not path.exists() and record == "none":
        raise StaleCassette(f"{loaded.source} has no cassette ({path}); record it: {regenerate}")
    cassette = run_sync(lambda: record_cassette(loaded, options))[0]
    cassette.save(path)
    return cassette


def run_sync(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to its end from sync code, even inside a running event loop."""
    with concurrent.futures.ThreadPoolExecutor(1, "cassette-recorder") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


if __name__ == "__main__":  # the older spelling of `rest-bridge scenarios record-cassettes`
    from scenarios.cli import main

    argv = sys.argv[1:]
    if argv[:1] in (["record"], ["check"]):
        argv[0] += "-cassettes"
    raise SystemExit(main(argv))
