"""Record, then replay: a `model:` scenario run on the real codex, written as a
fake-codex scenario that passes without codex.

The tests marked `real_codex` record against the pinned codex (they skip without it,
and fail instead when CI=true); the others need no codex: the tee, the translation of
a hand-written wire log (replayed on fake-codex), and the errors.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
import yaml
from front_here import main_here, run_here

from bridge import codex_window
from fakes.app_server.wire import WIRE_LOG_ENV
from scenarios import harness
from scenarios.cli import main as scenarios_main
from scenarios.format import load_scenario
from scenarios.record import (
    FROZEN_MS,
    FROZEN_S,
    USER_AGENT_MACHINE,
    Normaliser,
    RecordError,
    record_scenario,
    translate_wire_logs,
)
from scenarios.runner import RunOptions, run_scenario

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "scenarios" / "library"
SCRIPTED_MODEL = LIBRARY / "real-codex-scripted-model.scenario.yaml"
SCRIPTED_MODEL_REPLAY = LIBRARY / "real-codex-scripted-model-replay.scenario.yaml"

pytest_plugins = ["pytester"]

#: Two turns on one thread: a command accepted, then one declined, then the history.
APPROVALS = """
    scenario: 1
    name: approvals-both-ways
    description: The first command is accepted, the second declined.
    tags: [real-codex, requests]
    model:
      replies:
        - execCommand: {cmd: "touch accepted.txt"}
        - text: Touched it.
        - execCommand: {cmd: "touch declined.txt"}
        - text: Fine, I won't.
    steps:
      - createSession: session
      - stream: {session: "${session}"}
      - call:
          session: "${session}"
          method: thread/start
          params: {cwd: "${tmp}/work", approvalPolicy: untrusted, sandbox: workspace-write}
        capture: {thread: $.result.thread.id}
      - call:
          session: "${session}"
          method: turn/start
          params: {threadId: "${thread}", input: [{type: text, text: Touch the first file.}]}
      - read: {through: {kind: request}, timeoutMs: 30000}
        expect:
          subsequence:
            - method: item/commandExecution/requestApproval
              params: {threadId: "${thread}", cwd: "${tmp}/work"}
        capture: {first: $.requestKey}
      - reply: {session: "${session}", requestKey: "${first}", result: {decision: accept}}
      - read: {through: turn/completed, timeoutMs: 30000}
        expect:
          subsequence:
            - {method: item/completed, params: {item: {type: commandExecution, status: completed}}}
            - {method: item/completed, params: {item: {type: agentMessage, text: Touched it.}}}
            - {method: turn/completed, params: {turn: {status: completed}}}
      - call:
          session: "${session}"
          method: turn/start
          params: {threadId: "${thread}", input: [{type: text, text: Touch the second file.}]}
      - read: {through: {kind: request}, timeoutMs: 30000}
        capture: {second: $.requestKey}
      - reply: {session: "${session}", requestKey: "${second}", result: {decision: decline}}
      - read: {through: turn/completed, timeoutMs: 30000}
        expect:
          subsequence:
            - {method: item/completed, params: {item: {type: commandExecution, status: declined}}}
            - {method: item/completed, params: {item: {type: agentMessage, text: "Fine, I won't."}}}
            - {method: turn/completed, params: {turn: {status: completed}}}
      - call:
          session: "${session}"
          method: thread/read
          params: {threadId: "${thread}", includeTurns: true}
        expect:
          jsonPath:
            $.result.thread.turns[*].status: [completed, completed]
