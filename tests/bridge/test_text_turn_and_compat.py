"""The one-shot text turn and the compatibility route, on the fake app-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from processes import live_children

from bridge import codex_window
from bridge.app import text_turn_app, trusted_bridge_app
from bridge.limits import RestLimits

pytestmark = pytest.mark.asyncio


async def text_turn(http, base, body, status=200):
    async with http.post(f"{base}/v1/text-turn", json=body) as response:
        payload = await response.json()
        assert response.status == status, payload
        return payload


def approval_script(write_script, marker: Path, extra_steps=()):
    return write_script(
        {
            "turns": [
                {
                    "steps": [
                        {"commandApproval": {"command": f"touch {marker}", "touch": str(marker)}},
                        *extra_steps,
                        {"agentMessage": "All done."},
                    ]
                }
            ]
        }
    )


async def test_text_turn_returns_the_final_message_ids_status_and_usage(serve, fake_codex, http):
    base = await serve(text_turn_app(fake_codex))
    before = live_children()
    result = await text_turn(http, base, {"text": "ping"})
    assert result["text"] == "Hello from fake-codex. You said: ping"
    assert result["status"] == "completed"
    assert result["error"] is None
    assert result["threadId"]
    assert result["turnId"]
    assert result["usage"]["total"]["totalTokens"] > 0
    assert result["approvals"] == []
    assert "events" not in result
    assert live_children() == before


async def test_text_turn_includes_events_when_asked(serve, fake_codex, http):
    base = await serve(text_turn_app(fake_codex))
    result = await text_turn(http, base, {"text": "ping", "includeEvents": True})
    methods = [e["method"] for e in result["events"]]
    assert methods[-1] == "turn/completed"
    assert "turn/started" in methods
    assert [e["seq"] for e in result["events"]] == list(range(1, len(methods) + 1))


@pytest.mark.parametrize(
    ("policy", "runs", "status"),
    [
        ("decline", False, "completed"),
        ("accept", True, "completed"),
        ("acceptForSession", True, "completed"),
        ("cancel", False, "interrupted"),
    ],
)
async def test_text_turn_answers_an_approval_by_its_policy(
    serve, fake_codex, http, write_script, tmp_path, policy, runs, status
):
    marker = tmp_path / "marker"
    script = approval_script(write_script, marker)
    base = await serve(text_turn_app(fake_codex))
    body = {
        "text": "run it",
        "options": {"env": {"FAKE_CODEX_SCRIPT": script}},
        "includeEvents": True,
    }
    if policy != "decline":
        body["approvalPolicy"] = policy
    result = await text_turn(http, base, body)
    assert result["status"] == status
    assert marker.exists() is runs
    assert result["approvals"] == [
        {
            "method": "item/commandExecution/requestApproval",
            "requestKey": result["approvals"][0]["requestKey"],
            "decision": policy,
        }
    ]
    requests = [e for e in result["events"] if e["kind"] == "request"]
    assert [r["requestKey"] for r in requests] == [result["approvals"][0]["requestKey"]]


async def test_text_turn_answers_requests_that_are_not_approvals_with_an_error(
    serve, fake_codex, http, write_script
):
    script = write_script(
        {
            "turns": [
                {
                    "steps": [
                        {
                            "request": {"method": "item/tool/requestUserInput"},
                            "onReply": {
                                "error": [{"agentMessage": "no input then"}],
                                "default": [{"agentMessage": "got input"}],
                            },
                        }
                    ]
                }
            ]
        }
    )
    base = await serve(text_turn_app(fake_codex))
    result = await text_turn(
        http, base, {"text": "x", "options": {"env": {"FAKE_CODEX_SCRIPT": script}}}
    )
    assert result["text"] == "no input then"
    assert result["approvals"] == []


async def test_text_turn_past_its_deadline_is_504_and_the_process_is_gone(
    serve, fake_codex, http, write_script
):
    script = write_script({"turns": [{"steps": [{"stall": True}]}]})
    base = await serve(text_turn_app(fake_codex))
    before = live_children()
    body = {"text": "x", "timeoutMs": 300, "options": {"env": {"FAKE_CODEX_SCRIPT": script}}}
    result = await text_turn(http, base, body, status=504)
    assert result["error"] == "timeout"
    assert result["data"] == {"reason": "deadline"}
    assert live_children() == before


async def test_a_timed_out_text_turn_says_what_the_app_server_last_reported(
    serve, fake_codex, http, write_script
):
    """A codex that cannot reach its model retries and says so only in `error`
    notifications: the 504 repeats the last one's message, so the caller learns why."""
    retrying = {
        "error": {"message": "Reconnecting... 2/5 (stream disconnected)"},
        "willRetry": True,
        "threadId": "${threadId}",
        "turnId": "${turnId}",
    }
    steps = [{"notify": {"method": "error", "params": retrying}}, {"stall": True}]
    script = write_script({"turns": [{"steps": steps}]})
    base = await serve(text_turn_app(fake_codex))
    body = {"text": "x", "timeoutMs": 2000, "options": {"env": {"FAKE_CODEX_SCRIPT": script}}}
    result = await text_turn(http, base, body, status=504)
    assert result["error"] == "timeout"
    assert result["data"] == {
        "reason": "deadline",
        "lastError": "Reconnecting... 2/5 (stream disconnected)",
    }


