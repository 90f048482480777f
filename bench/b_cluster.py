"""7. Replicas behind nginx: calls/s and SSE events/s through the front.

``rest-bridge cluster`` (nginx, one worker, and N replicas) is measured against one
replica reached directly, all interleaved in every repeat: raw session calls of
``bench/ping`` under wrk (spread over sessions of every replica), latency at
concurrency 1, and SSE floods read through the front, one reader per replica. CPU per
call is measured for nginx (master and worker), each replica, the app-servers and wrk,
from the scheduler's own count (``/proc/<pid>/task/*/schedstat``), which other work on
the machine does not inflate the way it inflates wall time.

The app-servers behind the replicas: ``lean`` (``bench/lean``: a C app-server compiled
now with the system's cc, or its Python twin without a compiler; about 1 µs of CPU per
call) is the default and the one the targets are judged on, as the issue measured
with a compiled app-server; ``fake`` is fake-codex with ``bench/fake_script.yaml``
(30-60 µs per call, which takes most of the second core of a 2-core machine).

    .venv/bin/python -m bench.b_cluster --repeats 5              # the targets, lean
    .venv/bin/python -m bench.b_cluster --app-server lean,fake   # fake-codex too
    .venv/bin/python -m bench.b_cluster --replicas 1,2,4,8       # more cores
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bench import lean, wrk
from bench.common import (
    BIN,
    HOST,
    Section,
    child_pids,
    client_process,
    cpu_ns,
    fake_argv,
    fake_env,
    http_json,
    log,
    machine_busy,
)

METHOD = "bench/ping"
FLOOD = 100_000
WRK_SECONDS = 2
IN_FLIGHT = 64
SESSIONS_PER_REPLICA = 4
TARGET_SPEEDUP = 1.25
TARGET_NGINX_US = 25.0
TARGET_ADDED_P50_US = 60.0
APP_SERVERS = ("lean", "fake")
#: Also accepted by --app-server: the lean app-server's Python twin, as on a machine
#: without a C compiler.
OTHER_APP_SERVERS = ("lean-python",)
BUSY = 0.25  # other work above which the verdicts carry a warning


def app_server_argv(kind: str) -> list[str]:
    """The app-server command of the replicas: ``lean`` or ``fake`` (fake-codex)."""
    if kind == "lean":
        return lean.argv("auto")
    if kind == "lean-python":
        return lean.argv("python")
    if kind == "fake":
        return fake_argv()
    raise ValueError(f"app-server must be one of {APP_SERVERS + OTHER_APP_SERVERS}")


def app_server_label(kind: str) -> str:
    if kind == "fake":
        return "fake-codex"
    if kind == "lean-python":
        return "lean app-server (python)"
    return f"lean app-server ({lean.kind_of(lean.argv('auto'))})"


class Cluster:
    """``rest-bridge cluster`` with N replicas, and its front's address."""

    def __init__(self, replicas: int, loop: str = "asyncio", app_server: str = "lean") -> None:
        self.count = replicas
        self.loop = loop
        self.app_server = app_server
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
        argv += ["--app-server", " ".join(app_server_argv(self.app_server))]
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
                pids[f"app-server {name} {n}"] = child
        return pids

    def measure_calls(self) -> None:
        result, _ = wrk.run(self.url, connections=1, seconds=WRK_SECONDS, lua=self.lua)
        self.errors += result.errors + result.status_errors
        self.p50.append(result.p50_us)
        pids = self.pids()
        result, used_ns, wrk_cpu = wrk.loaded(
            self.url,
            self.lua,
            WRK_SECONDS,
            IN_FLIGHT,
            lambda: {k: cpu_ns(p) for k, p in pids.items()},
        )
        used = {k: v / 1000 for k, v in used_ns.items()}  # µs
        self.errors += result.errors + result.status_errors
        self.rate.append(result.rate)
        calls = result.requests
        per_call = {
            "nginx": sum(v for k, v in used.items() if k.startswith("nginx")),
            "replicas": sum(v for k, v in used.items() if k in self.cluster.replicas),
            "app-servers": sum(v for k, v in used.items() if k.startswith("app-server")),
        }
        per_call = {k: v / calls for k, v in per_call.items()}
        per_call["wrk"] = wrk_cpu / calls * 1e6
        for name in self.cluster.replicas:
            if name in used:
                per_call[name] = used[name] / calls
        self.cpu_per_call.append(per_call)

    def total_cpu(self) -> float:
        """Median CPU per call of everything on the machine's cores for this way in, µs."""
        parts = ("nginx", "replicas", "app-servers", "wrk")
        return median([sum(c[k] for k in parts) for c in self.cpu_per_call])

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


