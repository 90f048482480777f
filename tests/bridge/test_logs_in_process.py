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
