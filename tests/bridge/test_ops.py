"""The operations listener: metrics of real requests on real app-servers, the probes,
and what it never exposes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from cli_runs import main_here
from prometheus_client.parser import text_string_to_metric_families

from bridge import replica
from bridge.app import default_app, text_turn_app, trusted_bridge_app
from bridge.auth import with_bearer_auth
from bridge.limits import AppServerSettings, ReplicaSettings, RestLimits
from bridge.observe import observer
from bridge.ops import OpsListener
from bridge.policy import MethodPolicy
from bridge.routes import BACKEND

APPROVAL_SCRIPT = {
    "turns": [{"steps": [{"commandApproval": {"command": "true"}}, {"agentMessage": "done"}]}]
}

#: Methods aiohttp's parser knows and no route takes: each could be a label value.
WEBDAV = ("PROPFIND", "MKCOL", "LOCK", "UNLOCK", "COPY", "MOVE", "SEARCH", "REPORT", "PURGE")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(http: aiohttp.ClientSession, ops: str) -> Samples:
    async with http.get(f"{ops}/metrics") as response:
        assert response.status == 200
        assert response.content_type == "text/plain"
        text = await response.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {
        dict(have)[label] for (n, have), _ in samples.items() if n == name and label in dict(have)
    }


@pytest_asyncio.fixture
async def operated(
    serve: Callable[[web.Application], Awaitable[str]],
) -> AsyncIterator[Callable[..., Awaitable[tuple[str, str, OpsListener]]]]:
    """Serve an application with its operations listener on a free port: (api, ops, listener)."""
    listeners: list[OpsListener] = []

    async def start(app: web.Application, token: str | None = None) -> tuple[str, str, OpsListener]:
        if token is not None:
            with_bearer_auth(app, token)
        listener = OpsListener(app)
        listeners.append(listener)
        api = await serve(app)
        ops = await listener.start("127.0.0.1", 0)
        return api, f"http://{ops}", listener

    yield start
    for listener in listeners:
        await listener.close()


async def create_session(http: aiohttp.ClientSession, api: str, script: str | None = None) -> str:
    body = {"options": {"env": {"FAKE_CODEX_SCRIPT": script}}} if script else {}
    async with http.post(f"{api}/v1/sessions", json=body) as response:
        assert response.status == 201, await response.text()
        return str((await response.json())["sessionId"])


async def call(
    http: aiohttp.ClientSession, api: str, session: str, method: str, params: Any
) -> Any:
    async with http.post(
        f"{api}/v1/sessions/{session}/call/{method}", json={"params": params}
    ) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["result"]


async def readyz(http: aiohttp.ClientSession, ops: str) -> tuple[int, dict[str, Any]]:
    async with http.get(f"{ops}/readyz") as response:
        return response.status, await response.json()


async def until(predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = 60) -> None:
    """Wait until ``predicate()`` holds: for states a client has no event for."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)  # sync-ok: a gauge, a restart: no event to wait on


async def answers(http: aiohttp.ClientSession, ops: str, status: int) -> bool:
    return (await readyz(http, ops))[0] == status


async def in_flight(http: aiohttp.ClientSession, ops: str, name: str) -> bool:
    """No request of ``name`` in flight."""
    return value(await scrape(http, ops), name) == 0


async def polls(http: aiohttp.ClientSession, ops: str, count: int) -> bool:
    return value(await scrape(http, ops), "rest_bridge_long_polls") == count


