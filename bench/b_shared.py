"""Sessions per GB with the real codex: one app-server per session, or one shared.

    python -m bench.b_shared                      # all three modes, 2,000 shared sessions
    python -m bench.b_shared --modes shared --sessions 500

Each mode runs `rest-bridge serve` (its own process) in front of the pinned real codex
0.169.0, offline (its model provider points at a closed loopback port; no turn runs):

- `stdio-launcher`: a process per session, spawned through the npm package's Node
  launcher (`.codex-npm/node_modules/.bin/codex`);
- `stdio-native`: a process per session, the native binary the package ships;
- `shared`: `--app-server-mode shared`, one native app-server, each session a
  WebSocket connection to it over a unix socket.

Every session is created (`POST /v1/sessions`) and given a thread (`thread/start`
through the bridge). Memory is the bridge and every process under it counted together,
as the sum of PSS (each shared page split between the processes that map it: the
honest figure for a machine's budget) and, for comparison, of RSS. Then, with all
sessions live: `GET /health` and `thread/read` on the newest session, one at a time
(p50/p99), and sessionless calls (`POST /v1/call/model/list`). The machine is shared
with other work: memory figures are steady, latency figures are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import BIN, HOST, free_port, percentile, raise_fd_limit
from scenarios.codex_install import pinned_codex

ROOT = Path(__file__).resolve().parents[1]
NPM = ROOT / ".codex-npm"
MB = 1024 * 1024
CONCURRENCY = 8
PROBES = 300


def _descendants(pid: int) -> list[int]:
    """`pid` and every process under it."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as handle:
            ppid = int(handle.read().rpartition(")")[2].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        queue += parents.get(current, [])
    return found


def _memory(pid: int) -> tuple[int, int, int]:
    """(PSS, RSS, process count) of `pid` and its descendants, in bytes."""
    pss = rss = count = 0
    for each in _descendants(pid):
        with contextlib.suppress(OSError), open(f"/proc/{each}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
            count += 1
    return pss, rss, count


@dataclass
class Result:
    mode: str
    sessions: int = 0
    failed: str = ""
    base: tuple[int, int, int] = (0, 0, 0)
    points: list[tuple[int, int, int, int]] = field(default_factory=list)  # n, pss, rss, procs
    create_ms: list[float] = field(default_factory=list)
    thread_ms: list[float] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    call_ms: list[float] = field(default_factory=list)
    sessionless_ms: list[float] = field(default_factory=list)


def _codex_command(mode: str, home: Path) -> str:
    if mode == "stdio-launcher":
        codex = str(NPM / "node_modules" / ".bin" / "codex")
    else:
        found = pinned_codex(NPM)
        if found is None or found[1] is not None:
            raise SystemExit("no native codex in .codex-npm/: run `make codex`")
        codex = found[0]
    with socket.socket() as closed:
        closed.bind((HOST, 0))
        dead_port = closed.getsockname()[1]
    overrides = [
        'model_provider="bench"',
        'model_providers.bench.name="bench"',
        f'model_providers.bench.base_url="http://{HOST}:{dead_port}/v1"',
        'model_providers.bench.wire_api="responses"',
        'model_providers.bench.env_key="OPENAI_API_KEY"',
        'model="gpt-6.1-sol"',
    ]
    args = [arg for item in overrides for arg in ("-c", item)]
    # As the docs advise for a shared codex: no login-shell snapshot per thread (seconds
    # of bash each, and a leftover process per thread on some machines). Every mode
    # runs the same way, so the modes compare like with like.
    return shlex.join([codex, "app-server", "--disable", "shell_snapshot", *args])


def _open_log(path: Path) -> Any:
    return path.open("wb")


async def _timed(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[float, int, Any]:
    started = time.perf_counter()
    async with session.request(method, url, json=body) as response:
        payload = await response.json(content_type=None)
        return (time.perf_counter() - started) * 1000, response.status, payload


async def _run_mode(mode: str, count: int, checkpoints: list[int]) -> Result:
    result = Result(mode)
    home = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REST_ADAPTER_", "CODEX_"))}
    env |= {
        "CODEX_HOME": str(home),
        "OPENAI_API_KEY": "x",
        "REST_ADAPTER_MAX_SESSIONS": str(count + 64),
        "REST_ADAPTER_SPAWN_TIMEOUT_MS": "120000",
        "REST_ADAPTER_CALL_TIMEOUT_MS": "120000",
    }
    argv = [str(BIN / "rest-bridge"), "serve", "--host", HOST, "--port", str(port)]
    argv += ["--app-server", _codex_command(mode, home)]
    if mode == "shared":
        argv += ["--app-server-mode", "shared"]
    log = _open_log(home / "bridge.log")
    bridge = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=home
    )
    base = f"http://{HOST}:{port}"
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            for _ in range(400):
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{base}/health") as response:
                        if response.status == 200:
                            break
                await asyncio.sleep(0.05)  # sync-ok: a benchmark waiting for a port
            result.base = _memory(bridge.pid)
            sessions: list[tuple[str, str]] = []
            next_checkpoint = iter(sorted(checkpoints))
            checkpoint = next(next_checkpoint, None)

            async def one() -> None:
                ms, status, created = await _timed(http, "POST", f"{base}/v1/sessions", {})
                if status != 201:
                    raise RuntimeError(f"create: {status} {created}")
                result.create_ms.append(ms)
                sid = created["sessionId"]
                url = f"{base}/v1/sessions/{sid}/call/thread/start"
                ms, status, started = await _timed(http, "POST", url, {"params": {}})
                if status != 200:
                    raise RuntimeError(f"thread/start: {status} {started}")
                result.thread_ms.append(ms)
                sessions.append((sid, started["result"]["thread"]["id"]))

            while len(sessions) < count:
                batch = min(CONCURRENCY, count - len(sessions))
                if checkpoint is not None:
                    batch = min(batch, checkpoint - len(sessions))
                try:
                    await asyncio.gather(*(one() for _ in range(batch)))
                except (RuntimeError, aiohttp.ClientError) as exc:
                    result.failed = f"at {len(sessions)} sessions: {exc}"[:300]
                    break
                if checkpoint is not None and len(sessions) >= checkpoint:
                    result.points.append((len(sessions), *_memory(bridge.pid)))
                    print(f"{mode}: {result.points[-1]}", file=sys.stderr, flush=True)
                    checkpoint = next(next_checkpoint, None)
            result.sessions = len(sessions)
            if not result.points or result.points[-1][0] != len(sessions):
                result.points.append((len(sessions), *_memory(bridge.pid)))
            if sessions:
                newest, thread_id = sessions[-1]
                call = f"{base}/v1/sessions/{newest}/call/thread/read"
                for _ in range(PROBES):
                    ms, status, _ = await _timed(http, "GET", f"{base}/health")
                    assert status == 200
                    result.health_ms.append(ms)
                    ms, status, read = await _timed(
                        http, "POST", call, {"params": {"threadId": thread_id}}
                    )
                    assert status == 200, read
                    result.call_ms.append(ms)
            for _ in range(20):
                ms, status, listed = await _timed(
                    http, "POST", f"{base}/v1/call/model/list", {"params": {}}
                )
                assert status == 200, listed
                result.sessionless_ms.append(ms)
    finally:
        bridge.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(bridge.wait(), 60)
        except TimeoutError:
            bridge.kill()
            await bridge.wait()
        log.close()
    return result


def _p(values: list[float], q: float) -> str:
    return f"{percentile(sorted(values), q):.1f}" if values else "-"


def report(results: list[Result]) -> str:
    """The results as markdown."""
    lines = [
        "| mode | sessions | processes | PSS total | PSS per session (added) | RSS per session "
        "| sessions per GB (PSS) | create p50/p99 ms | thread/start p50/p99 ms "
        "| /health p50/p99 ms | call on newest p50/p99 ms | sessionless call p50/p99 ms |",
        "|---" * 12 + "|",
    ]
    for r in results:
        n, pss, rss, procs = r.points[-1] if r.points else (0, 0, 0, 0)
        first = r.points[0] if r.points else (0, 0, 0, 0)
        added = n - first[0]
        per_pss = (pss - first[1]) / added if added else 0
        per_rss = (rss - first[2]) / added if added else 0
        all_counted = pss / n if n else 0
        lines.append(
            f"| {r.mode} | {n} | {procs} | {pss / MB:.0f} MB | {per_pss / MB:.2f} MB "
            f"(all counted {all_counted / MB:.2f}) | {per_rss / MB:.2f} MB "
            f"| {1024 * MB / all_counted if all_counted else 0:.0f} "
            f"| {_p(r.create_ms, 50)}/{_p(r.create_ms, 99)} "
            f"| {_p(r.thread_ms, 50)}/{_p(r.thread_ms, 99)} "
            f"| {_p(r.health_ms, 50)}/{_p(r.health_ms, 99)} "
            f"| {_p(r.call_ms, 50)}/{_p(r.call_ms, 99)} "
            f"| {_p(r.sessionless_ms, 50)}/{_p(r.sessionless_ms, 99)} |"
        )
    lines.append("")
    for r in results:
        points = ", ".join(f"{n}: {pss / MB:.0f} MB" for n, pss, _, _ in r.points)
        lines.append(
            f"- {r.mode}: bridge alone {r.base[0] / MB:.0f} MB PSS; PSS by sessions {points}"
        )
        if r.failed:
            lines.append(f"  - stopped {r.failed}")
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    path.write_text(text)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="stdio-launcher,stdio-native,shared")
    parser.add_argument("--sessions", type=int, default=2000, help="shared mode")
    parser.add_argument("--stdio-sessions", type=int, default=20)
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args(argv)
    raise_fd_limit()
    results = []
    for mode in args.modes.split(","):
        count = args.sessions if mode == "shared" else args.stdio_sessions
        checkpoints = [1, 10, 100, 500, 1000, 1500, 2000, count]
        checkpoints = sorted({c for c in checkpoints if c <= count})
        results.append(await _run_mode(mode, count, checkpoints))
    text = report(results)
    print(text)
    if args.json:
        _write(Path(args.json), json.dumps([r.__dict__ for r in results], indent=1))
    return 0 if all(not r.failed for r in results) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
