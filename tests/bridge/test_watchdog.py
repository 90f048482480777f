"""Whatever kills `rest-bridge serve` or the cluster's launcher (SIGKILL here: nothing can
catch it), nothing they started outlives them and the folders they made are removed:
their watchdog (bridge/watchdog.py) sees the end of its pipe and cleans up.

Each test SIGKILLs the bridge, then waits on the processes it started and on the
watchdog itself to be gone (psutil waits on each process, with a deadline to fail at);
once the watchdog has exited, its work is done and is checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from processes import marked_processes, nginx_binary

from bridge import watchdog

REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
#: Marks every process a test's bridge starts (and all those start), as the test's own.
MARK = "WATCHDOG_TEST_MARK"
#: Generous: a SIGKILLed process is gone in milliseconds, even on a loaded machine.
GONE_SECONDS = 30.0
WAIT = 60.0

#: The stranger's script: a child in the app-server's group, and a daemon that leaves it.
EVIL = {
    "methods": {
        "x/child": {"steps": [{"spawnChild": {"command": ["sleep", "1001"]}}], "result": {}},
        "x/daemon": {
            "steps": [{"spawnChild": {"command": ["setsid", "-f", "sleep", "1002"], "wait": True}}],
            "result": {},
        },
    }
}


@dataclass
class Started:
    """A `rest-bridge serve` or `rest-bridge cluster` process of a test."""

    process: subprocess.Popen[str]
    mark: str
    stderr: Path
    url: str = ""
    #: Its stdout up to the line the test waited for.
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def marked(self) -> set[int]:
        """The live processes it started, however deep (itself excluded)."""
        return marked_processes(MARK, self.mark) - {self.pid}

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            answer: dict[str, Any] = json.load(response)
        return answer


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Any]:
    """Start `rest-bridge ARGS` (``until`` a line of its stdout); whatever is left of it is
    killed at the end."""
    processes: list[Started] = []

    def start(
        *args: str,
        until: str = " listening on ",
        env: dict[str, str] | None = None,
        merged: bool = False,
    ):
        mark = uuid.uuid4().hex
        environment = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
        environment.update(env or {})
        environment[MARK] = mark
        stderr = tmp_path / f"stderr-{len(processes)}"
        with stderr.open("w") as err:
            process = subprocess.Popen(
                [REST_BRIDGE, *args],
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                # The cluster's launcher says where it is on stderr: read with stdout.
                stderr=subprocess.STDOUT if merged else err,
                text=True,
                start_new_session=True,  # its own process group, as in a terminal
            )
        bridge = Started(process, mark, stderr)
        processes.append(bridge)
        assert process.stdout is not None
        lines: list[str] = []
        if not until:
            return bridge
        for line in process.stdout:  # waits on the process's own words
            lines.append(line)
            if until in line:
                found = re.search(r"http://[^\s\"]+", line) if "listening" in until else None
                bridge.url = found.group(0) if found else ""
                bridge.lines = lines
                return bridge
        process.wait(WAIT)
        pytest.fail(f"rest-bridge did not start: {lines} {stderr.read_text()}")

    yield start
    for bridge in processes:
        if bridge.process.poll() is None:
            bridge.process.kill()
            bridge.process.wait(WAIT)
        if bridge.process.stdout is not None:
            bridge.process.stdout.close()
        for pid in bridge.marked():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def watchdog_of(pid: int) -> psutil.Process:
    """The watchdog of the bridge ``pid``: its one child running bridge/watchdog.py."""
    found = [
        child for child in psutil.Process(pid).children() if watchdog.__file__ in child.cmdline()
    ]
    assert len(found) == 1, [child.cmdline() for child in psutil.Process(pid).children()]
    return found[0]


def processes(pids: set[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


def all_gone(waited: list[psutil.Process]) -> None:
    """Return once every process of ``waited`` has exited (fail after GONE_SECONDS)."""
    _, alive = psutil.wait_procs(waited, timeout=GONE_SECONDS)
    assert not alive, [(p.pid, p.cmdline()) for p in alive if p.is_running()]


def settled(bridge: Started, count: int) -> set[int]:
    """The processes ``bridge`` started, once there are ``count`` (polled: a count in
    /proc has no event to wait on; fails after GONE_SECONDS)."""
    deadline = time.monotonic() + GONE_SECONDS
    while len(found := bridge.marked()) != count and time.monotonic() < deadline:
        time.sleep(0.05)  # sync-ok: /proc counts have no event to wait on
    assert len(found) == count, commands(found)
    return found


def commands(pids: set[int]) -> list[str]:
    found = []
    for process in processes(pids):
        try:
            found.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return found


def test_sigkill_of_serve_kills_its_app_servers_children_and_escapees(started, write_script):
    """Process mode: an app-server's child (`sleep 1001`) and a daemon that left its
    session (`setsid -f sleep 1002`) die with the bridge's SIGKILL, as the app-server does."""
    script = write_script(EVIL)
    bridge = started(
        "serve", "--port", "0", "--app-server", f"{FAKE_CODEX} app-server --script {script}"
    )
    session = bridge.post("/v1/sessions")["sessionId"]
    for method in ("x/child", "x/daemon"):
        assert bridge.post(f"/v1/sessions/{session}/call/{method}", {"params": {}}) == {
            "result": {}
        }
    left = bridge.marked()
    # (the daemon may not have exec'd `sleep` yet: then it is still `setsid -f sleep 1002`)
    for command in ("sleep 1001", "sleep 1002"):
        assert any(running.endswith(command) for running in commands(left)), commands(left)
    waited = [*processes(left), watchdog_of(bridge.pid)]
    os.kill(bridge.pid, signal.SIGKILL)
    assert bridge.process.wait(WAIT) == -signal.SIGKILL
    all_gone(waited)
    assert not bridge.marked()
    said = bridge.stderr.read_text()
    assert "rest-bridge watchdog: the bridge is gone; killed " in said, said


