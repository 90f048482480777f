"""The observing middleware's parts that need no process (bridge/observe.py,
bridge/metrics.py): the request durations Prometheus reads, and a host's failure."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from datetime import UTC, datetime

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bridge import logs
from bridge.metrics import HTTP_BUCKETS, Metrics
from bridge.observe import Observer, RouteFacts, observer

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


def requests_counted(metrics: Metrics, route: str, method: str, status_class: str) -> float:
    """What ``http_server_request_duration_seconds`` counted for the route, method and
    status class, as a scrape shows it."""
    labels = {
        ("http_route", route),
        ("http_request_method", method),
        ("http_response_status_class", status_class),
    }
    exposed = samples(generate_latest(metrics.registry))
    return exposed["http_server_request_duration_seconds_count", frozenset(labels)]


def prometheus_twin(metrics: Metrics) -> tuple[CollectorRegistry, Histogram]:
    """prometheus-client's own histogram of the bridge's request durations, in a registry
    of its own: what the bridge's counts must equal."""
    registry = CollectorRegistry()
    reference = Histogram(
        metrics.requests.name,
        metrics.requests.documentation,
        metrics.requests.labelnames,
        buckets=HTTP_BUCKETS,
        registry=registry,
    )
    return registry, reference


def test_request_durations_are_exposed_as_a_prometheus_histogram_would_be():
    metrics = Metrics()
    registry, reference = prometheus_twin(metrics)
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


def counted_route(method: str, path: str) -> tuple[Metrics, Observer, RouteFacts]:
    """An application's observer counting into fresh metrics, and the facts of one route
    of it, for records put in the observer's batch by hand."""
    app = web.Application()

    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    route = app.router.add_route(method, path, handler)
    metrics = Metrics()
    found = observer(app)
    found.count(metrics)
    return metrics, found, RouteFacts(route, method, metrics.requests)


def test_requests_settled_in_a_batch_land_in_the_buckets_prometheus_would_choose():
    """The batch's settle counts each request's duration itself (no ``observe``): every
    bound, just over it, and past the last, as prometheus-client's histogram counts them."""
    metrics, found, facts = counted_route("POST", "/v1/sessions")
    registry, reference = prometheus_twin(metrics)
    durations = [*SECONDS, *HTTP_BUCKETS, *(b + 1e-9 for b in HTTP_BUCKETS)]
    for seconds in durations:
        found.pending.append((facts, "POST", None, 201, 10, None, 100.0, 100.0 + seconds))
        reference.labels(*LABELS).observe((100.0 + seconds) - 100.0)
    ours = samples(generate_latest(metrics.registry))  # the scrape settles the batch
    mine = {k: v for k, v in ours.items() if k[0].startswith(metrics.requests.name)}
    assert mine == samples(generate_latest(registry))
    assert requests_counted(metrics, "/v1/sessions", "POST", "2xx") == len(durations)


def test_a_status_outside_the_five_classes_is_counted_as_5xx():
    """aiohttp lets a host's handler answer any integer status: the histogram counts one
    outside 100-599 under 5xx, with the 5xx answers, and loses no request of the batch."""
    metrics, found, facts = counted_route("GET", "/x")
    statuses = (503, 600, 999, 1000, 12345, 42, 0, -600, -12345, 200)
    for status in statuses:
        found.pending.append((facts, "GET", None, status, 10, None, 100.0, 100.001))
    assert requests_counted(metrics, "/x", "GET", "5xx") == len(statuses) - 1
    assert requests_counted(metrics, "/x", "GET", "2xx") == 1


def test_a_status_outside_the_five_classes_has_its_line_and_the_batch_its_lines():
    """aiohttp writes whatever integer status a host's handler sets (a negative one too):
    its line shows it, and the other lines of its batch are written."""
    app = web.Application()

    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    where = RouteFacts(app.router.add_get("/x", handler), "GET", None)
    statuses = (-12345, -1, 0, 42, 999, 1023, 1024, 12345, 200)
    records = [(where, "GET", None, s, 10, None, 100.0, 100.001) for s in statuses]
    for log_format in logs.LOG_FORMATS:
        text = logs.AccessLines(log_format, io.StringIO()).lines(records, None)
        lines = text.splitlines()
        assert len(lines) == len(statuses)
        for line, status in zip(lines, statuses, strict=True):
            message = json.loads(line)["message"] if log_format == "json" else line
            assert f" GET /x {status} 1.0ms 10B" in f" {message.split(' bridge.access ')[-1]}"


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
    assert requests_counted(metrics, "/x/{sessionId}", "GET", "5xx") == 1


