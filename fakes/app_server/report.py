"""What a fake-codex process did, written as JSON for test harnesses (opt-in).

With ``$FAKE_CODEX_REPORT`` set to a directory, every ``fake-codex app-server`` process
writes ``<dir>/fake-codex-<pid>.json`` and keeps it current (rewritten atomically soon
after each change, and once more when it exits). A harness reads these files after the
run to check that no scripted reply went unused and no server request went unanswered,
and to show the fake's side of the conversation when a test fails.

    {"pid": 123, "exit": {"code": 0} | null,
     "serverRequests": [{"id": 0, "method": "...", "state": "pending|answered|dropped",
                         "reply": "result|error|null"}],
     "initialize": 1 | null,
     "methods": {"x/foo": [1, 0]},
     "turns": [1, 0],
     "wire": [{"atMs": 0, "dir": "in|out", "text": "..."}], "wireDropped": 0}

``methods.<m>`` and ``turns`` give, for each scripted entry in script order, how many
requests it answered (0: never used); ``initialize`` how often a scripted
``initialize`` answered (null when none is scripted). ``wire`` keeps the newest
protocol lines each way (long ones cut), ``wireDropped`` how many older ones were let
go.

A server with a report tells it what happens through the hooks of `Report`, and sends
its lines through `Report.watch`; the report knows the script and that sink, never the
server.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from fakes.app_server.wire import Message, RequestId, Sink, encode, now_ms

if TYPE_CHECKING:
    from fakes.app_server.script import AppServerScript

REPORT_ENV = "FAKE_CODEX_REPORT"
WIRE_KEEP = 400
TEXT_KEEP = 1000


class Report:
    """The observed state of one server, and the file it is written to."""

    def __init__(self, script: AppServerScript | None, path: str) -> None:
        self.path = path
        self.requests: dict[Any, dict[str, Any]] = {}
        self.exit: dict[str, Any] | None = None
        self.wire: deque[dict[str, Any]] = deque(maxlen=WIRE_KEEP)
        self.wire_seen = 0
        self.methods: dict[str, list[Any]] = dict(script.methods) if script else {}
        self.method_uses = {name: [0] * len(entries) for name, entries in self.methods.items()}
        self.turns: list[Any] = list(script.turns) if script else []
        self.turn_uses = [0] * len(self.turns)
        self.initialize_uses: int | None = (
            0 if script is not None and script.initialize is not None else None
        )
        self._scheduled = False

    def used(self, method: str | None, entry: Any) -> None:
        """A scripted entry answered: a method's behavior, or a turn (`method` None)."""
        if method == "initialize":
            self.initialize_uses = (self.initialize_uses or 0) + 1
        else:
            entries = self.turns if method is None else self.methods.get(method, [])
            uses = self.turn_uses if method is None else self.method_uses.get(method, [])
            for index, candidate in enumerate(entries):
                if candidate is entry:
                    uses[index] += 1
                    break
        self.changed()

    def snapshot(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping."""
        return {
            "pid": os.getpid(),
            "exit": self.exit,
            "serverRequests": list(self.requests.values()),
            "initialize": self.initialize_uses,
            "methods": self.method_uses,
            "turns": self.turn_uses,
            "wire": list(self.wire),
            "wireDropped": self.wire_seen - len(self.wire),
        }

    def flush(self) -> None:
        """Write the report now (atomically: readers never see half a file)."""
        self._scheduled = False
        temporary = f"{self.path}.tmp"
        with contextlib.suppress(OSError):
            with open(temporary, "wb") as handle:
                handle.write(orjson.dumps(self.snapshot(), default=str))
            os.replace(temporary, self.path)

    def changed(self) -> None:
        """Write the report soon; many changes in one loop iteration make one write."""
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)

    def line(self, direction: str, data: bytes) -> None:
        """Keep one protocol line (or chunk of lines) of the transcript."""
        text = data.decode("utf-8", "replace").rstrip("\n")
        if len(text) > TEXT_KEEP:
            text = f"{text[:TEXT_KEEP]}... (+{len(text) - TEXT_KEEP} characters)"
        self.wire.append({"atMs": now_ms(), "dir": direction, "text": text})
        self.wire_seen += 1
        self.changed()

    # What the server tells its report (see `AppServer`).

    def watch(self, out: Sink) -> Sink:
        """`out`, with every line the server puts through it kept in the transcript."""
        return _Watched(out, self)

    def received(self, line: bytes) -> None:
        """A line the server read and is about to handle."""
        if line.strip():
            self.line("in", line)

    def request_sent(self, request_id: RequestId, method: str) -> None:
        """A server request went out."""
        self.requests[_key(request_id)] = {
            "id": request_id,
            "method": method,
            "state": "pending",
            "reply": None,
        }
        self.changed()

    def response_received(self, request_id: RequestId, message: Message, *, awaited: bool) -> None:
        """The client answered a server request (`awaited`: one the server still waits on)."""
        entry = self.requests.get(_key(request_id))
        if entry is not None and entry["state"] == "pending" and awaited:
            entry["state"] = "answered"
            entry["reply"] = "error" if "error" in message else "result"
            self.changed()

    def requests_dropped(self, request_ids: Iterable[RequestId]) -> None:
        """An interrupted turn let these server requests go unanswered."""
        for request_id in request_ids:
            entry = self.requests.get(_key(request_id))
            if entry is not None and entry["state"] == "pending":
                entry["state"] = "dropped"
        self.changed()

    def exiting(self, code: int) -> None:
        """The server stops with status `code` (the first reason given is kept)."""
        if self.exit is None:
            self.exit = {"code": code, "signal": None}
        self.flush()

    def killed(self, signame: str) -> None:
        """The server dies by signal `signame`."""
        self.exit = {"code": None, "signal": signame}
        self.flush()


class _Watched:
    """A sink that keeps a transcript of what goes through it."""

    def __init__(self, out: Sink, report: Report) -> None:
        self._out = out
        self._report = report

    def send(self, message: Message) -> None:
        self._report.line("out", encode(message))
        self._out.send(message)

    def write(self, data: bytes) -> None:
        self._report.line("out", data)
        self._out.write(data)

    async def drain(self) -> None:
        await self._out.drain()

    async def close(self) -> None:
        await self._out.close()


def attach(script: AppServerScript | None, name: str | None = None) -> Report | None:
    """A report on a server playing `script`, if ``$FAKE_CODEX_REPORT`` names a directory.

    ``name``: the report's file name (``fake-codex-<pid>.json`` by default; a listening
    server names one per connection)."""
    directory = os.environ.get(REPORT_ENV)
    if not directory:
        return None
    with contextlib.suppress(OSError):
        os.makedirs(directory, exist_ok=True)
    report = Report(script, os.path.join(directory, name or f"fake-codex-{os.getpid()}.json"))
    atexit.register(report.flush)
    report.flush()
    return report


def _key(request_id: Any) -> str:
    """Ids 1 and "1" are different requests: key them by type and value."""
    return f"{type(request_id).__name__}:{request_id}"


def read_reports(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The reports the processes wrote into `directory` (none when it does not exist)."""
    reports = []
    for file in sorted(Path(directory).glob("fake-codex-*.json")):
        with contextlib.suppress(OSError, orjson.JSONDecodeError):
            reports.append(orjson.loads(file.read_bytes()))
    return reports


