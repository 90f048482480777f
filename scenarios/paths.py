"""Where the pytest plugin's fixtures find the files they are given by path.

A module of its own, not one of the plugin's: the plugin modules are imported by pytest
(which rewrites their assertions), so none of them imports another.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def file_beside_test(request: pytest.FixtureRequest, given: str | os.PathLike[str]) -> Path:
    """The file a fixture is given by path: a relative one is found beside the test file,
    else in the working directory (as before); absent from both, the test fails naming
    the paths tried. Every fixture of the plugin that takes a file finds it so."""
    path = Path(given)
    if path.is_absolute():
        tried = [path]
    else:
        tried = [Path(request.node.path).parent / path, Path.cwd() / path]
    for candidate in tried:
        if candidate.is_file():
            return candidate
    shown = " nor ".join(str(candidate) for candidate in dict.fromkeys(tried))
    raise pytest.fail.Exception(f"{os.fspath(given)}: no such file ({shown})", pytrace=False)
