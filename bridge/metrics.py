"""The bridge's Prometheus metrics: one registry per application, nothing global.

:class:`Metrics` holds a registry of its own (so several applications in one process
never share a series) and every metric the bridge exports. What changes on an event
(a request answered, an app-server spawned, a server request answered, a gap sent) is
observed where the event happens, through the few methods below; what is a state (live
sessions, pending requests, bytes held) is read when Prometheus scrapes, by collectors
added with :meth:`Metrics.add_collector` (:mod:`bridge.ops`), so serving pays nothing
for it.

Names follow Prometheus's conventions (``_total``, ``_seconds``, ``_bytes``) and, for
HTTP, OpenTelemetry's semantic conventions (``http_server_request_duration_seconds``,
``http_route``, ``http_request_method``). Every label takes values from a fixed set:
route templates, not paths; methods outside the known few become ``_OTHER``; error
kinds come from the bridge's error table. With a replica id, every series carries a
``replica`` label (:attr:`Metrics.replica`), set when the metrics are exposed.

It imports nothing else of the bridge but the label values (:mod:`bridge.labels`) and,
as a type, the client options, so every layer may report to it; it is imported only
where metrics are on.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

from prometheus_client import CollectorRegistry, Counter, Histogram, Metric
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from bridge.labels import EXIT_REASONS as EXIT_REASONS
from bridge.labels import KNOWN_METHODS as KNOWN_METHODS
from bridge.labels import STATUS_CLASSES as STATUS_CLASSES
from bridge.labels import exit_reason as exit_reason
from bridge.labels import status_class as status_class

if TYPE_CHECKING:
    from bridge.models import ClientOptions

#: How prometheus-client writes a bucket's bound (its ``le`` label); untyped there.
_bound_label = cast(Callable[[float], str], floatToGoString)

#: The content type of :meth:`Metrics.exposition` (Prometheus's text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: OpenTelemetry's recommended boundaries for HTTP durations, and a few longer ones for
#: long-polls, streams and text turns.
HTTP_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0,
    60.0, 300.0,
)  # fmt: skip
#: A server request (an approval) waits for a person: seconds to an hour.
WAIT_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
TURN_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ReplicaRegistry(CollectorRegistry):
    """A registry whose every sample carries ``replica="<id>"`` once :attr:`replica` is
    set (a constant label, as a replica is scraped on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.replica: str | None = None

    def collect(self) -> Iterator[Metric]:
        replica = self.replica
        for family in super().collect():
            if replica is None:
                yield family
                continue
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labelled.add_sample(
                    sample.name,
                    {**sample.labels, "replica": replica},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
            yield labelled


class DurationSeries:
    """One label set of a :class:`Durations`: a count per bucket, and the sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        #: Observations by the first bucket they fit (the last: above every bound).
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


class Durations:
    """A histogram kept as plain counts, exposed when Prometheus scrapes: the same series
    as prometheus-client's ``Histogram`` (``_bucket``, ``_count``, ``_sum``,
    ``_created``), at a tenth of its cost an observation (no lock: the bridge observes
    and is scraped on its event loop's thread). For the HTTP requests, observed once each.
    """

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.buckets = buckets
        self.series: dict[tuple[str, ...], DurationSeries] = {}
        #: Called before the series are read: what observes in batches settles first.
        self.before_collect: Callable[[], None] | None = None

    def labels(self, *values: str) -> DurationSeries:
        """The series of ``values`` (one per label name), made the first time."""
        found = self.series.get(values)
        if found is None:
            found = self.series[values] = DurationSeries(self.buckets)
        return found

    def collect(self) -> Iterator[Metric]:
        if self.before_collect is not None:
            self.before_collect()
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        bounds = [_bound_label(b) for b in self.buckets] + ["+Inf"]
        for values, series in list(self.series.items()):
            cumulative, total = [], 0
            for bound, count in zip(bounds, series.counts, strict=True):
                total += count
                cumulative.append((bound, total))
            family.add_metric(list(values), cumulative, series.sum)
            labels = dict(zip(self.labelnames, values, strict=True))
            family.samples.append(Sample(f"{self.name}_created", labels, series.created))
        yield family


class Metrics:
    """Every metric of one bridge application, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = ReplicaRegistry()
        registry = self.registry
        self.requests = Durations(
            "http_server_request_duration_seconds",
            "Duration of HTTP requests, by route template, method and status class",
            ("http_route", "http_request_method", "http_response_status_class"),
            HTTP_BUCKETS,
        )
        registry.register(self.requests)
        self.abandoned = Counter(
            "rest_bridge_requests_abandoned",
            "Requests ended before their answer was complete: the client left (a closed "
            "stream, an abandoned call), or the bridge stopped",
            ("http_route", "http_request_method"),
            registry=registry,
        )
        self.refusals = Counter(
            "rest_bridge_refusals",
            "Requests refused before any work: 401, 403 (policy), 413, 429, by error kind",
            ("kind",),
            registry=registry,
        )
        self.spawns = Counter(
            "rest_bridge_app_server_spawns",
            "App-server conversations opened (a process, or a connection in shared mode)",
            ("mode",),
            registry=registry,
        )
        self.start_failures = Counter(
            "rest_bridge_app_server_start_failures",
            "App-servers that could not be started or initialized, by error kind",
            ("mode", "kind"),
            registry=registry,
        )
        self.exits = Counter(
            "rest_bridge_app_server_exits",
            "App-server conversations that ended, by reason",
            ("mode", "reason"),
            registry=registry,
        )
        self.request_wait = Histogram(
            "rest_bridge_server_request_wait_seconds",
            "How long a server request (an approval) waited until answered",
            ("outcome",),
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.gaps = Counter(
            "rest_bridge_event_gaps",
            "gap events sent to readers (events they lacked were dropped)",
            registry=registry,
        )
        self.cut_loose = Counter(
            "rest_bridge_readers_cut_loose",
            "Event streams that stopped reading and were cut loose",
            registry=registry,
        )
        self.text_turns = Histogram(
            "rest_bridge_text_turn_duration_seconds",
            "Duration of text turns, by outcome",
            ("outcome",),
            buckets=TURN_BUCKETS,
            registry=registry,
        )
        self.first_event = Histogram(
            "rest_bridge_text_turn_first_event_seconds",
            "Time from a text turn's request to the app-server's first event",
            buckets=TURN_BUCKETS,
            registry=registry,
        )
        #: Called with (kind, the client options of the start) when an app-server fails
        #: to start, and with (None, options) when one started (readiness listens).
        self.start_listeners: list[Callable[[str | None, ClientOptions | None], None]] = []

    @property
    def replica(self) -> str | None:
        return self.registry.replica

    @replica.setter
    def replica(self, value: str | None) -> None:
        self.registry.replica = value

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def names(self) -> set[str]:
        """Every series name this registry exposes, children or not yet (``_total``,
        ``_bucket``, ``_count``, ``_sum``: by each family's type)."""
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
        return {
            family.name + suffix
            for family in self.registry.collect()
            for suffix in suffixes.get(family.type, ("",))
        }

    def start_mode(self, mode: str) -> None:
        """The exit reasons of ``mode``, at 0 from the start (for ``rate()`` and alerts)."""
        for reason in EXIT_REASONS:
            self.exits.labels(mode, reason)

    # -- what the backend reports ---------------------------------------------------

    def spawned(self, mode: str) -> None:
        self.spawns.labels(mode).inc()

    def started(self, options: ClientOptions | None) -> None:
        for listener in self.start_listeners:
            listener(None, options)

    def start_failed(self, mode: str, kind: str, options: ClientOptions | None) -> None:
        """An app-server the client ``options`` shaped (None: the bridge's own settings)
        could not be started or initialized: counted by ``kind`` whoever shaped it."""
        self.start_failures.labels(mode, kind).inc()
        for listener in self.start_listeners:
            listener(kind, options)

    def exited(self, mode: str, reason: str) -> None:
        self.exits.labels(mode, reason).inc()

    def answered(self, outcome: str, waited: float) -> None:
        self.request_wait.labels(outcome).observe(waited)

    def text_turn(self, outcome: str, seconds: float, first_event: float | None) -> None:
        self.text_turns.labels(outcome).observe(seconds)
        if first_event is not None:
            self.first_event.observe(first_event)
