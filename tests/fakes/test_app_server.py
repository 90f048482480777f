"""fake-codex, driven as a real process over real pipes.

Each test reads the fake's output until the line it expects (with a timeout); none
sleeps to synchronise or asserts on wall time.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bridge import codex_window
from fakes.app_server.protocol import profile, versions

pytestmark = pytest.mark.asyncio

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 20.0
CLIENT_INFO = {"name": "tests", "title": "Tests", "version": "9.9.9"}

Message = dict[str, Any]


class FakeCodex:
    """A running fake-codex and a minimal JSON-RPC client for it.

    Every message read is kept in `seen`; `until()` returns the ones read by that call.
    """

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.seen: list[Message] = []
        self.requested: dict[Any, str] = {}
        self.stderr = bytearray()
        self._stderr_changed = asyncio.Condition()
        self._stderr_task = asyncio.create_task(self._collect_stderr())
        self._ids = iter(range(1, 1_000_000))

    @classmethod
    async def start(cls, *args: str, env: dict[str, str], cwd: Path) -> FakeCodex:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fakes.app_server.cli",
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=cwd,
            limit=1 << 26,
        )
        return cls(proc)

    async def _collect_stderr(self) -> None:
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(1 << 16):
            async with self._stderr_changed:
                self.stderr += chunk
                self._stderr_changed.notify_all()

    async def stderr_contains(self, text: str) -> str:
        """Wait until stderr contains `text`; returns all of stderr so far."""
        async with self._stderr_changed:
            await asyncio.wait_for(
                self._stderr_changed.wait_for(lambda: text.encode() in self.stderr), TIMEOUT
            )
        return self.stderr.decode(errors="replace")

    async def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()

    async def send(self, message: Message) -> None:
        await self.write(json.dumps(message).encode() + b"\n")

    async def line(self) -> bytes:
        """The next stdout line, without its newline."""
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), TIMEOUT)
        if not line:
            raise EOFError("fake-codex closed stdout")
        return line.rstrip(b"\n")

    async def message(self) -> Message:
        message: Message = json.loads(await self.line())
        self.seen.append(message)
        return message

    async def rest(self) -> list[Message]:
        """Every message left on stdout, up to EOF."""
        assert self.proc.stdout is not None
        data = await asyncio.wait_for(self.proc.stdout.read(), TIMEOUT)
        messages = [json.loads(line) for line in data.splitlines()]
        self.seen += messages
        return messages

    async def until(self, predicate: Callable[[Message], bool]) -> list[Message]:
        """Read messages up to and including the first that matches."""
        read: list[Message] = []
        while True:
            message = await self.message()
            read.append(message)
            if predicate(message):
                return read

    async def until_method(self, method: str) -> list[Message]:
        return await self.until(lambda message: message.get("method") == method)

    async def request(self, method: str, params: Any = None, request_id: Any = None) -> Message:
        """Send a request and return its response (messages read meanwhile stay in `seen`)."""
        request_id = next(self._ids) if request_id is None else request_id
        self.requested[request_id] = method
        await self.send({"id": request_id, "method": method, "params": params or {}})
        read = await self.until(lambda m: m.get("id") == request_id and "method" not in m)
        return read[-1]

    async def initialize(self) -> Message:
        reply = await self.request("initialize", {"clientInfo": CLIENT_INFO})
        # Like the real server, the fake announces its remote control status at once.
        assert (await self.message())["method"] == "remoteControl/status/changed"
        await self.send({"method": "initialized"})
        return reply

    async def start_thread(self, **params: Any) -> str:
        reply = await self.request("thread/start", params)
        return str(reply["result"]["thread"]["id"])

    async def start_turn(self, thread_id: str, text: str = "hi") -> str:
        reply = await self.request(
            "turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": text}]}
        )
        return str(reply["result"]["turn"]["id"])

    async def answer(self, request: Message, result: Any) -> None:
        await self.send({"id": request["id"], "result": result})

    async def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    async def wait(self) -> int:
        code = await asyncio.wait_for(self.proc.wait(), TIMEOUT)
        await asyncio.wait_for(self._stderr_task, TIMEOUT)
        return code

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        self._stderr_task.cancel()


Spawn = Callable[..., Awaitable[FakeCodex]]


def fake_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("FAKE_CODEX_")}
    env["CODEX_HOME"] = str(tmp_path / "codex-home")
    env.update(extra)
    return env


@pytest_asyncio.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Spawn]:
    """Start fake-codex processes (`script` is YAML text); all are killed afterwards."""
    started: list[FakeCodex] = []

    async def start(script: str | None = None, *args: str, **env: str) -> FakeCodex:
        if script is not None:
            path = tmp_path / f"script-{len(started)}.yaml"
            path.write_text(textwrap.dedent(script))
            args = ("app-server", "--script", str(path), *args)
        elif not args:
            args = ("app-server",)
        fake = await FakeCodex.start(*args, env=fake_env(tmp_path, **env), cwd=tmp_path)
        started.append(fake)
        return fake

    yield start
    for fake in started:
        await fake.stop()


async def ready(spawn: Spawn, script: str | None = None, **env: str) -> tuple[FakeCodex, str]:
    """A fake that is initialized and has a thread; returns it and the thread id."""
    fake = await spawn(script, **env)
    await fake.initialize()
    return fake, await fake.start_thread(cwd=str(Path.cwd()))


def methods(messages: list[Message]) -> list[str | None]:
    return [message.get("method") for message in messages]


# --- command line -------------------------------------------------------------------


async def run_cli(tmp_path: Path, *args: str, **env: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fakes.app_server.cli",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=fake_env(tmp_path, **env),
    )
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_version_prints_the_real_cli_version(tmp_path: Path) -> None:
    assert await run_cli(tmp_path, "--version") == (0, f"codex-cli {codex_window.PIN}\n", "")


async def test_version_reads_the_script_named_by_the_environment(tmp_path: Path) -> None:
    script = tmp_path / "s.yaml"
    script.write_text("version: 1\nversionOutput: codex-cli 9.8.7\n")
    code, out, _ = await run_cli(tmp_path, "--version", FAKE_CODEX_SCRIPT=str(script))
    assert (code, out) == (0, "codex-cli 9.8.7\n")


@pytest.mark.parametrize("how", ["option", "config", "environment"])
async def test_version_honours_what_app_server_would_emulate(tmp_path: Path, how: str) -> None:
    """`--codex-version` (before `--version`), `-c fake_codex.script=...` and
    `$FAKE_CODEX_SCRIPT` name the release `--version` reports, as they do for app-server."""
    script = tmp_path / "v171.yaml"
    script.write_text("version: 1\ncodexVersion: 0.171.0\n")
    args: tuple[str, ...] = {
        "option": ("--codex-version", "0.171.0"),
        "config": ("-c", f"fake_codex.script={script}"),
        "environment": (),
    }[how]
    env = {"FAKE_CODEX_SCRIPT": str(script)} if how == "environment" else {}
    assert await run_cli(tmp_path, *args, "--version", **env) == (0, "codex-cli 0.171.0\n", "")


async def test_generate_json_schema_writes_the_params_the_fake_knows(tmp_path: Path) -> None:
    stable, experimental = tmp_path / "stable", tmp_path / "experimental"
    assert await run_cli(
        tmp_path, "-c", "a=1", "app-server", "generate-json-schema", "--out", str(stable)
    ) == (0, "", "")
    assert await run_cli(
        tmp_path, "app-server", "generate-json-schema", "--experimental", "-o", str(experimental)
    ) == (0, "", "")
    turn = json.loads((stable / "v2" / "TurnStartParams.json").read_text())
    assert turn["required"] == ["input", "threadId"]
    assert {"threadId", "input", "toolOutput", "turnTrigger"} <= set(turn["properties"])
    assert "collaborationMode" not in turn["properties"]
    turn = json.loads((experimental / "v2" / "TurnStartParams.json").read_text())
    assert "collaborationMode" in turn["properties"]
    assert (experimental / "v2" / "ThreadResumeParams.json").is_file()
    assert (experimental / "v2" / "ThreadForkParams.json").is_file()


async def test_generate_json_schema_needs_an_output_directory(tmp_path: Path) -> None:
    code, _, err = await run_cli(tmp_path, "app-server", "generate-json-schema")
    assert code == 2
    assert "--out" in err


async def test_a_listen_url_the_fake_does_not_serve_is_a_usage_error(tmp_path: Path) -> None:
    for url in ("off", "tcp://127.0.0.1:1", "ws://127.0.0.1", "ws://127.0.0.1:99999"):
        code, _, err = await run_cli(tmp_path, "app-server", "--listen", url)
        assert code == 2, url
        assert "--listen" in err


async def test_a_listen_address_that_cannot_be_bound_exits_1_without_a_traceback(
    tmp_path: Path,
) -> None:
    (tmp_path / "file").write_text("")
    code, _, err = await run_cli(tmp_path, "app-server", "--listen", f"unix://{tmp_path}/file/s")
    assert code == 1
    assert "Traceback" not in err
    code, _, err = await run_cli(tmp_path, "app-server", "--listen", "ws://192.0.2.1:9")
    assert code == 1
    assert err.startswith("fake-codex: cannot listen on ws://192.0.2.1:9")
    assert "Traceback" not in err


async def test_a_bad_seed_is_a_usage_error(tmp_path: Path) -> None:
    code, _, err = await run_cli(tmp_path, "app-server", FAKE_CODEX_SEED="seven")
    assert code == 2
    assert "FAKE_CODEX_SEED" in err


async def test_an_invalid_script_fails_with_file_line_and_problem(tmp_path: Path) -> None:
    script = tmp_path / "bad.yaml"
    script.write_text("version: 1\nturns:\n  - steps:\n      - agentMessage: {txt: hi}\n")
    code, _, err = await run_cli(tmp_path, "app-server", "--script", str(script))
    assert code == 2
    assert f"{script}:4:" in err
    assert "turns[0].steps[0].agentMessage.txt" in err


@pytest.mark.quick
async def test_the_readme_examples_are_valid_scripts() -> None:
    from fakes.app_server.script import parse_script_text

    readme = (REPO / "fakes" / "app_server" / "README.md").read_text()
    examples = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    assert len(examples) == 4
    for example in examples:
        parse_script_text(example.replace("[steps]", "[]"), "README.md")


@pytest.mark.quick
async def test_a_problem_beside_a_steps_kind_points_at_its_own_line() -> None:
    from fakes.app_server.script import ScriptError, parse_script_text

    text = (
        "version: 1\nturns:\n  - steps:\n      - commandApproval: {command: ls}\n"
        "        onReply: {decilne: [{agentMessage: x}]}\n"
    )
    with pytest.raises(ScriptError) as raised:
        parse_script_text(text, "s.yaml")
    assert (
        "s.yaml:5:9: turns[0].steps[0].onReply: 'decilne' is no reply's key (did you mean "
        "'decline'?)"
    ) in str(raised.value)


async def test_a_missing_script_file_is_a_usage_error(tmp_path: Path) -> None:
    code, _, err = await run_cli(tmp_path, "app-server", "--script", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "nope.yaml" in err


@pytest.mark.parametrize("how", ["flag", "env", "config", "config-unquoted", "config-global"])
async def test_the_script_is_found_by_flag_env_or_config(
    spawn: Spawn, tmp_path: Path, how: str
) -> None:
    path = tmp_path / "found.yaml"
    path.write_text("version: 1\nmethods:\n  model/list: {result: {found: true}}\n")
    if how == "flag":
        fake = await spawn(None, "app-server", "--script", str(path))
    elif how == "env":
        fake = await spawn(None, "app-server", FAKE_CODEX_SCRIPT=str(path))
    elif how == "config":
        fake = await spawn(None, "app-server", "-c", f'fake_codex.script="{path}"')
    elif how == "config-global":
        # Before the subcommand, as the official Python SDK passes its overrides.
        fake = await spawn(None, "--config", f'fake_codex.script="{path}"', "app-server")
    else:
        fake = await spawn(None, "app-server", "-c", f"fake_codex.script={path}")
    await fake.initialize()
    assert (await fake.request("model/list"))["result"] == {"found": True}


async def test_a_scenario_document_contributes_its_app_server_section(spawn: Spawn) -> None:
    fake = await spawn(
        """
        name: some scenario
        http: {ignored: true}
        appServer:
          version: 1
          methods:
            model/list: {result: {fromSection: true}}
        """
    )
    await fake.initialize()
    assert (await fake.request("model/list"))["result"] == {"fromSection": True}


# --- handshake and protocol errors ----------------------------------------------------


async def test_requests_before_initialize_are_refused(spawn: Spawn) -> None:
    fake = await spawn()
    reply = await fake.request("model/list", request_id="early")
    assert reply == {"error": {"code": -32600, "message": "Not initialized"}, "id": "early"}


async def test_initialize_answers_like_the_real_server(spawn: Spawn) -> None:
    fake = await spawn()
    reply = await fake.request("initialize", {"clientInfo": CLIENT_INFO})
    result = reply["result"]
    assert list(result) == ["userAgent", "codexHome", "platformFamily", "platformOs"]
    assert result["userAgent"].startswith(f"tests/{codex_window.PIN} (")
    assert result["userAgent"].endswith("(tests; 9.9.9)")


async def test_initialize_is_followed_by_the_remote_control_status(spawn: Spawn) -> None:
    fake = await spawn(FAKE_CODEX_SEED="3")
    await fake.request("initialize", {"clientInfo": CLIENT_INFO})
    status = await fake.message()
    assert status["method"] == "remoteControl/status/changed"
    assert list(status["params"]) == ["status", "serverName", "installationId", "environmentId"]
    assert status["params"]["status"] == "disabled"
    assert re.fullmatch(r"[0-9a-f-]{36}", status["params"]["installationId"])


async def test_a_second_initialize_is_refused(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    reply = await fake.request("initialize", {"clientInfo": CLIENT_INFO})
    assert reply["error"] == {"code": -32600, "message": "Already initialized"}


async def test_a_scripted_initialize_with_match_applies_to_the_clients_it_fits(
    spawn: Spawn,
) -> None:
    script = """
        version: 1
        initialize:
          match: {clientInfo: {name: probe, version: "1"}}
          error: {code: -32001, message: not you}
    """
    refused = await spawn(script)
    reply = await refused.request("initialize", {"clientInfo": {"name": "probe", "version": "1"}})
    assert reply["error"] == {"code": -32001, "message": "not you"}
    welcome = await spawn(script)
    reply = await welcome.request("initialize", {"clientInfo": CLIENT_INFO})
    assert reply["result"]["userAgent"].startswith(f"{CLIENT_INFO['name']}/")


async def test_requests_are_served_between_initialize_and_initialized(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.request("initialize", {"clientInfo": CLIENT_INFO})
    assert "result" in await fake.request("model/list")


async def test_initialize_without_client_info_names_the_missing_field(spawn: Spawn) -> None:
    fake = await spawn()
    reply = await fake.request("initialize", {})
    assert reply["error"]["message"] == "Invalid request: missing field `clientInfo`"


async def test_an_unknown_method_gets_the_real_unknown_variant_error(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    reply = await fake.request("no/such/method")
    error = reply["error"]
    assert error["code"] == -32600
    assert error["message"].startswith(
        "Invalid request: unknown variant `no/such/method`, expected one of `initialize`, "
    )
    assert "data" not in error


@pytest.mark.parametrize("how", ["option", "script"])
async def test_the_fake_speaks_the_protocol_of_the_release_it_emulates(
    spawn: Spawn, how: str
) -> None:
    """`--codex-version 0.171.0` (or the script's `codexVersion`): that release's method
    list in the unknown-variant error, its new method known (unscripted, the fake says it
    does not implement it, rather than that it does not exist), its version quoted."""
    if how == "option":
        fake = await spawn(None, "app-server", "--codex-version", "0.171.0")
    else:
        fake = await spawn("version: 1\ncodexVersion: 0.171.0\n")
    result = (await fake.initialize())["result"]
    assert result["userAgent"].split(" ")[0].endswith("/0.171.0")
    error = (await fake.request("no/such/method"))["error"]
    listed = re.findall(r"`([^`]*)`", error["message"].split("expected one of ", 1)[1])
    assert listed == list(profile("0.171.0").client_requests)
    assert "modelProvider/default/set" in listed
    known = (await fake.request("modelProvider/default/set", {}))["error"]
    assert "fake-codex does not implement `modelProvider/default/set`" in known["message"]


async def test_the_default_release_does_not_know_a_later_releases_method(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    error = (await fake.request("modelProvider/default/set", {}))["error"]
    assert error["message"].startswith(
        "Invalid request: unknown variant `modelProvider/default/set`, expected one of "
    )


async def test_a_release_the_fake_cannot_emulate_is_refused_naming_those_it_can(
    tmp_path: Path,
) -> None:
    refusal = f"fake-codex emulates codex {', '.join(versions())}, not '0.1.0'"
    code, _, err = await run_cli(tmp_path, "app-server", "--codex-version", "0.1.0")
    assert code == 2
    assert refusal in err
    script = tmp_path / "s.yaml"
    script.write_text("version: 1\ncodexVersion: 0.1.0\n")
    code, _, err = await run_cli(tmp_path, "app-server", "--script", str(script))
    assert code == 2
    assert refusal in err


async def test_a_request_without_params_names_the_missing_field(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    await fake.send({"id": 5, "method": "model/list"})
    reply = await fake.message()
    assert reply == {
        "error": {"code": -32600, "message": "Invalid request: missing field `params`"},
        "id": 5,
    }


async def test_a_known_but_unimplemented_method_says_so(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    reply = await fake.request("config/read")
    assert reply["error"]["code"] == -32603
    assert "methods:" in reply["error"]["message"]


async def test_an_unparsable_line_is_logged_and_the_connection_survives(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.write(b"{not json\n")
    await fake.stderr_contains("Failed to deserialize JSONRPCMessage")
    assert "result" in await fake.initialize()


def nested(levels: int) -> Any:
    """`levels` lists inside each other."""
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize("fast", ["1", "0"])
async def test_a_message_nested_too_deep_is_ignored(spawn: Spawn, fast: str) -> None:
    """A message nesting more than 200 objects and arrays is logged as undecodable and
    ignored (the real server does so past 127), on the fast start and after, instead of
    killing the fake when a reply echoes it (a 300-level `model` did: exit 70)."""
    fake = await spawn(FAKE_CODEX_FAST=fast)
    # 201 levels: the message, `params`, `clientInfo` and 198 lists in it.
    client_info = {**CLIENT_INFO, "title": nested(198)}
    await fake.send({"id": 1, "method": "initialize", "params": {"clientInfo": client_info}})
    await fake.stderr_contains("recursion limit exceeded")
    await fake.initialize()
    await fake.send({"id": 2, "method": "thread/start", "params": {"model": nested(300)}})
    # 200 levels (the message, `params` and 198 lists in it) are read and answered.
    reply = await fake.request("thread/start", {"model": nested(198)}, request_id=3)
    assert reply["result"]["model"] == nested(198)
    await fake.send({"id": 4, "method": "thread/start", "params": {"model": nested(199)}})
    assert "result" in await fake.request("model/list", request_id=5)
    answered = {m["id"] for m in fake.seen if "id" in m and "method" not in m}
    assert answered == {1, 3, 5}
    assert fake.stderr.decode().count("recursion limit exceeded") == 3
    assert fake.proc.returncode is None


async def test_a_response_to_an_unknown_id_is_ignored(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.send({"id": 4242, "result": {}})
    await fake.stderr_contains("4242")
    assert "result" in await fake.initialize()


async def test_a_very_long_request_line_is_read_whole(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    text = "y" * 3_000_000
    await fake.start_turn(thread_id, text)
    read = await fake.until_method("turn/completed")
    assert read[-1]["params"]["turn"]["items"][0]["text"].endswith(text)


async def test_model_list_is_plausible(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    result = (await fake.request("model/list"))["result"]
    assert result["nextCursor"] is None
    assert [model["isDefault"] for model in result["data"]].count(True) == 1


async def test_stdin_eof_exits_zero(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    await fake.close_stdin()
    assert await fake.wait() == 0


async def test_sigterm_ends_the_process(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    fake.proc.terminate()
    assert await fake.wait() == -signal.SIGTERM


async def test_the_seed_makes_ids_reproducible(spawn: Spawn) -> None:
    runs = []
    for _ in range(2):
        fake, thread_id = await ready(spawn, FAKE_CODEX_SEED="7")
        runs.append((thread_id, await fake.start_turn(thread_id)))
    assert runs[0] == runs[1]
    assert re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", runs[0][0]
    )


# --- threads and turns without a script -----------------------------------------------


async def test_thread_start_replies_then_announces_the_thread(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    reply = await fake.request("thread/start", {"cwd": "/tmp", "sandbox": "danger-full-access"})
    result = reply["result"]
    assert result["cwd"] == "/tmp"
    assert result["sandbox"] == {"type": "dangerFullAccess"}
    assert result["approvalPolicy"] == "on-request"
    started = await fake.message()
    assert started["method"] == "thread/started"
    assert started["params"]["thread"] == result["thread"]


async def test_a_default_turn_streams_in_the_real_order(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    reply = await fake.request(
        "turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": "ping"}]}
    )
    turn = reply["result"]["turn"]
    assert (turn["status"], turn["items"], turn["error"]) == ("inProgress", [], None)
    read = await fake.until_method("turn/completed")
    assert methods(read) == [
        "thread/status/changed",
        "turn/started",
        "item/started",
        "item/completed",
        "item/started",
        *["item/agentMessage/delta"] * 4,
        "item/completed",
        "thread/tokenUsage/updated",
        "account/rateLimits/updated",
        "thread/status/changed",
        "turn/completed",
    ]
    text = "Hello from fake-codex. You said: ping"
    assert "".join(m["params"]["delta"] for m in read if m["method"].endswith("/delta")) == text
    assert read[3]["params"]["item"]["type"] == "userMessage"
    completed = read[-1]["params"]
    assert completed["threadId"] == thread_id
    assert completed["turn"]["status"] == "completed"
    assert completed["turn"]["error"] is None
    assert completed["turn"]["items"] == [read[-5]["params"]["item"]]
    assert completed["turn"]["items"][0]["text"] == text
    assert all("emittedAtMs" in m for m in read)


async def test_turn_start_on_an_unknown_thread_fails(spawn: Spawn) -> None:
    fake = await spawn()
    await fake.initialize()
    reply = await fake.request("turn/start", {"threadId": "nope", "input": []})
    assert reply["error"] == {"code": -32600, "message": "thread not found: nope"}


async def test_turn_start_rejects_an_unknown_input_type(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    reply = await fake.request("turn/start", {"threadId": thread_id, "input": [{"type": "x"}]})
    assert reply["error"]["message"].startswith("Invalid request: unknown variant `x`")


async def test_turn_start_during_a_turn_joins_it(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [{steps: [{sleep: 600000}]}]\n")
    first = await fake.start_turn(thread_id)
    await fake.until_method("turn/started")
    second = await fake.start_turn(thread_id, "more")
    assert second == first
    read = await fake.until_method("item/completed")
    assert read[-1]["params"]["item"]["content"][0]["text"] == "more"


async def test_turn_interrupt_ends_a_running_turn(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [{steps: [{sleep: 600000}]}]\n")
    turn_id = await fake.start_turn(thread_id)
    await fake.until_method("turn/started")
    reply = await fake.request("turn/interrupt", {"threadId": thread_id, "turnId": turn_id})
    assert reply["result"] == {}
    read = await fake.until_method("turn/completed")
    turn = read[-1]["params"]["turn"]
    assert (turn["id"], turn["status"], turn["items"]) == (turn_id, "interrupted", [])


async def test_turn_interrupt_without_an_active_turn_fails(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    turn_id = await fake.start_turn(thread_id)
    await fake.until_method("turn/completed")
    reply = await fake.request("turn/interrupt", {"threadId": thread_id, "turnId": turn_id})
    assert reply["error"] == {"code": -32600, "message": "no active turn to interrupt"}


async def test_interrupting_during_an_approval_settles_the_request_after_the_turn(
    spawn: Spawn,
) -> None:
    fake, thread_id = await ready(
        spawn, "version: 1\nturns: [{steps: [{commandApproval: {command: ls}}]}]\n"
    )
    turn_id = await fake.start_turn(thread_id)
    request = (await fake.until_method("item/commandExecution/requestApproval"))[-1]
    await fake.request("turn/interrupt", {"threadId": thread_id, "turnId": turn_id})
    read = await fake.until_method("serverRequest/resolved")
    assert methods(read)[-2:] == ["turn/completed", "serverRequest/resolved"]
    assert read[-1]["params"] == {"threadId": thread_id, "requestId": request["id"]}


# --- scripted replies -----------------------------------------------------------------


async def test_initialize_can_fail(spawn: Spawn) -> None:
    fake = await spawn("version: 1\ninitialize: {error: {code: -32603, message: boom}}\n")
    reply = await fake.request("initialize", {"clientInfo": CLIENT_INFO})
    assert reply["error"] == {"code": -32603, "message": "boom"}
    assert (await fake.request("model/list"))["error"]["message"] == "Not initialized"


async def test_initialize_steps_can_notify_after_the_reply(spawn: Spawn) -> None:
    fake = await spawn(
        """
        version: 1
        initialize:
          steps:
            - respond:
            - notify: {method: configWarning, params: {summary: careful, details: null}}
        """
    )
    reply = await fake.request("initialize", {"clientInfo": CLIENT_INFO})
    assert reply["result"]["userAgent"].startswith("tests/")
    assert (await fake.message())["method"] == "remoteControl/status/changed"
    warning = await fake.message()
    assert warning["method"] == "configWarning"
    assert warning["params"] == {"summary": "careful", "details": None}


async def test_on_initialized_steps_run_after_the_initialized_notification(spawn: Spawn) -> None:
    fake = await spawn(
        """
        version: 1
        onInitialized:
          - notify: {method: remoteControl/status/changed, params: {status: disabled}}
        """
    )
    await fake.initialize()
    message = await fake.message()
    assert message["method"] == "remoteControl/status/changed"


async def test_a_method_can_be_overloaded_without_data(spawn: Spawn) -> None:
    fake = await spawn(
        """
        version: 1
        methods:
          thread/start: {error: {code: -32001, message: "Server overloaded; retry later."}}
        """
    )
    await fake.initialize()
    reply = await fake.request("thread/start")
    assert reply["error"] == {"code": -32001, "message": "Server overloaded; retry later."}


async def test_an_error_carries_data_only_when_given(spawn: Spawn) -> None:
    fake = await spawn(
        "version: 1\nmethods:\n  model/list: {error: {code: 1, message: m, data: null}}\n"
    )
    await fake.initialize()
    assert (await fake.request("model/list"))["error"] == {"code": 1, "message": "m", "data": None}


async def test_a_list_of_replies_is_used_in_order_and_the_last_repeats(spawn: Spawn) -> None:
    fake = await spawn(
        """
        version: 1
        methods:
          model/list:
            - {error: {code: -32001, message: busy}}
            - {result: {data: [], nextCursor: null}}
        """
    )
    await fake.initialize()
    replies = [await fake.request("model/list") for _ in range(3)]
    assert "error" in replies[0]
    assert replies[1]["result"] == replies[2]["result"] == {"data": [], "nextCursor": None}


async def test_a_scripted_method_can_be_new(spawn: Spawn) -> None:
    fake = await spawn("version: 1\nmethods:\n  test/echo: {result: {ok: true}}\n")
    await fake.initialize()
    assert (await fake.request("test/echo"))["result"] == {"ok": True}


async def test_method_steps_run_before_the_built_in_reply(spawn: Spawn) -> None:
    fake = await spawn(
        """
        version: 1
        methods:
          thread/start: {steps: [{notify: {method: warning, params: {message: first}}}]}
        """
    )
    await fake.initialize()
    await fake.send({"id": 1, "method": "thread/start", "params": {}})
    read = await fake.until_method("thread/started")
    assert methods(read) == ["warning", None, "thread/started"]


async def test_a_scripted_method_without_a_reply_says_its_script_lacks_one(spawn: Spawn) -> None:
    fake = await spawn("version: 1\nmethods:\n  x/flood: {steps: [{notify: {method: warning}}]}\n")
    await fake.initialize()
    reply = await fake.request("x/flood")
    assert reply["error"]["code"] == -32603
    assert reply["error"]["message"] == (
        "fake-codex has no built-in reply to `x/flood`, and its script gives it none: add "
        "`result:` or `error:` beside its `steps:`"
    )


async def test_no_reply_leaves_a_request_unanswered(spawn: Spawn) -> None:
    fake = await spawn("version: 1\nmethods:\n  model/list: {noReply: true}\n")
    await fake.initialize()
    await fake.send({"id": "lost", "method": "model/list", "params": {}})
    reply = await fake.request("thread/start")
    assert "result" in reply
    assert all(message.get("id") != "lost" for message in fake.seen)


async def test_a_method_can_crash_the_process(spawn: Spawn) -> None:
    fake = await spawn(
        'version: 1\nmethods:\n  test/crash: {steps: [{stderr: "boom\\n"}, {exit: 3}]}\n'
    )
    await fake.initialize()
    await fake.send({"id": 1, "method": "test/crash", "params": {}})
    assert await fake.wait() == 3
    assert b"boom\n" in fake.stderr


# --- steps: replies -----------------------------------------------------------------


async def test_respond_answers_early_and_later_steps_continue(spawn: Spawn) -> None:
    fake = await spawn(
        """
        version: 1
        methods:
          model/list:
            steps:
              - respond: {result: {early: true}}
              - notify: {method: warning, params: {message: after}}
        """
    )
    await fake.initialize()
    assert (await fake.request("model/list"))["result"] == {"early": True}
    assert (await fake.message())["params"] == {"message": "after"}


async def test_respond_twice_sends_a_duplicate_response(spawn: Spawn) -> None:
    fake = await spawn(
        "version: 1\nmethods:\n  model/list: {steps: [{respondTwice: {result: 1}}]}\n"
    )
    await fake.initialize()
    await fake.send({"id": 9, "method": "model/list", "params": {}})
    assert [await fake.message(), await fake.message()] == [{"id": 9, "result": 1}] * 2


async def test_respond_unknown_id_answers_an_id_never_used(spawn: Spawn) -> None:
    fake = await spawn(
        """
        version: 1
        methods:
          model/list: {steps: [{respondUnknownId: {id: 555}}, {respond: }]}
        """
    )
    await fake.initialize()
    await fake.send({"id": 1, "method": "model/list", "params": {}})
    assert await fake.message() == {"id": 555, "result": {}}
    assert (await fake.message())["id"] == 1


# --- steps: turns -------------------------------------------------------------------


async def test_turn_scripts_are_used_in_order_then_the_default(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [First, Second]\n")
    texts = []
    for _ in range(3):
        await fake.start_turn(thread_id, "x")
        read = await fake.until_method("turn/completed")
        texts.append(read[-1]["params"]["turn"]["items"][0]["text"])
    assert texts == ["First", "Second", "Hello from fake-codex. You said: x"]


async def test_agent_message_splits_into_the_requested_deltas(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn, "version: 1\nturns: [{steps: [{agentMessage: {text: abcdef, deltas: 3}}]}]\n"
    )
    await fake.start_turn(thread_id)
    read = await fake.until_method("turn/completed")
    deltas = [m["params"]["delta"] for m in read if m["method"] == "item/agentMessage/delta"]
    assert deltas == ["ab", "cd", "ef"]


async def test_agent_message_sentences_are_reproducible_under_a_seed(spawn: Spawn) -> None:
    script = "version: 1\nseed: 3\nturns: [{steps: [{agentMessage: {sentences: 2}}]}]\n"
    texts = []
    for _ in range(2):
        fake, thread_id = await ready(spawn, script)
        await fake.start_turn(thread_id)
        read = await fake.until_method("turn/completed")
        texts.append(read[-1]["params"]["turn"]["items"][0]["text"])
    assert texts[0] == texts[1]
    assert texts[0].count(".") >= 2


async def test_item_events_can_come_out_of_order(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns: [{steps: [{agentMessage: {text: hi, events: [completed, started]}}]}]
        """,
    )
    await fake.start_turn(thread_id)
    read = await fake.until_method("turn/completed")
    items = [
        (m["method"], m["params"]["item"]["type"])
        for m in read
        if m["method"] in ("item/started", "item/completed")
    ]
    assert items[2:] == [("item/completed", "agentMessage"), ("item/started", "agentMessage")]


