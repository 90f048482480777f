"""The token stays secret, the conservative preset stays conservative, errors say little.

The bridge runs as `rest-bridge serve` in a child process, so its real logs, its
command line and its children's environments can be searched for the token.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scenarios.openapi_check import OpenApiChecker

pytestmark = pytest.mark.asyncio

THEME = "Security"
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
TOKEN = "tok-3f1c9e2a-reliability-SECRET"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STDERR_SECRET = "stderr-says-SECRET-4242"


def proc_text(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


async def collect(http, method: str, url: str, bodies: list[str], **kwargs: Any) -> tuple[int, Any]:
    async with http.request(method, url, **kwargs) as response:
        text = await response.text()
        bodies.append(text)
        try:
            return response.status, await response.json(content_type=None)
        except ValueError:
            return response.status, text


async def authed(http, method: str, url: str, bodies: list[str], **kwargs: Any) -> tuple[int, Any]:
    """`collect` with the right bearer token."""
    return await collect(http, method, url, bodies, headers=AUTH, **kwargs)


async def test_token_never_in_logs_errors_ps_or_child_environments(
    bridge_process, http, contract_checkers, write_script, report, tmp_path
):
    """The token, with every kind of request, fault and malformed header"""
    env_dump = tmp_path / "grandchild.env"
    dump = ["sh", "-c", f"env > {env_dump}"]
    script = write_script(
        {
            "methods": {
                "x/crash": {"steps": [{"stderr": f"{STDERR_SECRET}\n"}, {"exit": 3}]},
                "x/fork": {
                    "steps": [
                        # The dump is written before the call answers; the sleeper stays.
                        {"spawnChild": {"command": dump, "wait": True}},
                        {"spawnChild": {"command": ["sleep", "1000"]}},
                    ],
                    "result": {},
                },
            }
        }
    )
    served = bridge_process(token=TOKEN, env={"FAKE_CODEX_SCRIPT": script})
    async with http.get(served.base + "/v1/openapi.json", headers=AUTH) as response:
        contract_checkers[served.base] = OpenApiChecker(await response.json())
    bodies: list[str] = []
    base = served.base
    # Right, wrong, near-miss and malformed tokens, on every kind of route.
    for header in (
        TOKEN,
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Basic {TOKEN}",
        f"Bearer{TOKEN}",
    ):
        for method, path in (("GET", "/v1/sessions"), ("POST", "/v1/sessions"), ("GET", "/nope")):
            status, body = await collect(
                http, method, base + path, bodies, headers={"Authorization": header}
            )
            assert status == 401, body
    status, created = await authed(http, "POST", base + "/v1/sessions", bodies)
    assert status == 201
    session_id = created["sessionId"]
    status, body = await authed(
        http, "POST", f"{base}/v1/sessions/{session_id}/call/x/fork", bodies, json={"params": {}}
    )
    assert status == 200, body
    # A caller cannot hand the token to the process either (the bridge's own variables
    # are refused), and a session with variables of its own does not get it.
    status, refused = await authed(
        http,
        "POST",
        base + "/v1/sessions",
        bodies,
        json={"options": {"env": {"REST_ADAPTER_TOKEN": "x", "SOMETHING": "y"}}},
    )
    assert (status, refused["error"]) == (403, "options_not_allowed")
    status, _ = await authed(
        http, "POST", base + "/v1/sessions", bodies, json={"options": {"env": {"SOMETHING": "y"}}}
    )
    assert status == 201
    for path in ("/v1/compatibility", f"/v1/sessions/{session_id}/events?after=0&waitMs=0"):
        status, _ = await authed(http, "GET", base + path, bodies)
        assert status == 200
    processes = served.resources.processes()
    command_lines = [proc_text(served.pid, "cmdline")] + [
        proc_text(pid, "cmdline") for pid in processes
    ]
    environments = [proc_text(pid, "environ") for pid in processes]
    grandchild_env = env_dump.read_text()
    status, body = await authed(
        http, "POST", f"{base}/v1/sessions/{session_id}/call/x/crash", bodies, json={"params": {}}
    )
    assert (status, body["error"]) == (502, "app_server_exited")
    # Requests aiohttp cannot parse are logged: the header bytes must not be.
    for raw in (
        f"GET /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\x01\r\n\r\n",
        f"GET /v1/sessions HTTP/1.1\r\nAuthorization: Bearer {TOKEN}{'a' * 9000}\r\n\r\n",
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(raw.encode())
        await writer.drain()
        async with asyncio.timeout(10):
            answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.")
    assert len(processes) >= 3  # two sessions and the grandchild
    assert all(TOKEN not in line for line in command_lines)
    assert all("REST_ADAPTER_TOKEN" not in environ for environ in environments)
    assert "REST_ADAPTER_TOKEN" not in grandchild_env
    assert all(TOKEN not in body for body in bodies)
    served.signal(signal.SIGTERM)
    assert served.wait(30) == 0
    logs = served.output
    assert "refused a request from" in logs  # the malformed requests were logged...
    assert TOKEN not in logs  # ...without their bytes
    assert "Traceback" not in logs
    report.figures.update(
        {
            "responsesSearched": len(bodies),
            "processesSearched": len(processes) + 1,
            "logBytesSearched": len(logs),
        }
    )
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = (
        "absent from logs, response bodies, command lines, and the environments of "
        "children and grandchildren"
    )


async def test_unauthenticated_callers_see_no_stderr_tail_path_or_version(
    bridge_process, http, contract_checkers, write_script, report
):
    """Unauthenticated callers, and error bodies, against stderr tails and paths"""
    script = write_script(
        {"methods": {"x/crash": {"steps": [{"stderr": f"{STDERR_SECRET}\n"}, {"exit": 3}]}}}
    )
    served = bridge_process(token=TOKEN, env={"FAKE_CODEX_SCRIPT": script})
    async with http.get(served.base + "/v1/openapi.json", headers=AUTH) as response:
        contract_checkers[served.base] = OpenApiChecker(await response.json())
    base = served.base
    bodies: list[str] = []
    status, created = await authed(http, "POST", base + "/v1/sessions", bodies)
    session_id = created["sessionId"]
    status, error = await authed(
        http, "POST", f"{base}/v1/sessions/{session_id}/call/x/crash", bodies, json={"params": {}}
    )
    assert (status, error["data"]) == (502, {"exitCode": 3, "signal": None})
    status, _ = await authed(
        http,
        "POST",
        base + "/v1/sessions",
        bodies,
        json={"options": {"cwd": "/definitely/not/here"}},
    )
    assert status == 502
    fake = os.path.dirname(served.argv[0])
    assert all(STDERR_SECRET not in b and fake not in b for b in bodies), bodies
    # The one place the stderr tail shows: the session's exit event, to a caller with
    # the token.
    event: dict[str, Any] = {}
    for _ in range(1000):
        async with http.get(
            f"{base}/v1/sessions/{session_id}/events?waitMs=10000", headers=AUTH
        ) as response:
            event = await response.json()
        if event["kind"] == "exit":
            break
    assert STDERR_SECRET in event["params"]["stderrTail"]
    unauthenticated = []
    for method, path in (
        ("GET", "/v1/compatibility"),
        ("GET", "/v1/openapi.json"),
        ("GET", "/v1/sessions"),
        ("GET", f"/v1/sessions/{session_id}/events?after=0&waitMs=0"),
        ("GET", f"/v1/sessions/{session_id}/events/stream?after=0"),
        ("POST", f"/v1/sessions/{session_id}/call/x"),
        ("DELETE", f"/v1/sessions/{session_id}"),
        ("POST", "/v1/text-turn"),
        ("POST", "/v1/call/model/list"),
    ):
        status, body = await collect(http, method, base + path, unauthenticated)
        assert status == 401, (path, body)
    assert len(set(unauthenticated)) == 1
    for path in ("/health", "/v1/health"):
        status, body = await collect(http, "GET", base + path, unauthenticated)
        assert status == 200
        assert set(body) == {"status", "version"}
    assert all(STDERR_SECRET not in b and fake not in b for b in unauthenticated)
    report.figures["unauthenticatedRequests"] = len(unauthenticated)
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = (
        "unauthenticated: one identical 401 everywhere but health (status, version only); "
        "error bodies carry neither stderr nor paths, only the exit event does"
    )


CONSERVATIVE_REFUSED = {
    "cwd": "/tmp",
    "env": {"A": "b"},
    "configOverrides": ["model=x"],
    "experimentalApi": True,
}


async def test_conservative_preset_refuses_every_process_shaping_option(
    bridge_process, http, contract_checkers, report
):
    """The conservative preset, asked for each process-shaping option"""
    served = bridge_process(preset="default")
    async with http.get(served.base + "/v1/openapi.json") as response:
        contract_checkers[served.base] = OpenApiChecker(await response.json())
    before = served.resources.processes()
    bodies: list[str] = []
    for field, value in CONSERVATIVE_REFUSED.items():
        for path, body in (
            ("/v1/sessions", {}),
            ("/v1/text-turn", {"text": "hi"}),
        ):
            status, payload = await collect(
                http, "POST", served.base + path, bodies, json={**body, "options": {field: value}}
            )
            assert status == 403, payload
            assert payload["error"] == "options_not_allowed"
            assert payload["data"] == {"fields": [field]}
    status, _ = await collect(http, "POST", served.base + "/v1/call/model/list", bodies, json={})
    assert status == 404
    assert served.resources.processes() == before
    allowed = {"clientInfo": {"name": "host", "version": "1"}, "optOutNotificationMethods": []}
    status, created = await collect(
        http, "POST", served.base + "/v1/sessions", bodies, json={"options": allowed}
    )
    assert status == 201, created
    report.figures["refusedFields"] = sorted(CONSERVATIVE_REFUSED)
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = (
        "403 options_not_allowed naming the field, nothing spawned; no sessionless call route; "
        "clientInfo and optOutNotificationMethods accepted"
    )


@pytest.mark.parametrize("token", ["  tok  ", "tok\t", "to\x01k"], ids=["spaces", "tab", "control"])
async def test_a_token_no_request_could_match_is_refused_at_start(token, report):
    """Starts `rest-bridge serve` with a token no header can carry"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    env["REST_ADAPTER_TOKEN"] = token
    child = await asyncio.create_subprocess_exec(
        REST_BRIDGE,
        "serve",
        "--port",
        "0",
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await child.communicate()
    stdout, stderr = out.decode(), err.decode()
    assert child.returncode == 2, (stdout, stderr)
    assert "REST_ADAPTER_TOKEN" in stderr
    assert "no request could match it" in stderr
    assert token.strip() not in stderr + stdout  # the token itself is never shown
    assert "Traceback" not in stderr
    report.survived = True
    report.outcome = "exit 2 naming the variable and the problem, never the token"
