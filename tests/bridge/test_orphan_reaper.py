"""`rest-bridge serve`'s reaper of adopted orphans (bridge.runtime.OrphanReaper), in a
process of its own made a child subreaper: it reaps an orphan that came to it, leaves
the exit status of a child the process spawned itself to whoever waits for it, and opens
the ``/proc`` entries of its own children only, not of every process on the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

#: Script text for both scripts below: ``with proc_entries_opened() as entries:`` gives
#: the pids whose ``/proc`` entries the block opened.
RECORD_PROC = r"""
import contextlib, re, sys
_opened, _recording = [], [False]
def _audit(event, args):
    if _recording[0] and event == "open" and isinstance(args[0], str):
        _opened.append(args[0])
sys.addaudithook(_audit)

@contextlib.contextmanager
def proc_entries_opened():
    entries = []
    _opened.clear()
    _recording[0] = True
    try:
        yield entries
    finally:
        _recording[0] = False
        pids = {int(m.group(1)) for m in map(re.compile(r"/proc/(\d+)/").match, _opened) if m}
        entries += sorted(pids)
"""

#: The script as a child subreaper with an app-server's lineage; ``spawn_app_server``
#: starts a shell line as that app-server, as the backend spawns one, and returns it
#: with the pid it prints first.
LINEAGE = r"""
import subprocess
from bridge import runtime
from bridge.process import descendants

assert runtime.become_subreaper()
lineage = descendants.Lineage()

def spawn_app_server(line, **popen):
    with descendants.children.spawning() as register:
        shell = subprocess.Popen(
            ["sh", "-c", line], env=lineage.environment(None), stdout=subprocess.PIPE, **popen
        )
        register(shell.pid)
    lineage.spawned(shell.pid)
    return shell, int(shell.stdout.readline())
"""

#: Prints, as JSON, what one reaping did (and, apart, what the two child listings say).
SCRIPT = (
    RECORD_PROC
    + r"""
import json, os, re, select, sys, threading
from bridge import runtime
from bridge.process import descendants

assert runtime.become_subreaper()

def exited(pid):
    fd = os.pidfd_open(pid)
    select.select([fd], [], [])
    os.close(fd)

# A child of its own, registered as the process layer registers its spawns: it exits.
with descendants.children.spawning() as register:
    own = os.fork()
    if own == 0:
        os._exit(7)
    register(own)
# An orphan: a child forks a grandchild and exits; the grandchild comes to this process.
report_r, report_w = os.pipe()
hold_r, hold_w = os.pipe()
middle = os.fork()
if middle == 0:
    os.close(hold_w)
    if os.fork() == 0:
        os.write(report_w, str(os.getpid()).encode())
        os.read(hold_r, 1)
        os._exit(0)
    os._exit(0)
orphan = int(os.read(report_r, 32))
os.waitpid(middle, 0)
# A child forked by a thread that has ended since: the kernel lists it under another one.
forked = []
def fork_a_child():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    forked.append(pid)
thread = threading.Thread(target=fork_a_child)
thread.start()
thread.join()
by_thread = forked[0]
adopted = descendants.read_stat(orphan).ppid == os.getpid()
os.close(hold_w)
exited(orphan)
exited(own)
exited(by_thread)
listings = sorted(runtime.own_children()), sorted(runtime.children_in_table())

with proc_entries_opened() as entries:
    runtime.reap_orphans()

def reaped(pid):
    try:
        os.waitpid(pid, os.WNOHANG)
        return False
    except ChildProcessError:
        return True
