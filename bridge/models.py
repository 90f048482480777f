"""Wire records of the HTTP API (docs/API.md), the single source of the OpenAPI schemas.

Field names are camelCase on the wire and snake_case in Python. Request records
forbid unknown fields, so a typo is a 400 rather than a silently ignored option.
Traffic that the bridge only forwards (JSON-RPC params and results, event payloads)
is typed ``Any`` and never validated here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

#: An RFC 3339 UTC timestamp with milliseconds, e.g. ``2026-11-21T23:44:45.123Z``.
Timestamp = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]


def _integral(value: Any) -> Any:
    """``1000.0`` is an integer in JSON Schema's eyes: take it as ``1000``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: A JSON integer that JSON-RPC can carry: within 64 bits, `1000.0` accepted as `1000`.
JsonInt = Annotated[int, Field(ge=-(2**63), le=2**63 - 1), BeforeValidator(_integral)]
#: A timeout in milliseconds.
Milliseconds = Annotated[int, Field(ge=1, le=2**63 - 1), BeforeValidator(_integral)]


class _Wire(BaseModel):
    # defer_build: a model's validator and serializer are built when it is first used,
    # not at import (6% of the instructions of `rest-bridge serve` up to listening); a
    # bridge builds those of the routes it is asked, the OpenAPI document all of them.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, defer_build=True)


class _Request(_Wire):
    # Strict: `"includeEvents": 0` or `"timeoutMs": "5"` is a wrong type (400), as the
    # OpenAPI schema says, not something to coerce.
    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorPayload(_Wire):
    """RestErrorResponse: the body of every error response."""

    error: str = Field(description="Short error kind, e.g. `session_not_found`.")
    message: str = Field(description="Human-readable explanation.")
    code: int | None = Field(default=None, description="JSON-RPC error code, when one applies.")
    data: Any = Field(default=None, description="Details, e.g. validation errors.")


class Health(_Wire):
    status: Literal["ok"] = "ok"
    version: str


class SharedAppServerState(_Wire):
    """Shared mode: the one app-server every session is a connection to."""

    source: Literal["supervised", "url"] = Field(
        description="`supervised`: started by the bridge; `url`: one it connects to."
    )
    state: Literal["idle", "starting", "running", "restarting", "failed", "stopped", "external"]
    pid: int | None = Field(default=None, description="The supervised process, while it runs.")
    connections: int = Field(description="Open connections: sessions, calls and text turns.")
    restarts: int = Field(description="How many times it died and was started again.")
    last_exit: dict[str, Any] | None = Field(
        default=None,
        description="`{exitCode, signal, at, wedged}` of its last death; `wedged`: killed "
        "by the bridge for not answering its liveness probe.",
    )
    restart_in_ms: int | None = Field(
        default=None, description="While restarting (or after a failed start): when it starts."
    )
    user_agent: str | None = Field(
        default=None, description="The `userAgent` of the last `initialize` answered."
    )


class AppServerInfo(_Wire):
    command: list[str]
    version: str | None
    version_error: str | None
    mode: Literal["process", "shared"] = Field(
        default="process",
        description="`process`: an app-server per session; `shared`: one for all of them.",
    )
    shared: SharedAppServerState | None = None
    kind: Literal["codex", "fake-codex"] | None = Field(
        default=None,
        description="`fake-codex` or a real `codex`, from the userAgent of the last "
        "`initialize` answered; null until an app-server has answered one.",
    )
    tested: bool | None = Field(
        default=None,
        description="Whether its version is one of `testedVersions`; null when the version "
        "is unknown.",
    )
    tested_versions: list[str] = Field(
        default_factory=list,
        description="The codex releases this bridge is tested against (its support window).",
    )
    warning: str | None = Field(
        default=None,
        description="One line when the app-server is not a tested release, else null.",
    )


class Compatibility(_Wire):
    bridge_version: str
    api_version: Literal["v1"] = "v1"
    openapi: Literal["3.1.0"] = "3.1.0"
    app_server: AppServerInfo
    #: Which replica answered (REST_ADAPTER_REPLICA_ID; null on a bridge alone), and
    #: whether it drains (no new sessions, sessionless calls or text turns).
    replica: str | None = None
    draining: bool = False


class ClientInfo(_Request):
    name: str
    title: str | None = None
    version: str