def report_problems(
    script: AppServerScript | None,
    reports: list[dict[str, Any]],
    *,
    script_used: bool = True,
    requests_answered: bool = True,
) -> list[tuple[tuple[Any, ...], str]]:
    """What `reports` (see `read_reports`) show went wrong: scripted replies no process
    used, server requests no client answered; each with its place in a scenario file.

    Every app-server process runs the whole script from the start, so an entry counts
    as used when any process used it.
    """
    problems: list[tuple[tuple[Any, ...], str]] = []
    if requests_answered:
        for report in reports:
            for request in report.get("serverRequests", []):
                if request.get("state") == "pending":
                    problems.append(
                        (
                            ("checks", "requestsAnswered"),
                            f"fake-codex (pid {report.get('pid')}) sent the server request "
                            f"{request.get('method')} (id {request.get('id')!r}), and it was "
                            "never answered",
                        )
                    )
    if script is None or not script_used:
        return problems
    note = (
        " (each app-server process — each session, sessionless call and text turn — "
        "runs the script from its start)"
    )
    if script.initialize is not None and not any(r.get("initialize") for r in reports):
        problems.append(
            (("appServer", "initialize"), f"the scripted `initialize` was never used{note}")
        )
    for method, entries in script.methods.items():
        for index in range(len(entries)):
            if not any(_used(report.get("methods", {}).get(method), index) for report in reports):
                where: tuple[Any, ...] = ("appServer", "methods", method)
                label = method
                if len(entries) > 1:
                    where, label = (*where, index), f"{method}[{index}]"
                problems.append((where, f"the scripted reply to {label} was never requested{note}"))
    for index in range(len(script.turns)):
        if not any(_used(report.get("turns"), index) for report in reports):
            problems.append(
                (
                    ("appServer", "turns", index),
                    f"scripted turn {index} was never started (no turn/start took it){note}",
                )
            )
    return problems


def _used(uses: Any, index: int) -> bool:
    return isinstance(uses, list) and index < len(uses) and bool(uses[index])
