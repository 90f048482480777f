"""The respx mock cannot drift from the bridge: the same scenario, run by the runner on
the real bridge and fake-codex, and driven over httpx against its respx mock, must get
the same statuses and satisfy the same expectations at every step.

The real side is `scenarios.runner.run_scenario` (every response checked against the
step and the bridge's OpenAPI document); the mock side is `respx_driver` doing what the
runner does, over httpx, with the same checks. Where the real response's body is in the
run's transcript whole, its shape (keys, nested, and JSON types) must equal the mock's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from respx_driver import drive

from scenarios.format import load_scenario
from scenarios.mock_plan import MockBuildError
from scenarios.openapi_check import OpenApiChecker
from scenarios.reporting import format_result
from scenarios.respx_mock import scenario_router
from scenarios.runner import RunOptions, ScenarioResult, run_scenario

LIBRARY = Path(__file__).resolve().parents[2] / "scenarios" / "library"
#: Library scenarios a respx mock cannot replay, and why (the library still runs them on
#: the real bridge). A listed scenario that its mock does replay fails the test below.
NOT_MOCKABLE = {
    # The mock answers a route's requests in scenario order and meets `until` with its
    # first answer: it cannot hold a slot with one request while refusing another.
    "text-turn-busy.scenario.yaml": "two text turns at once (429 busy) need real concurrency",
    # The mock's log keeps EVENT_BUFFER events; it does not weigh them.
    "event-buffer-bytes.scenario.yaml": "the mock does not model the log's byte bound",
}
#: Every library scenario on fake-codex (the real-codex one needs the real binary) that
#: a mock can replay (the test after this one holds NOT_MOCKABLE to its word).
FAKE_CODEX_SCENARIOS = sorted(
    path.name
    for path in LIBRARY.glob("*.scenario.yaml")
    if load_scenario(path).scenario.model is None and path.name not in NOT_MOCKABLE
)


def real_responses(result: ScenarioResult) -> dict[int, list[tuple[int, Any]]]:
    """Per step index: each response's status and JSON body (None when cut or not JSON)."""
    steps: dict[int, list[tuple[int, Any]]] = {}
    current: int | None = None
    for _, source, text in result.transcript.entries:
        if source == "step":
            current = int(text.split(":", 1)[0].split()[1]) - 1
            steps[current] = []
        elif source == "http" and current is not None:
            found = re.match(r"← (\d{3})(?: (.*))?$", text, re.S)
            if found:
                try:
                    body = orjson.loads(found.group(2) or "")
                except orjson.JSONDecodeError:
                    body = None
                steps[current].append((int(found.group(1)), body))
    return steps


def shape(value: Any) -> Any:
    """Keys and JSON types, not values (arrays by their first element)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "number"
    return type(value).__name__


@pytest.mark.parametrize("name", FAKE_CODEX_SCENARIOS)
@pytest.mark.asyncio
async def test_the_mock_answers_like_the_bridge(name: str, tmp_path: Path) -> None:
    loaded = load_scenario(LIBRARY / name)
    real = await run_scenario(loaded, RunOptions(tmp_root=tmp_path))
    assert real.passed, format_result(real)
    answered = real_responses(real)

    with scenario_router(loaded) as bridge:
        checker = OpenApiChecker(bridge.front.document)
        async with httpx.AsyncClient(base_url=bridge.base_url) as client:
            outcomes, seen = await drive(loaded, client, token=bridge.token, checker=checker)
        failures = {
            f"step {o.index + 1} ({o.title})": [p.message for p in o.problems]
            for o in outcomes
            if o.problems
        }
        assert failures == {}, failures
        assert {k: v for k, v in seen.items() if k != "base"} == {
            k: v for k, v in bridge.variables.items() if k != "base"
        }
    # Leaving the block checked that the host made every step.

    compared = 0
    for outcome in outcomes:
        real_statuses = {status for status, _ in answered.get(outcome.index, []) if status != 204}
        mock_statuses = {outcome.status} - {None, 204}
        step = f"step {outcome.index + 1} ({outcome.title})"
        assert real_statuses == mock_statuses, step
        bodies = [body for _, body in answered.get(outcome.index, []) if body is not None]
        if bodies and isinstance(outcome.body, dict) and not outcome.events:
            assert shape(bodies[-1]) == shape(outcome.body), step
            compared += 1
    assert compared > 0 or name == "turn-stream-and-resume.scenario.yaml"


@pytest.mark.asyncio
async def test_every_library_scenario_replays_against_its_mock() -> None:
    """Including the one on the real codex: the mock needs no binary."""
    for path in sorted(LIBRARY.glob("*.scenario.yaml")):
        loaded = load_scenario(path)
        if path.name in NOT_MOCKABLE:
            # Not replayable: either the mock cannot even be built, or it replays wrong.
            try:
                router = scenario_router(loaded, assert_all_called=False)
            except MockBuildError:
                continue
        else:
            router = scenario_router(loaded, assert_all_called=True)
        with router as bridge:
            checker = OpenApiChecker(bridge.front.document)
            async with httpx.AsyncClient(base_url=bridge.base_url) as client:
                outcomes, _ = await drive(loaded, client, token=bridge.token, checker=checker)
        problems = [o.problems for o in outcomes if o.problems]
        if path.name in NOT_MOCKABLE:
            assert problems, f"{path.name} replays now: drop it from NOT_MOCKABLE"
        else:
            assert problems == [], path.name
