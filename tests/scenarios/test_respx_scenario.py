"""Host code using httpx against the respx mock replaying a scenario's cassette.

The host code here is written the way a host team would write it (a small client over
`httpx.Client` / `httpx.AsyncClient`), not step by step from the scenario; the replay
must answer it as the bridge did, fail loudly where the recording has no answer, and
check at the end that every recorded exchange was made. Each test records its cassette
from a copy of a library scenario in its own temporary folder (the real bridge and
fake-codex run once, for the recording).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from front_here import Ran, main_here
from respx.models import AllMockedAssertionError

from scenarios.cassette import COMMAND, Cassette, StaleCassette, cassette_for, cassette_path
from scenarios.format import load_scenario
from scenarios.respx_mock import ScenarioMockError, UnmatchedRequest, scenario_router

LIBRARY = Path(__file__).resolve().parents[2] / "scenarios" / "library"


@pytest.fixture
def library(tmp_path: Path) -> Any:
    """A copy of a library scenario in this test's folder, with its cassette recorded
    there (explicitly: under CI=true a missing cassette is never recorded on its own)."""

    def copy(name: str, record: bool = True) -> Path:
        target = tmp_path / f"{name}.scenario.yaml"
        shutil.copy(LIBRARY / f"{name}.scenario.yaml", target)
        if record:
            cassette_for(load_scenario(target), record="once")
        return target

    return copy


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

    async def until(
        self,
        session: str,
        method: str | None = None,
        kind: str | None = None,
        after: int | None = None,
    ):
        """Long-poll (by the session's cursor, or from `after`) until an event of `method`
        (or `kind`); returns every event read."""
        read: list[dict[str, Any]] = []
        while True:
            query = {"waitMs": 1000} if after is None else {"waitMs": 1000, "after": after}
            event = await self.next_event(session, **query)
            if event is None:
                continue
            read.append(event)
            after = None if after is None else event["seq"]
            if event["method"] == method or event["kind"] == kind:
                return read

    async def reply(self, session: str, key: str, result: Any) -> httpx.Response:
        return await self.http.post(
            f"/v1/sessions/{session}/requests/{key}/result", json={"result": result}
        )


# -- scenarios from the library ------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_host_answers_an_approval_by_long_poll(library: Any) -> None:
    with scenario_router(library("approval-long-poll")) as bridge:
        host = AsyncHost(bridge.base_url)
        session = await host.create_session()
        thread = (await host.call(session, "thread/start", {}))["thread"]["id"]
        text = [{"type": "text", "text": "touch the file"}]
        await host.call(session, "turn/start", {"threadId": thread, "input": text})
        before = await host.until(session, kind="request")
        request = before[-1]
        assert request["method"] == "item/commandExecution/requestApproval"
        assert request["params"]["threadId"] == thread
        assert "touch proof.txt" in request["params"]["command"]
        assert [event["seq"] for event in before] == list(range(1, len(before) + 1))

        answered = await host.reply(session, request["requestKey"], {"decision": "decline"})
        assert answered.json() == {"status": "sent", "requestKey": request["requestKey"]}
        again = await host.reply(session, request["requestKey"], {"decision": "accept"})
        assert again.status_code == 409
        assert again.json()["error"] == "request_already_answered"

        after = await host.until(session, method="turn/completed", after=request["seq"])
        texts = [
            event["params"]["item"].get("text")
            for event in after
            if event["method"] == "item/completed"
        ]
        assert texts[-2:] == ["Fine, I won't.", "Done."]
        assert after[0]["seq"] == request["seq"] + 1
        await host.http.aclose()
    # Leaving the block ran assert_all_called: every recorded exchange was made.


def test_sync_host_reads_a_turn_over_sse_and_resumes_after_an_id(library: Any) -> None:
    with scenario_router(library("turn-stream-and-resume")) as bridge:
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        with host.http.stream("GET", f"/v1/sessions/{session}/events/stream") as stream:
            thread = host.call(session, "thread/start", {}).json()["result"]["thread"]["id"]
            started = host.call(
                session,
                "turn/start",
                {"threadId": thread, "input": [{"type": "text", "text": "hi"}]},
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
async def test_async_host_replies_to_a_server_request_while_its_call_waits(library: Any) -> None:
    with scenario_router(library("server-request-error-reply")) as bridge:
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


@pytest.mark.quick
def test_the_cassette_is_vcrpys_format_and_kept_beside_the_scenario(library: Any) -> None:
    path = library("auth-rejection")
    with scenario_router(path, assert_all_called=False):
        pass
    cassette = cassette_path(path)
    assert cassette == path.parent / "cassettes" / "auth-rejection.yaml"
    document = yaml.safe_load(cassette.read_text())
    assert document["version"] == 1
    first = document["interactions"][0]
    assert set(first) == {"request", "response", "codex"}
    assert set(first["request"]) == {"body", "headers", "method", "uri"}
    assert first["request"]["uri"].startswith("http://bridge.test/")
    assert set(first["response"]) == {"status", "headers", "body"}
    assert set(first["response"]["status"]) == {"code", "message"}
    assert isinstance(first["response"]["body"]["string"], str)
    assert document["codex"]["hash"].startswith("sha256:")


@pytest.mark.quick
def test_a_stale_cassette_fails_naming_the_command_and_is_rerecorded_on_demand(
    library: Any,
) -> None:
    path = library("auth-rejection")
    recorded = cassette_path(path).read_text()
    # Comments and layout are not the scenario's content: the cassette stays fresh.
    path.write_text("# a comment\n" + path.read_text())
    scenario_router(path, assert_all_called=False)
    assert cassette_path(path).read_text() == recorded
    path.write_text(path.read_text().replace("name: auth-rejection", "name: auth-renamed"))
    with pytest.raises(StaleCassette) as raised:
        scenario_router(path)
    message = str(raised.value)
    assert "is older than its scenario" in message
    assert f"regenerate it: {COMMAND} {path}" in message
    assert cassette_path(path).read_text() == recorded
    with pytest.raises(StaleCassette, match="has no cassette"):
        scenario_router(library("limits", record=False), record="none")
    fresh = scenario_router(path, record="refresh", assert_all_called=False)
    assert fresh.cassette.scenario == "auth-renamed"
    assert Cassette.load(cassette_path(path)).hash == fresh.cassette.hash != ""


def test_sync_host_gets_the_bridges_own_bytes(library: Any) -> None:
    path = library("error-payloads")
    with scenario_router(path, assert_all_called=False) as bridge:  # not the whole scenario
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        failed = host.call(session, "x/fail", {})
        recorded = next(
            item for item in bridge.cassette.interactions if item.path.endswith("/x/fail")
        )
        assert failed.status_code == 502
        assert failed.content == recorded.response_body.encode()
        assert failed.json() == {
            "error": "app_server_error",
            "message": "nope",
            "code": -32050,
            "data": {"k": [1, 2]},
        }
        busy = host.call(session, "x/busy", {})
        assert (busy.status_code, busy.headers["Retry-After"]) == (503, "1")


@pytest.mark.quick
def test_a_call_no_route_matches_fails_with_the_known_routes(library: Any) -> None:
    with (
        scenario_router(library("auth-rejection"), assert_all_called=False) as bridge,
        pytest.raises(UnmatchedRequest) as raised,
    ):
        httpx.Client(base_url=bridge.base_url).get("/v1/sessions/no-such-session/events")
    message = str(raised.value)
    assert "no route of the mocked bridge matches GET http://bridge.test/v1/sessions/" in message
    assert "known routes:" in message
    assert "\n  GET http://bridge.test/v1/sessions  — step 2 (" in message
    assert "auth-rejection.scenario.yaml:" in message
    assert isinstance(raised.value, AllMockedAssertionError)  # what respx users catch
    assert [r.url.path for r in bridge.unmatched] == ["/v1/sessions/no-such-session/events"]
    with pytest.raises(UnmatchedRequest, match=r"GET http://elsewhere.test/health"), bridge:
        httpx.get("http://elsewhere.test/health")


def test_requests_unlike_the_recorded_ones_fail_saying_how(library: Any) -> None:
    with scenario_router(library("auth-rejection"), assert_all_called=False) as bridge:
        http = httpx.Client(base_url=bridge.base_url)
        # The scenario sends its token on this route: no token is not what it recorded.
        with pytest.raises(ScenarioMockError, match="Authorization: another value instead of"):
            http.get("/v1/sessions", headers={"Authorization": "Token never-recorded"})
    with scenario_router(library("until-and-delays"), assert_all_called=False) as bridge:
        host = SyncHost(bridge.base_url)
        with pytest.raises(ScenarioMockError) as raised:
            host.http.post("/v1/sessions", json={"options": {"model": "other"}})
        assert "the body at $.options: unexpected key" in str(raised.value)
        # No body is `{}` to the bridge, as the recorded `{}` is.
        session = str(host.http.post("/v1/sessions").json()["sessionId"])
        assert host.call(session, "x/answer-then-exit", {}).json() == {"result": {"ok": True}}
        with pytest.raises(ScenarioMockError, match=r"answers this route 1 time\(s\)"):
            host.call(session, "x/answer-then-exit", {})
    with scenario_router(
        library("until-and-delays"), check_bodies=False, assert_all_called=False
    ) as bridge:
        host = SyncHost(bridge.base_url)
        session = str(host.http.post("/v1/sessions", json={"x": 1}).json()["sessionId"])
        host.call(session, "x/answer-then-exit", {"anything": True})
        assert host.http.get("/v1/sessions").json()["sessions"][0]["state"] == "exited"


def test_values_that_vary_between_runs_match_any_of_their_kind(library: Any) -> None:
    # The recording sent its own ${tmp}/no-such-directory; a host has another folder.
    with scenario_router(library("text-turn-busy")) as bridge:
        http = httpx.Client(base_url=bridge.base_url, timeout=30)
        holder = http.post("/v1/text-turn", json={"text": "hold the slot", "timeoutMs": 3000})
        assert holder.status_code == 504
        probe = {"text": "probe", "options": {"cwd": "/somewhere/else/no-such-directory"}}
        with pytest.raises(ScenarioMockError, match=r"at \$.options.cwd"):
            http.post("/v1/text-turn", json={**probe, "options": {"cwd": "/elsewhere"}})
        refused = http.post("/v1/text-turn", json=probe)
        assert (refused.status_code, refused.json()["error"]) == (429, "busy")
        assert http.post("/v1/text-turn", json={"text": "my turn now"}).status_code == 200


def test_exchanges_the_host_never_made_fail_when_the_mock_stops(library: Any) -> None:
    bridge = scenario_router(library("approval-long-poll"))
    bridge.start()
    host = SyncHost(bridge.base_url)
    session = host.create_session()
    host.call(session, "thread/start", {})
    with pytest.raises(AssertionError) as raised:
        bridge.stop()
    message = str(raised.value)
    assert "scenario approval-long-poll: " in message
    assert "recorded exchange(s) the host never made (assert_all_called):" in message
    assert "\n  step 3 (call turn/start, " in message
    assert "approval-long-poll.scenario.yaml:" in message
    assert f"GET /v1/sessions/{session}/events?" in message
    assert "never requested" in message


def test_a_long_poll_with_another_token_gets_nothing_and_a_loop_fails_saying_why(
    tmp_path: Path,
) -> None:
    path = tmp_path / "polled.scenario.yaml"
    path.write_text(
        "scenario: 1\nbridge: {token: s3cret}\nsteps:\n  - createSession: s\n"
        '  - poll: {session: "${s}"}\n'
    )
    cassette_for(load_scenario(path), record="once")
    with scenario_router(path, assert_all_called=False) as bridge:
        assert bridge.token == "s3cret"
        host = SyncHost(bridge.base_url, token=bridge.token)
        session = host.create_session()
        events = f"/v1/sessions/{session}/events"
        polled = 0
        with pytest.raises(ScenarioMockError) as raised:  # noqa: PT012 (a host's loop)
            while polled < 30:
                polled += 1
                wrong = host.http.get(events, headers={"Authorization": "Bearer nope"})
                assert wrong.status_code == 204
        assert polled == 21
        assert "Authorization: another value instead of the scenario's token" in str(raised.value)
        assert host.http.get(events).json()["seq"] == 1


def test_a_long_poll_before_its_request_gets_nothing_and_a_loop_fails_naming_it(
    library: Any,
) -> None:
    with scenario_router(
        library("approval-long-poll"), assert_all_called=False, max_idle_polls=3
    ) as bridge:
        host = SyncHost(bridge.base_url)
        session = host.create_session()
        thread = host.call(session, "thread/start", {}).json()["result"]["thread"]["id"]
        # The approval request comes after turn/start, which this host has not made.
        polls = [
            host.http.get(f"/v1/sessions/{session}/events", params={"waitMs": 10}) for _ in range(3)
        ]
        assert {poll.status_code for poll in polls[1:]} <= {200, 204}
        got = [poll for poll in polls if poll.status_code == 200]
        polled = 0
        with pytest.raises(ScenarioMockError) as raised:  # noqa: PT012 (a host's loop)
            while polled < 10:
                polled += 1
                host.http.get(f"/v1/sessions/{session}/events", params={"waitMs": 10})
        assert polled < 10
        assert "comes only after step 3 (call turn/start" in str(raised.value)
        assert all(event.json()["kind"] != "request" for event in got)
        assert thread


@pytest.mark.asyncio
async def test_an_async_long_poll_is_answered_once_a_concurrent_request_is_made(
    library: Any,
) -> None:
    with scenario_router(library("approval-long-poll"), assert_all_called=False) as bridge:
        host = AsyncHost(bridge.base_url)
        session = await host.create_session()
        thread = (await host.call(session, "thread/start", {}))["thread"]["id"]
        text = [{"type": "text", "text": "touch the file"}]
        waiting = asyncio.ensure_future(host.until(session, kind="request"))
        await host.call(session, "turn/start", {"threadId": thread, "input": text})
        events = await asyncio.wait_for(waiting, 30)
        request = events[-1]
        assert request["kind"] == "request"
        await host.reply(session, request["requestKey"], {"decision": "decline"})
        # The scenario reads the rest with `after`; a host reading by the session's
        # cursor gets the same events.
        rest = await host.until(session, method="turn/completed")
        assert [event["seq"] for event in rest] == list(
            range(request["seq"] + 1, request["seq"] + 1 + len(rest))
        )
        await host.http.aclose()


@pytest.mark.quick
def test_a_test_adds_routes_of_its_own_for_what_the_scenario_does_not_make(
    library: Any,
) -> None:
    """What the former OpenAPI-document mock gave (any answer to any route) is respx's
    own routes on the same router; the replayed routes come first."""
    with scenario_router(library("auth-rejection"), assert_all_called=False) as bridge:
        listed = bridge.get("/v1/sessions/abc/events").respond(204)
        http = httpx.Client(base_url=bridge.base_url)
        assert http.get("/health").json()["status"] == "ok"  # replayed
        assert http.get("/v1/sessions/abc/events").status_code == 204
        assert listed.called


@pytest.mark.quick
def test_a_scenario_given_as_a_mapping_behind_a_base_url_with_a_path() -> None:
    scenario = {
        "name": "inline",
        "bridge": {"token": "t0k3n"},
        "steps": [{"http": {"method": "GET", "path": "/v1/sessions"}}],
    }
    with scenario_router(scenario, base_url="https://example.test/bridge/") as bridge:
        assert bridge.token == "t0k3n"
        http = httpx.Client(base_url=bridge.base_url, headers={"Authorization": "Bearer t0k3n"})
        assert http.get("/v1/sessions").json() == {"sessions": []}
        with pytest.raises(UnmatchedRequest):
            httpx.get("https://example.test/v1/sessions")


def test_the_command_records_checks_and_refuses_a_failing_scenario(
    library: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    good = library("auth-rejection", record=False)
    broken = good.parent / "sub" / "broken.scenario.yaml"
    broken.parent.mkdir()
    broken.write_text(
        "scenario: 1\nsteps:\n  - http: {method: GET, path: /health}\n    expect: {status: 418}\n"
    )

    def command(action: str, *args: str, spelling: str = "cli") -> Ran:
        """`rest-bridge scenarios ACTION-cassettes ARGS` run by its main in this process
        (what it prints and returns is the subject); the older spelling, `python -m
        scenarios.cassette ACTION ARGS`, as the process it is."""
        if spelling == "cli":
            with monkeypatch.context() as here:
                here.chdir(good.parent)
                code = main_here([f"{action}-cassettes", *args])
            printed = capsys.readouterr()
            return Ran(code, printed.out, printed.err)
        done = subprocess.run(
            [sys.executable, "-m", "scenarios.cassette", action, *args],
            cwd=good.parent,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        return Ran(done.returncode, done.stdout, done.stderr)

    checked = command("check", ".")
    assert checked.returncode == 1
    assert f"has no cassette (cassettes/auth-rejection.yaml); record it: {COMMAND}" in (
        checked.stderr
    )
    recorded = command("record", ".")
    assert recorded.returncode == 1
    assert "ok  cassettes/auth-rejection.yaml  (6 exchanges)" in recorded.stdout
    assert "FAILED  sub/broken.scenario.yaml: no cassette: the scenario must pass" in (
        recorded.stderr
    )
    assert "expected status 418, received 200" in recorded.stderr
    assert not (broken.parent / "cassettes").exists()
    assert command("check", "auth-rejection.scenario.yaml").returncode == 0
    cassette_path(good).write_text("not: [a cassette")
    broken_file = command("check", "auth-rejection.scenario.yaml", spelling="module")
    assert broken_file.returncode == 1
    where = "cassettes/auth-rejection.yaml:2:1: invalid YAML: did not find expected ','"
    assert f"not a cassette of this tool ({where}" in broken_file.stderr, broken_file.stderr
    assert f"regenerate it: {COMMAND} auth-rejection.scenario.yaml" in broken_file.stderr
    # A cassette is YAML read by the scenarios' loader: its aliases are bounded too.
    levels = "".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    cassette_path(good).write_text("a: &a [lol]\n" + levels)
    laughs = command("check", "auth-rejection.scenario.yaml", spelling="module")
    assert laughs.returncode == 1
    assert "invalid YAML: its aliases stand for more than 100000 nodes" in laughs.stderr, (
        laughs.stderr
    )
    rerecorded = command("record", "auth-rejection.scenario.yaml", spelling="module")
    assert rerecorded.returncode == 0, rerecorded.stderr
    assert "ok  cassettes/auth-rejection.yaml" in rerecorded.stdout
    assert command("replay", ".", spelling="module").returncode == 2  # a usage error
    nothing = command("check", "cassettes")  # no scenario in it: not a pass
    assert nothing.returncode == 5
    assert "no scenario files (*.scenario.yaml) in cassettes" in nothing.stderr
    assert Cassette.load(cassette_path(good)).interactions
