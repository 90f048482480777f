"""A backend written only against the Backend interface, served by backend_app."""

from __future__ import annotations

from typing import Any

import pytest

from bridge.app import RouterOptions, backend_app
from bridge.events import EventLog
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


class OwnStream:
    """A host's event stream written to the interface's shape without subclassing it (so
    without `on_cut_loose`): a stream of its own three events."""

    def __init__(self, log: Any) -> None:
        self.batches = [log.read(0, 10)]

    async def next_batch(self, wait: float, limit: int) -> Any:
        return self.batches.pop() if self.batches else []

    def delivered(self, seq: int) -> None:
        pass

    def close(self, completed: bool = False) -> None:
        pass


class OwnStreamBackend(EchoBackend):
    async def open_stream(self, session_id: str, after: int | None) -> Any:
        log = EventLog(10)
        for n in range(2):
            log.append("notification", "own/event", {"n": n})
        log.close({"exitCode": 0})
        return OwnStream(log)


async def test_a_stream_of_the_hosts_own_without_every_method_is_served(serve, http):
    base = await serve(backend_app(OwnStreamBackend()))
    async with http.get(f"{base}/v1/sessions/any/events/stream") as response:
        assert response.status == 200
        frames = await SseReader(response).rest()
    assert [f.event for f in frames] == ["notification", "notification", "exit"]
