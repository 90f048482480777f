"""`$FAKE_CODEX_REPORT`: what a fake-codex process reports of its run, for harnesses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
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


@contextlib.asynccontextmanager
async def listening(tmp_path: Path, script_text: str) -> AsyncIterator[str]:
    """A fake-codex on `--listen ws://127.0.0.1:0` with a report directory
    (`tmp_path/reports`); yields its URL, and stops it with SIGTERM (exit 0)."""
    script = tmp_path / "script.yaml"
    script.write_text(script_text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_CODEX_", "CODEX_"))}
    env.update(FAKE_CODEX_REPORT=str(tmp_path / "reports"), CODEX_HOME=str(tmp_path / "home"))
    process = await asyncio.create_subprocess_exec(
        *(FAKE_CODEX, "app-server", "--listen", "ws://127.0.0.1:0", "--script", str(script)),
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert process.stderr is not None
        url = None
        async with asyncio.timeout(10):
            while url is None:
                line = (await process.stderr.readline()).decode()
                assert line, "no banner"
                if "listening on: " in line:
                    url = line.split("listening on: ")[1].strip()
        yield url
        process.terminate()
        assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def ws_call(
    ws: aiohttp.ClientWebSocketResponse, request_id: int, method: str, params: Any
) -> dict[str, Any]:
    await ws.send_str(json.dumps({"id": request_id, "method": method, "params": params}))
    async with asyncio.timeout(10):
        while True:
            message = json.loads(await ws.receive_str())
            if message.get("id") == request_id and "method" not in message:
                return message


async def test_a_listening_connection_reports_every_line_it_sent(tmp_path: Path) -> None:
    """Over `--listen`, the transcript holds the notifications and server requests a
    connection sent as well as its replies (the wire, both ways, as on stdio)."""
    async with (
        listening(tmp_path, SCRIPT) as url,
        aiohttp.ClientSession() as session,
        session.ws_connect(url) as ws,
    ):
        await ws_call(ws, 1, "initialize", {"clientInfo": {"name": "t", "version": "1"}})
        await ws.send_str(json.dumps({"method": "initialized"}))
        await ws_call(ws, 2, "thread/start", {})
    reports = tmp_path / "reports"
    [file] = reports.glob("fake-codex-*-0.json")
    wire = json.loads(file.read_text())["wire"]
    # An entry is one write (a reply and what follows it at once, or one message), and a
    # long line is cut: name each line by its method, else by the id it answers.
    said = [(entry["dir"], _name(line)) for entry in wire for line in entry["text"].split("\n")]
    assert said == [
        ("in", "initialize"),
        ("out", "reply 1"),
        ("out", "remoteControl/status/changed"),
        ("in", "initialized"),
        ("in", "thread/start"),
        ("out", "reply 2"),
        ("out", "thread/started"),
    ]


def _name(text: str) -> str:
    method = re.search(r'"method": ?"([^"]+)"', text)
    if method:
        return method.group(1)
    request_id = re.search(r'"id": ?(\d+)', text)
    assert request_id, text
    return f"reply {request_id.group(1)}"


async def test_each_listening_connection_reports_how_it_ended(tmp_path: Path) -> None:
    """A connection's `exit` step ends its own report: a signal as a crash of its
    "process", a code as its exit status."""
    script = (
        "version: 1\nmethods:\n"
        "  x/crash: {steps: [{exit: {signal: KILL}}]}\n"
        "  x/leave: {steps: [{exit: 3}]}\n"
    )
    async with listening(tmp_path, script) as url, aiohttp.ClientSession() as session:
        for method in ("x/crash", "x/leave"):
            async with session.ws_connect(url) as ws:
                await ws_call(ws, 1, "initialize", {"clientInfo": {"name": "t", "version": "1"}})
                await ws.send_str(json.dumps({"id": 2, "method": method, "params": {}}))
                async with asyncio.timeout(10):
                    while (await ws.receive()).type == aiohttp.WSMsgType.TEXT:
                        pass
    ends = {}
    for file in (tmp_path / "reports").glob("fake-codex-*-*.json"):
        report = json.loads(file.read_text())
        last_in = [entry for entry in report["wire"] if entry["dir"] == "in"][-1]
        ends[json.loads(last_in["text"])["method"]] = report["exit"]
    assert ends == {
        "x/crash": {"code": None, "signal": "SIGKILL"},
        "x/leave": {"code": 3, "signal": None},
    }
