"""examples/node-host: a host's test suite in Node (`node --test`, no npm package) runs
against `rest-bridge serve` on fake-codex playing a scenario file, and against
`rest-bridge-scenarios replay` with that scenario's cassette; this runs it as part of
the suite. Node is needed: without it the test skips, but fails when `CI=true`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios.cassette import cassette_for
from scenarios.format import load_scenario

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node-host"


def node_binary() -> str:
    found = shutil.which("node")
    if not found:
        message = "node is not installed (examples/node-host needs node 20 or newer)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def test_the_node_host_suite_passes_on_the_bridge_and_on_the_replay_server(
    tmp_path: Path,
) -> None:
    node = node_binary()
    # A copy, where the cassette is recorded (cassettes are made at test time).
    example = Path(shutil.copytree(EXAMPLE, tmp_path / "node-host"))
    cassette_for(load_scenario(example / "host.scenario.yaml"), record="once")
    scripts = str(Path(sys.executable).parent)
    done = subprocess.run(
        [node, "--test", "--test-reporter=spec", "host.test.mjs"],
        cwd=example,
        env={**os.environ, "PATH": scripts + os.pathsep + os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pass 2" in done.stdout, done.stdout
    assert "fail 0" in done.stdout, done.stdout
