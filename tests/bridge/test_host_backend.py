"""A backend written only against the Backend interface, served by backend_app."""

from __future__ import annotations

import pytest

from bridge.app import RouterOptions, backend_app
from examples.echo_backend import EchoBackend
from scenarios.sse import SseReader

pytestmark = [pytest.mark.asyncio, pytest.mark.quick]


async def test_host_backend_serves_sessions_calls_and_events(serve, http):
    base = await serve(backend_app(EchoBackend()))
    async with http.post(f"{base}/v1/sessions", json={}) as response:
        assert response.status == 201
        session_id = (await response.json())["sessionId"]
    url = f"{base}/v1/sessions/{session_id}/call/thread/start"
    async with http.post(url, json={"params": {"x": 1}}) as response:
        assert await response.json() == {"result": {"method": "thread/start", "params": {"x": 1}}}
    async with http.get(f"{base}/v1/sessions/{session_id}/events?waitMs=1000") as response:
        event = await response.json()
    assert (event["seq"], event["method"]) == (1, "echo/called")
    async with http.get(f"{base}/v1/sessions/{session_id}/events/stream?after=0") as response:
        frames = await SseReader(response).collect(1)
    assert frames[0].json()["params"] == {"method": "thread/start", "params": {"x": 1}}


async def test_what_a_host_backend_does_not_implement_is_404(serve, http):
    base = await serve(backend_app(EchoBackend()))
    async with http.post(f"{base}/v1/text-turn", json={"text": "hi"}) as response:
        assert response.status == 404
        body = await response.json()
    assert body["error"] == "not_found"
    assert "text turns" in body["message"]
    async with http.get(f"{base}/v1/compatibility") as response:
        assert response.status == 404


async def test_router_options_choose_the_routes_and_the_client_options(serve, http):
    options = RouterOptions(
        routes=frozenset({"health", "create_session", "openapi"}),
        allowed_client_options=frozenset({"clientInfo"}),
    )
    base = await serve(backend_app(EchoBackend(), options))
    async with http.get(f"{base}/v1/sessions") as response:
        assert response.status == 405
    async with http.post(f"{base}/v1/sessions", json={"options": {"cwd": "/"}}) as response:
        assert response.status == 403
    async with http.post(f"{base}/v1/sessions", json={}) as response:
        assert response.status == 201
