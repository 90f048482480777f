"""The scripted model speaks the Responses streaming API that codex reads."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from pydantic import ValidationError

from fakes.app_server.script_source import ScriptError
from fakes.model_provider import (
    ExecCommandReply,
    ModelProviderServer,
    ModelScript,
    ScriptedModel,
    StallReply,
    TextReply,
)

REPO = Path(__file__).resolve().parents[2]
PROMPT = {"model": "gpt-fake", "stream": True, "input": [{"type": "message", "role": "user"}]}


async def read_sse(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Yield each event's data, checking that `event:` names the data's `type`."""
    name: str | None = None
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert data["type"] == name
            yield data


async def events_of(response: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    return [event async for event in read_sse(response)]


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    http: aiohttp.ClientSession, server: ModelProviderServer, **headers: str
) -> aiohttp.ClientResponse:
    return await http.post(f"{server.base_url}/responses", json=PROMPT, headers=headers)


# --- streaming -------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.asyncio
async def test_text_reply_streams_deltas_between_item_added_and_done(http):
    async with ModelProviderServer([{"text": "Hello there, world!"}]) as server:
        response = await post(http, server)
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        events = await events_of(response)

    kinds = [event["type"] for event in events]
    assert kinds == [
        "response.created",
        "response.output_item.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [event["delta"] for event in events if event["type"].endswith(".delta")]
    assert "".join(deltas) == "Hello there, world!"
    item = events[-2]["item"]
    assert item["type"] == "message"
    assert item["role"] == "assistant"
    assert item["id"] == events[1]["item"]["id"]
    assert item["content"] == [{"type": "output_text", "text": "Hello there, world!"}]


@pytest.mark.quick
@pytest.mark.asyncio
async def test_completed_response_carries_its_id_and_usage(http):
    async with ModelProviderServer([{"text": "hi"}]) as server:
        events = await events_of(await post(http, server))

    created, completed = events[0]["response"], events[-1]["response"]
    assert completed["id"] == created["id"]
    assert completed["status"] == "completed"
    usage = completed["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.quick
@pytest.mark.asyncio
async def test_exec_command_reply_is_a_function_call_with_json_arguments(http):
    script = [
        {"execCommand": {"cmd": "touch f", "workdir": "/tmp/w"}},
        {"execCommand": {"cmd": "ls"}},
    ]
    async with ModelProviderServer(script) as server:
        first = await events_of(await post(http, server))
        second = await events_of(await post(http, server))

    assert [event["type"] for event in first] == [
        "response.created",
        "response.output_item.done",
        "response.completed",
    ]
    call = first[1]["item"]
    assert call["type"] == "function_call"
    assert call["name"] == "exec_command"
    assert call["call_id"]
    assert json.loads(call["arguments"]) == {"cmd": "touch f", "workdir": "/tmp/w"}
    assert json.loads(second[1]["item"]["arguments"]) == {"cmd": "ls"}
    assert second[1]["item"]["call_id"] != call["call_id"]


@pytest.mark.quick
@pytest.mark.asyncio
async def test_function_call_reply_calls_any_tool_by_name_and_namespace(http):
    script = [
        {"functionCall": {"name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": {}}},
        {"functionCall": {"name": "view_image", "arguments": {"path": "a.png"}}},
    ]
    async with ModelProviderServer(script) as server:
        first = await events_of(await post(http, server))
        second = await events_of(await post(http, server))
    spawn, view = first[1]["item"], second[1]["item"]
    assert (spawn["type"], spawn["name"], spawn["namespace"]) == (
        "function_call",
        "spawn_agent",
        "multi_agent_v1",
    )
    assert json.loads(spawn["arguments"]) == {}
    assert "namespace" not in view
    assert json.loads(view["arguments"]) == {"path": "a.png"}
    assert first[-1]["type"] == "response.completed"


@pytest.mark.quick
@pytest.mark.asyncio
async def test_exhausted_script_answers_with_the_default_text(http):
    script = ModelScript(replies=[TextReply(text="first")], default_text="fallback")
    async with ModelProviderServer(script) as server:
        await events_of(await post(http, server))
        events = await events_of(await post(http, server))

    assert events[-2]["item"]["content"][0]["text"] == "fallback"


@pytest.mark.quick
@pytest.mark.asyncio
async def test_http_error_reply_answers_with_its_status_and_json_body(http):
    body = {"error": {"message": "bad thing", "type": "invalid_request_error"}}
    async with ModelProviderServer([{"httpError": {"status": 400, "body": body}}]) as server:
        response = await post(http, server)
        assert response.status == 400
        assert await response.json() == body


@pytest.mark.quick
@pytest.mark.asyncio
async def test_http_error_reply_sends_a_string_body_as_text(http):
    async with ModelProviderServer([{"httpError": {"status": 503, "body": "busy"}}]) as server:
        response = await post(http, server)
        assert response.status == 503
        assert await response.text() == "busy"


@pytest.mark.quick
@pytest.mark.asyncio
async def test_disconnect_reply_cuts_the_stream_before_completed(http):
    script = [{"disconnect": True, "partialText": "partial words"}, {"text": "after"}]
    async with ModelProviderServer(script) as server:
        received: list[str] = []

        async def read_all() -> None:
            async with http.post(f"{server.base_url}/responses", json=PROMPT) as response:
                async for event in read_sse(response):
                    received.append(event["type"])

        with pytest.raises(aiohttp.ClientPayloadError):
            await read_all()
        retry = await events_of(await post(http, server))

    assert received[0] == "response.created"
    assert "response.output_text.delta" in received
    assert "response.completed" not in received
    assert retry[-1]["type"] == "response.completed"


@pytest.mark.quick
@pytest.mark.asyncio
async def test_stall_reply_holds_the_stream_until_the_server_stops(http):
    server = ModelProviderServer([StallReply(stall=True)])
    await server.start()
    async with http.post(f"{server.base_url}/responses", json=PROMPT) as response:
        events = read_sse(response)
        try:
            first = await anext(events)
        finally:
            await server.close()
        with pytest.raises(aiohttp.ClientPayloadError):
            await anext(events)

    assert first["type"] == "response.created"


# --- recording -------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.asyncio
async def test_requests_are_recorded_with_parsed_body_and_without_authorization(http):
    async with ModelProviderServer([{"text": "hi"}]) as server:
        await events_of(await post(http, server, Authorization="Bearer x", Originator="probe"))
        (request,) = server.requests

    assert request.method == "POST"
    assert request.path == "/v1/responses"
    assert request.body == PROMPT
    assert request.headers["originator"] == "probe"
    assert "authorization" not in request.headers


@pytest.mark.quick
@pytest.mark.asyncio
async def test_function_call_outputs_are_picked_from_the_recorded_input(http):
    output = {"type": "function_call_output", "call_id": "call_1", "output": "ok"}
    body = {**PROMPT, "input": [*PROMPT["input"], output]}
    async with ModelProviderServer() as server:
        await events_of(await http.post(f"{server.base_url}/responses", json=body))

    assert server.requests[0].function_call_outputs() == [output]


@pytest.mark.quick
@pytest.mark.asyncio
async def test_unknown_paths_get_404_and_are_recorded(http):
    async with ModelProviderServer() as server:
        response = await http.get(f"{server.base_url}/models")
        assert response.status == 404
        assert [(r.method, r.path) for r in server.requests] == [("GET", "/v1/models")]


@pytest.mark.quick
@pytest.mark.asyncio
async def test_wait_for_requests_returns_once_enough_arrived(http):
    async with ModelProviderServer() as server:
        waiting = asyncio.ensure_future(server.wait_for_requests(1))
        await events_of(await post(http, server))
        requests = await waiting

    assert len(requests) == 1


@pytest.mark.quick
@pytest.mark.asyncio
async def test_replies_added_while_running_are_played_after_the_script(http):
    model = ScriptedModel([{"text": "one"}])
    async with ModelProviderServer(model) as server:
        model.add({"text": "two"})
        await events_of(await post(http, server))
        events = await events_of(await post(http, server))

    assert events[-2]["item"]["content"][0]["text"] == "two"
    assert model.pending == ()


# --- scripts ---------------------------------------------------------------------------


@pytest.mark.quick
def test_script_loads_from_a_yaml_mapping():
    script = ModelScript.from_yaml(
        """
        defaultText: bye
        replies:
          - text: hello
          - execCommand: {cmd: touch f}
          - httpError: {status: 500}
          - disconnect: true
          - stall: true
        """
    )

    assert script.default_text == "bye"
    assert [type(reply).__name__ for reply in script.replies] == [
        "TextReply",
        "ExecCommandReply",
        "HttpErrorReply",
        "DisconnectReply",
        "StallReply",
    ]
    assert isinstance(script.replies[1], ExecCommandReply)
    assert script.replies[1].exec_command.cmd == "touch f"


@pytest.mark.quick
def test_script_loads_from_a_bare_yaml_list():
    script = ModelScript.from_yaml("- text: a\n- text: b\n")

    assert script.replies == [TextReply(text="a"), TextReply(text="b")]


@pytest.mark.quick
def test_script_rejects_unknown_fields():
    with pytest.raises(ValidationError):
        ModelScript.from_yaml("- text: a\n  colour: red\n")


@pytest.mark.quick
def test_script_rejects_a_reply_of_no_known_kind():
    with pytest.raises(ValidationError, match="a reply needs one of"):
        ModelScript.from_yaml("- sing: loudly\n")


# --- pointing codex at it --------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.asyncio
async def test_codex_overrides_point_the_fake_provider_at_the_server():
    async with ModelProviderServer() as server:
        overrides = server.codex_config_overrides()
        base_url = server.base_url

    assert base_url.startswith("http://127.0.0.1:")
    assert base_url.endswith("/v1")
    assert overrides == [
        'model_provider="fake"',
        'model_providers.fake.name="fake"',
        f'model_providers.fake.base_url="{base_url}"',
        'model_providers.fake.wire_api="responses"',
        'model_providers.fake.env_key="OPENAI_API_KEY"',
        "model_providers.fake.request_max_retries=0",
        "model_providers.fake.stream_max_retries=0",
        'model="gpt-fake"',
    ]


@pytest.mark.quick
@pytest.mark.asyncio
async def test_codex_overrides_can_keep_codex_retry_policy():
    async with ModelProviderServer() as server:
        overrides = server.codex_config_overrides(max_retries=None)
        args = server.codex_cli_args(max_retries=None)

    assert not any("max_retries" in item for item in overrides)
    assert args[0::2] == ["-c"] * len(overrides)
    assert args[1::2] == overrides


@pytest.mark.asyncio
async def test_cli_serves_a_yaml_script(tmp_path, http):
    script = tmp_path / "script.yaml"
    script.write_text("- text: from the cli\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fakes.model_provider",
        "--port",
        "0",
        "--script",
        str(script),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        banner = (await process.stdout.readline()).decode()
        base_url = banner.rsplit(" ", 1)[-1].strip()
        response = await http.post(f"{base_url}/responses", json=PROMPT)
        events = await events_of(response)
    finally:
        process.terminate()
        await process.wait()

    assert events[-2]["item"]["content"][0]["text"] == "from the cli"


# --- against the real codex ------------------------------------------------------------


class AppServer:
    """Just enough JSON-RPC over stdio to drive `codex app-server` through a turn."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.notifications: list[dict[str, Any]] = []
        self._ids = iter(range(1, 1_000_000))

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        await self.process.stdin.drain()

    async def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await self.process.stdout.readline()
        assert line, "codex app-server closed its stdout"
        message: dict[str, Any] = json.loads(line)
        return message

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        request_id = next(self._ids)
        await self.send({"id": request_id, "method": method, "params": params})
        while True:
            message = await self.receive()
            if message.get("id") == request_id and "method" not in message:
                assert "error" not in message, message
                result: dict[str, Any] = message["result"]
                return result
            self.notifications.append(message)

    async def until(self, method: str) -> dict[str, Any]:
        """Read until a message with `method`, keeping the notifications seen on the way."""
        while True:
            message = await self.receive()
            self.notifications.append(message)
            if message.get("method") == method:
                return message

    def methods(self) -> list[str]:
        return [m["method"] for m in self.notifications if "method" in m]


@pytest_asyncio.fixture
async def codex_app_server(tmp_path, codex_bin) -> AsyncIterator[Any]:
    binary = codex_bin

    async def start(server: ModelProviderServer) -> AppServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CODEX_", "OPENAI_"))}
        env.update(CODEX_HOME=str(tmp_path / "home"), OPENAI_API_KEY="x")
        (tmp_path / "home").mkdir()
        (tmp_path / "work").mkdir()
        process = await asyncio.create_subprocess_exec(
            str(binary),
            "app-server",
            *server.codex_cli_args(),
            env=env,
            cwd=tmp_path / "work",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        started.append(process)
        app = AppServer(process)
        await app.request(
            "initialize", {"clientInfo": {"name": "tests", "title": "Tests", "version": "0"}}
        )
        await app.send({"method": "initialized"})
        return app

    started: list[asyncio.subprocess.Process] = []
    yield start
    for process in started:
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()


@pytest.mark.real_codex
@pytest.mark.asyncio
async def test_real_codex_streams_a_scripted_text_turn(codex_app_server, tmp_path):
    async with ModelProviderServer([{"text": "Hello from the script."}]) as server:
        app = await codex_app_server(server)
        thread = await app.request("thread/start", {"cwd": str(tmp_path / "work")})
        await app.request(
            "turn/start",
            {"threadId": thread["thread"]["id"], "input": [{"type": "text", "text": "Say hi"}]},
        )
        completed = await app.until("turn/completed")

    deltas = [
        m["params"]["delta"]
        for m in app.notifications
        if m.get("method") == "item/agentMessage/delta"
    ]
    assert deltas == ["Hello ", "from ", "the ", "script."]
    turn = completed["params"]["turn"]
    assert turn["status"] == "completed"
    assert turn["items"][-1]["type"] == "agentMessage"
    assert turn["items"][-1]["text"] == "Hello from the script."
    (request,) = server.requests
    assert request.body["stream"] is True
    assert request.body["model"] == "gpt-fake"
    user_texts = [
        part["text"]
        for item in request.input
        if item.get("role") == "user"
        for part in item["content"]
    ]
    assert user_texts[-1] == "Say hi"


@pytest.mark.real_codex
@pytest.mark.asyncio
async def test_real_codex_runs_an_approved_command_and_returns_its_output(
    codex_app_server, tmp_path
):
    script = [{"execCommand": {"cmd": "touch made-by-codex"}}, {"text": "Touched."}]
    async with ModelProviderServer(script) as server:
        app = await codex_app_server(server)
        thread = await app.request(
            "thread/start",
            {
                "cwd": str(tmp_path / "work"),
                "approvalPolicy": "untrusted",
                # Under the default read-only sandbox an approved `touch` sometimes runs
                # sandboxed and fails: workspace-write makes the outcome deterministic.
                "sandbox": "workspace-write",
            },
        )
        await app.request(
            "turn/start",
            {"threadId": thread["thread"]["id"], "input": [{"type": "text", "text": "touch"}]},
        )
        approval = await app.until("item/commandExecution/requestApproval")
        await app.send({"id": approval["id"], "result": {"decision": "accept"}})
        completed = await app.until("turn/completed")

    print(json.dumps(app.notifications, indent=1)[-6000:])
    print(server.requests[1].function_call_outputs())
    assert "touch made-by-codex" in approval["params"]["command"]
    assert (tmp_path / "work" / "made-by-codex").exists()
    assert completed["params"]["turn"]["status"] == "completed"
    assert len(server.requests) == 2
    (output,) = server.requests[1].function_call_outputs()
    assert "exited with code 0" in output["output"]


@pytest.mark.real_codex
@pytest.mark.asyncio
async def test_the_readme_example_runs_a_scripted_text_turn_through_the_bridge(
    codex_bin, tmp_path, http
):
    """README.md, "The scripted model endpoint": the CLI serves the script and prints the
    `-c` arguments (`--print-codex-args` prints the same), and `rest-bridge serve` with
    them runs the real codex through a text turn offline."""
    script = tmp_path / "replies.yaml"
    script.write_text("replies:\n  - text: Hello from the scripted model.\n")
    model = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fakes.model_provider", "--port", "0", "--script", str(script),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    bridge = None
    try:
        assert model.stdout is not None
        banner = (await model.stdout.readline()).decode().strip()
        printed = (await model.stdout.readline()).decode().strip()
        port = banner.rsplit(":", 1)[1].removesuffix("/v1")
        done = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fakes.model_provider", "--port", port, "--print-codex-args",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await done.communicate()
        assert out.decode().strip() == printed
        home = tmp_path / "codex-home"
        home.mkdir()
        app_server = f"env CODEX_HOME={home} OPENAI_API_KEY=unused {codex_bin} app-server {printed}"
        bridge = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("rest-bridge")), "serve", "--port", "0",
            "--app-server", app_server,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        assert bridge.stdout is not None
        async with asyncio.timeout(60):
            listening = (await bridge.stdout.readline()).decode()
        base = listening.rsplit(" ", 1)[1].strip()
        response = await http.post(f"{base}/v1/text-turn", json={"text": "hi"})
        body = await response.json()
    finally:
        for process in (bridge, model):
            if process is not None and process.returncode is None:
                process.terminate()
                await process.wait()
    assert response.status == 200, body
    assert (body["text"], body["status"]) == ("Hello from the scripted model.", "completed")


@pytest.mark.quick
def test_script_refuses_aliases_that_stand_for_a_billion_replies():
    levels = "".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    laughs = "a: &a [{text: lol}]\n" + levels + "replies: *i\n"
    with pytest.raises(ScriptError, match=r"^the model script:6:16: invalid YAML: its aliases"):
        ModelScript.from_yaml(laughs)


@pytest.mark.asyncio
async def test_the_real_codex_offline_in_one_command_keeps_its_files_to_itself(
    codex_bin: str, tmp_path: Path
) -> None:
    """`--bridge CODEX` (what `make serve-codex-offline` runs): the bridge on the real codex
    behind the scripted model answers a text turn with no credentials and no network; codex
    keeps its files (rollouts, logs) in a CODEX_HOME of its own, not under $HOME/.codex,
    removed once the bridge is stopped."""
    home = tmp_path / "home"
    home.mkdir()
    script = tmp_path / "model.yaml"
    script.write_text("replies:\n  - text: Hello from the scripted model.\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "fakes.model_provider", "--script", str(script)),
        *("--bridge", codex_bin, "--", "--port", "0"),
        stdout=asyncio.subprocess.PIPE,
        cwd=tmp_path,
        env={**env, "HOME": str(home)},
    )
    assert process.stdout is not None
    try:
        said = (await process.stdout.readline()).decode()
        codex_home = Path(said.split("CODEX_HOME=")[1].split()[0])
        assert await asyncio.to_thread(codex_home.is_dir), said
        while not (line := (await process.stdout.readline()).decode()).startswith("rest-bridge"):
            assert line, "the bridge ended before it listened"
        url = line.split("listening on ")[1].strip()
        async with (
            aiohttp.ClientSession() as client,
            client.post(f"{url}/v1/text-turn", json={"text": "hi"}) as response,
        ):
            body = await response.json()
        assert response.status == 200, body
        assert body["text"] == "Hello from the scripted model."
        rollouts = await asyncio.to_thread(lambda: list(codex_home.rglob("rollout-*.jsonl")))
        assert rollouts, "no rollout in its CODEX_HOME"
    finally:
        if process.returncode is None:
            process.terminate()
        code = await process.wait()
    assert code == 0
    assert not await asyncio.to_thread(codex_home.exists)
    assert not await asyncio.to_thread((home / ".codex").exists)
