"""The scenario library in shared mode: one app-server, each session a connection to it.

The same files, run by `rest-bridge scenarios run` with `REST_ADAPTER_APP_SERVER_MODE=shared`
in its environment: the harness then builds every bridge in shared mode, on fake-codex
`--listen` (and on the real codex for the real-codex scenarios). The scenarios that cannot
apply there are named in `NOT_IN_SHARED_MODE` with the reason; each of them must still
fail in shared mode, so the list cannot go stale.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from processes import quiet_pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "scenarios" / "library"
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))

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


def run_library(files: list[Path], tmp_path: Path) -> dict[str, str]:
    """Each scenario's outcome (`passed`, `failure`, `error` or `skipped`), by name."""
    # From the project's root, as test_scenario_runner.py runs it: the real codex of
    # .codex-npm/ is found there (and must be, under CI=true).
    junit = tmp_path / "junit.xml"
    done = subprocess.run(
        [REST_BRIDGE, "scenarios", "run", *map(str, files), "-n", "2", f"--junitxml={junit}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=quiet_pytest({**os.environ, "REST_ADAPTER_APP_SERVER_MODE": "shared"}),
        timeout=300,
        check=False,
    )
    assert junit.exists(), done.stdout[-5000:] + done.stderr
    outcomes = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        tags = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.attrib["name"]] = tags[0] if tags else "passed"
    return outcomes


def name(path: Path) -> str:
    return path.name.removesuffix(".scenario.yaml")


@pytest.mark.quick
def test_every_scenario_left_out_exists_and_says_why() -> None:
    names = {name(p) for p in LIBRARY.glob("*.scenario.yaml")}
    assert set(NOT_IN_SHARED_MODE) <= names
    assert all(len(reason) > 20 for reason in NOT_IN_SHARED_MODE.values())


@pytest.mark.timeout(600)
def test_the_library_passes_in_shared_mode(tmp_path: Path) -> None:
    files = sorted(p for p in LIBRARY.glob("*.scenario.yaml") if name(p) not in NOT_IN_SHARED_MODE)
    outcomes = run_library(files, tmp_path)
    assert set(outcomes) == {name(p) for p in files}
    # A real-codex scenario may skip on a laptop without codex; never under CI=true.
    allowed = {"passed"} if os.environ.get("CI") == "true" else {"passed", "skipped"}
    assert {n: o for n, o in outcomes.items() if o not in allowed} == {}


@pytest.mark.timeout(600)
def test_the_scenarios_left_out_do_fail_in_shared_mode(tmp_path: Path) -> None:
    files = sorted(LIBRARY / f"{n}.scenario.yaml" for n in NOT_IN_SHARED_MODE)
    outcomes = run_library(files, tmp_path)
    assert outcomes == dict.fromkeys(NOT_IN_SHARED_MODE, "failure")
