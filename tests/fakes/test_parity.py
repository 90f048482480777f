"""fake-codex against the real codex: one conversation, the same messages in the same order.

The conversation: `initialize`, `initialized`, `thread/start`, a text turn, a turn whose
command approval is answered `accept`, one answered `decline`, and an unknown method.
The real codex (each release of the support window) runs it with the scripted model
(fakes/model_provider.py) playing the model; fake-codex, emulating that release, runs
it with a script that says the same things. Every
message each server sends is reduced to a token (its method, the kind of item or
status it carries, or which request a response answers), and the two token sequences
must be equal once the differences listed in TOLERATED_* are applied. The payloads'
key sets are compared too.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bridge import codex_window
from fakes.model_provider import ModelProviderServer

pytestmark = [pytest.mark.asyncio, pytest.mark.real_codex]

FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
WAIT = 60.0
# A model from codex's bundled catalogue (the fake's default model too): with an
# unknown name the real server sends a `warning` about missing model metadata on
# every turn, which would only be one more difference to tolerate.
MODEL = "gpt-6.1-sol"
CLIENT_INFO = {"name": "parity", "title": "Parity", "version": "1.0.0"}
APPROVAL = "item/commandExecution/requestApproval"

HELLO = "Hello there, world!"
AFTER_ACCEPT = "Done, the file exists."
AFTER_DECLINE = "Fine, I did not run it."


def words(text: str) -> int:
    """How many deltas the scripted model streams `text` in (one per word)."""
    return len(text.split())


MODEL_SCRIPT = [
    {"text": HELLO},
    {"execCommand": {"cmd": "touch accepted.txt"}},
    {"text": AFTER_ACCEPT},
    {"execCommand": {"cmd": "touch declined.txt"}},
    {"text": AFTER_DECLINE},
]

FAKE_SCRIPT = f"""
version: 1
turns:
  - steps: [{{agentMessage: {{text: "{HELLO}", deltas: {words(HELLO)}}}}}]
  - steps:
      - commandApproval: {{command: "touch accepted.txt", touch: "%(workspace)s/accepted.txt"}}
      - agentMessage: {{text: "{AFTER_ACCEPT}", deltas: {words(AFTER_ACCEPT)}}}
  - steps:
      - commandApproval: {{command: "touch declined.txt", touch: "%(workspace)s/declined.txt"}}
      - agentMessage: {{text: "{AFTER_DECLINE}", deltas: {words(AFTER_DECLINE)}}}
"""

#: Notifications only one side sends, for reasons outside the protocol: dropped from both.
TOLERATED_EXTRA = {
    "configWarning": (
        "real only: the real server warns, right after `initialize`, that bubblewrap is "
        "not on PATH on this machine (its sandbox falls back to a bundled copy); an "
        "environment warning, not protocol"
    ),
    "item/commandExecution/outputDelta": (
        "the command's output depends on the machine: the real server runs `bash -lc`, "
        "whose login profile may print (pyenv's `cannot rehash` warning on the machine "
        "the probes ran on), while `touch` itself prints nothing"
    ),
}
#: Messages whose position the real server does not fix: put in one canonical place.
TOLERATED_ORDER = {
    "remoteControl/status/changed": (
        "the real server emits it asynchronously right after the `initialize` response, "
        "so it can land after the client's next requests went out (NOTES.md); moved to "
        "just after the `initialize` response"
    ),
    "declined command": (
        "after a `decline`, the real server sends `item/completed` (declined) and "
        "`thread/status/changed` (active) in either order from run to run (NOTES.md); "
        "the fake sends the more common order, and the pair is compared as a set"
    ),
}


class Conversation:
    """A JSON-RPC client over a process's stdio that records everything it receives."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.received: list[dict[str, Any]] = []
        self.methods: dict[Any, str] = {}
        self.answered: set[Any] = set()
        self._arrived = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())
        self._next_id = 0

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            async with self._arrived:
                self.received.append(json.loads(line))
                self._arrived.notify_all()

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first message received (ever) that matches."""
        async with self._arrived:
            await asyncio.wait_for(
                self._arrived.wait_for(lambda: any(map(predicate, self.received))), WAIT
            )
        return next(filter(predicate, self.received))

    async def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.proc.stdin.drain()

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._next_id += 1
        request_id = self._next_id
        self.methods[request_id] = method
        await self.send({"id": request_id, "method": method, "params": params})
        return await self.wait_for(lambda m: m.get("id") == request_id and "method" not in m)

    async def turn(self, thread_id: str, text: str, decision: str | None = None) -> None:
        """A turn to its `turn/completed`, answering its command approval with `decision`."""
        count = sum(m.get("method") == "turn/completed" for m in self.received)
        reply = await self.request(
            "turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": text}]}
        )
        assert "result" in reply, reply
        if decision is not None:
            request = await self.wait_for(
                lambda m: m.get("method") == APPROVAL and "id" in m and m["id"] not in self.answered
            )
            self.answered.add(request["id"])
            await self.send({"id": request["id"], "result": {"decision": decision}})
        async with self._arrived:
            await asyncio.wait_for(
                self._arrived.wait_for(
                    lambda: sum(m.get("method") == "turn/completed" for m in self.received) > count
                ),
                WAIT,
            )

    async def finish(self) -> int:
        """Close stdin; wait for the exit and the last messages."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        code = await asyncio.wait_for(self.proc.wait(), WAIT)
        await asyncio.wait_for(self._reader, WAIT)
        return code