async def test_complete_turn_can_fail_the_turn_and_later_steps_still_run(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns:
          - steps:
              - completeTurn: {status: failed, error: {message: nope, codexErrorInfo: other}}
              - notify: {method: warning, params: {message: late}}
        """,
    )
    turn_id = await fake.start_turn(thread_id)
    read = await fake.until_method("warning")
    assert methods(read)[-4:] == ["error", "thread/status/changed", "turn/completed", "warning"]
    error = read[-4]["params"]
    assert (error["turnId"], error["willRetry"], error["error"]["message"]) == (
        turn_id,
        False,
        "nope",
    )
    turn = read[-2]["params"]["turn"]
    assert (turn["status"], turn["error"]["message"]) == ("failed", "nope")


async def test_no_completion_leaves_the_turn_open(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns:
          - noCompletion: true
            steps: [{agentMessage: done}, {notify: {method: warning, params: {message: end}}}]
        """,
    )
    await fake.start_turn(thread_id)
    await fake.until_method("warning")
    await fake.request("model/list")
    assert "turn/completed" not in methods(fake.seen)


async def test_usage_is_reported_and_accumulates_per_thread(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns: [{usage: {inputTokens: 7, outputTokens: 3}}, {usage: {inputTokens: 1}}]
        """,
    )
    usages = []
    for _ in range(2):
        await fake.start_turn(thread_id)
        usages.append((await fake.until_method("thread/tokenUsage/updated"))[-1]["params"])
    assert usages[0]["tokenUsage"]["last"]["totalTokens"] == 10
    assert usages[1]["tokenUsage"]["total"]["totalTokens"] == 10 + 21


# --- steps: server requests ----------------------------------------------------------

APPROVAL_SCRIPT = """
version: 1
turns:
  - steps:
      - commandApproval: {command: "touch %(path)s", touch: "%(path)s", output: "done\\n"}
        onReply:
          decline: [{notify: {method: warning, params: {message: declined}}}]
          default: [{notify: {method: warning, params: {message: other}}}]
      - agentMessage: finished
"""


async def approve(spawn: Spawn, tmp_path: Path, reply: Message) -> tuple[Path, list[Message]]:
    target = tmp_path / "touched"
    fake, thread_id = await ready(spawn, APPROVAL_SCRIPT % {"path": target})
    turn_id = await fake.start_turn(thread_id)
    read = await fake.until_method("item/commandExecution/requestApproval")
    request = read[-1]
    assert request["params"]["threadId"] == thread_id
    assert request["params"]["turnId"] == turn_id
    assert request["params"]["command"] == f"/bin/bash -lc 'touch {target}'"
    assert methods(read)[-3:-1] == ["thread/status/changed", "item/started"]
    await fake.send({"id": request["id"], **reply})
    return target, await fake.until_method("turn/completed")


async def test_an_accepted_command_runs(spawn: Spawn, tmp_path: Path) -> None:
    target, read = await approve(spawn, tmp_path, {"result": {"decision": "accept"}})
    assert target.exists()
    assert methods(read)[:2] == ["serverRequest/resolved", "thread/status/changed"]
    item = next(m for m in read if m["method"] == "item/completed")["params"]["item"]
    assert (item["status"], item["exitCode"], item["aggregatedOutput"]) == (
        "completed",
        0,
        "done\n",
    )
    assert "warning" in methods(read)
    assert read[-1]["params"]["turn"]["status"] == "completed"


async def test_a_declined_command_does_not_run(spawn: Spawn, tmp_path: Path) -> None:
    target, read = await approve(spawn, tmp_path, {"result": {"decision": "decline"}})
    assert not target.exists()
    item = next(m for m in read if m["method"] == "item/completed")["params"]["item"]
    assert item["status"] == "declined"
    assert {"message": "declined"} in [m["params"] for m in read if m["method"] == "warning"]
    assert read[-1]["params"]["turn"]["items"][0]["text"] == "finished"


async def test_a_cancelled_command_interrupts_the_turn(spawn: Spawn, tmp_path: Path) -> None:
    target, read = await approve(spawn, tmp_path, {"result": {"decision": "cancel"}})
    assert not target.exists()
    turn = read[-1]["params"]["turn"]
    assert (turn["status"], turn["items"]) == ("interrupted", [])
    assert "item/agentMessage/delta" not in methods(read)


async def test_an_error_reply_fails_the_command(spawn: Spawn, tmp_path: Path) -> None:
    target, read = await approve(spawn, tmp_path, {"error": {"code": -32000, "message": "no"}})
    assert not target.exists()
    item = next(m for m in read if m["method"] == "item/completed")["params"]["item"]
    assert item["status"] == "failed"
    assert {"message": "other"} in [m["params"] for m in read if m["method"] == "warning"]


async def test_an_accepted_file_change_is_written(spawn: Spawn, tmp_path: Path) -> None:
    target = tmp_path / "new.txt"
    fake, thread_id = await ready(
        spawn,
        f"""
        version: 1
        turns:
          - steps: [{{fileChangeApproval: {{path: "{target}", content: "hi\\n", write: true}}}}]
        """,
    )
    await fake.start_turn(thread_id)
    request = (await fake.until_method("item/fileChange/requestApproval"))[-1]
    await fake.answer(request, {"decision": "acceptForSession"})
    read = await fake.until_method("turn/completed")
    item = next(m for m in read if m["method"] == "item/completed")["params"]["item"]
    assert (item["type"], item["status"]) == ("fileChange", "completed")
    assert target.read_text() == "hi\n"


SERVER_REQUESTS = [
    "item/commandExecution/requestApproval",
    "item/fileChange/requestApproval",
    "item/permissions/requestApproval",
    "item/tool/requestUserInput",
    "item/tool/call",
    "mcpServer/elicitation/request",
    "account/chatgptAuthTokens/refresh",
    "attestation/generate",
    "execCommandApproval",
    "applyPatchApproval",
]


@pytest.mark.parametrize("method", SERVER_REQUESTS)
async def test_request_sends_any_server_request_and_waits(spawn: Spawn, method: str) -> None:
    fake, thread_id = await ready(
        spawn,
        f"""
        version: 1
        turns:
          - steps:
              - request: {{method: {method}}}
                onReply:
                  result: [{{notify: {{method: warning, params: {{message: "${{requestId}}"}}}}}}]
        """,
    )
    await fake.start_turn(thread_id)
    request = (await fake.until_method(method))[-1]
    assert request["id"] == 0
    assert isinstance(request["params"], dict)
    await fake.answer(request, {"ok": True})
    read = await fake.until_method("warning")
    assert read[0]["params"] == {"threadId": thread_id, "requestId": 0}
    assert read[-1]["params"] == {"message": 0}


@pytest.mark.parametrize(
    ("result", "branch"),
    [
        ({"permissions": {"network": {"enabled": True}}, "scope": "turn"}, "turn"),
        ({"permissions": {"network": {"enabled": True}}, "scope": "session"}, "session"),
        ({"permissions": {}}, "result"),
    ],
)
async def test_a_permissions_grant_selects_the_branch_of_its_scope(
    spawn: Spawn, result: dict[str, Any], branch: str
) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns:
          - steps:
              - request: {method: item/permissions/requestApproval}
                onReply:
                  turn: [{agentMessage: granted for the turn}]
                  session: [{agentMessage: granted for the session}]
                  result: [{agentMessage: not granted}]
        """,
    )
    await fake.start_turn(thread_id)
    request = (await fake.until_method("item/permissions/requestApproval"))[-1]
    await fake.answer(request, result)
    read = await fake.until_method("turn/completed")
    texts = {"turn": "granted for the turn", "session": "granted for the session"}
    assert read[-1]["params"]["turn"]["items"][0]["text"] == texts.get(branch, "not granted")


