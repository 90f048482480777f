"""Made-up content is realistic and varied, and a seed makes a whole run reproducible.

With a seed (`FAKE_CODEX_SEED` or the script's `seed:`) every byte fake-codex writes is
a function of the seed and the conversation: ids, generated text, commands and paths,
and the timestamps, which then come from a seeded virtual clock.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.asyncio

FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
TIMEOUT = 20.0

# Everything left out is made up: texts, the command, the file path.
SCRIPT = """
version: 1
turns:
  - steps:
      - agentMessage: {}
      - commandApproval: {}
      - agentMessage: {sentences: 2}
  - steps:
      - fileChangeApproval: {content: "print('hi')\\n"}
      - agentMessage: {}
"""
UUID7 = r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


async def run(tmp_path: Path, seed: str, *, via: str = "env") -> list[bytes]:
    """A fixed conversation with the fake; every stdout line, byte for byte."""
    script = tmp_path / f"script-{via}.yaml"
    script.write_text(SCRIPT if via == "env" else f"seed: {seed}\n{SCRIPT}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CODEX")}
    env["CODEX_HOME"] = str(tmp_path / "codex-home")
    if via == "env":
        env["FAKE_CODEX_SEED"] = seed
    proc = await asyncio.create_subprocess_exec(
        FAKE_CODEX,
        "app-server",
        "--script",
        str(script),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    lines: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(message).encode() + b"\n")
        await proc.stdin.drain()

    async def until(predicate: Any) -> dict[str, Any]:
        while True:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)
            assert line, "fake-codex closed stdout"
            lines.append(line)
            message = json.loads(line)
            if "method" in message and "id" in message:
                await send({"id": message["id"], "result": {"decision": "accept"}})
            if predicate(message):
                return message

    async def request(request_id: int, method: str, params: dict[str, Any]) -> dict[str, Any]:
        await send({"id": request_id, "method": method, "params": params})
        return await until(lambda m: m.get("id") == request_id and "method" not in m)

    await request(1, "initialize", {"clientInfo": {"name": "seeded", "version": "1"}})
    await send({"method": "initialized"})
    await until(lambda m: m.get("method") == "remoteControl/status/changed")
    started = await request(2, "thread/start", {"cwd": str(tmp_path)})
    thread_id = started["result"]["thread"]["id"]
    for number in (3, 4, 5):
        params = {"threadId": thread_id, "input": [{"type": "text", "text": f"turn {number}"}]}
        await request(number, "turn/start", params)
        await until(lambda m: m.get("method") == "turn/completed")
    await request(6, "thread/read", {"threadId": thread_id, "includeTurns": True})
    proc.stdin.close()
    lines += (await asyncio.wait_for(proc.stdout.read(), TIMEOUT)).splitlines(keepends=True)
    assert await asyncio.wait_for(proc.wait(), TIMEOUT) == 0
    return lines


async def test_one_seed_gives_identical_runs_and_another_seed_a_different_one(
    tmp_path: Path,
) -> None:
    first = await run(tmp_path, "1234")
    again = await run(tmp_path, "1234")
    from_script = await run(tmp_path, "1234", via="script")
    other = await run(tmp_path, "99")
    assert first == again
    assert from_script == first
    assert other != first
    assert len(other) == len(first)
    differing = sum(a != b for a, b in zip(first, other, strict=True))
    assert differing > len(first) // 2


async def test_made_up_content_looks_real(tmp_path: Path) -> None:
    messages = [json.loads(line) for line in await run(tmp_path, "7")]
    items = [m["params"]["item"] for m in messages if m.get("method") == "item/completed"]
    commands = [i for i in items if i["type"] == "commandExecution"]
    changes = [i for i in items if i["type"] == "fileChange"]
    agent = [i for i in items if i["type"] == "agentMessage"]
    users = [i for i in items if i["type"] == "userMessage"]

    assert all(re.fullmatch(UUID7, item["id"]) for item in users)
    assert all(re.fullmatch(r"msg_[0-9a-f]{48}", item["id"]) for item in agent)
    assert all(re.fullmatch(r"call_[0-9A-Za-z]{24}", item["id"]) for item in commands + changes)
    assert len({item["id"] for item in items}) == len(items)
    # Texts are sentences, and differ from one message to the next (the last turn is
    # the unscripted default one, which echoes the input).
    texts = [item["text"] for item in agent]
    assert texts.pop() == "Hello from fake-codex. You said: turn 5"
    assert len(set(texts)) == len(texts) == 3
    assert all(re.fullmatch(r"[A-Z][^.]*\.( [A-Z][^.]*\.)*", text) for text in texts)
    # The command is a plausible shell command, shown wrapped the way codex runs it.
    (command,) = commands
    assert command["command"].startswith("/bin/bash -lc ")
    assert command["commandActions"][0]["command"].split()[0] in {
        "ls", "cat", "sed", "rg", "pytest", "git", "wc", "python", "mkdir", "head", "npm", "find"
    }  # fmt: skip
    assert re.fullmatch(r"\d{4,5}", command["processId"])
    # The path is a file under the thread's directory.
    (change,) = changes
    path = change["changes"][0]["path"]
    assert path.startswith(f"{tmp_path}/")
    assert re.fullmatch(r"[a-z]+/[a-z]+_[a-z]+\.[a-z]+", path[len(str(tmp_path)) + 1 :])
    # Seeded time: 2026 onwards, never going backwards.
    stamps = [m["emittedAtMs"] for m in messages if "emittedAtMs" in m]
    assert stamps == sorted(stamps)
    assert 1_767_225_600_000 <= stamps[0] < stamps[-1] < 1_767_225_600_000 + 86_400_000


async def test_without_a_seed_runs_differ(tmp_path: Path) -> None:
    first = await run(tmp_path, "")
    second = await run(tmp_path, "")
    assert first != second