@pytest.mark.asyncio
async def test_requests_are_counted_by_route_template_and_sessions_by_state(
    operated, fake_codex, http
):
    api, ops, listener = await operated(trusted_bridge_app(fake_codex))
    await listener.readiness.probed.wait()
    sessions = [await create_session(http, api) for _ in range(3)]
    for session in sessions:
        await call(http, api, session, "thread/start", {})
    async with http.delete(f"{api}/v1/sessions/{sessions[0]}") as response:
        assert response.status == 200
    samples = await scrape(http, ops)
    count = "http_server_request_duration_seconds_count"
    assert value(samples, count, http_route="/v1/sessions", http_request_method="POST") == 3
    call_route = "/v1/sessions/{sessionId}/call/{method}"
    assert value(samples, count, http_route=call_route, http_response_status_class="2xx") == 3
    assert value(samples, "rest_bridge_sessions", state="running", mode="process") == 2
    # 3 sessions and the readiness probe's app-server; the deleted one's exit counted.
    assert value(samples, "rest_bridge_app_server_spawns_total", mode="process") == 4
    assert value(samples, "rest_bridge_app_server_exits_total") == 2
    assert value(samples, "rest_bridge_events_appended_total") >= 3
    assert value(samples, "rest_bridge_event_log_bytes") > 0
    assert value(samples, "rest_bridge_ready") == 1
    assert value(samples, "http_server_active_requests") == 0


@pytest.mark.asyncio
async def test_no_caller_can_grow_the_label_sets(operated, fake_codex, http):
    """Many distinct paths, session ids and methods: the same few label values."""
    api, ops, _ = await operated(trusted_bridge_app(fake_codex))
    session = await create_session(http, api)
    for n in range(60):
        async with http.get(f"{api}/v1/sessions/{uuid.uuid4()}/events?waitMs=1") as response:
            assert response.status == 404
        async with http.get(f"{api}/no/such/{n}/path-{uuid.uuid4()}") as response:
            assert response.status == 404
        verb = WEBDAV[n % len(WEBDAV)]  # aiohttp's parser refuses methods it does not know
        async with http.request(verb, f"{api}/v1/sessions") as response:
            assert response.status == 405
        async with http.post(
            f"{api}/v1/sessions/{session}/call/method-{n}", json={"params": {}}
        ) as response:
            assert response.status == 502  # the fake answers: method not found
    samples = await scrape(http, ops)
    name = "http_server_request_duration_seconds_count"
    routes = label_values(samples, name, "http_route")
    assert routes == {
        "/v1/sessions",
        "/v1/sessions/{sessionId}/events",
        "/{path}",
        "/v1/sessions/{sessionId}/call/{method}",
    }
    assert label_values(samples, name, "http_request_method") == {"GET", "POST", "_OTHER"}
    text = repr(samples)
    assert session not in text
    assert "PROPFIND" not in text
    assert "method-" not in text
    assert len(samples) < 200


@pytest.mark.asyncio
async def test_refusals_are_counted_by_kind(operated, fake_codex, http, write_script):
    limits = RestLimits(max_sessions=1, max_body_bytes=1000)
    app = trusted_bridge_app(
        fake_codex, limits, AppServerSettings(), MethodPolicy(refuse=frozenset({"thread/list"}))
    )
    api, ops, _ = await operated(app, token="s3cret-token")
    auth = {"Authorization": "Bearer s3cret-token"}
    async with http.get(f"{api}/v1/sessions") as response:
        assert response.status == 401
    async with http.post(f"{api}/v1/sessions", json={"x": "y" * 2000}, headers=auth) as response:
        assert response.status == 413
    async with http.post(f"{api}/v1/sessions", json={}, headers=auth) as response:
        session = (await response.json())["sessionId"]
    async with http.post(f"{api}/v1/sessions", json={}, headers=auth) as response:
        assert response.status == 429
    async with http.post(
        f"{api}/v1/sessions/{session}/call/thread/list", json={}, headers=auth
    ) as response:
        assert response.status == 403
    samples = await scrape(http, ops)
    kinds = {
        dict(labels)["kind"]: v
        for (name, labels), v in samples.items()
        if name == "rest_bridge_refusals_total"
    }
    assert kinds == {
        "unauthorized": 1,
        "payload_too_large": 1,
        "session_limit_reached": 1,
        "method_not_allowed": 1,
    }
    # The ops listener has no auth of its own and needs none: it is not the API.
    assert "s3cret-token" not in repr(samples)


