"""Many scenarios run in this process, a few at a time, for the tests that check a
property of every scenario of the library (its messages against the real schema, the
library in shared mode).

Each run has its own bridge, port, folder and fake-codex (`scenarios.runner`), so runs
can share an event loop; while one waits on a deadline of its own, the others go on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from scenarios.format import LoadedScenario
from scenarios.runner import RunOptions, ScenarioResult, run_scenario

#: How many scenarios run side by side: as many as `rest-bridge scenarios run -n 2` has,
#: and one more to fill the time the others spend waiting.
AT_ONCE = 3


async def run_all(
    scenarios: Sequence[LoadedScenario], options: RunOptions, at_once: int = AT_ONCE
) -> list[ScenarioResult]:
    """Each scenario's result, in the order given: up to `at_once` at a time, and a
    `parallel: false` one with nothing beside it (after the others)."""
    gate = asyncio.Semaphore(at_once)

    async def run(loaded: LoadedScenario) -> ScenarioResult:
        async with gate:
            return await run_scenario(loaded, options)

    together = [loaded for loaded in scenarios if loaded.scenario.parallel]
    results = dict(zip(map(id, together), await asyncio.gather(*map(run, together)), strict=True))
    for loaded in scenarios:
        if not loaded.scenario.parallel:
            results[id(loaded)] = await run_scenario(loaded, options)
    return [results[id(loaded)] for loaded in scenarios]
