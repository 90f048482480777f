"""nginx configurations side by side in front of the same replicas: what each costs.

An experiment tool, not part of ``make bench``. N replicas (``rest-bridge serve`` on the
lean app-server, each also listening on a unix socket, see ``--unix``) are started once;
then one nginx per variant of the generated configuration (``bridge_ops.front.render``
with a change applied), each on its own port, all in front of the same replicas. Every
round measures every variant, and the replica reached directly, one after the other:
calls/s with 64 in flight, the CPU per call of nginx, of the replicas, of the
app-servers and of wrk (scheduler counts from /proc), and p50 at concurrency 1.

    .venv/bin/python -m bench.front_ab --replicas 1 --rounds 6 --variants base,unix
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench import lean, wrk
from bench.b_cluster import IN_FLIGHT, SESSIONS_PER_REPLICA, WRK_SECONDS, rotating_lua
from bench.common import HOST, child_pids, cpu_ns, fake_env, free_port, http_json, log
from bridge.settings import LimitVariables
from bridge_ops.front import FrontSettings, Replica, render, token_map_text

# A replica that also listens on a unix socket: the bridge's own `serve`, with its
# listening sockets made to include a unix one (an experiment; serve has no such option).
UNIX_REPLICA = """
import os, socket, sys
import bridge.runtime
tcp = bridge.runtime.listening_sockets
def both(host, port):
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(os.environ["BENCH_UNIX_SOCKET"])
    unix.listen(128)
    unix.setblocking(False)
    return tcp(host, port) + [unix]
bridge.runtime.listening_sockets = both
from bridge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _sub(pattern: str, replacement: str) -> Callable[[str], str]:
    def change(config: str) -> str:
        changed, count = re.subn(pattern, replacement, config, flags=re.M)
        if not count:
            raise ValueError(f"variant pattern {pattern!r} matched nothing")
        return changed

    return change


def _unix(config: str) -> str:
    return re.sub(r"server 127\.0\.0\.1:(\d+)", r"server unix:{sock_\1}", config)


VARIANTS: dict[str, Callable[[str], str]] = {
    "base": lambda c: c,
    "unix": _unix,
    "no-request-buffering": _sub(
        r"^(        proxy_http_version 1.1;)$", r"\1\n        proxy_request_buffering off;"
    ),
    "keepalive-64": _sub(r"keepalive 256;", "keepalive 64;"),
    "affinity": _sub(r"^(worker_processes 1;)$", r"\1\nworker_cpu_affinity 01;"),
    "multi-accept": _sub(r"^(    worker_connections 4096;)$", r"\1\n    multi_accept on;"),
    "no-host-header": _sub(r"^        proxy_set_header Host \$http_host;\n", ""),
    "buffering-off": _sub(
        r"^(        proxy_http_version 1.1;)$", r"\1\n        proxy_buffering off;"
    ),
    "nodelay-off": _sub(r"^(    keepalive_requests 100000;)$", r"\1\n    tcp_nodelay off;"),
    "small-buffers": _sub(
        r"^(        proxy_http_version 1.1;)$", r"\1\n        proxy_buffer_size 1k;"
    ),
    # The front's own token check (FrontSettings.token_map): the map's regular expression
    # on every request's Authorization header and the `if`. wrk sends no token and the
    # replicas ask for none, so this map admits every header, after the same match.
    "token-check": lambda c: c,
    # Without the server block's `if` on the method that sends the listing to the reads
    # (what it costs every call; the bench's calls never list).
    "no-listing-if": _sub(
        r'^        if \(\$request_method ~ "\^\(GET\|HEAD\)\$"\) \{\n.*\n        \}\n', ""
    ),
}
#: Variants rendered with a token map (written to nginx's prefix directory).
TOKEN_MAPPED = frozenset({"token-check"})