@pytest.mark.asyncio
async def test_an_approval_wait_and_a_text_turn_are_observed(
    operated, fake_codex, http, write_script
):
    api, ops, _ = await operated(trusted_bridge_app(fake_codex))
    session = await create_session(http, api, write_script(APPROVAL_SCRIPT))
    thread = (await call(http, api, session, "thread/start", {}))["thread"]["id"]
    params = {"threadId": thread, "input": [{"type": "text", "text": "hi"}]}
    await call(http, api, session, "turn/start", params)
    key = None
    while key is None:
        async with http.get(f"{api}/v1/sessions/{session}/events?waitMs=30000") as response:
            event = await response.json()
        if event["kind"] == "request":
            key = event["requestKey"]
    samples = await scrape(http, ops)
    assert value(samples, "rest_bridge_server_requests_pending") == 1
    assert value(samples, "rest_bridge_server_request_wait_seconds_count") == 0
    url = f"{api}/v1/sessions/{session}/requests/{key}/result"
    async with http.post(url, json={"result": {"decision": "accept"}}) as response:
        assert response.status == 200
    samples = await scrape(http, ops)
    assert value(samples, "rest_bridge_server_requests_pending") == 0
    assert value(samples, "rest_bridge_server_request_wait_seconds_count", outcome="replied") == 1
    async with http.post(f"{api}/v1/text-turn", json={"text": "hello"}) as response:
        assert response.status == 200
    samples = await scrape(http, ops)
    turns = "rest_bridge_text_turn_duration_seconds_count"
    assert value(samples, turns, outcome="completed") == 1
    assert value(samples, "rest_bridge_text_turn_first_event_seconds_count") == 1


@pytest.mark.asyncio
async def test_streams_and_long_polls_in_flight_are_gauges(operated, fake_codex, http):
    api, ops, _ = await operated(trusted_bridge_app(fake_codex))
    session = await create_session(http, api)
    stream = await http.get(f"{api}/v1/sessions/{session}/events/stream?after=0")
    assert stream.status == 200
    await stream.content.readline()  # the first event is written: the stream is attached
    samples = await scrape(http, ops)
    assert value(samples, "rest_bridge_sse_streams") == 1
    stream.close()
    poll = asyncio.ensure_future(
        http.get(f"{api}/v1/sessions/{session}/events?after=1000&waitMs=30000")
    )
    try:
        await until(lambda: polls(http, ops, 1), "the long-poll counted")
    finally:
        poll.cancel()
    # Both clients vanished: nothing stays counted in flight.
    await until(lambda: polls(http, ops, 0), "the vanished long-poll no longer counted")
    await until(lambda: in_flight(http, ops, "rest_bridge_sse_streams"), "the stream gone")
    samples = await scrape(http, ops)
    route = "/v1/sessions/{sessionId}/events"
    assert value(samples, "http_server_active_requests", http_route=route) == 0


@pytest.mark.asyncio
async def test_compatibility_says_which_replica_answered_and_whether_it_drains(
    serve, fake_codex, http
):
    app = text_turn_app(fake_codex)
    drain = replica.configure(app[BACKEND], ReplicaSettings(replica_id="r-7"))
    base = await serve(app)
    async with http.get(f"{base}/v1/compatibility") as response:
        body = await response.json()
    assert (body["replica"], body["draining"]) == ("r-7", False)
    drain.start(asyncio.Event())
    async with http.get(f"{base}/v1/compatibility") as response:
        body = await response.json()
    assert (body["replica"], body["draining"]) == ("r-7", True)
    drain.cancel()


