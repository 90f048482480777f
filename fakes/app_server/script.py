"""The fake's script: pydantic models of the document, and loading it with useful errors.

A script is YAML (or JSON, which YAML reads too). It is either the app-server section
itself or a document with a top-level `appServer:` key, such as a scenario file; other
top-level keys of such a document are ignored. See `fakes/app_server/README.md`.

The models are written with real annotations (no `from __future__ import annotations`):
pydantic would otherwise compile and evaluate each annotation's text when it builds
them, at every scripted start. Only the recursive `Step` is a string. Likewise the
default factories are functions rather than the `dict` and `list` types, whose
signatures pydantic would ask `inspect` for (parsing a builtin's text signature compiles
the tokenizer's regular expressions).
"""

import os
import signal
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeInt,
    PositiveInt,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from fakes.app_server import protocol
from fakes.app_server.script_source import ScriptError, check_depth, describe_errors, parse_yaml

__all__ = [
    "AppServerScript",
    "MethodBehavior",
    "ScriptError",
    "Step",
    "TurnScript",
    "load_script",
    "parse_script",
    "parse_script_text",
]

SECTION_KEY = "appServer"

RequestIdSpec = int | str


class _Model(BaseModel):
    """Base of every script model: camelCase keys, unknown keys rejected."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        defer_build=True,
        strict=True,  # `timeoutMs: 1.0` or `count: "2"` is a mistake, not a number
    )

    @model_validator(mode="before")
    @classmethod
    def _reject_boolean_keys(cls, data: Any) -> Any:
        # YAML 1.1 reads `on:`, `yes:`, `no:` as booleans, which pydantic would report
        # as a baffling type error.
        if isinstance(data, dict) and any(isinstance(key, bool) for key in data):
            raise ValueError(
                "a key was read as a boolean (YAML turns `on`, `off`, `yes`, `no` into "
                "true/false); quote it, and note that reply branches are `onReply:`"
            )
        return data


# The shorthands below are before-validators that declare what they accept
# (`json_schema_input_type`), so the generated JSON Schema documents them too.


def _scalar_shorthand(field: str, key: str, scalar: Any) -> Any:
    """`field: <scalar>` means `field: {key: <scalar>}`."""

    def wrap(value: Any) -> Any:
        return value if isinstance(value, dict) else {key: value}

    return field_validator(field, mode="before", json_schema_input_type=scalar | dict)(wrap)


def _flag_shorthand(field: str) -> Any:
    """`field: true` or `field:` (empty) means "all defaults"."""

    def empty(value: Any) -> Any:
        return {} if value is True or value is None else value

    flag = Literal[True] | None | dict[str, Any]
    return field_validator(field, mode="before", json_schema_input_type=flag)(empty)


class RpcErrorSpec(_Model):
    """A JSON-RPC error object; `data` is sent only when given."""

    code: int
    message: str
    data: Any = None

    def to_wire(self) -> dict[str, Any]:
        """The error as it goes on the wire."""
        wire: dict[str, Any] = {"code": self.code, "message": self.message}
        if "data" in self.model_fields_set:
            wire["data"] = self.data
        return wire


class ReplySpec(_Model):
    """A reply to a client request: `result`, `error`, or neither (the built-in reply)."""

    result: Any = None
    error: RpcErrorSpec | None = None

    @property
    def has_result(self) -> bool:
        """Whether `result` was given (`result: null` counts)."""
        return "result" in self.model_fields_set

    @model_validator(mode="after")
    def _one_outcome(self) -> "ReplySpec":
        if self.has_result and self.error is not None:
            raise ValueError("give `result` or `error`, not both")
        return self


class UnknownIdReply(ReplySpec):
    """A response to an id the client never used."""

    id: RequestIdSpec = 987654321


class AgentMessage(_Model):
    """An agentMessage item: `text`, or `sentences` of seeded Faker text (1-3 if neither)."""

    text: str | None = None
    sentences: PositiveInt | None = None
    deltas: NonNegativeInt | None = None
    delta_delay_ms: NonNegativeInt = 0
    events: tuple[Literal["started", "deltas", "completed"], ...] = Field(
        default=("started", "deltas", "completed"),
        strict=False,  # a YAML list is a tuple
    )
    id: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "AgentMessage":
        if self.text is not None and self.sentences is not None:
            raise ValueError("give `text` or `sentences`, not both")
        return self


class CommandApproval(_Model):
    """A command the agent wants to run, behind `item/commandExecution/requestApproval`.

    Without `command`, a plausible one is made up (seeded).
    """

    command: str | None = None
    cwd: str | None = None
    output: str | None = None
    exit_code: int = 0
    touch: str | None = None
    reason: str | None = None
    id: RequestIdSpec | None = None


class FileChangeApproval(_Model):
    """A file the agent wants to change, behind `item/fileChange/requestApproval`.

    Without `path`, a plausible one in the thread's directory is made up (seeded).
    """

    path: str | None = None
    content: str = ""
    kind: Literal["add", "update", "delete"] = "add"
    write: bool = False
    reason: str | None = None
    id: RequestIdSpec | None = None


class ServerRequestSpec(_Model):
    """Any server-to-client request; `params` are laid over real-shaped defaults."""

    method: str
    params: dict[str, Any] | None = None
    id: RequestIdSpec | None = None
    wait: bool = True


class NotifySpec(_Model):
    """Any notification."""

    method: str
    params: Any = Field(default_factory=lambda: {})


class FloodSpec(_Model):
    """Many identical notifications, written as fast as the pipe takes them."""

    count: PositiveInt
    method: str = "item/agentMessage/delta"
    params: dict[str, Any] | None = None


class ExitSpec(_Model):
    """Exit with `code`, or die by `signal` (a name such as `KILL` or `SIGKILL`).

    Under `--listen` an exit ends this connection only, unless `server` is true: then
    the whole process exits (on stdio the two are the same)."""

    code: int = 0
    signal: str | None = None
    server: bool = False

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
        if name not in signal.Signals.__members__:
            raise ValueError(f"unknown signal {value!r}")
        return name


class StallSpec(_Model):
    """Stop doing anything; by default still die on SIGTERM but not on stdin EOF."""

    ignore_term: bool = False
    exit_on_eof: bool = False


class SpawnChildSpec(_Model):
    """A long-lived grandchild in the fake's process group."""

    command: list[str] = Field(default_factory=lambda: ["sleep", "1000"], min_length=1)
    inherit_stdio: bool = False
    #: Wait for the command to exit before the next step (a command that hands work to
    #: a descendant and exits once it is set up).
    wait: bool = False


