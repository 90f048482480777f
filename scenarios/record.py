"""Record, then replay: a `model:` scenario run on the real codex (through the bridge,
with `scenarios.wire_tee` logging each codex process's JSON-RPC lines), written again
with an `appServer:` script that makes fake-codex say what codex said, and replayed.
scenarios/README.md ("Record, then replay") says how and what is normalised.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bridge.process.startup import probe_app_server
from fakes.app_server.wire import SEEDED_EPOCH_MS
from scenarios.cassette import yaml_text
from scenarios.format import LoadedScenario, ScenarioError, load_scenario, parse_scenario_text
from scenarios.harness import NO_CODEX, CodexNotFound, find_codex
from scenarios.reporting import format_result
from scenarios.runner import RunOptions, ScenarioResult, run_scenario
from scenarios.scrub import USER_AGENT_MACHINE

#: Every timestamp of a recording is frozen where a seeded fake-codex starts its clock.
FROZEN_MS = SEEDED_EPOCH_MS
FROZEN_S = FROZEN_MS // 1000
#: The seed written into recordings: fake-codex's own ids and `emittedAtMs` stamps are
#: then the same on every replay.
REPLAY_SEED = 1

_UUID = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-([0-9a-fA-F])[0-9a-fA-F]{3}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
_DATE_TIME = re.compile(r"\b\d{4}-\d{2}-\d{2}T\d{2}([:-])\d{2}\1\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})?")
_DATE_PATH = re.compile(r"(?<=/sessions/)\d{4}/\d{2}/\d{2}(?=/)")
_TIME_KEY = re.compile(r"^[a-z][A-Za-z0-9]*At(Ms)?$")
_DURATION_KEY = re.compile(r"^([a-z][A-Za-z0-9]*D|d)urationMs$")
_PROCESS_ID_KEYS = frozenset({"processId", "pid"})
#: Ids the scripted model makes up (`fakes.model_provider` counts them across processes).
_MODEL_ID = re.compile(r"^(msg|call|fc|resp)_(\d+)$")
#: codex's `initialize` userAgent: `<originator>/<version> (<os>; <arch>) <terminal>
#: (<client>; <version>)`; the middle two name the recording machine (`USER_AGENT_MACHINE`
#: stands for them).
_USER_AGENT = re.compile(r"^(\S+) \([^()]*\) .*? (\([^()]*\))$")
_FAKE_SENDS_ITSELF = "remoteControl/status/changed"
#: Sent at start-up, after the `initialize` reply, at a moment that varies from run to
#: run (before or after `initialized`, or during the first call): recorded as
#: `onInitialized` steps when they come before anything about a thread.
STARTUP_NOTIFICATIONS = frozenset({"configWarning"})


class RecordError(Exception):
    """Recording cannot start or go on; the message says why and what to do."""


@dataclass
class Translation:
    """Wire logs as an `appServer:` script."""

    script: dict[str, Any]
    #: Per process (in start order): the server's messages, normalised, in the order
    #: the replay writes them (`emittedAtMs` and what fake-codex sends itself left out).
    server_messages: list[list[dict[str, Any]]]
    warnings: list[str]
    #: Server requests the client never answered.
    unanswered_requests: int


@dataclass
class Recording(Translation):
    """What `record_scenario` produced: the translation of the wire logs, and more."""

    #: The written scenario as data, and as the YAML text written.
    data: dict[str, Any]
    text: str
    #: Where it was written (None: not written).
    path: Path | None
    #: The run of the source scenario on the real codex.
    source_result: ScenarioResult
    #: The run of the written scenario on fake-codex (None: not verified).
    replay_result: ScenarioResult | None = None
    codex_version: str | None = None
    #: The recording's directory (wire logs, the run), when kept (`keep_tmp`).
    directory: Path | None = None

    @property
    def replay_passed(self) -> bool | None:
        return None if self.replay_result is None else self.replay_result.passed


class Normaliser:
    """Makes one process's messages free of machine paths and run-to-run values (the
    table in scenarios/README.md, "Volatile values"). UUIDs, process ids and the scripted
    model's ids are numbered by first appearance, so references between messages agree.
    """

    def __init__(self, paths: dict[str, str], hostname: str | None = None) -> None:
        self._standins: dict[str, str] = {}
        for path, standin in paths.items():
            for form in {path, os.path.realpath(path)}:
                self._standins.setdefault(form.rstrip("/"), standin)
        longest_first = sorted(self._standins, key=len, reverse=True)
        either = "|".join(re.escape(p) for p in longest_first)
        self._paths = re.compile(either + r"(?=$|[/\s'\"`:;,)\]}\\])") if either else None
        self._hostname = hostname
        self._uuids: dict[str, str] = {}
        self._process_ids: dict[str, int] = {}
        self._model_ids: dict[str, str] = {}

    def value(self, value: Any, key: str | None = None) -> Any:
        """`value` normalised (a new object); `key` is the mapping key it sits under."""
        if isinstance(value, dict):
            return {k: self.value(v, k if isinstance(k, str) else None) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        if key == "userAgent" and isinstance(value, str):
            value = _USER_AGENT.sub(rf"\1 {USER_AGENT_MACHINE} \2", value)
        if key is not None and value is not None and not isinstance(value, bool):
            if key in _PROCESS_ID_KEYS and isinstance(value, int | str):
                number = self._process_ids.setdefault(str(value), 1001 + len(self._process_ids))
                return number if isinstance(value, int) else str(number)
            if isinstance(value, int | float):
                if _DURATION_KEY.match(key):
                    return 0
                if _TIME_KEY.match(key):
                    return FROZEN_MS if key.endswith("Ms") else FROZEN_S
        return self.string(value) if isinstance(value, str) else value

    def string(self, text: str) -> str:
        if self._hostname and text == self._hostname:
            return "localhost"
        if model_id := _MODEL_ID.match(text):  # numbered per prefix
            prefix = model_id.group(1)
            taken = sum(known.startswith(f"{prefix}_") for known in self._model_ids)
            return self._model_ids.setdefault(text, f"{prefix}_{taken + 1}")
        text = text.replace("$", "$$")
        if self._paths is not None:
            text = self._paths.sub(lambda m: self._standins[m.group(0)], text)
        text = _UUID.sub(self._uuid, text)
        text = _DATE_PATH.sub("2026/01/01", text)
        return _DATE_TIME.sub(_frozen_date_time, text)

    def _uuid(self, found: re.Match[str]) -> str:
        original, version = found.group(0).lower(), found.group(1).lower()
        if original not in self._uuids:
            head = f"{FROZEN_MS:012x}" if version == "7" else "0" * 12
            number = len(self._uuids) + 1
            self._uuids[original] = f"{head[:8]}-{head[8:]}-{version}000-8000-{number:012x}"
        return self._uuids[original]


def _frozen_date_time(found: re.Match[str]) -> str:
    sep, fraction = found.group(1), ".000" if found.group(2) else ""
    suffix = {None: "", "Z": "Z"}.get(found.group(3), "+00:00")
    return f"2026-01-01T00{sep}00{sep}00{fraction}{suffix}"


_Entry = tuple[str, dict[str, Any] | None, str]


@dataclass
class _ProcessLog:
    started: int = 0
    #: (direction, the JSON object or None, the line): "c" from the client (the
    #: bridge), "s" from the server.
    lines: list[_Entry] = field(default_factory=list)
    client_eof: bool = False
    exit: int | None = None


def _object(text: str) -> dict[str, Any] | None:
    try:
        message = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return message if isinstance(message, dict) else None


def _read_logs(directory: Path) -> list[_ProcessLog]:
    logs = []
    for path in sorted(directory.glob("wire-*.jsonl")):
        log = _ProcessLog()
        for raw in path.read_bytes().splitlines():
            entry = _object(raw.decode("utf-8", "replace")) or {}  # {}: a line cut by a kill
            log.started = int(entry.get("started", log.started))
            log.exit = entry.get("exit", log.exit)
            log.client_eof = log.client_eof or bool(entry.get("eof"))
            if str(entry.get("line", "")).strip():
                log.lines.append((entry["dir"], _object(entry["line"]), entry["line"]))
        if any(direction == "c" and message is not None for direction, message, _ in log.lines):
            logs.append(log)  # it speaks the protocol
    return sorted(logs, key=lambda log: log.started)


# -- races: one order for messages codex writes in either order --------------------------


def _at(value: Any, *keys: str) -> Any:
    """`value[key1][key2]...`, None where a level is not a mapping or lacks the key."""
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _news_before_its_reply(first: Any, second: Any) -> bool:
    """A reply written after the news about what it made (usually it comes first): the
    `thread/start` reply after `thread/started`, the `turn/start` reply after the turn's
    first notifications (the thread active, `turn/started`)."""
    if "method" in second or "id" not in second or "method" not in first:
        return False
    made = (_at(second, "result", "thread", "id"), _at(second, "result", "turn", "id"))
    if first["method"] == "thread/status/changed":
        return made[1] is not None and _at(first, "params", "status", "type") == "active"
    params = first.get("params")
    about = (_at(params, "thread", "id"), _at(params, "turnId"), _at(params, "turn", "id"))
    return any(value is not None and value in made for value in about)


def _active_before_declined_item(first: Any, second: Any) -> bool:
    """After a declined approval: the thread active again before the declined item
    completes (usually it comes after)."""
    return bool(
        first.get("method") == "thread/status/changed"
        and second.get("method") == "item/completed"
        and _at(first, "params", "status", "type") == "active"
        and _at(second, "params", "item", "status") == "declined"
    )


def _warning_before_a_turn_reply(first: Any, second: Any) -> bool:
    """A `warning` (the model's metadata not found, say) written before the `turn/start`
    reply (usually it follows): both go to the `turn/start` entry, in this order."""
    return bool(
        first.get("method") == "warning"
        and "method" not in second
        and _at(second, "result", "turn", "id") is not None
    )


#: Pairs of adjacent server messages that codex 0.169.0 writes in either order from run
#: to run; a recording always has them in the usual order (second one first).
RACES = (_news_before_its_reply, _active_before_declined_item, _warning_before_a_turn_reply)


def _canonical_order(lines: list[_Entry]) -> list[_Entry]:
    """`lines` with each racing pair (adjacent server messages) in its usual order."""
    lines = list(lines)
    changed = True
    while changed:
        changed = False
        for index in range(len(lines) - 1):
            (one, first, _), (other, second, _) = lines[index], lines[index + 1]
            if one == other == "s" and first and second and any(r(first, second) for r in RACES):
                lines[index], lines[index + 1] = lines[index + 1], lines[index]
                changed = True
    return lines


Steps = list[dict[str, Any]]


@dataclass
class _Turn:
    thread: str | None
    #: Where the turn's next messages go: its `turn/start` entry, then the `onReply`
    #: branch of its latest answered server request, or a later `turn/*` call on it.
    sink: Steps


class _Translator:
    """One process's log → script entries (scenarios/README.md, "What the script says").

    A server message goes where fake-codex will write it from, by what it is about (a
    reply: its call's entry; `thread/started`: after the reply that carried the thread;
    a turn's message: the turn's current steps; else the latest client request's entry),
    not by how it raced the client's next request: nothing waits for a client action
    that came after it in the recording.
    """

    def __init__(self, norm: Normaliser) -> None:
        self.norm = norm
        # What it makes: the script's entries, and the server's messages as normalised.
        self.initialize: dict[str, Any] | None = None
        self.on_initialized: Steps = []
        self.methods: dict[str, list[dict[str, Any]]] = {}
        #: The (normalised) params of each call in `methods`, index for index.
        self.method_params: dict[str, list[Any]] = {}
        self.server_messages: list[dict[str, Any]] = []
        self.latest: Steps | None = None
        self.prelude: Steps = []
        self.startup: Steps = []
        #: Client calls not answered yet, by id: their entry and params.
        self.calls: dict[Any, tuple[dict[str, Any], Any]] = {}
        #: Server requests by id: their step, and the turn they are about.
        self.requests: dict[Any, tuple[dict[str, Any], _Turn | None]] = {}
        self.turns: dict[str, _Turn] = {}
        self.active: dict[str | None, _Turn] = {}
        self.done: set[str] = set()
        self.thread_replies: dict[str, Steps] = {}
        self.saw_initialized = False
        self.dropped_remote_control = False
        self.thread_seen = False

    def run(self, log: _ProcessLog) -> _Translator:
        for direction, message, raw in _canonical_order(log.lines):
            if message is not None:
                (self.client if direction == "c" else self.server)(message)
            elif direction == "s":
                self.default_sink().append({"raw": self.norm.string(raw)})
        if log.exit is not None and not log.client_eof:
            # It ended before the client let it go: the replay ends there too.
            died = {"signal": signal.Signals(-log.exit).name} if log.exit < 0 else log.exit
            self.default_sink().append({"exit": died})
        return self.finish()

    def default_sink(self) -> Steps:
        return self.latest if self.latest is not None else self.prelude

    def client(self, message: dict[str, Any]) -> None:
        method, has_id = message.get("method"), "id" in message
        if isinstance(method, str) and has_id:
            behavior: dict[str, Any] = {"steps": self.prelude}
            self.prelude = []
            params = message.get("params")
            if method == "initialize" and self.initialize is None:
                self.initialize = behavior
            else:
                self.methods.setdefault(method, []).append(behavior)
                self.method_params.setdefault(method, []).append(self.norm.value(params))
            self.calls[_id_key(message["id"])] = (behavior, params)
            self.latest = behavior["steps"]
            turn = self.active.get(_text(_at(params, "threadId")))
            if method.startswith("turn/") and turn is not None:  # an interrupt, a steer
                turn.sink = behavior["steps"]  # the rest of the running turn goes there
        elif method == "initialized" and not self.saw_initialized:
            self.saw_initialized = True
            self.latest = self.on_initialized
        elif has_id:
            step, turn = self.requests.get(_id_key(message["id"]), ({"onReply": 0}, None))
            if "onReply" not in step:
                from fakes.app_server.steps import reply_key

                branch: Steps = []
                step["onReply"] = {reply_key(message): branch}
                self.latest = branch
                if turn is not None:
                    turn.sink = branch

    def server(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        starting = not self.thread_seen
        self.thread_seen = self.thread_seen or _about_a_thread(message)
        if method is None and "id" in message:
            self.response(message)
            return
        params = self.norm.value(message.get("params"))
        if "id" in message:
            request = {"method": method, "id": message["id"]}
            request |= {"params": params} if params is not None else {}
            self.server_messages.append(dict(request))  # the step gains `wait`
            step = {"request": request}
            turn = self.turn_of(message.get("params"))
            self.requests[_id_key(message["id"])] = (step, turn)
            (turn.sink if turn is not None else self.default_sink()).append(step)
            return
        if method == _FAKE_SENDS_ITSELF and not self.dropped_remote_control:
            self.dropped_remote_control = True
            return
        step = {"notify": {"method": method, "params": params}}
        self.server_messages.append({"method": method, "params": params})
        raw = message.get("params")
        if method in STARTUP_NOTIFICATIONS and starting:
            self.startup.append(step)
        elif (
            method == "thread/started"
            and (where := self.thread_replies.get(_text(_at(raw, "thread", "id")) or ""))
            is not None
        ):
            where.append(step)
        elif (turn := self.turn_of(raw)) is not None:
            turn.sink.append(step)
            if method == "turn/completed":
                self.done.update(t for t, known in self.turns.items() if known is turn)
                self.active.pop(turn.thread, None)
        else:
            self.default_sink().append(step)

    def response(self, message: dict[str, Any]) -> None:
        kind = "error" if "error" in message else "result"
        reply = {kind: self.norm.value(message.get(kind))}
        self.server_messages.append({"id": message["id"], **reply})
        call, params = self.calls.pop(_id_key(message["id"]), (None, None))
        if call is None:
            self.default_sink().append({"respondUnknownId": {"id": message["id"], **reply}})
            return
        steps: Steps = call["steps"]
        steps.append({"respond": reply})
        if (thread := _text(_at(message, "result", "thread", "id"))) is not None:
            self.thread_replies[thread] = steps
        if (turn := _text(_at(message, "result", "turn", "id"))) is not None:
            thread = _text(_at(params, "threadId"))
            self.turns.setdefault(turn, _Turn(thread, steps))
            if thread is not None and turn not in self.done:
                self.active.setdefault(thread, self.turns[turn])

    def turn_of(self, params: Any) -> _Turn | None:
        """The turn a message's params are about (registering a turn seen first here)."""
        if isinstance(params, dict):
            thread = _text(params.get("threadId"))
            turn_id = _text(params.get("turnId")) or _text(_at(params, "turn", "id"))
            if turn_id is not None:
                turn = self.turns.setdefault(turn_id, _Turn(thread, self.default_sink()))
                turn.thread = turn.thread or thread
                if thread is not None and turn_id not in self.done:
                    self.active.setdefault(thread, turn)
                return turn
            if thread is not None or "thread" in params:
                return None if thread is None else self.active.get(thread)
        # About nothing in particular (rate limits): the running turn, if exactly one.
        return next(iter(self.active.values())) if len(self.active) == 1 else None

    def finish(self) -> _Translator:
        self.on_initialized[:0] = self.startup
        for call, _ in self.calls.values():
            call["noReply"] = True
        for behavior in [self.initialize, *[b for bs in self.methods.values() for b in bs]]:
            if behavior is not None:
                _tidy(behavior)
        _no_wait_before_more(self.on_initialized)
        return self


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _about_a_thread(message: dict[str, Any]) -> bool:
    bodies = (message.get("params"), message.get("result"))
    return any(isinstance(body, dict) and {"threadId", "thread"} & body.keys() for body in bodies)


def _id_key(value: Any) -> tuple[str, Any]:
    return (type(value).__name__, value)


def _tidy(behavior: dict[str, Any]) -> None:
    """A `respond` that is the last step becomes the entry's `result`/`error`; a request
    followed by more steps in the same list does not wait."""
    steps = behavior.pop("steps")
    if steps and "respond" in steps[-1] and not ({"result", "error"} & behavior.keys()):
        behavior.update(steps.pop()["respond"])
    _no_wait_before_more(steps)
    if steps:
        behavior["steps"] = steps  # after result/error in the file


def _no_wait_before_more(steps: list[dict[str, Any]]) -> None:
    for index, step in enumerate(steps):
        if "request" in step and index < len(steps) - 1:
            step["request"]["wait"] = False
        for branch in step.get("onReply", {}).values():
            _no_wait_before_more(branch)


def _merge(scripts: list[_Translator], warnings: list[str]) -> dict[str, Any]:
    """One `appServer:` script for all processes (each replays it from its start)."""
    initialize = next((s.initialize for s in scripts if s.initialize is not None), None)
    for number, other in enumerate(scripts[1:], start=2):
        if other.initialize is not None and other.initialize != initialize:
            warnings.append(
                f"process {number} answered `initialize` differently from the first; "
                "the replay gives every process the first answer"
            )
    on_initialized = max((s.on_initialized for s in scripts), key=len, default=[])
    methods = dict.fromkeys(m for process in scripts for m in process.methods)
    return {
        "initialize": initialize,
        "onInitialized": on_initialized,
        "methods": {method: _merge_method(method, scripts, warnings) for method in methods},
    }


def _merge_method(
    method: str, scripts: list[_Translator], warnings: list[str]
) -> list[dict[str, Any]]:
    """The entries of `method` for all processes: in order when every process got the
    same answers as far as it went, else each with a `match` on the params that tell the
    calls apart (`_telling_keys`), so that each process finds its own answer."""
    sequences = [process.methods.get(method, []) for process in scripts]
    longest = max(sequences, key=len)
    if all(sequence == longest[: len(sequence)] for sequence in sequences):
        return list(longest)
    calls = [
        (number, index, entry, process.method_params[method][index])
        for number, process in enumerate(scripts, start=1)
        for index, entry in enumerate(process.methods.get(method, []))
    ]
    keys = _telling_keys([params for _, _, _, params in calls])
    merged: list[dict[str, Any]] = []
    for number, index, entry, params in calls:
        match = {key: params[key] for key in keys if isinstance(params, dict) and key in params}
        keyed = {"match": match, **entry} if match else dict(entry)
        if keyed in merged:
            continue
        if any(other.get("match", {}) == match for other in merged):
            warnings.append(
                f"process {number} answered `{method}` call {index + 1} differently from an "
                "earlier call with the same params; the replay gives both the first answer"
            )
            continue
        merged.append(keyed)
    return merged


def _telling_keys(all_params: list[Any]) -> list[str]:
    """Param keys whose values differ between calls and hold no machine path."""
    keys: dict[str, set[bytes]] = {}
    for params in all_params:
        for key, value in (params if isinstance(params, dict) else {}).items():
            keys.setdefault(key, set()).add(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
    return [
        key
        for key, values in keys.items()
        if len(values) > 1 and not any(b"${" in v or b"$$" in v for v in values)
    ]


def translate_wire_logs(
    directory: str | os.PathLike[str],
    paths: dict[str, str],
    *,
    version_output: str | None = None,
    hostname: str | None = None,
) -> Translation:
    """The `appServer:` script that replays the `scenarios.wire_tee` logs in `directory`;
    `paths` maps machine directories to what they become (`{"/tmp/run/work": "${cwd}"}`)."""
    host = socket.gethostname() if hostname is None else hostname
    scripts = [_Translator(Normaliser(paths, host)).run(log) for log in _read_logs(Path(directory))]
    warnings: list[str] = []
    script = {"version": 1, "seed": REPLAY_SEED, "versionOutput": version_output}
    script = {key: value for key, value in (script | _merge(scripts, warnings)).items() if value}
    return Translation(
        script,
        [s.server_messages for s in scripts],
        warnings,
        sum("onReply" not in step for s in scripts for step, _ in s.requests.values()),
    )


def _build_document(
    loaded: LoadedScenario, translated: Translation, name: str, codex_version: str | None
) -> dict[str, Any]:
    source_data = loaded.data if isinstance(loaded.data, dict) else {}
    source_name = loaded.path.name if loaded.path is not None else loaded.name
    recorded = (
        f"Recorded from {source_name} against the real codex"
        + (f" ({codex_version})" if codex_version else "")
        + " by `rest-bridge scenarios record`; replays on fake-codex, without codex. "
        "Re-record rather than edit the appServer section."
    )
    if "description" in source_data:
        recorded += f"\nThe recorded scenario: {str(source_data['description']).strip()}"
    # Keys in the usual order: scenario, name, description, tags, then the rest.
    document = {"scenario": source_data.get("scenario", 1), "name": name, "description": recorded}
    kept = [tag for tag in source_data.get("tags") or [] if tag != "real-codex"]
    document["tags"] = [*kept, "recorded"] if "recorded" not in kept else kept
    for key, value in source_data.items():
        if key == "model":
            document["appServer"] = translated.script
        elif key not in document:
            document[key] = copy.deepcopy(value)
    if translated.unanswered_requests:
        # A request codex sent and nobody answered (dropped by an interrupt, or left
        # pending): fake-codex keeps it pending, which the end check would flag.
        document["checks"] = {**(document.get("checks") or {}), "requestsAnswered": False}
    return document


async def record_scenario(
    source: str | os.PathLike[str] | LoadedScenario,
    output: str | os.PathLike[str] | None = None,
    *,
    codex: str | None = None,
    name: str | None = None,
    verify: bool = True,
    tmp_root: Path | None = None,
    keep_tmp: bool = False,
) -> Recording:
    """Run `source` (a scenario with `model:`) on the real codex, write its replay to
    `output` and, with `verify`, run that on fake-codex (`replay_result`). `RecordError`
    when it cannot: an unwritable `output` (checked first), no real codex, no `model:`,
    or a source run that fails (its report in the message)."""
    if output is not None:
        _check_output(Path(output))
    try:
        loaded = source if isinstance(source, LoadedScenario) else load_scenario(source)
    except ScenarioError as exc:
        raise RecordError(str(exc)) from None
    if not loaded.scenario.real_codex:
        raise RecordError(
            f"{loaded.source}: nothing to record: a recording runs the real codex with a "
            "scripted model, so the scenario needs a `model:` section (it has "
            + ("`appServer:`" if loaded.scenario.app_server is not None else "neither")
            + ")"
        )
    try:
        found = find_codex(codex, option="--codex")
    except CodexNotFound as exc:
        raise RecordError(f"cannot record {loaded.source}: {exc}") from None
    if found is None:
        raise RecordError(
            f"cannot record {loaded.source}: {NO_CODEX}. In a checkout of codex-rest-bridge "
            "`make codex` installs the pinned one; elsewhere `npm install -g @openai/codex`."
        )
    codex_version, _, _ = await probe_app_server([found, "--version"])  # the bridge's way
    workspace = Path(tempfile.mkdtemp(prefix="scenario-record-", dir=tmp_root))
    wire, home, runs = workspace / "wire", workspace / "home", workspace / "runs"
    for directory in (wire, home, runs):
        directory.mkdir()
    # HOME is a fresh, empty directory: codex runs commands in a login shell, and the
    # recording machine's dotfiles must not speak in the recording.
    prefix = [sys.executable, "-m", "scenarios.wire_tee", str(wire), "--", "env", f"HOME={home}"]
    options = RunOptions(
        codex=found, tmp_root=runs, keep_tmp=True, require_codex=True, app_server_prefix=prefix
    )
    keep = keep_tmp
    try:
        result = await run_scenario(loaded, options)
        if not result.passed:  # its report points into the directory: the run, the logs
            keep = True
            raise RecordError(
                f"cannot record {loaded.source}: it does not pass against the real codex, so "
                f"nothing was written.\n{format_result(result)}\n"
                f"The recording's directory is kept: {workspace}"
            )
        assert result.tmp is not None
        norm_paths = {  # `${cwd}`: fake-codex's working directory, the replay's ${tmp}/work
            str(result.tmp / "work"): "${cwd}",
            str(result.tmp / "codex-home"): "/home/codex/.codex",
            str(home): "/home/codex",
            str(workspace): "/recording",
        }
        translated = translate_wire_logs(wire, norm_paths, version_output=codex_version)
    finally:
        if not keep:
            shutil.rmtree(workspace, ignore_errors=True)
    if not translated.server_messages:
        raise RecordError(
            f"cannot record {loaded.source}: the bridge started no codex process that "
            "spoke the protocol (does the scenario make any call?)"
        )
    document = _build_document(loaded, translated, name or f"{loaded.name}-replay", codex_version)
    text = (
        "# Recorded by `rest-bridge scenarios record`: the appServer section is what the\n"
        '# real codex said, normalised (see scenarios/README.md, "Record, then replay").\n'
    ) + yaml_text(document, width=100)
    real = os.path.realpath(workspace)  # noqa: ASYNC240 - a local folder
    if any(path in text for path in {str(workspace), real}):  # pragma: no cover - a bug
        raise RecordError(f"the recording still names the machine path {str(workspace)!r}")
    path = Path(output) if output is not None else None
    try:
        replay = parse_scenario_text(text, str(path or f"<recording of {loaded.source}>"), path)
    except ScenarioError as exc:  # pragma: no cover - a bug in the recorder
        raise RecordError(f"the recorded scenario does not validate:\n{exc}") from None
    if path is not None:
        path.write_text(text, encoding="utf-8")
    recording = Recording(
        **vars(translated),
        data=document,
        text=text,
        path=path,
        source_result=result,
        codex_version=codex_version,
        directory=workspace if keep_tmp else None,
    )
    if verify:
        # Where `run` would put it: a failed replay's directory is kept and named.
        recording.replay_result = await run_scenario(replay, RunOptions(tmp_root=tmp_root))
    return recording


def _check_output(path: Path) -> None:
    """Refuse, before anything runs, an output file that could not be written at the end."""
    folder = path.parent
    if path.is_dir():
        problem = "is a directory"
    elif not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        problem = f"cannot be written: its folder {str(folder)!r} {what}"
    elif not os.access(folder, os.W_OK | os.X_OK) or (
        path.exists() and not os.access(path, os.W_OK)
    ):
        problem = "cannot be written: permission denied"
    else:
        return
    raise RecordError(f"the output {str(path)!r} {problem}; nothing was recorded")
