"""Leak checks for tests: which processes has this test process left behind?"""

from __future__ import annotations

import os


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