class TurnErrorSpec(_Model):
    """The `TurnError` of a failed turn."""

    message: str
    codex_error_info: Any = None
    additional_details: str | None = None


class CompleteTurn(_Model):
    """End the current turn now."""

    status: Literal["completed", "interrupted", "failed"] = "completed"
    error: TurnErrorSpec | None = None


class _Step(_Model):
    """A step: a mapping with exactly one kind key (the class's `KIND`)."""

    KIND: ClassVar[str]


#: The keys an `onReply` branch may have: the decisions of codex's approval requests
#: (the v2 ones and the older review decisions), a permissions grant's scope, and
#: `error`, `result`, `default` (see `steps.reply_key`).
REPLY_KEYS = frozenset(
    {
        *("accept", "acceptForSession", "acceptWithExecpolicyAmendment", "decline", "cancel"),
        *("applyNetworkPolicyAmendment", "approved", "approved_for_session", "denied", "abort"),
        *("approved_execpolicy_amendment", "turn", "session", "error", "result", "default"),
    }
)


def _reply_keys(closed: bool) -> Any:
    """Refuse a typo'd `onReply` key, which no reply would ever select. An approval's
    keys are the known ones; a `request` may get any decision of its own, so there only
    a key close to a known one but not it (`decilne`) is refused."""

    def check(value: Any) -> Any:
        for key in value or {}:
            if key in REPLY_KEYS:
                continue
            import difflib  # only here: importing it compiles a namedtuple's code

            close = difflib.get_close_matches(str(key), sorted(REPLY_KEYS), n=1, cutoff=0.75)
            if closed or close:
                guess = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"{key!r} is no reply's key{guess}; a branch is one of "
                    f"{', '.join(sorted(REPLY_KEYS))}"
                )
        return value

    return field_validator("on_reply")(check)


