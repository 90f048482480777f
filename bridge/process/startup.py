"""How the backend reaches an app-server, and what is said when one cannot start.

A launcher opens one JSON-RPC conversation per session, sessionless call and text turn,
not yet initialized (the backend puts its handlers in place first, then does
``initialize``). :class:`SpawnStdio` spawns a child process for each; the shared mode's
:class:`~bridge.process.shared.ConnectShared` opens a connection to one app-server.

When one cannot start, the bridge's log names the command and why (the ``OSError``, or
the exit and the tail of its stderr); the client hears what to check, never the command,
a path or the stderr: those are the operator's (docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
from collections.abc import Sequence
from typing import Any, Protocol

from bridge import __version__, codex_window, credentials, errors, logs
from bridge.descriptors import OUT_OF_RESOURCES, shortage_behind
from bridge.limits import RestLimits
from bridge.models import AppServerInfo, ClientOptions, Compatibility, shaped_by_caller
from bridge.process import descendants
from bridge.process.channel import ExitInfo
from bridge.process.outcomes import rpc_failure
from bridge.process.peer import JsonRpcPeer, RpcError
from bridge.process.stdio import StdioChannel

DEFAULT_COMMAND = ("codex", "app-server")
_VERSION_TIMEOUT = 10.0

#: The part of the client's message that says what to check.
CHECK_COMMAND = "check the bridge's app-server command (`rest-bridge serve --app-server`)"


def spawn_failed(command: Sequence[str], exc: OSError, cwd: str | None) -> errors.RestError:
    """The process could not be created: 502 ``app_server_spawn_failed``, and a log line.
    A missing ``cwd`` fails as a missing executable does: the directory says which it was."""
    exc = shortage_behind(exc)
    reason = exc.strerror or type(exc).__name__
    # Asked of the directory, not of the error: uvloop's OSError names no file.
    if cwd is not None and not (os.path.isdir(cwd) and os.access(cwd, os.X_OK)):
        # Not the cwd itself: it is the caller's, a body's value (it could hold anything).
        said = "could not start the app-server in the working directory options.cwd names: %s"
        logs.start_failed("cwd", said, reason, level=logging.WARNING)
        return errors.of_kind(
            "app_server_spawn_failed",
            f"Could not start the app-server in the requested working directory ({reason}); "
            "check options.cwd.",
        )
    if exc.errno in OUT_OF_RESOURCES:
        # Nothing to check in the command: the bridge (or the machine) is out of room.
        logs.start_failed("resources", "could not start the app-server: %s", reason)
        return errors.of_kind(
            "app_server_spawn_failed",
            f"Could not start the app-server ({reason}); the bridge is out of resources, "
            "retry later.",
        )
    said = "could not start the app-server `%s`: %s"
    logs.start_failed("spawn", said, shlex.join(command), reason)
    return errors.of_kind(
        "app_server_spawn_failed", f"Could not start the app-server ({reason}); {CHECK_COMMAND}."
    )


def exited_at_startup(command: Sequence[str], info: ExitInfo) -> errors.RestError:
    """The process ended before answering ``initialize``: a log line with its stderr, and
    502 ``app_server_exited`` (``protocol_error`` when the bridge stopped it for that)."""
    if info.connection:
        # Shared mode: a connection, not a process, ended before `initialize`.
        said = "a connection to the shared app-server ended at start-up: %s"
        logs.start_failed("connection", said, info.connection)
        if info.protocol_error:
            return errors.of_kind("protocol_error", info.describe())
        return errors.of_kind(
            "app_server_exited",
            "The connection to the shared app-server ended before `initialize` was "
            f"answered ({info.connection}).",
            data={"exitCode": info.exit_code, "signal": info.signal},
        )
    logs.start_failed(
        "exited",
        "the app-server `%s` ended during start-up: %s; stderr: %s",
        shlex.join(command),
        info.describe().removeprefix("the app-server "),
        logs.stderr_summary(info.stderr_tail),
    )
    if info.protocol_error:
        return errors.of_kind("protocol_error", info.describe())
    how = f"was killed by {info.signal}" if info.signal else f"exited with code {info.exit_code}"
    return errors.of_kind(
        "app_server_exited",
        f"The app-server {how} during start-up, before answering `initialize`; "
        f"{CHECK_COMMAND}. The bridge's log has the process's stderr.",
        data={"exitCode": info.exit_code, "signal": info.signal},
    )


def user_agent(result: Any) -> str | None:
    """The ``userAgent`` an ``initialize`` answer names, cut to 200 characters."""
    agent = result.get("userAgent") if isinstance(result, dict) else None
    return agent[:200] if isinstance(agent, str) else None


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


#: What a ``--version`` probe found: (version, why not, kind), where kind is ``codex``,
#: ``fake-codex`` or None (``codex_window.version_kind``).
Probed = tuple[str | None, str | None, codex_window.Kind | None]


async def probe_app_server(argv: list[str]) -> Probed:
    """Run ``<server> --version`` without blocking the loop: (version, error, kind).

    The probe is an app-server's lineage like any other (:class:`descendants.Lineage`):
    marked, and what it leaves running is killed once it has exited, a daemon holding
    its output among them (whose end is then what ends the read)."""
    lineage = descendants.Lineage()
    environment = {**credentials.child_environment(), codex_window.IDENTIFY_VARIABLE: "1"}
    try:
        with descendants.children.spawning() as own:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=lineage.environment(environment),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
            own(proc.pid)
    except OSError as exc:
        return None, f"could not run the app-server: {exc.strerror or type(exc).__name__}", None
    lineage.spawned(proc.pid)
    assert proc.stdout is not None
    reading = asyncio.ensure_future(proc.stdout.read())
    try:
        async with asyncio.timeout(_VERSION_TIMEOUT):
            await proc.wait()
            lineage.end()
            out = await reading
    except TimeoutError:
        if proc.returncode is None:
            lineage.remember_tree()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            lineage.end()
        return None, "the app-server did not report its version in time", None
    finally:
        reading.cancel()  # done already, unless the probe timed out or was cancelled
    text = out.decode("utf-8", "replace").strip()
    if proc.returncode != 0 or not text:
        return None, f"`--version` exited with code {proc.returncode}", None
    return text.splitlines()[0][:200], None, codex_window.version_kind(text[:1000])


def compatibility(
    command: list[str], probed: Probed, user_agent: str | None, **more: Any
) -> Compatibility:
    """What ``/v1/compatibility`` says: ``probed`` by ``--version``, ``user_agent`` named
    by the last ``initialize`` answer, ``more`` the mode's own fields."""
    app_server = AppServerInfo(
        command=command,
        version=probed[0],
        version_error=probed[1],
        **more,
        **codex_window.assess(probed[0], user_agent, probed[2]),
    )
    return Compatibility(bridge_version=__version__, app_server=app_server)


