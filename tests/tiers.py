"""The test tiers, and how `make test` shares the tests out between pytest-xdist's workers.

**Quick** (`make check`): a test marked `quick` (``pytestmark = pytest.mark.quick`` in its
module, or ``@pytest.mark.quick`` on it) starts no process. What it needs runs inside the
test process: an in-process bridge, the in-process fakes. `nginx -t`, which checks a
configuration file and serves nothing, is the one exception. The rule holds because it
is checked: Python's audit events (``subprocess.Popen``, ``os.fork``, ``os.posix_spawn``,
``os.system``) report each process this process starts, a child still there at the end
of a phase is seen in ``/proc``, and a quick test that starts one fails, naming it, in the
phase (setup, call, teardown) that started it.

**Groups** (`make test`, ``--dist loadgroup``): a worker runs one test at a time, but a
test that reads this process's own state counts whatever the worker's earlier tests left
behind. Such a test is recognised by what its body calls, or by the fixture it uses:

- its live children: ``live_children()``, ``zombie_children()``;
- its open descriptors: ``open_descriptors()``, or an in-process bridge's ``resources``;
- its memory: ``resident_kib()``.

Each kind is one xdist group (``process-children``, ``process-descriptors``,
``process-memory``): its tests run one after another on one worker, scheduled first (they
are the longest units), and before each the worker waits for the processes its earlier
tests started to be gone. Tests that share a module's bridge (``shared_bridge_process``)
stay on one worker too, so that bridge starts once. A module with several shared bridges
names one group per bridge with an explicit ``xdist_group`` mark (tests/reliability/
test_fuzz.py), which this module keeps: the bridges' tests then run on several workers.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from processes import live_children

QUICK = "quick"
#: What a test's body calls, or the fixture it uses, and the state it then reads.
STATE_READERS = {
    "live_children": "children",
    "zombie_children": "children",
    "open_descriptors": "descriptors",
    "resources": "descriptors",
    "resident_kib": "memory",
}
#: The order in which a test reading several kinds is put in the first one's group.
KINDS = ("descriptors", "children", "memory")
SHARED_FIXTURES = ("shared_bridge_process",)
#: How long a test of a group waits for the processes of earlier tests to be gone.
SETTLE_SECONDS = 30.0
#: The audit events of a process being started, and where their argument lists hold argv.
SPAWN_EVENTS: dict[str, int | None] = {
    "subprocess.Popen": 1,
    "os.posix_spawn": 1,
    "os.system": 0,
    "os.fork": None,
    "os.forkpty": None,
}

#: What the quick tests running now have started (a list per test; none outside them).
_watching: list[list[str]] = []
_installed = False


# -- the hooks (tests/conftest.py registers this module as a plugin) ------------------


def pytest_configure(config: pytest.Config) -> None:
    """Listen to the audit events of this process, once (a hook cannot be removed)."""
    global _installed
    if not _installed:
        sys.addaudithook(_on_audit_event)
        _installed = True


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group(config, items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    before(item)
    with no_process_started(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with no_process_started(item, "call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with no_process_started(item, "teardown"):
        return (yield)


# -- quick: no process ----------------------------------------------------------------


def _on_audit_event(event: str, args: tuple[Any, ...]) -> None:
    if not _watching or event not in SPAWN_EVENTS:
        return
    # An exception here would fail the call being audited: none leaves this function.
    try:
        where = SPAWN_EVENTS[event]
        argv = args[where] if where is not None else [event]
        if isinstance(argv, (str, bytes, os.PathLike)):
            argv = [argv]
        words = [os.fsdecode(word) for word in argv]
    except Exception:
        words = [event]
    if _allowed(words):
        return
    for started in _watching:
        started.append(" ".join(words)[:200])


def _children() -> set[int]:
    """This process's children (each thread's; zombies included)."""
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            found.update(int(pid) for pid in f.read().split())
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return f"pid {pid}"
    return " ".join(os.fsdecode(word) for word in argv if word)[:200] or f"pid {pid}"


def _allowed(argv: list[str]) -> bool:
    """`nginx -t`: a check of a configuration file, over before the call returns."""
    return bool(argv) and os.path.basename(argv[0]) == "nginx" and "-t" in argv[1:]


@contextlib.contextmanager
def no_process_started(item: pytest.Item, phase: str) -> Iterator[None]:
    """Fail a quick test that starts a process during ``phase``."""
    if item.get_closest_marker(QUICK) is None:
        yield
        return
    started: list[str] = []
    children = _children()
    _watching.append(started)
    try:
        yield
    finally:
        _watching.remove(started)
    # A child started otherwise (multiprocessing's spawn, say, raises no event) is seen if
    # it is still there: alive, or exited and not yet reaped.
    started += [_command(pid) for pid in sorted(_children() - children)]
    if started:
        pytest.fail(
            f"a quick test started {len(started)} process(es) in its {phase}: "
            f"{'; '.join(started[:3])}. A quick test runs everything in the test process "
            "(tests/tiers.py): make it do so, or take its `quick` mark off.",
            pytrace=False,
        )


# -- groups: tests reading this process's state -----------------------------------------


def kind_of(item: pytest.Item) -> str | None:
    """Which of this process's states the test reads (see STATE_READERS), if any."""
    function = getattr(item, "function", None)
    names = set(getattr(getattr(function, "__code__", None), "co_names", ()))
    names |= set(getattr(item, "fixturenames", ()))
    kinds = {STATE_READERS[name] for name in names & STATE_READERS.keys()}
    return next((kind for kind in KINDS if kind in kinds), None)


def group(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put each test reading this process's state into its kind's xdist group, and the
    tests sharing a module's bridge into that module's; in an xdist worker, the tests
    of groups, the longest units, go first (a serial run keeps pytest's order)."""
    grouped: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            grouped.append(item)
            continue
        kind = kind_of(item)
        shared = any(name in getattr(item, "fixturenames", ()) for name in SHARED_FIXTURES)
        if kind is not None:
            item.add_marker(pytest.mark.xdist_group(f"process-{kind}"))
            grouped.append(item)
        elif shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
            grouped.append(item)
        else:
            rest.append(item)
    if hasattr(config, "workerinput"):
        items[:] = grouped + rest


def before(item: pytest.Item) -> None:
    """Before a test of a kind's group: wait for the processes earlier tests started to be
    gone, so that the test counts only its own (it then runs whatever is left)."""
    marker = item.get_closest_marker("xdist_group")
    if marker is None or not str(marker.args[0] if marker.args else "").startswith("process-"):
        return
    deadline = time.monotonic() + SETTLE_SECONDS
    while (left := live_children()) and time.monotonic() < deadline:
        _wait_for_any(left, deadline - time.monotonic())


def _wait_for_any(pids: set[int], timeout: float) -> None:
    """Return when one of ``pids`` exits, or at ``timeout`` (a pidfd is readable then)."""
    poll = select.poll()
    descriptors = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            descriptors.append(os.pidfd_open(pid))
            poll.register(descriptors[-1], select.POLLIN)
    try:
        if descriptors:
            poll.poll(max(0.0, timeout) * 1000)
    finally:
        for fd in descriptors:
            os.close(fd)