class AgentMessageStep(_Step):
    KIND = "agentMessage"
    agent_message: AgentMessage

    _shorthand = _scalar_shorthand("agent_message", "text", str)


class CommandApprovalStep(_Step):
    KIND = "commandApproval"
    command_approval: CommandApproval
    on_reply: dict[str, list["Step"]] | None = None

    _replies = _reply_keys(closed=True)


class FileChangeApprovalStep(_Step):
    KIND = "fileChangeApproval"
    file_change_approval: FileChangeApproval
    on_reply: dict[str, list["Step"]] | None = None

    _replies = _reply_keys(closed=True)


class RequestStep(_Step):
    KIND = "request"
    request: ServerRequestSpec
    on_reply: dict[str, list["Step"]] | None = None

    _replies = _reply_keys(closed=False)


class NotifyStep(_Step):
    KIND = "notify"
    notify: NotifySpec


class SleepStep(_Step):
    KIND = "sleep"
    sleep: NonNegativeInt


class StderrStep(_Step):
    KIND = "stderr"
    stderr: str


class StderrFloodStep(_Step):
    KIND = "stderrFlood"
    stderr_flood: PositiveInt


class RawStep(_Step):
    KIND = "raw"
    raw: str
    newline: bool = True


class BigLineStep(_Step):
    KIND = "bigLine"
    big_line: PositiveInt


class FloodStep(_Step):
    KIND = "flood"
    flood: FloodSpec


class RespondStep(_Step):
    KIND = "respond"
    respond: ReplySpec

    _shorthand = _flag_shorthand("respond")


class RespondTwiceStep(_Step):
    KIND = "respondTwice"
    respond_twice: ReplySpec

    _shorthand = _flag_shorthand("respond_twice")


class RespondUnknownIdStep(_Step):
    KIND = "respondUnknownId"
    respond_unknown_id: UnknownIdReply

    _shorthand = _flag_shorthand("respond_unknown_id")


class ExitStep(_Step):
    KIND = "exit"
    exit: ExitSpec

    _shorthand = _scalar_shorthand("exit", "code", int)


class StallStep(_Step):
    KIND = "stall"
    stall: StallSpec

    _shorthand = _flag_shorthand("stall")


class SpawnChildStep(_Step):
    KIND = "spawnChild"
    spawn_child: SpawnChildSpec

    _shorthand = _flag_shorthand("spawn_child")


class CompleteTurnStep(_Step):
    KIND = "completeTurn"
    complete_turn: CompleteTurn

    _shorthand = _flag_shorthand("complete_turn")


STEP_TYPES: tuple[type[_Step], ...] = (
    AgentMessageStep,
    CommandApprovalStep,
    FileChangeApprovalStep,
    RequestStep,
    NotifyStep,
    SleepStep,
    StderrStep,
    StderrFloodStep,
    RawStep,
    BigLineStep,
    FloodStep,
    RespondStep,
    RespondTwiceStep,
    RespondUnknownIdStep,
    ExitStep,
    StallStep,
    SpawnChildStep,
    CompleteTurnStep,
)
STEP_KINDS: frozenset[str] = frozenset(step.KIND for step in STEP_TYPES)


def one_key_union(types: tuple[type[Any], ...]) -> Any:
    """The union of step models told apart by their one kind key (each type's `KIND`).

    A mapping with exactly one of the kind keys is that kind; any other value fails
    with the error type `step_kind`, whose message names the kinds. Scenario steps
    (`scenarios.format`) are such a union too.
    """
    kinds = frozenset(step.KIND for step in types)

    def kind(value: Any) -> str | None:
        if isinstance(value, dict):
            found = [key for key in value if key in kinds]
            return found[0] if len(found) == 1 else None
        return getattr(value, "KIND", None)

    tagged = tuple(Annotated[step, Tag(step.KIND)] for step in types)
    message = "a step is a mapping with exactly one of the keys " + ", ".join(sorted(kinds))
    return Annotated[
        Union[tagged],  # noqa: UP007 (a union built from a tuple)
        Discriminator(kind, custom_error_type="step_kind", custom_error_message=message),
    ]


if TYPE_CHECKING:
    Step = _Step