def test_sigkill_of_serve_in_shared_mode_kills_the_app_server_and_removes_its_folder(started):
    """Shared mode: the shared app-server dies with the bridge's SIGKILL, and the folder of
    its socket is removed."""
    bridge = started(
        "serve",
        "--port",
        "0",
        "--app-server-mode",
        "shared",
        "--app-server",
        f"{FAKE_CODEX} app-server",
    )
    bridge.post("/v1/sessions")
    left = bridge.marked()
    listening = [command for command in commands(left) if "--listen unix://" in command]
    assert len(listening) == 1, commands(left)
    folder = Path(listening[0].split("--listen unix://", 1)[1].split()[0]).parent
    assert folder.name.startswith("rest-bridge-app-server-")
    assert folder.is_dir()
    waited = [*processes(left), watchdog_of(bridge.pid)]
    os.kill(bridge.pid, signal.SIGKILL)
    bridge.process.wait(WAIT)
    all_gone(waited)
    assert not bridge.marked()
    assert not folder.exists()


def test_sigkill_of_the_cluster_launcher_removes_its_folder_and_token_map(started):
    """`rest-bridge cluster`: its SIGKILL stops the replicas, their app-servers and nginx,
    and removes the folder it made, with the token map in it."""
    bridge = started(
        *("cluster", "--replicas", "2", "--port", "0", "--nginx", nginx_binary()),
        *("--app-server", f"{FAKE_CODEX} app-server"),
        until="rest-bridge cluster: ready",
        env={"REST_ADAPTER_TOKEN": "watchdog-test-token"},
        merged=True,
    )
    front = next(line for line in bridge.lines if line.startswith("rest-bridge cluster: front "))
    folder = Path(front.split(" config ", 1)[1].strip()).parent
    token_map = folder / "token-map.conf"
    assert token_map.stat().st_mode & 0o777 == 0o600
    replicas = [
        int(line.split()[6]) for line in bridge.lines if " replica " in line and " mark " in line
    ]
    assert len(replicas) == 2
    left = bridge.marked()
    assert set(replicas) <= left
    # The replicas' own watchdogs carry no mark (they spare each other): waited on too.
    watchdogs = [watchdog_of(pid) for pid in (bridge.pid, *replicas)]
    waited = [*processes(left), *watchdogs]
    os.kill(bridge.pid, signal.SIGKILL)
    bridge.process.wait(WAIT)
    all_gone(waited)
    assert not bridge.marked()
    assert not folder.exists()