async def converse(command: list[str], workspace: Path, env: dict[str, str]) -> Conversation:
    """Run the whole conversation against `command`."""
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=workspace,
        env=env,
        limit=1 << 24,
    )
    talk = Conversation(proc)
    try:
        await _converse(talk, workspace)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return talk


async def _converse(talk: Conversation, workspace: Path) -> None:
    """The conversation itself, on whichever transport `talk` speaks."""
    assert "result" in await talk.request("initialize", {"clientInfo": CLIENT_INFO})
    await talk.send({"method": "initialized"})
    started = await talk.request(
        "thread/start",
        {"cwd": str(workspace), "approvalPolicy": "untrusted", "sandbox": "workspace-write"},
    )
    thread_id = started["result"]["thread"]["id"]
    await talk.turn(thread_id, "Say hi")
    await talk.turn(thread_id, "Create accepted.txt", "accept")
    await talk.turn(thread_id, "Create declined.txt", "decline")
    assert "error" in await talk.request("no/such/method", {})
    assert await talk.finish() == 0


def token(message: dict[str, Any], methods: dict[Any, str]) -> str:
    """What a message is, without the values that always differ (ids, times, texts)."""
    if "method" not in message:
        outcome = "error" if "error" in message else "result"
        return f"{outcome} of {methods.get(message.get('id'), '?')}"
    method = message["method"]
    params = message.get("params") or {}
    if "id" in message:
        return f"request {method}"
    if method in ("item/started", "item/completed"):
        item = params["item"]
        return f"{method} {item['type']} {item.get('status', '')}".rstrip()
    if method == "thread/status/changed":
        status = params["status"]
        return f"{method} {status['type']} {','.join(status.get('activeFlags', []))}".rstrip()
    if method == "turn/completed":
        return f"{method} {params['turn']['status']}"
    return str(method)


def shape(message: dict[str, Any]) -> list[str]:
    """The keys a message carries: of its payload, and of the item it carries."""
    payload = message.get("params", message.get("result", message.get("error")))
    keys = list(payload) if isinstance(payload, dict) else []
    item = payload.get("item") if isinstance(payload, dict) else None
    if isinstance(item, dict):
        keys += [f"item.{key}" for key in item]
    return keys


def normalized(talk: Conversation) -> list[tuple[str, list[str]]]:
    """The conversation as (token, shape) pairs, with the tolerated differences applied."""
    pairs = [
        (token(message, talk.methods), shape(message))
        for message in talk.received
        if message.get("method") not in TOLERATED_EXTRA
    ]
    # `remoteControl/status/changed` goes right after the initialize response.
    announced = [pair for pair in pairs if pair[0] == "remoteControl/status/changed"]
    pairs = [pair for pair in pairs if pair[0] != "remoteControl/status/changed"]
    at = next(i for i, pair in enumerate(pairs) if pair[0] == "result of initialize") + 1
    pairs[at:at] = announced
    # A declined command's completion and the thread going active again: one order.
    for i in range(len(pairs) - 1):
        first, second = pairs[i][0], pairs[i + 1][0]
        if (first, second) == (
            "thread/status/changed active",
            "item/completed commandExecution declined",
        ):
            pairs[i], pairs[i + 1] = pairs[i + 1], pairs[i]
    # The real codex answers `turn/start` while the turn starts, so its result comes
    # before, between or after the thread going active and `turn/started` (seen in about
    # one run in ten on a busy machine): one order, the result first.
    for i, pair in enumerate(pairs):
        if pair[0] == "result of turn/start":
            while i > 0 and pairs[i - 1][0] in TURN_START_NOTIFICATIONS:
                pairs[i - 1], pairs[i] = pairs[i], pairs[i - 1]
                i -= 1
    return pairs


def emulating(codex_version: str) -> list[str]:
    """The fake's option to emulate the release of the real codex it is compared with
    (each test runs once per release of the window)."""
    release = codex_window.release(codex_version)
    return [] if release is None else ["--codex-version", release]


#: What the real codex sends as a turn starts, in any order against `turn/start`'s result.
TURN_START_NOTIFICATIONS = frozenset({"thread/status/changed active", "turn/started"})