async def test_request_params_are_laid_over_the_defaults(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns:
          - steps:
              - request:
                  method: item/tool/requestUserInput
                  id: req-1
                  params: {isBlocking: false}
        """,
    )
    turn_id = await fake.start_turn(thread_id)
    request = (await fake.until_method("item/tool/requestUserInput"))[-1]
    assert request["id"] == "req-1"
    assert request["params"]["isBlocking"] is False
    assert request["params"]["turnId"] == turn_id
    assert request["params"]["questions"]


async def test_a_client_request_with_a_pending_server_request_id_is_a_request(
    spawn: Spawn,
) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns:
          - steps:
              - request: {method: item/tool/call, id: 77}
              - agentMessage: after the call
        """,
    )
    await fake.start_turn(thread_id)
    request = (await fake.until_method("item/tool/call"))[-1]
    reply = await fake.request("model/list", request_id=77)
    assert "data" in reply["result"]
    assert "item/agentMessage/delta" not in methods(fake.seen)
    await fake.answer(request, {"contentItems": [], "success": True})
    read = await fake.until_method("turn/completed")
    assert read[-1]["params"]["turn"]["items"][0]["text"] == "after the call"


async def test_a_request_need_not_wait_for_its_reply(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns:
          - steps:
              - request: {method: item/tool/requestUserInput, wait: false}
              - agentMessage: without waiting
        """,
    )
    await fake.start_turn(thread_id)
    read = await fake.until_method("turn/completed")
    request = next(m for m in read if m.get("method") == "item/tool/requestUserInput")
    await fake.answer(request, {"answers": {}})
    resolved = (await fake.until_method("serverRequest/resolved"))[-1]
    assert resolved["params"]["requestId"] == request["id"]


async def test_on_initialized_requests_carry_no_thread(spawn: Spawn) -> None:
    fake = await spawn(
        """
        version: 1
        onInitialized:
          - request: {method: account/chatgptAuthTokens/refresh}
          - notify: {method: warning, params: {message: refreshed}}
        """
    )
    await fake.initialize()
    request = await fake.message()
    assert request["params"] == {"reason": "unauthorized", "previousAccountId": None}
    await fake.answer(request, {"accessToken": "t", "chatgptAccountId": "a"})
    assert (await fake.message())["method"] == "warning"


# --- steps: output quirks ------------------------------------------------------------


async def test_notify_fills_in_placeholders(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns:
          - steps:
              - notify:
                  method: turn/plan/updated
                  params: {threadId: "${threadId}", note: "in ${turnId}"}
        """,
    )
    turn_id = await fake.start_turn(thread_id)
    params = (await fake.until_method("turn/plan/updated"))[-1]["params"]
    assert params == {"threadId": thread_id, "note": f"in {turn_id}"}


