"""The respx mock cannot drift from the bridge: every library scenario is recorded on
the real bridge (the recording run is the scenario's run: it must pass), and a host
doing exactly what the steps say, over httpx against the replay of that cassette, must
satisfy the same expectations at every step and make every recorded exchange.

There is no list of scenarios a mock cannot replay: a replay serves what the bridge
said, concurrency (`text-turn-busy`) and byte bounds (`event-buffer-bytes`) included.

The recording run is also `make test`'s one run of each library scenario on the bridge
(pyproject.toml's testpaths do not collect `scenarios/library` a second time through
the plugin): a scenario that fails there fails here, with the runner's report.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from respx_driver import drive

from bridge.auth import with_bearer_auth
from scenarios.cassette import Cassette, record_cassette
from scenarios.format import load_scenario
from scenarios.harness import PRESETS, checker_for, find_codex
from scenarios.respx_mock import ScenarioRouter
from scenarios.runner import RunOptions

LIBRARY = Path(__file__).resolve().parents[2] / "scenarios" / "library"
SCENARIOS = sorted(path.name for path in LIBRARY.glob("*.scenario.yaml"))


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.asyncio
async def test_the_replay_answers_like_the_bridge(name: str, tmp_path: Path) -> None:
    loaded = load_scenario(LIBRARY / name)
    if loaded.scenario.real_codex and find_codex() is None and not RunOptions().require_codex:
        pytest.skip("no real codex to record from")
    recorded, _ = await record_cassette(loaded, RunOptions(tmp_root=tmp_path))
    # What is replayed is what the file says, not what the recorder held in memory.
    recorded.save(tmp_path / "cassette.yaml")
    cassette = Cassette.load(tmp_path / "cassette.yaml")
    assert cassette.dump() == recorded.dump()
    assert cassette.interactions, name

    # Each replayed response is checked against the preset's OpenAPI document too.
    spec = loaded.scenario.bridge
    app = PRESETS[spec.preset](["fake-codex"], spec.rest_limits())
    if spec.token is not None:
        with_bearer_auth(app, spec.token, exempt_health=spec.exempt_health)
    checker = checker_for(app)
    with ScenarioRouter(loaded, cassette) as bridge:
        async with httpx.AsyncClient(base_url=bridge.base_url) as client:
            outcomes, _ = await drive(
                loaded,
                client,
                token=bridge.token,
                checker=checker if loaded.scenario.bridge.contract_check else None,
            )
        failures = {
            f"step {o.index + 1} ({o.title})": [p.message for p in o.problems]
            for o in outcomes
            if o.problems
        }
        assert failures == {}, failures
    # Leaving the block checked that the host made every recorded exchange.
    assert len(outcomes) == len(loaded.scenario.steps)
