"""Where the real codex is, inside the folder `make codex` installs it into.

`make codex` installs each release of the support window (`bridge/codex_window.py`) in a
folder of its own, `.codex-npm/<version>/`; the pinned one is what `make serve-codex`
serves and what the harness finds when no codex is named. Of an install, the native
binary of this platform is what runs, else the Node launcher, said (why: see
`bridge/codex_binary.py`).

Standard library only (and `bridge.codex_window` and `bridge.codex_binary`, which are
too): the Makefile runs `python3 -m scenarios.codex_install` before any virtual
environment exists.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from bridge import codex_window
from bridge.codex_binary import native_relative_path


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


def main() -> int:
    """Print the pinned codex in `./.codex-npm` (or the folder given), or the version
    given second, for the Makefile."""
    npm_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".codex-npm")
    version = sys.argv[2] if len(sys.argv) > 2 else None
    found = pinned_codex(npm_dir, version)
    if found is None:
        print(
            f"no codex {version or codex_window.PIN} installed in {npm_dir.absolute()}/ "
            "(run `make codex`, which installs the releases of the support window there)",
            file=sys.stderr,
        )
        return 1
    path, note = found
    if note:
        print(note, file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
