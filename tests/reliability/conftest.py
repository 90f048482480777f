"""What the reliability tests share: bridges, leak accounting, and the report's rows.

Every test here records a :class:`Row` (what was injected or sent, what came back,
and whether the bridge survived, lost nothing and leaked nothing). With
``RELIABILITY_RESULTS=path`` set, the rows and each test's outcome are written to
that JSON file at the end of the run; ``tests/reliability/report.py`` renders them
as ``docs/RELIABILITY.md`` (``make reliability``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from processes import (
    descriptor_kinds,
    descriptor_targets,
    exited,
    marked_processes,
    resident_kib,
    tcp_sockets,
    zombie_children,
)

from scenarios.harness import contract_middleware
from scenarios.openapi_check import OpenApiChecker

RESULTS_VARIABLE = "RELIABILITY_RESULTS"
#: `full` runs the soak at the issue's size (10,000 cycles, 1,000 text turns).
SOAK_VARIABLE = "RELIABILITY_SOAK"
#: The variable that marks every process a test's bridge spawns (see `marked_processes`).
MARK_VARIABLE = "RELIABILITY_MARK"
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
#: How long a test waits for the bridge's processes and descriptors to settle.
SETTLE_SECONDS = 15.0


def full_run() -> bool:
    return os.environ.get(SOAK_VARIABLE, "").lower() == "full"


# -- report rows -------------------------------------------------------------------


@dataclass
class Row:
    """One line of docs/RELIABILITY.md."""

    theme: str
    case: str
    nodeid: str
    outcome: str = ""
    survived: bool | None = None
    nothing_lost: bool | None = None
    no_leak: bool | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    passed: bool | None = None
    seconds: float = 0.0


ROWS = pytest.StashKey[list[Row]]()
ROW = pytest.StashKey[Row]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[ROWS] = []


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Row:
    """This test's row: the theme is the module's THEME, the case its docstring."""
    node = request.node
    doc = (getattr(node.function, "__doc__", None) or node.name).strip().splitlines()[0]
    callspec = getattr(node, "callspec", None)
    case = f"{doc} [{callspec.id}]" if callspec is not None else doc
    row = Row(
        theme=getattr(request.module, "THEME", request.module.__name__),
        case=case,
        nodeid=node.nodeid,
    )
    node.stash[ROW] = row
    request.config.stash[ROWS].append(row)
    return row


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    result = yield
    row = item.stash.get(ROW, None)
    if row is not None:
        if result.when == "call":
            row.passed = result.passed
            row.seconds = round(call.duration, 2)
        elif result.failed:
            row.passed = False
    return result


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(RESULTS_VARIABLE)
    if not path:
        return
    rows = [asdict(row) for row in session.config.stash.get(ROWS, [])]
    Path(path).write_text(json.dumps({"rows": rows, "full": full_run()}, indent=1))


# -- clients -----------------------------------------------------------------------


@pytest_asyncio.fixture
async def http(
    contract_checkers: dict[str, OpenApiChecker],
) -> AsyncIterator[aiohttp.ClientSession]:
    """The plugin's contract-checking client, but every request on a connection of its own.

    With no idle keep-alive connections left over, a bridge's descriptor count settles
    back to its baseline once the responses are read, so leaks show exactly.
    """
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120),
        connector=aiohttp.TCPConnector(force_close=True, limit=0),
        middlewares=(contract_middleware(contract_checkers),),
    ) as session:
        yield session


# -- leak accounting -----------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """What a bridge holds: processes it spawned, zombies, descriptors, tasks, memory."""

    processes: frozenset[int]
    zombies: frozenset[int]
    descriptors: tuple[tuple[str, int], ...]
    tasks: int
    rss_kib: int

    def comparable(self) -> tuple[Any, ...]:
        return (self.processes, self.zombies, self.descriptors, self.tasks)


class Resources:
    """Snapshots of one bridge's resources, and a wait until they are back to a baseline.

    In-process (``pid`` None) the bridge is this test process: descriptors and asyncio
    tasks are ours. For a bridge in a child process, ``pid`` is that process.
    """

    def __init__(self, mark: str, pid: int | None = None) -> None:
        self.mark = mark
        self.pid = pid

    def processes(self) -> frozenset[int]:
        """The live processes the bridge spawned, however deep (its own pid excluded)."""
        return frozenset(marked_processes(MARK_VARIABLE, self.mark) - {self.pid or -1})

    def snapshot(self) -> Snapshot:
        tasks = 0
        if self.pid is None:
            tasks = len([t for t in asyncio.all_tasks() if not t.done()])
        return Snapshot(
            processes=self.processes(),
            zombies=frozenset(zombie_children(self.pid)),
            descriptors=tuple(sorted(descriptor_kinds(self.pid).items())),
            tasks=tasks,
            rss_kib=resident_kib(self.pid),
        )

    def requests_read(self) -> int:
        """Open connections whose bytes the bridge has all read (for a bridge process).

        With one request per connection, the requests the bridge is handling: a
        connection it has not accepted, or whose request it has not read, is not counted,
        nor one its client has closed.
        """
        return sum(
            1 for state, unread in tcp_sockets(self.pid) if state == "established" and not unread
        )

    async def idle(self, timeout: float = SETTLE_SECONDS) -> Snapshot:
        """A snapshot taken once the bridge holds no connection, only its listening socket.

        The baseline for a bridge process that has served requests already: their
        connections close on the bridge's side a moment after the client has its answer
        (later still on a loaded machine), and a baseline counting one of them is never
        reached again. Waits up to ``timeout``, then raises AssertionError.
        """
        await eventually(
            lambda: all(state == "listen" for state, _ in tcp_sockets(self.pid)),
            timeout,
            what="the bridge to close its connections",
        )
        return self.snapshot()

    async def quiet(self, reference: Snapshot) -> Snapshot:
        """A snapshot taken once the sockets are back to ``reference``'s count.

        For a baseline taken mid-test, after requests whose connections are closing.
        """

        # Only the sockets are read while waiting: a whole snapshot scans every process
        # of the machine for the mark, fifty times a second.
        def sockets_settled() -> bool:
            return descriptor_kinds(self.pid)["socket"] == dict(reference.descriptors)["socket"]

        await eventually(sockets_settled, raises=False)
        return self.snapshot()

    async def settled(self, baseline: Snapshot, timeout: float = SETTLE_SECONDS) -> Snapshot:
        """Wait until processes, zombies, descriptors and tasks equal ``baseline``.

        Raises AssertionError naming what differs if they do not within ``timeout``.
        """
        # Processes that should be gone are waited on through their pidfds (an event);
        # descriptor and zombie counts have none, so what remains is polled.
        await exited(self.processes() - baseline.processes, timeout)
        # The snapshot that matched is the one judged: a fresh one taken after it could
        # catch a descriptor the process holds for an instant (its orphan reaper reads
        # /proc/PID/stat files once a second), which is no leak.
        seen: list[Snapshot] = []

        def matches() -> bool:
            seen[:] = [self.snapshot()]
            return seen[0].comparable() == baseline.comparable()

        await eventually(matches, timeout, raises=False)
        current = seen[0] if seen else self.snapshot()
        assert current.processes == baseline.processes, (
            f"processes left: {sorted(current.processes - baseline.processes)}, "
            f"gone: {sorted(baseline.processes - current.processes)}"
        )
        assert not current.zombies - baseline.zombies, f"zombies: {sorted(current.zombies)}"
        assert current.descriptors == baseline.descriptors, (
            f"descriptors {dict(current.descriptors)} != baseline {dict(baseline.descriptors)}"
            f"; open now: {sorted(descriptor_targets(self.pid))}"
        )
        assert current.tasks == baseline.tasks, f"tasks {current.tasks} != {baseline.tasks}"
        return current


@pytest.fixture
def mark(monkeypatch: pytest.MonkeyPatch) -> str:
    """A unique value of MARK_VARIABLE, set in this process so every child inherits it."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARK_VARIABLE, value)
    return value


