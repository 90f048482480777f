"""Descendants of an app-server that leave its process group still die with it.

A helper script, started by fake-codex's `spawnChild` step, escapes the way daemons do
(fork, `setsid`, fork again, the middle process exits) and reports its pid through a
FIFO; the test then holds a pidfd on it and waits for its exit, an event. In-process,
the bridge finds escapees by the mark in their environment; `rest-bridge serve` is
also a child subreaper, so escapees are re-parented to it, reaped by it, and killed
when it stops.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from processes import zombie_children

from bridge.app import trusted_bridge_app
from bridge.limits import RestLimits

pytestmark = pytest.mark.asyncio

THEME = "Faults from the app-server"
#: Generous: a SIGKILLed process is gone in milliseconds, even on a loaded machine.
GONE_SECONDS = 20.0

#: argv: FIFO, then how to escape:
#:   now    - fork, setsid, fork: an orphan in a session of its own, at once;
#:   late   - setsid (out of the group), report, and only once the app-server has
#:            exited fork, setsid, fork;
#:   clean  - setsid with an empty environment, staying the app-server's child;
#:   orphan - fork, setsid, fork with an empty environment.
ESCAPE = """
import os, select, signal, sys

fifo, how = sys.argv[1], sys.argv[2]
origin = os.getsid(0)  # the app-server's session

def report():
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, f"{os.getpid()} {origin}\\n".encode())
    os.close(fd)

def double_fork(then_report=False):
    # The first process exits only once the escapee has reported (or died): the fake's
    # `spawnChild` with `wait: true` goes on only then, so the bridge cannot stop the
    # app-server while the escape is under way.
    ready, done = os.pipe()
    if os.fork():
        os.close(done)
        os.read(ready, 1)
        os._exit(0)
    os.close(ready)
    os.setsid()
    if os.fork():
        os._exit(0)
    if then_report:
        report()
    os.close(done)

if how == "late":
    os.setsid()
    try:
        exited = os.pidfd_open(origin)  # the app-server leads the session it was given
    except ProcessLookupError:
        exited = None
    report()
    if exited is not None:
        select.select([exited], [], [])
    double_fork()  # unreported: the test's last check finds it by the test's mark
elif how == "clean":
    os.setsid()
    report()
else:
    double_fork(then_report=True)
while True:
    signal.pause()
