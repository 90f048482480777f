"""A host team's first hour: `pip install` the package into a new project, write a
ten-line scenario and a five-line pytest test, and both run green.

Slow (about 40 s here: wheel 5 s, venv 5 s, install 20 s, the runs 10 s): it builds a
wheel of this checkout, makes a fresh virtual environment and installs the wheel with
its `harness` extra through pip as the machine has it set up (its index and find-links
configuration; offline when those are local), then runs pytest and the scenario
runner there, with nothing of this checkout on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = """\
scenario: 1
name: hello
appServer:
  version: 1
  turns: [Hello from my scenario.]
steps:
  - http: {method: POST, path: /v1/text-turn, json: {text: hi}}
    expect:
      jsonSubset: {text: Hello from my scenario., status: completed}
"""

TEST = """\
import pytest
@pytest.mark.asyncio
async def test_health(bridge_client):
    async with bridge_client.get("/health") as response:
        assert response.status == 200
"""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"{' '.join(args)}\n{done.stdout}\n{done.stderr}"
    return done


def test_pip_install_then_a_scenario_and_a_test_run_green(tmp_path: Path) -> None:
    assert len(SCENARIO.splitlines()) <= 10
    assert len(TEST.splitlines()) <= 5
    # The host's environment: none of this checkout's Python settings leak in.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")
        and not key.startswith(("FAKE_CODEX_", "REST_ADAPTER_"))
    }
    timings: dict[str, float] = {}

    started = time.monotonic()
    wheels = tmp_path / "wheels"
    run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), "."],
        ROOT,
        env,
    )
    [wheel] = wheels.glob("codex_rest_bridge-*.whl")
    timings["build the wheel"] = time.monotonic() - started

    started = time.monotonic()
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    timings["make the venv"] = time.monotonic() - started

    started = time.monotonic()
    python = str(venv / "bin" / "python")
    run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         f"{wheel}[harness]"],
        tmp_path,
        env,
    )  # fmt: skip
    timings["pip install"] = time.monotonic() - started

    project = tmp_path / "host-project"
    project.mkdir()
    (project / "hello.scenario.yaml").write_text(SCENARIO)
    (project / "test_bridge.py").write_text(TEST)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    started = time.monotonic()
    done = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], project, env)
    timings["pytest"] = time.monotonic() - started
    assert "2 passed" in done.stdout, done.stdout
    assert str(ROOT) not in done.stdout  # the plugin came from the venv, not this checkout

    started = time.monotonic()
    done = run([str(venv / "bin" / "rest-bridge"), "scenarios", "run", "."], project, env)
    timings["rest-bridge scenarios run"] = time.monotonic() - started
    assert "1 passed, 0 failed" in done.stdout, done.stdout

    where = run(
        [python, "-c", "import scenarios.pytest_plugin as p; print(p.__file__)"], project, env
    )
    assert where.stdout.startswith(str(venv)), where.stdout
    print("timings:", ", ".join(f"{name} {seconds:.1f}s" for name, seconds in timings.items()))
