"""What `rest-bridge serve` does to its own process, apart from parsing its arguments.

An application of :mod:`bridge.app` is the whole HTTP product; serving it as a
program is more: the event loop chosen, glibc told to return big buffers, the
descriptor budget raised and its shortage reported (:mod:`bridge.descriptors`), the
stop and drain signals, the bridge made the subreaper of its app-servers' orphans and
their reaper (:mod:`bridge.subreaper`), its watchdog started (:mod:`bridge.watchdog`: if
the bridge is killed, what it started dies too), and at exit every leftover descendant
killed.
:class:`ServeProcess` holds that policy; ``bridge.cli`` parses arguments and prints.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from aiohttp import web

from bridge import logs
from bridge.descriptors import (
    Acceptor,
    ShortageReporter,
    budget_line,
    listening_sockets,
    raise_soft_limit,
)
from bridge.observe import observer
from bridge.server import SERVER_SETTINGS
from bridge.subreaper import ORPHAN_REAP_SECONDS as ORPHAN_REAP_SECONDS
from bridge.subreaper import OrphanReaper as OrphanReaper
from bridge.subreaper import Watchdog as Watchdog
from bridge.subreaper import become_subreaper as become_subreaper
from bridge.subreaper import carrying as carrying
from bridge.subreaper import children_in_table as children_in_table
from bridge.subreaper import end_all as end_all
from bridge.subreaper import kill_all as kill_all
from bridge.subreaper import own_children as own_children
from bridge.subreaper import reap_every as reap_every
from bridge.subreaper import reap_orphans as reap_orphans

#: Allocations at least this big are mapped from the OS and returned to it when freed.
MMAP_THRESHOLD = 1 << 20
#: `--loop` of serve and cluster.
LOOPS = ("auto", "asyncio", "uvloop")
DEFAULT_LOOP = "uvloop"
SHUTDOWN_HANDLER_SECONDS = 2.0
#: At exit, how long to wait for the last descendants to die once killed.
DESCENDANTS_EXIT_SECONDS = 5.0
#: Objects allocated beyond those freed before Python collects its youngest
#: generation, once `rest-bridge serve` has started (:func:`settle_heap`); Python's
#: default is 700.
GC_YOUNG_THRESHOLD = 10_000

log = logging.getLogger("bridge.process")


class StartupError(Exception):
    """`serve` cannot start; the message is the one line it prints (exit status 2)."""


def return_big_buffers_to_the_os() -> None:
    """Have glibc map big allocations (app-server lines, events) and unmap them when freed.

    By default glibc raises its mmap threshold to the size of the biggest buffer freed so
    far (up to 32 MiB), after which buffers of a few MiB come from the heap and their
    memory stays with the process after a session is deleted: resident memory then creeps
    up with every burst of big events. A fixed threshold keeps it honest.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold = -3
    mallopt(m_mmap_threshold, MMAP_THRESHOLD)


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop `--loop name` asks for; None when that is uvloop and it is not installed.

    ``auto`` is uvloop when it can be imported, else asyncio.
    """
    if name in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            return None if name == "uvloop" else asyncio.new_event_loop
        return uvloop.new_event_loop
    return asyncio.new_event_loop


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: Exception) -> str:
    """The system's words for a failed bind or lookup, without Python's decoration."""
    if isinstance(exc, socket.gaierror) and exc.strerror:
        return exc.strerror
    errno = getattr(exc, "errno", None)
    if errno:
        return os.strerror(errno)
    return str(exc)


#: What stops a process of the bridge's as it should be stopped: Ctrl-C, a supervisor,
#: and the SIGHUP of a terminal that closes (whose default would kill it without its
#: app-servers, its held access lines, or its answers to the requests in flight).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def ignore_stop_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP dropped by the kernel from now on (SIGKILL still ends
    us)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stop_on_first_signal(stop: asyncio.Event) -> None:
    """The first SIGINT, SIGTERM or SIGHUP sets ``stop``; from then on all are ignored.

    For a process that stops by itself once asked (`rest-bridge serve`, the cluster
    launcher), in the main thread with its loop running. Plain handlers, not the loop's:
    swapping one for SIG_IGN is a single step, where removing the loop's restores the
    default first, and a SIGTERM in that moment kills a process on its way out. Ignored
    at once, a flood of signals cannot fill the loop's wakeup pipe either (CPython 3.11's
    handler then blocks for good on a lock).
    """
    loop = asyncio.get_running_loop()
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        # Signals that come before the swap run this again, nested: they return at once.
        nonlocal stopping
        if stopping:
            return
        stopping = True
        ignore_stop_signals()
        loop.call_soon_threadsafe(stop.set)

    sys.unraisablehook = _quiet_about_ignored_signals
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)


def quiet_wakeup_fd() -> None:
    """Call after the loop's ``add_signal_handler``: its wakeup pipe, once full (a few
    hundred signals the loop has not read yet), is then skipped in silence. By default
    CPython reports each failed write with a traceback, from a call it queues inside the
    signal handler, which can block for good on the queue's lock."""
    fd = signal.set_wakeup_fd(-1)
    if fd != -1:
        signal.set_wakeup_fd(fd, warn_on_full_buffer=False)


