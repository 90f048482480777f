"""Replicas behind real nginx: `rest-bridge cluster` with three replicas on fake-codex.

Every route through the front (SSE resumed with Last-Event-ID, long-poll, replies to
server requests), creation spread over the replicas, the listing of every replica's
sessions, a replica killed (its sessions get 503 `replica_unavailable` as JSON, its
app-servers die with it, the others serve on) and a replica drained (no new work,
its sessions served to their end, then it exits).

nginx is Debian's package (`make cluster` installs it when missing); without it these
tests skip, unless `CI=true`, where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from cli_runs import main_here
from processes import (
    marked_processes,
    nginx_binary,
    quiet_pytest,
    storm_of_sigterm_after_sigint,
    zombie_children,
)

from bridge.app import mounted_routes, trusted_bridge_app
from bridge.openapi import build_openapi
from bridge_ops.cluster import CLUSTER_MARK_VARIABLE
from bridge_ops.front import POOLS, URI_TOO_LONG
from scenarios.openapi_check import OpenApiChecker
from scenarios.sse import SseReader

pytestmark = pytest.mark.asyncio

THEME = "Replicas behind nginx"
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
MARK_VARIABLE = "RELIABILITY_MARK"
REPLICAS = 3
START_SECONDS = 90.0

APPROVAL_SCRIPT = {
    "turns": [
        {"steps": [{"commandApproval": {"command": "touch marker"}}, {"agentMessage": "done"}]}
    ]
}


class ClusterProcess:
    """`rest-bridge cluster` as a child process: the front, the replicas, the output."""

    def __init__(
        self,
        directory: Path,
        env: dict[str, str] | None = None,
        app_server: str = "",
        nginx: str = "",
        until: str = "rest-bridge cluster: ready",
        args: tuple[str, ...] = (),
    ) -> None:
        self.mark = uuid.uuid4().hex
        self.directory = directory
        environment = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
        environment.update(env or {})
        environment[MARK_VARIABLE] = self.mark
        argv = [
            REST_BRIDGE,
            "cluster",
            *("--replicas", str(REPLICAS), "--port", "0", "--id-prefix", "bridge"),
            *("--nginx", nginx or nginx_binary(), "--dir", str(directory)),
            *("--app-server", app_server or f"{FAKE_CODEX} app-server"),
            *args,
        ]
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._seen = threading.Condition(self._lock)
        self.process = subprocess.Popen(
            argv,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, as in a terminal
        )
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.wait_for_line(until, START_SECONDS)
        self.replicas: dict[str, dict[str, Any]] = {}
        self.front = ""
        self.nginx_pid = 0
        for line in self.output_lines():
            words = line.split()
            if line.startswith("rest-bridge cluster: replica ") and "mark" in words:
                self.replicas[words[3]] = {
                    "url": words[4],
                    "pid": int(words[6]),
                    "mark": words[8],
                }
            elif line.startswith("rest-bridge cluster: front "):
                self.front = words[3]
                self.nginx_pid = int(words[5])

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()
        with self._seen:
            self.lines.append("<eof>")
            self._seen.notify_all()

    def output_lines(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def wait_for_line(self, text: str, timeout: float = 60.0, member: str = "") -> str:
        """The first output line containing ``text`` (waits on the reader, no polling);
        with ``member``, the first such line that member printed."""
        prefix = f"[{member}] " if member else ""

        def found() -> str | None:
            for line in self.lines:
                if text in line and line.startswith(prefix):
                    return line
            return "<eof>" if self.lines[-1:] == ["<eof>"] else None

        with self._seen:
            if not self._seen.wait_for(lambda: found() is not None, timeout):
                raise AssertionError(f"no line with {text!r} in {timeout} s: {self.lines[-20:]}")
            line = found()
        assert line is not None
        if line == "<eof>":
            raise AssertionError(f"the cluster ended before {text!r}: {self.lines[-30:]}")
        return line

    async def line(self, text: str, timeout: float = 60.0, member: str = "") -> str:
        return await asyncio.to_thread(self.wait_for_line, text, timeout, member)

    def processes(self) -> set[int]:
        """Every process the cluster runs (its launcher excluded)."""
        return marked_processes(MARK_VARIABLE, self.mark) - {self.process.pid}

    def replica_processes(self, name: str) -> set[int]:
        """The replica and everything it started (its app-servers)."""
        return marked_processes(CLUSTER_MARK_VARIABLE, self.replicas[name]["mark"])

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._reader.join(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        left = self.processes()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(left)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterProcess]:
    started = ClusterProcess(tmp_path / "front")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def steady_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterProcess]:
    """One cluster for the tests that leave it as they found it (every replica up, no
    session of theirs left): started once for them, not once per test."""
    started = ClusterProcess(tmp_path_factory.mktemp("steady") / "front")
    yield started
    started.stop()


#: The tests on `steady_cluster` run on one xdist worker, so that it starts once.
STEADY = pytest.mark.xdist_group("cluster-steady")


@pytest_asyncio.fixture
async def steady(
    steady_cluster: ClusterProcess, http: aiohttp.ClientSession
) -> AsyncIterator[ClusterProcess]:
    """The module's steady cluster, holding no session when the test starts; whatever
    session the test leaves (one that failed midway, say) is deleted after it."""
    front = steady_cluster.front
    status, listed, _ = await request(http, "GET", f"{front}/v1/sessions")
    assert (status, listed["sessions"], listed["unavailableReplicas"]) == (200, [], [])
    yield steady_cluster
    status, listed, _ = await request(http, "GET", f"{front}/v1/sessions")
    for summary in listed["sessions"]:
        await request(http, "DELETE", f"{front}/v1/sessions/{summary['sessionId']}")


@pytest.fixture
def lingering_cluster(tmp_path: Path) -> Iterator[ClusterProcess]:
    """App-servers that leave a process behind which outlives them unless killed."""
    command = f"sh -c 'sleep 600 & exec {FAKE_CODEX} app-server'"
    started = ClusterProcess(tmp_path / "front", app_server=command)
    yield started
    started.stop()


@pytest.fixture
def front_checker(contract_checkers: dict[str, OpenApiChecker]) -> Any:
    """Check every response from the front against the replicas' own OpenAPI document."""

    def register(front: str) -> None:
        app = trusted_bridge_app([FAKE_CODEX, "app-server"])
        contract_checkers[front] = OpenApiChecker(build_openapi(mounted_routes(app)))

    return register


async def request(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None, **kwargs: Any
) -> tuple[int, Any, Any]:
    async with http.request(method, url, json=body, **kwargs) as response:
        raw = await response.read()
        payload = await response.json(content_type=None) if raw else None
        return response.status, payload, response.headers