"""


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def machine_paths(tmp_path: Path) -> list[str]:
    """What a recording must never name: temporary directories and the home folder."""
    paths = [str(tmp_path), tempfile.gettempdir().rstrip("/") + "/", str(ROOT)]
    home = str(Path.home())
    if len(home) > 1:
        paths.append(home + "/")
    return paths


def without_codex(monkeypatch: pytest.MonkeyPatch, where: Path) -> None:
    """No codex anywhere the recorder looks: no CODEX_BIN, no .codex-npm, none on PATH."""
    monkeypatch.delenv("CODEX_BIN", raising=False)
    monkeypatch.chdir(where)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")


# -- the tee -----------------------------------------------------------------------------


def read_log(directory: Path) -> list[dict[str, Any]]:
    (log,) = directory.glob("wire-*.jsonl")
    return [orjson.loads(line) for line in log.read_bytes().splitlines()]


def test_the_tee_passes_lines_through_and_logs_both_ways(tmp_path: Path) -> None:
    logs = tmp_path / "wire"
    done = subprocess.run(
        [sys.executable, "-m", "scenarios.wire_tee", str(logs), "--", "cat"],
        input=b'{"id":1}\n{"id":2}\n',
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert done.stdout == b'{"id":1}\n{"id":2}\n'
    entries = read_log(logs)
    assert entries[0]["argv"] == ["cat"]
    assert [e["line"] for e in entries if e.get("dir") == "c" and "line" in e] == [
        '{"id":1}',
        '{"id":2}',
    ]
    assert [e["line"] for e in entries if e.get("dir") == "s"] == ['{"id":1}', '{"id":2}']
    assert {"dir": "c", "eof": True} in entries
    assert entries[-1] == {"exit": 0}
    # Each echoed line was logged after the line it echoes.
    order = [(e["dir"], e["line"]) for e in entries if "line" in e]
    assert order.index(("c", '{"id":2}')) < order.index(("s", '{"id":2}'))


def test_the_tee_exits_as_its_command_does(tmp_path: Path) -> None:
    logs = tmp_path / "wire"
    base = [sys.executable, "-m", "scenarios.wire_tee", str(logs), "--"]
    killed = subprocess.run(
        [*base, "sh", "-c", "kill -TERM $$"], capture_output=True, timeout=60, check=False
    )
    assert killed.returncode == -signal.SIGTERM
    assert read_log(logs)[-1] == {"exit": -signal.SIGTERM}
    exited = subprocess.run([*base, "sh", "-c", "exit 3"], timeout=60, check=False)
    assert exited.returncode == 3
    missing = subprocess.run(
        [*base, str(tmp_path / "no-such-program")], capture_output=True, timeout=60, check=False
    )
    assert missing.returncode == 127
    assert b"cannot start" in missing.stderr


def test_the_tee_exits_as_its_command_does_while_its_client_holds_stdin_open(
    tmp_path: Path,
) -> None:
    """The bridge keeps the tee's stdin open; COMMAND exits on its own meanwhile.

    The tee's stdin pump is then blocked in a read of its stdin while the tee exits.
    It must still exit with COMMAND's status, having relayed and logged everything,
    rather than abort at interpreter shutdown over a lock that read holds. Several
    rounds, each either exiting at once or after echoing one line relayed through it.
    """
    for attempt in range(6):
        logs = tmp_path / f"wire-{attempt}"
        echo = attempt % 2 == 1
        script = 'read line; echo "$line"; exit 3' if echo else "exit 3"
        tee = subprocess.Popen(
            [sys.executable, "-m", "scenarios.wire_tee", str(logs), "--", "sh", "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert tee.stdin is not None
        assert tee.stdout is not None
        assert tee.stderr is not None
        try:
            if echo:
                tee.stdin.write(b'{"id":1}\n')
                tee.stdin.flush()
            out = tee.stdout.read()  # to EOF: COMMAND's stdout ended and the tee exited
            err = tee.stderr.read()
            code = tee.wait(timeout=60)
        finally:
            tee.stdin.close()
            tee.stdout.close()
            tee.stderr.close()
            if tee.poll() is None:
                tee.kill()
                tee.wait()
        assert (code, err) == (3, b""), err.decode(errors="replace")
        assert out == (b'{"id":1}\n' if echo else b"")
        entries = read_log(logs)
        assert entries[-1] == {"exit": 3}
        if echo:
            assert [(e["dir"], e["line"]) for e in entries if "line" in e] == [
                ("c", '{"id":1}'),
                ("s", '{"id":1}'),
            ]


# -- normalising -------------------------------------------------------------------------


@pytest.mark.quick
def test_the_normaliser_takes_out_what_changes_from_run_to_run() -> None:
    work = "/tmp/scenario-x/work"
    norm = Normaliser(
        {work: "${cwd}", "/tmp/scenario-x/codex-home": "/home/codex/.codex"}, hostname="vm7"
    )
    thread = "01a20124-70e3-76e0-87ce-d466f5137e69"
    turn = "01a20124-710e-7cc3-8594-8a9de0368c48"
    message = {
        "thread": {
            "id": thread,
            "cwd": work,
            "path": f"/tmp/scenario-x/codex-home/sessions/2026/11/22/"
            f"rollout-2026-11-22T02-44-55-{thread}.jsonl",
            "createdAt": 1795315495,
        },
        "turn": {"id": turn, "startedAtMs": 1795315495346, "durationMs": 607},
        "item": {"command": "echo $HOME > out", "cwd": f"{work}/sub", "processId": "58920"},
        "other": {"threadId": thread, "processId": "58920", "name": "vm7", "text": "vm7 said"},
        "workspace": "/tmp/scenario-x/workspace",
        "resetsAt": None,
    }
    assert norm.value(message) == {
        "thread": {
            "id": "019b76da-a800-7000-8000-000000000001",
            "cwd": "${cwd}",
            "path": "/home/codex/.codex/sessions/2026/01/01/"
            "rollout-2026-01-01T00-00-00-019b76da-a800-7000-8000-000000000001.jsonl",
            "createdAt": FROZEN_S,
        },
        "turn": {
            "id": "019b76da-a800-7000-8000-000000000002",
            "startedAtMs": FROZEN_MS,
            "durationMs": 0,
        },
        "item": {"command": "echo $$HOME > out", "cwd": "${cwd}/sub", "processId": "1001"},
        "other": {
            "threadId": "019b76da-a800-7000-8000-000000000001",
            "processId": "1001",
            "name": "localhost",
            "text": "vm7 said",
        },
        # Only whole path components are replaced.
        "workspace": "/tmp/scenario-x/workspace",
        "resetsAt": None,
    }
    # A fresh normaliser (another process) numbers from 1 again: identical processes
    # give identical scripts.
    again = Normaliser({}).value({"id": turn})
    assert again == {"id": "019b76da-a800-7000-8000-000000000001"}


# -- a hand-written wire log, translated and replayed on fake-codex ---------------------


THREAD = "01a20124-70e3-76e0-87ce-d466f5137e69"
TURN = "01a20124-710e-7cc3-8594-8a9de0368c48"


def wire_log(run: Path) -> list[dict[str, Any]]:
    """A recorded conversation with the awkward parts: a start-up warning, the
    `thread/started` that lost the race against the next request, a `$` in a command,
    an unrelated call in the middle of a turn, rate limits that name no thread."""
    work = str(run / "work")
    thread = {
        "id": THREAD,
        "cwd": work,
        "path": f"{run}/codex-home/sessions/2026/11/22/rollout-2026-11-22T02-44-55-{THREAD}.jsonl",
        "createdAt": 1795315495,
        "status": {"type": "idle"},
    }
    command = {
        "type": "commandExecution",
        "id": "call_1",
        "command": "/bin/bash -lc 'echo $HOME'",
        "cwd": work,
        "status": "inProgress",
    }
    c: list[Any] = [
        {"id": 1, "method": "initialize", "params": {"clientInfo": {"name": "b"}}},
        {"method": "initialized"},
        {"id": 2, "method": "thread/start", "params": {"cwd": work}},
        {"id": 3, "method": "turn/start", "params": {"threadId": THREAD, "input": []}},
        {"id": 0, "result": {"decision": "decline"}},
        {"id": 4, "method": "model/list", "params": {}},
    ]
    s: list[Any] = [
        {"id": 1, "result": {"userAgent": "x", "codexHome": f"{run}/codex-home"}},
        {"method": "remoteControl/status/changed", "params": {"status": "disabled"}},
        {"method": "configWarning", "params": {"summary": "no bubblewrap", "details": None}},
        {"id": 2, "result": {"thread": thread, "cwd": work}},
        {"method": "thread/started", "params": {"thread": thread}},
        {"id": 3, "result": {"turn": {"id": TURN, "status": "inProgress"}}},
        {"method": "turn/started", "params": {"threadId": THREAD, "turn": {"id": TURN}}},
        {
            "method": "item/started",
            "params": {"threadId": THREAD, "turnId": TURN, "item": command},
        },
        {
            "method": "item/commandExecution/requestApproval",
            "id": 0,
            "params": {
                "threadId": THREAD,
                "turnId": TURN,
                "itemId": "call_1",
                "command": command["command"],
                "cwd": work,
            },
        },
        {"method": "serverRequest/resolved", "params": {"threadId": THREAD, "requestId": 0}},
        {
            "method": "item/completed",
            "params": {
                "threadId": THREAD,
                "turnId": TURN,
                "item": {**command, "status": "declined"},
            },
        },
        {"method": "account/rateLimits/updated", "params": {"rateLimits": {"limitId": "codex"}}},
        {"id": 4, "result": {"data": []}},
        {
            "method": "turn/completed",
            "params": {
                "threadId": THREAD,
                "turn": {"id": TURN, "status": "completed", "durationMs": 607},
            },
        },
    ]
    # The order the tee saw: note turn/start (c3) before thread/started (s4), and
    # model/list (c5) before the rate limits (s11).
    order = [
        ("c", 0), ("s", 0), ("c", 1), ("s", 1), ("c", 2), ("s", 2), ("s", 3), ("c", 3),
        ("s", 4), ("s", 5), ("s", 6), ("s", 7), ("s", 8), ("c", 4), ("s", 9), ("s", 10),
        ("c", 5), ("s", 11), ("s", 12), ("s", 13),
    ]  # fmt: skip
    entries: list[dict[str, Any]] = [{"argv": ["codex", "app-server"], "started": 1}]
    for direction, index in order:
        message = (c if direction == "c" else s)[index]
        entries.append({"dir": direction, "line": json.dumps(message)})
    return [*entries, {"dir": "c", "eof": True}, {"exit": 0}]


REPLAY_STEPS = """
    steps:
      - createSession: session
      - stream: {session: "${session}"}
      - call: {session: "${session}", method: thread/start, params: {cwd: "${tmp}/work"}}
        capture: {thread: $.result.thread.id}
        expect:
          jsonPath:
            $.result.cwd: "${tmp}/work"
            $.result.thread.createdAt: %(frozen_s)d
      - call:
          session: "${session}"
          method: turn/start
          params: {threadId: "${thread}", input: []}
      - read: {through: {kind: request}}
        expect:
          subsequence:
            - thread/started
            - turn/started
            - method: item/commandExecution/requestApproval
              params: {threadId: "${thread}", command: "/bin/bash -lc 'echo $HOME'"}
        capture: {key: $.requestKey}
      - reply: {session: "${session}", requestKey: "${key}", result: {decision: decline}}
      - call: {session: "${session}", method: model/list, params: {}}
        expect: {json: {result: {data: []}}}
      - read: {through: turn/completed}
        expect:
          subsequence:
            - {method: item/completed, params: {item: {status: declined, cwd: "${tmp}/work"}}}
            - account/rateLimits/updated
            - {method: turn/completed, params: {turn: {durationMs: 0}}}
