"""A real Prometheus scrapes a bridge and a `rest-bridge cluster` of three replicas.

Prometheus is Debian's package (`make prometheus` installs it when missing); without it
these tests skip, unless `CI=true`, where they fail. It runs on a free port with a
configuration and a storage directory of the test's own, scraping every second; the
test waits on Prometheus's targets API (every target up, a scrape after the test's
requests), never on time, then asks its query API what it must have seen.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from processes import prometheus_binary
from test_cluster import ClusterProcess
from test_dashboard import dashboard_queries

from scenarios.format import dump_yaml

REST_BRIDGE = Path(sys.executable).with_name("rest-bridge")

START_ATTEMPTS = 3
APPROVAL_SCRIPT = {
    "turns": [{"steps": [{"commandApproval": {"command": "true"}}, {"agentMessage": "done"}]}]
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Prometheus:
    """Prometheus as a child process, scraping ``jobs`` (name → host:port targets)."""

    def __init__(self, directory: Path, jobs: dict[str, list[str]]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]}
                for job, targets in jobs.items()
            ],
        }
        (directory / "prometheus.yml").write_text(dump_yaml(config))
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        """Started on a free port (chosen again if taken meanwhile), once it listens."""
        for _ in range(START_ATTEMPTS):
            port = free_port()
            log = (self.directory / "prometheus.log").open("wb")
            self.process = subprocess.Popen(
                [
                    prometheus_binary(),
                    f"--config.file={self.directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            self.url = f"http://127.0.0.1:{port}"
            if self._wait_listening(port):
                return
            self.stop()
        raise AssertionError(f"Prometheus did not start: {self.log()[-2000:]}")

    def _wait_listening(self, port: int) -> bool:
        """Its log says it listens (on our port), or it exited."""
        needle = re.compile(rf'msg="?Listening on"? address=127\.0\.0\.1:{port}')
        assert self.process is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if needle.search(self.log()):
                return True
            if self.process.poll() is not None:
                return False
            time.sleep(0.05)  # sync-ok: its log file has no event to wait on
        return False

    def log(self) -> str:
        return (self.directory / "prometheus.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    async def api(self, http: aiohttp.ClientSession, path: str, **params: str) -> Any:
        async with http.get(f"{self.url}/api/v1/{path}", params=params) as response:
            body = await response.json()
            assert body["status"] == "success", body
            return body["data"]

    async def query(self, http: aiohttp.ClientSession, expression: str) -> dict[str, float]:
        """An instant query: each series' value, by the series' labels as text."""
        data = await self.api(http, "query", query=expression)
        return {
            ",".join(f"{k}={v}" for k, v in sorted(item["metric"].items())): float(item["value"][1])
            for item in data["result"]
        }

    async def scraped_after(self, http: aiohttp.ClientSession, moment: float) -> None:
        """Every target is up and was scraped after ``moment`` (epoch seconds)."""
        deadline = time.monotonic() + 60
        while True:
            targets = (await self.api(http, "targets"))["activeTargets"]
            if targets and all(
                t["health"] == "up" and scrape_time(t["lastScrape"]) > moment for t in targets
            ):
                return
            assert time.monotonic() < deadline, f"targets never all up and scraped: {targets}"
            await asyncio.sleep(0.2)  # sync-ok: Prometheus's targets API has no push


def scrape_time(text: str) -> float:
    """An RFC 3339 time of Prometheus's (nanoseconds, a zone) in epoch seconds."""
    found = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", text)
    assert found, text
    zone = "+00:00" if found[3] == "Z" else found[3]
    base = datetime.fromisoformat(found[1] + zone).timestamp()
    return base + float("0" + (found[2] or ".0"))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterProcess]:
    started = ClusterProcess(tmp_path / "front", args=("--ops-port", "0"))
    yield started
    started.stop()


async def post(http: aiohttp.ClientSession, url: str, body: Any, status: int = 200) -> Any:
    async with http.post(url, json=body) as response:
        payload = await response.json()
        assert response.status == status, payload
        return payload


