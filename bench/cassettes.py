"""Cassettes of the library: how long recording takes, how big they are, how fast the
respx mock replays them (a host doing what the steps say, over httpx).

    .venv/bin/python -m bench.cassettes        # prints a Markdown table
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scenarios.cassette import Cassette, record_cassette
from scenarios.format import load_scenario
from scenarios.respx_mock import ScenarioRouter
from scenarios.runner import RunOptions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scenarios"))
from respx_driver import drive  # noqa: E402


async def main() -> None:
    rows, totals = [], [0.0, 0, 0.0, 0.0]
    for path in sorted((ROOT / "scenarios" / "library").glob("*.scenario.yaml")):
        loaded = load_scenario(path)
        if loaded.scenario.real_codex:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            cassette, _ = await record_cassette(loaded, RunOptions(tmp_root=Path(tmp)))
            recorded = time.perf_counter() - started
            file = Path(tmp) / "c.yaml"
            cassette.save(file)
            size = file.stat().st_size
            started = time.perf_counter()
            cassette = Cassette.load(file)
            loaded_in = time.perf_counter() - started
        started = time.perf_counter()
        with ScenarioRouter(loaded, cassette) as bridge:
            async with httpx.AsyncClient(base_url=bridge.base_url) as client:
                await drive(loaded, client, token=bridge.token)
        replayed = time.perf_counter() - started
        rows.append((path.name, len(cassette.interactions), size, recorded, loaded_in, replayed))
        for i, value in enumerate((recorded, size, loaded_in, replayed)):
            totals[i] += value
    print("| scenario | exchanges | cassette | record (real bridge) | load | replay |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, count, size, recorded, loaded_in, replayed in rows:
        print(
            f"| {name} | {count} | {size / 1024:.1f} KiB | {recorded:.2f} s | "
            f"{loaded_in * 1000:.1f} ms | {replayed * 1000:.0f} ms |"
        )
    print(
        f"| **{len(rows)} scenarios** | | {totals[1] / 1024:.0f} KiB | {totals[0]:.1f} s | "
        f"{totals[2] * 1000:.0f} ms | {totals[3] * 1000:.0f} ms |"
    )


if __name__ == "__main__":
    asyncio.run(main())
