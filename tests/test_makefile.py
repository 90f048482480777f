"""The Makefile says what it does: `make serve` names the app-server it serves on.

`make -n` prints the commands without running them; `-o .venv/.installed` keeps the
venv's stamp out of it, so nothing is installed either.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_n(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("APP_SERVER", "MAKEFLAGS")}
    done = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_serve_names_the_app_server_it_was_given() -> None:
    command = "/opt/codex/bin/codex app-server"
    out = make_n("serve", f"APP_SERVER={command}")
    assert f'echo "Serving on the app-server command you gave: {command}"' in out
    assert "bundled fake" not in out
    assert f'--app-server "{command}"' in out


def test_make_serve_without_one_says_it_serves_the_fake() -> None:
    out = make_n("serve")
    assert 'echo "Serving on the bundled fake app-server.' in out
    assert "/fake-codex app-server" in out


def test_make_dist_builds_an_sdist_and_a_wheel_into_dist() -> None:
    out = make_n("-o", ".venv-build/.installed", "dist")
    assert "-m build --outdir dist ." in out