#: What the operating system can take in a path, an argument or a variable: no NUL.
OsText = Annotated[str, Field(pattern=r"^[^\x00]*$")]
#: A variable name: not empty, no `=`, no NUL.
EnvName = Annotated[str, Field(pattern=r"^[^=\x00]+$")]


class ClientOptions(_Request):
    """How a request that spawns an app-server process shapes it and its `initialize`."""

    client_info: ClientInfo | None = None
    cwd: OsText | None = Field(default=None, description="Working directory of the process.")
    env: (
        Annotated[
            dict[EnvName, OsText],
            # What pydantic would write, patternProperties, allows any other name too.
            WithJsonSchema(
                {
                    "type": "object",
                    "propertyNames": {"pattern": r"^[^=\x00]+$"},
                    "additionalProperties": {"type": "string", "pattern": r"^[^\x00]*$"},
                }
            ),
        ]
        | None
    ) = Field(default=None, description="Variables added to the process environment.")
    config_overrides: list[Annotated[str, Field(pattern=r"^[^\x00]*=[^\x00]*$")]] | None = Field(
        default=None, description="`key=value` pairs passed as `-c key=value`."
    )
    experimental_api: bool | None = None
    opt_out_notification_methods: list[str] | None = None

    def set_fields(self) -> list[str]:
        """Wire names of the fields the caller set (to check against a preset's policy)."""
        return [to_camel(name) for name in self.model_fields_set]


def shaped_by_caller(options: ClientOptions | None) -> bool:
    """Whether a start carried client options (a name, capabilities, cwd, env, `-c`
    overrides...): what it met may be the caller's doing, not the bridge's."""
    return options is not None and bool(options.model_dump(exclude_none=True))


class SessionCreateRequest(_Request):
    options: ClientOptions | None = None


class SessionCreated(_Wire):
    session_id: str
    created_at: Timestamp
    initialize: Any = Field(description="The app-server's `initialize` result, untouched.")


class SessionSummary(_Wire):
    session_id: str
    created_at: Timestamp
    last_activity_at: Timestamp
    state: Literal["running", "exited"]
    exit_code: int | None
    pending_requests: list[str]
    next_seq: int
    buffered_events: int


class SessionList(_Wire):
    sessions: list[SessionSummary]
    unavailable_replicas: list[str] | None = Field(
        default=None,
        description="Behind a front with several replicas (REST_ADAPTER_PEERS set): the "
        "replicas whose sessions could not be listed.",
    )


class StatusResponse(_Wire):
    status: str
    session_id: str | None = None
    request_key: str | None = None


class CallBody(_Request):
    """Body of a raw method call inside a session."""

    params: Any = None
    timeout_ms: Milliseconds | None = None


class SessionlessCallBody(CallBody):
    """Body of a raw method call on a process spawned for this call alone."""

    options: ClientOptions | None = None


class CallResponse(_Wire):
    result: Any = Field(description="The JSON-RPC result, untouched.")


class ReplyResult(_Request):
    result: Any = Field(description="The JSON-RPC result sent to the app-server.")


class ReplyError(_Request):
    code: JsonInt
    message: str
    data: Any = None


EventKind = Literal["notification", "request", "exit", "gap"]


class EventResponse(_Wire):
    """One event of a session's log."""

    seq: int = Field(description="Position in the session's log, from 1, never repeated.")
    kind: EventKind
    method: str | None
    params: Any
    request_key: str | None
    received_at: Timestamp


ApprovalPolicy = Literal["decline", "accept", "acceptForSession", "cancel"]


class TextTurnRequest(_Request):
    text: str = Field(min_length=1)
    approval_policy: ApprovalPolicy = "decline"
    thread_params: dict[str, Any] | None = None
    turn_params: dict[str, Any] | None = None
    timeout_ms: Milliseconds | None = None
    options: ClientOptions | None = None
    include_events: bool = False


class Approval(_Wire):
    method: str
    request_key: str
    decision: str


class TextTurnResponse(_Wire):
    text: str
    thread_id: str
    turn_id: str
    status: Literal["completed", "interrupted", "failed"]
    error: dict[str, Any] | None
    usage: dict[str, Any] | None
    approvals: list[Approval]
    events: list[EventResponse] | None = None
