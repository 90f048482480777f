"""``wrk`` (Debian's package) as the HTTP load generator, with a Lua script per run."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.common import children_cpu

_REPORT = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nWRK-JSON {"requests": %d, "duration_us": %d, "errors": %d, "status_errors": %d, '
    .. '"p50_us": %d, "p99_us": %d, "mean_us": %.1f}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


@dataclass
class WrkResult:
    requests: int
    seconds: float
    errors: int
    status_errors: int
    p50_us: float
    p99_us: float
    mean_us: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


def wrk_binary() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit("wrk is not installed: `apt-get install -y wrk` (make bench does it)")
    return path


def version() -> str:
    done = subprocess.run([wrk_binary(), "-v"], capture_output=True, text=True, timeout=10)
    return (done.stdout + done.stderr).splitlines()[0].split(" Copyright")[0]


def lua_post(body: Any, headers: dict[str, str] | None = None) -> str:
    encoded = json.dumps(json.dumps(body, separators=(",", ":")))
    more = "".join(
        f"wrk.headers[{json.dumps(name)}] = {json.dumps(value)}\n"
        for name, value in (headers or {}).items()
    )
    return (
        'wrk.method = "POST"\n'
        f"wrk.body = {encoded}\n"
        'wrk.headers["Content-Type"] = "application/json"\n' + more + _REPORT
    )


def lua_get() -> str:
    return _REPORT


def run(
    url: str,
    *,
    connections: int,
    seconds: float,
    lua: str,
    threads: int = 1,
    on_start: Any = None,
) -> tuple[WrkResult, subprocess.Popen[str]]:
    """Run wrk to completion. ``on_start(proc)`` runs while it works (e.g. to sample CPU)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", prefix="bench-") as script:
        script.write(lua)
        script.flush()
        argv = [wrk_binary(), f"-t{threads}", f"-c{connections}", f"-d{seconds}s"]
        argv += ["--timeout", "10s", "-s", script.name, url]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if on_start is not None:
            on_start(proc)
        out, err = proc.communicate(timeout=seconds + 30)
    for line in out.splitlines():
        if line.startswith("WRK-JSON "):
            data = json.loads(line[len("WRK-JSON ") :])
            return (
                WrkResult(
                    requests=data["requests"],
                    seconds=data["duration_us"] / 1e6,
                    errors=data["errors"],
                    status_errors=data["status_errors"],
                    p50_us=data["p50_us"],
                    p99_us=data["p99_us"],
                    mean_us=data["mean_us"],
                ),
                proc,
            )
    raise RuntimeError(f"wrk printed no report:\n{out}\n{err}")


def loaded(
    url: str, lua: str, seconds: float, connections: int, counters: Callable[[], dict[str, int]]
) -> tuple[WrkResult, dict[str, int], float]:
    """wrk at ``connections``; how much each of ``counters()`` grew from wrk's start to its
    end, and wrk's own CPU seconds."""
    start: dict[str, int] = {}
    before = children_cpu()
    result, _ = run(
        url,
        connections=connections,
        seconds=seconds,
        lua=lua,
        on_start=lambda proc: start.update(counters()),
    )
    end = counters()
    return result, {k: end[k] - start[k] for k in start if k in end}, children_cpu() - before
