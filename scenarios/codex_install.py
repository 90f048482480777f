"""Where the real codex is, inside the folder `make codex` installs it into.

`make codex` installs each release of the support window (`bridge/codex_window.py`) in a
folder of its own, `.codex-npm/<version>/`; the pinned one is what `make serve-codex`
serves and what the harness finds when no codex is named. The npm package
`@openai/codex` is a Node launcher (`node_modules/.bin/codex`) plus, in a package per
platform, the native binary it starts:
`node_modules/@openai/codex-<platform>/vendor/<target triple>/bin/codex`. Run the native
binary directly: measured with 0.169.0 on Linux x64, an idle `codex app-server` after
`initialize` holds 88 MB instead of 132 MB (the launcher's Node process stays alive
beside the binary when Node cannot `execve`) and answers `initialize` after about 48 ms
instead of 115 ms. The launcher adds only `CODEX_MANAGED_BY_NPM=1` and
`CODEX_MANAGED_PACKAGE_ROOT` to the environment, which steer codex's self-update hints,
not the app-server protocol.

Standard library only (and `bridge.codex_window`, which is too): the Makefile runs
`python3 -m scenarios.codex_install` before any virtual environment exists.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from bridge import codex_window

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


def pinned_codex(npm_dir: Path, version: str | None = None) -> tuple[str, str | None] | None:
    """The codex `version` (default: the pinned one) installed under `npm_dir` (a
    `.codex-npm/` folder, holding a folder per version; a folder that is itself one npm
    install, as before the window, is used as it is when the version's folder is not
    there): the native binary when it is there, else the Node launcher with a note saying
    why it is second best; None when neither is installed."""
    versioned = npm_dir / (version or codex_window.PIN)
    return _installed(versioned) or (_installed(npm_dir) if version is None else None)


def _installed(npm_dir: Path) -> tuple[str, str | None] | None:
    modules = npm_dir / "node_modules"
    relative = native_relative_path()
    if relative is not None:
        native = modules / relative
        if os.access(native, os.X_OK) and native.is_file():
            return str(native.absolute()), None
    launcher = modules / ".bin" / "codex"
    if os.access(launcher, os.X_OK):
        note = (
            f"using the Node launcher {launcher}: no native codex binary for this platform "
            f"({sys.platform} {platform.machine()}) in {modules}; the launcher costs about "
            "44 MB more per app-server process"
        )
        return str(launcher.absolute()), note
    return None


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


def main() -> int:
    """Print the pinned codex in `./.codex-npm` (or the folder given), or the version
    given second, for the Makefile."""
    npm_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".codex-npm")
    found = pinned_codex(npm_dir, sys.argv[2] if len(sys.argv) > 2 else None)
    if found is None:
        return 1
    path, note = found
    if note:
        print(note, file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
