"""Start-up and configuration mistakes: what `rest-bridge serve` says, and when.

A port already taken, an address that does not resolve, an `--app-server` that names
nothing or a program that exits at once: each is said on one line, at start where it
can be known, with exit status 2 where the bridge cannot serve at all. When an
app-server fails to start, the operator's log names the command and its stderr; the
client's error payload says what to check, and no more.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from processes import marked_processes

from bridge import codex_window

pytestmark = pytest.mark.asyncio

THEME = "Start-up"
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
#: The variable the `mark` fixture sets, so that the bridge's children can be found.
MARK_VARIABLE = "RELIABILITY_MARK"
#: The words every failed start tells the client to check.
CHECK = "check the bridge's app-server command (`rest-bridge serve --app-server`)"


@contextlib.contextmanager
def listening_socket() -> Iterator[int]:
    """A port somebody else is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`rest-bridge serve ARGS` expected to refuse to start (it would serve forever)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    environment.update(env or {})
    return subprocess.run(
        [REST_BRIDGE, "serve", *args],
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        http.post(url, json=body) as response,
    ):
        text = await response.text()
        return response.status, await response.json(content_type=None), text


async def test_a_port_in_use_is_one_line_naming_the_address(report, mark):
    """`serve` on a port another process listens on"""
    with listening_socket() as port:
        done = serve("--port", str(port), "--app-server", f"{FAKE_CODEX} app-server")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        f"rest-bridge: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    )
    assert "listening on" not in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    # Whatever it started (the app-server's `--version` probe) is gone with it.
    assert marked_processes(MARK_VARIABLE, mark) == set()
    report.survived = report.nothing_lost = True
    report.no_leak = True
    report.figures["stderr"] = done.stderr.strip()
    report.outcome = "exit 2, one line naming the address, no traceback, no process left"