@pytest.fixture
def resources(mark: str) -> Resources:
    """Resource accounting of an in-process bridge (this test process)."""
    return Resources(mark)


# -- a bridge in a process of its own --------------------------------------------------


_WITH_NOFILE = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)


class BridgeProcess:
    """`rest-bridge serve` as a child process: its URL, its output, and its end.

    The output (stdout and stderr together) is drained by a thread into
    :attr:`output`, so the test can search the bridge's logs.
    """

    def __init__(
        self,
        *,
        preset: str = "trusted",
        app_server: list[str] | None = None,
        env: dict[str, str] | None = None,
        token: str | None = None,
        mark: str | None = None,
        extra_args: list[str] | None = None,
        nofile: tuple[int, int] | None = None,
    ) -> None:
        self.mark = mark or uuid.uuid4().hex
        environment = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
        environment.update(env or {})
        environment[MARK_VARIABLE] = self.mark
        if token is not None:
            environment["REST_ADAPTER_TOKEN"] = token
        command = " ".join(app_server or [FAKE_CODEX, "app-server"])
        self.argv = [
            REST_BRIDGE,
            "serve",
            "--preset",
            preset,
            "--port",
            "0",
            "--app-server",
            command,
            *(extra_args or []),
        ]
        if nofile is not None:
            # RLIMIT_NOFILE (soft, hard), set by a small exec wrapper: same pid, no preexec_fn.
            self.argv = [sys.executable, "-c", _WITH_NOFILE, *map(str, nofile), *self.argv]
        self._output = bytearray()
        #: Guards the output; notified for each line the drain thread appends.
        self._lock = threading.Condition()
        self._listening = threading.Event()
        self.process = subprocess.Popen(
            self.argv,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.pid = self.process.pid
        self.base = ""
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        if not self._listening.wait(30):
            self.kill()
            raise RuntimeError(f"rest-bridge did not start: {self.output}")
        self.resources = Resources(self.mark, self.pid)

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._lock:
                self._output += line
                self._lock.notify_all()
            if not self._listening.is_set() and b" listening on " in line:
                self.base = line.decode().rsplit(" ", 1)[1].strip()
                self._listening.set()

    @property
    def output(self) -> str:
        with self._lock:
            return self._output.decode("utf-8", "replace")

    def wait_for_output(self, text: str, timeout: float = 30) -> str:
        """The output, once it holds ``text`` (woken by each line read, no polling)."""
        needle = text.encode()
        with self._lock:
            if not self._lock.wait_for(lambda: needle in self._output, timeout):
                raise AssertionError(f"{text!r} not in the bridge's output:\n{self.output}")
            return self._output.decode("utf-8", "replace")

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        code = self.process.wait(timeout)
        self._close_output()
        return code

    def _close_output(self) -> None:
        # Closed here, not by the garbage collector at some later test's expense.
        self._reader.join(5)
        if self.process.stdout is not None and not self._reader.is_alive():
            self.process.stdout.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._close_output()
        # Whatever the bridge could not stop on its way down.
        for pid in marked_processes(MARK_VARIABLE, self.mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def bridge_process() -> Iterator[Callable[..., BridgeProcess]]:
    """Start `rest-bridge serve` processes; whatever is left of them is killed at the end."""
    started: list[BridgeProcess] = []

    def start(**kwargs: Any) -> BridgeProcess:
        bridge = BridgeProcess(**kwargs)
        started.append(bridge)
        return bridge

    yield start
    for bridge in started:
        bridge.kill()


POLL_SECONDS = 0.02


async def eventually(
    predicate: Callable[[], bool], timeout: float = 10.0, *, raises: bool = True, what: str = ""
) -> bool:
    """Wait until ``predicate()`` holds, for states that have no event to wait on.

    Polls every POLL_SECONDS; at ``timeout`` raises AssertionError (or returns False).
    The deadline is on the clock, not a number of polls: a predicate that reads a large
    /proc table on a loaded machine takes a while itself.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(POLL_SECONDS)  # sync-ok: /proc counts have no event to wait on
    if predicate():
        return True
    if raises:
        raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
    return False


@pytest.fixture(name="eventually")
def eventually_fixture() -> Callable[..., Any]:
    """The :func:`eventually` helper, for test modules (which cannot import a conftest)."""
    return eventually


@pytest.fixture(scope="module")
def shared_bridge_process() -> Iterator[Callable[..., BridgeProcess]]:
    """Like `bridge_process`, for a whole module: the same arguments, the same bridge."""
    started: dict[str, BridgeProcess] = {}

    def start(**kwargs: Any) -> BridgeProcess:
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in started or started[key].process.poll() is not None:
            started[key] = BridgeProcess(**kwargs)
        return started[key]

    yield start
    for bridge in started.values():
        bridge.kill()


def elapsed_ms(since: float) -> float:
    return round((time.monotonic() - since) * 1000, 1)
