"""The watchdog: what a bridge started dies with it, however the bridge dies (Linux).

On its way out `rest-bridge serve` (and the cluster's launcher) stops everything it
started; SIGKILLed, killed by the OOM killer or crashed, it can stop nothing. So at its
start it runs this small program (:class:`bridge.subreaper.Watchdog`) as a child in a
session of its own, with the standard library only (``python -I -S``: about 10 ms of CPU
and 10 MB), an environment holding nothing but ``REST_ADAPTER_BRIDGE_MARK=watchdog``,
and the read end of a pipe as its stdin. The write end is the bridge's alone:
close-on-exec, no process the bridge starts inherits it.

The bridge writes a random mark on the pipe, then adds it to ``REST_ADAPTER_BRIDGE_MARK``
in its own environment (marks separated by spaces: a replica's list holds its launcher's
mark and its own), so every process it starts and everything those start carry it,
wherever they go (``setsid``, a daemon's double fork). It then writes the path of each
folder it makes (:func:`make_folder`: the shared app-server's socket folder, the
cluster's folder with its token map). Each record ends with a NUL byte.

When the pipe reads end-of-file, or the bridge's process has exited (watched through a
pidfd as well: a process of the bridge's user that opened a copy of the pipe through
``/proc`` cannot hide the bridge's end), the bridge is gone, whatever ended it. The
watchdog then SIGKILLs every live process that started after it and carries the mark,
and every descendant of those (one that cleared its environment too), searching again
until a search finds nothing new; it removes the folders (only folders of its user named
``rest-bridge-*``, each only if it is still the very folder that was made), and exits.
Processes are signalled through pidfds after checking their start time, so a recycled
pid is never hit. On a normal exit the bridge has done all this already: the watchdog
finds nothing, says nothing and exits at once.

Nobody but the bridge reaches it: it reads nothing but its stdin, ignores SIGINT, SIGTERM
and SIGHUP (Ctrl-C, a supervisor's signal to the whole group, a terminal that closes:
the bridge's end still comes and is still cleaned up after), and whatever happens it
exits :data:`LIFETIME_SECONDS` after its bridge (SIGALRM). It spares other watchdogs
(a replica's, under its launcher), known by their command line, not by their label.
What it keeps of its pipe is bounded (:data:`MAX_FOLDERS`, :data:`MAX_RECORD`): a
process of the bridge's user can open its write end through ``/proc``.

This file is run as a script and must import nothing but the standard library at its
top; the bridge imports :func:`make_folder` from it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import sys
import time

#: In the environment of everything a bridge starts: the marks of the bridges above it.
VARIABLE = "REST_ADAPTER_BRIDGE_MARK"
#: Its value in a watchdog's own environment: no mark, and spared by other watchdogs.
LABEL = "watchdog"
#: Rounds of search-and-kill before giving up on processes that keep forking.
MAX_ROUNDS = 64
#: How long to wait for the killed processes to be gone before the folders are removed.
EXIT_SECONDS = 5.0
#: When to look again after a sweep that killed something (a daemon's fork in flight).
SWEEP_AGAIN = (0.1, 1.0)
#: At most this long after its bridge is gone, the watchdog is gone too (a read of a
#: process stuck in the kernel can block, and so can a full stderr pipe).
LIFETIME_SECONDS = 60

#: What the watchdog keeps of its pipe, whoever writes to it (a process of the bridge's
#: user can, through ``/proc``, as it can reach the bridge itself): the first record (the
#: mark), at most this many folders, no record longer than a path can be.
MAX_FOLDERS = 64
MAX_RECORD = 4096
#: The name of every folder a bridge has its watchdog remove begins so.
FOLDER_PREFIX = "rest-bridge-"

_PREFIX = os.fsencode(VARIABLE) + b"="

# -- in the bridge ------------------------------------------------------------------------

#: The bridge's end of its watchdog's pipe, while one runs.
_pipe: int | None = None


def guard(pipe: int | None) -> None:
    """Folders made from now on are told to the watchdog on ``pipe`` (None: to none)."""
    global _pipe
    _pipe = pipe


def guard_folder(path: str) -> None:
    """Have the watchdog remove ``path`` if the bridge dies (no watchdog: nothing)."""
    if _pipe is None:
        return
    try:
        os.write(_pipe, os.fsencode(path) + b"\0")
    except OSError as exc:  # the watchdog is gone (killed by hand)
        import logging

        logging.getLogger("bridge.process").warning(
            "the watchdog is gone (%s): if this process is killed, %s stays",
            exc.strerror or exc,
            path,
        )


def make_folder(prefix: str) -> str:
    """``tempfile.mkdtemp(prefix=prefix)``, removed by the watchdog if the bridge dies."""
    import tempfile  # the watchdog itself has no use for it

    path = tempfile.mkdtemp(prefix=prefix)
    guard_folder(path)
    return path


# -- the watchdog -------------------------------------------------------------------------

Stat = tuple[int, bool, int]  # parent, alive (not a zombie), start time in clock ticks


def read_stat(pid: int) -> Stat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # after the command's name
    return int(fields[1]), fields[0] not in (b"Z", b"X"), int(fields[19])


def marks_of(pid: int) -> bytes | None:
    """The value of :data:`VARIABLE` in ``pid``'s environment (as it was started)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            entries = file.read().split(b"\0")
    except OSError:
        return None
    for entry in entries:
        if entry.startswith(_PREFIX):
            return entry[len(_PREFIX) :]
    return None