_, status = os.waitpid(own, 0)
print(json.dumps({
    "adopted": adopted, "orphan": orphan, "own": own, "byThread": by_thread,
    "orphanReaped": reaped(orphan), "byThreadReaped": reaped(by_thread),
    "ownExitCode": os.waitstatus_to_exitcode(status), "procEntries": entries,
    "ownChildren": listings[0], "childrenInTable": listings[1],
}))
"""
)


@pytest.fixture(scope="module")
def reaping() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_the_reaper_takes_the_exit_of_an_orphan_not_of_its_own_child(reaping):
    assert reaping["adopted"], "the orphan did not come to the subreaper"
    assert reaping["orphanReaped"], "the adopted orphan was left a zombie"
    assert reaping["byThreadReaped"], "an unregistered child of an ended thread was left"
    assert reaping["ownExitCode"] == 7, "the exit status of a registered child was taken"


def test_the_reaper_reads_the_entries_of_its_own_children_only(reaping):
    """Not the stat of every process on the machine at each reaping: its children's."""
    children = {reaping["orphan"], reaping["own"], reaping["byThread"]}
    assert set(reaping["procEntries"]) <= children, reaping["procEntries"]


def test_the_childrens_listing_and_the_tables_agree(reaping):
    """The kernel's list of each thread's children, and the fallback for a kernel that
    has none (the whole process table): the same children, zombies included, a child of
    a thread that has ended too."""
    expected = sorted([reaping["orphan"], reaping["own"], reaping["byThread"]])
    assert reaping["ownChildren"] == expected
    assert reaping["childrenInTable"] == expected


#: An app-server (a shell) whose child leaves its session and outlives it: the sweep at
#: the app-server's end, in a subreaper, kills that child, opening no entry of ``/proc``
#: but those of the subreaper's own descendants.
SWEEP = (
    RECORD_PROC
    + LINEAGE
    + r"""
import asyncio, json, os
shell, escaped = spawn_app_server("setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!")
shell.wait()
gone = os.pidfd_open(escaped)

async def end():
    with proc_entries_opened() as entries:
        lineage.end()  # the first sweep, at once
    exited = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().add_reader(gone, exited.set_result, None)
    await asyncio.wait_for(exited, 30)
    return entries

entries = asyncio.run(end())
print(json.dumps({
    "shell": shell.pid, "escaped": escaped, "procEntries": entries,
}))
"""
)


def test_a_subreapers_sweep_kills_what_an_app_server_left_reading_its_subtree_only():
    """The sweep after an app-server's exit in `rest-bridge serve` (a child subreaper):
    what the app-server left (here a child in a session of its own, adopted by the
    subreaper) is killed, and only the entries of the subreaper's descendants are read,
    not every process's on the machine at each app-server's end."""
    done = subprocess.run(
        [sys.executable, "-c", SWEEP], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # It exited (a `sleep 1000`: it was killed), or the script would have timed out.
    assert set(result["procEntries"]) <= {result["shell"], result["escaped"]}, result


#: Two app-servers of one subreaper, the first with a child of its own: what lives under
#: the first is noted before it is stopped (remember_tree) from its own lists of children.
REMEMBER = (
    RECORD_PROC
    + LINEAGE
    + r"""
import json, os, signal
first, child = spawn_app_server("sleep 1000 & echo $!; wait", start_new_session=True)
with descendants.children.spawning() as register:
    other = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    register(other.pid)
try:
    with proc_entries_opened() as entries:
        lineage.remember_tree()
finally:
    for pid in (first.pid, other.pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    first.wait()
    other.wait()
print(json.dumps({
    "first": first.pid, "child": child, "other": other.pid, "procEntries": entries,
    "listed": os.path.exists(f"/proc/self/task/{os.getpid()}/children"),
}))
"""
)


def test_an_app_servers_tree_is_noted_from_its_own_entries_not_every_sessions():
    """Before an app-server is stopped (every text turn's, every deleted session's), what
    lives under it is noted: from its own lists of children, so the other sessions'
    app-servers are not read each time (which made a text turn's cost grow with the
    number of live sessions)."""
    done = subprocess.run(
        [sys.executable, "-c", REMEMBER], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["child"] in result["procEntries"], result
    if result["listed"]:  # a kernel without CONFIG_PROC_CHILDREN reads the whole table
        assert set(result["procEntries"]) <= {result["first"], result["child"]}, result
