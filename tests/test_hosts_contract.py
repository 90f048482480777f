"""docs/HOSTS.md, statement by statement: how a host in any language starts the bridge
and the fake, learns the port, knows they are ready, stops them, and reads the fake's
end-of-run report, whose JSON Schema (docs/fake-codex-report.schema.json) is checked
against real reports here. The replay server's part of the contract is in
tests/scenarios/test_replay_server.py, the whole of it in Node in examples/node-host.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import psutil
import pytest

from fakes.app_server.report import read_reports

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "fake-codex-report.schema.json").read_text())
SCRIPTS = Path(sys.executable).parent
LISTENING = re.compile(r"^rest-bridge \S+ listening on (http://\S+)$")
SCRIPT = """\
appServer:
  version: 1
  turns:
    - steps:
        - commandApproval: {command: "echo hi", output: "hi\\n"}
          onReply:
            accept: [{agentMessage: "Ran it."}]
"""


@pytest.mark.quick
def test_the_report_schema_is_a_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


async def wait_for_request(http: aiohttp.ClientSession, session: str) -> dict[str, Any]:
    """Start a turn in `session` and read its SSE stream up to the approval request."""
    path = f"/v1/sessions/{session}"
    stream = await http.get(f"{path}/events/stream")
    thread = (await (await http.post(f"{path}/call/thread/start", json={"params": {}})).json())[
        "result"
    ]
    turn = {"threadId": thread["thread"]["id"], "input": [{"type": "text", "text": "go"}]}
    assert (await http.post(f"{path}/call/turn/start", json={"params": turn})).status == 200
    async for line in stream.content:
        if line.startswith(b"data: ") and b'"kind":"request"' in line:
            stream.close()
            return dict(json.loads(line[len(b"data: ") :]))
    raise AssertionError("the stream ended before the approval request")


def test_serve_on_port_0_states_its_url_is_ready_then_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    """The first stdout line names the URL, once it accepts connections; SIGTERM stops
    it with status 0 and no app-server left; each fake wrote a report the schema holds."""
    script, reports = tmp_path / "host.scenario.yaml", tmp_path / "reports"
    script.write_text(SCRIPT)
    fake = SCRIPTS / "fake-codex"
    serve = subprocess.Popen(
        [
            SCRIPTS / "rest-bridge",
            "serve",
            "--port",
            "0",
            "--app-server",
            f"{fake} app-server --script {script}",
        ],
        cwd=tmp_path,
        env={**os.environ, "FAKE_CODEX_REPORT": str(reports)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert serve.stdout is not None
        found = LISTENING.match(serve.stdout.readline().rstrip("\n"))
        assert found, "the first line is not the listening line"
        assert serve.stdout.readline().startswith("  preset: ")  # lines for people follow
        asyncio.run(drive(found[1]))
        running = read_reports(reports)
        pids = [report["pid"] for report in running]
        assert len(pids) == 2
        assert all(psutil.pid_exists(pid) for pid in pids)
        for report in running:  # the report is whole while the process runs
            jsonschema.validate(report, SCHEMA)
            assert report["exit"] is None
        serve.terminate()
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate()
    assert not [pid for pid in pids if _alive(pid)], "an app-server outlived the bridge"
    final = read_reports(reports)
    for report in final:
        jsonschema.validate(report, SCHEMA)
        assert report["exit"] is not None
        assert report["turns"] == [1]  # each process played the scripted turn once
    states = sorted(request["state"] for report in final for request in report["serverRequests"])
    assert states[0] == "answered"
    assert states[1] in ("pending", "dropped")


async def drive(url: str) -> None:
    """Health at once, then two sessions at an approval request: one answered, one not."""
    async with aiohttp.ClientSession(url) as http:
        health = await http.get("/health")  # at once: no retry needed
        assert health.status == 200
        sessions = []
        for _ in range(2):
            created = await http.post("/v1/sessions", json={})
            sessions.append((await created.json())["sessionId"])
        answered = await wait_for_request(http, sessions[0])
        reply = {"result": {"decision": "accept"}}
        key = answered["requestKey"]
        path = f"/v1/sessions/{sessions[0]}/requests/{key}/result"
        assert (await http.post(path, json=reply)).status == 200
        await wait_for_request(http, sessions[1])  # left unanswered


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_serve_that_cannot_listen_exits_2_saying_so(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [SCRIPTS / "rest-bridge", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "listening on" not in done.stdout
