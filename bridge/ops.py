"""The operations listener: ``/metrics``, ``/livez`` and ``/readyz`` on a port of their own.

Off unless asked (``rest-bridge serve --ops-port``, ``REST_ADAPTER_OPS_PORT``), on
loopback by default (``--ops-host``), and apart from the API: the API's routes and
auth rules do not change, and nothing here is reachable on the API's port.

- :func:`enable_metrics` turns an application's metrics on: the observing middleware
  (:mod:`bridge.observe`), outermost, counts every request (by route template), and
  the backend reports what only it knows (:class:`bridge.metrics.Metrics`); a collector
  reads the bundled backend's state (sessions, pending requests, event logs, the shared
  app-server) when Prometheus scrapes.
- :class:`Readiness` says whether the replica should get new work: not while the
  app-server cannot be started or initialized with the bridge's own settings (probed at
  start, and again after a failure until one succeeds; a start a caller's options
  shaped is not the replica's to judge by, so its failure only asks for a probe), not
  while the shared app-server is down (restarting after an exit, or after the liveness
  probe found it wedged), not while draining.
- :class:`OpsListener` serves the three routes. What they expose: counts, durations and
  states; never a token, a session id, a path or a body.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from bridge import errors
from bridge.backend import Backend
from bridge.metrics import CONTENT_TYPE, Metrics
from bridge.models import ClientOptions, shaped_by_caller
from bridge.observe import observer
from bridge.process.backend import ProcessBackend
from bridge.process.shared import ConnectShared
from bridge.routes import BACKEND as BACKEND_KEY
from bridge.runtime import StartupError, address
from bridge.server import SERVER_SETTINGS
from bridge.wire import dumps

METRICS = web.AppKey("bridge.metrics", Metrics)
#: Readiness probes after a failure: the first after this, then twice as long each time.
PROBE_FIRST_SECONDS = 1.0
PROBE_MAX_SECONDS = 30.0
#: The states of the shared app-server in which new sessions cannot start.
SHARED_DOWN = frozenset({"restarting", "failed", "stopped"})


def enable_metrics(app: web.Application) -> Metrics:
    """Turn ``app``'s metrics on (before it starts); the :class:`Metrics` it reports to.

    The application's observing middleware (:mod:`bridge.observe`) counts each
    request; it goes first, outside the bearer check, so refused requests count too. A
    backend of :mod:`bridge.process` reports its events and state; a host's backend
    gets the HTTP metrics only.
    """
    metrics = app.get(METRICS)
    if metrics is not None:
        return metrics
    metrics = Metrics()
    app[METRICS] = metrics
    observer(app).count(metrics)
    backend = app.get(BACKEND_KEY)
    if isinstance(backend, ProcessBackend):
        backend.metrics = metrics
        metrics.start_mode(backend.mode)
        metrics.add_collector(BackendCollector(backend))
    return metrics


class BackendCollector:
    """What the bundled backend holds, read at scrape time (nothing on the request path)."""

    def __init__(self, backend: ProcessBackend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        backend = self.backend
        sessions = backend.sessions().values()
        by_state = {"running": 0, "exited": 0}
        pending = events = held_bytes = appended = 0
        for session in sessions:
            by_state["running" if session.running else "exited"] += 1
            pending += session.pending_requests
            log_ = session.events
            events += len(log_)
            held_bytes += log_.retained_bytes
            appended += log_.next_seq - 1
        live = GaugeMetricFamily(
            "rest_bridge_sessions",
            "Sessions held, by state and app-server mode",
            labels=("state", "mode"),
        )
        for state, count in by_state.items():
            live.add_metric((state, backend.mode), count)
        yield live
        yield GaugeMetricFamily(
            "rest_bridge_server_requests_pending",
            "Server requests (approvals) waiting for an answer",
            value=pending,
        )
        yield GaugeMetricFamily(
            "rest_bridge_event_log_events", "Events held in the sessions' logs", value=events
        )
        yield GaugeMetricFamily(
            "rest_bridge_event_log_bytes",
            "Bytes of events held in the sessions' logs",
            value=held_bytes,
        )
        yield CounterMetricFamily(
            "rest_bridge_events_appended",
            "Events appended to the sessions' logs",
            value=appended + backend.events_ended,
        )
        yield CounterMetricFamily(
            "rest_bridge_app_server_late_replies",
            "Replies of the app-server to unknown or finished request ids",
            value=backend.late_replies(),
        )
        yield GaugeMetricFamily(
            "rest_bridge_draining", "1 while the replica drains", value=int(backend.draining)
        )
        launcher = backend.launcher
        if isinstance(launcher, ConnectShared):
            yield GaugeMetricFamily(
                "rest_bridge_shared_app_server_up",
                "1 while the shared app-server runs (or is an external one)",
                value=int(launcher.state not in SHARED_DOWN),
            )
            yield CounterMetricFamily(
                "rest_bridge_shared_app_server_restarts",
                "Restarts of the shared app-server after an exit or a wedge",
                value=launcher.restarts,
            )


class ReadinessCollector:
    """``rest_bridge_ready``: what ``/readyz`` says, as a number."""

    def __init__(self, readiness: Readiness) -> None:
        self.readiness = readiness

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "rest_bridge_ready", "1 while /readyz says ready", value=int(self.readiness.ready)
        )


def start_problem(kind: str) -> str:
    """A readiness reason: the error kind only (the message, which may quote the
    app-server, stays in the API's answers and the log)."""
    return f"the app-server cannot be started or initialized ({kind})"


class Readiness:
    """Whether the replica should get new work, and why not."""

    def __init__(self, backend: Backend, metrics: Metrics | None = None) -> None:
        self.backend = backend
        #: Why the app-server cannot be started now (None: it can).
        self.problem: str | None = None
        self._probing: asyncio.Task[None] | None = None
        #: Set after each probe (a host or a test waits on it), cleared as one begins.
        self.probed = asyncio.Event()
        self._closed = False
        #: Failed starts that callers shaped ask for a probe at most this often (each is
        #: a process, and a failure may cost a caller no process at all: a missing cwd).
        self.caller_probe_seconds = PROBE_FIRST_SECONDS
        self._caller_probe_due = 0.0
        #: Starts with the bridge's own settings that failed, so far (a probe's success
        #: does not undo one reported while it was stopping its process).
        self._failures = 0
        self._probes = isinstance(backend, ProcessBackend)
        if self._probes:
            self.problem = "the app-server has not been probed yet"
        if metrics is not None:
            metrics.start_listeners.append(self._on_start)

    def start(self) -> None:
        """Probe the app-server now (in the background)."""
        if self._probes:
            self._probe_soon()

    def _on_start(self, kind: str | None, options: ClientOptions | None) -> None:
        if shaped_by_caller(options):
            # It may have failed for what the caller asked (a client name codex refuses,
            # a missing cwd): the probe, with the bridge's own settings, tells.
            now = asyncio.get_running_loop().time()
            if kind is not None and now >= self._caller_probe_due:
                self._caller_probe_due = now + self.caller_probe_seconds
                self._probe_soon()
            return
        if kind is None:
            self.problem = None
            return
        self.problem = start_problem(kind)
        self._failures += 1
        self._probe_soon()

    async def settled(self) -> None:
        """Wait for the probe under way, if any, to end (a host or a test)."""
        if self._probing is not None:
            await asyncio.shield(self._probing)

    def _probe_soon(self) -> None:
        if self._closed or (self._probing is not None and not self._probing.done()):
            return
        self._probing = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        assert isinstance(self.backend, ProcessBackend)
        delay = PROBE_FIRST_SECONDS
        while not self._closed:
            self.probed.clear()
            failures = self._failures
            try:
                await self.backend.probe()
            except errors.RestError as exc:
                self.problem = start_problem(exc.kind)
            except Exception as exc:  # a probe reports, it never raises
                self.problem = start_problem(type(exc).__name__)
            else:
                # A start that failed meanwhile is newer news: probe again, later.
                if self._failures == failures:
                    self.problem = None
                    self.probed.set()
                    return
            self.probed.set()
            await asyncio.sleep(delay)
            delay = min(delay * 2, PROBE_MAX_SECONDS)

    def reasons(self) -> list[str]:
        backend = self.backend
        reasons = []
        if backend.draining:
            reasons.append("draining: the replica takes no new work")
        if isinstance(backend, ProcessBackend):
            launcher = backend.launcher
            if isinstance(launcher, ConnectShared) and launcher.state in SHARED_DOWN:
                reasons.append(f"the shared app-server is {launcher.state}")
        if self.problem is not None:
            reasons.append(self.problem)
        return reasons

    @property
    def ready(self) -> bool:
        return not self.reasons()

    async def close(self) -> None:
        self._closed = True
        if self._probing is not None:
            self._probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probing


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=dumps(body), content_type="application/json")


