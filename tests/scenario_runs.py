"""The scenarios of the library run in this process, one after another, for the tests
that check a property of every scenario (its messages against the real schema, the
library in shared mode).

One at a time: the runs would share this process's one thread (each its bridge, its
harness and its deadlines), and a scenario whose limits are a few hundred milliseconds
(`session-idle-reaping`'s idle timeout) failed when two others held that thread between
two of its steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from scenarios.format import LoadedScenario
from scenarios.runner import RunOptions, ScenarioResult, run_scenario


async def run_all(scenarios: Sequence[LoadedScenario], options: RunOptions) -> list[ScenarioResult]:
    """Each scenario's result, in the order given."""
    return [await run_scenario(loaded, options) for loaded in scenarios]
