"""Log lines of an in-process bridge (bridge/logs.py, bridge/errors.py): no process."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from bridge.app import backend_app
from examples.echo_backend import EchoBackend

pytestmark = [pytest.mark.asyncio, pytest.mark.quick]


class FailingBackend(EchoBackend):
    """A host backend with a bug: every session call raises."""

    async def session_call(
        self, session_id: str, method: str, params: Any, *, timeout_ms: int | None
    ) -> Any:
        raise RuntimeError(f"bug while serving {session_id}")


async def test_an_internal_error_is_logged_with_the_route_template_not_the_path(
    serve, http, caplog: pytest.LogCaptureFixture
):
    base = await serve(backend_app(FailingBackend()))
    caplog.set_level(logging.ERROR, logger="bridge")
    forged = "x%0A2026-01-01 00:00:00,000 INFO bridge.access forged"
    async with http.post(f"{base}/v1/sessions/{forged}/call/m", json={"params": {}}) as response:
        assert response.status == 500
    said = [r.getMessage() for r in caplog.records if r.name == "bridge"]
    assert said == ["internal error on POST /v1/sessions/{sessionId}/call/{method}: RuntimeError"]


async def test_a_throttle_admits_one_line_a_kind_an_interval_and_counts_the_rest():
    from bridge import logs

    now = [0.0]
    held: list[tuple[str, int]] = []
    throttle = logs.Throttle(lambda kind, count: held.append((kind, count)), 10.0, lambda: now[0])
    assert throttle.admit("spawn") == 0
    assert [throttle.admit("spawn") for _ in range(3)] == [None, None, None]
    assert throttle.admit("exited") == 0  # each kind its own interval
    now[0] = 10.0
    assert throttle.admit("spawn") == 3  # the next line says how many were held back
    assert throttle.admit("spawn") is None
    throttle.flush()  # when the application stops
    assert held == [("spawn", 1)]
    throttle.flush()
    assert held == [("spawn", 1)]