def ops_app(metrics: Metrics, readiness: Readiness) -> web.Application:
    """The operations listener's application: three routes, everything else a 404."""

    async def metrics_route(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE}
        )

    async def livez(request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        reasons = readiness.reasons()
        if not reasons:
            return _json({"ready": True, "reasons": []})
        error = errors.of_kind(
            "replica_unavailable",
            "Not ready: " + "; ".join(reasons),
            data={"ready": False, "reasons": reasons},
        )
        return error.to_response()

    @web.middleware
    async def as_error_payload(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return errors.from_http_exception(exc, None).to_response()

    app = web.Application(middlewares=[as_error_payload], client_max_size=1024)
    for path, handler in (("/metrics", metrics_route), ("/livez", livez), ("/readyz", readyz)):
        app.router.add_get(path, handler)  # GET and HEAD
    return app


class OpsListener:
    """The operations listener of one bridge application, started and closed with it."""

    def __init__(self, app: web.Application) -> None:
        self.metrics = enable_metrics(app)
        backend = app[BACKEND_KEY]
        self.backend = backend
        self.readiness = Readiness(backend, self.metrics)
        self.metrics.add_collector(ReadinessCollector(self.readiness))
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (0: a free port); the bound address, as ``host:port``.

        Raises :class:`bridge.runtime.StartupError` when it cannot listen there.
        """
        self.metrics.replica = self.backend.replica_id
        runner = web.AppRunner(
            ops_app(self.metrics, self.readiness), access_log=None, **SERVER_SETTINGS
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except (OSError, OverflowError) as exc:
            await runner.cleanup()
            raise StartupError(
                f"cannot listen on {address(host, port)} (--ops-port): {exc.strerror or exc}"
                if isinstance(exc, OSError)
                else f"cannot listen on {address(host, port)} (--ops-port): {exc}"
            ) from None
        self._runner = runner
        self.readiness.start()
        bound = runner.addresses[0]
        return address(str(bound[0]), int(bound[1]))

    async def close(self) -> None:
        await self.readiness.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
