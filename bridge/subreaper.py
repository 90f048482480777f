"""The descendants of the whole process (:mod:`bridge.process.descendants` has one
app-server's): a child subreaper's reaping of the orphans it adopts, and the killing of
every process left below it.

`rest-bridge serve` (:mod:`bridge.runtime`), the cluster launcher and the scenario
runner's front use it. It imports neither aiohttp nor the rest of the bridge, so a
process that only supervises children (the runner's front) does not pay for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType

from bridge import watchdog
from bridge.process import descendants

#: How often `rest-bridge serve` reaps adopted orphans that exited on their own.
ORPHAN_REAP_SECONDS = 5.0
#: How long a process waits for its watchdog to exit, once it has closed its pipe.
WATCHDOG_EXIT_SECONDS = 10.0
_PR_SET_CHILD_SUBREAPER = 36

log = logging.getLogger("bridge.process")


def own_children() -> list[int]:
    """The pids of this process's children, exited ones not yet reaped included.

    The kernel lists each thread's children in ``/proc/self/task/<tid>/children`` (an
    orphan a subreaper adopts goes to one of its threads), so no other process's entry
    is read. That file needs CONFIG_PROC_CHILDREN, which Linux leaves off by default
    (distributions turn it on): without it, they are found in the whole process table.
    """
    if not _CHILDREN_LISTED:
        return children_in_table()
    return children_of("self")


def children_of(pid: int | str) -> list[int]:
    """The children the kernel lists under each thread of ``pid``; none once it is gone."""
    pids: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return pids
    for tid in threads:
        # A thread may end meanwhile: its children have gone to another one by then.
        with (
            contextlib.suppress(FileNotFoundError, ProcessLookupError),
            open(f"/proc/{pid}/task/{tid}/children", "rb") as listing,
        ):
            pids += map(int, listing.read().split())
    return pids


_CHILDREN_LISTED = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def subtree(root: int | None = None) -> dict[int, descendants.Stat]:
    """Every process below this one (or below ``root``, ``root`` included), from the
    kernel's lists of children: the entries of those descendants are read, no other
    process's (the whole table without CONFIG_PROC_CHILDREN)."""
    if not _CHILDREN_LISTED:
        return descendants.read_table()
    table: dict[int, descendants.Stat] = {}
    below: list[int | str] = ["self"]
    if root is not None:
        stat = descendants.read_stat(root)
        if stat is None:
            return table
        table[root] = stat
        below = [root]
    while below:
        for pid in children_of(below.pop()):
            if pid not in table and (stat := descendants.read_stat(pid)) is not None:
                table[pid] = stat
                below.append(pid)
    return table


def children_in_table() -> list[int]:
    """:func:`own_children` read from the whole process table."""
    me = os.getpid()
    return [pid for pid, stat in descendants.read_table().items() if stat.ppid == me]


