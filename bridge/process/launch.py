"""How the backend reaches an app-server: a launcher it is given.

A launcher opens one JSON-RPC conversation per session, sessionless call and text turn,
not yet initialized (the backend puts its handlers in place first, then does
``initialize``). :class:`SpawnStdio` spawns a child process for each; the shared mode's
:class:`~bridge.process.shared.ConnectShared` opens a connection to one app-server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from bridge import __version__, codex_window, credentials, errors
from bridge.limits import RestLimits
from bridge.models import AppServerInfo, ClientOptions, Compatibility
from bridge.process import startup
from bridge.process.peer import JsonRpcPeer
from bridge.process.stdio import StdioChannel

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

    def initialized(self, result: Any) -> None:
        """A conversation's ``initialize`` was answered with ``result``."""

    async def compatibility(self) -> Compatibility:
        """What ``/v1/compatibility`` says of the app-server."""

    async def close(self) -> None:
        """Release what the launcher holds (its conversations are closed already)."""


async def spawn_peer(
    command: Sequence[str],
    *,
    max_line_bytes: int,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> JsonRpcPeer:
    """A peer speaking to a new child process ``command`` over its stdio.

    Raises ``OSError`` when it cannot be started.
    """
    channel = StdioChannel(max_line_bytes=max_line_bytes)
    peer = JsonRpcPeer(channel)
    await channel.spawn(command, env=env, cwd=cwd)
    return peer


class VersionProbe:
    """What ``<command> --version`` says, asked once (again a while after a failure)."""

    def __init__(self, command: Sequence[str]) -> None:
        self._argv = startup.version_command(command)
        self._version: tuple[str | None, str | None] | None = None
        self._checked_at = 0.0
        self._lock = asyncio.Lock()

    async def get(self) -> tuple[str | None, str | None]:
        """(version, None), or (None, why not)."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            stale = self._version is None or (
                self._version[0] is None and loop.time() - self._checked_at > _VERSION_RETRY_AFTER
            )
            if stale:
                self._version = await startup.probe_version(self._argv)
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
        #: The userAgent of the last `initialize` answered (fake-codex or codex).
        self.user_agent: str | None = None

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
        try:
            return await spawn_peer(
                argv,
                max_line_bytes=self.limits.max_line_bytes,
                env=credentials.child_environment(options.env if options else None),
                cwd=cwd,
            )
        except OSError as exc:
            raise startup.spawn_failed(self.command, exc, cwd) from None
        except ValueError:
            # A NUL byte, or `=` in a variable name: the request's options cannot be used.
            raise errors.bad_request("The client options cannot be given to a process.") from None

    def initialized(self, result: Any) -> None:
        if isinstance(result, dict) and isinstance(result.get("userAgent"), str):
            self.user_agent = str(result["userAgent"])[:200]

    async def compatibility(self) -> Compatibility:
        version, version_error = await self.version.get()
        return Compatibility(
            bridge_version=__version__,
            app_server=AppServerInfo(
                command=self.command,
                version=version,
                version_error=version_error,
                **codex_window.assess(version, self.user_agent),
            ),
        )

    async def close(self) -> None:
        pass