async def test_raw_writes_a_line_that_is_not_json(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, 'version: 1\nturns: [{steps: [{raw: "not json"}]}]\n')
    await fake.start_turn(thread_id)
    await fake.until_method("turn/started")
    lines = [await fake.line() for _ in range(3)]
    assert b"not json" in lines


async def test_raw_without_newline_leaves_a_partial_line(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns: [{noCompletion: true, steps: [{raw: "{\\"partial\\": ", newline: false}]}]
        """,
    )
    await fake.start_turn(thread_id)
    await fake.until_method("turn/started")
    await fake.close_stdin()
    assert await fake.wait() == 0
    assert fake.proc.stdout is not None
    rest = await fake.proc.stdout.read()
    assert rest.endswith(b'{"partial": ')


async def test_big_line_writes_a_line_of_the_requested_size(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [{steps: [{bigLine: 2000000}]}]\n")
    await fake.start_turn(thread_id)
    await fake.until_method("turn/started")
    while len(line := await fake.line()) < 1_000_000:
        pass
    assert len(line) == 2_000_000
    assert json.loads(line)["method"] == "item/agentMessage/delta"


async def test_flood_writes_many_notifications(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn, "version: 1\nturns: [{steps: [{flood: {count: 50000}}]}]\n"
    )
    await fake.start_turn(thread_id)
    read = await fake.until_method("turn/completed")
    assert methods(read).count("item/agentMessage/delta") == 50000


async def test_stderr_writes_text(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, 'version: 1\nturns: [{steps: [{stderr: "oops\\n"}]}]\n')
    await fake.start_turn(thread_id)
    assert "oops\n" in await fake.stderr_contains("oops")


async def test_stderr_flood_writes_that_many_bytes_then_carries_on(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [{steps: [{stderrFlood: 3000000}]}]\n")
    before = len(fake.stderr)
    await fake.start_turn(thread_id)
    await fake.until_method("turn/completed")
    await fake.close_stdin()
    assert await fake.wait() == 0
    assert len(fake.stderr) - before >= 3_000_000


async def test_sleep_holds_the_turn_until_it_ends(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn, "version: 1\nturns: [{steps: [{sleep: 1}, {agentMessage: awake}]}]\n"
    )
    await fake.start_turn(thread_id)
    read = await fake.until_method("turn/completed")
    assert read[-1]["params"]["turn"]["items"][0]["text"] == "awake"


# --- steps: process fate -------------------------------------------------------------


async def test_exit_mid_turn_is_a_silent_exit(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [{steps: [{exit: 0}]}]\n")
    await fake.start_turn(thread_id)
    await fake.until_method("turn/started")
    assert await fake.wait() == 0
    assert methods(await fake.rest()) == ["item/started", "item/completed"]


async def test_exit_can_die_by_signal(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [{steps: [{exit: {signal: KILL}}]}]\n")
    await fake.start_turn(thread_id)
    assert await fake.wait() == -signal.SIGKILL


async def test_a_stalled_fake_ignores_input_and_eof_but_not_sigterm(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [{steps: [{stall: true}]}]\n")
    await fake.start_turn(thread_id)
    await fake.stderr_contains("fake-codex: stalled")
    await fake.send({"id": 99, "method": "model/list", "params": {}})
    await fake.close_stdin()
    await fake.stderr_contains("stdin closed; stalled, so not exiting")
    fake.proc.terminate()
    assert await fake.wait() == -signal.SIGTERM
    assert all(message.get("id") != 99 for message in fake.seen)


async def test_a_stall_can_ignore_sigterm(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        "version: 1\nturns: [{steps: [{stall: {ignoreTerm: true, exitOnEof: true}}]}]\n",
    )
    await fake.start_turn(thread_id)
    await fake.stderr_contains("fake-codex: stalled")
    fake.proc.terminate()
    await fake.close_stdin()
    # Had SIGTERM been honoured, the pending signal would have ended the process
    # before it could see EOF and exit normally.
    assert await fake.wait() == 0


async def test_spawn_child_leaves_a_grandchild_in_the_process_group(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [{steps: [{spawnChild: true}]}]\n")
    await fake.start_turn(thread_id)
    stderr = await fake.stderr_contains("fake-codex: child pid ")
    match = re.search(r"fake-codex: child pid (\d+)", stderr)
    assert match is not None
    pid = int(match.group(1))
    try:
        assert os.getpgid(pid) == os.getpgid(fake.proc.pid)
        await fake.close_stdin()
        assert await fake.wait() == 0
        os.kill(pid, 0)
    finally:
        os.kill(pid, signal.SIGKILL)


async def test_spawn_child_with_wait_goes_on_once_the_command_exits(
    spawn: Spawn, tmp_path: Path
) -> None:
    # The agent message comes after the command's exit: its marker file exists by then.
    marker = tmp_path / "done"
    child = {"command": ["sh", "-c", f"touch {marker}; exit 3"], "wait": True}
    script = {"version": 1, "turns": [{"steps": [{"spawnChild": child}, {"stderr": "after\n"}]}]}
    fake, thread_id = await ready(spawn, json.dumps(script))
    await fake.start_turn(thread_id)
    stderr = await fake.stderr_contains("after")
    assert re.search(r"fake-codex: child pid \d+ exited: 3\n.*after", stderr, re.S), stderr
    assert marker.exists()


# --- the real schema -----------------------------------------------------------------


RESPONSE_SCHEMAS = {
    "initialize": "v1/InitializeResponse.json",
    "thread/start": "v2/ThreadStartResponse.json",
    "turn/start": "v2/TurnStartResponse.json",
    "turn/interrupt": "v2/TurnInterruptResponse.json",
    "model/list": "v2/ModelListResponse.json",
    "thread/read": "v2/ThreadReadResponse.json",
    "thread/list": "v2/ThreadListResponse.json",
    "thread/loaded/list": "v2/ThreadLoadedListResponse.json",
    "thread/name/set": "v2/ThreadSetNameResponse.json",
    "thread/resume": "v2/ThreadResumeResponse.json",
    "thread/fork": "v2/ThreadForkResponse.json",
    "thread/archive": "v2/ThreadArchiveResponse.json",
    "thread/unarchive": "v2/ThreadUnarchiveResponse.json",
    "turn/steer": "v2/TurnSteerResponse.json",
}

SCHEMA_SCRIPT = """
version: 1
turns:
  - steps:
      - agentMessage: hello
      - commandApproval: {command: "echo hi", output: "hi\\n"}
      - fileChangeApproval: {path: /tmp/never-written.txt, content: x}
%(requests)s
      - completeTurn: {status: failed}
  - steps: [{sleep: 600000}]
"""


@pytest.mark.real_codex
async def test_every_message_matches_the_real_json_schema(
    spawn: Spawn, tmp_path: Path, codex_bin: str
) -> None:
    codex = codex_bin
    import jsonschema

    schema_dir = tmp_path / "schema"
    proc = await asyncio.create_subprocess_exec(
        codex, "app-server", "generate-json-schema", "--out", str(schema_dir)
    )
    assert await asyncio.wait_for(proc.wait(), 60) == 0

    def validator(name: str) -> Any:
        schema = json.loads((schema_dir / name).read_text())
        return jsonschema.Draft7Validator(schema)

    notifications = validator("ServerNotification.json")
    server_requests = validator("ServerRequest.json")
    responses = {method: validator(path) for method, path in RESPONSE_SCHEMAS.items()}

    requests = "\n".join(f"      - request: {{method: {m}}}" for m in SERVER_REQUESTS)
    fake, thread_id = await ready(spawn, SCHEMA_SCRIPT % {"requests": requests})
    await fake.request("model/list")
    await fake.start_turn(thread_id)
    while (message := await fake.message()).get("method") != "turn/completed":
        if "id" in message:
            await fake.answer(message, {"decision": "accept"})
    turn_id = await fake.start_turn(thread_id)
    steer = {"threadId": thread_id, "expectedTurnId": turn_id, "input": []}
    assert "result" in await fake.request("turn/steer", steer)
    await fake.request("turn/interrupt", {"threadId": thread_id, "turnId": turn_id})
    await fake.until_method("turn/completed")
    for method, params in [
        ("thread/read", {"threadId": thread_id, "includeTurns": True}),
        ("thread/name/set", {"threadId": thread_id, "name": "Checked"}),
        ("thread/list", {}),
        ("thread/loaded/list", {"limit": 1}),
        ("thread/resume", {"threadId": thread_id}),
        ("thread/fork", {"threadId": thread_id}),
        ("thread/archive", {"threadId": thread_id}),
        ("thread/list", {"archived": True}),
        ("thread/unarchive", {"threadId": thread_id}),
    ]:
        assert "result" in await fake.request(method, params), method
    await fake.close_stdin()
    await fake.rest()

    problems = []
    for message in fake.seen:
        if "method" in message:
            checker = server_requests if "id" in message else notifications
        elif "result" in message:
            checker, message = responses[fake.requested[message["id"]]], message["result"]
        else:
            continue
        problems += [
            f"{error.message} in {message}"[:300] for error in checker.iter_errors(message)
        ]
    assert problems == []


# --- thread methods ------------------------------------------------------------------


async def finished_turn(fake: FakeCodex, thread_id: str, text: str = "hi") -> str:
    turn_id = await fake.start_turn(thread_id, text)
    await fake.until_method("turn/completed")
    return turn_id


async def test_thread_read_shows_the_turns_only_when_asked(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    fresh = (await fake.request("thread/read", {"threadId": thread_id}))["result"]
    assert (fresh["thread"]["turns"], fresh["readState"], fresh["thread"]["preview"]) == (
        [],
        None,
        "",
    )
    turn_id = await finished_turn(fake, thread_id, "Say hi")
    plain = (await fake.request("thread/read", {"threadId": thread_id}))["result"]
    assert plain["thread"]["turns"] == []
    assert plain["thread"]["preview"] == "Say hi"
    assert plain["readState"]["firstUnread"] == {"type": "turn", "turnId": turn_id}
    await fake.send(
        {
            "id": "full",
            "method": "thread/read",
            "params": {"threadId": thread_id, "includeTurns": True},
        }
    )
    notice, reply = await fake.message(), await fake.message()
    assert notice["method"] == "deprecationNotice"
    (turn,) = reply["result"]["thread"]["turns"]
    assert (turn["id"], turn["itemsView"], turn["status"]) == (turn_id, "full", "completed")
    assert [item["type"] for item in turn["items"]] == ["userMessage", "agentMessage"]
    unknown = await fake.request("thread/read", {"threadId": "nope"})
    assert unknown["error"] == {"code": -32600, "message": "thread not loaded: nope"}


async def test_thread_list_shows_threads_with_turns_newest_first(spawn: Spawn) -> None:
    fake, first = await ready(spawn)
    await finished_turn(fake, first)
    second = await fake.start_thread()
    await fake.until_method("thread/started")
    await fake.start_thread()  # no turn: not listed, like a thread without a rollout
    await finished_turn(fake, second)
    listed = (await fake.request("thread/list"))["result"]
    assert list(listed) == ["data", "readStates", "nextCursor", "backwardsCursor"]
    assert [thread["id"] for thread in listed["data"]] == [second, first]
    assert set(listed["readStates"]) == {first, second}
    assert listed["data"][0]["canAcceptDirectInput"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", listed["backwardsCursor"])


async def test_thread_loaded_list_pages_the_threads_in_memory(spawn: Spawn) -> None:
    """The ids in codex's order (sorted: its ids are UUIDv7, so oldest first but for
    threads of one millisecond), a page at a time; archived threads are not loaded."""
    fake, first = await ready(spawn)
    second = await fake.start_thread()
    third = await fake.start_thread()
    ids = sorted([first, second, third])
    assert (await fake.request("thread/loaded/list"))["result"] == {
        "data": ids,
        "nextCursor": None,
    }
    page = (await fake.request("thread/loaded/list", {"limit": 2}))["result"]
    assert page == {"data": ids[:2], "nextCursor": ids[1]}
    rest = {"limit": 2, "cursor": page["nextCursor"]}
    assert (await fake.request("thread/loaded/list", rest))["result"] == {
        "data": ids[2:],
        "nextCursor": None,
    }
    await finished_turn(fake, second)
    assert "result" in await fake.request("thread/archive", {"threadId": second})
    listed = (await fake.request("thread/loaded/list"))["result"]
    assert listed["data"] == sorted([first, third])


async def test_thread_list_pages_with_the_real_cursor(spawn: Spawn) -> None:
    """As codex 0.169.0: with a `limit` short of the rest, `nextCursor` is the last
    listed thread's creation second and id (`2026-11-27T08:50:09Z|<id>`); the next page
    starts after it; the last page's is null; a cursor of another shape is refused."""
    fake, first = await ready(spawn)
    await finished_turn(fake, first)
    threads = [first]
    for _ in range(2):
        thread_id = await fake.start_thread()
        await fake.until_method("thread/started")
        await finished_turn(fake, thread_id)
        threads.append(thread_id)
    seen: list[str] = []
    cursor = None
    for _ in range(len(threads)):
        page = (await fake.request("thread/list", {"limit": 1, "cursor": cursor}))["result"]
        seen += [thread["id"] for thread in page["data"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\|" + seen[-1], cursor)
    assert seen == threads[::-1]
    assert cursor is None
    whole = (await fake.request("thread/list", {"limit": 3}))["result"]
    assert whole["nextCursor"] is None
    refused = await fake.request("thread/list", {"cursor": "garbage"})
    assert refused["error"] == {"code": -32600, "message": "invalid cursor: garbage"}


async def test_thread_loaded_list_pages_by_the_last_id(spawn: Spawn) -> None:
    fake, first = await ready(spawn)
    second = await fake.start_thread()
    await fake.until_method("thread/started")
    whole = (await fake.request("thread/loaded/list"))["result"]
    assert whole == {"data": sorted([first, second]), "nextCursor": None}
    page = (await fake.request("thread/loaded/list", {"limit": 1}))["result"]
    assert page == {"data": [min(first, second)], "nextCursor": min(first, second)}
    rest = await fake.request("thread/loaded/list", {"limit": 1, "cursor": page["nextCursor"]})
    assert rest["result"] == {"data": [max(first, second)], "nextCursor": None}


async def test_thread_name_set_answers_then_announces(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    assert (await fake.request("thread/name/set", {"threadId": thread_id, "name": "Mine"}))[
        "result"
    ] == {}
    updated = await fake.message()
    assert updated["method"] == "thread/name/updated"
    assert updated["params"] == {"threadId": thread_id, "threadName": "Mine"}
    read = (await fake.request("thread/read", {"threadId": thread_id}))["result"]
    assert read["thread"]["name"] == "Mine"
    unknown = await fake.request("thread/name/set", {"threadId": "x", "name": "y"})
    assert unknown["error"]["message"] == "no rollout found for thread id x"


async def test_thread_resume_returns_history_settings_and_usage(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    turn_id = await finished_turn(fake, thread_id)
    await fake.send({"id": "r", "method": "thread/resume", "params": {"threadId": thread_id}})
    read = await fake.until(lambda m: m.get("method") == "thread/goal/cleared")
    assert methods(read) == [
        "deprecationNotice",
        None,
        "thread/tokenUsage/updated",
        "thread/goal/cleared",
    ]
    result = read[1]["result"]
    assert list(result)[:2] == ["thread", "model"]
    assert list(result)[-4:] == [
        "multiAgentMode",
        "initialTurnsPage",
        "turnsBackwardsCursor",
        "itemsBackwardsCursor",
    ]
    assert result["collaborationMode"]["mode"] == "default"
    assert [turn["id"] for turn in result["thread"]["turns"]] == [turn_id]
    assert read[2]["params"]["turnId"] == turn_id
    quiet = await fake.request("thread/resume", {"threadId": thread_id, "excludeTurns": True})
    assert quiet["result"]["thread"]["turns"] == []
    unknown = await fake.request("thread/resume", {"threadId": "gone"})
    assert unknown["error"]["message"] == "no rollout found for thread id gone"


async def test_thread_fork_copies_the_history_into_a_new_thread(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    await fake.request("thread/name/set", {"threadId": thread_id, "name": "Source"})
    turn_id = await finished_turn(fake, thread_id, "Say hi")
    await fake.send({"id": "f", "method": "thread/fork", "params": {"threadId": thread_id}})
    read = await fake.until_method("thread/started")
    assert methods(read) == [
        "deprecationNotice",
        None,
        "thread/tokenUsage/updated",
        "thread/started",
    ]
    forked = read[1]["result"]["thread"]
    assert forked["id"] != thread_id
    assert (forked["forkedFromId"], forked["name"], forked["preview"]) == (
        thread_id,
        "Source",
        "Say hi",
    )
    assert [turn["id"] for turn in forked["turns"]] == [turn_id]
    assert read[3]["params"]["thread"]["turns"] == []
    assert "result" in await fake.request("turn/start", {"threadId": forked["id"], "input": []})


async def test_archived_threads_are_unloaded_until_resumed(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    await finished_turn(fake, thread_id)
    await fake.send({"id": "a", "method": "thread/archive", "params": {"threadId": thread_id}})
    read = await fake.until_method("thread/archived")
    assert methods(read) == ["thread/status/changed", None, "thread/archived"]
    assert read[0]["params"]["status"] == {"type": "notLoaded"}
    assert (await fake.request("thread/list"))["result"]["data"] == []
    archived = (await fake.request("thread/list", {"archived": True}))["result"]["data"]
    assert [thread["id"] for thread in archived] == [thread_id]
    assert "/archived_sessions/" in archived[0]["path"]
    refused = await fake.request("turn/start", {"threadId": thread_id, "input": []})
    assert refused["error"]["message"] == f"thread not found: {thread_id}"
    unarchived = (await fake.request("thread/unarchive", {"threadId": thread_id}))["result"]
    assert unarchived["thread"]["status"] == {"type": "notLoaded"}
    assert (await fake.message())["method"] == "thread/unarchived"
    await fake.send({"id": "r", "method": "thread/resume", "params": {"threadId": thread_id}})
    assert (await fake.until_method("thread/status/changed"))[-1]["params"]["status"] == {
        "type": "idle"
    }
    await fake.until_method("thread/goal/cleared")
    assert "result" in await fake.request("turn/start", {"threadId": thread_id, "input": []})


async def test_turn_steer_adds_input_to_the_expected_turn(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn, "version: 1\nturns: [{steps: [{sleep: 600000}]}]\n")
    steer = {
        "threadId": thread_id,
        "expectedTurnId": "x",
        "input": [{"type": "text", "text": "more"}],
    }
    idle = await fake.request("turn/steer", steer)
    assert idle["error"] == {"code": -32600, "message": "no active turn to steer"}
    turn_id = await fake.start_turn(thread_id)
    await fake.until_method("turn/started")
    wrong = await fake.request("turn/steer", steer)
    assert wrong["error"]["message"] == f"expected active turn id `x` but found `{turn_id}`"
    right = await fake.request("turn/steer", {**steer, "expectedTurnId": turn_id})
    assert right["result"] == {"turnId": turn_id}
    added = await fake.until(
        lambda m: (
            m.get("method") == "item/completed"
            and m["params"]["item"]["content"][0]["text"] == "more"
        )
    )
    assert added[-1]["params"]["turnId"] == turn_id


# --- script: matching requests, unknown methods, usage per model response --------------


async def test_turns_and_methods_can_match_request_params_and_repeat(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        methods:
          model/list:
            - {match: {includeHidden: true}, repeat: true, result: {hidden: true}}
            - {result: {hidden: false}}
        turns:
          - match: {requireApproval: true}
            repeat: true
            steps: [{commandApproval: {command: ls}}]
          - Plain.
        """,
    )
    for _ in range(2):
        assert (await fake.request("model/list", {"includeHidden": True}))["result"] == {
            "hidden": True
        }
    assert (await fake.request("model/list"))["result"] == {"hidden": False}
    for _ in range(2):
        await fake.request(
            "turn/start", {"threadId": thread_id, "input": [], "requireApproval": True}
        )
        request = (await fake.until_method("item/commandExecution/requestApproval"))[-1]
        await fake.answer(request, {"decision": "accept"})
        await fake.until_method("turn/completed")
    await fake.start_turn(thread_id)
    read = await fake.until_method("turn/completed")
    assert read[-1]["params"]["turn"]["items"][0]["text"] == "Plain."


async def test_unknown_methods_can_be_scripted_with_placeholders(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        unknownMethods: {error: {code: -32601, message: "unknown method ${method}"}}
        methods:
          x/echo: {result: {thread: "${threadId}", method: "${method}"}}
        """,
    )
    reply = await fake.request("no/such/method")
    assert reply["error"] == {"code": -32601, "message": "unknown method no/such/method"}
    echoed = await fake.request("x/echo", {"threadId": "thr_123"})
    assert echoed["result"] == {"thread": "thr_123", "method": "x/echo"}
    known = await fake.request("x/echo", {"threadId": thread_id})
    assert known["result"]["thread"] == thread_id


async def test_a_tool_call_ends_a_model_response_and_reports_its_usage(spawn: Spawn) -> None:
    fake, thread_id = await ready(
        spawn,
        """
        version: 1
        turns:
          - steps: [{commandApproval: {command: ls}}, {agentMessage: Listed.}]
          - steps: [{commandApproval: {command: ls}}, {agentMessage: Never.}]
        """,
    )
    await fake.start_turn(thread_id)
    request = (await fake.until_method("item/commandExecution/requestApproval"))[-1]
    await fake.answer(request, {"decision": "decline"})
    read = await fake.until_method("turn/completed")
    assert methods(read)[:5] == [
        "serverRequest/resolved",
        "item/completed",
        "thread/status/changed",
        "thread/tokenUsage/updated",
        "account/rateLimits/updated",
    ]
    assert methods(read).count("thread/tokenUsage/updated") == 2
    await fake.start_turn(thread_id)
    request = (await fake.until_method("item/commandExecution/requestApproval"))[-1]
    await fake.answer(request, {"decision": "cancel"})
    read = await fake.until_method("turn/completed")
    assert methods(read) == [
        "serverRequest/resolved",
        "item/completed",
        "thread/status/changed",
        "thread/tokenUsage/updated",
        "account/rateLimits/updated",
        "thread/status/changed",
        "turn/completed",
    ]


async def test_thread_methods_refuse_like_the_real_server(spawn: Spawn) -> None:
    fake, thread_id = await ready(spawn)
    fork = await fake.request("thread/fork", {"threadId": thread_id})
    assert fork["error"]["message"] == f"no rollout found for thread id {thread_id}"
    unarchive = await fake.request("thread/unarchive", {"threadId": thread_id})
    assert unarchive["error"]["message"] == f"thread {thread_id} already has an active writer"
    unknown = await fake.request("thread/unarchive", {"threadId": "x"})
    assert unknown["error"]["message"] == "no archived rollout found for thread id x"
    steer = {"threadId": "x", "expectedTurnId": "y", "input": []}
    assert (await fake.request("turn/steer", steer))["error"]["message"] == "thread not found: x"


def nested_script(levels: int) -> str:
    """A script whose `x/deep` result is `levels` lists inside each other (the document
    nests `levels` + 3 maps and lists: the script, `methods:` and `x/deep:`)."""
    return f"version: 1\nmethods:\n  x/deep: {{result: {'[' * levels}{']' * levels}}}\n"


async def test_a_script_nested_too_deep_is_refused_when_read(tmp_path: Path, spawn: Spawn) -> None:
    """A reply is one JSON line, and the JSON writer refuses to nest past about 250
    levels (and Python's recursion ends near 1,000): a script nesting more than 200 maps
    and lists is an invalid script (exit 2, with the line and column where it goes too
    deep), not a fake that crashes when the reply is due."""
    for levels in (990, 300, 198):
        deep = tmp_path / f"deep-{levels}.yaml"
        deep.write_text(nested_script(levels))
        code, out, err = await run_cli(tmp_path, "app-server", "--script", str(deep))
        assert (code, out) == (2, ""), err
        assert f"{deep}:3:217: methods.x/deep.result[0][0][0][0][0]...: nests more" in err
        assert "than 200 maps and lists inside each other" in err
        assert "Traceback" not in err
        assert "RecursionError" not in err
    # At the bound, the reply goes out whole.
    fake = await spawn(nested_script(197))
    await fake.initialize()
    result = (await fake.request("x/deep"))["result"]
    for _ in range(196):
        [result] = result
    assert result == []


#: Nine levels of nine aliases: 574 bytes that stand for 9**9 (387 million) strings.
LAUGHS = (
    "version: 1\nmethods:\n  x/a: {result: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]}\n"
    + "".join(
        f"  x/{b}: {{result: &{b} [{', '.join([f'*{a}'] * 9)}]}}\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
)


async def test_a_billion_laughs_script_is_refused_naming_the_alias(
    tmp_path: Path, spawn: Spawn
) -> None:
    """Aliases stand for 100,000 nodes at most in all, and none may sit inside the node
    it names: past that, the script is an invalid one (exit 2) before anything runs."""
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(LAUGHS)
    code, out, err = await run_cli(tmp_path, "app-server", "--script", str(laughs))
    assert (code, out) == (2, ""), err
    # The first *e (x/f, line 8, column 21) takes the count past the bound.
    assert f"{laughs}:8:21: invalid YAML: its aliases stand for more than 100000 nodes" in err
    assert "Traceback" not in err
    endless = tmp_path / "endless.yaml"
    endless.write_text("version: 1\nmethods:\n  x/a: {result: &r {self: [1, *r]}}\n")
    code, out, err = await run_cli(tmp_path, "app-server", "--script", str(endless))
    assert (code, out) == (2, ""), err
    assert f"{endless}:3:31: invalid YAML: the alias *r is inside the node &r names" in err
    # Few nodes, long strings: 300 aliases of a 10,000-character string, repeated 320
    # times, are 12 KB that stand for a gigabyte; refused by the characters they repeat.
    long = tmp_path / "long.yaml"
    many = ", ".join(["*s"] * 300)
    more = ", ".join(["*l"] * 320)
    long.write_text(
        "version: 1\nmethods:\n"
        f"  x/a: {{result: &s '{'x' * 10_000}'}}\n"
        f"  x/b: {{result: &l [{many}]}}\n"
        f"  model/list: {{result: {{data: [{more}]}}}}\n"
    )
    code, out, err = await run_cli(tmp_path, "app-server", "--script", str(long))
    assert (code, out) == (2, ""), err
    assert f"{long}:5:" in err
    assert "invalid YAML: its aliases repeat more than 4194304 characters" in err
    # Aliases within the bound are YAML as usual.
    fake = await spawn(
        "version: 1\nmethods:\n  x/a: {result: &ok {models: [a, b]}}\n  x/b: {result: *ok}\n"
    )
    await fake.initialize()
    assert (await fake.request("x/b"))["result"] == {"models": ["a", "b"]}
