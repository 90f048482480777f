"""Header flood: the bridge's resident memory under heads that never end.

N connections each send ``GET /health`` and then HEADERS headers of HEADER_BYTES bytes,
never the blank line that ends a head. Resident memory (VmRSS of the `rest-bridge serve`
process, from /proc) is read before, once every connection has sent all it could (or
was closed by the bridge), and after every connection is closed.

    python -m bench.header_flood --connections 300
    python -m bench.header_flood --connections 1000

Run from the repository (or with PYTHONPATH set to another checkout's, to measure it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
FAKE = str(Path(sys.executable).with_name("fake-codex")) + " app-server"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def flood(port: int, headers: int, header_bytes: int) -> tuple[bool, asyncio.StreamWriter]:
    """Send one never-ending head; (whether the bridge refused it, the open writer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    line = b"X-Flood: " + b"v" * (header_bytes - 11) + b"\r\n"
    refused = False
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: bridge\r\n")
        for _ in range(headers):
            writer.write(line)
            await writer.drain()
    except ConnectionError:
        refused = True
    if not refused:
        # Everything sent: the bridge refuses (and closes) once over its bound, or holds it.
        try:
            answer = await asyncio.wait_for(reader.read(200), timeout=2.0)
            refused = answer.startswith(b"HTTP/1.1 4")
        except (TimeoutError, ConnectionError):
            pass
    return refused, writer


def start_bridge() -> tuple[subprocess.Popen[str], int]:
    """A `rest-bridge serve` on a free port (auth on, the fake app-server), and its port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    env["REST_ADAPTER_TOKEN"] = "bench-token"
    bridge = subprocess.Popen(
        [REST_BRIDGE, "serve", "--port", "0", "--app-server", FAKE],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert bridge.stdout is not None
    for text in bridge.stdout:
        found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
        if found:
            return bridge, int(found.group(1))
    bridge.wait(timeout=30)
    raise SystemExit("the bridge did not start")


async def run(pid: int, port: int, connections: int, headers: int, header_bytes: int) -> None:
    before = rss_mb(pid)
    results = await asyncio.gather(
        *(flood(port, headers, header_bytes) for _ in range(connections))
    )
    during = rss_mb(pid)
    for _, writer in results:
        writer.close()
    await asyncio.gather(*(w.wait_closed() for _, w in results), return_exceptions=True)
    await asyncio.sleep(1.0)  # a benchmark, not a test: let the bridge see the closes
    after = rss_mb(pid)
    refused = sum(r for r, _ in results)
    print(
        f"connections={connections} headers={headers}x{header_bytes}B "
        f"refused={refused} rss_mb before={before:.0f} during={during:.0f} after={after:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--headers", type=int, default=120)
    parser.add_argument("--header-bytes", type=int, default=8000)
    args = parser.parse_args()
    bridge, port = start_bridge()
    try:
        asyncio.run(run(bridge.pid, port, args.connections, args.headers, args.header_bytes))
    finally:
        bridge.terminate()
        bridge.wait(timeout=30)


if __name__ == "__main__":
    main()
