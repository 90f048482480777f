"""fake-codex in place of the real binary, driven by a client this project did not write.

The client is OpenAI's own Python SDK for codex, `openai-codex` 0.163.0 (installed by
the Makefile without its 142 MB `openai-codex-cli-bin` dependency: `codex_bin` points
it at fake-codex). It launches `<codex_bin> --config k=v ... app-server --listen
stdio://`, reads the runtime version from the `initialize` userAgent, answers server
requests with its approval handler, maps JSON-RPC errors to its own exception types,
and, facing an unversioned CLI, runs `<codex_bin> --config ... app-server
generate-json-schema --experimental --out DIR` to learn which params it supports.
Every script here is handed over with the SDK's own `config_overrides`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from bridge import codex_window

FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))

if os.environ.get("CI", "").lower() == "true":
    import openai_codex  # in CI a missing SDK is a failure, not a skip
else:
    openai_codex = pytest.importorskip(
        "openai_codex", reason="openai-codex is installed by `make test` (see the Makefile)"
    )

from openai_codex import (  # noqa: E402
    AsyncCodex,
    Codex,
    CodexConfig,
    CodexError,
    CodexRpcError,
    InvalidRequestError,
    ServerBusyError,
    Thread,
    is_retryable_error,
)
from openai_codex._runtime_requirements import CheckoutCapabilities  # noqa: E402
from openai_codex.client import CodexClient  # noqa: E402

TEXT_SCRIPT = {"seed": 5, "turns": ["Hello there, world!"]}

APPROVAL_SCRIPT = """
version: 1
turns:
  - steps:
      - agentMessage: Let me create it.
      - commandApproval: {command: "touch %(proof)s", touch: "%(proof)s", output: "created\\n"}
        onReply:
          accept: [{agentMessage: "Done: the file is there."}]
          decline: [{agentMessage: "Understood, I did not run it."}]