@pytest.mark.asyncio
async def test_readiness_while_the_app_server_cannot_start_and_while_draining(
    operated, http, tmp_path
):
    flag = tmp_path / "broken"
    flag.write_text("")
    # An app-server command that fails while the flag file exists.
    command = ["sh", "-c", f'test -e {flag} && exit 3; exec "$0" "$@"', *fake_codex_command()]
    app = trusted_bridge_app(command)
    backend = app[BACKEND]
    drain = replica.configure(backend, ReplicaSettings(replica_id="r-1"))
    _, ops, listener = await operated(app)
    await listener.readiness.probed.wait()
    status, body = await readyz(http, ops)
    assert status == 503
    assert body["error"] == "replica_unavailable"
    assert body["data"]["ready"] is False
    assert body["data"]["reasons"] == [
        "the app-server cannot be started or initialized (app_server_exited)"
    ]
    async with http.get(f"{ops}/livez") as response:
        assert response.status == 200
    flag.unlink()
    await listener.readiness.probed.wait()  # the next probe, after its backoff
    while listener.readiness.problem is not None:
        listener.readiness.probed.clear()
        await listener.readiness.probed.wait()
    assert await readyz(http, ops) == (200, {"ready": True, "reasons": []})
    drain.start(asyncio.Event())
    status, body = await readyz(http, ops)
    assert status == 503
    assert body["data"]["reasons"] == ["draining: the replica takes no new work"]
    samples = await scrape(http, ops)
    assert value(samples, "rest_bridge_ready", replica="r-1") == 0
    assert value(samples, "rest_bridge_draining", replica="r-1") == 1
    assert value(samples, "rest_bridge_app_server_start_failures_total") >= 1
    drain.cancel()


@pytest.mark.asyncio
async def test_a_failure_while_a_probe_ends_is_not_undone_by_its_success(
    operated, http, write_script, tmp_path
):
    """A probe answers `initialize`, then takes a while to stop its process: a start of
    the bridge's own that fails meanwhile is the newer news, and the probe's success
    does not make the replica ready again over it (the probe goes on instead)."""
    flag = tmp_path / "broken"
    flag.write_text("")
    # Once initialized, the process ignores the end of its input: stopping it takes the
    # grace period (then a signal), the window this test needs.
    script = write_script({"onInitialized": [{"stall": True}]})
    starting = [*fake_codex_command(), "--script", script]
    command = ["sh", "-c", f'test -e {flag} && exit 3; exec "$0" "$@"', *starting]
    app = trusted_bridge_app(command, RestLimits(shutdown_grace_ms=3000))
    api, ops, listener = await operated(app)
    await listener.readiness.probed.wait()
    assert (await readyz(http, ops))[0] == 503
    flag.unlink()
    # The next probe's `initialize` is answered: ready, while it stops its process.
    await until(lambda: answers(http, ops, 200), "ready once a probe starts")
    flag.write_text("")
    async with http.post(f"{api}/v1/sessions", json={}) as response:
        assert response.status == 502, await response.text()
    await listener.readiness.probed.wait()  # that probe has ended
    status, body = await readyz(http, ops)
    assert status == 503, body
    assert body["data"]["reasons"] == [
        "the app-server cannot be started or initialized (app_server_exited)"
    ]
    flag.unlink()
    await until(lambda: answers(http, ops, 200), "ready again once it starts")


#: An `initialize` that fails for one client name only (codex refuses a name that cannot
#: be a header value: the bridge's own start is fine, the caller's is not).
REFUSED_NAME = {"name": "a\nb", "version": "1"}
REFUSED = {"code": -32600, "message": "Invalid request: refused"}
REFUSING_SCRIPT = {"initialize": {"match": {"clientInfo": REFUSED_NAME}, "error": REFUSED}}