def measure(
    counts: list[int],
    repeats: int,
    loop: str,
    sse: bool = True,
    app_servers: tuple[str, ...] = ("lean",),
) -> dict[str, dict[str, Target]]:
    """Every way in, interleaved over ``repeats``: per app-server, direct then a front per count.

    Keys: app-server kind, then ``direct`` or ``front-<n>``.
    """
    targets: dict[str, dict[str, Target]] = {}
    with contextlib.ExitStack() as stack:
        for app in app_servers:
            clusters = {n: stack.enter_context(Cluster(n, loop, app)) for n in counts}
            first = clusters[counts[0]]
            port = next(iter(first.replicas.values()))[0]
            ways = targets[app] = {}
            ways["direct"] = Target("one replica, directly", first, port, through_front=False)
            for n, cluster in clusters.items():
                name = f"{n} replica{'s' if n > 1 else ''} behind nginx"
                ways[f"front-{n}"] = Target(name, cluster, cluster.front_port, True)
        for index in range(repeats):
            log(f"cluster: repeat {index + 1} of {repeats}")
            for ways in targets.values():
                for target in ways.values():
                    target.measure_calls()
            if sse:
                for ways in targets.values():
                    for target in ways.values():
                        target.measure_sse()
    return targets


def verdicts(ways: dict[str, Target]) -> list[tuple[str, bool | None, str]]:
    """(target, met, what was measured) for the three targets of one app-server."""
    direct = ways["direct"]
    out: list[tuple[str, bool | None, str]] = []
    if "front-2" in ways:
        front = ways["front-2"]
        ratio = median(front.rate) / median(direct.rate)
        cores = os.cpu_count() or 1
        by_cpu = cores * median([c["replicas"] for c in direct.cpu_per_call]) / front.total_cpu()
        low = min(front.rate) / max(direct.rate)
        high = max(front.rate) / min(direct.rate)
        out.append(
            (
                f"2 replicas behind nginx >= {TARGET_SPEEDUP}x one replica directly",
                ratio >= TARGET_SPEEDUP,
                f"{ratio:.2f}x ({median(front.rate):,.0f} / {median(direct.rate):,.0f} calls/s;"
                f" rounds {low:.2f}-{high:.2f}x; by CPU per call {by_cpu:.2f}x)",
            )
        )
    for key, target in ways.items():
        if key == "direct":
            continue
        nginx = [c["nginx"] for c in target.cpu_per_call]
        out.append(
            (
                f"nginx CPU per call <= {TARGET_NGINX_US:.0f} µs ({target.name})",
                median(nginx) <= TARGET_NGINX_US,
                f"{median(nginx):.1f} µs (rounds {min(nginx):.1f}-{max(nginx):.1f})",
            )
        )
    if "front-1" in ways:
        front = ways["front-1"]
        added = median(front.p50) - median(direct.p50)
        rounds = [f - d for f, d in zip(front.p50, direct.p50, strict=True)]
        out.append(
            (
                f"p50 at concurrency 1 through the front <= direct + {TARGET_ADDED_P50_US:.0f} µs",
                added <= TARGET_ADDED_P50_US,
                f"{added:+.0f} µs ({median(front.p50):.0f} against {median(direct.p50):.0f};"
                f" per round {min(rounds):+.0f} to {max(rounds):+.0f})",
            )
        )
    return out


def capacity(ways: dict[str, Target], cores: int) -> str:
    """The arithmetic bound, from CPU per call alone (robust to other work on the machine).

    Reached directly, one replica is bound by its own core: 10⁶ / its µs per call. Behind
    the front every process shares every core: ``cores`` x 10⁶ / the total µs per call.
    """
    direct = median([c["replicas"] for c in ways["direct"].cpu_per_call])
    front = ways.get("front-2") or ways[max(ways)]
    total = front.total_cpu()
    return (
        f"by CPU per call: {front.name}, {total:.0f} µs of CPU per call in all, so {cores} cores"
        f" carry {cores * 1e6 / total:,.0f} calls/s; one replica directly, {direct:.0f} µs on"
        f" its one core: {1e6 / direct:,.0f} calls/s; ratio {cores * direct / total:.2f}x"
    )


def cpu_text(target: Target) -> str:
    parts = target.cpu_per_call[0].keys()
    return ", ".join(
        f"{part} {median([c.get(part, 0.0) for c in target.cpu_per_call]):.1f}" for part in parts
    )