def _quiet_about_ignored_signals(unraisable: sys.UnraisableHookArgs) -> None:
    """Python's default ``sys.unraisablehook``, without its report of a signal that
    arrived as its handler became SIG_IGN ("Signal 15 ignored due to race condition",
    with a traceback): what :func:`stop_on_first_signal` asks for, not an error."""
    error = unraisable.exc_value
    if isinstance(error, OSError) and str(error).endswith("ignored due to race condition"):
        return
    sys.__unraisablehook__(unraisable)


def settle_heap() -> None:
    """Tune Python's garbage collector for serving, once start-up is done.

    A call allocates a few dozen container objects and frees them by reference count;
    a bridge makes no cyclic garbage while it serves. Python's default still collected
    the youngest generation every 700 objects allocated beyond those freed, which calls
    in flight reach every hundred calls or so, and each such collection promoted the
    calls in flight to an older generation, so that a full collection of every object
    start-up built (about 60,000) followed every few thousand calls: together 3-5 µs of
    CPU per call, measured with ``gc.callbacks`` at 64 calls in flight. Now what start-up
    built is frozen (after one collection that frees its own garbage), so that later
    collections skip it, and the youngest generation is collected every
    :data:`GC_YOUNG_THRESHOLD` objects, which 64 calls in flight did not reach in 12,000
    calls: a call's share of collections is then next to nothing. Cyclic garbage (an
    exception's traceback, a cancelled task) is still collected, once that many objects
    more have been allocated than freed.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


class ServeProcess:
    """The process policy of `rest-bridge serve`, for as long as it serves.

    ``async with ServeProcess(drain) as process:`` takes over the signals (the first
    SIGINT, SIGTERM or SIGHUP stops, SIGUSR1 calls ``drain`` with :attr:`stop`), raises the
    descriptor limit (:attr:`descriptors` says how), reports descriptor shortages, reaps
    orphaned descendants and starts the watchdog; :meth:`serve` listens; leaving stops
    the runner, kills what is left below the bridge, lets the watchdog go and ignores
    further stop signals.
    """

    def __init__(self, drain: Callable[[asyncio.Event], None] | None = None) -> None:
        self._drain = drain
        self.stop = asyncio.Event()
        self.descriptors = ""
        self._shortage = ShortageReporter()
        self._orphans: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._acceptor: Acceptor | None = None
        self._watchdog = Watchdog(logs.log_format())

    async def __aenter__(self) -> ServeProcess:
        loop = asyncio.get_running_loop()
        # Ctrl-C reaches a replica of `rest-bridge cluster` from the terminal, then from
        # the launcher: the first signal stops, the second must not kill the exit.
        stop_on_first_signal(self.stop)
        if self._drain is not None:
            # SIGUSR1: drain (no new work; exit once the last session has ended).
            loop.add_signal_handler(signal.SIGUSR1, self._drain, self.stop)
        quiet_wakeup_fd()
        self.descriptors = budget_line(*raise_soft_limit())
        loop.set_exception_handler(self._shortage)
        # Orphaned descendants of app-servers come to the bridge, not init.
        if become_subreaper():
            self._orphans = asyncio.create_task(reap_every())
        # Before anything is started: the probe, the app-servers (bridge.watchdog).
        self._watchdog.__enter__()
        return self

    async def serve(
        self,
        app: web.Application,
        host: str,
        port: int,
        access_log_class: type[logs.AccessLog] | None = None,
    ) -> tuple[Any, ...]:
        """Serve ``app`` on every address of ``host:port``; the first bound address.
        With ``access_log_class``, a line for each request (:mod:`bridge.logs`).

        Raises :class:`StartupError` when it cannot listen there.
        """
        # The lines come from the application's observing middleware; aiohttp's hook
        # adds the one of a request its parser refused (bridge.observe). The level is
        # read here, once: --log-level warning installs neither.
        access = access_log_class is not None and logs.ACCESS.isEnabledFor(logging.INFO)
        if access_log_class is not None and access:
            observer(app).log_access(access_log_class(logs.ACCESS, ""))
        runner = web.AppRunner(
            app,
            access_log=logs.ACCESS if access else None,
            access_log_class=access_log_class or logs.AccessLog,
            # Shutdown closes the backend first, which ends every stream, long-poll and
            # call; a handler still running this long after that is cancelled.
            shutdown_timeout=SHUTDOWN_HANDLER_SECONDS,
            **SERVER_SETTINGS,
        )
        await runner.setup()
        assert runner.server is not None
        try:
            sockets = listening_sockets(host, port)
        except (OSError, OverflowError) as exc:
            await runner.cleanup()
            raise StartupError(f"cannot listen on {address(host, port)}: {_reason(exc)}") from None
        self._runner = runner
        # The bridge accepts its connections itself, on either loop, so that running out
        # of descriptors is reported and survived alike (bridge.descriptors).
        self._acceptor = Acceptor(runner.server, sockets)
        settle_heap()
        return tuple(sockets[0].getsockname())

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._acceptor is not None:
            await self._acceptor.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._orphans is not None:
            self._orphans.cancel()
        # Every app-server is stopped: whatever still runs below the bridge is a leftover.
        killed = await end_all(DESCENDANTS_EXIT_SECONDS)
        if killed:
            fields = {"event": "leftovers_killed", "processes": killed}
            log.warning("killed %d leftover processes", killed, extra={logs.FIELDS: fields})
        self._watchdog.__exit__(None, None, None)
        self._shortage.close()
        # Stopped otherwise (drained): a signal now must not kill the exit either.
        ignore_stop_signals()
