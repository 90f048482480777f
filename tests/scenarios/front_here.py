"""`rest-bridge scenarios run|check ARGS` without the front's two Python processes.

The front (scenarios/cli.py) starts pytest with the arguments `pytest_arguments` (or
`check_arguments`) makes of its own; here that same pytest runs in this process, in
`pytester`'s folder. For what a run reports and how it ends; what the front's own
processes do (signals, what a run leaves behind, xdist's workers) is started for real.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from scenarios.cli import check_arguments, main, pytest_arguments

#: pytest-timeout's alarm, set and cleared by the run in here, would clear the test's own;
#: the modules it would assert-rewrite are imported here already (no news for the run).
IN_PROCESS = ("-p", "no:timeout", "-W", "ignore::pytest.PytestAssertRewriteWarning")


def in_process(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """pytest ARGS on `pytester`'s folder, in this process, as a pytest of its own would
    run: a warning that one only prints on its stderr (a plugin's, at configuration
    time) is neither made an error by this test's filters (the project makes pytest's
    warnings errors) nor counted as this test's; what the run reports is its own."""
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("default", pytest.PytestWarning)
        return pytester.runpytest_inprocess(*args, *IN_PROCESS)


@dataclass
class Ran:
    """How a run ended and what it printed, as `subprocess.CompletedProcess` has them."""

    returncode: int
    stdout: str
    stderr: str


def run_here(pytester: pytest.Pytester, *args: str, front: bool = True) -> Ran:
    """`rest-bridge scenarios ARGS` (`run` or `check` first), or with `front=False` pytest
    given ARGS as they are (the plugin's own options), run in this process."""
    if front:
        action, *rest = args
        argv = check_arguments(rest) if action == "check" else pytest_arguments(rest)
    else:
        argv = list(args)
    result = in_process(pytester, *argv)
    return Ran(int(result.ret), "\n".join(result.outlines), "\n".join(result.errlines))


def main_here(argv: Sequence[str]) -> int:
    """`rest-bridge scenarios ARGV` by its main, in this process, leaving the logging set
    up as it found it (the record commands quiet the bridge's logs for the process
    they run in, which here is a worker that runs other tests next)."""
    root, bridge = logging.getLogger(), logging.getLogger("bridge")
    handlers, level = list(root.handlers), bridge.level
    try:
        return main(list(argv))
    finally:
        root.handlers[:] = handlers
        bridge.setLevel(level)