async def test_text_turn_without_turn_completed_ends_when_the_thread_goes_idle(
    serve, fake_codex, http, write_script
):
    idle = {"threadId": "${threadId}", "status": {"type": "idle"}}
    went_idle = {"notify": {"method": "thread/status/changed", "params": idle}}
    steps = [{"agentMessage": "hi"}, went_idle]
    script = write_script({"turns": [{"steps": steps, "noCompletion": True}]})
    base = await serve(text_turn_app(fake_codex))
    body = {"text": "x", "timeoutMs": 50_000, "options": {"env": {"FAKE_CODEX_SCRIPT": script}}}
    result = await text_turn(http, base, body, status=504)
    assert result["data"] == {"reason": "idle_without_completion"}


async def test_text_turn_app_server_crash_is_502(serve, fake_codex, http, write_script):
    script = write_script({"turns": [{"steps": [{"stderr": "dying\n"}, {"exit": 9}]}]})
    base = await serve(text_turn_app(fake_codex))
    body = {"text": "x", "options": {"env": {"FAKE_CODEX_SCRIPT": script}}}
    result = await text_turn(http, base, body, status=502)
    assert result["error"] == "app_server_exited"
    assert result["data"]["exitCode"] == 9


async def test_text_turns_beyond_the_limit_are_429_busy(serve, fake_codex, http, write_script):
    script = write_script({"turns": [{"steps": [{"stall": True}]}]})
    base = await serve(text_turn_app(fake_codex, RestLimits(max_concurrent_text_turns=1)))
    stalled = {"text": "x", "timeoutMs": 60_000, "options": {"env": {"FAKE_CODEX_SCRIPT": script}}}

    async def hold_the_only_slot():
        # Retries until it gets the slot (a probe below may hold it for a moment).
        while True:
            async with http.post(f"{base}/v1/text-turn", json=stalled) as response:
                if response.status != 429:
                    return response.status

    holder = asyncio.create_task(hold_the_only_slot())
    try:
        async with asyncio.timeout(30):
            while True:
                async with http.post(f"{base}/v1/text-turn", json={"text": "y"}) as response:
                    if response.status == 429:
                        assert response.headers["Retry-After"] == "1"
                        assert (await response.json())["error"] == "busy"
                        break
                    assert response.status == 200
    finally:
        holder.cancel()


@pytest.mark.quick
async def test_empty_text_is_400(serve, fake_codex, http):
    base = await serve(text_turn_app(fake_codex))
    result = await text_turn(http, base, {"text": ""}, status=400)
    assert result["error"] == "bad_request"


async def test_compatibility_reports_the_app_server_version(serve, fake_codex, http):
    base = await serve(trusted_bridge_app(fake_codex))
    async with http.get(f"{base}/v1/compatibility") as response:
        body = await response.json()
    assert body == {
        "bridgeVersion": body["bridgeVersion"],
        "apiVersion": "v1",
        "openapi": "3.1.0",
        "appServer": {
            "command": fake_codex,
            "version": f"codex-cli {codex_window.PIN}",
            "versionError": None,
            "mode": "process",
            "shared": None,
            "kind": "fake-codex",  # the `--version` probe says so before any `initialize`
            "tested": True,
            "testedVersions": list(codex_window.TESTED),
            "warning": None,
        },
        "replica": None,
        "draining": False,
    }


async def test_compatibility_reports_a_missing_binary_as_version_error(serve, http):
    base = await serve(trusted_bridge_app(["/nonexistent/codex", "app-server"]))
    async with http.get(f"{base}/v1/compatibility") as response:
        assert response.status == 200
        body = await response.json()
    assert body["appServer"]["version"] is None
    assert body["appServer"]["versionError"].startswith("could not run the app-server")
