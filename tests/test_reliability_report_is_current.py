"""docs/RELIABILITY.md is generated (`make reliability`): it must have a row for every
reliability test, or a test added since the last run is missing from the report.

A reliability test's row is named by the first line of its docstring (see `report` in
tests/reliability/conftest.py); the schemathesis operations, which have none, are
summed up by preset in the fuzzing table instead. Only the names are checked: the
figures are a run's, and a run at full size takes about 45 minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Collects tests/reliability and prints, for each test that asks for its `report` row
#: and has a docstring, that docstring's first line.
COLLECT = """
import json, sys
import pytest

class Names:
    names = set()

    def pytest_collection_modifyitems(self, items):
        for item in items:
            doc = getattr(getattr(item, "function", None), "__doc__", None)
            if "report" in getattr(item, "fixturenames", ()) and doc and doc.strip():
                self.names.add(doc.strip().splitlines()[0])

names = Names()
code = pytest.main(
    ["--collect-only", "-q", "-p", "no:cacheprovider", "tests/reliability"], plugins=[names]
)
print("NAMES " + json.dumps(sorted(names.names)))
sys.exit(code)
"""


@pytest.mark.timeout(600)  # collecting the fuzzing module loads schemathesis
def test_every_reliability_test_has_its_row_in_the_report() -> None:
    done = subprocess.run(
        [sys.executable, "-c", COLLECT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("NAMES "))
    names = json.loads(line.removeprefix("NAMES "))
    assert len(names) > 50, names  # the collection did find the suite
    report = (ROOT / "docs" / "RELIABILITY.md").read_text()
    cases = {
        row.split(" | ", 1)[0].removeprefix("| ").replace("\\|", "|")
        for row in report.splitlines()
        if row.startswith("| ")
    }
    missing = [name for name in names if not any(case.startswith(name) for case in cases)]
    assert not missing, f"run `make reliability` to regenerate docs/RELIABILITY.md: {missing}"
