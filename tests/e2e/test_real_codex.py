"""The bridge in front of the real, pinned ``codex app-server``, with a scripted model.

Each test starts its own bridge, scripted model, ``CODEX_HOME`` and workspace (see
conftest.py). Every HTTP response is also checked against the bridge's OpenAPI
document by the root ``http`` fixture.
"""

from __future__ import annotations

from typing import Any

import pytest
from processes import live_children

from bridge import codex_window
from bridge.app import default_app
from bridge.ops import OpsListener
from scenarios.sse import SseFrame, SseReader

pytestmark = [pytest.mark.asyncio, pytest.mark.real_codex]

COMMAND_APPROVAL = "item/commandExecution/requestApproval"
#: How long any one wait on the real codex may take before the test fails.
WAIT = 30.0


# -- helpers -----------------------------------------------------------------------


async def create_session(http, base, options) -> str:
    async with http.post(f"{base}/v1/sessions", json={"options": options}) as response:
        payload = await response.json()
        assert response.status == 201, payload
    return payload["sessionId"]


async def call(http, base, session_id, method, params) -> tuple[int, Any]:
    url = f"{base}/v1/sessions/{session_id}/call/{method}"
    async with http.post(url, json={"params": params}) as response:
        return response.status, await response.json()


async def start_thread(http, base, session_id, **params) -> str:
    status, body = await call(http, base, session_id, "thread/start", params)
    assert status == 200, body
    return body["result"]["thread"]["id"]


async def start_turn(http, base, session_id, thread_id, text) -> str:
    params = {"threadId": thread_id, "input": [{"type": "text", "text": text}]}
    status, body = await call(http, base, session_id, "turn/start", params)
    assert status == 200, body
    return body["result"]["turn"]["id"]


def method_is(method: str):
    return lambda frame: frame.json()["method"] == method


def events(frames: list[SseFrame]) -> list[dict[str, Any]]:
    return [frame.json() for frame in frames]


def untrusted_thread(workspace) -> dict[str, Any]:
    """Asks before running anything; ``workspace-write`` so an accepted command runs."""
    return {"cwd": str(workspace), "approvalPolicy": "untrusted", "sandbox": "workspace-write"}


async def run_approved_command_turn(http, base, options, workspace, decision) -> list[dict]:
    """A turn whose command approval is answered ``decision``; its events to turn/completed."""
    session_id = await create_session(http, base, options)
    async with http.get(f"{base}/v1/sessions/{session_id}/events/stream") as stream:
        reader = SseReader(stream)
        thread_id = await start_thread(http, base, session_id, **untrusted_thread(workspace))
        turn_id = await start_turn(http, base, session_id, thread_id, "Touch the file.")
        before = await reader.until(lambda f: f.event == "request", timeout=WAIT)
        request = before[-1].json()
        assert request["method"] == COMMAND_APPROVAL
        assert request["params"]["turnId"] == turn_id
        url = f"{base}/v1/sessions/{session_id}/requests/{request['requestKey']}/result"
        async with http.post(url, json={"result": {"decision": decision}}) as answered:
            assert answered.status == 200, await answered.text()
            assert await answered.json() == {"status": "sent", "requestKey": request["requestKey"]}
        after = await reader.until(method_is("turn/completed"), timeout=WAIT)
    return events(before + after)


def command_items(seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e["params"]["item"]
        for e in seen
        if e["method"] == "item/completed" and e["params"]["item"]["type"] == "commandExecution"
    ]


# -- versions and sessionless calls -------------------------------------------------


async def test_compatibility_reports_the_codex_version(bridge, http, codex_bin, codex_version):
    async with http.get(f"{bridge}/v1/compatibility") as response:
        assert response.status == 200
        body = await response.json()
    assert body["appServer"]["version"] == codex_version
    assert body["appServer"]["versionError"] is None
    assert body["appServer"]["command"] == [codex_bin, "app-server"]


async def test_compatibility_says_a_tested_real_codex_once_one_answered(
    bridge, http, codex_options
):
    await create_session(http, bridge, codex_options)
    async with http.get(f"{bridge}/v1/compatibility") as response:
        app_server = (await response.json())["appServer"]
    assert app_server["kind"] == "codex"
    assert app_server["tested"] is True
    assert app_server["warning"] is None
    assert app_server["testedVersions"] == list(codex_window.TESTED)


async def test_sessionless_model_list_returns_the_model_catalogue(bridge, http, codex_options):
    body = {"params": {}, "options": codex_options}
    async with http.post(f"{bridge}/v1/call/model/list", json=body) as response:
        payload = await response.json()
        assert response.status == 200, payload
    models = payload["result"]["data"]
    assert isinstance(models, list)
    assert models
    assert all(isinstance(m["id"], str) and m["id"] for m in models)


# -- sessions ----------------------------------------------------------------------


async def test_unknown_method_in_a_session_is_502_with_codex_error(bridge, http, codex_options):
    session_id = await create_session(http, bridge, codex_options)
    status, body = await call(http, bridge, session_id, "no/such/method", {})
    assert status == 502, body
    assert body["error"] == "app_server_error"
    assert body["code"] == -32600
    assert body["message"].startswith("Invalid request: unknown variant")