@pytest.mark.asyncio
@pytest.mark.parametrize("preset", ["default", "trusted"])
async def test_starts_a_caller_shaped_that_fail_are_counted_and_leave_the_replica_ready(
    operated, http, write_script, tmp_path, preset
):
    """A token holder cannot keep `/readyz` failing: a start that failed with what the
    caller asked for (its client name, cwd, environment) is counted by kind, and the
    bridge's own start (a probe) decides readiness."""
    command = [*fake_codex_command(), "--script", write_script(REFUSING_SCRIPT)]
    app = (default_app if preset == "default" else trusted_bridge_app)(command)
    api, ops, listener = await operated(app)
    # Failures ask for a probe at most once in this long (each probe is a process, and a
    # failure may cost its caller none: a missing cwd).
    listener.readiness.caller_probe_seconds = 3600
    await listener.readiness.probed.wait()
    assert await readyz(http, ops) == (200, {"ready": True, "reasons": []})
    asked = [({"clientInfo": REFUSED_NAME}, "app_server_error")]
    if preset == "trusted":
        asked += [
            ({"cwd": str(tmp_path / "missing")}, "app_server_spawn_failed"),
            ({"env": {"FAKE_CODEX_VERSION": "9.9.9"}}, "app_server_exited"),
        ]
    for options, kind in asked * 3:
        for path, body in (
            ("/v1/sessions", {"options": options}),
            ("/v1/text-turn", {"text": "hi", "options": options}),
        ):
            async with http.post(f"{api}{path}", json=body) as response:
                payload = await response.json()
                assert (response.status, payload["error"]) == (502, kind), payload
            assert await readyz(http, ops) == (200, {"ready": True, "reasons": []}), options
    await listener.readiness.settled()  # the probe a failure asks for, if one runs
    assert await readyz(http, ops) == (200, {"ready": True, "reasons": []})
    samples = await scrape(http, ops)
    failures = "rest_bridge_app_server_start_failures_total"
    for kind in {kind for _, kind in asked}:
        counted = sum(6 for _, k in asked if k == kind)
        assert value(samples, failures, mode="process", kind=kind) == counted, kind
    assert value(samples, "rest_bridge_ready") == 1
    # The processes: the failures' own (a missing cwd starts none), and two probes: the
    # first, at start, and the one the failures asked for.
    spawned = sum(6 for _, kind in asked if kind != "app_server_spawn_failed")
    assert value(samples, "rest_bridge_app_server_spawns_total") == spawned + 2
    # A start with the bridge's own settings still works, and still counts.
    async with http.post(f"{api}/v1/sessions", json={}) as response:
        assert response.status == 201, await response.text()


@pytest.mark.asyncio
async def test_a_broken_command_still_makes_the_replica_unready_whoever_starts_it(
    operated, http, write_script, tmp_path
):
    """The bridge's own command failing is the replica's problem: a start without
    options says so at once, and a start a caller shaped asks the probe, which finds it."""
    flag = tmp_path / "broken"
    command = ["sh", "-c", f'test -e {flag} && exit 3; exec "$0" "$@"', *fake_codex_command()]
    api, ops, listener = await operated(trusted_bridge_app(command))
    await listener.readiness.probed.wait()
    assert (await readyz(http, ops))[0] == 200
    flag.write_text("")
    for body in ({"options": {"clientInfo": {"name": "host", "version": "1"}}}, {}):
        async with http.post(f"{api}/v1/sessions", json=body) as response:
            assert response.status == 502, await response.text()
        await until(lambda: answers(http, ops, 503), f"not ready after {body}")
        _, payload = await readyz(http, ops)
        assert payload["data"]["reasons"] == [
            "the app-server cannot be started or initialized (app_server_exited)"
        ]
        flag.unlink()
        await until(lambda: answers(http, ops, 200), "ready again once it starts")
        flag.write_text("")


@pytest.mark.asyncio
async def test_readiness_while_the_shared_app_server_is_down(operated, fake_codex, http):
    app = trusted_bridge_app(fake_codex, None, AppServerSettings(mode="shared"))
    api, ops, listener = await operated(app)
    await listener.readiness.probed.wait()
    assert (await readyz(http, ops))[0] == 200
    async with http.get(f"{api}/v1/compatibility") as response:
        pid = (await response.json())["appServer"]["shared"]["pid"]
    os.kill(pid, signal.SIGKILL)
    await until(lambda: answers(http, ops, 503), "not ready once the app-server died")
    status, body = await readyz(http, ops)
    assert status == 503
    assert any("shared app-server" in reason for reason in body["data"]["reasons"])
    samples = await scrape(http, ops)
    assert value(samples, "rest_bridge_shared_app_server_restarts_total") == 1
    assert value(samples, "rest_bridge_sessions", mode="shared") == 0
    await until(lambda: answers(http, ops, 200), "ready again once restarted")
    assert value(await scrape(http, ops), "rest_bridge_shared_app_server_up") == 1