def cpu(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_ns(pid)
    return total


class Replicas:
    def __init__(self, count: int, directory: Path) -> None:
        self.count = count
        self.directory = directory
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        self.sockets: list[str] = []

    def __enter__(self) -> Replicas:
        command = " ".join(lean.argv("auto"))
        for n in range(self.count):
            port = free_port()
            sock = str(self.directory / f"replica-{n}.sock")
            env = fake_env(
                {
                    "REST_ADAPTER_REPLICA_ID": f"replica-{n}",
                    "BENCH_UNIX_SOCKET": sock,
                    "REST_ADAPTER_MAX_SESSIONS": "64",
                }
            )
            argv = [sys.executable, "-c", UNIX_REPLICA, "serve", "--app-server", command]
            argv += ["--host", HOST, "--port", str(port)]
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.procs.append(proc)
            self.ports.append(port)
            self.sockets.append(sock)
        for port, sock in zip(self.ports, self.sockets, strict=True):
            deadline = time.monotonic() + 60
            while not os.path.exists(sock):
                if time.monotonic() > deadline:
                    raise RuntimeError("a replica did not start")
                time.sleep(0.05)  # bench set-up, not a measurement
            os.chmod(sock, 0o666)  # nginx's workers may run as another user (nobody)
            status, _ = http_json(port, "GET", "/health")
            assert status == 200
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def app_server_pids(self) -> list[int]:
        return [c for p in self.procs for c in child_pids(p.pid)]


@contextlib.contextmanager
def nginx(name: str, replicas: Replicas, directory: Path) -> Iterator[tuple[int, int]]:
    """One nginx with variant ``name``: (port, master pid)."""
    port = free_port()
    prefix = directory / f"nginx-{name}"
    prefix.mkdir()
    listed = [Replica(f"replica-{n}", f"{HOST}:{p}") for n, p in enumerate(replicas.ports)]
    token_map = ""
    if name in TOKEN_MAPPED:
        token_map = "token-map.conf"
        admit_all = token_map_text("bench-token").replace("default 0;", "default 1;")
        (prefix / token_map).write_text(admit_all)
    settings = FrontSettings(listen=f"{HOST}:{port}", token_map=token_map)
    config = VARIANTS[name](render(listed, LimitVariables.from_env().limits(), settings))
    for n, p in enumerate(replicas.ports):
        config = config.replace(f"{{sock_{p}}}", replicas.sockets[n])
    (prefix / "nginx.conf").write_text(config)
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    argv = [binary, "-p", f"{prefix}/", "-c", f"{prefix}/nginx.conf", "-e", "stderr"]
    proc = subprocess.Popen([*argv, "-g", "daemon off;"], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, _ = http_json(port, "GET", "/health", timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"nginx {name} did not start")
            time.sleep(0.05)  # bench set-up, not a measurement
        yield port, proc.pid
    finally:
        proc.send_signal(3)  # SIGQUIT: graceful stop
        proc.wait(30)


class Way:
    def __init__(self, name: str, port: int, nginx_pid: int, replicas: Replicas) -> None:
        self.name = name
        self.port = port
        self.nginx_pid = nginx_pid
        self.replicas = replicas
        sessions = []
        wanted = SESSIONS_PER_REPLICA * (replicas.count if nginx_pid else 1)
        while len(sessions) < wanted:
            status, body = http_json(port, "POST", "/v1/sessions", {})
            assert status == 201, (status, body)
            sessions.append(body["sessionId"])
        self.lua = rotating_lua([f"/v1/sessions/{s}/call/bench/ping" for s in sessions])
        self.url = f"http://{HOST}:{port}/"
        self.rows: list[dict[str, float]] = []
        wrk.run(self.url, connections=16, seconds=1, lua=self.lua)

    def measure(self) -> None:
        p50, _ = wrk.run(self.url, connections=1, seconds=WRK_SECONDS, lua=self.lua)
        groups = {
            "nginx": [self.nginx_pid, *child_pids(self.nginx_pid)] if self.nginx_pid else [],
            "replicas": self.replicas.pids() if self.nginx_pid else self.replicas.pids()[:1],
            "app-servers": self.replicas.app_server_pids(),
        }
        result, used, wrk_cpu = wrk.loaded(
            self.url,
            self.lua,
            WRK_SECONDS,
            IN_FLIGHT,
            lambda: {k: cpu(v) for k, v in groups.items()},
        )
        row = {k: v / 1000 / result.requests for k, v in used.items()}
        row["wrk"] = wrk_cpu / result.requests * 1e6
        row["calls/s"] = result.rate
        row["p50"] = p50.p50_us
        row["errors"] = result.errors + result.status_errors + p50.errors + p50.status_errors
        self.rows.append(row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default="base,unix", help=", ".join(VARIANTS))
    args = parser.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in names:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name}")
    with open("/proc/loadavg") as handle:
        load_before = " ".join(handle.read().split()[:3])
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ab-")))
        directory.chmod(0o755)
        replicas = stack.enter_context(Replicas(args.replicas, directory))
        ways = [Way("direct", replicas.ports[0], 0, replicas)]
        for name in names:
            port, pid = stack.enter_context(nginx(name, replicas, directory))
            ways.append(Way(name, port, pid, replicas))
        for index in range(args.rounds):
            log(f"front_ab: round {index + 1} of {args.rounds}")
            for way in ways:
                way.measure()
    with open("/proc/loadavg") as handle:
        load_after = " ".join(handle.read().split()[:3])
    print(f"load average before {load_before}, after {load_after}; {args.replicas} replicas")
    keys = ("calls/s", "p50", "nginx", "replicas", "app-servers", "wrk")
    print(f"{'variant':<22}" + "".join(f"{k:>22}" for k in keys) + "   total µs")
    for way in ways:
        cells = []
        for key in keys:
            values = [r[key] for r in way.rows]
            cells.append(f"{statistics.median(values):>9.1f} ({min(values):.0f}-{max(values):.0f})")
        total = statistics.median(
            [sum(r[k] for k in ("nginx", "replicas", "app-servers", "wrk")) for r in way.rows]
        )
        errors = sum(r["errors"] for r in way.rows)
        print(
            f"{way.name:<22}"
            + "".join(f"{c:>22}" for c in cells)
            + f"   {total:.0f}"
            + (f"  ERRORS {errors:.0f}" if errors else "")
        )
    # What the cores could carry, from CPU per call alone (robust to other load): one
    # replica reached directly is bound by its own core; a front by every core.
    cores = os.cpu_count() or 1
    direct = ways[0]
    replica_direct = statistics.median([r["replicas"] for r in direct.rows])
    rate_direct = statistics.median([r["calls/s"] for r in direct.rows])
    for way in ways[1:]:
        total = statistics.median(
            [sum(r[k] for k in ("nginx", "replicas", "app-servers", "wrk")) for r in way.rows]
        )
        rate = statistics.median([r["calls/s"] for r in way.rows])
        print(
            f"{way.name}: measured {rate / rate_direct:.2f}x direct; by CPU per call,"
            f" {cores} cores / {total:.0f} µs against 1 core / {replica_direct:.0f} µs ="
            f" {cores * replica_direct / total:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