async def test_turn_streams_from_turn_started_to_completed_with_the_scripted_text(
    bridge, http, codex_options, model, workspace
):
    text = "Hello there, from the scripted model!"
    model.model.add({"text": text})
    session_id = await create_session(http, bridge, codex_options)
    async with http.get(f"{bridge}/v1/sessions/{session_id}/events/stream") as stream:
        reader = SseReader(stream)
        thread_id = await start_thread(http, bridge, session_id, cwd=str(workspace))
        turn_id = await start_turn(http, bridge, session_id, thread_id, "Say hello.")
        seen = events(await reader.until(method_is("turn/completed"), timeout=WAIT))
    methods = [e["method"] for e in seen]
    assert methods.index("turn/started") < methods.index("turn/completed")
    assert seen[methods.index("turn/started")]["params"]["turn"]["id"] == turn_id
    deltas = [e["params"]["delta"] for e in seen if e["method"] == "item/agentMessage/delta"]
    assert len(deltas) > 1
    assert "".join(deltas) == text
    completed = seen[-1]["params"]["turn"]
    assert completed["id"] == turn_id
    assert completed["status"] == "completed"
    final = [item for item in completed["items"] if item["type"] == "agentMessage"][-1]
    assert final["text"] == text


async def test_accepted_command_approval_runs_the_command(
    bridge, http, codex_options, model, workspace
):
    model.model.add({"execCommand": {"cmd": "touch accepted.txt"}}, {"text": "Touched it."})
    seen = await run_approved_command_turn(http, bridge, codex_options, workspace, "accept")
    assert seen[-1]["params"]["turn"]["status"] == "completed"
    assert [item["status"] for item in command_items(seen)] == ["completed"]
    assert (workspace / "accepted.txt").exists()


async def test_declined_command_approval_does_not_run_and_the_turn_completes(
    bridge, http, codex_options, model, workspace
):
    model.model.add({"execCommand": {"cmd": "touch declined.txt"}}, {"text": "Fine, I won't."})
    seen = await run_approved_command_turn(http, bridge, codex_options, workspace, "decline")
    assert seen[-1]["params"]["turn"]["status"] == "completed"
    assert [item["status"] for item in command_items(seen)] == ["declined"]
    assert not (workspace / "declined.txt").exists()


async def test_deleting_a_session_stops_its_codex_process(bridge, http, codex_options):
    before = live_children()
    session_id = await create_session(http, bridge, codex_options)
    assert live_children() - before
    async with http.delete(f"{bridge}/v1/sessions/{session_id}") as response:
        assert response.status == 200
        assert await response.json() == {"status": "deleted", "sessionId": session_id}
    assert live_children() - before == set()


# -- text turns --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "status", "runs"),
    [
        ("decline", "completed", False),
        ("accept", "completed", True),
        ("acceptForSession", "completed", True),
        ("cancel", "interrupted", False),
    ],
)
async def test_text_turn_answers_the_command_approval_by_its_policy(
    bridge, http, codex_options, model, workspace, policy, status, runs
):
    text = "All done here."
    model.model.add({"execCommand": {"cmd": "touch side-effect.txt"}}, {"text": text})
    body = {
        "text": "Touch the file, then say so.",
        "approvalPolicy": policy,
        "threadParams": untrusted_thread(workspace),
        "options": codex_options,
        "timeoutMs": int(WAIT * 1000),
    }
    async with http.post(f"{bridge}/v1/text-turn", json=body) as response:
        payload = await response.json()
        assert response.status == 200, payload
    assert payload["status"] == status
    assert payload["error"] is None
    assert payload["threadId"]
    assert payload["turnId"]
    assert payload["usage"]["total"]["totalTokens"] > 0
    assert [(a["method"], a["decision"]) for a in payload["approvals"]] == [
        (COMMAND_APPROVAL, policy)
    ]
    # A cancelled approval interrupts the turn before the model speaks again.
    assert payload["text"] == ("" if policy == "cancel" else text)
    assert (workspace / "side-effect.txt").exists() is runs


async def test_a_client_name_codex_refuses_leaves_the_replica_ready(
    model, codex_home, workspace, serve, codex_bin, http
):
    """codex refuses a client name that cannot be a header value: the caller's 502, while
    `/readyz` stays 200 on the `default` preset (any token holder can send one)."""
    app = default_app(model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace))
    listener = OpsListener(app)
    base = await serve(app)
    ops = "http://" + await listener.start("127.0.0.1", 0)
    try:
        await listener.readiness.probed.wait()
        refused = {"options": {"clientInfo": {"name": "a\nb", "version": "1"}}}
        for _ in range(3):
            async with http.post(f"{base}/v1/sessions", json=refused) as response:
                payload = await response.json()
                assert (response.status, payload["error"]) == (502, "app_server_error")
            assert "clientInfo" in payload["message"], payload
            async with http.get(f"{ops}/readyz") as response:
                assert response.status == 200, await response.text()
        await listener.readiness.settled()
        async with http.get(f"{ops}/readyz") as response:
            assert (response.status, await response.json()) == (200, {"ready": True, "reasons": []})
    finally:
        await listener.close()
