"""One observing middleware: the access line and the HTTP metrics of every request.

:func:`observer` installs it on an application, outermost (outside the bearer check,
so a refused request is seen too), once; `rest-bridge serve` turns its access lines on
(:meth:`Observer.log_access`) and the operations listener its metrics
(:meth:`Observer.count`). Without either nothing is installed, and a request pays
nothing.

A request is observed from the same facts for both: the clock read once when the
middleware is entered and once when the response has been written (so the duration and
the bytes are those of the whole answer, head included), the route's template, method
and series found once per route and method and kept, and the error kind the response
carries (:data:`bridge.errors.ERROR_KIND`). A handler cancelled before it answered (its
client went away) gets its line with status :data:`bridge.logs.CLIENT_GONE` and the
bytes sent so far; the metrics count it in flight only while it runs.

Two kinds of request never reach the middleware, and are observed all the same: one
refused by a route's ``Expect`` handler before any middleware runs (the 401 of a
request without the token; :func:`observed_expect`), and one aiohttp's parser refused
(its access line only, from aiohttp's access-log hook: :class:`bridge.logs.AccessLog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from bridge import errors
from bridge.errors import ERROR_KIND
from bridge.logs import CLIENT_GONE, NO_ROUTE, AccessLog, safe_method, safe_session_id

if TYPE_CHECKING:
    # prometheus-client is loaded where metrics are on (bridge.metrics), not here.
    from prometheus_client.core import Metric

    from bridge.metrics import Durations, DurationSeries, Metrics
from bridge.labels import KNOWN_METHODS, status_class

#: The statuses whose error kind ``rest_bridge_refusals_total`` counts.
REFUSAL_STATUSES = frozenset({401, 403, 413, 429})
REFUSAL_KINDS = frozenset(e.kind for e in errors.ERROR_KINDS if e.status in REFUSAL_STATUSES)
#: The only kind at a status, where there is one (a response that names none).
_ONLY_KIND = {
    status: kinds[0]
    for status in REFUSAL_STATUSES
    if len(kinds := [e.kind for e in errors.ERROR_KINDS if e.status == status]) == 1
}
#: The method label of any method outside :data:`bridge.labels.KNOWN_METHODS`.
OTHER_METHOD = "_OTHER"

_clock = time.perf_counter


def refusal_kind(response: web.StreamResponse, kind: str | None) -> str | None:
    """The error kind of a refusal: the one the response carries (every error payload
    of the bridge does), else the kind its body names (a host's backend may build its
    own), else the only kind at its status."""
    if kind in REFUSAL_KINDS:
        return kind
    body = response.body if isinstance(response, web.Response) else None
    if isinstance(body, bytes):
        with contextlib.suppress(orjson.JSONDecodeError, TypeError, AttributeError):
            named = orjson.loads(body).get("error")
            if named in REFUSAL_KINDS:
                return str(named)
    return _ONLY_KIND.get(response.status)


class RouteFacts:
    """What is known of a route and a method before any request of them: found once."""

    __slots__ = (
        "active",
        "by_class",
        "label",
        "method",
        "name",
        "requests",
        "route",
        "sessions",
        "shown",
    )

    def __init__(self, route: web.AbstractRoute, method: str, requests: Durations | None) -> None:
        resource = route.resource
        #: The template in an access line (``-``: none) and in the metrics' labels.
        self.route = resource.canonical if resource is not None else NO_ROUTE
        self.label = resource.canonical if resource is not None else "unmatched"
        self.name = route.name
        #: The method label; the method an access line shows (None: the request's own,
        #: made safe, as the label is ``_OTHER`` for many methods).
        self.method = method
        self.shown: str | None = None if method == OTHER_METHOD else method
        #: Whether the path has a session id (a line names it).
        self.sessions = resource is not None and "{sessionId}" in resource.canonical
        self.requests = requests
        #: Requests of the route and method being handled now.
        self.active = 0
        #: The duration histogram's child by status class (status // 100).
        self.by_class: dict[int, DurationSeries] = {}

    def duration(self, status: int) -> DurationSeries:
        child = self.by_class.get(status // 100)
        if child is None:
            assert self.requests is not None
            child = self.requests.labels(self.label, self.method, status_class(status))
            self.by_class[status // 100] = child
        return child


class InFlight:
    """``http_server_active_requests`` by route and method, and the SSE streams and
    long-polls among them, from the middleware's counts (read at scrape time)."""

    def __init__(self, facts: dict[tuple[web.AbstractRoute, str], RouteFacts]) -> None:
        self.facts = facts

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily  # at scrape time: metrics are on

        active = GaugeMetricFamily(
            "http_server_active_requests",
            "HTTP requests being handled now",
            labels=("http_route", "http_request_method"),
        )
        readers = {"events_stream": 0, "events": 0}
        for found in list(self.facts.values()):
            active.add_metric((found.label, found.method), found.active)
            if found.name in readers:
                readers[found.name] += found.active
        yield active
        yield GaugeMetricFamily(
            "rest_bridge_sse_streams",
            "Server-Sent Event streams attached now",
            value=readers["events_stream"],
        )
        yield GaugeMetricFamily(
            "rest_bridge_long_polls", "Event long-polls waiting now", value=readers["events"]
        )


