"""The lean app-server of the benchmarks: C when a compiler is at hand, else Python.

fake-codex is the project's scriptable fake and costs 30-60 µs of CPU per call (it is
Python, asyncio and a script interpreter); behind a bridge on a 2-core machine it takes
most of the second core. The lean app-server answers the benchmarks' methods for a few
µs (Python) or about one µs (C), so that what a benchmark measures is the bridge and
what stands in front of it. It is for ``bench/`` only; it is not shipped.

:func:`argv` compiles ``lean_app_server.c`` with the system's ``cc`` (once per
process, into a temporary directory) and falls back to ``lean_app_server.py`` when
there is no compiler or the compilation fails: a fresh machine may lack one
(``apt-get install gcc``).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "lean_app_server.c"
PYTHON = HERE / "lean_app_server.py"
KINDS = ("auto", "c", "python")


@functools.cache
def compiled() -> Path | None:
    """The C app-server, compiled now; None without a compiler or if it does not build."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    build = Path(tempfile.mkdtemp(prefix="bench-lean-"))
    atexit.register(shutil.rmtree, build, True)
    binary = build / "lean-app-server"
    done = subprocess.run(
        [compiler, "-O2", "-Wall", "-Wextra", "-o", str(binary), str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        print(f"bench: the lean app-server did not compile:\n{done.stderr}", file=sys.stderr)
        return None
    return binary


def argv(kind: str = "auto") -> list[str]:
    """The command that starts a lean app-server (``kind``: auto, c or python)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    if kind != "python":
        binary = compiled()
        if binary is not None:
            return [str(binary), "app-server"]
        if kind == "c":
            raise SystemExit("the C lean app-server needs a C compiler (cc)")
    return [sys.executable, str(PYTHON), "app-server"]


def kind_of(command: list[str]) -> str:
    """``c`` or ``python``: which lean app-server a command from :func:`argv` starts."""
    return "python" if command[0] == sys.executable else "c"
