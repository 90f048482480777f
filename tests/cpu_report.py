"""`--cpu-report`: the CPU time each test spends, with every process it started.

Opt-in (``pytest --cpu-report`` or ``--cpu-report=N``; tests/conftest.py registers this
module as a plugin). Around each test (setup, call and teardown) the worker reads
``getrusage(RUSAGE_SELF)`` and ``getrusage(RUSAGE_CHILDREN)``: the difference is the CPU
the test spent in its own process plus that of the processes it started and reaped
(a bridge's reaped app-servers count in the bridge, and so in the test once the bridge is
reaped). A module's shared bridge is reaped at the module's end, so it counts in the
module's last test: the per-file figures are the ones to compare. A process that is
never reaped by its parent (an orphan adopted by init) is not counted.

Under pytest-xdist each worker measures its own tests and sends the figures with the
test's report (its ``user_properties``); the summary at the end of the run names the N
tests (40 unless given) and the N/2 files that spent most. ``--cpu-report-file PATH``
also writes every test's figures, one JSON object a line, to compare two runs.
"""

from __future__ import annotations

import json
import resource
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

#: The names of the figures in a report's ``user_properties``.
SELF = "cpu_self_s"
CHILDREN = "cpu_children_s"
_START = pytest.StashKey[tuple[float, float]]()


def positive_int(text: str) -> int:
    count = int(text)
    if count < 1:
        raise ValueError(text)
    return count


def add_options(parser: pytest.Parser) -> None:
    """The options (tests/conftest.py's pytest_addoption calls this)."""
    group = parser.getgroup("cpu-report", "CPU time per test")
    group.addoption(
        "--cpu-report",
        action="store",
        type=positive_int,
        nargs="?",
        const=40,
        default=None,
        metavar="N",
        help="print the N tests (default 40) and N/2 files that spent the most CPU, "
        "counting the processes each test started",
    )
    group.addoption(
        "--cpu-report-file",
        action="store",
        default=None,
        metavar="PATH",
        help="with --cpu-report, write each test's CPU figures to PATH (JSON lines)",
    )


def _enabled(config: pytest.Config) -> bool:
    return config.getoption("cpu_report", None) is not None


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    if _enabled(item.config):
        item.stash[_START] = _cpu()
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    if call.when == "teardown" and _START in item.stash:
        own_before, children_before = item.stash[_START]
        own_after, children_after = _cpu()
        item.user_properties.append((SELF, round(own_after - own_before, 3)))
        item.user_properties.append((CHILDREN, round(children_after - children_before, 3)))
    return (yield)


class _Collector:
    """In the process that prints the summary: the figures of every finished test."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.tests: dict[str, dict[str, float]] = {}
        self.wall: defaultdict[str, float] = defaultdict(float)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.wall[report.nodeid] += report.duration
        if report.when != "teardown":
            return
        figures = {
            name: value for name, value in report.user_properties if name in (SELF, CHILDREN)
        }
        if len(figures) == 2:
            self.tests[report.nodeid] = figures

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        count = int(self.config.getoption("cpu_report"))
        rows = sorted(
            ((f[SELF] + f[CHILDREN], f[SELF], f[CHILDREN], node) for node, f in self.tests.items()),
            reverse=True,
        )
        files: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
        for total, own, children, node in rows:
            entry = files[node.split("::", 1)[0]]
            entry[0] += total
            entry[1] += own
            entry[2] += children
            entry[3] += 1
        write = terminalreporter.write_line
        terminalreporter.section("CPU per test (own + started processes), seconds")
        grand = sum(row[0] for row in rows)
        write(f"{len(rows)} tests, {grand:.1f} CPU-s in all")
        write(f"{'total':>8} {'own':>8} {'children':>8} {'wall':>7}  test")
        for total, own, children, node in rows[:count]:
            write(f"{total:8.2f} {own:8.2f} {children:8.2f} {self.wall[node]:7.2f}  {node}")
        write("")
        write(f"{'total':>8} {'own':>8} {'children':>8} {'tests':>5}  file")
        by_file = sorted(files.items(), key=lambda pair: pair[1][0], reverse=True)
        for name, (total, own, children, tests) in by_file[: max(1, count // 2)]:
            write(f"{total:8.2f} {own:8.2f} {children:8.2f} {int(tests):5d}  {name}")
        path = self.config.getoption("cpu_report_file", None)
        if path:
            with Path(path).open("w", encoding="utf-8") as out:
                for node, figures in self.tests.items():
                    record = {"test": node, **figures, "wall_s": round(self.wall[node], 3)}
                    out.write(json.dumps(record) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    # The summary is printed where the terminal is: the controller under xdist, which
    # runs no test, or the single process of a run without -n.
    if _enabled(config) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Collector(config), "cpu-report-collector")