async def sessions_on_every_replica(
    http: aiohttp.ClientSession, front: str
) -> dict[str, list[str]]:
    """Sessions created through the front until every replica holds one, by replica."""
    by_replica: dict[str, list[str]] = {}
    while len(by_replica) < REPLICAS:
        status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
        assert status == 201, created
        session_id = created["sessionId"]
        by_replica.setdefault(session_id.split(".", 1)[0], []).append(session_id)
    return by_replica


async def served_through(
    http: aiohttp.ClientSession, front: str, session_ids: Iterable[str]
) -> None:
    """Each of these sessions answers a call through the front."""
    for session_id in session_ids:
        url = f"{front}/v1/sessions/{session_id}/call/thread/start"
        status, body, _ = await request(http, "POST", url, {"params": {}})
        assert status == 200, body


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def live_children_of(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


def script_body(write_script: Any, script: dict[str, Any]) -> dict[str, Any]:
    return {"options": {"env": {"FAKE_CODEX_SCRIPT": write_script(script)}}}


async def events_until(http, session: str, method: str) -> list[dict[str, Any]]:
    seen = []
    while True:
        status, event, _ = await request(http, "GET", f"{session}/events?waitMs=30000")
        assert status == 200, (status, event)
        seen.append(event)
        if event["method"] == method or event["kind"] == "exit":
            return seen


async def start_turn(http, session: str) -> None:
    status, started, _ = await request(http, "POST", f"{session}/call/thread/start", {"params": {}})
    assert status == 200, started
    thread = started["result"]["thread"]["id"]
    params = {"threadId": thread, "input": [{"type": "text", "text": "hello"}]}
    status, turn, _ = await request(http, "POST", f"{session}/call/turn/start", {"params": params})
    assert status == 200, turn


# -- every route -------------------------------------------------------------------------


@STEADY
async def test_every_route_through_the_front(steady, http, front_checker, report, write_script):
    """Every route of the trusted preset through nginx, checked against the OpenAPI document"""
    front = steady.front
    front_checker(front)
    for path in ("/health", "/v1/health", "/v1/compatibility", "/v1/openapi.json"):
        status, body, _ = await request(http, "GET", f"{front}{path}")
        assert status == 200, (path, body)
    status, body, _ = await request(http, "POST", f"{front}/v1/call/thread/start", {"params": {}})
    assert status == 200, body
    status, body, _ = await request(http, "POST", f"{front}/v1/text-turn", {"text": "hello"})
    assert status == 200, body
    assert body["status"] == "completed"

    status, created, _ = await request(
        http, "POST", f"{front}/v1/sessions", script_body(write_script, APPROVAL_SCRIPT)
    )
    assert status == 201, created
    session_id = created["sessionId"]
    replica = session_id.split(".", 1)[0]
    assert replica in steady.replicas
    session = f"{front}/v1/sessions/{session_id}"
    await start_turn(http, session)

    # Long-poll to the server's request, then the reply through the front.
    seen = await events_until(http, session, "item/commandExecution/requestApproval")
    approval = seen[-1]
    assert approval["kind"] == "request"
    reply = f"{session}/requests/{approval['requestKey']}/result"
    status, body, _ = await request(http, "POST", reply, {"result": {"decision": "accept"}})
    assert status == 200, body
    status, body, _ = await request(http, "POST", reply, {"result": {"decision": "accept"}})
    assert (status, body["error"]) == (409, "request_already_answered")
    rest = await events_until(http, session, "turn/completed")
    last = rest[-1]["seq"]

    # SSE from the start: three frames, then resumed with Last-Event-ID to the end.
    async with http.get(f"{session}/events/stream?after=0") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        first = await SseReader(response).collect(3, timeout=30)
    assert [int(f.id) for f in first] == [1, 2, 3]
    headers = {"Last-Event-ID": first[-1].id}
    async with http.get(f"{session}/events/stream", headers=headers) as response:
        assert response.status == 200
        resumed = await SseReader(response).collect(last - 3, timeout=30)
    assert [int(f.id) for f in resumed] == list(range(4, last + 1))
    status, body, _ = await request(http, "GET", f"{session}/events?after={last}&waitMs=0")
    assert status == 204

    status, listed, _ = await request(http, "GET", f"{front}/v1/sessions")
    assert status == 200
    assert [s["sessionId"] for s in listed["sessions"]] == [session_id]
    assert listed["unavailableReplicas"] == []

    status, body, _ = await request(http, "DELETE", session)
    assert (status, body) == (200, {"status": "deleted", "sessionId": session_id})
    status, body, _ = await request(http, "DELETE", session)
    assert (status, body["error"]) == (404, "session_not_found")
    # An id that names no replica of the front, and errors nginx itself answers: JSON.
    status, body, _ = await request(http, "GET", f"{front}/v1/sessions/elsewhere.x/events")
    assert (status, body["error"]) == (404, "session_not_found")
    huge = {"params": {"blob": "x" * (1_048_576 + 10)}}
    status, body, _ = await request(http, "POST", f"{front}/v1/call/thread/start", huge)
    assert (status, body["error"]) == (413, "payload_too_large")
    report.outcome = (
        "health, compatibility, OpenAPI, sessionless call, text turn, create, long-poll, "
        "reply (twice: 409), SSE resumed with Last-Event-ID, listing, delete: all through "
        "nginx, every answer as the OpenAPI document says"
    )
    report.survived = steady.process.poll() is None
    report.nothing_lost = True
    report.figures.update({"replicas": REPLICAS, "events": last})


@STEADY
async def test_creation_is_spread_over_the_replicas(steady, http, report):
    """Twelve sessions created through the front, six of them at once"""
    front = steady.front
    ids = []
    for _ in range(6):
        status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
        assert status == 201, created
        ids.append(created["sessionId"])
    answers = await asyncio.gather(
        *(request(http, "POST", f"{front}/v1/sessions") for _ in range(6))
    )
    for status, created, _ in answers:
        assert status == 201, created
        ids.append(created["sessionId"])
    spread = Counter(i.split(".", 1)[0] for i in ids)
    assert set(spread) == set(steady.replicas), spread
    status, listed, _ = await request(http, "GET", f"{front}/v1/sessions")
    assert status == 200
    assert sorted(s["sessionId"] for s in listed["sessions"]) == sorted(ids)
    assert listed["unavailableReplicas"] == []
    # Each replica alone knows only its own; asked as a peer, it answers for itself.
    for name, replica in steady.replicas.items():
        status, own, _ = await request(
            http,
            "GET",
            f"{replica['url']}/v1/sessions",
            headers={"X-Rest-Bridge-Peer-Query": "1"},
        )
        assert status == 200
        assert sorted(s["sessionId"] for s in own["sessions"]) == sorted(
            i for i in ids if i.startswith(name + ".")
        )
    report.outcome = f"sessions per replica: {dict(sorted(spread.items()))}; listed: all 12"
    report.survived = True
    report.nothing_lost = True
    report.figures.update(dict(sorted(spread.items())))


@STEADY
async def test_bodies_and_answers_of_any_allowed_size_pass_the_front(steady, http):
    """nginx keeps neither in a temporary file: its workers (nobody, under a root master)
    could not write one in the cluster's private directory, and a 100 KB body was a 500."""
    front = steady.front
    status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
    assert status == 201, created
    session = created["sessionId"]
    for size in (100_000, 900_000):
        text = "x" * size
        body = {"params": {"threadId": "no-such-thread", "input": [{"type": "text", "text": text}]}}
        status, answer, _ = await request(
            http, "POST", f"{front}/v1/sessions/{session}/call/turn/start", body
        )
        # fake-codex's own answer for a thread it does not know: the body reached it.
        assert status == 502, (size, answer)
        assert answer["error"] == "app_server_error", (size, answer)
    status, _, _ = await request(http, "DELETE", f"{front}/v1/sessions/{session}")
    assert status == 200


async def test_a_killed_replica(lingering_cluster, http, report, eventually):
    """SIGKILL to one replica holding sessions (each app-server with a child of its own)"""
    cluster = lingering_cluster
    front = cluster.front
    by_replica: dict[str, list[str]] = {}
    for _ in range(3 * REPLICAS):
        status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
        assert status == 201, created
        session_id = created["sessionId"]
        by_replica.setdefault(session_id.split(".", 1)[0], []).append(session_id)
    victim = "bridge-1"
    assert by_replica.get(victim), by_replica
    doomed = cluster.replica_processes(victim)
    pid = cluster.replicas[victim]["pid"]
    assert pid in doomed
    # The replica, and for each session its app-server and the `sleep` that app-server
    # started, which nothing but the mark would stop once the replica is gone.
    assert len(doomed) >= 1 + 2 * len(by_replica[victim])
    os.kill(pid, signal.SIGKILL)
    line = await cluster.line(f"replica {victim} exited")
    assert "signal 9" in line
    # Everything it started died with it, and nothing is left unreaped.
    assert cluster.replica_processes(victim) == set()
    await eventually(lambda: not zombie_children(cluster.process.pid), what="zombies")

    for session_id in by_replica[victim]:
        status, body, headers = await request(
            http, "POST", f"{front}/v1/sessions/{session_id}/call/thread/start", {"params": {}}
        )
        assert status == 503, body
        assert body["error"] == "replica_unavailable"
        assert headers["Content-Type"].startswith("application/json")
        assert headers["Retry-After"] == "1"
        status, body, _ = await request(
            http, "GET", f"{front}/v1/sessions/{session_id}/events/stream"
        )
        assert (status, body["error"]) == (503, "replica_unavailable")
    survivors = [s for name, ids in by_replica.items() if name != victim for s in ids]
    await served_through(http, front, survivors)
    for _ in range(2 * REPLICAS):
        status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
        assert status == 201, created
        assert not created["sessionId"].startswith(victim + ".")
    status, listed, _ = await request(http, "GET", f"{front}/v1/sessions")
    assert status == 200
    assert listed["unavailableReplicas"] == [victim]
    assert not any(s["sessionId"].startswith(victim + ".") for s in listed["sessions"])
    report.outcome = (
        f"{len(by_replica[victim])} sessions of {victim}: 503 replica_unavailable (JSON, "
        f"Retry-After); its {len(doomed) - 1} app-servers and their children died with it; "
        f"{len(survivors)} others served on; 6 new sessions on the others; listing names it"
    )
    report.survived = cluster.process.poll() is None
    report.nothing_lost = True
    report.no_leak = cluster.replica_processes(victim) == set()
    report.figures.update({"killed_app_servers": len(doomed) - 1, "survivors": len(survivors)})


async def test_a_drained_replica(cluster, http, report):
    """SIGUSR1 to one replica holding a session with an open stream"""
    front = cluster.front
    held: dict[str, str] = {}
    while len(held) < REPLICAS:
        status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
        assert status == 201, created
        held.setdefault(created["sessionId"].split(".", 1)[0], created["sessionId"])
    victim = "bridge-0"
    replica = cluster.replicas[victim]
    session = f"{front}/v1/sessions/{held[victim]}"
    os.kill(replica["pid"], signal.SIGUSR1)
    await cluster.line("draining: no new work; sessions left: 1", member=victim)

    # No new work on it, asked directly: 503 replica_unavailable with Retry-After.
    for method, path, body in (
        ("POST", "/v1/sessions", {}),
        ("POST", "/v1/call/thread/start", {"params": {}}),
        ("POST", "/v1/text-turn", {"text": "hello"}),
    ):
        status, answer, headers = await request(http, method, f"{replica['url']}{path}", body)
        assert (status, answer["error"]) == (503, "replica_unavailable"), (path, answer)
        assert headers["Retry-After"] == "1"
    # Through the front, new work goes elsewhere and never fails.
    for _ in range(2 * REPLICAS):
        status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
        assert status == 201, created
        assert not created["sessionId"].startswith(victim + ".")
        status, answer, _ = await request(
            http, "POST", f"{front}/v1/call/thread/start", {"params": {}}
        )
        assert status == 200, answer
    # Its session is served on: calls, and a stream that ends with the exit event.
    status, answer, _ = await request(http, "POST", f"{session}/call/thread/start", {"params": {}})
    assert status == 200, answer
    assert cluster.process.poll() is None
    async with http.get(f"{session}/events/stream?after=0") as response:
        assert response.status == 200
        reader = SseReader(response)
        await reader.collect(1, timeout=30)
        status, answer, _ = await request(http, "DELETE", session)
        assert status == 200, answer
        frames = []
        while True:
            frame = await reader.next(timeout=30)
            assert frame is not None
            frames.append(frame)
            if frame.event == "exit":
                break
    line = await cluster.line(f"replica {victim} exited")
    assert "status 0" in line
    assert cluster.replica_processes(victim) == set()
    assert any(
        x.startswith(f"[{victim}] ") and "drained; sessions left: 0" in x
        for x in cluster.output_lines()
    )
    status, answer, _ = await request(http, "POST", f"{session}/call/thread/start", {"params": {}})
    assert (status, answer["error"]) == (503, "replica_unavailable")
    await served_through(http, front, [s for name, s in held.items() if name != victim])
    report.outcome = (
        "draining: 503 replica_unavailable for new sessions, calls and text turns asked "
        "directly; through the front all went elsewhere; its session was served to its "
        "exit event; then it exited 0 and the others served on"
    )
    report.survived = True
    report.nothing_lost = True
    report.no_leak = cluster.replica_processes(victim) == set()


async def test_the_cluster_stops_on_sigint_and_leaves_nothing(cluster, http, report):
    """SIGINT to `rest-bridge cluster` with sessions on every replica"""
    for _ in range(REPLICAS):
        status, created, _ = await request(http, "POST", f"{cluster.front}/v1/sessions")
        assert status == 201, created
    # nginx rewrites its environment (its process titles), so it carries no mark.
    running = cluster.processes()
    assert len(running) >= 2 * REPLICAS  # replicas and their app-servers
    nginx = [cluster.nginx_pid, *live_children_of(cluster.nginx_pid)]
    assert len(nginx) >= 2  # master and worker
    # Then SIGTERM without a pause, as an impatient operator or a supervisor would:
    # ignored from the first signal on, it neither kills nor hangs the launcher.
    code = await asyncio.to_thread(storm_of_sigterm_after_sigint, cluster.process)
    left = cluster.stop()
    assert code == 0, cluster.output_lines()
    assert left == 0
    assert not [pid for pid in nginx if alive(pid)]
    running |= set(nginx)
    lines = cluster.output_lines()
    assert "rest-bridge cluster: stopped" in lines
    assert not [line for line in lines if "Traceback" in line], lines
    report.outcome = f"{len(running)} processes stopped, exit 0, none left"
    report.survived = True
    report.no_leak = left == 0


LIBRARY = Path(__file__).resolve().parents[2] / "scenarios" / "library"
FRONT_TOKEN = "front-t0k3n"


#: With auth on, the scenarios written for a token run; with it off, those without one.
THROUGH_THE_FRONT = {
    "auth on": ({"REST_ADAPTER_TOKEN": FRONT_TOKEN}, {"auth-rejection", "auth-variants"}),
    "auth off": ({}, {"errors-client-mistakes"}),
}


@pytest.mark.parametrize("auth", list(THROUGH_THE_FRONT))
async def test_the_scenario_library_runs_against_the_front(tmp_path, report, auth):
    """The scenario library against the front (`rest-bridge scenarios run --target`)"""
    env, expected = THROUGH_THE_FRONT[auth]
    front = ClusterProcess(tmp_path / "front", env=env)
    try:
        done = await asyncio.to_thread(
            subprocess.run,
            [REST_BRIDGE, "scenarios", "run", str(LIBRARY), "--target", front.front, "-v"],
            env=quiet_pytest({**{k: v for k, v in os.environ.items() if k != "CI"}, **env}),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        left = front.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    passed = [line.split("::")[1].split()[0] for line in done.stdout.splitlines()
              if line.endswith("%]") and " PASSED " in line]  # fmt: skip
    # The scenarios that need no bridge of their own (auth, client mistakes) pass there.
    assert expected <= set(passed), done.stdout
    assert "not against a target: scripts the app-server" in done.stdout
    assert left == 0
    report.outcome = f"{len(passed)} scenarios passed through nginx, the others skipped"
    report.survived = True
    report.no_leak = left == 0


async def test_full_replicas_are_passed_over(tmp_path, http, report):
    """MAX_SESSIONS=1 on each of three replicas, two of them full"""
    cluster = ClusterProcess(tmp_path / "front", env={"REST_ADAPTER_MAX_SESSIONS": "1"})
    try:
        front = cluster.front
        free = "bridge-2"
        for name, replica in cluster.replicas.items():
            if name != free:
                status, created, _ = await request(http, "POST", f"{replica['url']}/v1/sessions")
                assert status == 201, created
        # Whichever replica nginx asks first, a full one's 429 is passed over: every
        # creation lands on the free one.
        for _ in range(2 * REPLICAS):
            status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
            assert status == 201, created
            assert created["sessionId"].startswith(free + "."), created
            url = f"{front}/v1/sessions/{created['sessionId']}"
            status, body, _ = await request(http, "DELETE", url)
            assert status == 200, body
        status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
        assert status == 201, created
        # All full: the last replica's 429, or, once the refusals have marked every
        # replica as failed for a moment (max_fails), 503 replica_unavailable.
        status, body, headers = await request(http, "POST", f"{front}/v1/sessions")
        assert (status, body["error"]) in (
            (429, "session_limit_reached"),
            (503, "replica_unavailable"),
        )
        assert headers["Retry-After"] == "1"
        # nginx's own refusals are the payload too: a request head too large for it.
        status, body, headers = await request(
            http, "GET", f"{front}/health", headers={"X-Big": "x" * 20_000}
        )
        assert status == 431
        assert headers["Content-Type"].startswith("application/json")
        assert body["error"] == "headers_too_large"
        status, body, headers = await request(http, "GET", f"{front}/health?q={'a' * 10_000}")
        assert (status, body["error"]) == (414, "uri_too_long")
        assert headers["Content-Type"].startswith("application/json")
        # Where nginx sends its 414 is internal: asked for, it is a JSON 404.
        status, body, _ = await request(http, "GET", f"{front}{URI_TOO_LONG}")
        assert (status, body["error"]) == (404, "not_found")
        report.outcome = (
            "2 of 3 replicas full: 6 creations in a row all on the free one (429s passed "
            "over); all full: 429 session_limit_reached or 503 replica_unavailable; a 20 kB "
            "header: 431 headers_too_large, a 10 kB URL: 414 uri_too_long, both JSON"
        )
        report.survived = cluster.process.poll() is None
        report.nothing_lost = True
    finally:
        assert cluster.stop() == 0


async def test_the_cluster_stops_when_no_replica_is_left(cluster, http, report):
    """One replica drained (SIGUSR1), then the two others SIGKILLed"""
    front = cluster.front
    nginx = [cluster.nginx_pid, *live_children_of(cluster.nginx_pid)]
    assert len(nginx) >= 2  # master and worker
    # A replica that exits while others live: its line says how many are left, and
    # the cluster serves on.
    os.kill(cluster.replicas["bridge-0"]["pid"], signal.SIGUSR1)
    line = await cluster.line("replica bridge-0 exited")
    assert line.endswith("exited (status 0); 2 of 3 left"), line
    os.kill(cluster.replicas["bridge-1"]["pid"], signal.SIGKILL)
    line = await cluster.line("replica bridge-1 exited")
    assert "(signal 9)" in line, line
    assert line.endswith("; 1 of 3 left"), line
    for _ in range(REPLICAS):
        status, body, _ = await request(http, "GET", f"{front}/health")
        assert status == 200, body
    status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
    assert status == 201, created
    assert created["sessionId"].startswith("bridge-2."), created
    assert cluster.process.poll() is None
    # The last one: nothing can be served any more; the launcher says so, stops nginx,
    # and exits 1 (a supervisor restarts it), leaving nothing behind.
    os.kill(cluster.replicas["bridge-2"]["pid"], signal.SIGKILL)
    line = await cluster.line("replica bridge-2 exited")
    assert line.endswith("; 0 of 3 left"), line
    await cluster.line("rest-bridge cluster: no replica left: stopping")
    code = await asyncio.to_thread(cluster.process.wait, 60)
    assert code == 1
    lines = cluster.output_lines()
    assert "rest-bridge cluster: nginx exited (status 0)" in lines
    assert "rest-bridge cluster: stopped (no replica left): exit status 1" in lines
    # Gone, not zombies (a zombie still takes signal 0): every one was reaped.
    assert not [pid for pid in nginx if alive(pid)]
    assert not [r["pid"] for r in cluster.replicas.values() if alive(r["pid"])]
    assert cluster.stop() == 0  # nothing of the cluster left to kill
    for name in cluster.replicas:
        assert cluster.replica_processes(name) == set()
    with pytest.raises(aiohttp.ClientConnectionError):
        await request(http, "GET", f"{front}/health")
    report.outcome = (
        "drained, killed, killed: '2 of 3 left', '1 of 3 left' (still serving), then "
        "'no replica left: stopping', nginx stopped, exit 1, no process left"
    )
    report.survived = True
    report.no_leak = True


async def test_the_cluster_stops_when_nginx_dies(cluster, http, report):
    """SIGKILL to the front's nginx master (and its worker)"""
    nginx = [cluster.nginx_pid, *live_children_of(cluster.nginx_pid)]
    status, created, _ = await request(http, "POST", f"{cluster.front}/v1/sessions")
    assert status == 201, created
    for pid in nginx:
        os.kill(pid, signal.SIGKILL)
    await cluster.line("rest-bridge cluster: nginx exited (signal 9)")
    await cluster.line("rest-bridge cluster: nginx exited: stopping")
    code = await asyncio.to_thread(cluster.process.wait, 60)
    assert code == 1
    lines = cluster.output_lines()
    assert "rest-bridge cluster: stopped (nginx exited): exit status 1" in lines
    for name in cluster.replicas:
        assert any(x.startswith(f"rest-bridge cluster: replica {name} exited") for x in lines)
        assert cluster.replica_processes(name) == set()
    assert cluster.stop() == 0
    report.outcome = "nginx killed: 'nginx exited: stopping', replicas stopped, exit 1"
    report.survived = True
    report.no_leak = True


READS = ("/health", "/v1/health", "/v1/compatibility", "/v1/openapi.json", "/v1/sessions")


async def test_reads_are_never_refused_because_a_create_was(tmp_path, http, report):
    """MAX_SESSIONS=1 on each of three replicas, all full, a creation refused"""
    cluster = ClusterProcess(tmp_path / "front", env={"REST_ADAPTER_MAX_SESSIONS": "1"})
    try:
        front = cluster.front
        held = []
        for replica in cluster.replicas.values():
            status, created, _ = await request(http, "POST", f"{replica['url']}/v1/sessions")
            assert status == 201, created
            held.append(created["sessionId"])
        # Every replica refuses (429): nginx passes the creation over each, and the
        # refusals mark every replica as failed for creations, for a moment.
        for _ in range(2):
            status, body, _ = await request(http, "POST", f"{front}/v1/sessions")
            assert (status, body["error"]) in (
                (429, "session_limit_reached"),
                (503, "replica_unavailable"),
            )
        # At once, and each several times (so that every replica is asked): every read
        # is answered by a replica, as if no creation had been refused.
        for _ in range(REPLICAS):
            for path in READS:
                status, body, headers = await request(http, "GET", f"{front}{path}")
                assert status == 200, (path, body)
                assert "Retry-After" not in headers
        status, listed, _ = await request(http, "GET", f"{front}/v1/sessions")
        assert sorted(s["sessionId"] for s in listed["sessions"]) == sorted(held)
        assert listed["unavailableReplicas"] == []
        # A sessionless call counts as held by a replica, so full replicas refuse it
        # too; but a replica's own 429 answers it, not the front's 503: a refused
        # creation does not mark the replicas for sessionless calls.
        status, body, _ = await request(
            http, "POST", f"{front}/v1/call/thread/start", {"params": {}}
        )
        assert (status, body["error"]) == (429, "session_limit_reached"), body
        # The sessions held are served as ever.
        await served_through(http, front, held)
        report.outcome = (
            "3 replicas full, creations refused (429 or 503); at once health, compatibility, "
            "OpenAPI and the listing answered 200 three times each; a sessionless call got the "
            "replicas' own 429"
        )
        report.survived = cluster.process.poll() is None
        report.nothing_lost = True
    finally:
        assert cluster.stop() == 0


async def test_a_front_port_already_taken(tmp_path, report):
    """`rest-bridge cluster --port P` with P held by another program"""
    mark = uuid.uuid4().hex
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = await asyncio.to_thread(
            subprocess.run,
            [
                REST_BRIDGE,
                "cluster",
                *("--replicas", "1", "--port", str(port), "--dir", str(tmp_path / "front")),
                *("--nginx", nginx_binary(), "--app-server", f"{FAKE_CODEX} app-server"),
            ],
            env={**os.environ, MARK_VARIABLE: mark},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=START_SECONDS * 3,
        )
    # The port answers, but not as nginx: the launcher does not take it for its front.
    # (The launcher's log is on stderr, as serve's.)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-2000:]
    assert "rest-bridge cluster: ready" not in said
    # Another attempt could only find the same port taken: one is enough.
    assert "could not start (attempt 1 of 3)" in said
    assert "attempt 2" not in said
    left = marked_processes(MARK_VARIABLE, mark)
    assert not left
    report.outcome = "one attempt, stopped cleanly; exit 1, never 'ready'; nothing left"
    report.survived = True
    report.no_leak = not left


async def test_ctrl_c_while_the_cluster_is_starting(tmp_path, report):
    """Ctrl-C to `rest-bridge cluster` while it starts: the replicas up, the front not yet"""
    # A front that starts and never answers: the launcher waits for it to.
    silent = tmp_path / "silent-nginx"
    silent.write_text("#!/bin/sh\necho 'silent front up'\nexec sleep 600\n")
    silent.chmod(0o755)
    cluster = ClusterProcess(tmp_path / "front", nginx=str(silent), until="silent front up")
    try:
        assert "rest-bridge cluster: ready" not in cluster.output_lines()
        # As a terminal's Ctrl-C: SIGINT to the whole process group.
        os.killpg(cluster.process.pid, signal.SIGINT)
        code = await asyncio.to_thread(cluster.process.wait, 60)
    finally:
        left = cluster.stop()
    lines = cluster.output_lines()
    assert code == 0, lines
    assert "rest-bridge cluster: stopped before it was ready" in lines
    assert not [line for line in lines if "could not start" in line], lines
    cut_short = [line for line in lines if ": replica " in line and "exited (signal" in line]
    assert not cut_short, lines  # the second signal (the launcher's) did not kill a replica
    assert left == 0
    report.outcome = "stopped at once, exit 0, every replica exited by itself, nothing left"
    report.survived = True
    report.no_leak = left == 0


# -- strangers -------------------------------------------------------------------------


#: A token with what could end a string, a pattern or a directive in nginx.conf.
SECRET = 's3cr3t "t0k3n" \';{$x}\\ (a|b)*'


async def raw_answer(url: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes to ``url``'s host; the status, headers (lower-case) and body of the
    one response (read by its Content-Length, or to the end of the connection)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
            while head.startswith(b"HTTP/1.1 100 "):  # nginx's interim answer: the next
                head = await reader.readuntil(b"\r\n\r\n")
            status_line, *lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in filter(None, lines):
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if data.startswith(b"HEAD "):  # the length of a body not sent
                body = b""
            elif "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            else:
                body = await reader.read()
    finally:
        writer.close()
    return int(status_line.split()[1]), headers, body


#: Requests nginx cannot or will not pass on, each with the status it answers.
ODD_REQUESTS = {
    "OPTIONS *": (b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "CONNECT": (b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n", 400),
    "a NUL byte in the path": (b"GET /v1/ses\x00sions HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "a lower-case method": (b"get /v1/sessions HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "%2e%2e above the root": (b"GET /%2e%2e/%2e%2e/etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "TRACE": (b"TRACE / HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    "Transfer-Encoding: gzip, chunked": (
        b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b"0\r\n\r\n",
        501,
    ),
    "HTTP/2.0 on the request line": (b"GET /v1/sessions HTTP/2.0\r\nHost: x\r\n\r\n", 505),
}


@pytest.mark.parametrize("given", ["variable", "file"])
async def test_strangers_learn_nothing_but_401_through_the_front(tmp_path, http, given):
    """Without the token, through the front: sessions of live, dead and unknown replicas,
    a 5 MB body, and requests nginx refuses itself"""
    env = {"REST_ADAPTER_TOKEN": SECRET}
    if given == "file":
        (tmp_path / "token").write_text(SECRET + "\n")
        env = {"REST_ADAPTER_TOKEN_FILE": str(tmp_path / "token")}
    cluster = ClusterProcess(tmp_path / "front", env=env)
    try:
        front = cluster.front
        token_map = tmp_path / "front" / "token-map.conf"
        assert token_map.stat().st_mode & 0o777 == 0o600
        assert SECRET not in (tmp_path / "front" / "nginx.conf").read_text()
        os.kill(cluster.replicas["bridge-2"]["pid"], signal.SIGKILL)
        await cluster.line("replica bridge-2 exited")
        # What a replica itself answers a stranger: the reference, byte for byte.
        replica = cluster.replicas["bridge-0"]["url"]
        reference = await raw_answer(replica, b"GET /v1/sessions HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reference[0] == 401, reference
        unknown_session = f"{uuid.uuid4()}"
        paths = [
            f"GET /v1/sessions/bridge-0.{unknown_session}/events",  # a live replica
            f"GET /v1/sessions/bridge-2.{unknown_session}/events",  # a dead one
            f"DELETE /v1/sessions/bridge-9.{unknown_session}",  # none
            "GET /v1/sessions/nodot",
            "GET /v1/sessions",
            "GET /v1/compatibility",
            "GET /v1/openapi.json",
            "POST /v1/call/thread/start",
            "GET /nowhere",
        ]
        wrong = [
            "",
            "Authorization: Bearer nope\r\n",
            "Authorization: Basic czNjcjN0\r\n",
            f"Authorization: Bearer {SECRET[:-1]}\r\n",  # a prefix of the token
            f"Authorization: Bearer {SECRET}x\r\n",
        ]
        answers = []
        for line in paths:
            for header in wrong:
                raw = f"{line} HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode()
                answers.append((line, header, await raw_answer(front, raw)))
        # A 5 MB body, announced: the 401, not a 413 that names the limit.
        big = b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n"
        answers.append(("POST /v1/sessions (5 MB)", "", await raw_answer(front, big)))
        for line, header, (status, headers, body) in answers:
            assert status == 401, (line, header, status, body)
            assert headers["www-authenticate"] == "Bearer", (line, header)
            assert headers["content-type"] == reference[1]["content-type"], (line, headers)
            assert body == reference[2], (line, header, body)

        # Health stays exempt, as on a replica; with the token, the front routes.
        status, body, _ = await request(http, "GET", f"{front}/health")
        assert (status, body["status"]) == (200, "ok")
        auth = {"Authorization": f"Bearer {SECRET}"}
        status, body, _ = await request(
            http, "GET", f"{front}/v1/sessions/bridge-2.{unknown_session}/events", headers=auth
        )
        assert (status, body["error"]) == (503, "replica_unavailable")
        status, created, _ = await request(http, "POST", f"{front}/v1/sessions", headers=auth)
        assert status == 201, created
        # Accepted the way a replica accepts it: the scheme in any case, spaces trimmed.
        status, body, _ = await request(
            http, "GET", f"{front}/v1/sessions", headers={"Authorization": f"bEARER   {SECRET}  "}
        )
        assert status == 200, body
        assert [s["sessionId"] for s in body["sessions"]] == [created["sessionId"]]

        # What nginx refuses itself is the error payload too, never its HTML.
        for name, (raw, expected) in ODD_REQUESTS.items():
            status, headers, body = await raw_answer(front, raw)
            assert status == expected, (name, status, body)
            assert headers["content-type"] == "application/json", (name, headers)
            payload = json.loads(body)
            assert set(payload) == {"error", "message"}, (name, payload)
            assert b"<html" not in body
        status, headers, body = await raw_answer(front, ODD_REQUESTS["TRACE"][0])
        assert headers["allow"] == "DELETE, GET, HEAD, POST"
        assert cluster.process.poll() is None
    finally:
        assert cluster.stop() == 0


#: What a stranger asked the front and learned something from it: the body limit (413
#: with limitBytes, even on the health paths, which need no token), the bound on a
#: request head (431), or that the front's internal pages exist (404).
PROBES = {
    "GET /health, a body over the limit": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n"
    ),
    "GET /v1/health, a body over the limit, Expect: 100-continue": (
        b"GET /v1/health HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Length: 999999999999\r\n\r\n"
    ),
    "HEAD /health, a body over the limit": (
        b"HEAD /health HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n"
    ),
    "GET /health, a wrong token and a body over the limit": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
        b"Content-Length: 999999999999\r\n\r\n"
    ),
    # Any body at all: a body under the limit passed and one over it refused would
    # tell the limit by bisection.
    "GET /health, a body of one byte": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx"
    ),
    "GET /health, an empty chunked body": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "GET /health, a chunked body over the limit": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"10000\r\n%s\r\n" % (b"a" * 0x10000) * 17
        + b"0\r\n\r\n"
    ),
    "GET /health, a head over MAX_HEADER_BYTES": (
        b"GET /health HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-Pad-%d: %s\r\n" % (n, b"a" * 8000) for n in range(6))
        + b"\r\n"
    ),
    **{
        f"GET {path}": b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode()
        for path in (
            *(f"/.front/{status}" for status in (400, 401, 404, 413, 414, 494, 500, 504)),
            "/.front//413",
            "/%2efront/413",
            "/.%66ront/404",
            "/.front/sessions",
            "/.front/999",
        )
    },
    "GET /.front/404, a body over the limit": (
        b"GET /.front/404 HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n"
    ),
    "POST /.front/413, a chunked body": (
        b"POST /.front/413 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
}


async def test_a_stranger_learns_no_limit_and_no_internal_page_through_the_front(tmp_path):
    """Without the token, through the front: a body over the limit or a head over its
    bound, even on the health paths, and the front's own internal pages, get the 401;
    with the token, the 413, the 431 and the 404, as before."""
    cluster = ClusterProcess(tmp_path / "front", env={"REST_ADAPTER_TOKEN": SECRET})
    try:
        front = cluster.front
        replica = cluster.replicas["bridge-0"]["url"]
        reference = await raw_answer(replica, b"GET /v1/sessions HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reference[0] == 401, reference
        for name, raw in PROBES.items():
            status, headers, body = await raw_answer(front, raw)
            assert status == 401, (name, status, body)
            assert headers["www-authenticate"] == "Bearer", (name, headers)
            assert headers["content-type"] == reference[1]["content-type"], (name, headers)
            if not raw.startswith(b"HEAD "):
                assert body == reference[2], (name, body)
        # A plain health check needs no token, as on a replica; nor does an empty body.
        for length in (b"", b"Content-Length: 0\r\n"):
            raw = b"GET /health HTTP/1.1\r\nHost: x\r\n%s\r\n" % length
            status, _, body = await raw_answer(front, raw)
            assert (status, json.loads(body)["status"]) == (200, "ok"), body
        # The token holder still learns the limits, and that no such route exists.
        auth = f"Authorization: Bearer {SECRET}\r\n".encode()
        over = b"GET /health HTTP/1.1\r\nHost: x\r\n" + auth
        status, _, body = await raw_answer(front, over + b"Content-Length: 999999999999\r\n\r\n")
        assert (status, json.loads(body)["data"]) == (413, {"limitBytes": 1048576}), body
        status, _, body = await raw_answer(front, over + b"Content-Length: 1\r\n\r\nx")
        assert (status, json.loads(body)["status"]) == (200, "ok"), body
        head = PROBES["GET /health, a head over MAX_HEADER_BYTES"].replace(b"Host: x\r\n", auth)
        status, _, body = await raw_answer(front, head)
        assert (status, json.loads(body)["error"]) == (431, "headers_too_large"), body
        for path in (b"/.front/413", b"/.front//401", b"/%2efront/404", b"/.front/sessions"):
            raw = b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path, auth)
            status, headers, body = await raw_answer(front, raw)
            assert (status, json.loads(body)["error"]) == (404, "not_found"), (path, body)
            assert headers["content-type"] == "application/json", (path, headers)
        # What nginx could not read still gets its own answer, never a 401.
        for name, (raw, expected) in ODD_REQUESTS.items():
            status, _, body = await raw_answer(front, raw)
            assert status == expected, (name, status, body)
        assert cluster.process.poll() is None
    finally:
        assert cluster.stop() == 0


# -- a hung replica --------------------------------------------------------------------


#: The launcher's probes that never mark a replica down within a test: nginx alone.
NO_PROBES = ("--probe-interval-ms", "60000", "--probe-misses", "100")


@pytest.fixture
def unprobed_cluster(tmp_path: Path) -> Iterator[ClusterProcess]:
    """A cluster whose launcher marks no replica down: nginx's own checks alone (as
    behind another front)."""
    started = ClusterProcess(tmp_path / "front", args=NO_PROBES)
    yield started
    started.stop()


async def test_a_stopped_replica_is_passed_over(unprobed_cluster, http):
    """SIGSTOP to one replica (alive, its kernel still accepting connections), nginx alone"""
    cluster = unprobed_cluster
    front = cluster.front
    by_replica = await sessions_on_every_replica(http, front)
    victim = "bridge-2"
    pid = cluster.replicas[victim]["pid"]
    asked = cluster.replicas["bridge-0"]["url"]
    os.kill(pid, signal.SIGSTOP)
    try:
        # The first listing waits for the stopped peer, up to the peers' timeout, and
        # names it; the next ones pass over it without asking.
        for _ in range(3):
            status, listed, _ = await request(http, "GET", f"{asked}/v1/sessions")
            assert status == 200, listed
            assert listed["unavailableReplicas"] == [victim]
            ids = {s["sessionId"] for s in listed["sessions"]}
            assert ids == {s for name, ss in by_replica.items() if name != victim for s in ss}
        # Reads through the front: a stopped replica costs one read a bounded wait,
        # then the others answer (it is passed over for reads, 30 s at a time).
        for _ in range(2 * REPLICAS):
            status, body, _ = await request(http, "GET", f"{front}/health")
            assert status == 200, body
        # The listing through the front is a read too, and names it.
        for _ in range(REPLICAS):
            status, listed, _ = await request(http, "GET", f"{front}/v1/sessions?x=1")
            assert status == 200, listed
            assert listed["unavailableReplicas"] == [victim]
    finally:
        os.kill(pid, signal.SIGCONT)
    # Once it answers again, the replica that asked lists it again: it says so once.
    await cluster.line(f"replica {victim} answers again", member="bridge-0")
    asked_about = [
        line
        for line in cluster.output_lines()
        if line.startswith("[bridge-0] ") and f"replica {victim} could not list" in line
    ]
    assert len(asked_about) == 1, asked_about  # asked once, then passed over
    assert "timed out" in asked_about[0]
    status, listed, _ = await request(http, "GET", f"{asked}/v1/sessions")
    assert status == 200, listed
    assert listed["unavailableReplicas"] == []
    assert {s["sessionId"] for s in listed["sessions"]} == {
        s for ss in by_replica.values() for s in ss
    }
    await served_through(http, front, by_replica[victim])
    timeouts = [line for line in cluster.output_lines() if "upstream timed out" in line]
    assert len(timeouts) <= 1, timeouts
    assert cluster.process.poll() is None


def server_lines(cluster: ClusterProcess) -> dict[str, list[str]]:
    """The ``server`` lines of the front's nginx.conf, by the replica they name."""
    lines = (cluster.directory / "nginx.conf").read_text().splitlines()
    servers: dict[str, list[str]] = {}
    for name, replica in cluster.replicas.items():
        address = replica["url"].removeprefix("http://")
        servers[name] = [x.strip() for x in lines if x.strip().startswith(f"server {address}")]
    return servers


async def test_a_stopped_replica_is_marked_down_at_the_front(cluster, http, report):
    """SIGSTOP to one replica: the launcher's health probes mark it down at the front
    (nginx reloaded), so work goes to the others and its sessions get 503 at once; a
    stream through the front on another replica lives through both reloads; after
    SIGCONT it is put back and used again."""
    front = cluster.front
    by_replica = await sessions_on_every_replica(http, front)
    victim, streamed = "bridge-2", "bridge-0"
    stream_session = f"{front}/v1/sessions/{by_replica[streamed][0]}"
    pid = cluster.replicas[victim]["pid"]
    unbounded = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with http.get(f"{stream_session}/events/stream", timeout=unbounded) as stream:
        assert stream.status == 200
        reader = SseReader(stream)
        os.kill(pid, signal.SIGSTOP)
        try:
            await cluster.line(f"rest-bridge cluster: replica {victim} missed")
            # Down in every pool and in its own upstream; no other replica is.
            servers = server_lines(cluster)
            assert len(servers[victim]) == len(POOLS) + 1
            assert all(line.endswith(" down;") for line in servers[victim]), servers
            others = [line for name, lines in servers.items() if name != victim for line in lines]
            assert not any(line.endswith(" down;") for line in others), others
            # Work goes to the others: each answer comes from a replica that runs (a
            # stopped one answers nothing), a creation names it.
            for _ in range(REPLICAS):
                status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
                assert status == 201, created
                assert created["sessionId"].split(".", 1)[0] != victim
                status, body, _ = await request(
                    http, "POST", f"{front}/v1/call/thread/start", {"params": {}}
                )
                assert status == 200, body
                status, body, _ = await request(
                    http, "POST", f"{front}/v1/text-turn", {"text": "hello"}
                )
                assert status == 200, body
                assert body["status"] == "completed"
            # Its sessions: 503 replica_unavailable at once, not the call's timeout.
            for session_id in by_replica[victim]:
                for path in ("/call/thread/start", "/events/stream", "/events"):
                    method = "POST" if path.startswith("/call") else "GET"
                    url = f"{front}/v1/sessions/{session_id}{path}"
                    status, body, headers = await request(http, method, url, {"params": {}})
                    assert (status, body["error"]) == (503, "replica_unavailable"), body
                    assert headers["Retry-After"] == "1"
            status, listed, _ = await request(http, "GET", f"{front}/v1/sessions")
            assert status == 200, listed
            assert listed["unavailableReplicas"] == [victim]
            # The stream on a healthy replica lived through the reload.
            await start_turn(http, stream_session)
            frames = await reader.until(
                lambda frame: frame.json().get("method") == "turn/completed", timeout=30
            )
            assert frames
        finally:
            os.kill(pid, signal.SIGCONT)
        await cluster.line(f"rest-bridge cluster: replica {victim} answers /health again")
        assert not any(
            line.endswith(" down;") for ls in server_lines(cluster).values() for line in ls
        )
        # Used again: its sessions answer, and creations reach it again.
        await served_through(http, front, by_replica[victim])
        placed: set[str] = set()
        for _ in range(4 * REPLICAS):
            status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
            assert status == 201, created
            placed.add(created["sessionId"].split(".", 1)[0])
            if victim in placed:
                break
        assert victim in placed
        # The stream lived through the second reload too.
        await start_turn(http, stream_session)
        frames = await reader.until(
            lambda frame: frame.json().get("method") == "turn/completed", timeout=30
        )
        assert frames
    lines = cluster.output_lines()
    assert sum(f"replica {victim} missed" in line for line in lines) == 1
    assert sum(f"replica {victim} answers /health again" in line for line in lines) == 1
    assert not any("did not take the new configuration" in line for line in lines)
    assert cluster.process.poll() is None
    report.outcome = (
        f"{victim} stopped: marked down after missed probes; creations, sessionless calls "
        "and text turns answered by the others, its sessions 503 at once; put back after "
        "SIGCONT and used again; an SSE stream on another replica lived through both reloads"
    )
    report.survived = cluster.process.poll() is None
    report.nothing_lost = True


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--probe-interval-ms", "0"),
        ("--probe-interval-ms", "99"),
        ("--probe-timeout-ms", "60001"),
        ("--probe-timeout-ms", "1e3"),
        ("--probe-misses", "0"),
        ("--probe-misses", "-1"),
        ("--probe-misses", "two"),
    ],
)
@pytest.mark.quick
async def test_the_probe_options_are_validated(tmp_path, monkeypatch, option, value):
    """A bad probe option stops the launcher with status 2 and names the option, before
    anything starts.

    Run by the CLI's own main in this process (tests/cli_runs.py): argparse refuses the
    option before the launcher runs; the tests above and below run the console script."""
    argv = ["cluster", "--port", "0", "--dir", str(tmp_path / "front"), f"{option}={value}"]
    done = main_here(argv, monkeypatch)
    out, err = done.stdout.encode(), done.stderr.encode()
    assert done.returncode == 2, (out, err)
    # argparse names the option it refused (not "unrecognized arguments").
    assert f"argument {option}: ".encode() in err, err
    assert b"Traceback" not in err
    assert not (tmp_path / "front").exists()


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--workers", "1;x", "workers '1;x'"),
        ("--host", "a;b", "not one word of nginx.conf"),
        ("--host", "::1", "--host '::1' (an IPv4 address or name)"),
    ],
)
async def test_the_front_options_are_validated(tmp_path, option, value, said):
    """A front option nginx could not take stops the launcher with status 2 and says
    why, before anything starts (no traceback)."""
    process = await asyncio.create_subprocess_exec(
        *(REST_BRIDGE, "cluster", "--port", "0", "--dir", str(tmp_path / "front")),
        *("--nginx", nginx_binary(), option, value),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 2, (out, err)
    assert err.startswith(b"rest-bridge cluster: "), err
    assert said.encode() in err, err
    assert b"Traceback" not in err
    assert not (tmp_path / "front").exists()


async def test_every_replica_stopped_is_a_503_at_once(cluster, http):
    """SIGSTOP to every replica: once the launcher marked them all down, the front
    answers everything with 503 replica_unavailable without waiting on any; after
    SIGCONT they are all put back."""
    front = cluster.front
    status, created, _ = await request(http, "POST", f"{front}/v1/sessions")
    assert status == 201, created
    pids = [replica["pid"] for replica in cluster.replicas.values()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        for name in cluster.replicas:
            await cluster.line(f"rest-bridge cluster: replica {name} missed")
        asked = [
            ("POST", "/v1/sessions", None),
            ("POST", "/v1/call/thread/start", {"params": {}}),
            ("POST", "/v1/text-turn", {"text": "hello"}),
            ("GET", "/health", None),
            ("GET", "/v1/sessions", None),
            ("POST", f"/v1/sessions/{created['sessionId']}/call/thread/start", {"params": {}}),
        ]
        for method, path, body in asked:
            status, answer, headers = await request(http, method, f"{front}{path}", body)
            assert (status, answer["error"]) == (503, "replica_unavailable"), (path, answer)
            assert headers["Retry-After"] == "1"
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    for name in cluster.replicas:
        await cluster.line(f"rest-bridge cluster: replica {name} answers /health again")
    await served_through(http, front, [created["sessionId"]])
    status, body, _ = await request(http, "POST", f"{front}/v1/text-turn", {"text": "hello"})
    assert status == 200, body
    assert cluster.process.poll() is None
