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

import psutil
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


def run_node(example: Path, *args: str) -> subprocess.CompletedProcess[str]:
    scripts = str(Path(sys.executable).parent)
    return subprocess.run(
        [node_binary(), "--test", "--test-reporter=spec", *args, "host.test.mjs"],
        cwd=example,
        env={**os.environ, "PATH": scripts + os.pathsep + os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_host_bug_fails_the_node_suite_within_its_deadline_leaving_no_process(
    tmp_path: Path,
) -> None:
    """The example's host, changed to never answer the approval, times out instead of
    hanging on the bridge's keep-alives, and what it started is gone when node exits."""
    example = Path(shutil.copytree(EXAMPLE, tmp_path / "node-host"))
    test_file = example / "host.test.mjs"
    text = test_file.read_text()
    answer, deadline = "      const answer = await call(", "timeout: 60_000"
    assert answer in text
    assert deadline in text
    text = text.replace(answer, "      continue;\n" + answer).replace(deadline, "timeout: 5_000")
    test_file.write_text(text)
    done = run_node(example, "--test-name-pattern=fake-codex")
    assert done.returncode != 0
    assert "test timed out after 5000ms" in done.stdout, done.stdout
    left = [
        process.pid
        for process in psutil.process_iter(["cmdline"])
        if any(str(example) in part for part in process.info["cmdline"] or [])
    ]
    assert left == []


def test_the_node_host_suite_passes_on_the_bridge_and_on_the_replay_server(
    tmp_path: Path,
) -> None:
    node_binary()
    # A copy, where the cassette is recorded (cassettes are made at test time).
    example = Path(shutil.copytree(EXAMPLE, tmp_path / "node-host"))
    cassette_for(load_scenario(example / "host.scenario.yaml"), record="once")
    done = run_node(example)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pass 2" in done.stdout, done.stdout
    assert "fail 0" in done.stdout, done.stdout
