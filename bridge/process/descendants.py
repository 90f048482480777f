"""What an app-server starts dies with it, wherever it went (Linux).

Killing an app-server's process group misses every descendant that left the group
(``setsid``, ``setpgid``, a daemon's double fork). So each app-server gets a random
*mark* in its environment, ``REST_ADAPTER_PROCESS_MARK``, which everything it starts
inherits. When the app-server has ended, :meth:`Lineage.end` SIGKILLs every live
process that carries its mark, every descendant of those, and whatever was under the
app-server when the bridge began to stop it, repeating the search until a round finds
nothing new (a process forking while the bridge kills stays a step behind).

Processes are signalled through pidfds, after checking that the pid still names the
process that was found (same start time), so a recycled pid is never hit.

The process layer registers the children it spawns itself with :data:`children`; a
sweep spares them. ``rest-bridge serve``, a child subreaper, puts its reaper of adopted
orphans in that hook's place (:mod:`bridge.runtime`); an embedding host does without.

Elsewhere than Linux (no ``/proc``, pidfds or subreapers) this module does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import psutil

log = logging.getLogger("bridge.process")

#: The variable that marks everything one app-server starts.
MARK_VARIABLE = "REST_ADAPTER_PROCESS_MARK"
#: When to look again for what an app-server left, after the sweep at its exit.
_SWEEP_AGAIN = (0.1, 1.0)
LINUX = sys.platform.startswith("linux") and hasattr(os, "pidfd_open")

#: Rounds of search-and-kill before giving up on a lineage that keeps forking.
_MAX_ROUNDS = 64
#: When the process table cannot be read (no descriptor left), how often and how long to retry.
_RETRY_SECONDS = 1.0
_RETRIES = 60
_DEAD = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


@dataclass(frozen=True, slots=True)
class Stat:
    ppid: int
    alive: bool
    #: When the process started (psutil's create_time): with the pid, who it is.
    start: float


#: Picks, from the process table, the processes to kill.
Selector = Callable[[Mapping[int, Stat]], set[int]]


def read_stat(pid: int) -> Stat | None:
    """A process's parent, whether it is alive (not a zombie) and its start time; None
    if the pid is gone or hidden (``/proc`` mounted ``hidepid``); OSError for the rest."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            return Stat(process.ppid(), process.status() not in _DEAD, process.create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def read_table() -> dict[int, Stat]:
    # psutil.Process objects made afresh, not process_iter's cache: a cached object
    # keeps the start time of a pid the system has since given to another process.
    table: dict[int, Stat] = {}
    for pid in psutil.pids():
        stat = read_stat(pid)
        if stat is not None:
            table[pid] = stat
    return table


