"""Sessions, raw calls, events and replies over real sockets and real fake processes."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from processes import live_children
from yarl import URL

from bridge.app import trusted_bridge_app
from bridge.limits import RestLimits
from scenarios.sse import SseReader

pytestmark = pytest.mark.asyncio


@pytest.fixture
def bridge(serve, fake_codex):
    """Start a trusted bridge on the fake with the given limits; returns its base URL."""

    async def start(**limits) -> str:
        return await serve(trusted_bridge_app(fake_codex, RestLimits(**limits)))

    return start


async def create_session(http, base, script=None, status=201):
    body = {"options": {"env": {"FAKE_CODEX_SCRIPT": script}}} if script else {}
    async with http.post(f"{base}/v1/sessions", json=body) as response:
        payload = await response.json()
        assert response.status == status, payload
        return payload


async def call(http, base, session_id, method, params=None, **extra):
    params = {} if params is None else params
    url = f"{base}/v1/sessions/{session_id}/call/{method}"
    async with http.post(url, json={"params": params, **extra}) as response:
        return response.status, await response.json()


async def next_event(http, base, session_id, wait_ms=10_000, **query):
    params = {"waitMs": str(wait_ms), **{k: str(v) for k, v in query.items()}}
    async with http.get(f"{base}/v1/sessions/{session_id}/events", params=params) as response:
        if response.status == 204:
            return None
        assert response.status == 200, await response.text()
        return await response.json()


async def events_until(http, base, session_id, method):
    seen = []
    while True:
        event = await next_event(http, base, session_id)
        assert event is not None, f"no event before {method}: {[e['method'] for e in seen]}"
        seen.append(event)
        if event["method"] == method or event["kind"] == "exit":
            return seen


async def start_turn(http, base, session_id, text="hello"):
    status, started = await call(http, base, session_id, "thread/start", {})
    assert status == 200, started
    thread_id = started["result"]["thread"]["id"]
    status, turn = await call(
        http,
        base,
        session_id,
        "turn/start",
        {"threadId": thread_id, "input": [{"type": "text", "text": text}]},
    )
    assert status == 200, turn
    return thread_id, turn["result"]["turn"]["id"]


# -- health and routing ------------------------------------------------------------


@pytest.mark.quick
async def test_health_is_the_same_on_both_paths(bridge, http):
    base = await bridge()
    bodies = []
    for path in ("/health", "/v1/health"):
        async with http.get(base + path) as response:
            assert response.status == 200
            bodies.append(await response.json())
    assert bodies[0] == bodies[1]
    assert bodies[0]["status"] == "ok"
    assert set(bodies[0]) == {"status", "version"}


@pytest.mark.quick
async def test_unknown_route_is_404_with_the_error_payload(bridge, http):
    base = await bridge()
    async with http.get(f"{base}/v1/nothing-here") as response:
        assert response.status == 404
        assert await response.json() == {"error": "not_found", "message": "No such route."}


@pytest.mark.quick
async def test_wrong_method_is_405_with_allow_header(bridge, http):
    base = await bridge()
    async with http.put(f"{base}/v1/sessions") as response:
        assert response.status == 405
        assert set(response.headers["Allow"].split(", ")) == {"GET", "POST"}
        body = await response.json()
        assert body["error"] == "method_not_allowed"


# -- sessions ----------------------------------------------------------------------


async def test_session_lifecycle_create_list_delete(bridge, http):
    base = await bridge()
    created = await create_session(http, base)
    assert set(created) == {"sessionId", "createdAt", "initialize"}
    assert created["initialize"]["platformFamily"] == "unix"
    async with http.get(f"{base}/v1/sessions") as response:
        listed = (await response.json())["sessions"]
    assert [s["sessionId"] for s in listed] == [created["sessionId"]]
    summary = listed[0]
    assert summary["state"] == "running"
    assert summary["exitCode"] is None
    assert summary["pendingRequests"] == []
    async with http.delete(f"{base}/v1/sessions/{created['sessionId']}") as response:
        assert response.status == 200
        assert await response.json() == {"status": "deleted", "sessionId": created["sessionId"]}
    async with http.delete(f"{base}/v1/sessions/{created['sessionId']}") as response:
        assert response.status == 404
        assert (await response.json())["error"] == "session_not_found"
    async with http.get(f"{base}/v1/sessions") as response:
        assert (await response.json())["sessions"] == []


async def test_session_call_matches_methods_with_slashes_encoded_or_not(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]
    for path in ("thread/start", "thread%2Fstart"):
        url = URL(f"{base}/v1/sessions/{session_id}/call/{path}", encoded=True)
        async with http.post(url, json={"params": {}}) as response:
            assert response.status == 200
            assert "id" in (await response.json())["result"]["thread"]


@pytest.mark.quick
async def test_call_on_unknown_session_is_404(bridge, http):
    base = await bridge()
    status, body = await call(http, base, "nope", "thread/start", {})
    assert status == 404
    assert body["error"] == "session_not_found"


async def test_unknown_method_is_502_app_server_error_with_code_and_message(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]
    status, body = await call(http, base, session_id, "no/such/method", {})
    assert status == 502
    assert body["error"] == "app_server_error"
    assert body["code"] == -32600
    assert body["message"].startswith("Invalid request: unknown variant `no/such/method`")


async def test_json_rpc_error_data_passes_through(bridge, http, write_script):
    script = write_script(
        {"methods": {"x/fail": {"error": {"code": -32050, "message": "nope", "data": {"k": [1]}}}}}
    )
    base = await bridge()
    session_id = (await create_session(http, base, script))["sessionId"]
    status, body = await call(http, base, session_id, "x/fail")
    assert status == 502
    assert body == {
        "error": "app_server_error",
        "message": "nope",
        "code": -32050,
        "data": {"k": [1]},
    }


async def test_overloaded_is_503_with_retry_after(bridge, http, write_script):
    script = write_script(
        {
            "methods": {
                "x/busy": {"error": {"code": -32001, "message": "Server overloaded; retry later."}}
            }
        }
    )
    base = await bridge()
    session_id = (await create_session(http, base, script))["sessionId"]
    url = f"{base}/v1/sessions/{session_id}/call/x/busy"
    async with http.post(url, json={"params": {}}) as response:
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        body = await response.json()
    assert body == {
        "error": "app_server_overloaded",
        "message": "Server overloaded; retry later.",
        "code": -32001,
    }


async def test_call_past_its_deadline_is_504_and_the_session_lives_on(bridge, http, write_script):
    script = write_script({"methods": {"x/stall": {"noReply": True}}})
    base = await bridge()
    session_id = (await create_session(http, base, script))["sessionId"]
    status, body = await call(http, base, session_id, "x/stall", timeoutMs=200)
    assert status == 504
    assert body["error"] == "timeout"
    status, _ = await call(http, base, session_id, "thread/start", {})
    assert status == 200


async def test_process_dying_mid_call(bridge, http, write_script):
    script = write_script(
        {"methods": {"x/crash": {"steps": [{"stderr": "boom: disk on fire\n"}, {"exit": 3}]}}}
    )
    base = await bridge()
    session_id = (await create_session(http, base, script))["sessionId"]
    status, body = await call(http, base, session_id, "x/crash")
    assert status == 502
    assert body["error"] == "app_server_exited"
    assert body["data"] == {"exitCode": 3, "signal": None}
    exit_event = (await events_until(http, base, session_id, None))[-1]
    assert exit_event["kind"] == "exit"
    assert exit_event["params"]["exitCode"] == 3
    assert "boom: disk on fire" in exit_event["params"]["stderrTail"]
    status, body = await call(http, base, session_id, "thread/start", {})
    assert status == 409
    assert body["error"] == "session_exited"
    assert body["message"] == f"The app-server process of session {session_id!r} has exited."
    async with http.get(f"{base}/v1/sessions") as response:
        summary = (await response.json())["sessions"][0]
    assert (summary["state"], summary["exitCode"]) == ("exited", 3)


async def test_non_json_line_is_502_protocol_error(bridge, http, write_script):
    script = write_script({"methods": {"x/garbage": {"steps": [{"raw": "this is not json"}]}}})
    base = await bridge()
    session_id = (await create_session(http, base, script))["sessionId"]
    status, body = await call(http, base, session_id, "x/garbage")
    assert status == 502
    assert body["error"] == "protocol_error"
    exit_event = (await events_until(http, base, session_id, None))[-1]
    assert exit_event["params"]["protocolError"] == "the app-server wrote a line that is not JSON"


async def test_line_over_max_line_bytes_fails_the_session_cleanly(bridge, http, write_script):
    script = write_script({"methods": {"x/big": {"steps": [{"bigLine": 300_000}]}}})
    base = await bridge(max_line_bytes=100_000)
    session_id = (await create_session(http, base, script))["sessionId"]
    status, body = await call(http, base, session_id, "x/big")
    assert status == 502
    assert body["error"] == "protocol_error"
    assert "MAX_LINE_BYTES" in body["message"]


async def test_session_limit_is_429_with_retry_after(bridge, http):
    base = await bridge(max_sessions=2)
    await create_session(http, base)
    await create_session(http, base)
    async with http.post(f"{base}/v1/sessions", json={}) as response:
        assert response.status == 429
        assert response.headers["Retry-After"] == "1"
        assert (await response.json())["error"] == "session_limit_reached"


async def test_idle_sessions_are_reaped(bridge, http):
    base = await bridge(session_idle_timeout_ms=100)
    session_id = (await create_session(http, base))["sessionId"]
    async with asyncio.timeout(10):
        while True:
            async with http.get(f"{base}/v1/sessions") as response:
                ids = [s["sessionId"] for s in (await response.json())["sessions"]]
            if session_id not in ids:
                break
            await asyncio.sleep(0.05)  # sync-ok: polling the reaper's observable effect
    status, _ = await call(http, base, session_id, "thread/start", {})
    assert status == 404


async def test_spawn_failure_is_502(serve, http):
    base = await serve(trusted_bridge_app(["/nonexistent/app-server-binary", "app-server"]))
    async with http.post(f"{base}/v1/sessions", json={}) as response:
        assert response.status == 502
        body = await response.json()
    assert body["error"] == "app_server_spawn_failed"
    assert "/nonexistent" not in body["message"]


async def test_initialize_error_is_reported_and_nothing_is_left_running(bridge, http, write_script):
    script = write_script({"initialize": {"error": {"code": -32603, "message": "cannot start"}}})
    base = await bridge()
    body = await create_session(http, base, script, status=502)
    assert body["error"] == "app_server_error"
    # The app-server's own message goes to the operator's log only (it may name a path);
    # the start was shaped by the request's options (its env), which come first.
    assert body["message"] == (
        "The app-server answered `initialize` with an error; check the request's options "
        "(clientInfo among them), else check the bridge's app-server command (`rest-bridge "
        "serve --app-server`). The bridge's log has its message."
    )
    assert body["code"] == -32603
    async with http.get(f"{base}/v1/sessions") as response:
        assert (await response.json())["sessions"] == []


# -- bodies ------------------------------------------------------------------------


@pytest.mark.quick
async def test_body_over_the_limit_is_413_and_nothing_is_spawned(bridge, http):
    base = await bridge()
    before = live_children()
    body = b'{"params": "' + b"x" * 2_000_000 + b'"}'
    async with http.post(f"{base}/v1/call/model/list", data=body) as response:
        assert response.status == 413
        payload = await response.json()
    assert payload["error"] == "payload_too_large"
    assert live_children() == before


@pytest.mark.quick
async def test_chunked_body_over_the_limit_is_413(bridge, http):
    base = await bridge()

    async def chunks():
        for _ in range(40):
            yield b"x" * 65536

    async with http.post(f"{base}/v1/sessions", data=chunks()) as response:
        assert response.status == 413
        assert (await response.json())["error"] == "payload_too_large"


@pytest.mark.quick
@pytest.mark.parametrize("size", [100, 101, 4000])
async def test_chunked_body_that_arrived_whole_is_bounded_too(bridge, size):
    """A chunked body (no Content-Length) sent in one write with its head is all there
    when the handler runs: it is measured as it is taken, a 413 past MAX_BODY_BYTES."""
    base = await bridge(max_body_bytes=100)
    host, port = URL(base).host, URL(base).port
    reader, writer = await asyncio.open_connection(host, port)
    body = b'{"params": "' + b"x" * (size - 14) + b'"}'
    assert len(body) == size
    writer.write(
        b"POST /v1/sessions/nope/call/x HTTP/1.1\r\nHost: t\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (size, body)
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    await writer.wait_closed()
    # Within the bound, the body is read and the session is looked up (404).
    assert head.startswith(b"HTTP/1.1 413 " if size > 100 else b"HTTP/1.1 404 "), head


@pytest.mark.quick
async def test_invalid_json_is_400(bridge, http):
    base = await bridge()
    async with http.post(f"{base}/v1/sessions", data=b"{not json") as response:
        assert response.status == 400
        body = await response.json()
    assert body["error"] == "bad_request"
    assert body["message"] == "The request body is not valid JSON."


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity"])
async def test_nan_and_infinity_are_not_json(bridge, http, write_script, number):
    script = write_script({"methods": {"x/echo": {"result": {"ok": True}}}})
    base = await bridge()
    url = f"{base}/v1/call/x/echo"
    body = b'{"params": {"x": [%s]}, "options": {"env": {"FAKE_CODEX_SCRIPT": "%s"}}}'
    async with http.post(url, data=body % (number, script.encode())) as response:
        assert response.status == 400
        answer = await response.json()
    assert answer["message"] == "The request body is not valid JSON."
    assert answer["data"]["errors"][0]["type"] == "json_invalid"
    # The words inside a string are just text.
    async with http.post(url, data=body % (b'"' + number + b'"', script.encode())) as response:
        assert response.status == 200, await response.text()


async def test_undecodable_body_is_400_and_closes_the_connection(bridge, http):
    # The rest of such a body cannot be skipped safely, so aiohttp drops the connection
    # after the response: the response must say so, or a keep-alive client sends its
    # next request into a closed connection.
    base = await bridge()
    url = URL(base)
    assert url.host is not None
    assert url.port is not None
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        body = b"not gzip at all"
        writer.write(
            b"POST /v1/sessions HTTP/1.1\r\nHost: bridge\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        async with asyncio.timeout(10):
            head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
            assert head.startswith("http/1.1 400 ")
            assert "\r\nconnection: close\r\n" in head
            rest = await reader.read()  # the body, then the server closes
        assert b'"error":"bad_request"' in rest
    finally:
        writer.close()
    async with http.post(f"{base}/v1/sessions", json={}) as response:
        assert response.status == 201


@pytest.mark.quick
async def test_unknown_field_is_400_with_details(bridge, http):
    base = await bridge()
    async with http.post(f"{base}/v1/sessions", json={"optoins": {}}) as response:
        assert response.status == 400
        body = await response.json()
    assert body["data"]["errors"][0]["loc"] == ["optoins"]
    assert body["data"]["errors"][0]["type"] == "extra_forbidden"


# -- sessionless calls -------------------------------------------------------------


async def test_sessionless_call_spawns_calls_and_stops(bridge, http):
    base = await bridge()
    before = live_children()
    async with http.post(f"{base}/v1/call/model/list", json={"params": {}}) as response:
        assert response.status == 200
        body = await response.json()
    assert isinstance(body["result"]["data"], list)
    assert live_children() == before


async def test_sessionless_call_takes_client_options(bridge, http, write_script):
    script = write_script({"methods": {"x/hello": {"result": {"hi": True}}}})
    base = await bridge()
    body = {"params": {}, "options": {"env": {"FAKE_CODEX_SCRIPT": script}}}
    async with http.post(f"{base}/v1/call/x/hello", json=body) as response:
        assert response.status == 200
        assert await response.json() == {"result": {"hi": True}}


async def test_a_sessionless_call_answers_the_servers_requests_with_an_error(
    bridge, http, write_script
):
    """Nobody can answer a server request outside a session: it gets an error at once,
    and the call goes on (here the app-server answers the call with what it was told)."""
    on_reply = {"error": [{"respond": {"result": "refused"}}], "default": [{"respond": {}}]}
    ask = {"steps": [{"request": {"method": "item/tool/requestUserInput"}, "onReply": on_reply}]}
    script = write_script({"methods": {"x/ask": ask}})
    base = await bridge()
    body = {"params": {}, "options": {"env": {"FAKE_CODEX_SCRIPT": script}}}
    async with http.post(f"{base}/v1/call/x/ask", json=body) as response:
        assert (response.status, await response.json()) == (200, {"result": "refused"})


# -- events ------------------------------------------------------------------------


async def test_long_poll_times_out_with_204(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]
    # Far past anything this session will write: nothing can arrive in time.
    url = f"{base}/v1/sessions/{session_id}/events?waitMs=50&after=1000000"
    async with http.get(url) as response:
        assert response.status == 204
        assert await response.read() == b""


async def test_long_poll_reads_a_turn_in_order_without_loss(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]
    await start_turn(http, base, session_id, text="ping")
    events = await events_until(http, base, session_id, "turn/completed")
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    methods = [e["method"] for e in events]
    assert methods.index("turn/started") < methods.index("item/agentMessage/delta")
    completed = [e for e in events if e["method"] == "item/completed"]
    assert "ping" in completed[-1]["params"]["item"]["text"]


async def test_after_reads_without_moving_the_cursor(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]
    await start_turn(http, base, session_id)
    first = await next_event(http, base, session_id)
    peek = await next_event(http, base, session_id, after=0)
    assert peek["seq"] == 1
    second = await next_event(http, base, session_id)
    assert second["seq"] == first["seq"] + 1


async def test_bad_query_values_are_400(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]
    for query in ("waitMs=abc", "waitMs=-1", "after=x"):
        async with http.get(f"{base}/v1/sessions/{session_id}/events?{query}") as response:
            assert response.status == 400
            assert (await response.json())["error"] == "bad_request"


async def test_slow_reader_gets_an_explicit_gap(bridge, http, write_script):
    script = write_script(
        {
            "methods": {
                "x/flood": {
                    "steps": [
                        {"flood": {"count": 50, "method": "x/tick"}},
                        {"respond": {"result": {}}},
                    ]
                }
            }
        }
    )
    base = await bridge(event_buffer=10)
    session_id = (await create_session(http, base, script))["sessionId"]
    status, _ = await call(http, base, session_id, "x/flood")
    assert status == 200
    first = await next_event(http, base, session_id, after=0)
    assert first["kind"] == "gap"
    assert first["params"]["fromSeq"] == 1
    following = await next_event(http, base, session_id, after=first["seq"])
    assert following["seq"] == first["params"]["toSeq"] + 1


# -- server requests and replies ---------------------------------------------------

APPROVAL_SCRIPT = {
    "turns": [
        {
            "steps": [
                {"commandApproval": {"command": "touch marker"}},
                {"agentMessage": "done"},
            ]
        }
    ]
}


async def test_reply_result_answers_a_server_request_exactly_once(bridge, http, write_script):
    base = await bridge()
    session_id = (await create_session(http, base, write_script(APPROVAL_SCRIPT)))["sessionId"]
    await start_turn(http, base, session_id)
    request = (await events_until(http, base, session_id, "item/commandExecution/requestApproval"))[
        -1
    ]
    assert request["kind"] == "request"
    key = request["requestKey"]
    async with http.get(f"{base}/v1/sessions") as response:
        assert (await response.json())["sessions"][0]["pendingRequests"] == [key]
    url = f"{base}/v1/sessions/{session_id}/requests/{key}/result"
    async with http.post(url, json={"result": {"decision": "accept"}}) as response:
        assert response.status == 200
        assert await response.json() == {"status": "sent", "requestKey": key}
    async with http.post(url, json={"result": {"decision": "accept"}}) as response:
        assert response.status == 409
        assert (await response.json())["error"] == "request_already_answered"
    rest = await events_until(http, base, session_id, "turn/completed")
    assert "serverRequest/resolved" in [e["method"] for e in rest]


async def test_reply_to_unknown_request_key_is_404(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]
    url = f"{base}/v1/sessions/{session_id}/requests/12345/result"
    async with http.post(url, json={"result": {}}) as response:
        assert response.status == 404
        assert (await response.json())["error"] == "request_not_found"


async def test_reply_error_answers_with_a_json_rpc_error(bridge, http, write_script):
    base = await bridge()
    session_id = (await create_session(http, base, write_script(APPROVAL_SCRIPT)))["sessionId"]
    await start_turn(http, base, session_id)
    request = (await events_until(http, base, session_id, "item/commandExecution/requestApproval"))[
        -1
    ]
    url = f"{base}/v1/sessions/{session_id}/requests/{request['requestKey']}/error"
    async with http.post(url, json={"code": -32000, "message": "no thanks"}) as response:
        assert response.status == 200
    rest = await events_until(http, base, session_id, "turn/completed")
    assert rest[-1]["method"] == "turn/completed"


async def test_string_request_ids_colliding_with_client_ids(bridge, http, write_script):
    script = write_script(
        {
            "turns": [
                {
                    "steps": [
                        {"request": {"method": "item/tool/call", "id": "1", "params": {}}},
                        {"request": {"method": "item/tool/call", "id": 2, "params": {}}},
                    ]
                }
            ]
        }
    )
    base = await bridge()
    session_id = (await create_session(http, base, script))["sessionId"]
    await start_turn(http, base, session_id)
    # The string "1" cannot share the key of the integer 1: its key is its JSON text.
    for key in ('"1"', "2"):
        request = (await events_until(http, base, session_id, "item/tool/call"))[-1]
        assert request["requestKey"] == key
        url = f"{base}/v1/sessions/{session_id}/requests/{key}/result"
        async with http.post(
            url, json={"result": {"contentItems": [], "success": True}}
        ) as response:
            assert response.status == 200
    await events_until(http, base, session_id, "turn/completed")


# -- SSE ---------------------------------------------------------------------------


async def test_sse_streams_a_turn_with_ids_and_kinds(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]
    async with http.get(f"{base}/v1/sessions/{session_id}/events/stream") as response:
        assert response.status == 200
        reader = SseReader(response)
        await start_turn(http, base, session_id, text="stream me")
        frames = await reader.until(lambda f: f.json()["method"] == "turn/completed")
    assert all(f.id == str(f.json()["seq"]) for f in frames)
    assert all(f.event == f.json()["kind"] for f in frames)
    seqs = [int(f.id) for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


async def test_sse_resume_after_a_dropped_connection_delivers_each_missed_event_once(
    bridge, http, write_script
):
    flood = {"steps": [{"flood": {"count": 40, "method": "x/tick"}}, {"respond": {"result": {}}}]}
    base = await bridge()
    session_id = (await create_session(http, base, write_script({"methods": {"x/burst": flood}})))[
        "sessionId"
    ]
    url = f"{base}/v1/sessions/{session_id}/events/stream"
    assert (await call(http, base, session_id, "x/burst"))[0] == 200
    async with http.get(url, params={"after": "0"}) as response:
        first = await SseReader(response).collect(15)
    assert (await call(http, base, session_id, "x/burst"))[0] == 200
    async with http.get(f"{base}/v1/sessions") as listing:
        last_seq = (await listing.json())["sessions"][0]["nextSeq"] - 1
    async with http.get(url, headers={"Last-Event-ID": first[-1].id}) as response:
        resumed = await SseReader(response).until(lambda f: int(f.id) == last_seq)
    assert [int(f.id) for f in first + resumed] == list(range(1, last_seq + 1))


async def test_sse_ends_after_the_exit_event(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]
    async with http.get(f"{base}/v1/sessions/{session_id}/events/stream") as response:
        reader = SseReader(response)
        async with http.delete(f"{base}/v1/sessions/{session_id}") as deleted:
            assert deleted.status == 200
        frames = await reader.rest()
    assert frames[-1].event == "exit"


async def test_sse_sends_keepalive_comments_when_idle(bridge, http):
    base = await bridge(sse_keepalive_ms=50)
    session_id = (await create_session(http, base))["sessionId"]
    async with http.get(f"{base}/v1/sessions/{session_id}/events/stream") as response:
        reader = SseReader(response, comments=True)
        frames = []
        while not any(f.comment == "keep-alive" for f in frames):
            frames.append(await reader.next())


@pytest.mark.quick
async def test_stream_of_unknown_session_is_a_json_404(bridge, http):
    base = await bridge()
    async with http.get(f"{base}/v1/sessions/nope/events/stream") as response:
        assert response.status == 404
        assert (await response.json())["error"] == "session_not_found"


async def test_reading_past_the_exit_event_is_409(bridge, http, write_script):
    script = write_script({"methods": {"x/crash": {"steps": [{"exit": 0}]}}})
    base = await bridge()
    session_id = (await create_session(http, base, script))["sessionId"]
    await call(http, base, session_id, "x/crash")
    assert (await events_until(http, base, session_id, None))[-1]["kind"] == "exit"
    async with http.get(f"{base}/v1/sessions/{session_id}/events?waitMs=0") as response:
        assert response.status == 409
        assert (await response.json())["error"] == "session_exited"
    async with http.get(f"{base}/v1/sessions/{session_id}/events/stream") as response:
        assert response.status == 409
    async with http.get(f"{base}/v1/sessions/{session_id}/events/stream?after=0") as response:
        frames = await SseReader(response).rest()
    assert frames[-1].event == "exit"


async def test_no_child_process_outlives_the_app(fake_codex, http):
    before = live_children()
    runner = web.AppRunner(trusted_bridge_app(fake_codex))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    for _ in range(3):
        await create_session(http, base)
    assert len(live_children() - before) >= 3
    await runner.cleanup()
    assert live_children() == before


async def test_concurrent_deletes_exactly_one_wins(bridge, http):
    base = await bridge()
    session_id = (await create_session(http, base))["sessionId"]

    async def delete():
        async with http.delete(f"{base}/v1/sessions/{session_id}") as response:
            return response.status

    statuses = await asyncio.gather(*(delete() for _ in range(5)))
    assert sorted(statuses) == [200, 404, 404, 404, 404]


async def test_a_deleted_session_is_gone_for_every_new_request(bridge, http, write_script):
    script = write_script({"turns": [{"steps": [{"request": {"method": "item/tool/call"}}]}]})
    base = await bridge()
    session_id = (await create_session(http, base, script))["sessionId"]
    await start_turn(http, base, session_id)
    key = (await events_until(http, base, session_id, "item/tool/call"))[-1]["requestKey"]
    async with http.delete(f"{base}/v1/sessions/{session_id}") as response:
        assert response.status == 200
    prefix = f"{base}/v1/sessions/{session_id}"
    requests = [
        ("GET", f"{prefix}/events?after=0&waitMs=0", None),
        ("GET", f"{prefix}/events?waitMs=0", None),
        ("GET", f"{prefix}/events/stream?after=0", None),
        ("GET", f"{prefix}/events/stream", None),
        ("POST", f"{prefix}/call/thread/start", {"params": {}}),
        ("POST", f"{prefix}/requests/{key}/result", {"result": {}}),
        ("POST", f"{prefix}/requests/{key}/error", {"code": 1, "message": "no"}),
        ("DELETE", prefix, None),
    ]
    for method, url, body in requests:
        async with http.request(method, url, json=body) as response:
            assert response.status == 404, (method, url)
            assert (await response.json())["error"] == "session_not_found"
    async with http.get(f"{base}/v1/sessions") as response:
        assert session_id not in [s["sessionId"] for s in (await response.json())["sessions"]]
