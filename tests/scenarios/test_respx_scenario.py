"""Host code using httpx against the respx mock built from a scenario: no process at all.

The host code here is written the way a host team would write it (a small client over
`httpx.Client` / `httpx.AsyncClient`), not step by step from the scenario; the mock
must answer it as the scenario says, fail loudly where it cannot, and check at the end
that every step was made.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from respx.models import AllMockedAssertionError

from bridge import errors
from bridge.models import SessionCreateRequest
from bridge.routes import validate_body
from scenarios.format import ScenarioError
from scenarios.respx_mock import (
    MockBuildError,
    ScenarioMockError,
    UnmatchedRequest,
    scenario_router,
)

LIBRARY = Path(__file__).resolve().parents[2] / "scenarios" / "library"


# -- host code -------------------------------------------------------------------------


class SyncHost:
    """What a host application's bridge client looks like, synchronous."""

    def __init__(self, base_url: str, token: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url, headers=headers)

    def create_session(self) -> str:
        response = self.http.post("/v1/sessions", json={})
        response.raise_for_status()
        return str(response.json()["sessionId"])

    def call(self, session: str, method: str, params: Any) -> httpx.Response:
        return self.http.post(f"/v1/sessions/{session}/call/{method}", json={"params": params})

    def events(self, session: str, *, last_event_id: int | None = None) -> list[dict[str, Any]]:
        """Every event of the stream, until it ends."""
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
        seen = []
        with self.http.stream(
            "GET", f"/v1/sessions/{session}/events/stream", headers=headers
        ) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[len("data: ") :]))
        return seen


