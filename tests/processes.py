"""Leak checks for tests: which processes has this test process left behind? And the
system programs some tests start (`nginx_binary`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import pytest


def _stat(pid: str) -> tuple[int, int, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[2]), fields[0]


def live_children() -> set[int]:
    """Pids of this process's live children and of every live member of their groups.

    An app-server started in its own process group takes its grandchildren along,
    so a grandchild that outlived its parent shows up here too. Zombies do not count.
    Linux only (reads ``/proc``).
    """
    me = os.getpid()
    own_group = os.getpgid(0)
    table = {pid: stat for pid in os.listdir("/proc") if pid.isdigit() and (stat := _stat(pid))}
    found: set[int] = set()
    groups: set[int] = set()
    for pid, (ppid, pgid, state) in table.items():
        if ppid == me and state != "Z":
            found.add(int(pid))
            groups.add(pgid)
    groups.discard(own_group)
    for pid, (_, pgid, state) in table.items():
        if pgid in groups and state != "Z":
            found.add(int(pid))
    return found


def open_descriptors() -> int:
    """How many file descriptors this process has open."""
    return len(os.listdir("/proc/self/fd"))


def zombie_children(pid: int | None = None) -> set[int]:
    """Pids of the children of ``pid`` (default: this process) that exited unreaped."""
    parent = os.getpid() if pid is None else pid
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        stat = _stat(entry) if entry.isdigit() else None
        if stat is not None and stat[0] == parent and stat[2] == "Z":
            found.add(int(entry))
    return found


def marked_processes(variable: str, value: str) -> set[int]:
    """Live pids, other than this one, whose environment has ``variable=value``.

    A bridge passes its environment on, so setting a unique variable before starting
    one marks every process it spawns, and every process those spawn, wherever they
    were re-parented after their parent died.
    """
    needle = f"{variable}={value}".encode()
    me = os.getpid()
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:
            continue
        stat = _stat(entry)
        if needle in environ and stat is not None and stat[2] != "Z":
            found.add(int(entry))
    return found


def descriptor_targets(pid: int | None = None) -> list[str]:
    """What the open descriptors of ``pid`` (default: this process) point at."""
    directory = f"/proc/{'self' if pid is None else pid}/fd"
    targets = []
    for fd in os.listdir(directory):
        try:
            targets.append(os.readlink(f"{directory}/{fd}"))
        except OSError:
            continue  # closed while listing (the listing's own descriptor, for one)
    return targets


def descriptor_kinds(pid: int | None = None) -> dict[str, int]:
    """Open descriptors of ``pid`` (default: this process) by kind: pipe, socket, other."""
    kinds = {"pipe": 0, "socket": 0, "other": 0}
    for target in descriptor_targets(pid):
        kind = target.split(":", 1)[0]
        kinds[kind if kind in ("pipe", "socket") else "other"] += 1
    return kinds


#: The TCP states of /proc/net/tcp that tests look for (hex code: name).
TCP_STATES = {"01": "established", "08": "close_wait", "0A": "listen"}


def tcp_sockets(pid: int | None = None) -> list[tuple[str, int]]:
    """``(state, unread bytes)`` of each TCP socket ``pid`` (default: this process) holds.

    The state is a name of TCP_STATES, or the kernel's hex code for the others; the
    unread bytes are the receive queue: what arrived and the process has not read yet.
    Linux only (reads ``/proc``).
    """
    where = "self" if pid is None else str(pid)
    inodes: set[str] = set()
    for fd in os.listdir(f"/proc/{where}/fd"):
        try:
            target = os.readlink(f"/proc/{where}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found: list[tuple[str, int]] = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{where}/net/{table}") as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[9] in inodes:
                unread = int(fields[4].split(":")[1], 16)
                found.append((TCP_STATES.get(fields[3], fields[3]), unread))
    return found


def resident_kib(pid: int | None = None) -> int:
    """Resident memory of ``pid`` (default: this process) in KiB."""
    with open(f"/proc/{'self' if pid is None else pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def exited(pids: Iterable[int], timeout: float) -> None:
    """Return once every pid in ``pids`` has exited, or at ``timeout`` (no polling).

    A pidfd becomes readable when its process exits.
    """
    loop = asyncio.get_running_loop()
    waits: list[asyncio.Future[None]] = []
    descriptors: list[int] = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        done: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, lambda f=done: f.done() or f.set_result(None))
        waits.append(done)
        descriptors.append(fd)
    try:
        if waits:
            await asyncio.wait(waits, timeout=timeout)
    finally:
        for fd in descriptors:
            loop.remove_reader(fd)
            os.close(fd)


def storm_of_sigterm_after_sigint(process: subprocess.Popen[bytes], seconds: float = 60) -> int:
    """SIGINT, then SIGTERM without a pause until ``process`` exits; its exit code.

    The storm stops after ``seconds`` (then the process has 30 s more), so that one it
    keeps busy, or one hung, fails a test instead of hanging it.
    """
    process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + seconds
    while process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
    return process.wait(30)


def nginx_binary() -> str:
    """nginx (Debian's package, which `make nginx` installs): skip without it, but fail
    when `CI=true`, where the tests that need it must run."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else "")
    if not found:
        message = "nginx is not installed (make nginx installs Debian's package)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found