"""


class Reports:
    """Pids reported through a FIFO, read as they arrive (no polling).

    Each line is ``pid session``: the helper's pid and the session it was started in.
    """

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = str(path)
        self._read = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        # Held open so that the FIFO never reads as closed between two writers.
        self._write = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        self._buffer = b""
        self._pids: asyncio.Queue[int] = asyncio.Queue()
        #: pid: the session (the app-server's) the helper that reported it began in.
        self.origin: dict[int, int] = {}
        asyncio.get_running_loop().add_reader(self._read, self._readable)

    def _readable(self) -> None:
        self._buffer += os.read(self._read, 4096)
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            pid, origin = map(int, line.split())
            self.origin[pid] = origin
            self._pids.put_nowait(pid)

    async def next(self, timeout: float = 30.0) -> int:
        async with asyncio.timeout(timeout):
            return await self._pids.get()

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self._read)
        os.close(self._read)
        os.close(self._write)


@pytest_asyncio.fixture
async def reports(tmp_path):
    pids = Reports(tmp_path / "pids")
    yield pids
    pids.close()


def watch(pid: int) -> int:
    """A pidfd on ``pid``, which must still be running."""
    fd = os.pidfd_open(pid)
    assert signal.pidfd_send_signal(fd, 0) is None
    return fd


async def gone(fd: int, timeout: float = GONE_SECONDS) -> bool:
    """Whether the process behind pidfd ``fd`` exits within ``timeout`` (then closes fd)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        await asyncio.wait_for(done, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def escape_script(write_script, tmp_path: Path, fifo: str) -> str:
    helper = tmp_path / "escape.py"
    helper.write_text(ESCAPE)

    def child(how: str, clear_env: bool = False) -> dict[str, Any]:
        command = [sys.executable, str(helper), fifo, how]
        if clear_env:
            command = ["env", "-i", *command]
        # A double fork returns once its escapee has reported: the call's reply comes
        # after the report, so even a sessionless call's app-server, stopped right after
        # the reply, is stopped with the escape complete.
        wait = how in ("now", "orphan")
        return {"steps": [{"spawnChild": {"command": command, "wait": wait}}], "result": {}}

    return write_script(
        {
            "methods": {
                "x/escape": child("now"),
                "x/late": child("late"),
                "x/clean": child("clean", clear_env=True),
                "x/orphan": child("orphan", clear_env=True),
                "x/exit": {"steps": [{"exit": 0}]},
            }
        }
    )


class Client:
    def __init__(self, http, base: str, script: str) -> None:
        self.http = http
        self.base = base
        self.options = {"env": {"FAKE_CODEX_SCRIPT": script}}

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        async with self.http.post(self.base + path, json=body) as response:
            return response.status, await response.json()

    async def session(self) -> str:
        status, body = await self.post("/v1/sessions", {"options": self.options})
        assert status == 201, body
        return str(body["sessionId"])

    async def call(self, session_id: str, method: str) -> tuple[int, Any]:
        return await self.post(f"/v1/sessions/{session_id}/call/{method}", {"params": {}})

    async def delete(self, session_id: str) -> None:
        async with self.http.delete(f"{self.base}/v1/sessions/{session_id}") as response:
            assert response.status == 200, await response.text()


async def test_escaped_descendants_die_with_their_app_server(
    serve, http, fake_codex, write_script, report, resources, reports, tmp_path
):
    """Descendants that setsid and double-fork: during a session, after its exit, env cleared"""
    base = await serve(trusted_bridge_app(fake_codex, RestLimits(shutdown_grace_ms=1000)))
    baseline = resources.snapshot()
    client = Client(http, base, escape_script(write_script, tmp_path, reports.path))

    # During the session: an orphan in a session of its own, then the session is deleted.
    session = await client.session()
    status, body = await client.call(session, "x/escape")
    assert status == 200, body
    escaped = await reports.next()
    assert os.getsid(escaped) != reports.origin[escaped], (
        "it did not leave the app-server's session"
    )
    escaped_fd = watch(escaped)
    await client.delete(session)
    assert await gone(escaped_fd), "a double-forked, setsid descendant outlived its session"

    # After the app-server exited: out of the group while it lives, orphaned once it is gone.
    session = await client.session()
    status, body = await client.call(session, "x/late")
    assert status == 200, body
    late_fd = watch(await reports.next())
    status, body = await client.call(session, "x/exit")
    assert (status, body["error"]) == (502, "app_server_exited"), body
    assert await gone(late_fd), "a descendant that escaped the group outlived its app-server"

    # Environment cleared (so unmarked), but still the app-server's child when it is stopped.
    session = await client.session()
    status, body = await client.call(session, "x/clean")
    assert status == 200, body
    clean_fd = watch(await reports.next())
    await client.delete(session)
    assert await gone(clean_fd), "an unmarked child that left the group outlived its session"

    # A sessionless call's process is stopped after the call, and its escapee with it.
    status, body = await client.post("/v1/call/x/escape", {"params": {}, "options": client.options})
    assert status == 200, body
    assert await gone(watch(await reports.next())), "a sessionless call's escapee survived"

    report.outcome = (
        "setsid + double fork during the session, after the app-server's exit, with a "
        "cleared environment, and from a sessionless call: all SIGKILLed with their app-server"
    )
    report.figures = {"escapeesKilled": 4, "waitedOnWith": "pidfd"}
    report.survived = True
    report.nothing_lost = True
    # Whatever the late helper forked after the exit carries the test's mark: none remains.
    await resources.settled(baseline)
    report.no_leak = True


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


async def test_rest_bridge_serve_adopts_reaps_and_outlives_no_escapee(
    bridge_process, http, write_script, report, reports, tmp_path, eventually
):
    """`rest-bridge serve` adopts escapees, reaps them, and kills the rest when it stops"""
    served = bridge_process(env={"REST_ADAPTER_SHUTDOWN_GRACE_MS": "1000"})
    client = Client(http, served.base, escape_script(write_script, tmp_path, reports.path))

    session = await client.session()
    status, body = await client.call(session, "x/escape")
    assert status == 200, body
    escaped = await reports.next()
    assert parent_of(escaped) == served.pid, "the orphan was not re-parented to the bridge"
    escaped_fd = watch(escaped)
    await client.delete(session)
    assert await gone(escaped_fd), "the adopted escapee outlived its session"
    # Its exit status went to the bridge, which must collect it (zombies have no event).
    await eventually(lambda: not zombie_children(served.pid), GONE_SECONDS, what="reaping")

    # Left running when the bridge is told to stop: a marked escapee of a live session,
    # and an orphan with a cleared environment (which no mark can name).
    session = await client.session()
    for method in ("x/escape", "x/orphan"):
        status, body = await client.call(session, method)
        assert status == 200, body
    leftovers = [await reports.next(), await reports.next()]
    assert {parent_of(pid) for pid in leftovers} == {served.pid}
    fds = [watch(pid) for pid in leftovers]
    served.signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.wait, 60) == 0
    outcomes = [await gone(fd) for fd in fds]
    assert outcomes == [True, True], "an escapee outlived `rest-bridge serve`"
    report.figures = {"adoptedByTheBridge": 3, "zombiesLeft": 0, "exitCode": 0}
    report.outcome = (
        "escapees re-parented to the bridge (child subreaper), reaped when killed with "
        "their session, and killed at SIGTERM, an unmarked orphan included; exit 0"
    )
    report.survived = True
    report.nothing_lost = True
    report.no_leak = True


async def test_what_the_version_probe_leaves_running_dies_and_its_answer_is_read_at_once(
    bridge_process, reports, tmp_path
):
    """`rest-bridge serve`'s `--version` probe at start is marked and swept like any
    app-server: a daemon it leaves (out of its session, holding the probe's output) is
    killed once the probe has exited, so the version it printed is read at once instead
    of after the probe's 15 s deadline, and nothing of it outlives the bridge."""
    helper = tmp_path / "escape.py"
    helper.write_text(ESCAPE)
    command = tmp_path / "probed.sh"
    command.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then\n'
        f"  {sys.executable} {helper} {reports.path} now\n"
        "  echo 'codex-cli 0.169.0'\n"
        "  exit 0\n"
        "fi\n"
        f'exec {sys.executable.rsplit("/", 1)[0]}/fake-codex "$@"\n'
    )
    command.chmod(0o755)
    served = bridge_process(app_server=[str(command), "app-server"])
    escaped = await reports.next()
    try:
        fd = os.pidfd_open(escaped)
    except ProcessLookupError:
        fd = None  # killed and reaped already
    if fd is not None:
        assert await gone(fd), "the probe's daemon outlived the probe"
    # The banner's app-server line comes after the listening line: waited for, then read.
    said = served.wait_for_output("\n  tested: ")
    assert "codex-cli 0.169.0; kind" in said, said
    assert "did not report its version in time" not in said