async def test_the_fake_says_what_the_real_codex_says(
    codex_bin: str, codex_version: str, tmp_path: Path
) -> None:
    real_dir, fake_dir = tmp_path / "real", tmp_path / "fake"
    runs: dict[str, list[tuple[str, list[str]]]] = {}
    for workspace in (real_dir, fake_dir):
        (workspace / "home").mkdir(parents=True)
        (workspace / "work").mkdir()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("CODEX_", "FAKE_CODEX"))}

    async with ModelProviderServer(MODEL_SCRIPT) as model:
        env = {**base_env, "CODEX_HOME": str(real_dir / "home"), "OPENAI_API_KEY": "x"}
        command = [codex_bin, "app-server", *model.codex_cli_args(model=MODEL)]
        real = await converse(command, real_dir / "work", env)
        assert len(model.requests) == len(MODEL_SCRIPT)
    assert (real_dir / "work" / "accepted.txt").exists()
    assert not (real_dir / "work" / "declined.txt").exists()
    runs["real"] = normalized(real)

    script = fake_dir / "script.yaml"
    script.write_text(FAKE_SCRIPT % {"workspace": fake_dir / "work"})
    env = {**base_env, "CODEX_HOME": str(fake_dir / "home")}
    fake = await converse(
        [FAKE_CODEX, "app-server", "--script", str(script), *emulating(codex_version)],
        fake_dir / "work",
        env,
    )
    assert (fake_dir / "work" / "accepted.txt").exists()
    assert not (fake_dir / "work" / "declined.txt").exists()
    runs["fake"] = normalized(fake)

    tokens = {name: [pair[0] for pair in pairs] for name, pairs in runs.items()}
    diff = "\n".join(difflib.unified_diff(tokens["real"], tokens["fake"], "real", "fake", n=2))
    assert tokens["fake"] == tokens["real"], f"the message sequences differ:\n{diff}"
    shapes = [
        f"{real_token}: real {real_keys} / fake {fake_keys}"
        for (real_token, real_keys), (_, fake_keys) in zip(runs["real"], runs["fake"], strict=True)
        if real_keys != fake_keys
    ]
    assert shapes == [], "payload keys differ:\n" + "\n".join(shapes)


class SocketConversation(Conversation):
    """The same client over one WebSocket connection to a `--listen unix://` server."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.received = []
        self.methods = {}
        self.answered = set()
        self._arrived = asyncio.Condition()
        self._next_id = 0
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for frame in self.ws:
            if frame.type == aiohttp.WSMsgType.TEXT:
                async with self._arrived:
                    self.received.append(json.loads(frame.data))
                    self._arrived.notify_all()

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(message))

    async def finish(self) -> int:
        await self.ws.close()
        await asyncio.wait_for(self._reader, WAIT)
        return 0


def _accepts(link: Path) -> bool:
    """Whether the socket `link` points to accepts connections."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(os.readlink(link))
        except OSError:
            return False
    return True


async def converse_over_socket(
    command: list[str], workspace: Path, env: dict[str, str]
) -> Conversation:
    """Run the whole conversation over `command --listen unix://...`, then stop it."""
    link = workspace.parent / "app.sock"
    proc = await asyncio.create_subprocess_exec(
        *command,
        "--listen",
        f"unix://{link}",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=workspace,
        env=env,
    )
    try:
        async with asyncio.timeout(WAIT):
            while not _accepts(link):  # noqa: ASYNC110 (nothing announces the socket)
                await asyncio.sleep(0.02)  # sync-ok: polled, see above
        connector = aiohttp.UnixConnector(path=os.readlink(link))
        async with aiohttp.ClientSession(connector=connector) as session:
            ws = await session.ws_connect("http://localhost/", max_msg_size=1 << 24)
            talk = SocketConversation(ws)
            await _converse(talk, workspace)
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), WAIT) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return talk


async def test_the_fake_says_what_the_real_codex_says_over_a_unix_socket(
    codex_bin: str, codex_version: str, tmp_path: Path
) -> None:
    real_dir, fake_dir = tmp_path / "real", tmp_path / "fake"
    for workspace in (real_dir, fake_dir):
        (workspace / "home").mkdir(parents=True)
        (workspace / "work").mkdir()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("CODEX_", "FAKE_CODEX"))}
    async with ModelProviderServer(MODEL_SCRIPT) as model:
        env = {**base_env, "CODEX_HOME": str(real_dir / "home"), "OPENAI_API_KEY": "x"}
        command = [codex_bin, "app-server", *model.codex_cli_args(model=MODEL)]
        real = await converse_over_socket(command, real_dir / "work", env)
    assert (real_dir / "work" / "accepted.txt").exists()
    script = fake_dir / "script.yaml"
    script.write_text(FAKE_SCRIPT % {"workspace": fake_dir / "work"})
    env = {**base_env, "CODEX_HOME": str(fake_dir / "home")}
    fake = await converse_over_socket(
        [FAKE_CODEX, "app-server", "--script", str(script), *emulating(codex_version)],
        fake_dir / "work",
        env,
    )
    assert (fake_dir / "work" / "accepted.txt").exists()
    tokens = {
        name: [pair[0] for pair in normalized(talk)]
        for name, talk in (("real", real), ("fake", fake))
    }
    diff = "\n".join(difflib.unified_diff(tokens["real"], tokens["fake"], "real", "fake", n=2))
    assert tokens["fake"] == tokens["real"], f"the message sequences differ:\n{diff}"