class OrphanReaper(descendants.OwnChildren):
    """A child subreaper's own children, and the reaping of the orphans it adopts.

    An orphaned descendant is re-parented to this process rather than to init, and its
    exit status comes here. :meth:`reap` waits only for children that are not this
    process's own (those the process layer spawned and registered, which asyncio waits
    for by pid), so no exit status is ever taken from under asyncio's child watcher.
    While a spawn is under way nothing is reaped: a new child that died at once could
    not yet be told apart from an orphan.
    """

    def __init__(self, own: dict[int, float]) -> None:
        super().__init__(own)
        self._spawns = 0
        self._deferred = False
        #: The last reaping failed (and said so).
        self._failing = False

    @contextlib.contextmanager
    def spawning(self) -> Iterator[Callable[[int], None]]:
        self._spawns += 1
        try:
            yield self.register
        finally:
            self._spawns -= 1
            if self._spawns == 0 and self._deferred:
                self._deferred = False
                self.reap()

    def reap(self) -> None:
        """Reap the adopted orphans that have exited."""
        if self._spawns:
            self._deferred = True
            return
        try:
            for pid in own_children():
                # A child's pid stays its own until it is reaped: never a recycled one.
                stat = descendants.read_stat(pid)
                if stat is None or stat.alive:
                    continue
                if pid in Watchdog.running:
                    Watchdog.running[pid].lost()
                elif not self.is_own(pid, stat):
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
        except OSError as exc:
            # Out of descriptors, most likely: said once, tried again at the next occasion.
            if not self._failing:
                log.warning("could not reap orphaned processes: %s", exc.strerror or exc)
            self._failing = True
        else:
            self._failing = False

    def table(self) -> dict[int, descendants.Stat]:
        """Only this process's subtree: a child subreaper adopts every orphan below it, so
        nothing an app-server started can be anywhere else (a sweep after each app-server
        exit reads its descendants' entries, not every process's on the machine)."""
        return subtree()

    def tree_of(self, pid: int) -> dict[int, descendants.Stat]:
        """``pid`` and what lives below it, read from its own lists of children: the other
        sessions' app-servers are not read."""
        return subtree(pid)

    def killed(self, fds: list[int]) -> None:
        """Close the pidfds once their processes have exited, then reap them."""
        if not fds:
            return
        loop = asyncio.get_running_loop()
        waiting = set(fds)

        def exited(fd: int) -> None:
            loop.remove_reader(fd)
            os.close(fd)
            waiting.discard(fd)
            if not waiting:
                self.reap()

        for fd in fds:
            loop.add_reader(fd, exited, fd)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux; True if so)."""
    if not descendants.LINUX:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("could not become a child subreaper: %s", os.strerror(ctypes.get_errno()))
        return False
    if not isinstance(descendants.children, OrphanReaper):
        descendants.children = OrphanReaper(descendants.children.own)
    return True


def reap_orphans() -> None:
    """Reap the adopted orphans that have exited (only as a subreaper)."""
    if isinstance(descendants.children, OrphanReaper):
        descendants.children.reap()


async def reap_every(seconds: float = ORPHAN_REAP_SECONDS) -> None:
    """Reap adopted orphans that exited on their own, every ``seconds``, until cancelled."""
    while True:
        await asyncio.sleep(seconds)
        reap_orphans()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def kill_all(
    select: descendants.Selector,
    timeout: float,
    read: Callable[[], dict[int, descendants.Stat]] = descendants.read_table,
) -> int:
    """SIGKILL every process ``select`` picks (:func:`~bridge.process.descendants.kill_rounds`)
    from what ``read`` reads, wait up to ``timeout`` for them to exit and reap what this
    process adopted. Returns how many were found and killed.

    A failure to read the process table (no descriptor left) is logged, not raised: the
    kills made so far stand.
    """
    if not descendants.LINUX:
        return 0
    loop = asyncio.get_running_loop()
    killed: set[tuple[int, float]] = set()
    fds: list[int] = []
    try:
        descendants.kill_rounds(select, killed, fds, read)
        if fds:
            pending = []
            for fd in fds:
                done: asyncio.Future[None] = loop.create_future()
                loop.add_reader(fd, _settle, done)
                pending.append(done)
            await asyncio.wait(pending, timeout=timeout)
        reap_orphans()
    except OSError as exc:
        log.warning("could not stop every process: %s", exc.strerror or exc)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)
    return len(killed)


async def end_all(timeout: float) -> int:
    """Kill every descendant of this process and reap them: `rest-bridge serve`'s last act.

    Returns how many were killed. Only for a process that is the bridge alone: it
    spares nothing below it but its :class:`Watchdog`, which has its own end.
    """
    return await kill_all(
        lambda table: {
            pid for pid, stat in table.items() if stat.alive and pid not in Watchdog.running
        },
        timeout,
        subtree,
    )


def carrying(variable: str, value: str) -> descendants.Selector:
    """For :func:`kill_all`: the live processes whose environment has ``variable=value``
    (whoever their parent is now)."""
    me = os.getpid()

    def select(table: Mapping[int, descendants.Stat]) -> set[int]:
        return {
            pid
            for pid, stat in table.items()
            if pid != me and stat.alive and descendants.environ_has(pid, variable, value)
        }

    return select


class Watchdog:
    """The watchdog of this process (:mod:`bridge.watchdog`): ``with Watchdog():`` starts
    it, marks what this process starts from then on, and has the folders made by
    :func:`bridge.watchdog.make_folder` removed; leaving closes its pipe and waits for it
    to be gone. Should it not start, a warning says so and the process runs without.
    """

    #: The watchdogs running, by pid: :func:`end_all` spares them, and the reaper of a
    #: child subreaper waits for one that has exited (killed by hand) and says so.
    running: dict[int, Watchdog] = {}

    def __init__(self, log_format: str = "text") -> None:
        self.process: subprocess.Popen[bytes] | None = None
        #: How its one line is written (the bridge's ``--log-format``: text or json).
        self.log_format = log_format
        self._pipe: int | None = None
        #: This process's marks before its watchdog's was added (``()``: not added).
        self._marks: tuple[str | None] | tuple[()] = ()

    def __enter__(self) -> Watchdog:
        if not descendants.LINUX:
            return self
        if not sys.executable or not os.path.isfile(watchdog.__file__):
            log.warning("no watchdog: if this process is killed, what it started may outlive it")
            return self
        read, self._pipe = os.pipe()  # neither end inherited by what this process starts
        mark = secrets.token_hex(16)
        try:
            with descendants.children.spawning() as own:
                self.process = subprocess.Popen(
                    [
                        sys.executable,
                        "-I",
                        "-S",
                        watchdog.__file__,
                        str(os.getpid()),
                        self.log_format,
                    ],
                    stdin=read,
                    stdout=subprocess.DEVNULL,
                    env={watchdog.VARIABLE: watchdog.LABEL},
                    start_new_session=True,
                )
                own(self.process.pid)
            os.write(self._pipe, mark.encode() + b"\0")
            # Never waits on the watchdog (one stopped, its pipe filled through /proc).
            os.set_blocking(self._pipe, False)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            log.warning(
                "could not start the watchdog (%s): if this process is killed, what it "
                "started may outlive it",
                getattr(exc, "strerror", None) or exc,
            )
            self.__exit__(None, None, None)
            return self
        finally:
            os.close(read)
        Watchdog.running[self.process.pid] = self
        watchdog.guard(self._pipe)
        marks = os.environ.get(watchdog.VARIABLE)
        self._marks = (marks,)
        os.environ[watchdog.VARIABLE] = " ".join([*(marks or "").split(), mark])
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        watchdog.guard(None)
        if self._marks:
            marks, self._marks = self._marks[0], ()
            if marks is None:
                os.environ.pop(watchdog.VARIABLE, None)
            else:
                os.environ[watchdog.VARIABLE] = marks
        self.lost()
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self.process is None:
            return
        try:
            # It finds nothing left to do (this process did it), and is gone at once.
            self.process.wait(WATCHDOG_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("the watchdog did not exit in time: killing it")
            self.process.kill()
            self.process.wait()
        self._forget()

    def lost(self) -> None:
        """If the watchdog has exited while this process runs (killed by hand), wait for
        it and say so: from then on nothing is cleaned up if this process is killed."""
        if self.process is None or self.process.poll() is None:
            return
        log.warning(
            "the watchdog has exited (%s): if this process is killed, what it started may "
            "outlive it",
            self.process.returncode,
        )
        self._forget()

    def _forget(self) -> None:
        assert self.process is not None
        Watchdog.running.pop(self.process.pid, None)
        descendants.children.released(self.process.pid)
        self.process = None
