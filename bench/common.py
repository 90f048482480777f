"""What every benchmark shares: processes, their CPU and memory, statistics, figures."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).with_name("fake_script.yaml")
HOST = "127.0.0.1"  # every byte of every benchmark stays on the loopback


def fake_argv() -> list[str]:
    return [str(BIN / "fake-codex"), "app-server"]


def fake_env(extra: dict[str, str] | None = None, script: bool = True) -> dict[str, str]:
    """The environment of fake-codex (and of the bridge that spawns it).

    Without the script the fake starts without pydantic and YAML: its fast start.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REST_ADAPTER_", "FAKE_"))}
    if script:
        env["FAKE_CODEX_SCRIPT"] = str(SCRIPT)
    env.update(extra or {})
    return env


def raise_fd_limit() -> None:
    """Thousands of sockets: lift the soft limit to the hard one (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- processes --------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size of one process."""
    return psutil.Process(pid).memory_info().rss


def cpu_seconds(pid: int) -> float:
    """User + system CPU time one process (all its threads) has used."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def children_cpu() -> float:
    """CPU seconds of this process's waited-for children (wrk, fakes), once reaped."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_ns(pid: int) -> int:
    """CPU time one process's live threads have used, in ns (the scheduler's own count).

    Finer than :func:`cpu_seconds` (clock ticks): what a process spending a few µs per
    call uses over a short window is a few ticks. Threads that have exited are not
    counted; the benchmarks' processes keep theirs. Read from /proc: psutil has no
    nanosecond count.
    """
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as handle:
            total += int(handle.read().split()[0])
    return total


def thread_count(pid: int) -> int:
    return psutil.Process(pid).num_threads()


def child_pids(pid: int) -> list[int]:
    """The children of ``pid`` but a bridge's watchdog (bridge/watchdog.py), which idles
    beside the app-servers until the bridge is gone."""
    found = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children():
            with contextlib.suppress(psutil.Error):
                if not any(arg.endswith("watchdog.py") for arg in child.cmdline()):
                    found.append(child.pid)
    return found


