"""The app-server's command, and when it cannot start: what the operator reads, and what
the client is told.

The operator chose the command, so the bridge's log names it, with the reason (the
``OSError``, or the exit and the tail of what the process wrote on stderr). The client
gets the error payload with what to check, never the command, a path or the stderr: those
are the operator's to show (the threat model is docs/SECURITY.md).

``rest-bridge serve`` also resolves the command once at start-up and reports it on one
line (:func:`describe_command`), so a misspelt ``--app-server`` shows before the first
request.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shlex
import shutil
from collections.abc import Sequence

from bridge import credentials, errors
from bridge.process import descendants
from bridge.process.channel import ExitInfo

log = logging.getLogger("bridge")

DEFAULT_COMMAND = ("codex", "app-server")
#: Variables of the bridge's own environment that a child process must never see: the
#: secrets and the paths of their files (bridge.credentials).
SECRET_ENV = tuple(sorted(credentials.HIDDEN_VARIABLES))
_VERSION_TIMEOUT = 10.0

#: The part of the client's message that says what to check.
CHECK_COMMAND = "check the bridge's app-server command (`rest-bridge serve --app-server`)"
#: Spawn failures that say nothing about the command: descriptors, processes, memory.
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})
#: How much of a start-up failure's stderr one log line carries (its end).
LOG_STDERR_CHARS = 1000


def spawn_failed(command: Sequence[str], exc: OSError, cwd: str | None) -> errors.RestError:
    """The process could not be created: 502 ``app_server_spawn_failed``, and a log line.

    A ``cwd`` that does not exist fails the same way as a missing executable; the
    exception names which (``filename``), and the client hears which of the two to check.
    """
    reason = exc.strerror or type(exc).__name__
    if cwd is not None and exc.filename == cwd:
        log.warning("could not start the app-server in the requested cwd %r: %s", cwd, reason)
        return errors.app_server_spawn_failed(
            f"Could not start the app-server in the requested working directory ({reason}); "
            "check options.cwd."
        )
    if exc.errno in OUT_OF_RESOURCES:
        # Nothing to check in the command: the bridge (or the machine) is out of room.
        log.error("could not start the app-server: %s", reason)
        return errors.app_server_spawn_failed(
            f"Could not start the app-server ({reason}); the bridge is out of resources, "
            "retry later."
        )
    log.error("could not start the app-server `%s`: %s", shlex.join(command), reason)
    return errors.app_server_spawn_failed(
        f"Could not start the app-server ({reason}); {CHECK_COMMAND}."
    )


def exited_at_startup(command: Sequence[str], info: ExitInfo) -> errors.RestError:
    """The process ended before answering ``initialize``: a log line with its stderr, and
    502 ``app_server_exited`` (``protocol_error`` when the bridge stopped it for that)."""
    if info.connection:
        # Shared mode: a connection, not a process, ended before `initialize`.
        log.error("a connection to the shared app-server ended at start-up: %s", info.connection)
        if info.protocol_error:
            return errors.protocol_error(info.describe())
        return errors.app_server_exited(
            "The connection to the shared app-server ended before `initialize` was "
            f"answered ({info.connection}).",
            data={"exitCode": info.exit_code, "signal": info.signal},
        )
    log.error(
        "the app-server `%s` ended during start-up: %s; stderr: %s",
        shlex.join(command),
        info.describe().removeprefix("the app-server "),
        stderr_summary(info.stderr_tail),
    )
    if info.protocol_error:
        return errors.protocol_error(info.describe())
    how = f"was killed by {info.signal}" if info.signal else f"exited with code {info.exit_code}"
    return errors.app_server_exited(
        f"The app-server {how} during start-up, before answering `initialize`; "
        f"{CHECK_COMMAND}. The bridge's log has the process's stderr.",
        data={"exitCode": info.exit_code, "signal": info.signal},
    )


def stderr_summary(tail: str) -> str:
    """The end of a stderr tail on one line: lines joined by `` | ``, at most
    :data:`LOG_STDERR_CHARS` characters."""
    text = " | ".join(line.strip() for line in tail.splitlines() if line.strip())
    if not text:
        return "(nothing)"
    if len(text) > LOG_STDERR_CHARS:
        text = "…" + text[-LOG_STDERR_CHARS:]
    return text


def unstartable(command: Sequence[str]) -> str | None:
    """Why ``command`` cannot be started from here (its program missing, a directory,
    not executable), or None when its program resolves as ``PATH`` stands now."""
    program = command[0]
    if shutil.which(program):
        return None
    if "/" not in program:
        return f"{program}: not found on PATH"
    if not os.path.exists(program):
        return f"{program}: no such file"
    if os.path.isdir(program):
        return f"{program}: is a directory"
    return f"{program}: not executable"


async def describe_command(command: Sequence[str]) -> tuple[str, str | None]:
    """One line for ``rest-bridge serve``'s start: the command, where its program is, and
    the version it reports, or why it cannot start (the bridge serves anyway: a request's
    ``options.cwd`` or ``options.env`` may still make it startable); and that version."""
    shown = shlex.join(command)
    problem = unstartable(command)
    if problem is not None:
        line = (
            f"app-server: {shown}: cannot start: {problem}; every request that starts an "
            "app-server will fail (502 app_server_spawn_failed) until --app-server names "
            "a command that exists"
        )
        if os.path.basename(command[0]) == "codex":
            line += (
                " (install codex: npm install -g @openai/codex; or serve the bundled fake: "
                "--app-server 'fake-codex app-server')"
            )
        return line, None
    found = _absolute(shutil.which(command[0]) or command[0])
    version, error = await probe_version(version_command(command))
    details = [version or f"version unknown: {error}"]
    if found != command[0]:
        details.insert(0, found)
    if "app-server" not in command:
        details.append("note: no `app-server` in the command, which codex needs to serve")
    return f"app-server: {shown} ({'; '.join(details)})", version


def _absolute(path: str) -> str:
    return os.path.abspath(path)


def parse_command(command: str | Sequence[str]) -> list[str]:
    """A command line as argv: a string is split like a shell would."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if not argv:
        raise ValueError("the app-server command is empty")
    return argv


def version_command(command: Sequence[str]) -> list[str]:
    """``codex app-server -c x`` → ``codex --version`` (wrappers before it are kept)."""
    argv = list(command)
    if "app-server" in argv:
        argv = argv[: argv.index("app-server")]
    return [*argv, "--version"]


async def probe_version(argv: list[str]) -> tuple[str | None, str | None]:
    """Run ``<server> --version`` without blocking the loop: (version, error)."""
    try:
        with descendants.spawning() as own:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=credentials.child_environment(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
            own(proc.pid)
    except OSError as exc:
        return None, f"could not run the app-server: {exc.strerror or type(exc).__name__}"
    try:
        async with asyncio.timeout(_VERSION_TIMEOUT):
            out, _ = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return None, "the app-server did not report its version in time"
    finally:
        if proc.returncode is not None:
            descendants.released(proc.pid)
    text = out.decode("utf-8", "replace").strip()
    if proc.returncode != 0 or not text:
        return None, f"`--version` exited with code {proc.returncode}"
    return text.splitlines()[0][:200], None