"""


@pytest.mark.asyncio
async def test_a_wire_log_becomes_a_script_that_fake_codex_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    wire = tmp_path / "wire"
    wire.mkdir()
    lines = [orjson.dumps(entry).decode() for entry in wire_log(run)]
    (wire / "wire-1.jsonl").write_text("\n".join(lines) + "\n")
    paths = {str(run / "work"): "${cwd}", str(run / "codex-home"): "/home/codex/.codex"}
    translated = translate_wire_logs(wire, paths, version_output=f"codex-cli {codex_window.PIN}")
    script = translated.script
    assert str(tmp_path) not in json.dumps(script)
    assert translated.unanswered_requests == 0
    assert script["initialize"] == {"result": {"userAgent": "x", "codexHome": "/home/codex/.codex"}}
    # The start-up warning is replayed after `initialized`; remoteControl is the fake's.
    assert script["onInitialized"] == [
        {
            "notify": {
                "method": "configWarning",
                "params": {"summary": "no bubblewrap", "details": None},
            }
        }
    ]
    methods = script["methods"]
    assert set(methods) == {"thread/start", "turn/start", "model/list"}
    # thread/started goes with the reply that carried the thread, not with turn/start.
    (thread_start,) = methods["thread/start"]
    assert [next(iter(step)) for step in thread_start["steps"]] == ["respond", "notify"]
    assert thread_start["steps"][1]["notify"]["method"] == "thread/started"
    # The turn: its reply, its notifications, the request; what followed the decline
    # (rate limits included, though model/list came in between) under onReply.
    (turn_start,) = methods["turn/start"]
    kinds = [next(iter(step)) for step in turn_start["steps"]]
    assert kinds == ["respond", "notify", "notify", "request"]
    request = turn_start["steps"][-1]
    assert request["request"]["params"]["command"] == "/bin/bash -lc 'echo $$HOME'"
    assert list(request["onReply"]) == ["decline"]
    assert [step["notify"]["method"] for step in request["onReply"]["decline"]] == [
        "serverRequest/resolved",
        "item/completed",
        "account/rateLimits/updated",
        "turn/completed",
    ]
    assert methods["model/list"] == [{"result": {"data": []}}]

    text = "scenario: 1\nname: from-a-wire-log\n" + yaml.safe_dump(
        {"appServer": script}, sort_keys=False
    )
    text += textwrap.dedent(REPLAY_STEPS % {"frozen_s": FROZEN_S})
    path = tmp_path / "replay.scenario.yaml"
    path.write_text(text)
    fake_wire = tmp_path / "fake-wire"
    fake_wire.mkdir()
    monkeypatch.setenv(WIRE_LOG_ENV, str(fake_wire))
    result = await run_scenario(load_scenario(path), RunOptions(tmp_root=tmp_path))
    assert result.passed, [p.message for f in result.failures for p in f.problems]
    written = b"".join(log.read_bytes() for log in fake_wire.glob("*.out"))
    assert b"echo $HOME" in written
    assert b"$$" not in written


@pytest.mark.quick
@pytest.mark.parametrize("warning_first", [True, False])
def test_a_warning_racing_the_turn_start_reply_is_recorded_after_it(
    tmp_path: Path, warning_first: bool
) -> None:
    """codex writes the model-metadata `warning` before or after the `turn/start` reply,
    from run to run; a recording has it after, either way."""
    reply = {"id": 2, "result": {"turn": {"id": "t1", "status": "inProgress"}}}
    warning = {"method": "warning", "params": {"threadId": "th", "message": "no metadata"}}
    server = [warning, reply] if warning_first else [reply, warning]
    lines: list[dict[str, Any]] = [
        {"argv": ["codex"], "started": 1},
        {"dir": "c", "line": json.dumps({"id": 2, "method": "turn/start", "params": {}})},
        *({"dir": "s", "line": json.dumps(message)} for message in server),
        {"exit": 0},
    ]
    (tmp_path / "wire-1.jsonl").write_bytes(b"\n".join(orjson.dumps(line) for line in lines))
    (turn_start,) = translate_wire_logs(tmp_path, {}).script["methods"]["turn/start"]
    assert [next(iter(step)) for step in turn_start["steps"]][:2] == ["respond", "notify"]
    assert turn_start["steps"][1]["notify"]["method"] == "warning"


@pytest.mark.quick
def test_a_process_that_died_with_a_request_unanswered(tmp_path: Path) -> None:
    lines: list[dict[str, Any]] = [
        {"argv": ["codex"], "started": 1},
        {"dir": "c", "line": json.dumps({"id": 1, "method": "x/ask", "params": {}})},
        {"dir": "s", "line": json.dumps({"method": "item/tool/call", "id": 0, "params": {}})},
        {"dir": "s", "line": "not json"},
        {"exit": -signal.SIGKILL},
    ]
    (tmp_path / "wire-1.jsonl").write_bytes(b"\n".join(orjson.dumps(line) for line in lines))
    translated = translate_wire_logs(tmp_path, {})
    assert translated.unanswered_requests == 1
    assert translated.script["methods"]["x/ask"] == [
        {
            "noReply": True,
            "steps": [
                {"request": {"method": "item/tool/call", "id": 0, "params": {}, "wait": False}},
                {"raw": "not json"},
                {"exit": {"signal": "SIGKILL"}},
            ],
        }
    ]


@pytest.mark.quick
def test_the_library_replay_is_a_recording_of_its_source() -> None:
    """library/real-codex-scripted-model-replay.scenario.yaml was written by `record`
    from its source (pytest and `make test` run it on fake-codex, with the library)."""
    replay = load_scenario(LIBRARY / "real-codex-scripted-model-replay.scenario.yaml")
    source = load_scenario(SCRIPTED_MODEL)
    assert replay.scenario.app_server is not None
    assert not replay.scenario.real_codex
    for key in ("steps", "bridge", "checks"):
        assert replay.data.get(key) == source.data.get(key), key
    text = (LIBRARY / "real-codex-scripted-model-replay.scenario.yaml").read_text()
    assert "/tmp/" not in text
    assert "${cwd}" in text


# -- errors -----------------------------------------------------------------------------


@pytest.mark.quick
def test_recording_without_codex_says_so_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    without_codex(monkeypatch, tmp_path)
    out = tmp_path / "out.scenario.yaml"
    status = scenarios_main(["record", str(SCRIPTED_MODEL), "-o", str(out)])
    assert status == 2
    error = capsys.readouterr().err
    assert harness.NO_CODEX in error
    assert "make codex" in error
    assert not out.exists()
    nope = tmp_path / "nope"
    with pytest.raises(RecordError, match=re.escape(f"--codex {nope}: no such file")):
        asyncio.run(record_scenario(SCRIPTED_MODEL, out, codex=str(nope)))
    assert not out.exists()


@pytest.mark.quick
def test_an_output_that_cannot_be_written_is_refused_before_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing" / "dir" / "out.scenario.yaml"
    # A codex that would fail the run at once: the output is checked before it is asked.
    status = scenarios_main(["record", str(SCRIPTED_MODEL), "-o", str(missing), "--codex", "/"])
    assert status == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"rest-bridge scenarios record: the output {str(missing)!r} cannot be written: its "
        f"folder {str(missing.parent)!r} does not exist; nothing was recorded"
    )
    assert not (tmp_path / "missing").exists()
    with pytest.raises(RecordError, match="is a directory; nothing was recorded"):
        asyncio.run(record_scenario(SCRIPTED_MODEL, tmp_path))


@pytest.mark.quick
@pytest.mark.asyncio
async def test_only_scenarios_that_script_the_model_can_be_recorded(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match="needs a `model:` section"):
        await record_scenario(LIBRARY / "approval-long-poll.scenario.yaml", tmp_path / "x.yaml")
    assert not (tmp_path / "x.yaml").exists()


# -- against the real codex ----------------------------------------------------------------


@pytest.fixture(scope="module")
def schema(codex_bin: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Validators from the JSON Schema the pinned codex generates."""
    out = tmp_path_factory.mktemp("schema")
    subprocess.run(
        [codex_bin, "app-server", "generate-json-schema", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )

    def validator(name: str) -> jsonschema.Draft7Validator:
        return jsonschema.Draft7Validator(json.loads((out / name).read_text()))

    notifications = json.loads((out / "ServerNotification.json").read_text())
    return {
        "notification": validator("ServerNotification.json"),
        "request": validator("ServerRequest.json"),
        "envelope": validator("JSONRPCMessage.json"),
        "known": {branch["properties"]["method"]["enum"][0] for branch in notifications["oneOf"]},
    }


def fake_output(directory: Path) -> Iterator[dict[str, Any]]:
    for log in sorted(directory.glob("*.out")):
        for line in log.read_bytes().splitlines():
            if line:
                yield orjson.loads(line)


def as_replayed(value: Any, cwd: str) -> Any:
    """A normalised recorded value as fake-codex writes it (placeholders filled in)."""
    if isinstance(value, str):
        return value.replace("${cwd}", cwd).replace("$$", "$")
    if isinstance(value, dict):
        return {key: as_replayed(item, cwd) for key, item in value.items()}
    if isinstance(value, list):
        return [as_replayed(item, cwd) for item in value]
    return value


@pytest.mark.real_codex
def test_record_the_library_scenario_then_run_it_where_there_is_no_codex(
    codex_bin: str,
    tmp_path: Path,
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `rest-bridge scenarios record` and `run` in this process (their output and status
    # are the subject here, not their processes; test_scenario_runner starts the front).
    out = tmp_path / "recorded.scenario.yaml"
    monkeypatch.setenv("CODEX_BIN", codex_bin)
    status = main_here(["record", str(SCRIPTED_MODEL), "-o", str(out)])
    printed = capsys.readouterr()
    assert status == 0, printed.out + printed.err
    assert "replayed" in printed.out
    assert "passed" in printed.out
    text = out.read_text()
    for path in machine_paths(tmp_path):
        assert path not in text
    loaded = load_scenario(out)
    assert loaded.scenario.model is None
    assert loaded.scenario.app_server is not None
    assert loaded.name == "real-codex-scripted-model-replay"
    source = yaml.safe_load(SCRIPTED_MODEL.read_text())
    assert loaded.data["steps"] == source["steps"]

    # Elsewhere (pytester's folder, the working directory now), without any codex.
    monkeypatch.delenv("CODEX_BIN")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")
    replay = run_here(pytester, "run", str(out))
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "1 passed in" in replay.stdout, replay.stdout
    assert "skipped" not in replay.stdout


@pytest.mark.real_codex
@pytest.mark.asyncio
@pytest.mark.parametrize("which", ["library", "approvals"])
async def test_a_recording_is_stable_and_the_fake_says_what_codex_said(
    which: str,
    codex_bin: str,
    schema: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = (
        SCRIPTED_MODEL if which == "library" else write(tmp_path / "a.scenario.yaml", APPROVALS)
    )
    first = await record_scenario(source, tmp_path / "first.scenario.yaml", codex=codex_bin)
    assert first.replay_passed, first.replay_result
    assert first.warnings == []
    # Recorded again: the same file, byte for byte.
    second = await record_scenario(source, None, codex=codex_bin, verify=False)
    assert second.text == first.text
    for path in machine_paths(tmp_path):
        assert path not in first.text

    # Replayed with fake-codex's stdout teed: the same messages as codex wrote, each
    # valid under the real JSON Schema.
    wire = tmp_path / "fake-wire"
    wire.mkdir()
    monkeypatch.setenv(WIRE_LOG_ENV, str(wire))
    replay = await run_scenario(
        load_scenario(tmp_path / "first.scenario.yaml"),
        RunOptions(tmp_root=tmp_path, keep_tmp=True),
    )
    assert replay.passed
    assert replay.tmp is not None
    written = list(fake_output(wire))
    problems = []
    for message in written:
        method = message.get("method")
        if method is not None and "id" not in message:
            assert method in schema["known"], method
            checker = schema["notification"]
        else:
            checker = schema["request"] if method is not None else schema["envelope"]
        problems += [error.message for error in checker.iter_errors(message)]
    assert problems == []
    said = [
        {key: value for key, value in message.items() if key != "emittedAtMs"}
        for message in written
        if message.get("method") != "remoteControl/status/changed"
    ]
    (recorded,) = first.server_messages
    assert said == as_replayed(recorded, str(replay.tmp / "work"))
    if which == "approvals":
        decisions = [
            m["params"]["item"]["status"]
            for m in said
            if m.get("method") == "item/completed"
            and m["params"]["item"]["type"] == "commandExecution"
        ]
        assert decisions == ["completed", "declined"]


@pytest.mark.real_codex
@pytest.mark.asyncio
@pytest.mark.parametrize(
    "codex_bin", [codex_window.PIN], indirect=True, ids=[f"codex-{codex_window.PIN}"]
)
async def test_the_committed_replay_of_the_library_scenario_is_what_recording_it_gives(
    codex_bin: str,
) -> None:
    recording = await record_scenario(SCRIPTED_MODEL, None, codex=codex_bin, verify=False)
    assert recording.text == SCRIPTED_MODEL_REPLAY.read_text()
    # Nothing of the recording machine: its OS, kernel, architecture and terminal.
    user_agent = recording.data["appServer"]["initialize"]["result"]["userAgent"]
    assert f" {USER_AGENT_MACHINE} " in user_agent
    uname = os.uname()
    for detail in (uname.release, uname.version, uname.nodename, os.environ.get("TERM")):
        assert not detail or detail not in recording.text


#: The text-turn preset: a codex process per turn, each running the recorded script
#: from its start, so the replay tells the two turns apart by their prompts.
TEXT_TURNS = """
    scenario: 1
    name: two-text-turns
    bridge: {preset: text-turn}
    model:
      replies: [{text: First answer.}, {text: Second answer.}]
    steps:
      - http: {method: POST, path: /v1/text-turn, json: {text: one}}
        expect: {jsonSubset: {text: First answer., status: completed}}
      - http: {method: POST, path: /v1/text-turn, json: {text: two}}
        expect: {jsonSubset: {text: Second answer., status: completed}}
"""


@pytest.mark.real_codex
@pytest.mark.asyncio
async def test_processes_that_were_asked_different_things_replay_their_own_answers(
    codex_bin: str, tmp_path: Path
) -> None:
    source = write(tmp_path / "text-turns.scenario.yaml", TEXT_TURNS)
    recording = await record_scenario(source, None, codex=codex_bin)
    assert recording.warnings == []
    assert len(recording.server_messages) == 2
    assert recording.replay_passed, recording.replay_result
    methods = recording.data["appServer"]["methods"]
    assert [entry["match"] for entry in methods["turn/start"]] == [
        {"input": [{"type": "text", "text": "one"}]},
        {"input": [{"type": "text", "text": "two"}]},
    ]
    # The two processes started their threads alike: one entry serves both.
    assert len(methods["thread/start"]) == 1