def pipe_holders(inode: str) -> set[int]:
    """Every process that holds a descriptor of the pipe ``inode`` (``pipe:[N]``)."""
    holders = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") == inode:
                    holders.add(int(name))
                    break
            except OSError:
                continue
    return holders


def test_the_watchdog_reaches_nobody_but_its_bridge_and_kills_only_what_it_started(
    started, write_script, tmp_path
):
    """Its pipe is held by the bridge alone (a copy opened through /proc neither hides the
    bridge's end nor removes a folder), its environment holds no secret and no mark, stop
    signals do not end it, and of processes carrying look-alike marks it kills none."""
    script = write_script(EVIL)
    bridge = started(
        *("serve", "--port", "0", "--app-server", f"{FAKE_CODEX} app-server --script {script}"),
        env={"REST_ADAPTER_TOKEN": "watchdog-test-token"},
    )
    headers = {"Authorization": "Bearer watchdog-test-token", "Content-Type": "application/json"}
    request = urllib.request.Request(bridge.url + "/v1/sessions", b"{}", headers, method="POST")
    with urllib.request.urlopen(request, timeout=WAIT) as response:
        session = json.load(response)["sessionId"]
    request = urllib.request.Request(
        f"{bridge.url}/v1/sessions/{session}/call/x/child",
        b'{"params": {}}',
        headers,
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=WAIT):
        pass
    dog = watchdog_of(bridge.pid)
    assert dog.environ() == {watchdog.VARIABLE: watchdog.LABEL}
    assert os.getsid(dog.pid) == dog.pid != os.getsid(bridge.pid)
    stdin = os.readlink(f"/proc/{dog.pid}/fd/0")
    assert stdin.startswith("pipe:")
    assert pipe_holders(stdin) == {bridge.pid, dog.pid}
    # A process of the bridge's user can still open a copy of the write end through
    # /proc: holding it hides no end of the bridge, and what it writes there removes
    # nothing but a folder the bridge would make.
    (end,) = [
        fd
        for fd in os.listdir(f"/proc/{bridge.pid}/fd")
        if os.readlink(f"/proc/{bridge.pid}/fd/{fd}") == stdin
    ]
    copy = os.open(f"/proc/{bridge.pid}/fd/{end}", os.O_WRONLY)
    victim = tmp_path / "victim"
    victim.mkdir()
    os.write(copy, b"\0" + os.fsencode(victim) + b"\0" + os.fsencode(tmp_path) + b"\0")
    left = bridge.marked()
    (app_server,) = [p for p in processes(left) if "fake-codex" in " ".join(p.cmdline())]
    mark = app_server.environ()[watchdog.VARIABLE]
    assert len(mark.split()) == 1
    decoys = [
        subprocess.Popen(["sleep", "1003"], env={watchdog.VARIABLE: value})
        for value in (mark + "0", mark[:-1], f"other{mark}", watchdog.LABEL, "")
    ]
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(dog.pid, sig)
            os.killpg(dog.pid, sig)
        # The bridge's whole process group at once, as `kill -9 -PGID` does.
        os.killpg(bridge.pid, signal.SIGKILL)
        bridge.process.wait(WAIT)
        all_gone([*processes(left), dog])
        assert not bridge.marked()
        assert [decoy.poll() for decoy in decoys] == [None] * len(decoys)
        assert victim.is_dir()
    finally:
        os.close(copy)
        for decoy in decoys:
            decoy.kill()
            decoy.wait()
    said = bridge.stderr.read_text()
    assert "rest-bridge watchdog: the bridge is gone; killed " in said, said
    assert "watchdog-test-token" not in said