"""


class AnyResult(BaseModel):
    """A response model that accepts any object."""

    model_config = {"extra": "allow"}


@pytest.fixture
def config(tmp_path: Path) -> Callable[..., CodexConfig]:
    """A CodexConfig launching fake-codex with `script` (a mapping or YAML text)."""
    home = tmp_path / "codex-home"
    home.mkdir()
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    counter = iter(range(1000))

    def make(script: dict[str, Any] | str) -> CodexConfig:
        path = tmp_path / f"script-{next(counter)}.yaml"
        if isinstance(script, str):
            path.write_text(script)
        else:
            path.write_text(yaml.safe_dump({"version": 1, **script}))
        return CodexConfig(
            codex_bin=FAKE_CODEX,
            # Global `--config` options before `app-server`, as the SDK puts them.
            config_overrides=(f'fake_codex.script="{path}"', 'model="gpt-6.1-sol"'),
            cwd=str(workspace),
            env={"CODEX_HOME": str(home), "FAKE_CODEX_SEED": ""},
        )

    return make


def test_the_sdk_runs_a_text_turn(config: Callable[..., CodexConfig]) -> None:
    with Codex(config(TEXT_SCRIPT)) as codex:
        assert codex.metadata.serverInfo is not None
        assert codex.metadata.serverInfo.version.startswith(f"{codex_window.PIN} ")
        thread = codex.thread_start()
        result = thread.run("Say hi")
    assert result.final_response == "Hello there, world!"
    assert result.status.value == "completed"
    assert result.usage is not None
    assert result.usage.last.total_tokens == 120
    kinds = [item.root.type for item in result.items]
    assert kinds == ["userMessage", "agentMessage"]


def test_the_sdk_streams_the_deltas_of_a_turn(config: Callable[..., CodexConfig]) -> None:
    with Codex(config(TEXT_SCRIPT)) as codex:
        handle = codex.thread_start().turn("Say hi")
        events = list(handle.stream())
    deltas = [e.payload.delta for e in events if e.method == "item/agentMessage/delta"]
    assert "".join(deltas) == "Hello there, world!"
    assert len(deltas) == 4
    assert events[-1].method == "turn/completed"


def test_the_async_sdk_runs_a_text_turn(config: Callable[..., CodexConfig]) -> None:
    import asyncio

    async def run() -> str | None:
        async with AsyncCodex(config(TEXT_SCRIPT)) as codex:
            thread = await codex.thread_start()
            return (await thread.run("Say hi")).final_response

    assert asyncio.run(run()) == "Hello there, world!"


def test_the_sdk_reads_threads_back(config: Callable[..., CodexConfig]) -> None:
    with Codex(config(TEXT_SCRIPT)) as codex:
        thread = codex.thread_start()
        thread.run("Say hi")
        thread.set_name("Greetings")
        read = thread.read(include_turns=True)
        listed = codex.thread_list()
        forked = codex.thread_fork(thread.id)
        resumed = codex.thread_resume(thread.id)
    assert read.thread.name == "Greetings"
    assert read.thread.preview == "Say hi"
    assert [item.root.type for item in read.thread.turns[0].items] == [
        "userMessage",
        "agentMessage",
    ]
    assert [t.id for t in listed.data] == [thread.id]
    assert forked.id != thread.id
    assert resumed.id == thread.id


def approval_turn(
    config: Callable[..., CodexConfig], tmp_path: Path, decision: str
) -> tuple[Any, list[tuple[str, Any]], Path]:
    """Run the approval script with an SDK client whose handler answers `decision`."""
    proof = tmp_path / "proof.txt"
    asked: list[tuple[str, Any]] = []

    def handler(method: str, params: dict[str, Any] | None) -> dict[str, Any]:
        asked.append((method, params))
        return {"decision": decision}

    with CodexClient(
        config(APPROVAL_SCRIPT % {"proof": proof}), approval_handler=handler
    ) as client:
        client.initialize()
        started = client.thread_start({"approvalPolicy": "untrusted", "approvalsReviewer": "user"})
        result = Thread(client, started.thread.id).run("Create proof.txt")
    return result, asked, proof


def test_the_sdk_approval_handler_accepts_a_command(
    config: Callable[..., CodexConfig], tmp_path: Path
) -> None:
    result, asked, proof = approval_turn(config, tmp_path, "accept")
    assert [method for method, _ in asked] == ["item/commandExecution/requestApproval"]
    params = asked[0][1]
    assert params["command"] == f"/bin/bash -lc 'touch {proof}'"
    assert params["availableDecisions"][0] == "accept"
    assert proof.exists()
    commands = [item.root for item in result.items if item.root.type == "commandExecution"]
    assert [(c.status.value, c.exit_code, c.aggregated_output) for c in commands] == [
        ("completed", 0, "created\n")
    ]
    assert result.final_response == "Done: the file is there."


def test_the_sdk_approval_handler_declines_a_command(
    config: Callable[..., CodexConfig], tmp_path: Path
) -> None:
    result, asked, proof = approval_turn(config, tmp_path, "decline")
    assert len(asked) == 1
    assert not proof.exists()
    commands = [item.root for item in result.items if item.root.type == "commandExecution"]
    assert [c.status.value for c in commands] == ["declined"]
    assert result.final_response == "Understood, I did not run it."
    assert result.status.value == "completed"


def test_the_sdk_default_handler_accepts(
    config: Callable[..., CodexConfig], tmp_path: Path
) -> None:
    proof = tmp_path / "proof.txt"
    with Codex(config(APPROVAL_SCRIPT % {"proof": proof})) as codex:
        result = codex.thread_start().run("Create proof.txt")
    assert proof.exists()
    assert result.final_response == "Done: the file is there."


def test_an_unknown_method_is_the_sdks_invalid_request_error(
    config: Callable[..., CodexConfig],
) -> None:
    with CodexClient(config(TEXT_SCRIPT)) as client:
        client.initialize()
        with pytest.raises(InvalidRequestError) as raised:
            client.request("no/such/method", {}, response_model=AnyResult)
    assert raised.value.code == -32600
    assert raised.value.message.startswith("Invalid request: unknown variant `no/such/method`")


def test_the_real_overload_error_is_a_plain_rpc_error_to_the_sdk(
    config: Callable[..., CodexConfig],
) -> None:
    # The real server's overload error carries no `data`, and the SDK only treats an
    # error as retryable when `data` says `server_overloaded`.
    script = {"methods": {"thread/start": [{"error": {"code": -32001, "message": OVERLOADED}}]}}
    with Codex(config(script)) as codex, pytest.raises(CodexRpcError) as raised:
        codex.thread_start()
    assert raised.value.code == -32001
    assert raised.value.message == OVERLOADED
    assert not isinstance(raised.value, ServerBusyError)
    assert not is_retryable_error(raised.value)


OVERLOADED = "Server overloaded; retry later."
BUSY = {"code": -32001, "message": OVERLOADED, "data": {"codex_error_info": "server_overloaded"}}


def test_an_overload_with_data_is_the_sdks_busy_error_and_is_retried(
    config: Callable[..., CodexConfig],
) -> None:
    script = {"methods": {"thread/start": [{"error": BUSY}, {"error": BUSY}, {}]}}
    with CodexClient(config(script)) as client:
        client.initialize()
        with pytest.raises(ServerBusyError):
            client.thread_start({})
        started = client.request_with_retry_on_overload(
            "thread/start", {}, response_model=AnyResult, initial_delay_s=0.01
        )
    assert started.model_dump()["thread"]["id"]


def test_the_sdk_checks_an_unversioned_cli_with_generate_json_schema(
    config: Callable[..., CodexConfig],
) -> None:
    script = {"versionOutput": "codex-cli 0.0.0", "turns": ["Checked."]}
    with Codex(config(script)) as codex:
        # `source` is a newer param: the SDK asks the CLI's schema whether it knows it.
        result = codex.thread_start().run("Go", source="sdk-test")
    assert result.final_response == "Checked."


def test_the_sdk_reads_the_runtime_version_from_the_user_agent(
    config: Callable[..., CodexConfig],
) -> None:
    # `versionOutput` sets the version the fake reports (in the initialize userAgent);
    # the SDK wants 0.151.0 or newer before it sends a newer param such as `source`.
    script = {"versionOutput": "codex-cli 0.150.0", "turns": ["Never."]}
    with Codex(config(script)) as codex:
        thread = codex.thread_start()
        with pytest.raises(CodexError, match=r"0\.151\.0 or newer is required"):
            thread.run("Go", source="sdk-test")
        assert thread.run("Go").final_response == "Never."


def test_generate_json_schema_lists_the_params_the_sdk_looks_for(tmp_path: Path) -> None:
    command = (FAKE_CODEX, "--config", 'model="x"', "app-server")
    fields = CheckoutCapabilities(command=command, cwd=str(tmp_path), env=dict(os.environ)).fields
    assert {"toolOutput", "turnTrigger", "serviceTierForTurn"} <= fields["turn/start"]
    assert "excludeTurns" in fields["thread/resume"]
    assert "excludeTurns" in fields["thread/fork"]


def sdk_fake_script() -> str:
    """The README's script that does what the SDK's own test fake does in code."""
    readme = (
        Path(__file__).resolve().parents[2] / "fakes" / "app_server" / "README.md"
    ).read_text()
    section = readme.split("### Example: the official SDK's test fake, as a script", 1)[1]
    return section.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_the_sdk_fakes_behaviours_scripted_from_a_file(
    config: Callable[..., CodexConfig],
) -> None:
    asked: list[Any] = []

    def handler(method: str, params: dict[str, Any] | None) -> dict[str, Any]:
        asked.append((method, params))
        return {"decision": "accept"}

    with CodexClient(config(sdk_fake_script()), approval_handler=handler) as client:
        client.initialize()
        thread = Thread(client, client.thread_start({}).thread.id)
        plain = thread.run("no approval")
        started = client.turn_start(thread.id, "approve", params={"requireApproval": True})
        approved = client.wait_for_turn_completed(started.turn.id)
        overloaded = client.request_with_retry_on_overload(
            "test/overload-once", {}, response_model=AnyResult, initial_delay_s=0.01
        )
        with pytest.raises(ServerBusyError) as always:
            client.request_with_retry_on_overload(
                "test/always-overload", {}, response_model=AnyResult, initial_delay_s=0.01
            )
        with pytest.raises(CodexRpcError) as unknown:
            client.request("no/such/method", {}, response_model=AnyResult)
    # Without `requireApproval` the turn streams out of order: its message completes
    # after turn/completed, so the SDK's collected result never sees it.
    assert plain.final_response is None
    assert [(method, params["command"]) for method, params in asked] == [
        ("item/commandExecution/requestApproval", "/bin/bash -lc 'echo hi'")
    ]
    assert approved.turn.status.value == "completed"
    assert approved.turn.items[0].root.text == "hello world"
    assert overloaded.model_dump() == {"ok": True}
    assert type(always.value).__name__ == "RetryLimitExceededError"
    assert (unknown.value.code, unknown.value.message) == (-32601, "unknown method no/such/method")
