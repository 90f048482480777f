"""The codex releases this project is tested against: its support window, in one place.

`make codex` installs every version of ``TESTED`` (each in ``.codex-npm/<version>/``), the
real-codex tests run against each of them, ``make serve-codex`` serves ``PIN``, and
``rest-bridge serve`` and ``/v1/compatibility`` say whether the app-server that answers
is inside the window. Moving the window is editing this file (README, "Upgrading codex").

Standard library only, and nothing of the package imported: the Makefile runs
``python3 -m bridge.codex_window`` before any virtual environment exists.
"""

from __future__ import annotations

import re
import sys
from typing import Literal, TypedDict

#: Every codex release the tests run against, oldest first.
TESTED: tuple[str, ...] = ("0.169.0", "0.171.0")
#: The release `make serve-codex` serves and fake-codex emulates; one of ``TESTED``.
PIN = "0.169.0"

#: What `codex --version` prints: `codex-cli 0.169.0` (a pre-release may follow `-`).
_VERSION = re.compile(r"^codex-cli (\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?)$")


def release(version_output: str | None) -> str | None:
    """``0.169.0`` from ``codex-cli 0.169.0``; None for anything else."""
    match = _VERSION.match((version_output or "").strip())
    return match.group(1) if match else None


def window() -> str:
    """The window in words, for messages: ``codex-cli 0.169.0, 0.171.0``."""
    return "codex-cli " + ", ".join(TESTED)


def is_tested(version_output: str | None) -> bool | None:
    """Whether ``version_output`` names a release of the window; None when it names none
    (unknown, or not a codex version line)."""
    found = release(version_output)
    return None if found is None else found in TESTED


def warning(version_output: str | None) -> str | None:
    """One line when the app-server's version is not one the project tested, else None."""
    tested = is_tested(version_output)
    if tested:
        return None
    if tested is None:
        shown = f"{version_output!r}" if version_output else "an unknown version"
        return f"cannot tell whether {shown} was tested: this bridge is tested on {window()}"
    return f"{version_output} is outside the tested window ({window()}); it may still work"


def status(version_output: str | None) -> str:
    """`rest-bridge serve`'s line on the window: ``tested: ...`` or ``warning: ...``."""
    found = warning(version_output)
    if found is not None:
        return f"warning: {found}"
    return f"tested: {version_output} is a release this bridge is tested on ({window()})"


#: The token fake-codex puts in its `initialize` userAgent (after the terminal, before the
#: client's `(name; version)`), as `fake-codex/<the codex release it emulates>`.
FAKE_TOKEN = "fake-codex/"


#: Set (to 1) in the environment of the `--version` probe `rest-bridge serve` runs at start:
#: fake-codex then prints a second line, `fake-codex/<the release it emulates>`, after the
#: version line it shares with the release (a real codex ignores it). Without it, the
#: fake's `--version` is the release's, byte for byte.
IDENTIFY_VARIABLE = "FAKE_CODEX_IDENTIFY"


#: What answers as an app-server: the real codex or the bundled fake.
Kind = Literal["codex", "fake-codex"]


def version_kind(version_text: str | None) -> Kind | None:
    """``fake-codex`` or ``codex``, from the whole output of a `--version` probe run with
    ``IDENTIFY_VARIABLE`` set; None when it names no codex release and is not the fake."""
    lines = (version_text or "").strip().splitlines()
    if any(line.strip().startswith(FAKE_TOKEN) for line in lines[1:]):
        return "fake-codex"
    return "codex" if lines and release(lines[0]) else None


class Assessment(TypedDict):
    """The fields ``/v1/compatibility`` adds to ``appServer`` (snake_case)."""

    kind: Kind | None
    tested: bool | None
    tested_versions: list[str]
    warning: str | None


def kind(user_agent: str | None) -> Kind | None:
    """``fake-codex`` or ``codex``, from an `initialize` userAgent; None without one."""
    if not user_agent:
        return None
    return "fake-codex" if f" {FAKE_TOKEN}" in user_agent else "codex"


def agent_release(user_agent: str | None) -> str | None:
    """The codex release an `initialize` userAgent names (`<originator>/0.171.0 (...`)."""
    head = (user_agent or "").split(" ", 1)[0]
    version = head.rsplit("/", 1)[-1] if "/" in head else ""
    return version if release(f"codex-cli {version}") else None


def assess(
    version_output: str | None, user_agent: str | None = None, probed_kind: Kind | None = None
) -> Assessment:
    """What ``/v1/compatibility`` adds about the app-server: ``kind`` (from the userAgent
    of the last `initialize` answered; before one, what the ``--version`` probe found),
    ``tested``, ``tested_versions`` and ``warning`` (from its ``--version`` line, else
    from the release that userAgent names)."""
    if release(version_output) is None and agent_release(user_agent) is not None:
        version_output = f"codex-cli {agent_release(user_agent)}"
    return {
        "kind": kind(user_agent) or probed_kind,
        "tested": is_tested(version_output),
        "tested_versions": list(TESTED),
        "warning": warning(version_output),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the window (space-separated), or ``--pin`` the pinned release."""
    args = sys.argv[1:] if argv is None else argv
    print(PIN if args == ["--pin"] else " ".join(TESTED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