def spawn_timed_out(
    what: str, ms: int, why: str = "no answer to `initialize`", command: Sequence[str] = ()
) -> errors.RestError:
    """The 504 of a start past ``REST_ADAPTER_SPAWN_TIMEOUT_MS`` (``ms``), naming the
    setting only the operator can change; the WARNING line says ``why``: what was awaited
    (from ``command``, when a process of the bridge's own was)."""
    late = f"{what} did not complete before its deadline"
    why += f" from `{shlex.join(command)}`" if command else ""
    logs.start_failed("timeout", "%s: %s within %d ms", late, why, ms, level=logging.WARNING)
    return errors.of_kind("timeout", f"{late} (REST_ADAPTER_SPAWN_TIMEOUT_MS, {ms} ms).")


def initialize_refused(
    command: Sequence[str], exc: RpcError, options: ClientOptions | None
) -> errors.RestError:
    """The app-server answered ``initialize`` with an error: its message (which may name
    a path or a setting) goes to the operator's line; the client gets the code and what
    to check, its own options first when they shaped the start (a name, capabilities)."""
    shaped = shaped_by_caller(options)
    logs.initialize_refused(shlex.join(command), str(exc.message), exc.code, by_caller=shaped)
    if exc.code == -32001:  # codex's "overloaded" (its own words): retryable, as after start
        return rpc_failure(exc, "initialize")
    check = f"check the request's options (clientInfo among them), else {CHECK_COMMAND}"
    return errors.of_kind(
        "app_server_error",
        f"The app-server answered `initialize` with an error; {check if shaped else CHECK_COMMAND}"
        ". The bridge's log has its message.",
        code=exc.code,
    )