else:
    Step = one_key_union(STEP_TYPES)


class MethodBehavior(ReplySpec):
    """How the fake answers one client request: steps, then a reply.

    The reply is `result` or `error` when given, else the built-in one; a `respond`
    step answers earlier, and `noReply: true` never answers. `match` limits it to
    requests whose params contain those keys and values; `repeat` keeps it from being
    used up.
    """

    steps: list["Step"] = Field(default_factory=lambda: [])
    no_reply: bool = False
    match: dict[str, Any] | None = None
    repeat: bool = False


class Usage(_Model):
    """The token usage a turn reports."""

    input_tokens: NonNegativeInt = 100
    output_tokens: NonNegativeInt = 20
    cached_input_tokens: NonNegativeInt = 0
    reasoning_output_tokens: NonNegativeInt = 0


class TurnScript(_Model):
    """One turn: steps between the turn's opening and closing notifications.

    Each `turn/start` takes the first turn whose `match` its params fit, and uses it
    up unless it has `repeat: true`.
    """

    steps: list["Step"] = Field(default_factory=lambda: [])
    no_completion: bool = False
    usage: Usage | None = None
    match: dict[str, Any] | None = None
    repeat: bool = False


class AppServerScript(_Model):
    """A whole script: the app-server section of a scenario."""

    version: Literal[1]
    seed: int | None = None
    version_output: str | None = None
    codex_version: str | None = None
    initialize: MethodBehavior | None = None
    on_initialized: list["Step"] = Field(default_factory=lambda: [])
    methods: dict[str, list[MethodBehavior]] = Field(default_factory=lambda: {})
    unknown_methods: MethodBehavior | None = None
    turns: list[TurnScript] = Field(default_factory=lambda: [])

    @field_validator(
        "methods",
        mode="before",
        json_schema_input_type=dict[str, MethodBehavior | list[MethodBehavior]],
    )
    @classmethod
    def _listify(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        return {key: entry if isinstance(entry, list) else [entry] for key, entry in value.items()}

    @field_validator("codex_version")
    @classmethod
    def _emulated(cls, value: str | None) -> str | None:
        """The release to emulate: one that fake-codex has a protocol profile of."""
        if value is not None and value not in protocol.versions():
            known = ", ".join(protocol.versions())
            raise ValueError(f"fake-codex emulates codex {known}, not {value!r}")
        return value

    @field_validator("turns", mode="before", json_schema_input_type=list[TurnScript | str])
    @classmethod
    def _text_turns(cls, value: Any) -> Any:
        """A turn given as a string is one agentMessage of that text."""
        if not isinstance(value, list):
            return value
        return [{"steps": [{"agentMessage": t}]} if isinstance(t, str) else t for t in value]

    @field_validator("methods")
    @classmethod
    def _not_initialize(
        cls, value: dict[str, list[MethodBehavior]]
    ) -> dict[str, list[MethodBehavior]]:
        if "initialize" in value:
            raise ValueError("script `initialize` with the top-level `initialize:` key")
        return value


def load_script(path: str | os.PathLike[str]) -> AppServerScript:
    """Read and validate the script at `path`; raise ScriptError naming what is wrong."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ScriptError(f"{source}: cannot read the script: {exc.strerror}") from exc
    return parse_script_text(text, source)


def parse_script_text(text: str, source: str = "<script>") -> AppServerScript:
    """Validate a script given as YAML or JSON text."""
    return parse_script(parse_yaml(text, source), source, text)


def parse_script(data: Any, source: str = "<script>", text: str | None = None) -> AppServerScript:
    """Validate an already-parsed script (or a document with an `appServer:` section).

    With the original `text`, error messages point at lines.
    """
    prefix: tuple[str, ...] = ()
    if isinstance(data, dict) and SECTION_KEY in data:
        data, prefix = data[SECTION_KEY], (SECTION_KEY,)
    check_depth(data, source, text, prefix)
    try:
        return AppServerScript.model_validate(data)
    except ValidationError as exc:
        raise ScriptError(
            describe_errors(exc, source, text, prefix, tags=STEP_KINDS, message=_message)
        ) from None


def _message(error: Any) -> str:
    return str(error["msg"]).removeprefix("Value error, ")