def run(repeats: int, options: dict[str, Any]) -> Section:
    section = Section("cluster", "7. Replicas behind nginx", subject="Way in")
    counts = [1, 2]
    log("cluster: one replica directly, 1 and 2 replicas behind nginx, interleaved")
    everything = measure(counts, repeats, options.get("loop", "asyncio"), app_servers=APP_SERVERS)
    for app, ways in everything.items():
        label = app_server_label(app)
        judged = app == APP_SERVERS[0]
        direct = ways["direct"]
        for key, target in ways.items():
            speedup = median(target.rate) / median(direct.rate)
            figure = section.add(
                f"calls/s, {IN_FLIGHT} in flight, {label}: {target.name}",
                "calls/s",
                target.rate,
                baseline=direct.rate if key != "direct" else None,
                baseline_name="one replica directly",
            )
            if key == "front-2" and judged:
                figure.target = f"≥ {TARGET_SPEEDUP}x one replica directly ({speedup:.2f}x)"
                figure.met = speedup >= TARGET_SPEEDUP
        for key, target in ways.items():
            figure = section.add(
                f"latency p50, concurrency 1, {label}: {target.name}",
                "µs",
                target.p50,
                baseline=direct.p50 if key != "direct" else None,
                baseline_name="one replica directly",
            )
            if key == "front-1" and judged:
                added = median(target.p50) - median(direct.p50)
                figure.target = f"≤ direct + {TARGET_ADDED_P50_US:.0f} µs (added: {added:.0f} µs)"
                figure.met = added <= TARGET_ADDED_P50_US
        for key, target in ways.items():
            if target.sse_rate:
                section.add(
                    f"SSE events/s, one reader per replica, {label}: {target.name}",
                    "events/s",
                    target.sse_rate,
                    baseline=direct.sse_rate if key != "direct" else None,
                    baseline_name="one replica directly",
                )
        for key, target in ways.items():
            if key == "direct":
                continue
            nginx = [c["nginx"] for c in target.cpu_per_call]
            figure = section.add(f"nginx CPU per call, {label}: {target.name}", "µs", nginx)
            if judged:
                figure.target = f"≤ {TARGET_NGINX_US:.0f} µs"
                figure.met = median(nginx) <= TARGET_NGINX_US
        for target in ways.values():
            section.notes.append(
                f"CPU per call at {IN_FLIGHT} in flight, {label}, {target.name} (µs): "
                f"{cpu_text(target)}. Errors or non-2xx: {target.errors}."
            )
        section.notes.append(f"{label}: {capacity(ways, os.cpu_count() or 1)}.")
    section.notes.append(
        f"nginx 1 worker, keep-alive to every replica; {SESSIONS_PER_REPLICA} sessions per "
        f"replica, wrk (1 thread) posting to each in turn, {WRK_SECONDS} s per run; SSE: "
        f"{FLOOD:,} events per replica, all floods at once. The targets are judged with the "
        "lean app-server (bench/lean). CPU from /proc/<pid>/task/*/schedstat. Any replica "
        "count: `python -m bench.b_cluster --replicas 1,2,4`."
    )
    return section


def load_average() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="1,2", help="counts behind the front, e.g. 1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument(
        "--app-server",
        default="lean",
        help="the replicas' app-server(s), comma-separated: lean (default), fake, lean-python",
    )
    parser.add_argument("--no-sse", action="store_true")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.replicas.split(",") if n.strip()]
    apps = tuple(a.strip() for a in args.app_server.split(",") if a.strip())
    if not apps or any(a not in APP_SERVERS + OTHER_APP_SERVERS for a in apps):
        parser.error(f"--app-server takes {', '.join(APP_SERVERS + OTHER_APP_SERVERS)}")
    if 1 not in counts:
        counts.insert(0, 1)  # one replica behind nginx: the latency target's front
    cores = os.cpu_count() or 1
    before = load_average()
    busy = machine_busy()
    everything = measure(counts, args.repeats, args.loop, sse=not args.no_sse, app_servers=apps)
    print(
        f"load average before: {before}; after: {load_average()}; {cores} cores;"
        f" {busy:.0%} of the CPU busy with other work just before the run"
    )
    caveat = ""
    if busy > BUSY:
        caveat = (
            f" [machine busy ({busy:.0%} before the run): rates and latencies are not"
            " reliable; CPU per call and the ratio by CPU are]"
        )
    for app, ways in everything.items():
        direct = median(ways["direct"].rate)
        print(f"\n{app_server_label(app)}, {args.repeats} interleaved rounds (medians):")
        print(
            f"{'way in':<32} {'calls/s':>9} {'xdirect':>8} {'p50 µs':>7} {'events/s':>9}"
            "  CPU µs/call"
        )
        for target in ways.values():
            print(
                f"{target.name:<32} {median(target.rate):>9,.0f}"
                f" {median(target.rate) / direct:>7.2f}x {median(target.p50):>7.0f}"
                f" {median(target.sse_rate):>9,.0f}  {cpu_text(target)}"
                + (f"; ERRORS {target.errors}" if target.errors else "")
            )
        print(capacity(ways, cores))
        for name, met, measured in verdicts(ways):
            print(f"VERDICT {app}: {'MET   ' if met else 'MISSED'} {name}: {measured}{caveat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
