"""Resource limits of the bridge (``RestLimits``), loadable from the environment."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "REST_ADAPTER_"
#: Past this much unsent data on an app-server's stdin, new calls are refused.
MAX_STDIN_BUFFER = 16 * 1024 * 1024
#: What one buffered event costs beyond its JSON bytes (the event object, its list slot).
EVENT_OVERHEAD = 200


class RestLimitsEnvError(ValueError):
    """A ``REST_ADAPTER_*`` limit variable is set but is not a valid value of its type."""

    def __init__(self, variable: str, value: str, expected: str) -> None:
        # The value as given, up to a line's worth of it.
        super().__init__(f"{variable}={value[:80]!r} is not a valid {expected}")
        self.variable = variable
        self.value = value
        self.expected = expected


def _limit(default: int, description: str) -> Any:
    """A limit's field: its default, and in a line what it bounds (the settings model's
    description of its variable, bridge.settings)."""
    return dataclasses.field(default=default, metadata={"description": description})


@dataclass(frozen=True, slots=True)
class RestLimits:
    """Bounds on what the bridge holds and how long it waits.

    Each field can be set from the environment as ``REST_ADAPTER_<FIELD IN CAPITALS>``,
    e.g. ``REST_ADAPTER_MAX_SESSIONS=16``.
    """

    max_sessions: int = _limit(64, "sessions and sessionless calls held at once")
    max_body_bytes: int = _limit(1_048_576, "a request body")
    call_timeout_ms: int = _limit(60_000, "a call without timeoutMs")
    text_turn_timeout_ms: int = _limit(600_000, "a text turn without timeoutMs")
    spawn_timeout_ms: int = _limit(15_000, "spawning an app-server and initialize")
    max_wait_ms: int = _limit(30_000, "a long-poll's waitMs: default and cap")
    event_buffer: int = _limit(4096, "events kept per session")
    session_idle_timeout_ms: int = _limit(1_800_000, "an idle session is removed")
    sse_keepalive_ms: int = _limit(15_000, "keep-alive comments of an idle stream")
    max_concurrent_text_turns: int = _limit(8, "text turns at once")
    max_line_bytes: int = _limit(16_777_216, "one line from the app-server")
    shutdown_grace_ms: int = _limit(3000, "stopping a process before SIGKILL")
    #: The bytes of one session's event log (the events' JSON), as EVENT_BUFFER bounds
    #: their number; what either drops is announced by a ``gap`` event.
    event_buffer_bytes: int = _limit(33_554_432, "bytes of events kept per session")
    #: How long a request body may take to arrive (408 ``request_timeout``).
    body_timeout_ms: int = _limit(30_000, "a request body's arrival")
    #: How long an SSE stream that is behind may stop reading before the app-server's
    #: output is no longer held back for it (its connection is then reset; a client
    #: resuming from its last event gets a ``gap``).
    reader_stall_ms: int = _limit(10_000, "how long a stream behind may stop reading")
    #: The bytes of one request head (request line and headers) in all (431 beyond).
    max_header_bytes: int = _limit(32_768, "one request head in all")
    #: How long a request head may take to arrive once begun (408, connection closed).
    header_timeout_ms: int = _limit(10_000, "a request head's arrival")
    #: Shared mode, supervised: how often the app-server is asked a cheap question over a
    #: connection of the bridge's own, and how long it has to answer before it counts as
    #: wedged (killed and restarted, its sessions ended): twice READER_STALL_MS, the
    #: longest the bridge holds a connection's output back for a slow reader, in case the
    #: app-server waits on that connection meanwhile.
    liveness_interval_ms: int = _limit(10_000, "shared mode: how often it is probed")
    liveness_timeout_ms: int = _limit(20_000, "shared mode: unanswered, it is wedged")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RestLimits.{field.name} must be a positive integer")

    def memory_bound(self) -> int:
        """The most memory (bytes) the bridge's sessions, calls and text turns can hold.

        Beyond the bridge's own baseline (about 50 MB) and the requests in flight (each at
        most ``2 * MAX_BODY_BYTES`` while its body is read and decoded). Each slot of
        MAX_SESSIONS (a session or a sessionless call) holds at most its event log
        (EVENT_BUFFER_BYTES, plus :data:`EVENT_OVERHEAD` per event), a partial line
        (MAX_LINE_BYTES), input queued for the app-server (:data:`MAX_STDIN_BUFFER`)
        and an 8 KiB stderr tail; a text turn the same plus its deltas
        (EVENT_BUFFER_BYTES) and its response, built from its log (3 * EVENT_BUFFER_BYTES).
        One line at a time is being parsed, which costs up to 6 * MAX_LINE_BYTES.
        """
        slot = (
            self.event_buffer_bytes
            + self.event_buffer * EVENT_OVERHEAD
            + self.max_line_bytes
            + MAX_STDIN_BUFFER
            + 8192
        )
        turn = slot + 4 * self.event_buffer_bytes
        return (
            self.max_sessions * slot
            + self.max_concurrent_text_turns * turn
            + 6 * self.max_line_bytes
        )

    @classmethod
    def unknown_variables(
        cls, environ: Mapping[str, str] | None = None, others: frozenset[str] = frozenset()
    ) -> list[str]:
        """``REST_ADAPTER_*`` variables that are neither a limit nor one of ``others``.

        A misspelt limit would otherwise be ignored without a word.
        """
        env = os.environ if environ is None else environ
        known = {cls.env_variable(f.name) for f in dataclasses.fields(cls)} | set(others)
        return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)

    def changed(self) -> dict[str, int]:
        """The limits that differ from their defaults, by variable name."""
        default = type(self)()
        return {
            self.env_variable(f.name): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }

    @classmethod
    def env_variable(cls, field_name: str) -> str:
        return ENV_PREFIX + field_name.upper()


#: ``process`` (one app-server per session, the default) or ``shared`` (one for all).
APP_SERVER_MODES = ("process", "shared")
MODE_VARIABLE = ENV_PREFIX + "APP_SERVER_MODE"
URL_VARIABLE = ENV_PREFIX + "APP_SERVER_URL"
#: The token of an app-server the bridge connects to over ``ws://`` (never logged).
APP_SERVER_TOKEN_VARIABLE = ENV_PREFIX + "APP_SERVER_TOKEN"
APP_SERVER_VARIABLES = frozenset({MODE_VARIABLE, URL_VARIABLE, APP_SERVER_TOKEN_VARIABLE})


@dataclass(frozen=True, slots=True)
class AppServerSettings:
    """How the bridge reaches app-servers.

    ``process``: every session, sessionless call and text turn spawns its own app-server
    on stdio. ``shared``: one app-server serves them all, each over a connection of its
    own; the bridge starts and supervises it on a private unix socket, or, with ``url``
    (``unix://PATH`` or ``ws://HOST:PORT``), connects to one that is already running.
    """

    mode: str = "process"
    url: str | None = None
    #: Sent as ``Authorization: Bearer`` to a ``url`` app-server; kept out of reprs.
    token: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in APP_SERVER_MODES:
            raise ValueError(f"the app-server mode must be one of {', '.join(APP_SERVER_MODES)}")
        if self.url is not None:
            if self.mode != "shared":
                raise ValueError("an app-server URL needs the shared mode")
            if url_problem(self.url) is not None:
                raise ValueError(f"the app-server URL {url_problem(self.url)}")

    @property
    def shared(self) -> bool:
        return self.mode == "shared"


def url_problem(url: str) -> str | None:
    """What is wrong with an app-server URL, or None for ``unix://PATH``/``ws://HOST:PORT``."""
    if url.startswith("unix://"):
        return None if url[len("unix://") :].startswith("/") else "needs an absolute path"
    if url.startswith("ws://"):
        rest = url[len("ws://") :]
        if "@" in rest.partition("/")[0]:
            # It would be shown on the start line and in every connection error.
            return (
                "holds credentials before the host: the token goes in "
                "REST_ADAPTER_APP_SERVER_TOKEN (or its _FILE)"
            )
        host, _, port = rest.partition("/")[0].rpartition(":")
        if host and port.isascii() and port.isdigit() and 0 < int(port) < 65536:
            return None
        return "needs a host and a port (ws://HOST:PORT)"
    return "must start with unix:// or ws://"


# -- replicas (bridge.replica runs them; these are what the environment says) -------------

REPLICA_ID_VARIABLE = "REST_ADAPTER_REPLICA_ID"
PEERS_VARIABLE = "REST_ADAPTER_PEERS"
DRAIN_TIMEOUT_VARIABLE = "REST_ADAPTER_DRAIN_TIMEOUT_MS"
#: A replica id: a DNS label (lower-case letters, digits, inner hyphens; 1-63 characters).
REPLICA_ID = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
DEFAULT_DRAIN_TIMEOUT_MS = 600_000


class ReplicaSettingsError(ValueError):
    """A replica variable is set to something the bridge cannot use."""


def validate_replica_id(value: str) -> str:
    if not REPLICA_ID.fullmatch(value):
        raise ReplicaSettingsError(
            f"{REPLICA_ID_VARIABLE}={value[:80]!r} is not a valid replica id: a DNS label "
            "(1-63 lower-case letters, digits and inner hyphens, e.g. bridge-0)"
        )
    return value


def parse_peers(text: str) -> dict[str, str]:
    """``id=url,id=url`` (whitespace ignored) as a mapping; a bad entry raises."""
    peers: dict[str, str] = {}
    for entry in text.replace("\n", ",").split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, equals, url = entry.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not equals or not url.startswith(("http://", "https://")):
            raise ReplicaSettingsError(
                f"{PEERS_VARIABLE}: {entry[:120]!r} is not of the form id=http://host:port"
            )
        try:
            validate_replica_id(name)
        except ReplicaSettingsError:
            raise ReplicaSettingsError(
                f"{PEERS_VARIABLE}: {name[:80]!r} is not a valid replica id"
            ) from None
        if name in peers:
            raise ReplicaSettingsError(f"{PEERS_VARIABLE}: replica {name!r} is listed twice")
        peers[name] = url
    return peers


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    """What the environment says about this replica (all optional)."""

    replica_id: str | None = None
    #: The other replicas, by id (this replica's own id is left out if listed).
    peers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    drain_timeout_ms: int = DEFAULT_DRAIN_TIMEOUT_MS
