"""The native codex binary behind an npm install of `@openai/codex`.

The npm package is a Node launcher (`bin/codex.js`, linked as `node_modules/.bin/codex`
or a global install's `bin/codex`) plus, in a package per platform, the native binary it
starts: `@openai/codex-<platform>/vendor/<target triple>/bin/codex`. The launcher adds
nothing the app-server protocol needs (two environment variables that steer codex's
self-update hints), but keeps a Node process alive beside the binary: about 44 MB more
per app-server and `initialize` answered later (measured with 0.169.0 on Linux x64:
132 MB and ~115 ms through the launcher, 88 MB and ~48 ms for the binary). So
`rest-bridge serve` and the test harness run the binary beside a launcher they are
given, and say so.

Standard library only: the Makefile runs `python3 -m scenarios.codex_install`, which
imports this, before any virtual environment exists.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

#: The launcher's own table (`bin/codex.js` in @openai/codex 0.169.0): target triple and
#: platform package for each (sys.platform, machine), machine names as `_MACHINES` has them.
_TARGETS: dict[tuple[str, str], tuple[str, str]] = {
    ("linux", "x86_64"): ("x86_64-unknown-linux-musl", "codex-linux-x64"),
    ("linux", "aarch64"): ("aarch64-unknown-linux-musl", "codex-linux-arm64"),
    ("darwin", "x86_64"): ("x86_64-apple-darwin", "codex-darwin-x64"),
    ("darwin", "aarch64"): ("aarch64-apple-darwin", "codex-darwin-arm64"),
    ("win32", "x86_64"): ("x86_64-pc-windows-msvc", "codex-win32-x64"),
    ("win32", "aarch64"): ("aarch64-pc-windows-msvc", "codex-win32-arm64"),
}
_MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}


def native_relative_path(system: str | None = None, machine: str | None = None) -> Path | None:
    """The native binary's path under `node_modules/` for this platform (or the one
    given), None on a platform the package does not ship."""
    system = system or sys.platform
    machine = (machine or platform.machine()).lower()
    target = _TARGETS.get((system, _MACHINES.get(machine, machine)))
    if target is None:
        return None
    triple, package = target
    executable = "codex.exe" if system == "win32" else "codex"
    return Path("@openai") / package / "vendor" / triple / "bin" / executable


def native_beside(launcher: str | os.PathLike[str]) -> tuple[str, str | None]:
    """What to run for a codex given by path, wherever npm installed it: when `launcher` is
    the npm package's Node launcher (`bin/codex.js`, or a link to it such as a global
    install's `bin/codex`), the native binary of this platform's package beside it (nested
    in the package's `node_modules/`, or next to the package as npm hoists it), else the
    launcher with a note saying why; anything else as given, without a note."""
    given = Path(launcher)
    script = given.resolve()
    if script.suffix != ".js" or script.parent.name != "bin":
        return str(given), None
    package = script.parent.parent  # .../node_modules/@openai/codex
    relative = native_relative_path()
    if relative is not None:
        for modules in (package / "node_modules", package.parent.parent):
            native = modules / relative
            if os.access(native, os.X_OK) and native.is_file():
                return str(native.absolute()), None
    note = (
        f"using the Node launcher {given}: no native codex binary for this platform "
        f"({sys.platform} {platform.machine()}) beside its package {package}; the launcher "
        "costs about 44 MB more per app-server process"
    )
    return str(given), note


def native_command(command: Sequence[str]) -> tuple[list[str], str | None]:
    """``command`` with its program replaced by the native binary when the program is
    codex's npm launcher (named as given or found on PATH), and a line for the banner
    saying what was chosen; any other command as given, without a line."""
    command = list(command)
    if not command:
        return command, None
    program = command[0]
    found = shutil.which(program) if os.sep not in program else program
    if found is None or not os.path.exists(found):
        return command, None
    native, note = native_beside(os.path.abspath(found))
    if note is not None:
        return command, note
    if native == os.path.abspath(found):
        return command, None
    return [native, *command[1:]], (
        f"running the native codex binary {native}, beside the npm launcher {program} "
        "(the launcher would keep a Node process alive beside it)"
    )