MISTAKES = {
    "an address that does not resolve": (
        ["--host", "no-such-host.invalid", "--port", "0"],
        {},
        "rest-bridge: cannot listen on no-such-host.invalid:0: ",
    ),
    "a port out of range": (
        ["--port", "65536"],
        {},
        "rest-bridge serve: error: argument --port: 65536 is not a port number (0 to 65535)",
    ),
    "an --app-server that cannot be split": (
        ["--app-server", 'codex "app-server', "--port", "0"],
        {},
        "rest-bridge: --app-server 'codex \"app-server': No closing quotation",
    ),
    "an empty --app-server": (
        ["--app-server", " ", "--port", "0"],
        {},
        "rest-bridge: --app-server ' ': the app-server command is empty",
    ),
    "a blank token": (
        ["--port", "0"],
        {"REST_ADAPTER_TOKEN": "  "},
        "rest-bridge: REST_ADAPTER_TOKEN is empty or blank: no request could match it",
    ),
    "a limit that is not a number": (
        ["--port", "0"],
        {"REST_ADAPTER_MAX_SESSIONS": "many"},
        "rest-bridge: REST_ADAPTER_MAX_SESSIONS='many' is not a valid positive integer",
    ),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
async def test_other_start_up_mistakes_are_one_line_and_exit_2(report, case):
    """Every other way `serve` cannot start"""
    args, env, expected = MISTAKES[case]
    done = serve(*args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "listening on" not in done.stdout
    last = done.stderr.splitlines()[-1]
    assert last.startswith(expected), done.stderr
    if not case.startswith("a port"):  # argparse prints its usage first
        assert done.stderr.count("\n") == 1, done.stderr
    report.survived = report.nothing_lost = report.no_leak = True
    report.figures["stderr"] = last
    report.outcome = "exit 2, one line, no traceback"


async def test_an_app_server_that_does_not_exist_is_said_at_start_and_logged(
    bridge_process, report
):
    """`--app-server` names a program that is nowhere"""
    served = bridge_process(app_server=["fake-codx", "app-server"])
    started = served.wait_for_output("  app-server: ")
    assert (
        "  app-server: fake-codx app-server: cannot start: fake-codx: not found on PATH; "
        "every request that starts an app-server will fail (502 app_server_spawn_failed) "
        "until --app-server names a command that exists"
    ) in started.splitlines(), started
    bodies = []
    for path, body in (
        ("/v1/sessions", {}),
        ("/v1/call/model/list", {}),
        ("/v1/text-turn", {"text": "hi"}),
    ):
        status, payload, text = await post(served.base + path, body)
        bodies.append(text)
        assert status == 502, text
        assert payload == {
            "error": "app_server_spawn_failed",
            "message": f"Could not start the app-server (No such file or directory); {CHECK}.",
        }
    served.signal(signal.SIGTERM)
    assert served.wait(30) == 0
    logs = served.output
    # One line a kind of failure an interval (callers cannot flood the log with them);
    # those held back are counted when the bridge stops.
    assert (
        logs.count(
            "ERROR bridge could not start the app-server `fake-codx app-server`: "
            "No such file or directory"
        )
        == 1
    ), logs
    assert "2 more app-server start failures like the last (spawn) since the last" in logs
    assert "Traceback" not in logs
    assert served.resources.processes() == frozenset()
    report.survived = report.nothing_lost = report.no_leak = True
    report.figures["requests"] = len(bodies)
    report.outcome = (
        "said at start on one line; each spawning route 502 app_server_spawn_failed saying "
        "what to check, the command only in the log"
    )


async def test_an_app_server_that_exits_at_start_is_logged_with_its_stderr(bridge_process, report):
    """`--app-server` starts a program that exits before `initialize` (no subcommand)"""
    served = bridge_process(app_server=[FAKE_CODEX])
    started = served.wait_for_output("  app-server: ")
    assert (
        f"  app-server: {FAKE_CODEX} (codex-cli {codex_window.PIN}; kind: fake-codex; note: no "
        "`app-server` in the "
        "command, which codex needs to serve)"
    ) in started.splitlines(), started
    for path, body in (
        ("/v1/sessions", {}),
        ("/v1/call/model/list", {}),
        ("/v1/text-turn", {"text": "hi"}),
    ):
        status, payload, text = await post(served.base + path, body)
        assert status == 502, text
        assert payload == {
            "error": "app_server_exited",
            "message": "The app-server exited with code 2 during start-up, before answering "
            f"`initialize`; {CHECK}. The bridge's log has the process's stderr.",
            "data": {"exitCode": 2, "signal": None},
        }
        assert "usage" not in text
        assert FAKE_CODEX not in text
    served.signal(signal.SIGTERM)
    assert served.wait(30) == 0
    logs = served.output
    line = f"ERROR bridge the app-server `{FAKE_CODEX}` ended during start-up: "
    line += "process exited with code 2; stderr: usage: fake-codex [-h]"
    assert logs.count(line) == 1, logs
    assert "2 more app-server start failures like the last (exited) since the last" in logs
    assert "Traceback" not in logs
    assert served.resources.processes() == frozenset()
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = (
        "its version said at start, with a note; each spawning route 502 app_server_exited "
        "saying what to check; the command and its stderr tail in one log line each"
    )


async def test_the_default_command_without_codex_says_so_at_start(bridge_process, report):
    """Plain `serve` (`codex app-server`) where no codex is installed"""
    served = bridge_process(app_server=["codex", "app-server"], env={"PATH": "/usr/bin:/bin"})
    started = served.wait_for_output("  app-server: ")
    assert (
        "  app-server: codex app-server: cannot start: codex: not found on PATH; every request "
        "that starts an app-server will fail (502 app_server_spawn_failed) until --app-server "
        "names a command that exists (install codex: npm install -g @openai/codex; or serve "
        "the bundled fake: --app-server 'fake-codex app-server')"
    ) in started.splitlines(), started
    served.signal(signal.SIGTERM)
    assert served.wait(30) == 0
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = "said at start, on one line"


@pytest.mark.parametrize(
    ("args", "loop"),
    [((), "uvloop"), (("--loop", "auto"), "uvloop"), (("--loop", "asyncio"), "asyncio")],
    ids=["default", "auto", "asyncio"],
)
async def test_the_event_loop_is_said_at_start_and_serves(bridge_process, report, args, loop):
    """`--loop auto` is uvloop when installed (it is, with the dev extra); the default
    is uvloop too (a dependency now; bench/FINDINGS.md says why), and `--loop asyncio`
    still runs the standard library's loop; each serves a session and stops clean"""
    import uvloop  # noqa: F401  (a dependency: the default and auto must pick it)

    served = bridge_process(extra_args=list(args))
    started = served.wait_for_output("  preset: ")
    assert f"; loop: {loop}" in started, started
    status, created, text = await post(served.base + "/v1/sessions", {})
    assert status == 201, text
    session = created["sessionId"]
    status, answered, text = await post(
        f"{served.base}/v1/sessions/{session}/call/model/list", {"params": {}}
    )
    assert status == 200, text
    assert "result" in answered
    served.signal(signal.SIGTERM)
    assert served.wait(30) == 0
    assert "Traceback" not in served.output
    assert served.resources.processes() == frozenset()
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = f"started on {loop}, served a session call, stopped with nothing left"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_a_missing_cwd_is_said_to_be_the_callers_on_either_loop(
    bridge_process, tmp_path, loop
):
    """A session asks for a working directory that does not exist: the payload names
    `options.cwd` and the log line the directory, never blaming the bridge's command, on
    uvloop (whose error names no file) as on asyncio; a cwd that is a file, or that
    cannot be entered, is the caller's too."""
    served = bridge_process(extra_args=["--loop", loop])
    assert f"; loop: {loop}" in served.wait_for_output("  preset: ")
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o000)
    asked = [str(tmp_path / "missing" / "dir"), str(not_a_directory)]
    if os.geteuid() != 0:  # root enters any directory
        asked.append(str(closed))
    for cwd in asked:
        status, payload, text = await post(served.base + "/v1/sessions", {"options": {"cwd": cwd}})
        assert (status, payload["error"]) == (502, "app_server_spawn_failed"), text
        assert payload["message"].endswith("; check options.cwd."), payload
        assert "requested working directory" in payload["message"], payload
        assert cwd not in text
    closed.chmod(0o700)
    # The bridge's own command still starts in a directory that exists.
    status, _, text = await post(served.base + "/v1/sessions", {"options": {"cwd": str(tmp_path)}})
    assert status == 201, text
    served.signal(signal.SIGTERM)
    assert served.wait(30) == 0
    logs = served.output
    assert "ERROR" not in logs, logs
    assert "Traceback" not in logs
    # One WARNING line for the first, the others counted when the bridge stops (callers
    # repeat them at will: one line of a kind per 10 s); never the directory, which is a
    # value of the caller's body.
    assert logs.count("could not start the app-server in the working directory options.cwd") == 1
    assert f"{len(asked) - 1} more app-server start failure" in logs, logs
    assert not [cwd for cwd in asked if cwd in logs]
    assert served.resources.processes() == frozenset()