def environ_has(pid: int, variable: str, value: str) -> bool:
    try:
        return psutil.Process(pid).environ().get(variable) == value
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def descendants_of(table: Mapping[int, Stat], roots: set[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, stat in table.items():
        if stat.alive:
            children.setdefault(stat.ppid, []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        for child in children.get(pid, ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _kill(pid: int, start: float) -> int | None:
    """SIGKILL the process ``pid`` started at ``start``; its pidfd, if one could be had."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError:
        # No descriptor to spare: check and signal by pid (a far narrower window).
        stat = read_stat(pid)
        if stat is not None and stat.start == start and stat.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return None
    try:
        stat = read_stat(pid)
        if stat is None or stat.start != start:
            os.close(fd)
            return None
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- the bridge's own children ----------------------------------------------------------------


class OwnChildren:
    """The children this process spawns itself (asyncio waits for them by pid): a spawn
    runs inside :meth:`spawning`, and :meth:`released` follows once it is waited for."""

    def __init__(self, own: dict[int, float] | None = None) -> None:
        #: By pid, with its start time: a pid the system gives again later (one left here
        #: by mistake, or reused while the entry lives) is then never taken for ours.
        self.own: dict[int, float] = {} if own is None else own

    @contextlib.contextmanager
    def spawning(self) -> Iterator[Callable[[int], None]]:
        """Around a spawn of this process's own child: hands out ``register(pid)``."""
        yield self.register

    def register(self, pid: int) -> None:
        try:
            stat = read_stat(pid)
        except OSError:
            stat = None
        self.own[pid] = stat.start if stat is not None else -1

    def released(self, pid: int | None) -> None:
        """``pid``, a child registered by :meth:`spawning`, has been waited for."""
        self.own.pop(pid or -1, None)

    def is_own(self, pid: int, stat: Stat) -> bool:
        start = self.own.get(pid)
        return start is not None and start in (stat.start, -1)

    def killed(self, fds: list[int]) -> None:
        """Processes were SIGKILLed; ``fds`` are their pidfds, this method's to close."""
        for fd in fds:
            os.close(fd)

    def table(self) -> dict[int, Stat]:
        """Where a sweep looks for what an app-server left: the whole process table (an
        orphan goes to init, or to a subreaper above this process, anywhere in it)."""
        return read_table()

    def tree_of(self, pid: int) -> dict[int, Stat]:
        """A table that holds ``pid`` and its descendants (here, the whole one)."""
        return read_table()


#: This process's own children (a child subreaper replaces it with its reaper).
children = OwnChildren()


def kill_rounds(
    select: Selector,
    killed: set[tuple[int, float]],
    fds: list[int],
    read: Callable[[], dict[int, Stat]] = read_table,
) -> bool:
    """SIGKILL every process ``select`` picks from the process table, again until a
    search finds nothing new (one may fork meanwhile); False if some are still found after
    :data:`_MAX_ROUNDS`. ``killed`` gets (pid, start time) and ``fds`` the pidfds, which
    stand when reading the table (``read``) raises OSError."""
    for _ in range(_MAX_ROUNDS):
        table = read()
        found = {(pid, table[pid].start) for pid in select(table)} - killed
        if not found:
            return True
        for pid, start in found:
            killed.add((pid, start))
            fd = _kill(pid, start)
            if fd is not None:
                fds.append(fd)
    return False


# -- one app-server's lineage -----------------------------------------------------------------


class Lineage:
    """One app-server and everything it starts: marked, remembered and killed with it."""

    def __init__(self) -> None:
        self.mark = secrets.token_hex(16)
        self.pid: int | None = None
        self._start = 0.0
        #: Descendants seen under the app-server while it lived, by pid: start time.
        self._tree: dict[int, float] = {}

    def environment(self, env: Mapping[str, str] | None) -> dict[str, str]:
        """The app-server's environment (``env``, or this process's) with the mark."""
        environment = dict(os.environ if env is None else env)
        environment[MARK_VARIABLE] = self.mark
        return environment

    def spawned(self, pid: int) -> None:
        self.pid = pid
        if LINUX:
            # The start time the spawn registered (children.spawning), when it could be
            # read then: the process's entry is read once per spawn, not twice.
            start = children.own.get(pid, -1)
            if start >= 0:
                self._start = start
                return
            with contextlib.suppress(OSError):
                stat = read_stat(pid)
                self._start = stat.start if stat is not None else 0.0

    def remember_tree(self) -> None:
        """Note what lives under the app-server now, before it is asked to stop: what it
        started with a cleared environment is then killed with it too."""
        if not LINUX or self.pid is None:
            return
        try:
            table = children.tree_of(self.pid)
        except OSError:
            return
        mine = table.get(self.pid)
        if mine is None or not mine.alive or mine.start != self._start:
            return
        for pid in descendants_of(table, {self.pid}):
            self._tree[pid] = table[pid].start

    def end(self) -> None:
        """The app-server has exited and been waited for: kill everything it left.

        A sweep reads the table an entry at a time, so a descendant between its parent's
        exit and its own fork (a double fork woken by the app-server's exit) can be in no
        entry it reads: later sweeps (:data:`_SWEEP_AGAIN`) find it by its mark.
        """
        children.released(self.pid)
        if LINUX:
            self._attempt(_RETRIES)
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to schedule
                loop = asyncio.get_running_loop()
                for delay in _SWEEP_AGAIN:
                    loop.call_later(delay, self._attempt, 0)

    def _attempt(self, retries: int) -> None:
        try:
            killed, fds = self._sweep()
        except OSError as exc:
            if retries == _RETRIES:
                log.warning(
                    "cannot look for what app-server pid %s left running (%s); retrying",
                    self.pid,
                    exc.strerror or exc,
                )
            if retries > 0:
                asyncio.get_running_loop().call_later(_RETRY_SECONDS, self._attempt, retries - 1)
            else:
                log.error("gave up looking for what app-server pid %s left running", self.pid)
            return
        if killed:
            log.info(
                "app-server pid %s exited and left %d of its processes running; the bridge "
                "stopped them, so none is left over",
                self.pid,
                killed,
            )
        children.killed(fds)

    def _targets(self, table: Mapping[int, Stat]) -> set[int]:
        me = os.getpid()
        roots: set[int] = set()
        for pid, stat in table.items():
            if pid == me or children.is_own(pid, stat) or not stat.alive:
                continue
            if stat.start < self._start:
                continue
            if self._tree.get(pid) == stat.start or environ_has(pid, MARK_VARIABLE, self.mark):
                roots.add(pid)
        found = roots | descendants_of(table, roots)
        found.discard(me)
        return {pid for pid in found if not children.is_own(pid, table[pid])}

    def _sweep(self) -> tuple[int, list[int]]:
        killed: set[tuple[int, float]] = set()
        fds: list[int] = []
        try:
            if not kill_rounds(self._targets, killed, fds, children.table):
                log.warning("app-server pid %s left processes that keep forking", self.pid)
        except BaseException:
            # The kills so far stand; the next attempt finds the rest.
            for fd in fds:
                os.close(fd)
            raise
        self._tree.clear()
        return len(killed), fds
