"""`$FAKE_CODEX_REPORT`: what a fake-codex process reports of its run, for harnesses."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
SCRIPT = """
version: 1
methods:
  x/a: [{result: 1}, {result: 2}]
  x/b: {result: 3}
  x/ask:
    steps: [{request: {method: item/tool/requestUserInput, params: {questions: []}}}]
    result: {}
turns:
  - steps: [{request: {method: item/tool/call}}]
  - Never started.
"""

pytestmark = pytest.mark.asyncio


class Client:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.next_id = 100

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        await self.process.stdin.drain()

    async def until(self, predicate) -> dict[str, Any]:
        assert self.process.stdout is not None
        async with asyncio.timeout(10):
            while True:
                message = json.loads(await self.process.stdout.readline())
                if predicate(message):
                    return message

    async def call(self, method: str, params: Any) -> dict[str, Any]:
        self.next_id += 1
        request_id = self.next_id
        await self.send({"id": request_id, "method": method, "params": params})
        return await self.until(lambda m: m.get("id") == request_id and "method" not in m)


async def test_the_report_tells_what_was_used_answered_dropped_and_said(tmp_path: Path) -> None:
    script = tmp_path / "script.yaml"
    script.write_text(SCRIPT)
    reports = tmp_path / "reports"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CODEX_")}
    env["FAKE_CODEX_REPORT"] = str(reports)
    process = await asyncio.create_subprocess_exec(
        FAKE_CODEX,
        "app-server",
        "--script",
        str(script),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    client = Client(process)
    await client.call("initialize", {"clientInfo": {"name": "t", "version": "1"}})
    await client.send({"method": "initialized"})
    assert (await client.call("x/a", {}))["result"] == 1
    # x/ask waits on a server request: answer it.
    await client.send({"id": 1, "method": "x/ask", "params": {}})
    asked = await client.until(lambda m: m.get("method") == "item/tool/requestUserInput")
    await client.send({"id": asked["id"], "result": {"answers": {}}})
    await client.until(lambda m: m.get("id") == 1)
    thread = (await client.call("thread/start", {}))["result"]["thread"]["id"]
    started = await client.call(
        "turn/start", {"threadId": thread, "input": [{"type": "text", "text": "go"}]}
    )
    await client.until(lambda m: m.get("method") == "item/tool/call")
    turn = started["result"]["turn"]["id"]
    await client.call("turn/interrupt", {"threadId": thread, "turnId": turn})
    assert process.stdin is not None
    process.stdin.close()
    assert await process.wait() == 0

    [file] = reports.glob("fake-codex-*.json")
    report = json.loads(file.read_text())
    assert report["pid"] == process.pid
    assert report["exit"] == {"code": 0, "signal": None}
    assert report["methods"] == {"x/a": [1, 0], "x/b": [0], "x/ask": [1]}
    assert report["turns"] == [1, 0]
    assert report["initialize"] is None
    states = {(r["method"], r["state"], r["reply"]) for r in report["serverRequests"]}
    assert states == {
        ("item/tool/requestUserInput", "answered", "result"),
        ("item/tool/call", "dropped", None),
    }
    wire = report["wire"]
    assert wire[0]["dir"] == "in"
    assert json.loads(wire[0]["text"])["method"] == "initialize"
    assert any(e["dir"] == "out" and '"method":"turn/completed"' in e["text"] for e in wire)
    assert report["wireDropped"] == 0


async def test_without_the_variable_nothing_is_written(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CODEX_")}
    process = await asyncio.create_subprocess_exec(
        FAKE_CODEX, "app-server", stdin=asyncio.subprocess.DEVNULL, env=env, cwd=tmp_path
    )
    assert await process.wait() == 0
    assert os.listdir(tmp_path) == []
