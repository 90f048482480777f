"""The scenario library in shared mode: one app-server, each session a connection to it.

The same files, run with `REST_ADAPTER_APP_SERVER_MODE=shared` in the environment (as
`rest-bridge scenarios run` takes it from its own): the harness then builds every bridge
in shared mode, on fake-codex `--listen` (and on the real codex for the real-codex
scenarios). They run in this process, one at a time, once for both tests below. The
scenarios that cannot apply there are named in `NOT_IN_SHARED_MODE` with the reason; each
of them must still fail in shared mode, so the list cannot go stale.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from scenario_runs import run_all

from scenarios.format import load_scenario
from scenarios.harness import find_codex
from scenarios.runner import RunOptions

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "scenarios" / "library"

#: Scenarios about what only a process of one's own has, by file name, and why.
NOT_IN_SHARED_MODE: dict[str, str] = {
    "app-server-start-timeout": "spawns with `options.cwd`, which shared mode refuses (403), "
    "and times a per-session process's `initialize`",
    "app-server-protocol-errors": "expects the broken process SIGKILLed; in shared mode the "
    "bridge closes that connection and the app-server serves on",
    "crash-and-garbage": "expects the session's exit code (3) and stderr; a connection has "
    "neither, and the shared stderr is never put in one session's exit event",
    "crash-mid-turn": "expects the session's process exit code (7); a connection has none",
    "limits": "expects a wedged process of the session's own to be SIGKILLed at delete",
    "until-and-delays": "expects the session's own stderr tail in its exit event",
}


#: A run's outcome as JUnit names it.
JUNIT = {"passed": "passed", "failed": "failure", "skipped": "skipped"}


@pytest.fixture(scope="module")
def shared_mode(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each library scenario's outcome in shared mode (`passed`, `failure` or `skipped`),
    by name: every file run once, in this process, one at a time (`scenario_runs`),
    with the real codex of .codex-npm/ for those that script the model."""
    files = sorted(LIBRARY.glob("*.scenario.yaml"))
    options = RunOptions(codex=find_codex(root=ROOT), tmp_root=tmp_path_factory.mktemp("shared"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("REST_ADAPTER_APP_SERVER_MODE", "shared")
        results = asyncio.run(run_all([load_scenario(path) for path in files], options))
    return {name(path): JUNIT[result.outcome] for path, result in zip(files, results, strict=True)}


def name(path: Path) -> str:
    return path.name.removesuffix(".scenario.yaml")


@pytest.mark.quick
def test_every_scenario_left_out_exists_and_says_why() -> None:
    names = {name(p) for p in LIBRARY.glob("*.scenario.yaml")}
    assert set(NOT_IN_SHARED_MODE) <= names
    assert all(len(reason) > 20 for reason in NOT_IN_SHARED_MODE.values())


# Both read one run of the library (the module's fixture): on one worker.
@pytest.mark.xdist_group("library-shared-mode")
@pytest.mark.timeout(600)
def test_the_library_passes_in_shared_mode(shared_mode: dict[str, str]) -> None:
    files = sorted(p for p in LIBRARY.glob("*.scenario.yaml") if name(p) not in NOT_IN_SHARED_MODE)
    outcomes = {n: o for n, o in shared_mode.items() if n not in NOT_IN_SHARED_MODE}
    assert set(outcomes) == {name(p) for p in files}
    # A real-codex scenario may skip on a laptop without codex; never under CI=true.
    allowed = {"passed"} if os.environ.get("CI") == "true" else {"passed", "skipped"}
    assert {n: o for n, o in outcomes.items() if o not in allowed} == {}


@pytest.mark.xdist_group("library-shared-mode")
@pytest.mark.timeout(600)
def test_the_scenarios_left_out_do_fail_in_shared_mode(shared_mode: dict[str, str]) -> None:
    outcomes = {n: o for n, o in shared_mode.items() if n in NOT_IN_SHARED_MODE}
    assert outcomes == dict.fromkeys(NOT_IN_SHARED_MODE, "failure")