def test_the_session_ids_an_access_line_repeats_are_checked_and_kept_bounded():
    for index in range(logs.SAFE_IDS_KEPT * 2 + 1):
        assert logs.session_part(f"s-{index}") == f" session=s-{index}"
        assert logs.session_part(f"s-{index}") == f" session=s-{index}"  # the one kept
    assert len(logs._safe_ids) <= logs.SAFE_IDS_KEPT
    for unsafe in ("x\ny", "a" * 129, "x y", "", "é"):
        assert logs.session_part(unsafe) == " session=?"
        assert unsafe not in logs._safe_ids
    assert logs.session_part("a" * 128) == " session=" + "a" * 128


def test_a_batch_of_lines_gives_each_request_its_own_end_time_and_fields():
    """Lines are made a batch at a time, their time text once per millisecond: each line
    still says when its own request ended (to the millisecond) and its own fields."""
    app = web.Application()

    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    route = app.router.add_post("/v1/sessions/{sessionId}/call/{method}", handler)
    where = RouteFacts(route, "POST", None)
    base = logs.clock()
    # Ten requests 0.3 ms apart (three or four to a millisecond), then one 2 s later.
    ends = [base + k * 0.0003 for k in range(10)] + [base + 2.0]
    records = [
        (where, "POST", "s-1" if k % 2 else "x y", 200 + k, 180 + k, None, end - 0.0004, end)
        for k, end in enumerate(ends)
    ]
    records[3] = (*records[3][:3], 502, 2000, "app_server_exited", ends[3] - 1.23456, ends[3])
    before = time.time() - logs.clock()
    text = logs.AccessLines("json", io.StringIO()).lines(records, "r1")
    after = time.time() - logs.clock()
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == len(records)
    for line, (_, _, _, status, size, kind, began, ended) in zip(lines, records, strict=True):
        shown = datetime.strptime(line["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
        wall = shown.replace(tzinfo=UTC).timestamp()
        assert ended + before - 0.0015 <= wall <= ended + after + 0.0005, (line, ended)
        assert line["status"] == status
        assert line["bytes"] == size
        assert line["durationMs"] == round((ended - began) * 1000, 1)
        assert line.get("errorKind") == kind
        assert line["replicaId"] == "r1"
        assert line["route"] == "/v1/sessions/{sessionId}/call/{method}"
        assert line["message"].startswith(f"POST {line['route']} {status} ")
    assert [x.get("sessionId") for x in lines[:4]] == ["?", "s-1", "?", "s-1"]
    assert lines[3]["message"].endswith(
        " 1234.6ms 2000B session=s-1 replica=r1 error=app_server_exited"
    )
    texts = logs.AccessLines("text", io.StringIO()).lines(records, None).splitlines()
    assert [t.split(" INFO bridge.access ", 1)[1] for t in texts] == [
        x["message"].removesuffix(" replica=r1").replace(" replica=r1 ", " ") for x in lines
    ]


@pytest.mark.asyncio
async def test_a_scrape_counts_every_request_ended_before_it(serve, http):
    """Durations are counted a batch at a time: a scrape settles the batch first."""

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/x/{sessionId}", ok)
    metrics = Metrics()
    observer(app).count(metrics)
    base = await serve(app)
    for _ in range(3):
        async with http.get(f"{base}/x/abc") as response:
            assert response.status == 200
    assert requests_counted(metrics, "/x/{sessionId}", "GET", "2xx") == 3


@pytest.mark.asyncio
async def test_a_request_whose_client_left_first_is_counted_apart(serve):
    """Its access line says 499; the duration histogram does not count it, the count of
    abandoned requests does, by route and method."""
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        entered.set()
        try:
            await asyncio.Event().wait()  # until the client leaves
        finally:
            cancelled.set()
        raise AssertionError("not reached")

    app = web.Application()
    app.router.add_get("/held/{sessionId}", held)
    metrics = Metrics()
    observer(app).count(metrics)
    base = await serve(app)
    host, port = base.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /held/abc HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(entered.wait(), 30)
    writer.close()
    await writer.wait_closed()
    # The handler is cancelled, and the middleware has seen it end, in one step.
    await asyncio.wait_for(cancelled.wait(), 30)
    exposed = samples(generate_latest(metrics.registry))
    durations = {
        dict(labels)["http_route"]
        for name, labels in exposed
        if name == "http_server_request_duration_seconds_count"
    }
    assert "/held/{sessionId}" not in durations
    abandoned = frozenset({("http_route", "/held/{sessionId}"), ("http_request_method", "GET")})
    assert exposed["rest_bridge_requests_abandoned_total", abandoned] == 1
    active = ("http_server_active_requests", "/held/{sessionId}")
    assert [
        v for (n, labels), v in exposed.items() if (n, dict(labels).get("http_route")) == active
    ] == [0]
