"""7. Replicas behind nginx: calls/s and SSE events/s through the front.

``rest-bridge cluster`` (nginx, one worker, and N replicas on fake-codex with
``bench/fake_script.yaml``) is measured against one replica reached directly, all
interleaved in every repeat: raw session calls of ``bench/ping`` under wrk (spread over
sessions of every replica), latency at concurrency 1, and SSE floods read through the
front, one reader per replica. CPU per call is measured for nginx (master and worker),
each replica, the fake app-servers and wrk.

For another number of replicas (more cores):

    .venv/bin/python -m bench.b_cluster --replicas 1,2,4,8 --repeats 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bench import wrk
from bench.common import (
    BIN,
    HOST,
    CpuMeter,
    Section,
    child_pids,
    client_process,
    fake_argv,
    fake_env,
    http_json,
    log,
)

METHOD = "bench/ping"
FLOOD = 100_000
WRK_SECONDS = 2
IN_FLIGHT = 64
SESSIONS_PER_REPLICA = 4
TARGET_SPEEDUP = 1.25
TARGET_NGINX_US = 25.0
TARGET_ADDED_P50_US = 60.0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Cluster:
    """``rest-bridge cluster`` with N replicas on fake-codex, and its front's address."""

    def __init__(self, replicas: int, loop: str = "asyncio") -> None:
        self.count = replicas
        self.loop = loop
        self.replicas: dict[str, tuple[int, int]] = {}  # id -> (port, pid)
        self.front_port = 0
        self.nginx_pid = 0
        self.proc: subprocess.Popen[str] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="bench-cluster-")
        self._ready = threading.Event()
        self._lines: list[str] = []

    def __enter__(self) -> Cluster:
        argv = [str(BIN / "rest-bridge"), "cluster", "--replicas", str(self.count)]
        argv += ["--port", "0", "--dir", self._dir.name, "--loop", self.loop]
        argv += ["--app-server", " ".join(fake_argv())]
        self.proc = subprocess.Popen(
            argv,
            env=fake_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(120) or self.proc.poll() is not None:
            self.__exit__()
            raise RuntimeError("the cluster did not start:\n" + "\n".join(self._lines[-30:]))
        return self

    def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        replica = re.compile(r"cluster: replica (\S+) http://[^:]+:(\d+) pid (\d+)")
        front = re.compile(r"cluster: front http://[^:]+:(\d+) pid (\d+)")
        for line in self.proc.stdout:
            self._lines.append(line.rstrip())
            if m := replica.search(line):
                self.replicas[m.group(1)] = (int(m.group(2)), int(m.group(3)))
            elif m := front.search(line):
                self.front_port, self.nginx_pid = int(m.group(1)), int(m.group(2))
            elif "cluster: ready" in line:
                self._ready.set()
        self._ready.set()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._dir.cleanup()

    def nginx_pids(self) -> dict[str, int]:
        pids = {"nginx master": self.nginx_pid}
        for n, pid in enumerate(child_pids(self.nginx_pid)):
            pids[f"nginx worker {n}"] = pid
        return pids

    def create_sessions(self, port: int, per_replica: int) -> list[str]:
        """Sessions through ``port`` until every replica behind it holds ``per_replica``."""
        wanted = per_replica * (self.count if port == self.front_port else 1)
        ids: list[str] = []
        while len(ids) < wanted:
            status, body = http_json(port, "POST", "/v1/sessions", {})
            if status != 201:
                raise RuntimeError(f"creating a session: {status} {body}")
            ids.append(body["sessionId"])
        return ids


def rotating_lua(paths: list[str]) -> str:
    """wrk posting `bench/ping` to each of ``paths`` in turn."""
    listed = ", ".join(f'"{p}"' for p in paths)
    return (
        f"local paths = {{{listed}}}\n"
        "local i = 0\n"
        'local body = "{\\"params\\":{}}"\n'
        'local headers = {["Content-Type"] = "application/json"}\n'
        "request = function()\n"
        "  i = i % #paths + 1\n"
        '  return wrk.format("POST", paths[i], headers, body)\n'
        "end\n" + wrk._REPORT
    )


class Target:
    """One way in: a replica directly, or a front with N replicas behind it."""

    def __init__(self, name: str, cluster: Cluster, port: int, through_front: bool) -> None:
        self.name = name
        self.cluster = cluster
        self.port = port
        self.front = through_front
        self.sessions = cluster.create_sessions(port, SESSIONS_PER_REPLICA)
        self.lua = rotating_lua([f"/v1/sessions/{s}/call/{METHOD}" for s in self.sessions])
        self.url = f"http://{HOST}:{port}/"
        self.rate: list[float] = []
        self.p50: list[float] = []
        self.cpu_per_call: list[dict[str, float]] = []
        self.sse_rate: list[float] = []
        self.errors = 0
        wrk.run(self.url, connections=16, seconds=1, lua=self.lua)  # warm-up

    def pids(self) -> dict[str, int]:
        pids: dict[str, int] = {}
        replicas = self.cluster.replicas.items()
        if not self.front:
            replicas = [r for r in replicas if r[1][0] == self.port]  # type: ignore[assignment]
        else:
            pids.update(self.cluster.nginx_pids())
        for name, (_, pid) in replicas:
            pids[name] = pid
            for n, child in enumerate(child_pids(pid)):
                pids[f"fake {name} {n}"] = child
        return pids

    def measure_calls(self) -> None:
        result, _ = wrk.run(self.url, connections=1, seconds=WRK_SECONDS, lua=self.lua)
        self.errors += result.errors + result.status_errors
        self.p50.append(result.p50_us)
        meters: list[CpuMeter] = []
        pids = self.pids()
        before = children_cpu()
        result, _ = wrk.run(
            self.url,
            connections=IN_FLIGHT,
            seconds=WRK_SECONDS,
            lua=self.lua,
            on_start=lambda proc: meters.append(CpuMeter(pids)),
        )
        wrk_cpu = children_cpu() - before
        self.errors += result.errors + result.status_errors
        self.rate.append(result.rate)
        shares = meters[0].shares()
        calls = result.requests
        per_call = {
            "nginx": sum(v for k, v in shares.items() if k.startswith("nginx")),
            "replicas": sum(v for k, v in shares.items() if k in self.cluster.replicas),
            "fakes": sum(v for k, v in shares.items() if k.startswith("fake")),
        }
        per_call = {k: v * result.seconds / calls * 1e6 for k, v in per_call.items()}
        per_call["wrk"] = wrk_cpu / calls * 1e6
        for name in self.cluster.replicas:
            if name in shares:
                per_call[name] = shares[name] * result.seconds / calls * 1e6
        self.cpu_per_call.append(per_call)

    def measure_sse(self) -> None:
        """One SSE reader per replica through this way in, all floods at once."""
        chosen: dict[str, str] = {}
        for session in self.sessions:
            chosen.setdefault(session.split(".", 1)[0], session)
        with contextlib.ExitStack() as stack:
            readers = []
            for session in chosen.values():
                after = next_seq(self.port, session) - 1
                reader = stack.enter_context(
                    client_process(["sse", str(self.port), session, str(after), str(after + FLOOD)])
                )
                if not reader.read().get("ready"):
                    raise RuntimeError("sse reader did not start")
                readers.append(reader)
            start = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(len(chosen)) as pool:
                floods = [
                    pool.submit(
                        http_json,
                        self.port,
                        "POST",
                        f"/v1/sessions/{s}/call/bench/flood",
                        {"params": {}},
                        300,
                    )
                    for s in chosen.values()
                ]
                reports = [reader.read() for reader in readers]
                for flood in floods:
                    flood.result()
        done = max(r["done_at"] for r in reports)
        events = sum(r["events"] for r in reports)
        self.sse_rate.append(events / (done - start))


def next_seq(port: int, session: str) -> int:
    _, body = http_json(port, "GET", "/v1/sessions")
    for summary in body["sessions"]:
        if summary["sessionId"] == session:
            return int(summary["nextSeq"])
    raise KeyError(session)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(counts: list[int], repeats: int, loop: str, sse: bool = True) -> dict[str, Target]:
    """Every way in, interleaved over ``repeats``: direct, then a front per count."""
    targets: dict[str, Target] = {}
    with contextlib.ExitStack() as stack:
        clusters = {n: stack.enter_context(Cluster(n, loop)) for n in counts}
        first = clusters[counts[0]]
        port = next(iter(first.replicas.values()))[0]
        targets["direct"] = Target("one replica, directly", first, port, through_front=False)
        for n, cluster in clusters.items():
            targets[f"front-{n}"] = Target(
                f"{n} replica{'s' if n > 1 else ''} behind nginx", cluster, cluster.front_port, True
            )
        for index in range(repeats):
            log(f"cluster: repeat {index + 1} of {repeats}")
            for target in targets.values():
                target.measure_calls()
            if sse:
                for target in targets.values():
                    target.measure_sse()
    return targets


def run(repeats: int, options: dict[str, Any]) -> Section:
    section = Section("cluster", "7. Replicas behind nginx", subject="Way in")
    counts = [1, 2]
    log("cluster: one replica directly, 1 and 2 replicas behind nginx, interleaved")
    targets = measure(counts, repeats, options.get("loop", "asyncio"))
    direct = targets["direct"]
    for key, target in targets.items():
        speedup = median(target.rate) / median(direct.rate)
        figure = section.add(
            f"calls/s, {IN_FLIGHT} in flight: {target.name}",
            "calls/s",
            target.rate,
            baseline=direct.rate if key != "direct" else None,
            baseline_name="one replica directly",
        )
        if key == "front-2":
            figure.target = f"≥ {TARGET_SPEEDUP}x one replica directly ({speedup:.2f}x)"
            figure.met = speedup >= TARGET_SPEEDUP
    for key, target in targets.items():
        figure = section.add(
            f"latency p50, concurrency 1: {target.name}",
            "µs",
            target.p50,
            baseline=direct.p50 if key != "direct" else None,
            baseline_name="one replica directly",
        )
        if key == "front-1":
            added = median(target.p50) - median(direct.p50)
            figure.target = f"≤ direct + {TARGET_ADDED_P50_US:.0f} µs (added: {added:.0f} µs)"
            figure.met = added <= TARGET_ADDED_P50_US
    for key, target in targets.items():
        if target.sse_rate:
            section.add(
                f"SSE events/s, one reader per replica: {target.name}",
                "events/s",
                target.sse_rate,
                baseline=direct.sse_rate if key != "direct" else None,
                baseline_name="one replica directly",
            )
    for key, target in targets.items():
        if key == "direct":
            continue
        nginx = [c["nginx"] for c in target.cpu_per_call]
        figure = section.add(f"nginx CPU per call: {target.name}", "µs", nginx)
        figure.target = f"≤ {TARGET_NGINX_US:.0f} µs"
        figure.met = median(nginx) <= TARGET_NGINX_US
    for target in targets.values():
        parts = target.cpu_per_call[0].keys()
        text = ", ".join(
            f"{part} {median([c.get(part, 0.0) for c in target.cpu_per_call]):.0f}"
            for part in parts
        )
        section.notes.append(
            f"CPU per call at {IN_FLIGHT} in flight, {target.name} (µs): {text}."
            f" Errors or non-2xx: {target.errors}."
        )
    section.notes.append(
        f"nginx 1 worker, keep-alive to every replica; {SESSIONS_PER_REPLICA} sessions per "
        f"replica, wrk (1 thread) posting to each in turn, {WRK_SECONDS} s per run; SSE: "
        f"{FLOOD:,} events per replica, all floods at once. Any replica count: "
        "`python -m bench.b_cluster --replicas 1,2,4`."
    )
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="1,2", help="counts behind the front, e.g. 1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--no-sse", action="store_true")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.replicas.split(",") if n.strip()]
    targets = measure(counts, args.repeats, args.loop, sse=not args.no_sse)
    direct = median(targets["direct"].rate)
    print(
        f"{'way in':<32} {'calls/s':>9} {'xdirect':>8} {'p50 µs':>7} {'events/s':>9}  CPU µs/call"
    )
    for target in targets.values():
        cpu = {
            k: median([c.get(k, 0.0) for c in target.cpu_per_call])
            for k in ("nginx", "replicas", "fakes", "wrk")
        }
        print(
            f"{target.name:<32} {median(target.rate):>9,.0f} {median(target.rate) / direct:>7.2f}x"
            f" {median(target.p50):>7.0f} {median(target.sse_rate):>9,.0f}  "
            + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