@pytest.mark.asyncio
async def test_prometheus_sees_a_bridge_and_each_replica_of_a_cluster(
    bridge_process, cluster, tmp_path, http, write_script
):
    bridge = bridge_process(extra_args=["--ops-port", "0"])
    output = bridge.wait_for_output("operations: http://")
    ops = re.search(r"operations: http://(\S+)", output)
    assert ops is not None
    replicas = {}
    for line in cluster.output_lines():
        found = re.search(r"replica (\S+) \S+ pid \d+ mark \S+ ops http://(\S+)", line)
        if found:
            replicas[found[1]] = found[2]
    assert len(replicas) == 3, cluster.output_lines()
    prometheus = Prometheus(
        tmp_path / "prometheus", {"bridge": [ops[1]], "cluster": sorted(replicas.values())}
    )
    prometheus.start()
    try:
        # The bridge: two sessions, a call in each, an approval answered after a wait.
        api = bridge.base
        plain = (await post(http, f"{api}/v1/sessions", {}, 201))["sessionId"]
        body = {"options": {"env": {"FAKE_CODEX_SCRIPT": write_script(APPROVAL_SCRIPT)}}}
        asking = (await post(http, f"{api}/v1/sessions", body, 201))["sessionId"]
        await post(http, f"{api}/v1/sessions/{plain}/call/thread/list", {"params": {}})
        thread = await post(http, f"{api}/v1/sessions/{asking}/call/thread/start", {"params": {}})
        params = {
            "threadId": thread["result"]["thread"]["id"],
            "input": [{"type": "text", "text": "hi"}],
        }
        await post(http, f"{api}/v1/sessions/{asking}/call/turn/start", {"params": params})
        key = None
        while key is None:
            async with http.get(f"{api}/v1/sessions/{asking}/events?waitMs=30000") as response:
                event = await response.json()
            key = event["requestKey"] if event["kind"] == "request" else None
        await post(
            http,
            f"{api}/v1/sessions/{asking}/requests/{key}/result",
            {"result": {"decision": "accept"}},
        )
        # The cluster: six sessions through the front, spread over the replicas.
        front_sessions = [
            (await post(http, f"{cluster.front}/v1/sessions", {}, 201))["sessionId"]
            for _ in range(6)
        ]
        done = time.time()
        await prometheus.scraped_after(http, done)

        live = await prometheus.query(http, 'sum by (job) (rest_bridge_sessions{state="running"})')
        assert live == {"job=bridge": 2, "job=cluster": len(front_sessions)}
        per_replica = await prometheus.query(
            http, 'sum by (replica) (rest_bridge_sessions{job="cluster",state="running"})'
        )
        expected: dict[str, float] = {}
        for session in front_sessions:
            name = f"replica={session.split('.')[0]}"
            expected[name] = expected.get(name, 0) + 1
        assert {k: v for k, v in per_replica.items() if v} == expected
        assert set(per_replica) == {f"replica={name}" for name in replicas}
        routes = await prometheus.query(
            http,
            'sum by (http_route) (http_server_request_duration_seconds_count{job="bridge",'
            'http_request_method="POST"})',
        )
        assert routes["http_route=/v1/sessions"] == 2
        assert routes["http_route=/v1/sessions/{sessionId}/call/{method}"] == 3
        assert routes["http_route=/v1/sessions/{sessionId}/requests/{requestKey}/result"] == 1
        waits = await prometheus.query(
            http, 'rest_bridge_server_request_wait_seconds_count{job="bridge"}'
        )
        assert list(waits.values()) == [1]
        waited = await prometheus.query(
            http, 'rest_bridge_server_request_wait_seconds_sum{job="bridge"}'
        )
        assert next(iter(waited.values())) > 0
        created = await prometheus.query(
            http,
            'sum(http_server_request_duration_seconds_count{job="cluster",'
            'http_route="/v1/sessions",http_request_method="POST",http_response_status_class="2xx"})',
        )
        assert list(created.values()) == [len(front_sessions)]

        # Every query of the Grafana dashboard is one the real engine runs (rates need two
        # scrapes in their window, and these bridges are not in shared mode: only the
        # other plain ones must have data already).
        for expression in dashboard_queries():
            if expression.startswith("label_values("):
                values = await prometheus.api(http, "label/replica/values")
                assert set(values) == set(replicas)
                continue
            result = await prometheus.query(http, expression.replace("$replica", ".*"))
            if "(" not in expression and "shared" not in expression:
                assert result, expression

        # A replica drained (it holds a session, so it stays up): not ready, and Prometheus
        # sees it so, by its replica label.
        victim = front_sessions[0].split(".")[0]
        os.kill(cluster.replicas[victim]["pid"], signal.SIGUSR1)
        await cluster.line("draining", member=victim)
        drained = time.time()
        await prometheus.scraped_after(http, drained)
        ready = await prometheus.query(http, 'rest_bridge_ready{job="cluster"}')
        assert {k.split("replica=")[1].split(",")[0]: v for k, v in ready.items()} == {
            name: (0 if name == victim else 1) for name in replicas
        }
    finally:
        prometheus.stop()


def test_an_ops_port_variable_does_not_reach_the_replicas(tmp_path: Path) -> None:
    """REST_ADAPTER_OPS_PORT set for `rest-bridge cluster`: one port cannot serve three
    replicas, so the launcher keeps it from them (its --ops-port numbers them)."""
    started = ClusterProcess(tmp_path / "front", env={"REST_ADAPTER_OPS_PORT": str(free_port())})
    try:
        lines = [line for line in started.output_lines() if "cluster: replica " in line]
        assert len(lines) == 3
        assert not any(" ops " in line for line in lines)
    finally:
        assert started.stop() == 0


def test_the_cluster_refuses_an_ops_port_with_no_room_for_its_replicas(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            str(Path(REST_BRIDGE)),
            *("cluster", "--replicas", "3", "--port", "0", "--ops-port", "65534"),
            *("--nginx", "/bin/true", "--dir", str(tmp_path / "front")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--ops-port 65534 leaves no port for replica 2" in done.stderr