def fake_codex_command() -> list[str]:
    from scenarios.harness import fake_codex_command as command

    return [*command(), "app-server"]


@pytest.mark.asyncio
async def test_the_ops_listener_shows_no_token_id_path_or_content(operated, fake_codex, http):
    """An attacker on the operations port, after callers sent secrets everywhere they
    could: the metrics and probes hold none of it, and neither port serves the other's
    routes."""
    token = "tok-" + uuid.uuid4().hex
    secret = "secret-" + uuid.uuid4().hex
    api, ops, listener = await operated(trusted_bridge_app(fake_codex), token=token)
    auth = {"Authorization": f"Bearer {token}"}
    async with http.post(f"{api}/v1/sessions", json={}, headers=auth) as response:
        session = (await response.json())["sessionId"]
    for path in (
        f"/v1/sessions/{session}/call/{secret}",
        f"/v1/sessions/{secret}/events?waitMs=1&after={secret}",
        f"/{secret}/x?{secret}={secret}",
    ):
        for headers in (auth, {"Authorization": f"Bearer {secret}"}, {}):
            async with http.post(
                f"{api}{path}", json={"params": {secret: secret}}, headers=headers
            ):
                pass
    await listener.readiness.probed.wait()
    seen = ""
    for route in ("/metrics", "/livez", "/readyz"):
        async with http.get(f"{ops}{route}") as response:
            assert response.status == 200
            seen += await response.text()
    for leaked in (token, secret, session, session.split("-")[0], "Bearer"):
        assert leaked not in seen
    # Nothing new on the API's port (no auth exemption either), no API on the ops port.
    for route in ("/metrics", "/livez", "/readyz"):
        async with http.get(f"{api}{route}") as response:
            assert response.status == 401
        async with http.get(f"{api}{route}", headers=auth) as response:
            assert response.status == 404
    for route in ("/v1/sessions", "/health", f"/v1/sessions/{session}"):
        async with http.get(f"{ops}{route}") as response:
            assert response.status == 404
            assert (await response.json())["error"] == "not_found"


REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))


