"""docs/RELIABILITY.md is generated (`make reliability`): it must have a row for every
reliability test, or a test added since the last run is missing from the report.

A reliability test's row is named by the first line of its docstring (see `report` in
tests/reliability/conftest.py); the schemathesis operations, which have none, are
summed up by preset in the fuzzing table instead. Only the names are checked: the
figures are a run's, and a run at full size takes about 45 minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ["pytester"]


class Names:
    """For each test that asks for its `report` row and has a docstring, that
    docstring's first line."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            doc = getattr(getattr(item, "function", None), "__doc__", None)
            if "report" in getattr(item, "fixturenames", ()) and doc and doc.strip():
                self.names.add(doc.strip().splitlines()[0])


# Collecting the fuzzing module loads schemathesis, unless this process has already.
@pytest.mark.timeout(600)
def test_every_reliability_test_has_its_row_in_the_report(pytester: pytest.Pytester) -> None:
    # In this process: the collection is the same pytest's with the same plugins, and a
    # run of the whole suite has imported the modules it reads already.
    found = Names()
    args = ("--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "reliability"))
    # What it would assert-rewrite is imported here already (the project's packages).
    args += ("-W", "ignore::pytest.PytestAssertRewriteWarning")
    collected = pytester.inline_run(*args, plugins=[found])
    assert collected.ret == pytest.ExitCode.OK, collected.getreports()[-3:]
    names = sorted(found.names)
    assert len(names) > 50, names  # the collection did find the suite
    report = (ROOT / "docs" / "RELIABILITY.md").read_text()
    cases = {
        row.split(" | ", 1)[0].removeprefix("| ").replace("\\|", "|")
        for row in report.splitlines()
        if row.startswith("| ")
    }
    missing = [name for name in names if not any(case.startswith(name) for case in cases)]
    assert not missing, f"run `make reliability` to regenerate docs/RELIABILITY.md: {missing}"