def test_a_bridge_that_stops_lets_its_watchdog_go_with_nothing_to_do(started, write_script):
    """SIGTERM: the bridge stops its app-server and what it started itself, and its
    watchdog is gone before the bridge exits, having found nothing to kill."""
    script = write_script(EVIL)
    bridge = started(
        "serve", "--port", "0", "--app-server", f"{FAKE_CODEX} app-server --script {script}"
    )
    session = bridge.post("/v1/sessions")["sessionId"]
    bridge.post(f"/v1/sessions/{session}/call/x/daemon", {"params": {}})
    dog = watchdog_of(bridge.pid)
    bridge.process.send_signal(signal.SIGTERM)
    assert bridge.process.wait(WAIT) == 0
    assert not dog.is_running()  # waited for by the bridge, which has exited since
    assert not bridge.marked()
    assert "rest-bridge watchdog" not in bridge.stderr.read_text()


def test_a_watchdog_killed_by_hand_is_said_and_the_bridge_still_stops_clean(started):
    """SIGKILL to the watchdog alone: the bridge reaps it and says so once, the folder made
    next cannot be handed to it (one warning), the bridge serves on, and its stop still
    removes that folder and stops what it started itself."""
    bridge = started(
        *("serve", "--port", "0", "--app-server-mode", "shared"),
        *("--app-server", f"{FAKE_CODEX} app-server"),
    )
    dog = watchdog_of(bridge.pid)
    dog.kill()
    all_gone([dog])  # reaped by the bridge (its reaper of orphans), not left a zombie
    bridge.post("/v1/sessions")  # the shared app-server starts: its folder is made now
    left = bridge.marked()
    (listening,) = [command for command in commands(left) if "--listen unix://" in command]
    folder = Path(listening.split("--listen unix://", 1)[1].split()[0]).parent
    bridge.process.send_signal(signal.SIGTERM)
    assert bridge.process.wait(WAIT) == 0
    said = bridge.stderr.read_text()
    assert f"the watchdog is gone (Broken pipe): if this process is killed, {folder} stays" in said
    assert said.count("the watchdog has exited (-9): if this process is killed") == 1, said
    assert not folder.exists()
    assert not bridge.marked()


def test_sigkill_of_serve_during_its_version_probe_kills_the_probe(started, tmp_path):
    """The `--version` probe runs before `serve` listens: one that hangs dies with the
    bridge's SIGKILL too."""
    fifo = tmp_path / "probe-started"
    os.mkfifo(fifo)
    probe = f"echo started > {fifo}; exec sleep 1006"
    bridge = started(
        "serve", "--port", "0", "--app-server", f"sh -c '{probe}' x app-server", until=""
    )
    with fifo.open() as reading:  # the probe's own word that it runs
        assert reading.read() == "started\n"
    left = bridge.marked()  # the probe: `sh`, or the `sleep 1006` it becomes
    assert len(left) == 1, commands(left)
    waited = [*processes(left), watchdog_of(bridge.pid)]
    os.kill(bridge.pid, signal.SIGKILL)
    bridge.process.wait(WAIT)
    all_gone(waited)
    assert not bridge.marked()


def test_the_sigkill_of_one_bridge_leaves_another_bridges_processes_alone(started, write_script):
    """Two bridges side by side: one SIGKILLed takes its app-server and its child along,
    the other's app-server and child (its own mark) serve on."""
    script = write_script(EVIL)
    command = f"{FAKE_CODEX} app-server --script {script}"
    killed, spared = (started("serve", "--port", "0", "--app-server", command) for _ in "ab")
    for bridge in (killed, spared):
        session = bridge.post("/v1/sessions")["sessionId"]
        answer = bridge.post(f"/v1/sessions/{session}/call/x/child", {"params": {}})
        assert answer == {"result": {}}
    left, kept = settled(killed, 2), settled(spared, 2)
    waited = [*processes(left), watchdog_of(killed.pid)]
    os.kill(killed.pid, signal.SIGKILL)
    killed.process.wait(WAIT)
    all_gone(waited)
    assert not killed.marked()
    assert spared.marked() == kept
    assert spared.post("/v1/sessions")["sessionId"]