class Observer:
    """The observing middleware of one application and what it feeds: an access line
    (:attr:`access`), the HTTP metrics (:attr:`metrics`), either or both."""

    def __init__(self) -> None:
        self.access: AccessLog | None = None
        self.metrics: Metrics | None = None
        #: The facts by route and method label: as many as routes times known methods.
        self.facts: dict[tuple[web.AbstractRoute, str], RouteFacts] = {}
        #: The first route without a resource seen, by method label.
        self.unrouted: dict[str, web.AbstractRoute] = {}

    def log_access(self, access: AccessLog) -> None:
        """An access line for each request, written by ``access``."""
        self.access = access

    def count(self, metrics: Metrics) -> None:
        """Each request in ``metrics``: its duration by route, method and status class,
        the refusals by kind, the requests in flight."""
        if self.metrics is None:
            self.metrics = metrics
            metrics.add_collector(InFlight(self.facts))
            for found in self.facts.values():
                found.requests = metrics.requests

    def facts_of(self, request: web.Request) -> RouteFacts:
        route = request.match_info.route
        method = request.method
        found = self.facts.get((route, method))
        if found is None:
            if method not in KNOWN_METHODS:
                method = OTHER_METHOD
            if route.resource is None:
                # aiohttp's answer to a request no route takes (a target that is not a
                # path: CONNECT host:port, OPTIONS *) is a new route object each time:
                # they all share the first one's facts.
                route = self.unrouted.setdefault(method, route)
            found = self.facts.get((route, method))
            if found is None:
                requests = self.metrics.requests if self.metrics is not None else None
                found = self.facts[route, method] = RouteFacts(route, method, requests)
        return found

    def middleware(self) -> Middleware:
        """The middleware (one per observer: :func:`observer` installs it)."""
        facts_of, done, line, failed = self.facts_of, self.done, self.line, self.failed

        @web.middleware
        async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
            began = _clock()
            facts = facts_of(request)
            facts.active += 1
            try:
                response = await handler(request)
                try:
                    # Written here rather than after the middleware returns (aiohttp
                    # then finds it done): the duration and bytes are the whole answer's.
                    await response.prepare(request)
                    await response.write_eof()
                except ConnectionError:
                    pass  # the client is gone: aiohttp, writing again, closes the connection
            except asyncio.CancelledError:
                if self.access is not None:
                    size = request.writer.output_size
                    line(request, facts, CLIENT_GONE, size, None, _clock() - began)
                raise
            except Exception as exc:
                # Not from the bridge's own middlewares, which answer every failure; a
                # host's, inside this one: aiohttp answers it (500 or the exception's).
                failed(request, facts, exc, _clock() - began)
                raise
            finally:
                facts.active -= 1
            done(request, facts, response, _clock() - began)
            return response

        return observe

    def done(
        self, request: web.Request, facts: RouteFacts, response: web.StreamResponse, seconds: float
    ) -> None:
        status = response.status
        # Only an error payload has a kind: a success does not pay for the lookup.
        kind = response.get(ERROR_KIND) if status >= 400 else None
        metrics = self.metrics
        if metrics is not None:
            facts.duration(status).observe(seconds)
            if status in REFUSAL_STATUSES:
                refused = refusal_kind(response, kind)
                if refused is not None:
                    metrics.refusals.labels(refused).inc()
        if self.access is not None:
            self.line(request, facts, status, response.body_length, kind, seconds)

    def failed(
        self, request: web.Request, facts: RouteFacts, exc: Exception, seconds: float
    ) -> None:
        status = exc.status if isinstance(exc, web.HTTPException) else 500
        if self.metrics is not None:
            facts.duration(status).observe(seconds)
        if self.access is not None:
            self.line(request, facts, status, request.writer.output_size, None, seconds)

    def line(
        self,
        request: web.Request,
        facts: RouteFacts,
        status: int,
        size: int,
        kind: str | None,
        seconds: float,
    ) -> None:
        assert self.access is not None
        session = safe_session_id(request.match_info.get("sessionId")) if facts.sessions else None
        method = facts.shown or safe_method(request.method)
        self.access.write(method, facts.route, session, status, size, kind, seconds)

    def answered_early(
        self, request: web.Request, response: web.StreamResponse, seconds: float
    ) -> None:
        """``response``, sent before any middleware ran (a route's ``Expect`` handler)."""
        self.done(request, self.facts_of(request), response, seconds)


OBSERVER = web.AppKey("bridge.observer", Observer)


def observer(app: web.Application) -> Observer:
    """``app``'s observer, its middleware installed outermost the first time (before the
    application starts)."""
    found = app.get(OBSERVER)
    if found is None:
        found = app[OBSERVER] = Observer()
        app.middlewares.insert(0, found.middleware())
    return found


def observed_expect(handler: errors.ExpectHandler) -> errors.ExpectHandler:
    """``handler`` (a route's ``Expect`` handler), whose answers, sent before any
    middleware runs, are observed like any other (when the application has an observer)."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        began = _clock()
        response = await handler(request)
        if response is not None:
            found = request.app.get(OBSERVER)
            if found is not None:
                found.answered_early(request, response, _clock() - began)
        return response

    return expect
