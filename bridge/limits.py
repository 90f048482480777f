"""Resource limits of the bridge (``RestLimits``), loadable from the environment."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_PREFIX = "REST_ADAPTER_"
#: Past this much unsent data on an app-server's stdin, new calls are refused.
MAX_STDIN_BUFFER = 16 * 1024 * 1024
#: What one buffered event costs beyond its JSON bytes (the event object, its list slot).
EVENT_OVERHEAD = 200


class RestLimitsEnvError(ValueError):
    """A ``REST_ADAPTER_*`` limit variable is set but is not a valid value of its type."""

    def __init__(self, variable: str, value: str, expected: str) -> None:
        super().__init__(f"{variable}={value!r} is not a valid {expected}")
        self.variable = variable
        self.value = value
        self.expected = expected


@dataclass(frozen=True, slots=True)
class RestLimits:
    """Bounds on what the bridge holds and how long it waits.

    Each field can be set from the environment as ``REST_ADAPTER_<FIELD IN CAPITALS>``,
    e.g. ``REST_ADAPTER_MAX_SESSIONS=16``.
    """

    max_sessions: int = 64
    max_body_bytes: int = 1_048_576
    call_timeout_ms: int = 60_000
    text_turn_timeout_ms: int = 600_000
    spawn_timeout_ms: int = 15_000
    max_wait_ms: int = 30_000
    event_buffer: int = 4096
    session_idle_timeout_ms: int = 1_800_000
    sse_keepalive_ms: int = 15_000
    max_concurrent_text_turns: int = 8
    max_line_bytes: int = 16_777_216
    shutdown_grace_ms: int = 3000
    #: The bytes of one session's event log (the events' JSON), as EVENT_BUFFER bounds
    #: their number; what either drops is announced by a ``gap`` event.
    event_buffer_bytes: int = 33_554_432
    #: How long a request body may take to arrive (408 ``request_timeout``).
    body_timeout_ms: int = 30_000
    #: How long an SSE stream that is behind may stop reading before the app-server's
    #: output is no longer held back for it (it then gets a ``gap``).
    reader_stall_ms: int = 10_000

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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RestLimits:
        """Defaults overridden by every ``REST_ADAPTER_*`` limit that is set.

        Raises :class:`RestLimitsEnvError` for a set variable that is not a positive
        integer, naming the variable, its value and the expected type.
        """
        env = os.environ if environ is None else environ
        values: dict[str, int] = {}
        for field in dataclasses.fields(cls):
            variable = cls.env_variable(field.name)
            raw = env.get(variable)
            if raw is None:
                continue
            # ASCII digits only: not " 5 ", "+5", "1_000" or other scripts' digits, which
            # int() takes, so that what the environment says is what the docs show.
            if not raw.isascii() or not raw.isdigit() or int(raw) < 1:
                raise RestLimitsEnvError(variable, raw, "positive integer")
            parsed = int(raw)
            values[field.name] = parsed
        return cls(**values)