class AsyncHost:
    """The same, asynchronous."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.AsyncClient(base_url=base_url)

    async def create_session(self) -> str:
        response = await self.http.post("/v1/sessions", json={})
        response.raise_for_status()
        return str(response.json()["sessionId"])

    async def call(self, session: str, method: str, params: Any) -> Any:
        response = await self.http.post(
            f"/v1/sessions/{session}/call/{method}", json={"params": params}
        )
        response.raise_for_status()
        return response.json()["result"]

    async def next_event(self, session: str, **query: Any) -> dict[str, Any] | None:
        response = await self.http.get(f"/v1/sessions/{session}/events", params=query)
        if response.status_code == 204:
            return None
        response.raise_for_status()
        event: dict[str, Any] = response.json()
        return event

    async def until(self, session: str, method: str | None = None, kind: str | None = None):
        """Long-poll until an event of `method` (or `kind`); returns every event read."""
        read: list[dict[str, Any]] = []
        while True:
            event = await self.next_event(session, waitMs=1000)
            if event is None:
                continue
            read.append(event)
            if event["method"] == method or event["kind"] == kind:
                return read

    async def reply(self, session: str, key: str, result: Any) -> httpx.Response:
        return await self.http.post(
            f"/v1/sessions/{session}/requests/{key}/result", json={"result": result}
        )


# -- scenarios from the library ------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_host_answers_an_approval_by_long_poll() -> None:
    with scenario_router(LIBRARY / "approval-long-poll.scenario.yaml") as bridge:
        host = AsyncHost(bridge.base_url)
        session = await host.create_session()
        thread = (await host.call(session, "thread/start", {}))["thread"]["id"]
        text = [{"type": "text", "text": "touch the file"}]
        await host.call(session, "turn/start", {"threadId": thread, "input": text})
        before = await host.until(session, kind="request")
        request = before[-1]
        assert request["method"] == "item/commandExecution/requestApproval"
        assert request["params"]["threadId"] == thread == bridge.variables["thread"]
        assert "touch proof.txt" in request["params"]["command"]
        assert [event["seq"] for event in before] == list(range(1, len(before) + 1))

        answered = await host.reply(session, request["requestKey"], {"decision": "decline"})
        assert answered.json() == {"status": "sent", "requestKey": request["requestKey"]}
        again = await host.reply(session, request["requestKey"], {"decision": "accept"})
        assert again.status_code == 409
        assert again.json()["error"] == "request_already_answered"

        after = await host.until(session, method="turn/completed")
        texts = [
            event["params"]["item"].get("text")
            for event in after
            if event["method"] == "item/completed"
        ]
        assert texts[-2:] == ["Fine, I won't.", "Done."]
        assert after[0]["seq"] == request["seq"] + 1
        await host.http.aclose()
    # Leaving the block ran assert_all_called: every step was made.


def test_sync_host_reads_a_turn_over_sse_and_resumes_after_an_id() -> None:
    with scenario_router(LIBRARY / "turn-stream-and-resume.scenario.yaml") as bridge:
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        with host.http.stream("GET", f"/v1/sessions/{session}/events/stream") as stream:
            thread = host.call(session, "thread/start", {}).json()["result"]["thread"]["id"]
            started = host.call(
                session, "turn/start", {"threadId": thread, "input": [{"type": "text"}]}
            )
            turn = started.json()["result"]["turn"]["id"]
            lines = list(stream.iter_lines())
        ids = [int(line[4:]) for line in lines if line.startswith("id: ")]
        assert ids == list(range(1, len(ids) + 1))
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        methods = [event["method"] for event in events]
        assert methods[-1] == "turn/completed"
        assert events[-1]["params"]["turn"] == {**events[-1]["params"]["turn"], "id": turn}
        deltas = [e["params"]["delta"] for e in events if e["method"] == "item/agentMessage/delta"]
        assert deltas[0].startswith("Stream")
        assert deltas[-1].endswith("works.")

        resumed = host.events(session, last_event_id=3)
        assert [event["seq"] for event in resumed] == ids[3:]


@pytest.mark.asyncio
async def test_async_host_replies_to_a_server_request_while_its_call_waits() -> None:
    with scenario_router(LIBRARY / "server-request-error-reply.scenario.yaml") as bridge:
        http = httpx.AsyncClient(base_url=bridge.base_url)
        session = (await http.post("/v1/sessions", json={})).json()["sessionId"]
        path = f"/v1/sessions/{session}"
        async with http.stream("GET", f"{path}/events/stream") as stream:
            ask = asyncio.ensure_future(http.post(f"{path}/call/x/ask", json={"params": {}}))
            frames = stream.aiter_lines()
            request = None
            async for line in frames:
                if line.startswith("data: ") and '"kind":"request"' in line:
                    request = json.loads(line[6:])
                    break
            assert request is not None
            listed = (await http.get("/v1/sessions")).json()["sessions"]
            assert listed[0]["pendingRequests"] == [request["requestKey"]]
            error = {"code": -32000, "message": "nobody is here to answer"}
            replied = await http.post(f"{path}/requests/{request['requestKey']}/error", json=error)
            assert replied.status_code == 200
            assert (await ask).json() == {"result": {"asked": True}}
            rest = [line async for line in frames if line.startswith("data: ")]
        assert [json.loads(line[6:])["params"] for line in rest] == [{"branch": "error"}]
        listed = (await http.get("/v1/sessions")).json()["sessions"]
        assert listed[0]["pendingRequests"] == []
        await http.aclose()


def test_sync_host_gets_the_bridges_error_payloads() -> None:
    with scenario_router(LIBRARY / "error-payloads.scenario.yaml") as bridge:
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        failed = host.call(session, "x/fail", {})
        assert failed.status_code == 502
        assert failed.json() == {
            "error": "app_server_error",
            "message": "nope",
            "code": -32050,
            "data": {"k": [1, 2]},
        }
        busy = host.call(session, "x/busy", {})
        assert busy.status_code == 503
        assert busy.headers["Retry-After"].isdigit()
        slow = host.http.post(
            f"/v1/sessions/{session}/call/x/slow", json={"params": {}, "timeoutMs": 200}
        )
        assert (slow.status_code, slow.json()["error"]) == (504, "timeout")
        unknown = host.call(session, "no/such/method", {})
        assert unknown.json()["message"].startswith("Invalid request: unknown variant")
        missing = host.http.post("/v1/sessions/no-such-session/call/thread/start", json={})
        assert missing.json()["error"] == "session_not_found"
        # Rejected by the bridge's front, exactly as the bridge words it:
        bogus = host.http.post(
            f"/v1/sessions/{session}/call/thread%2Fstart", json={"params": {}, "bogus": 1}
        )
        assert bogus.status_code == 400
        assert bogus.json()["data"]["errors"][0]["loc"] == ["bogus"]
        assert host.http.get("/v1/nothing-here").json() == {
            "error": "not_found",
            "message": "No such route.",
        }
        put = host.http.put("/v1/sessions")
        assert put.status_code == 405
        assert put.headers["Allow"] == "GET, POST"
        assert host.http.delete(f"/v1/sessions/{session}").json() == {
            "status": "deleted",
            "sessionId": session,
        }
        assert host.http.delete(f"/v1/sessions/{session}").status_code == 404


def test_a_scenario_with_a_token_rejects_a_host_without_it() -> None:
    with scenario_router(LIBRARY / "auth-rejection.scenario.yaml") as bridge:
        anonymous = SyncHost(bridge.base_url)
        assert anonymous.http.get("/health").status_code == 200
        rejected = anonymous.http.get("/v1/sessions")
        assert rejected.status_code == 401
        assert rejected.headers["WWW-Authenticate"] == "Bearer"
        assert rejected.json() == errors.unauthorized().payload()
        wrong = anonymous.http.get("/v1/sessions", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        basic = anonymous.http.get("/v1/sessions", headers={"Authorization": "Basic czNjcmV0"})
        assert basic.status_code == 401
        assert bridge.token is not None
        host = SyncHost(bridge.base_url, token=bridge.token)
        assert host.http.get("/v1/sessions").json() == {"sessions": []}
        lower = {"Authorization": f"bearer {bridge.token}"}
        assert anonymous.http.get("/v1/sessions", headers=lower).status_code == 200


# -- failing loudly ---------------------------------------------------------------------------


def test_a_call_no_route_matches_fails_with_the_known_routes() -> None:
    with (
        scenario_router(
            LIBRARY / "default-preset.scenario.yaml", assert_all_called=False
        ) as bridge,
        pytest.raises(UnmatchedRequest) as raised,
    ):
        httpx.Client(base_url=bridge.base_url).get("/v1/sessions/no-such-session/events")
    message = str(raised.value)
    assert "GET http://bridge.test/v1/sessions/no-such-session/events" in message
    assert "known routes:" in message
    assert "POST http://bridge.test/v1/sessions  — step 2 (env is a process-shaping option)" in (
        message
    )
    assert "GET http://bridge.test/v1/openapi.json" in message
    assert isinstance(raised.value, AllMockedAssertionError)  # what respx users catch
    assert [request.url.path for request in bridge.unmatched] == [
        "/v1/sessions/no-such-session/events"
    ]


def test_another_host_is_not_the_bridge() -> None:
    with (
        scenario_router(LIBRARY / "auth-rejection.scenario.yaml", assert_all_called=False),
        pytest.raises(UnmatchedRequest, match=r"GET http://elsewhere.test/health"),
    ):
        httpx.get("http://elsewhere.test/health")


def test_a_route_asked_more_often_than_the_scenario_answers_it_fails() -> None:
    with scenario_router(LIBRARY / "until-and-delays.scenario.yaml") as bridge:
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        assert host.call(session, "x/answer-then-exit", {}).json() == {"result": {"ok": True}}
        with pytest.raises(ScenarioMockError, match=r"answers this route 1 time\(s\)"):
            host.call(session, "x/answer-then-exit", {})
        assert host.http.get("/v1/sessions").json()["sessions"][0]["state"] == "exited"
        events = host.events(session)
        assert [e["method"] for e in events][-2:] == ["custom/hello", None]
        assert events[-1]["params"]["stderrTail"] == "leaving now"


def test_steps_the_host_never_made_fail_when_the_mock_stops() -> None:
    bridge = scenario_router(LIBRARY / "approval-long-poll.scenario.yaml")
    bridge.start()
    host = SyncHost(bridge.base_url)
    session = host.create_session()
    host.call(session, "thread/start", {})
    with pytest.raises(AssertionError) as raised:
        bridge.stop()
    message = str(raised.value)
    assert "scenario approval-long-poll: 5 step(s) the host never made" in message
    assert "\n  step 3 (call turn/start, " in message
    assert "approval-long-poll.scenario.yaml:" in message
    # The poll through the request: the session's first event, the turn's, the request.
    assert f"events up to #8 of session {session} never read (read: 0)" in message
    assert "\n  step 7 (the same request cannot be answered twice, " in message

    quiet = scenario_router(LIBRARY / "approval-long-poll.scenario.yaml", assert_all_called=False)
    with quiet:
        SyncHost(quiet.base_url).create_session()
    assert len(quiet.unserved()) == 6


def test_an_invalid_body_gets_the_bridges_400_and_leaves_the_step_for_later() -> None:
    with scenario_router(LIBRARY / "until-and-delays.scenario.yaml") as bridge:
        http = httpx.Client(base_url=bridge.base_url)
        bad = http.post("/v1/sessions", json={"options": {"clientInfo": {"name": 7}}})
        with pytest.raises(errors.RestError) as expected:
            validate_body(SessionCreateRequest, bad.request.content)
        assert bad.status_code == 400
        assert bad.json() == expected.value.payload()
        not_json = http.post("/v1/sessions", content=b"{not json")
        assert not_json.json()["message"] == "The request body is not valid JSON."
        created = http.post("/v1/sessions", json={})
        assert created.status_code == 201
        session = created.json()["sessionId"]
        assert session == bridge.variables["session"]
        http.post(f"/v1/sessions/{session}/call/x/answer-then-exit", json={"params": {}})
        http.get("/v1/sessions")
        assert http.get(f"/v1/sessions/{session}/events", params={"after": 0}).status_code == 200
        for _ in range(3):
            http.get(f"/v1/sessions/{session}/events")
        assert http.get(f"/v1/sessions/{session}/events").json()["error"] == "session_exited"


# -- events wait for the request they come after ------------------------------------------------


def test_a_long_poll_before_the_reply_gets_nothing_and_a_loop_fails_naming_the_reply() -> None:
    bridge = scenario_router(
        LIBRARY / "approval-long-poll.scenario.yaml", max_idle_polls=2, assert_all_called=False
    )
    with bridge:
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        thread = host.call(session, "thread/start", {}).json()["result"]["thread"]["id"]
        path = f"/v1/sessions/{session}/events"
        assert host.http.get(path).status_code == 204  # before turn/start: nothing yet
        host.call(session, "turn/start", {"threadId": thread, "input": []})
        kinds = [host.http.get(path).json()["kind"] for _ in range(8)]
        assert kinds == ["notification"] * 7 + ["request"]
        assert [host.http.get(path).status_code for _ in range(2)] == [204, 204]
        with pytest.raises(ScenarioMockError) as raised:
            host.http.get(path)
        message = str(raised.value)
        assert "long-polled session" in message
        assert "#9 serverRequest/resolved" in message
        assert "comes only after step 6 (reply, " in message


@pytest.mark.asyncio
async def test_an_async_long_poll_is_answered_once_a_concurrent_reply_is_made() -> None:
    with scenario_router(LIBRARY / "approval-long-poll.scenario.yaml") as bridge:
        host = AsyncHost(bridge.base_url)
        session = await host.create_session()
        thread = (await host.call(session, "thread/start", {}))["thread"]["id"]
        await host.call(session, "turn/start", {"threadId": thread, "input": []})
        request = (await host.until(session, kind="request"))[-1]
        waiting = asyncio.ensure_future(host.next_event(session, waitMs=30000))
        await host.reply(session, request["requestKey"], {"decision": "decline"})
        await host.reply(session, request["requestKey"], {"decision": "decline"})
        event = await waiting
        assert event is not None
        assert event["method"] == "serverRequest/resolved"
        await host.until(session, method="turn/completed")
        await host.http.aclose()


def test_a_sync_stream_reader_ahead_of_the_scenario_fails_naming_the_missing_request() -> None:
    bridge = scenario_router(
        LIBRARY / "turn-stream-and-resume.scenario.yaml",
        release_timeout=0,
        assert_all_called=False,
    )
    with bridge:
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        with pytest.raises(ScenarioMockError) as raised:
            host.events(session)
    assert "comes only after step 4 (call turn/start, " in str(raised.value)


# -- options -----------------------------------------------------------------------------------


def test_strict_bodies_compare_each_request_with_the_steps() -> None:
    with scenario_router(
        LIBRARY / "error-payloads.scenario.yaml", strict_bodies=True, assert_all_called=False
    ) as bridge:
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        assert host.call(session, "x/fail", {}).status_code == 502
        with pytest.raises(ScenarioMockError, match="the body differs") as raised:
            host.call(session, "x/busy", {"extra": True})
    assert "params" in str(raised.value)


def test_made_up_values_depend_on_the_seed_only() -> None:
    path = LIBRARY / "approval-long-poll.scenario.yaml"
    first = scenario_router(path, assert_all_called=False).variables
    again = scenario_router(path, assert_all_called=False).variables
    other = scenario_router(path, seed=1, assert_all_called=False).variables
    assert first == again
    assert first["s1"] != other["s1"]
    assert first["thread"] != other["thread"]


def test_a_scenario_given_as_a_mapping_behind_a_base_url_with_a_path() -> None:
    scenario = {
        "name": "mapped",
        "bridge": {"preset": "text-turn"},
        "appServer": {"version": 1, "turns": ["Hello from a mapping."]},
        "steps": [
            {
                "http": {"method": "POST", "path": "${base}/v1/text-turn", "json": {"text": "hi"}},
                "expect": {"jsonSubset": {"text": "Hello from a mapping."}},
                "capture": {"thread": "$.threadId"},
            },
            {"http": {"path": "/v1/compatibility"}, "expect": {"jsonPath": {"$.appServer": {}}}},
        ],
    }
    with pytest.raises(MockBuildError, match="no made-up response satisfies the step"):
        scenario_router(scenario)
    scenario["steps"][1]["expect"] = {"jsonPath": {"$.appServer.version": "0.169.0"}}
    base = "https://bridge.internal:9443/codex"
    with scenario_router(scenario, base_url=base) as bridge:
        http = httpx.Client(base_url=base)
        turn = http.post("/v1/text-turn", json={"text": "hi"}).json()
        assert turn["text"] == "Hello from a mapping."
        assert turn["threadId"] == bridge.variables["thread"]
        assert http.get("/v1/compatibility").json()["appServer"]["version"] == "0.169.0"
        with pytest.raises(UnmatchedRequest):
            httpx.get("https://bridge.internal:9443/v1/compatibility")


# -- what cannot be mocked fails at build time -------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (
            [{"http": {"path": "/health"}, "expect": {"json": {"status": "ok"}, "status": 200}}],
            r"step 1 \(http GET /health, <scenario>\).*\n.*no made-up response.*\n.*contract",
        ),
        (
            [{"http": {"path": "/v1/sessions"}, "expect": {"jsonPath": {"$..x": 1}}}],
            r"cannot be written",
        ),
        (
            [
                {"createSession": "s"},
                {"http": {"path": "/v1/sessions/${s}/events"}},
            ],
            r"(?s)step 2 .*read events with `poll` or `stream`",
        ),
        (
            [
                {"createSession": "s"},
                {"poll": {"session": "${s}", "through": "turn/completed"}},
                {"poll": {"session": "${s}", "through": {"seq": 1}}},
            ],
            r"(?s)step 3 .*no events satisfy the read.*no event matches \{\"seq\": 1\}",
        ),
        (
            [
                {
                    "http": {"path": "/health"},
                    "expect": {"jsonSubset": {"version": {"$regex": "^(?=x)y"}}},
                }
            ],
            r"cannot make up a string matching /\^\(\?=x\)y/",
        ),
        (
            [{"http": {"path": "/v1/sessions", "auth": False}, "expect": {"status": 200}}],
            r"rejects this request .*401 unauthorized",
        ),
    ],
)
def test_a_step_the_mock_cannot_answer_fails_at_build_time(
    steps: list[dict[str, Any]], message: str
) -> None:
    scenario = {"bridge": {"token": "t0k3n"}, "steps": steps}
    with pytest.raises(MockBuildError, match=message) as raised:
        scenario_router(scenario)
    assert isinstance(raised.value, ScenarioError)


def test_a_background_call_never_awaited_gets_what_the_script_answers() -> None:
    scenario = {
        "appServer": {"version": 1, "methods": {"x/later": {"result": {"done": True}}}},
        "steps": [
            {"createSession": "s"},
            {"call": {"session": "${s}", "method": "x/later", "params": {}}, "background": "b"},
        ],
    }
    with scenario_router(scenario) as bridge:
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        assert host.call(session, "x/later", {}).json() == {"result": {"done": True}}


@pytest.mark.parametrize(
    ("scripted", "expect", "status", "kind"),
    [
        ({}, {"status": [400, 404], "error": "session_not_found"}, 404, "session_not_found"),
        ({}, {"status": "5xx"}, 502, "app_server_error"),
        ({}, {"status": "4xx", "error": "session_exited"}, 409, "session_exited"),
        ({"error": {"code": -32001, "message": "m"}}, {"status": "5xx"}, 503, None),
        ({"result": {}}, {}, 200, None),
    ],
)
def test_the_status_a_step_allows_is_the_one_the_bridge_would_give(
    scripted: dict[str, Any], expect: dict[str, Any], status: int, kind: str | None
) -> None:
    """A status class or list lets the bridge's plausible answer (here: the script's)
    through; otherwise the expected error kind decides."""
    scenario = {
        "appServer": {"version": 1, "methods": {"x/m": scripted}} if scripted else None,
        "steps": [
            {"createSession": "s"},
            {"call": {"session": "${s}", "method": "x/m", "params": {}}, "expect": expect},
        ],
    }
    if not scripted:
        del scenario["appServer"]
    with scenario_router(scenario) as bridge:
        host = SyncHost(bridge.base_url)
        answer = host.call(host.create_session(), "x/m", {})
    assert answer.status_code == status
    if kind is not None:
        assert answer.json()["error"] == kind
    if status == 503:
        assert answer.json() == {"error": "app_server_overloaded", "message": "m", "code": -32001}
