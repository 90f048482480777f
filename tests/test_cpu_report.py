"""`--cpu-report` (tests/cpu_report.py): each test's CPU, its started processes' included."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent
#: CPU seconds the busy child of the test below spends, at least.
BUSY_SECONDS = 0.3


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project whose conftest registers the report as this project's tests/conftest.py does."""
    pytester.makeconftest(
        f"""
        import sys

        sys.path.append({str(TESTS)!r})
        import cpu_report

        def pytest_addoption(parser):
            cpu_report.add_options(parser)

        def pytest_configure(config):
            config.pluginmanager.register(cpu_report, "cpu_report")
        """
    )
    pytester.makepyfile(
        test_busy=textwrap.dedent(
            f"""
            import subprocess, sys

            BUSY = "import time\\nwhile time.process_time() < {BUSY_SECONDS}: pass"

            def test_starts_a_busy_child():
                subprocess.run([sys.executable, "-c", BUSY], check=True)

            def test_idle():
                pass
            """
        )
    )
    return pytester


def test_a_child_process_counts_in_the_test_that_started_it(project: pytest.Pytester) -> None:
    figures = project.path / "cpu.jsonl"
    result = project.runpytest(
        "-p", "no:cacheprovider", "--cpu-report=5", f"--cpu-report-file={figures}"
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*CPU per test (own + started processes), seconds*",
            "2 tests, * CPU-s in all",
            "*test_busy.py::test_starts_a_busy_child",
            "*test_busy.py::test_idle",
            "* 2  test_busy.py",
        ]
    )
    rows = {row["test"]: row for row in map(json.loads, figures.read_text().splitlines())}
    busy = rows["test_busy.py::test_starts_a_busy_child"]
    assert busy["cpu_children_s"] >= BUSY_SECONDS
    assert rows["test_busy.py::test_idle"]["cpu_children_s"] < BUSY_SECONDS


def test_without_the_option_nothing_is_measured_or_printed(project: pytest.Pytester) -> None:
    result = project.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert "CPU per test" not in result.stdout.str()


def test_a_count_below_one_is_a_usage_error(project: pytest.Pytester) -> None:
    result = project.runpytest("-p", "no:cacheprovider", "--cpu-report=0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--cpu-report: invalid positive_int value: '0'*"])
