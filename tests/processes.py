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
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil
import pytest

from bridge import subreaper

#: pytest plugins of the development venv that no scenario run and no host suite here uses
#: (hypothesis's, faker's and schemathesis's, installed for the fuzzing and the fakes):
#: about 2 s of CPU in imports per pytest process. A host's `harness` install has none of
#: them; the tests that start `rest-bridge scenarios run` (a pytest, and its xdist
#: workers) turn them off with `quiet_pytest()`, as tests/scenarios/test_pytest_plugin.py
#: does for its pytester runs.
QUIET_PLUGINS = ("-p", "no:hypothesispytest", "-p", "no:faker", "-p", "no:schemathesis")


def quiet_pytest(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with `QUIET_PLUGINS` added to `PYTEST_ADDOPTS` (what it held stays)."""
    addopts = " ".join(filter(None, (*QUIET_PLUGINS, env.get("PYTEST_ADDOPTS", ""))))
    return {**env, "PYTEST_ADDOPTS": addopts}


def _live(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _children_of(pid: int | None = None) -> list[psutil.Process]:
    """The children of ``pid`` (default: this process), zombies included.

    What ``psutil.Process(pid).children()`` returns, from the kernel's lists of each of
    its threads' children (:func:`bridge.subreaper.children_of`, as the bridge reads its
    own) instead of every process's stat file on the machine: the tests poll these
    lists, and a scan of the whole machine each time was a large part of their CPU on a
    busy one.
    """
    where = "self" if pid is None else str(pid)
    if not os.path.isdir(f"/proc/{where}/task"):
        raise psutil.NoSuchProcess(pid or os.getpid())
    found = set(subreaper.children_of(where))
    children = []
    for child in sorted(found):
        with contextlib.suppress(psutil.NoSuchProcess):
            children.append(psutil.Process(child))
    return children


def live_children() -> set[int]:
    """Pids of this process's live children and of every live member of their groups.

    An app-server started in its own process group takes its grandchildren along,
    so a grandchild that outlived its parent shows up here too. Zombies do not count.
    """
    own_group = os.getpgid(0)
    found: set[int] = set()
    groups: set[int] = set()
    for child in _children_of():
        with contextlib.suppress(ProcessLookupError):
            if _live(child):
                found.add(child.pid)
                groups.add(os.getpgid(child.pid))
    groups.discard(own_group)
    if groups:
        for process in psutil.process_iter():
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(process.pid) in groups and _live(process):
                    found.add(process.pid)
    return found


def open_descriptors() -> int:
    """How many file descriptors this process has open."""
    return psutil.Process().num_fds()


def zombie_children(pid: int | None = None) -> set[int]:
    """Pids of the children of ``pid`` (default: this process) that exited unreaped."""
    found: set[int] = set()
    for child in _children_of(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() == psutil.STATUS_ZOMBIE:
                found.add(child.pid)
    return found


def marked_processes(variable: str, value: str) -> set[int]:
    """Live pids, other than this one, whose environment has ``variable=value``.

    A bridge passes its environment on, so setting a unique variable before starting
    one marks every process it spawns, and every process those spawn, wherever they
    were re-parented after their parent died.
    """
    # Each environment is read as the bytes /proc holds (what psutil's environ() parses
    # into a dict, for every process of the machine each time): this runs in polls.
    entry = b"\0" + os.fsencode(f"{variable}={value}") + b"\0"
    me = os.getpid()
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                environment = handle.read()
        except OSError:
            continue
        if entry in b"\0" + environment + b"\0":
            with contextlib.suppress(psutil.Error):
                if _live(psutil.Process(int(name))):
                    found.add(int(name))
    return found


def descriptor_targets(pid: int | None = None) -> list[str]:
    """What the open descriptors of ``pid`` (default: this process) point at (from
    ``/proc``: psutil lists files and sockets, never pipes)."""
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
    Linux only (reads ``/proc``: psutil's connections carry no receive queue).
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
    return psutil.Process(pid).memory_info().rss // 1024


def reset_peak_resident(pid: int) -> int:
    """Start ``pid``'s peak resident memory afresh (``/proc/PID/clear_refs``), at what it
    holds now; returns that, in KiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return psutil.Process(pid).memory_info().rss // 1024


def peak_resident_kib(pid: int) -> int:
    """The most resident memory ``pid`` has held since it started or was last reset
    (``VmHWM``), in KiB: a bound checked against it holds at every moment in between."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


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


def prometheus_binary() -> str:
    """Prometheus (Debian's package, which `make prometheus` installs): skip without it,
    but fail when `CI=true`, where the tests that need it must run."""
    found = shutil.which("prometheus") or ""
    if not found:
        message = "prometheus is not installed (make prometheus installs Debian's package)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def start_nginx(prefix: Path, config: str) -> subprocess.Popen[str]:
    """nginx in the foreground on ``config`` (written to ``prefix``/nginx.conf), once it
    has bound its ports: the line of its first worker is the event waited on. Its
    stderr is closed then, so nginx never blocks on it; stop it with ``terminate()``."""
    prefix.mkdir(parents=True, exist_ok=True)
    (prefix / "nginx.conf").write_text(config)
    process = subprocess.Popen(
        [
            *(nginx_binary(), "-p", f"{prefix}/", "-c", f"{prefix}/nginx.conf", "-e", "stderr"),
            *("-g", "daemon off; error_log stderr notice;"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    with process.stderr:
        for line in process.stderr:
            if "start worker process" in line:
                return process
    process.wait(timeout=30)
    pytest.fail("nginx did not start")
