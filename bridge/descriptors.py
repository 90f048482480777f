"""File descriptors for `rest-bridge serve`: the budget, and running out of it.

At start the soft ``RLIMIT_NOFILE`` is raised to the hard limit (:func:`raise_soft_limit`).
When the bridge still runs out, asyncio's accept loop would log a traceback for every
failed ``accept()``: up to the listen backlog per pass, each pass scheduling its own
retry, so the retries (and the log) multiply every second. Two parts stop that:

- :class:`ShortageReporter`, the loop's exception handler, turns those failures into
  one line when they start, one line per :data:`REPORT_SECONDS` while they last (how
  many, and the limit), and one line when connections are accepted again; every other
  context goes to the loop's default handler.
- :class:`Acceptor`, which accepts the connections of ``rest-bridge serve``'s listening
  sockets (:func:`listening_sockets`) itself, on any event loop (``loop.sock_accept``),
  and hands each to aiohttp's server (``loop.connect_accepted_socket``). At a failure
  for want of descriptors it reports once (to the loop's exception handler, as
  asyncio's own accept loop does) and waits :data:`ACCEPT_RETRY_SECONDS` before the
  next ``accept()``, so a shortage costs one report and one retry a second, on asyncio
  and uvloop alike (uvloop's own accept loop, in C, would close the waiting
  connections and say nothing). Connections beyond what fits wait in the kernel's
  backlog and are served once descriptors are free.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("bridge")

#: accept() errors that mean "no descriptor (or memory) to spare right now".
SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: At most one line per this many seconds while accepting keeps failing.
REPORT_SECONDS = 10.0
_ACCEPT_MESSAGE = "socket.accept() out of system resource"


def raise_soft_limit() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one: (soft before, soft, hard)."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        # Linux refuses an infinite soft limit; fs.nr_open is the most it allows.
        try:
            with open("/proc/sys/fs/nr_open") as handle:
                target = int(handle.read())
        except (OSError, ValueError):
            target = before
    if before != resource.RLIM_INFINITY and before < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("could not raise the descriptor limit to %d: %s", target, exc)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return before, soft, hard


def describe_limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def budget_line(before: int, soft: int, hard: int) -> str:
    """The start-up line: ``file descriptors: soft limit S (raised from B), hard limit H``."""
    raised = f" (raised from {describe_limit(before)})" if soft != before else ""
    return (
        f"file descriptors: soft limit {describe_limit(soft)}{raised}, "
        f"hard limit {describe_limit(hard)}"
    )


def is_accept_shortage(context: dict[str, Any]) -> bool:
    exc = context.get("exception")
    return (
        isinstance(exc, OSError)
        and exc.errno in SHORTAGE_ERRNOS
        and context.get("message") == _ACCEPT_MESSAGE
    )


class ShortageReporter:
    """A loop exception handler: accept failures for want of descriptors, summarised.

    ``loop.set_exception_handler(ShortageReporter())``. Lines: one when failures
    begin, one per ``interval`` with the count while they go on, one when an interval
    passes without any (accepting again). Nothing else is changed.
    """

    def __init__(
        self, interval: float = REPORT_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self._clock = clock
        #: Failures since the last line, and since the shortage began.
        self.recent = 0
        self.total = 0
        self._short_since: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not is_accept_shortage(context):
            loop.default_exception_handler(context)
            return
        self.recent += 1
        self.total += 1
        if self._short_since is None:
            self._short_since = self._clock()
            self.recent = 0
            exc = context["exception"]
            log.error(
                "out of file descriptors: cannot accept connections (%s); limit %s",
                exc.strerror or errno.errorcode.get(exc.errno, exc.errno),
                _soft_limit(),
            )
            self._timer = loop.call_later(self.interval, self._report, loop)

    def _report(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self.recent:
            log.error(
                "out of file descriptors: %d accept failures in the last %g s; limit %s",
                self.recent,
                self.interval,
                _soft_limit(),
            )
            self.recent = 0
            self._timer = loop.call_later(self.interval, self._report, loop)
            return
        since = self._short_since or self._clock()
        log.warning(
            "accepting connections again after %d accept failures over %.0f s "
            "for want of file descriptors",
            self.total,
            self._clock() - since,
        )
        self._short_since = None
        self.total = 0

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _soft_limit() -> str:
    return describe_limit(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


#: How long to wait after an accept() that failed for want of descriptors (asyncio's own
#: accept loop waits as long).
ACCEPT_RETRY_SECONDS = 1.0


class Acceptor:
    """Accepts connections on ``sockets`` and serves each with ``protocol_factory``
    (aiohttp's ``web.Server``: ``runner.server``), one task per socket, on whatever loop
    runs it. :meth:`close` stops accepting and closes the sockets; connections already
    accepted are the server's (``runner.cleanup()`` closes them).
    """

    def __init__(
        self, protocol_factory: Callable[[], asyncio.Protocol], sockets: list[socket.socket]
    ) -> None:
        self._factory = protocol_factory
        self.sockets = sockets
        self._tasks = [asyncio.create_task(self._accept(sock)) for sock in sockets]

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except (ConnectionAbortedError, InterruptedError):
                continue  # the client left before it was accepted
            except OSError as exc:
                if exc.errno in SHORTAGE_ERRNOS:
                    # The loop's exception handler (ShortageReporter under serve) reports it.
                    context = {"message": _ACCEPT_MESSAGE, "exception": exc, "socket": sock}
                    loop.call_exception_handler(context)
                else:
                    log.warning("accept() failed: %s", exc)
                await asyncio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            try:
                await loop.connect_accepted_socket(self._factory, conn)
            except OSError as exc:
                conn.close()
                log.warning("could not serve an accepted connection: %s", exc)
            except BaseException:
                conn.close()
                raise

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in self.sockets:
            sock.close()


def listening_sockets(host: str, port: int, backlog: int = 128) -> list[socket.socket]:
    """Non-blocking sockets bound to every address of ``host:port`` and
    listening, as ``web.TCPSite`` binds them (``SO_REUSEADDR``; an IPv6 socket for IPv6
    only). Raises OSError (``socket.gaierror`` for a host that does not resolve)."""
    found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


#: Spawn failures that say nothing about the command: descriptors, processes, memory.
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})


#: Descriptors a spawn takes at once (three pipes, and the child's error pipe).
SPAWN_DESCRIPTORS = 8


def shortage_behind(exc: OSError) -> OSError:
    """``exc``, or the shortage it hides: uvloop reports a spawn that failed for want of
    descriptors without an errno (-1), so the bridge asks for as many as a spawn takes."""
    if exc.errno not in (None, -1):
        return exc
    opened: list[int] = []
    try:
        while len(opened) < SPAWN_DESCRIPTORS:
            opened.extend(os.pipe())
    except OSError as probe:
        if probe.errno in OUT_OF_RESOURCES:
            return probe
    finally:
        for fd in opened:
            os.close(fd)
    return exc
