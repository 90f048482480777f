"""`rest-bridge serve` stopped by a signal while it has work in flight.

The bridge runs as a real child process. On SIGTERM (or SIGINT) it must stop every
app-server within SHUTDOWN_GRACE_MS (SIGKILL for those that ignore SIGTERM), end every
stream with its session's ``exit`` event, answer the requests in flight, leave no
process behind, and exit with status 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest
from processes import storm_of_sigterm_after_sigint

from scenarios.openapi_check import OpenApiChecker
from scenarios.sse import SseReader

pytestmark = pytest.mark.asyncio

THEME = "Shutdown"
GRACE_MS = 1000

SCRIPT = {
    "methods": {
        "x/stall": {
            "steps": [
                {"notify": {"method": "x/stalling", "params": {}}},
                {"stall": {"ignoreTerm": True}},
            ]
        },
    },
    "turns": [{"steps": [{"stall": {"ignoreTerm": True}}]}],
}


async def contract(http, contract_checkers, served) -> None:
    async with http.get(served.base + "/v1/openapi.json") as response:
        contract_checkers[served.base] = OpenApiChecker(await response.json())


async def create(http, base: str) -> str:
    async with http.post(base + "/v1/sessions", json={}) as response:
        body = await response.json()
        assert response.status == 201, body
        return str(body["sessionId"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_signal_during_live_sessions_streams_calls_and_turns(
    bridge_process, http, contract_checkers, write_script, report, eventually, sig
):
    """Signalled while sessions, SSE streams, a long-poll, a call and a text turn are live"""
    served = bridge_process(
        env={
            "FAKE_CODEX_SCRIPT": write_script(SCRIPT),
            "REST_ADAPTER_SHUTDOWN_GRACE_MS": str(GRACE_MS),
            "REST_ADAPTER_SSE_KEEPALIVE_MS": "60000",
        }
    )
    await contract(http, contract_checkers, served)
    sessions = [await create(http, served.base) for _ in range(4)]
    streams = []
    for session_id in sessions:
        response = await http.get(f"{served.base}/v1/sessions/{session_id}/events/stream?after=0")
        assert response.status == 200
        streams.append(response)
    readers = [SseReader(r) for r in streams]
    # A call that the app-server will never answer, stuck in its stall.
    call = asyncio.ensure_future(
        http.post(
            f"{served.base}/v1/sessions/{sessions[0]}/call/x/stall",
            json={"params": {}, "timeoutMs": 600_000},
        )
    )
    await readers[0].until(lambda f: f.json()["method"] == "x/stalling", timeout=30)
    status, listing = 0, None
    async with http.get(served.base + "/v1/sessions") as response:
        status, listing = response.status, await response.json()
    assert status == 200
    after = listing["sessions"][1]["nextSeq"] - 1
    poll = asyncio.ensure_future(
        http.get(f"{served.base}/v1/sessions/{sessions[1]}/events?after={after}&waitMs=600000")
    )
    turn = asyncio.ensure_future(
        http.post(served.base + "/v1/text-turn", json={"text": "hi", "timeoutMs": 600_000})
    )

    # Every request is in: the bridge has read all 7 (4 streams, the call, the long-poll
    # and the text turn), and the text turn's own app-server is running. Counted by the
    # connections' state, not against a socket baseline: a connection of an earlier,
    # answered request may still be closing on the bridge's side when a baseline is
    # taken, and under load such a baseline was never reached.
    def all_in() -> bool:
        return served.resources.requests_read() == 7 and len(served.resources.processes()) == 5

    await eventually(all_in, 60, what="every request in flight")
    started = time.monotonic()
    served.signal(sig)
    code = await asyncio.to_thread(served.wait, 30)
    stopped_ms = round((time.monotonic() - started) * 1000)
    assert code == 0, served.output
    exits = []
    for reader in readers:
        frames = await reader.rest(timeout=10)
        assert frames, "the stream ended without its exit event"
        assert frames[-1].event == "exit"
        exits.append(frames[-1].json()["params"])
    for response in streams:
        response.release()
    results: dict[str, Any] = {}
    for name, pending in (("call", call), ("long-poll", poll), ("text turn", turn)):
        response = await pending
        results[name] = response.status
        if response.status != 200:
            body = await response.json()
            assert response.status in (409, 502), body
            results[name] = f"{response.status} {body['error']}"
        response.release()
    assert served.resources.processes() == frozenset()
    assert "Traceback" not in served.output
    assert "rest-bridge: stopping" in served.output
    report.figures.update(
        {
            "shutdownGraceMs": GRACE_MS,
            "signalToExitMs": stopped_ms,
            "exitSignals": sorted({str(e["signal"]) for e in exits}),
            **results,
        }
    )
    report.survived = True
    report.nothing_lost = True
    report.no_leak = True
    report.outcome = (
        f"exit 0 in {stopped_ms} ms; every stream ended with its exit event; in flight: {results}"
    )


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_storm_of_stop_signals_never_kills_a_bridge_on_its_way_out(
    bridge_process, report, loop
):
    """SIGINT, then SIGTERM without a pause until the bridge has exited, five times"""
    # A replica of `rest-bridge cluster` gets Ctrl-C from the terminal and SIGTERM from
    # the launcher just after. Stopped, the bridge ignores both; when its loop's handlers
    # were swapped for SIG_IGN one at a time, SIGTERM had a moment at its default (about
    # one bridge in five died of it; a storm could fill the loop's wakeup pipe and hang
    # CPython's handler).
    codes = []
    for _ in range(5):
        served = bridge_process(extra_args=["--loop", loop])
        await asyncio.to_thread(storm_of_sigterm_after_sigint, served.process)
        codes.append(served.wait(30))
        # Nor a word about them (CPython reports a signal that meets SIG_IGN as it is set).
        assert "Traceback" not in served.output, served.output
    assert codes == [0] * 5, "a negative code is death by that signal"
    report.figures = {"bridges": 5, "exitCodes": sorted(set(codes))}
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = "every bridge exit 0: the signals after the first are ignored"


async def test_idle_bridge_stops_at_once(bridge_process, http, report):
    """SIGTERM with nothing running"""
    served = bridge_process()
    async with http.get(served.base + "/health") as response:
        assert response.status == 200
    started = time.monotonic()
    served.signal(signal.SIGTERM)
    code = await asyncio.to_thread(served.wait, 30)
    report.figures["signalToExitMs"] = round((time.monotonic() - started) * 1000)
    assert code == 0, served.output
    assert served.resources.processes() == frozenset()
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = "exit 0"
