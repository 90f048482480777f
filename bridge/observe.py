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
from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from bridge import errors, logs
from bridge.errors import ERROR_KIND
from bridge.labels import KNOWN_METHODS, class_number, status_class
from bridge.logs import (
    BATCH_LINES,
    CLIENT_GONE,
    FLUSH_SECONDS,
    NO_ROUTE,
    AccessLog,
    LineRoute,
    clock,
)

if TYPE_CHECKING:
    # prometheus-client is loaded where metrics are on (bridge.metrics), not here.
    from prometheus_client.core import Metric

    from bridge.metrics import Durations, DurationSeries, Metrics

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


class RouteFacts(LineRoute):
    """What is known of a route and a method before any request of them: found once."""

    __slots__ = ("active", "by_class", "label", "method", "name", "requests", "uncounted")

    def __init__(self, route: web.AbstractRoute, method: str, requests: Durations | None) -> None:
        resource = route.resource
        #: The template in an access line (``-``: none) and the method it shows (None:
        #: the request's own, made safe, as the label is ``_OTHER`` for many methods).
        super().__init__(
            resource.canonical if resource is not None else NO_ROUTE,
            None if method == OTHER_METHOD else method,
        )
        #: The template in the metrics' labels.
        self.label = resource.canonical if resource is not None else "unmatched"
        self.name = route.name
        #: The method label.
        self.method = method
        self.requests = requests
        #: Requests of the route and method being handled now.
        self.active = 0
        #: The duration histogram's series by status class (``class_number``, 1 to 5),
        #: made when the class is first seen.
        self.by_class: list[DurationSeries | None] = [None] * 6
        #: The same route in a record that has a line and no metric.
        self.uncounted = LineRoute(self.route, self.shown)

    def duration(self, status: int) -> DurationSeries:
        index = class_number(status)
        child = self.by_class[index]
        if child is None:
            assert self.requests is not None
            child = self.requests.labels(self.label, self.method, status_class(status))
            self.by_class[index] = child
        return child


#: A request's record (:data:`bridge.logs.Record`), from its route's facts.
Observed = tuple[LineRoute, str, "str | None", int, int, "str | None", float, float]


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


#: Where :attr:`Observer.timer` holds no timer: no access lines to write in time.
_UNTIMED = object()