@pytest.mark.quick
@pytest.mark.parametrize("value", ["65536", "-1", " 80", "\uff18\uff10", "http"])
def test_serve_refuses_an_ops_port_that_is_not_one(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before anything starts. Run by the CLI's own main in this process
    (tests/cli_runs.py); the test below runs the console script."""
    env = {"REST_ADAPTER_OPS_PORT": value}
    done = main_here(["serve", "--port", "0", "--app-server", "true"], monkeypatch, env)
    assert done.returncode == 2
    assert "REST_ADAPTER_OPS_PORT" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_stops_when_its_ops_port_is_taken() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [REST_BRIDGE, "serve", "--port", "0", "--ops-port", str(port), "--app-server", "true"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port} (--ops-port)" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.asyncio
async def test_a_request_its_session_ended_on_is_observed_as_abandoned(
    operated, fake_codex, http, write_script
):
    api, ops, _ = await operated(trusted_bridge_app(fake_codex))
    session = await create_session(http, api, write_script(APPROVAL_SCRIPT))
    thread = (await call(http, api, session, "thread/start", {}))["thread"]["id"]
    params = {"threadId": thread, "input": [{"type": "text", "text": "hi"}]}
    await call(http, api, session, "turn/start", params)
    while True:
        async with http.get(f"{api}/v1/sessions/{session}/events?waitMs=30000") as response:
            if (await response.json())["kind"] == "request":
                break
    async with http.delete(f"{api}/v1/sessions/{session}") as response:
        assert response.status == 200
    samples = await scrape(http, ops)
    wait = "rest_bridge_server_request_wait_seconds_count"
    assert value(samples, wait, outcome="abandoned") == 1
    assert value(samples, wait) == 1
    assert value(samples, "rest_bridge_server_requests_pending") == 0


@pytest.mark.asyncio
async def test_late_replies_of_the_app_server_are_counted(operated, fake_codex, http, write_script):
    """A call past its deadline, answered afterwards: one late reply, counted."""
    api, ops, _ = await operated(trusted_bridge_app(fake_codex))
    script = write_script({"methods": {"x/slow": {"steps": [{"sleep": 300}], "result": {}}}})
    session = await create_session(http, api, script)
    async with http.post(
        f"{api}/v1/sessions/{session}/call/x/slow", json={"params": {}, "timeoutMs": 20}
    ) as response:
        assert response.status == 504

    async def counted() -> bool:
        samples = await scrape(http, ops)
        return value(samples, "rest_bridge_app_server_late_replies_total") == 1

    await until(counted, "the late reply counted")
    async with http.delete(f"{api}/v1/sessions/{session}") as response:
        assert response.status == 200
    # Its app-server gone, its late replies are still in the total.
    assert await counted()


@pytest.mark.asyncio
async def test_gaps_and_events_are_counted(operated, fake_codex, http, write_script):
    flood = [{"flood": {"count": 50, "method": "x/tick"}}, {"respond": {"result": {}}}]
    script = write_script({"methods": {"x/flood": {"steps": flood}}})
    api, ops, _ = await operated(trusted_bridge_app(fake_codex, RestLimits(event_buffer=10)))
    session = await create_session(http, api, script)
    await call(http, api, session, "x/flood", {})
    async with http.get(f"{api}/v1/sessions/{session}/events?after=0") as response:
        assert (await response.json())["kind"] == "gap"
    async with http.get(
        f"{api}/v1/sessions/{session}/events/stream?after=0",
        headers={"Accept": "text/event-stream"},
    ) as response:
        assert b"gap" in await response.content.readuntil(b"\n\n")
    samples = await scrape(http, ops)
    assert value(samples, "rest_bridge_event_gaps_total") == 2
    assert value(samples, "rest_bridge_events_appended_total") >= 50  # and what init sent
    assert value(samples, "rest_bridge_event_log_events") == 10


@pytest.mark.asyncio
async def test_a_refusal_sent_before_100_continue_is_counted_like_any(operated, fake_codex, http):
    """aiohttp runs a route's Expect handler before any middleware: its 401 is observed."""
    api, ops, _ = await operated(trusted_bridge_app(fake_codex), token="s3cret-token")
    host, port = api.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 401 "), head
        # No 100 Continue first, and the connection is closed: the body never comes.
        await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    samples = await scrape(http, ops)
    assert value(samples, "rest_bridge_refusals_total", kind="unauthorized") == 1
    durations = "http_server_request_duration_seconds_count"
    labels = {"http_route": "/v1/sessions", "http_request_method": "POST"}
    assert value(samples, durations, http_response_status_class="4xx", **labels) == 1


@pytest.mark.asyncio
async def test_a_stream_that_stops_reading_is_counted_when_cut_loose(
    operated, fake_codex, http, write_script
):
    flood = [{"flood": {"count": 30_000, "method": "x/tick"}}, {"respond": {"result": {}}}]
    script = write_script({"methods": {"x/flood": {"steps": flood}}})
    limits = RestLimits(event_buffer=10, reader_stall_ms=200)
    api, ops, _ = await operated(trusted_bridge_app(fake_codex, limits))
    session = await create_session(http, api, script)
    samples = await scrape(http, ops)
    assert value(samples, "rest_bridge_readers_cut_loose_total") == 0
    host, port = api.removeprefix("http://").rsplit(":", 1)
    # A reader with a small window, which reads the head of its stream and nothing more.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(
            f"GET /v1/sessions/{session}/events/stream HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200 "), head
        # The flood is answered only once the stalled stream is cut loose.
        await call(http, api, session, "x/flood", {})
        samples = await scrape(http, ops)
        assert value(samples, "rest_bridge_readers_cut_loose_total") == 1
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_text_turns_that_fail_or_time_out_are_observed_by_outcome(
    operated, fake_codex, http, write_script
):
    api, ops, _ = await operated(trusted_bridge_app(fake_codex))
    crash = write_script({"turns": [{"steps": [{"exit": 3}]}]})
    slow = write_script({"turns": [{"steps": [{"sleep": 30_000}]}]})
    # The deadline counts from the spawned app-server: the slow turn always outlives it.
    for script, timeout_ms, status in ((crash, None, 502), (slow, 500, 504)):
        env = {"FAKE_CODEX_SCRIPT": script}
        body = {"text": "hi", "timeoutMs": timeout_ms, "options": {"env": env}}
        async with http.post(f"{api}/v1/text-turn", json=body) as response:
            assert response.status == status, await response.text()
    samples = await scrape(http, ops)
    turns = "rest_bridge_text_turn_duration_seconds_count"
    assert value(samples, turns, outcome="failed") == 1
    assert value(samples, turns, outcome="timeout") == 1
    assert value(samples, turns, outcome="completed") == 0
    assert value(samples, turns) == 2


