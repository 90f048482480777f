"""The benchmarks' lean app-server (bench/lean), C and Python: what it answers, and a
bridge in front of it. The cluster benchmark's figures are only worth something if the
bridge does with it what it does with fake-codex."""

from __future__ import annotations

import os
import shutil
import subprocess

import orjson
import pytest

from bench import lean
from bridge.app import trusted_bridge_app
from bridge.limits import RestLimits

KINDS = ["c", "python"]


def command(kind: str) -> list[str]:
    if kind == "c" and not (shutil.which("cc") or shutil.which("gcc")):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("no C compiler: CI builds the lean app-server")
        pytest.skip("no C compiler here (the benchmarks fall back to the Python one)")
    argv = lean.argv(kind)
    assert lean.kind_of(argv) == kind
    return argv


def lines(*messages: object) -> bytes:
    return b"".join((m if isinstance(m, bytes) else orjson.dumps(m)) + b"\n" for m in messages)


@pytest.mark.parametrize("kind", KINDS)
def test_the_lean_app_server_answers_as_codex_app_server_would(kind):
    sent = lines(
        {"id": 1, "method": "bench/ping", "params": {}},
        {"id": 2, "method": "initialize", "params": {"clientInfo": {"name": "t", "version": "1"}}},
        {"method": "initialized"},
        {"id": 'a"b', "method": "bench/ping", "params": {"x": [1, {"y": "}"}]}},
        {"id": 3, "method": "no/such", "params": {}},
        {"id": 4, "method": "initialize", "params": {}},
        {"id": 5, "method": "bench/ping"},
        b"not json",
        {"id": 7, "result": {}},  # the client's answer to a request: dropped
        {"id": 6, "method": "bench/flood", "params": {}},
    )
    done = subprocess.run(command(kind), input=sent, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    answers = [orjson.loads(line) for line in done.stdout.splitlines()]
    replies = {a["id"]: a for a in answers if "id" in a}
    notifications = [a for a in answers if "id" not in a]
    assert replies[1]["error"] == {"code": -32600, "message": "Not initialized"}
    assert set(replies[2]["result"]) == {"userAgent", "codexHome", "platformFamily", "platformOs"}
    assert replies['a"b'] == {"id": 'a"b', "result": {"ok": True}}
    assert replies[3]["error"]["code"] == -32600
    assert replies[3]["error"]["message"].startswith("Invalid request: unknown variant `no/such`")
    assert replies[4]["error"]["message"] == "Already initialized"
    assert replies[5]["error"]["message"] == "Invalid request: missing field `params`"
    assert replies[6]["result"] == {"flooded": 100_000}
    assert set(replies) == {1, 2, 'a"b', 3, 4, 5, 6}
    assert len(notifications) == 100_000
    assert notifications[0]["method"] == "item/agentMessage/delta"
    # Every notification comes before the reply that ends the flood.
    assert answers[-1]["id"] == 6


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_bridge_serves_sessions_on_the_lean_app_server(kind, serve, http):
    base = await serve(trusted_bridge_app(command(kind), RestLimits()))
    async with http.post(f"{base}/v1/sessions", json={}) as response:
        assert response.status == 201, await response.text()
        session = (await response.json())["sessionId"]
    for n in range(20):
        url = f"{base}/v1/sessions/{session}/call/bench/ping"
        async with http.post(url, json={"params": {"n": n}}) as response:
            assert response.status == 200
            assert (await response.json())["result"] == {"ok": True}
    async with http.post(f"{base}/v1/sessions/{session}/call/no/such", json={"params": {}}) as r:
        body = await r.json()
        assert r.status >= 400
        assert "unknown variant" in orjson.dumps(body).decode()
    async with http.delete(f"{base}/v1/sessions/{session}") as response:
        assert response.status == 200
