"""The observing middleware's parts that need no process (bridge/observe.py,
bridge/metrics.py): the request durations Prometheus reads, and a host's failure."""

from __future__ import annotations

import logging

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bridge import logs
from bridge.metrics import HTTP_BUCKETS, Metrics
from bridge.observe import observer

pytestmark = pytest.mark.quick

SECONDS = (0.0, 0.004, 0.005, 0.0051, 0.3, 7.5, 299.0, 300.0, 301.0, 1e9)
LABELS = ("/v1/sessions", "POST", "2xx")


def samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample but ``_created`` (a time), by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_request_durations_are_exposed_as_a_prometheus_histogram_would_be():
    metrics = Metrics()
    registry = CollectorRegistry()
    reference = Histogram(
        metrics.requests.name,
        metrics.requests.documentation,
        metrics.requests.labelnames,
        buckets=HTTP_BUCKETS,
        registry=registry,
    )
    for seconds in SECONDS:
        metrics.requests.labels(*LABELS).observe(seconds)
        reference.labels(*LABELS).observe(seconds)
    ours = generate_latest(metrics.registry)
    theirs = generate_latest(registry)
    mine = {k: v for k, v in samples(ours).items() if k[0].startswith(metrics.requests.name)}
    assert mine == samples(theirs)
    assert len(mine) == len(HTTP_BUCKETS) + 1 + 2  # the buckets, +Inf, _count, _sum
    assert f"{metrics.requests.name}_created{{".encode() in ours
    assert f"# TYPE {metrics.requests.name} histogram".encode() in ours


@pytest.mark.asyncio
async def test_a_failure_a_host_middleware_lets_through_is_observed(
    serve, http, caplog, monkeypatch
):
    """The bridge's middlewares answer every failure; a host's inside the observer may
    not: aiohttp answers it, and the observer says what it answers."""

    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("a host's bug")

    app = web.Application()
    app.router.add_get("/x/{sessionId}", broken)
    found = observer(app)
    metrics = Metrics()
    found.count(metrics)
    found.log_access(logs.access_log_class("r9")(logs.ACCESS, ""))
    # Through `logging` (as before `rest-bridge serve` sets its batched writer up).
    monkeypatch.setattr(logs, "_access_lines", None)
    caplog.set_level(logging.INFO, logger=logs.ACCESS.name)
    base = await serve(app)
    async with http.get(f"{base}/x/abc") as response:
        assert response.status == 500
    said = [r.getMessage() for r in caplog.records if r.name == logs.ACCESS.name]
    assert len(said) == 1
    assert said[0].startswith("GET /x/{sessionId} 500 ")
    assert said[0].endswith(" session=abc replica=r9")
    exposed = samples(generate_latest(metrics.registry))
    count = (
        "http_server_request_duration_seconds_count",
        frozenset(
            {
                ("http_route", "/x/{sessionId}"),
                ("http_request_method", "GET"),
                ("http_response_status_class", "5xx"),
            }
        ),
    )
    assert exposed[count] == 1


def test_the_session_ids_an_access_line_repeats_are_checked_and_kept_bounded():
    for index in range(logs.SAFE_IDS_KEPT * 2 + 1):
        assert logs.safe_session_id(f"s-{index}") == f"s-{index}"
        assert logs.safe_session_id(f"s-{index}") == f"s-{index}"  # the one kept
    assert len(logs._safe_ids) <= logs.SAFE_IDS_KEPT
    for unsafe in ("x\ny", "a" * 129, "x y", "", "é"):
        assert logs.safe_session_id(unsafe) == "?"
        assert unsafe not in logs._safe_ids
    assert logs.safe_session_id("a" * 128) == "a" * 128