class Observer:
    """The observing middleware of one application and what it feeds: an access line
    (:attr:`access`), the HTTP metrics (:attr:`metrics`), either or both.

    The middleware keeps the facts of each request it saw end (:data:`bridge.logs.Record`)
    in one batch, :attr:`pending`, and :meth:`settle` hands the batch to both: at most
    :data:`bridge.logs.BATCH_LINES` requests or :data:`bridge.logs.FLUSH_SECONDS` apart
    (with access lines), before any other log line is written
    (:func:`bridge.logs.settle_pending`), when Prometheus scrapes, and when the
    application stops. A
    request pays for a tuple and an append; the lines are formatted and the durations
    counted a batch at a time.
    """

    def __init__(self) -> None:
        self.access: AccessLog | None = None
        self.metrics: Metrics | None = None
        #: The facts by route, for a route of one method (most).
        self.by_route: dict[web.AbstractRoute, RouteFacts] = {}
        #: The facts by route and method label: as many as routes times known methods.
        self.facts: dict[tuple[web.AbstractRoute, str], RouteFacts] = {}
        #: The first route without a resource seen, by method label.
        self.unrouted: dict[str, web.AbstractRoute] = {}
        #: The requests ended and not yet settled.
        self.pending: list[Observed] = []
        #: A batch this long is settled at once (1: lines written through ``logging``).
        self.limit = BATCH_LINES
        self.timer: asyncio.TimerHandle | object | None = None

    def log_access(self, access: AccessLog) -> None:
        """An access line for each request, written by ``access``."""
        self.access = access
        logs.holds_lines(self)
        self.refresh()

    def count(self, metrics: Metrics) -> None:
        """Each request in ``metrics``: its duration by route, method and status class,
        the refusals by kind, the requests in flight."""
        if self.metrics is None:
            self.metrics = metrics
            metrics.add_collector(InFlight(self.facts))
            # What Prometheus reads includes every request ended before it asked.
            metrics.requests.before_collect = self.settle
            for found in self.facts.values():
                found.requests = metrics.requests

    def refresh(self) -> None:
        """How the batch is settled, from where the lines go (read again when the
        application starts)."""
        self.limit = 1 if self.access is not None and not self.access.batched() else BATCH_LINES

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
                if route.resource is not None and route.method == method:
                    self.by_route[route] = found
        return found

    def middleware(self) -> Middleware:
        """The middleware (one per observer: :func:`observer` installs it)."""
        by_route, facts_of, add = self.by_route, self.facts_of, self.add

        @web.middleware
        async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
            began = clock()
            facts = by_route.get(request.match_info.route)
            if facts is None:
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
                # Its line, and a count of its own: a request whose client left first
                # has no status of its own nor a duration of a whole answer.
                size = request.writer.output_size
                add(request, facts.uncounted, CLIENT_GONE, size, None, began)
                if self.metrics is not None:
                    self.metrics.abandoned.labels(facts.label, facts.method).inc()
                raise
            except Exception as exc:
                # Not from the bridge's own middlewares, which answer every failure; a
                # host's, inside this one: aiohttp answers it (500 or the exception's).
                status = exc.status if isinstance(exc, web.HTTPException) else 500
                add(request, facts, status, request.writer.output_size, None, began)
                raise
            finally:
                facts.active -= 1
            status = response.status
            kind = None
            if status >= 400:
                # Only an error payload has a kind: a success does not pay for the lookup.
                kind = response.get(ERROR_KIND)
                if status in REFUSAL_STATUSES:
                    self.refused(response, kind)
            add(request, facts, status, response.body_length, kind, began)
            return response

        return observe

    def add(
        self,
        request: web.Request,
        facts: LineRoute,
        status: int,
        size: int,
        kind: str | None,
        began: float,
    ) -> None:
        """A request that ended (``facts``: its route's, or what its line alone says of
        it), into the batch; the batch settled when it is full, else given its deadline."""
        record: Observed = (
            facts,
            request.method,
            request.match_info.get("sessionId"),
            status,
            size,
            kind,
            began,
            clock(),
        )
        self.pending.append(record)
        if len(self.pending) >= self.limit:
            self.settle()
        elif self.timer is None:
            self.arm()

    def arm(self) -> None:
        """The batch's deadline: its lines are written within FLUSH_SECONDS."""
        if self.access is None:
            self.timer = _UNTIMED  # settled when full, scraped or stopped
            return
        with contextlib.suppress(RuntimeError):  # no running loop: settled at exit
            self.timer = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.settle)

    def refused(self, response: web.StreamResponse, kind: str | None) -> None:
        if self.metrics is not None:
            refused = refusal_kind(response, kind)
            if refused is not None:
                self.metrics.refusals.labels(refused).inc()

    def settle(self) -> None:
        """The batch's requests, to the metrics and the access lines."""
        timer, self.timer = self.timer, None
        if isinstance(timer, asyncio.TimerHandle):
            timer.cancel()
        if not self.pending:
            return
        batch = self.pending.copy()
        self.pending.clear()
        if self.metrics is not None:
            from bridge.metrics import HTTP_BUCKETS as bounds  # loaded: metrics are on

            first = bounds[0]
            for facts, _, _, status, _, _, began, ended in batch:
                if not isinstance(facts, RouteFacts):
                    continue  # a line only (RouteFacts.uncounted)
                # class_number written out (once per request): a series of a status
                # outside 100-599, or of a class not seen yet, comes from duration().
                series = facts.by_class[status // 100] if 100 <= status < 600 else None
                if series is None:
                    series = facts.duration(status)
                seconds = ended - began
                # Most requests end within the first bucket: no search for them.
                series.counts[0 if seconds <= first else bisect_left(bounds, seconds)] += 1
                series.sum += seconds
        if self.access is not None:
            self.access.write_records(batch)

    def answered_early(
        self, request: web.Request, response: web.StreamResponse, began: float
    ) -> None:
        """``response``, sent before any middleware ran (a route's ``Expect`` handler)."""
        status = response.status
        kind = response.get(ERROR_KIND) if status >= 400 else None
        if status in REFUSAL_STATUSES:
            self.refused(response, kind)
        self.add(request, self.facts_of(request), status, response.body_length, kind, began)


OBSERVER = web.AppKey("bridge.observer", Observer)


def observer(app: web.Application) -> Observer:
    """``app``'s observer, its middleware installed outermost the first time (before the
    application starts)."""
    found = app.get(OBSERVER)
    if found is None:
        found = app[OBSERVER] = Observer()
        app.middlewares.insert(0, found.middleware())
        app.on_startup.append(lambda app: _refreshed(found))
        app.on_cleanup.append(lambda app: _settled(found))
    return found


async def _refreshed(found: Observer) -> None:
    found.refresh()


async def _settled(found: Observer) -> None:
    found.settle()


def observed_expect(handler: errors.ExpectHandler) -> errors.ExpectHandler:
    """``handler`` (a route's ``Expect`` handler), whose answers, sent before any
    middleware runs, are observed like any other (when the application has an observer)."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        began = clock()
        response = await handler(request)
        if response is not None:
            found = request.app.get(OBSERVER)
            if found is not None:
                found.answered_early(request, response, began)
        return response

    return expect