def read_table() -> dict[int, Stat]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (found := read_stat(int(name))) is not None:
            table[int(name)] = found
    return table


def targets(mark: bytes, table: dict[int, Stat], me: int, born: int) -> set[int]:
    """The live processes that carry ``mark`` and started no earlier than ``born``, and
    all their live descendants; never ``me`` nor a watchdog (:func:`is_watchdog`)."""
    roots = {
        pid
        for pid, (_, alive, start) in table.items()
        if alive and start >= born and mark in (marks_of(pid) or b"").split(b" ")
    }
    children: dict[int, list[int]] = {}
    for pid, (parent, alive, _) in table.items():
        if alive:
            children.setdefault(parent, []).append(pid)
    found, stack = set(roots), list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    found.discard(me)
    return {pid for pid in found if not is_watchdog(pid)}


def is_watchdog(pid: int) -> bool:
    """Whether ``pid`` runs this program, as :class:`bridge.subreaper.Watchdog` starts it
    (a replica's, under its launcher): the label in its environment is not enough, as any
    process may set it."""
    if marks_of(pid) != LABEL.encode():
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            args = file.read().split(b"\0")
    except OSError:
        return False
    return args[1:3] == [b"-I", b"-S"] and args[3:4] == [os.fsencode(__file__)]


def kill(pid: int, start: int) -> int | None:
    """SIGKILL ``pid`` if it is still the process that started at ``start``; its pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        found = read_stat(pid)  # no pidfd to be had: by pid, a far narrower window
        if found is not None and found[2] == start:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return None
    found = read_stat(pid)
    try:
        if found is None or found[2] != start:
            raise ProcessLookupError
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep(mark: bytes) -> int:
    """Kill what carries ``mark`` (:func:`targets`) until a search finds nothing new,
    and wait for it to be gone; how many were killed."""
    me = os.getpid()
    born = (read_stat(me) or (0, False, 0))[2]
    killed: set[tuple[int, int]] = set()
    fds: list[int] = []
    try:
        for _ in range(MAX_ROUNDS):
            table = read_table()
            found = {(pid, table[pid][2]) for pid in targets(mark, table, me, born)} - killed
            if not found:
                break
            for pid, start in found:
                killed.add((pid, start))
                if (fd := kill(pid, start)) is not None:
                    fds.append(fd)
        poll = select.poll()
        for fd in fds:
            poll.register(fd, select.POLLIN)
        deadline = time.monotonic() + EXIT_SECONDS
        waiting = len(fds)
        while waiting and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poll.poll(left * 1000):
                poll.unregister(fd)
                waiting -= 1
    finally:
        for fd in fds:
            os.close(fd)
    return len(killed)


def remove(folders: dict[str, tuple[int, int]]) -> int:
    """Remove each folder that is still the one made (same device and inode)."""
    import shutil

    removed = 0
    for path, identity in folders.items():
        if accept(path) == identity:
            shutil.rmtree(path, ignore_errors=True)
            removed += not os.path.lexists(path)
    return removed


def accept(path: str) -> tuple[int, int] | None:
    """Who the folder ``path`` is (device, inode), if it is one a bridge makes: a folder,
    not a link, of this user, named ``rest-bridge-*``; anything else is never removed."""
    try:
        found = os.lstat(path)
    except OSError:
        return None
    if not path.rpartition("/")[2].startswith(FOLDER_PREFIX) or found.st_uid != os.getuid():
        return None
    return (found.st_dev, found.st_ino) if stat.S_ISDIR(found.st_mode) else None


def listen(bridge: int) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The mark and the folders, read until the bridge is gone: the end of the pipe, or
    the bridge's exit (which a process that got hold of a copy of the pipe cannot hide)."""
    try:
        gone: int | None = os.pidfd_open(bridge)
    except OSError:
        gone = None
    ended = os.getppid() != bridge  # gone already (the pidfd, if any, is another's)
    os.set_blocking(0, False)
    poll = select.poll()
    poll.register(0, select.POLLIN)
    if gone is not None and not ended:
        poll.register(gone, select.POLLIN)
    mark = b""
    folders: dict[str, tuple[int, int]] = {}
    pending = b""
    while True:
        if not ended:
            ended = any(fd == gone for fd, _ in poll.poll())
        while True:  # what the pipe holds now
            try:
                chunk = os.read(0, 65536)
            except BlockingIOError:
                break
            if not chunk:
                ended = True
                break
            *complete, pending = (pending + chunk).split(b"\0")
            if len(pending) > MAX_RECORD:
                pending = b""  # no path is this long: not the bridge's
            for record in complete:
                # A folder is identified while the bridge is sure to hold it.
                if (
                    mark
                    and len(folders) < MAX_FOLDERS
                    and (identity := accept(os.fsdecode(record))) is not None
                ):
                    folders[os.fsdecode(record)] = identity
                elif not mark:
                    mark = record[:MAX_RECORD]
        if ended:
            return mark, folders


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    os.chdir("/")  # holds no folder of the bridge's (one to be unmounted) open
    mark, folders = listen(int(sys.argv[1]))
    signal.alarm(LIFETIME_SECONDS)
    if not mark:
        return 0  # the bridge died before it marked anything
    killed = sweep(mark)
    removed = remove(folders)
    if killed:
        for delay in SWEEP_AGAIN:
            time.sleep(delay)
            killed += sweep(mark)
    if killed or removed:
        said = (
            f"the bridge is gone; killed {killed} process{'' if killed == 1 else 'es'} it "
            f"started, removed {removed} of its folders"
        )
        line = f"rest-bridge watchdog: {said}"
        if sys.argv[2:3] == ["json"]:  # the bridge's --log-format: one object, as its lines
            import json

            now = time.time()
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
            line = json.dumps(
                {
                    "time": f"{stamp}.{int(now % 1 * 1000):03d}Z",
                    "level": "WARNING",
                    "logger": "bridge.watchdog",
                    "message": said,
                    "event": "watchdog_cleanup",
                    "processesKilled": killed,
                    "foldersRemoved": removed,
                }
            )
        with contextlib.suppress(OSError):
            os.write(2, (line + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