def test_a_process_that_calls_itself_a_watchdog_still_dies_with_the_bridge(started, write_script):
    """The label in a watchdog's environment is no disguise: a process that sets it, and
    what that process starts, die with the bridge like any other; only a process running
    the watchdog itself is spared."""
    disguised = ["env", f"{watchdog.VARIABLE}={watchdog.LABEL}", "sh", "-c"]
    script = write_script(
        {
            "methods": {
                "x/disguised": {
                    "steps": [
                        {"spawnChild": {"command": [*disguised, "sleep 1004 & exec sleep 1005"]}}
                    ],
                    "result": {},
                }
            }
        }
    )
    bridge = started(
        "serve", "--port", "0", "--app-server", f"{FAKE_CODEX} app-server --script {script}"
    )
    session = bridge.post("/v1/sessions")["sessionId"]
    assert bridge.post(f"/v1/sessions/{session}/call/x/disguised", {"params": {}}) == {"result": {}}
    left = settled(bridge, 3)  # the app-server, `sleep 1005` (was sh) and `sleep 1004`
    waited = [*processes(left), watchdog_of(bridge.pid)]
    os.kill(bridge.pid, signal.SIGKILL)
    assert bridge.process.wait(WAIT) == -signal.SIGKILL
    all_gone(waited)
    assert not bridge.marked()


def test_the_watchdog_keeps_a_bounded_record_of_its_pipe(tmp_path):
    """Whoever writes to its pipe (a process of the bridge's user can, through /proc), the
    watchdog keeps the mark, at most MAX_FOLDERS folders, and no record past MAX_RECORD."""
    folders = []
    for index in range(watchdog.MAX_FOLDERS + 10):
        folder = tmp_path / f"{watchdog.FOLDER_PREFIX}{index}"
        folder.mkdir()
        folders.append(os.fsencode(folder))
    flood = b"x" * (watchdog.MAX_RECORD * 64)
    records = b"\0".join([b"the-mark", *folders, flood, flood]) + b"\0"
    listener = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, bridge.watchdog as w;"
            "mark, folders = w.listen(int(sys.argv[1]));"
            "print(mark.decode(), len(folders))",
            str(os.getpid()),  # its parent: the pipe's end, not the parent's, ends it
        ],
        input=records,
        capture_output=True,
        timeout=WAIT,
        check=True,
    )
    assert listener.stdout.decode().split() == ["the-mark", str(watchdog.MAX_FOLDERS)]


def test_the_watchdogs_line_is_json_when_the_bridges_log_is(started):
    """With `--log-format json` the watchdog's one line is a JSON object like the bridge's
    own lines (found by today's re-test: it was plain text among them)."""
    bridge = started(
        *("serve", "--port", "0", "--log-format", "json", "--app-server-mode", "shared"),
        *("--app-server", f"{FAKE_CODEX} app-server"),
    )
    bridge.post("/v1/sessions")
    waited = [*processes(bridge.marked()), watchdog_of(bridge.pid)]
    os.kill(bridge.pid, signal.SIGKILL)
    bridge.process.wait(WAIT)
    all_gone(waited)
    said = [
        json.loads(line)
        for line in bridge.stderr.read_text().splitlines()
        if '"bridge.watchdog"' in line
    ]
    assert len(said) == 1, bridge.stderr.read_text()
    assert said[0]["event"] == "watchdog_cleanup"
    assert said[0]["processesKilled"] >= 1
    assert said[0]["foldersRemoved"] == 1
    assert said[0]["level"] == "WARNING"