#: How long a failed ``--version`` is remembered before it is asked again.
_VERSION_RETRY_AFTER = 30.0


class AppServerLauncher(Protocol):
    """Opens app-server conversations for :class:`~bridge.process.backend.ProcessBackend`."""

    #: The app-server's command line (shown by ``/v1/compatibility``, named in logs).
    command: list[str]
    #: What a failed ``initialize`` was doing, for the client's error message.
    starting: str

    async def open(self, options: ClientOptions | None) -> JsonRpcPeer:
        """A new conversation shaped by ``options``; raises the bridge's RestError
        (``app_server_spawn_failed``, ``bad_request``, ``options_not_allowed``...)."""

    async def compatibility(self, user_agent: str | None) -> Compatibility:
        """What ``/v1/compatibility`` says of the app-server; ``user_agent``: the one the
        last ``initialize`` answer named (fake-codex or codex)."""

    async def close(self) -> None:
        """Release what the launcher holds (its conversations are closed already)."""


class VersionProbe:
    """What ``<command> --version`` says, asked once (again a while after a failure)."""

    def __init__(self, command: Sequence[str]) -> None:
        self._argv = version_command(command)
        self._version: Probed | None = None
        self._checked_at = 0.0
        self._lock = asyncio.Lock()

    async def get(self) -> Probed:
        """(version, None, kind), or (None, why not, None)."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            stale = self._version is None or (
                self._version[0] is None and loop.time() - self._checked_at > _VERSION_RETRY_AFTER
            )
            if stale:
                self._version = await probe_app_server(self._argv)
                self._checked_at = loop.time()
            assert self._version is not None
            return self._version


class SpawnStdio:
    """Every conversation is a child process of its own, spoken to over its stdio."""

    starting = "Starting the app-server"

    def __init__(self, command: Sequence[str], limits: RestLimits) -> None:
        self.command = list(command)
        self.limits = limits
        self.version = VersionProbe(self.command)

    def _argv(self, options: ClientOptions | None) -> list[str]:
        argv = list(self.command)
        for override in (options.config_overrides or []) if options else []:
            if "=" not in override:
                raise errors.bad_request(
                    "Each configOverrides entry must have the form key=value.",
                    data={"configOverrides": override},
                )
            argv += ["-c", override]
        return argv

    async def open(self, options: ClientOptions | None) -> JsonRpcPeer:
        argv = self._argv(options)
        # 403 for an `options.env` naming a REST_ADAPTER_* variable: those are the bridge's
        # own (its secrets, the marks that tie a process to its bridge and replica).
        reserved = credentials.reserved_variables(options.env if options else None)
        if reserved:
            raise errors.reserved_variables(reserved)
        cwd = options.cwd if options else None
        channel = StdioChannel(max_line_bytes=self.limits.max_line_bytes)
        peer = JsonRpcPeer(channel)  # attached before the child can write
        try:
            env = credentials.child_environment(options.env if options else None)
            await channel.spawn(argv, env=env, cwd=cwd)
        except OSError as exc:
            raise spawn_failed(self.command, exc, cwd) from None
        except ValueError:
            # A NUL byte, or `=` in a variable name: the request's options cannot be used.
            raise errors.bad_request("The client options cannot be given to a process.") from None
        return peer

    async def compatibility(self, user_agent: str | None) -> Compatibility:
        return compatibility(self.command, await self.version.get(), user_agent)

    async def close(self) -> None:
        pass