class CpuMeter:
    """CPU share of some processes over a window: 1.0 is one core busy all along."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start = {name: cpu_seconds(pid) for name, pid in pids.items()}
        self._t0 = time.monotonic()

    def shares(self) -> dict[str, float]:
        elapsed = time.monotonic() - self._t0
        out = {}
        for name, pid in self.pids.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                out[name] = (cpu_seconds(pid) - self._start[name]) / elapsed
        return out


def machine_busy(seconds: float = 1.0) -> float:
    """Share of the machine's CPU busy over ``seconds`` (0.0 to 1.0, all cores; idle and
    iowait count as not busy)."""
    return psutil.cpu_percent(interval=seconds) / 100


def wait_for_quiet(threshold: float = 0.15, patience: float = 5.0) -> float:
    """Wait (boundedly) for other work on the machine to calm down; the last reading."""
    deadline = time.monotonic() + patience
    busy = machine_busy()
    while busy > threshold and time.monotonic() < deadline:
        busy = machine_busy()
    return busy


def speed_probe() -> float:
    """Milliseconds for ``sum(range(100_000))``: how fast this CPU runs Python right now."""
    import timeit

    return min(timeit.repeat("sum(range(100_000))", number=20, repeat=5)) / 20 * 1000


# -- statistics and figures ---------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


@dataclass
class Figure:
    """One figure of RESULTS.md: values per repeat, for the bridge and its baseline."""

    section: str
    name: str
    unit: str
    bridge: list[float]
    baseline: list[float] | None = None
    baseline_name: str = "pipe"
    target: str = ""
    met: bool | None = None
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.bridge)

    @property
    def baseline_median(self) -> float | None:
        return statistics.median(self.baseline) if self.baseline else None

    @property
    def ratio(self) -> float | None:
        base = self.baseline_median
        if base is None or base == 0:
            return None
        return self.median / base


@dataclass
class Section:
    key: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    profile: str = ""
    subject: str = "Bridge"  # what the figures' first column measures

    def add(self, name: str, unit: str, bridge: list[float], **kwargs: Any) -> Figure:
        figure = Figure(self.title, name, unit, bridge, **kwargs)
        self.figures.append(figure)
        return figure


def log(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# -- HTTP from the driver -------------------------------------------------------------


def http_json(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    timeout: float = 60.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One request on a fresh connection; (status, decoded JSON body or None)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=payload, headers=sent)
        response = conn.getresponse()
        raw = response.read()
        return response.status, (json.loads(raw) if raw else None)
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


# -- the bridge as its own process --------------------------------------------------------


def wait_until_healthy(
    proc: subprocess.Popen[Any], port: int, path: str, name: str, output: Callable[[], str]
) -> None:
    """Poll ``GET path`` on ``port`` until it answers 200, for at most 20 s; RuntimeError,
    with the end of ``output()``, if ``proc`` (``name``) exits first or never answers."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {name} exited at start:\n{output()}")
        with contextlib.suppress(OSError):
            if http_json(port, "GET", path, timeout=2)[0] == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"the {name} did not answer {path} within 20 s:\n{output()}")


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM ``proc`` if it still runs, and SIGKILL it if it has not ended 20 s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Bridge:
    """``rest-bridge serve`` on a free loopback port, fronting fake-codex (or the
    app-server ``app_server`` starts)."""

    def __init__(
        self,
        limits: dict[str, int] | None = None,
        loop: str | None = None,
        script: bool = True,
        env: dict[str, str] | None = None,
        app_server: Sequence[str] | None = None,
        args: Sequence[str] = (),
    ) -> None:
        self.app_server = list(app_server) if app_server is not None else fake_argv()
        #: More arguments of `rest-bridge serve` (e.g. ``--log-level warning``).
        self.args = list(args)
        self.limits = limits or {}
        self.extra_env = env or {}
        self.loop = loop
        self.script = script
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="bench-bridge-", suffix=".log")  # noqa: SIM115

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> Bridge:
        command = shlex.join(self.app_server)
        argv = [str(BIN / "rest-bridge"), "serve", "--host", HOST, "--port", str(self.port)]
        argv += ["--app-server", command]
        if self.loop:
            argv += ["--loop", self.loop]
        argv += self.args
        limits = {f"REST_ADAPTER_{k.upper()}": str(v) for k, v in self.limits.items()}
        env = fake_env({**limits, **self.extra_env}, script=self.script)
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until_healthy(self.proc, self.port, "/health", "bridge", self.output)
        except RuntimeError:
            self.__exit__(None, None, None)
            raise
        return self

    def output(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-4000:]

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        children = child_pids(self.proc.pid)
        stop_process(self.proc)
        for pid in children:  # nothing the bridge spawned may outlive a benchmark
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        self._log.close()
        self.proc = None

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def create_session(self) -> str:
        status, body = http_json(self.port, "POST", "/v1/sessions", {})
        if status != 201:
            raise RuntimeError(f"creating a session: {status} {body}")
        return str(body["sessionId"])

    def delete_session(self, session_id: str) -> None:
        http_json(self.port, "DELETE", f"/v1/sessions/{session_id}")

    def call(self, session_id: str, method: str, params: Any = None) -> Any:
        status, body = http_json(
            self.port, "POST", f"/v1/sessions/{session_id}/call/{method}", {"params": params or {}}
        )
        if status != 200:
            raise RuntimeError(f"{method}: {status} {body}")
        return body["result"]

    def next_seq(self, session_id: str) -> int:
        _, body = http_json(self.port, "GET", "/v1/sessions")
        for session in body["sessions"]:
            if session["sessionId"] == session_id:
                return int(session["nextSeq"])
        raise KeyError(session_id)


@contextlib.contextmanager
def client_process(args: Sequence[str], timeout: float | None = None) -> Iterator[ClientProcess]:
    """``python -m bench.clients ARGS``: a load client in its own process."""
    limit = float(os.environ.get("BENCH_CLIENT_SECONDS", "120"))
    client = ClientProcess(args, (timeout or limit) + 10)
    try:
        yield client
    finally:
        client.close()


class ClientProcess:
    """A line protocol: the client prints JSON lines, the driver may write lines to it."""

    def __init__(self, args: Sequence[str], timeout: float) -> None:
        self.deadline = time.monotonic() + timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.clients", *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self) -> dict[str, Any]:
        """The next JSON line the client prints (blocking, within the client's deadline)."""
        assert self.proc.stdout is not None
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                raise TimeoutError(f"client {self.proc.args[3:]} did not answer in time")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client {self.proc.args[3:]} exited ({self.proc.wait()})")
        return dict(json.loads(line))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def machine_summary() -> tuple[str, float]:
    """This machine's CPU model name and total memory in GiB (for reports; Linux only)."""
    cpu = "?"
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as handle:
        memory_gib = int(handle.readline().split()[1]) / 1024 / 1024
    return cpu, memory_gib
