"""5. Text turns: ``POST /v1/text-turn`` against the same turn driven over the pipe.

Both sides do the same work: spawn fake-codex, initialize, thread/start, turn/start,
read until turn/completed, stop the process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import orjson

from bench.common import Bridge, Section, http_json, log
from bench.pipe import Pipe

TURNS = 5
TEXT = "hello"


def direct_turn() -> float:
    start = time.perf_counter()
    with Pipe() as pipe:
        pipe.initialize()
        thread = pipe.call("thread/start", {})["thread"]["id"]
        pipe.call("turn/start", {"threadId": thread, "input": [{"type": "text", "text": TEXT}]})
        for _ in range(10_000):
            message = orjson.loads(pipe.read_line())
            if message.get("method") == "turn/completed":
                break
        else:
            raise RuntimeError("no turn/completed")
    return time.perf_counter() - start


def bridge_turn(bridge: Bridge) -> float:
    start = time.perf_counter()
    status, body = http_json(bridge.port, "POST", "/v1/text-turn", {"text": TEXT})
    elapsed = time.perf_counter() - start
    if status != 200 or body.get("status") != "completed":
        raise RuntimeError(f"text turn: {status} {body}")
    return elapsed


def run(repeats: int, options: dict[str, Any]) -> Section:
    section = Section("turns", "5. Text turns")
    log("turns: direct and through the bridge")
    direct: list[float] = []
    bridged: list[float] = []
    with Bridge(loop=options.get("loop")) as bridge:
        direct_turn()
        bridge_turn(bridge)
        for _ in range(repeats):
            direct.append(statistics.median(direct_turn() for _ in range(TURNS)) * 1000)
            bridged.append(statistics.median(bridge_turn(bridge) for _ in range(TURNS)) * 1000)
    section.add(
        f"one-shot turn, end to end (median of {TURNS} per repeat)",
        "ms",
        bridged,
        baseline=direct,
        baseline_name="driven over the pipe",
    )
    section.notes.append(
        "Sequential turns from the driver process (a Python client adds well under 1 ms to a"
        " turn); both sides include stopping the process (close stdin, wait for the exit)."
    )
    return section
