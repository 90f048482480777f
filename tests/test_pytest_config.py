"""The project's pytest configuration turns a PytestWarning into a failure.

A PytestWarning is a mistake in a test (an asyncio mark on a sync test, say) that
pytest would otherwise only print at the end of a long run, where nobody reads it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