@pytest.mark.asyncio
async def test_a_text_turn_whose_app_server_outlives_the_spawn_deadline_is_a_timeout(
    operated, fake_codex, http, write_script
):
    """The client gets 504 `timeout` (REST_ADAPTER_SPAWN_TIMEOUT_MS), and the metric
    counts what the client got, not a failure."""
    api, ops, _ = await operated(trusted_bridge_app(fake_codex, RestLimits(spawn_timeout_ms=300)))
    deaf = write_script({"initialize": {"noReply": True}})
    body = {"text": "hi", "timeoutMs": 60_000, "options": {"env": {"FAKE_CODEX_SCRIPT": deaf}}}
    async with http.post(f"{api}/v1/text-turn", json=body) as response:
        assert response.status == 504, await response.text()
        assert "REST_ADAPTER_SPAWN_TIMEOUT_MS" in (await response.json())["message"]
    samples = await scrape(http, ops)
    turns = "rest_bridge_text_turn_duration_seconds_count"
    assert value(samples, turns, outcome="timeout") == 1
    assert value(samples, turns) == 1


@pytest.mark.asyncio
async def test_requests_no_route_takes_share_their_series(operated, fake_codex, http):
    """aiohttp answers a target that is not a path with a new route object each time:
    their series (and what the bridge keeps for them) do not grow with their number."""
    app = trusted_bridge_app(fake_codex)
    api, ops, _ = await operated(app)
    host, port = api.removeprefix("http://").rsplit(":", 1)
    for n in range(20):
        target = f"CONNECT host-{n}:443" if n % 2 else "OPTIONS *"
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"{target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            assert head.startswith(b"HTTP/1.1 404 "), head
        finally:
            writer.close()
    samples = await scrape(http, ops)
    active = [
        dict(labels)
        for (name, labels), _ in samples.items()
        if name == "http_server_active_requests" and dict(labels)["http_route"] == "unmatched"
    ]
    assert sorted(x["http_request_method"] for x in active) == ["CONNECT", "OPTIONS"]
    count = "http_server_request_duration_seconds_count"
    assert value(samples, count, http_route="unmatched") == 20
    assert len(observer(app).facts) <= 4
    async with http.get(f"{ops}/metrics") as response:
        exposed = await response.text()
    unmatched = [x for x in exposed.splitlines() if 'http_route="unmatched"' in x]
    assert len(unmatched) == len(set(unmatched)), "a series exposed twice"
