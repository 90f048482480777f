"""The project's pytest configuration turns a PytestWarning into a failure.

A PytestWarning is a mistake in a test (an asyncio mark on a sync test, say) that
pytest would otherwise only print at the end of a long run, where nobody reads it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MISTAKE = """
import pytest

pytestmark = pytest.mark.asyncio


def test_sync_under_an_asyncio_mark():
    assert True
"""


def test_a_pytest_warning_fails_the_run(tmp_path: Path) -> None:
    (tmp_path / "test_mistake.py").write_text(MISTAKE)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-q",
            str(tmp_path / "test_mistake.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "is marked with '@pytest.mark.asyncio' but it is not an async function" in done.stdout


@pytest.mark.quick
def test_a_test_that_sets_no_timeout_gets_the_projects(request: pytest.FixtureRequest) -> None:
    """120 s, from conftest.py (not pyproject.toml, which a checkout without pytest-timeout
    also reads)."""
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None
    assert marker.args == (120,)


@pytest.mark.quick
@pytest.mark.timeout(7)
def test_a_test_that_sets_its_timeout_keeps_it(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None
    assert marker.args == (7,)
