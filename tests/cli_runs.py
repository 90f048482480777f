"""A `rest-bridge` command run by the CLI's own main in the test process.

For the refusals at start: a bad setting, option or secret makes `serve` (or `cluster`)
exit 2 with one line before anything starts. Checking that needs no Python process of
its own (a start and its imports cost about 0.4 CPU-s); the tests that serve, and one
refusal of each kind, run the console script itself. Were a refusal let through, the
test fails where serving, or the cluster's launcher, would begin: nothing starts here.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
from collections.abc import Mapping, Sequence

import pytest

import bridge_ops.cluster
from bridge import cli


def main_here(
    argv: Sequence[str],
    monkeypatch: pytest.MonkeyPatch,
    env: Mapping[str, str] | None = None,
    *,
    keep_settings: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`rest-bridge ARGV` with ``env`` added to this process's environment (the other
    ``REST_ADAPTER_*`` variables removed, unless ``keep_settings``): its exit status,
    what it printed and what it wrote on stderr."""
    if not keep_settings:
        for name in [name for name in os.environ if name.startswith("REST_ADAPTER_")]:
            monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    given = f"{' '.join(argv)} with {sorted(env or {})}"

    async def serving(*_: object, **__: object) -> None:
        raise AssertionError(f"serve started: {given}")

    def launching(*_: object) -> int:
        raise AssertionError(f"the cluster's launcher started: {given}")

    monkeypatch.setattr(cli, "serve", serving)
    monkeypatch.setattr(bridge_ops.cluster, "main", launching)
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers = list(root.handlers)  # `serve` calls logging.basicConfig first
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = cli.main(list(argv))
            except SystemExit as exit_:  # argparse's refusals
                status = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        root.handlers[:] = handlers
    return subprocess.CompletedProcess(list(argv), status, out.getvalue(), err.getvalue())
