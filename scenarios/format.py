"""The scenario format, version 1: pydantic models, and loading files with useful errors.

`scenarios/README.md` documents it. `appServer:` is a fake-codex script validated by the
fake's own models (so the file can be handed to `fake-codex --script`); `model:` is a
`fakes.model_provider.ModelScript`. What can be checked before a run is checked at load
(shape, matchers, JSONPath, every `${variable}` and stream defined by an earlier step);
`ScenarioError` messages name the file, the line and the problem.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from bridge.limits import RestLimits
from fakes.app_server.script import STEP_KINDS as FAKE_STEP_KINDS
from fakes.app_server.script import AppServerScript, ScriptError, one_key_union
from fakes.app_server.script_source import (
    _compose,
    _format_path,
    _mark,
    describe_errors,
    parse_yaml,
)
from fakes.model_provider import ModelScript
from scenarios.matching import check_matchers, compile_jsonpath, json_type

FORMAT_VERSION = 1
#: Variables every scenario has: the bridge's base URL, its token, a private directory.
BUILTIN_VARIABLES = frozenset({"base", "token", "tmp"})
VARIABLE = re.compile(r"(?<!\$)\$\{([^}]*)\}")
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ScenarioError(ValueError):
    """A scenario that cannot be run; the message names the file, the line and the problem."""


class _Model(BaseModel):
    """Base of every scenario model: camelCase keys, unknown keys rejected."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True, strict=True
    )

    @model_validator(mode="before")
    @classmethod
    def _reject_boolean_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(isinstance(key, bool) for key in data):
            raise ValueError(
                "a key was read as a boolean (YAML turns `on`, `off`, `yes`, `no` into "
                "true/false); quote it"
            )
        return data

    def given(self, name: str) -> bool:
        """Whether the document set field `name` (even to null)."""
        return name in self.model_fields_set


def check_jsonpath(expression: str) -> str:
    """A JSONPath expression that parses (compiled once and cached)."""
    try:
        compile_jsonpath(expression)
    except Exception as exc:
        raise ValueError(f"invalid JSONPath {expression!r}: {exc}") from None
    return expression


#: Any JSON value, possibly containing matcher mappings (`{$regex: ...}`).
Expected = Annotated[Any, AfterValidator(check_matchers)]
JsonPath = Annotated[str, AfterValidator(check_jsonpath)]
#: The keys of an event (long-poll and SSE alike).
EVENT_KEYS = ("seq", "kind", "method", "params", "requestKey", "receivedAt")


def _event_keys(value: Any) -> Any:
    """An event matcher's keys are an event's: `{knd: request}` would match nothing."""
    if isinstance(value, dict) and not any(str(key).startswith("$") for key in value):
        unknown = [str(key) for key in value if key not in EVENT_KEYS]
        if unknown:
            close = difflib.get_close_matches(unknown[0], EVENT_KEYS, n=1)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"an event has no key {unknown[0]!r}{guess}; its keys are {', '.join(EVENT_KEYS)}"
            )
    return value


#: An event matcher; a bare string is shorthand for `{method: <string>}`.
EventMatcher = Annotated[Any, AfterValidator(check_matchers), AfterValidator(_event_keys)]


def _variable_name(value: str) -> str:
    if not NAME.match(value):
        raise ValueError(f"{value!r} is not a variable name (letters, digits, _)")
    if value in BUILTIN_VARIABLES:
        raise ValueError(f"{value!r} is a built-in variable; pick another name")
    return value


VariableName = Annotated[str, AfterValidator(_variable_name)]


if TYPE_CHECKING:
    Limits = _Model
else:  # `RestLimits` as a model: every field optional, camelCase, positive
    Limits = create_model(
        "Limits",
        __base__=_Model,
        __doc__="Bridge limits (`RestLimits`), each optional; see the README's table.",
        **{item.name: (PositiveInt | None, None) for item in dataclasses.fields(RestLimits)},
    )


class BridgeSpec(_Model):
    """How the bridge under test is built."""

    preset: Literal["trusted", "default", "text-turn"] = "trusted"
    #: Turns bearer auth on; requests carry it unless a step says otherwise.
    token: str | None = None
    exempt_health: bool = True
    limits: Limits = Field(default_factory=Limits)
    #: Check every response against the bridge's own OpenAPI document.
    contract_check: bool = True

    @field_validator("token")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("the token must not be blank (omit it to turn auth off)")
        return value

    def rest_limits(self) -> RestLimits:
        """The limits as the bridge takes them."""
        return RestLimits(**{name: value for name, value in self.limits if value is not None})


class Checks(_Model):
    """The checks made after the last step, on what the fake (or model) reports."""

    #: Every scripted method reply, turn and model reply was asked for.
    script_used: bool = True
    #: Every server request the app-server sent was answered (or dropped by an interrupt).
    requests_answered: bool = True


AuthSpec = bool | str


class Until(_Model):
    """Repeat the step until its expectations hold, or fail at the deadline."""

    deadline_ms: PositiveInt = 10_000
    interval_ms: PositiveInt = 100


class HttpExpect(_Model):
    """What an HTTP response must look like; `status` defaults to any 2xx (non-2xx with
    `error`)."""

    status: int | list[int] | str | None = None
    headers: dict[str, Expected] | None = None
    json_body: Expected = Field(default=None, alias="json")
    json_subset: Expected = None
    json_path: dict[JsonPath, Expected] | None = None
    body: Expected = None
    error: str | dict[str, Expected] | None = None

    @field_validator("status")
    @classmethod
    def _status_pattern(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.fullmatch(r"[1-5](xx|\d\d)", value):
            raise ValueError("a status is a number, a list of numbers, or a class like 4xx")
        return value


class IdsSpec(_Model):
    """The SSE ids (or long-poll seqs) read: consecutive, and where they start."""

    first: int | str | None = None
    after: int | str | None = None
    consecutive: bool = True


class EventsExpect(_Model):
    """What a sequence of events (long-poll or SSE) must look like."""

    events: list[EventMatcher] | None = None
    subsequence: list[EventMatcher] | None = None
    absent: list[EventMatcher] | None = None
    kinds: list[str] | None = None
    methods: list[str | None] | None = None
    ids: list[int | str] | IdsSpec | Literal["consecutive"] | None = None
    count: NonNegativeInt | None = None
    quiet_ms: PositiveInt | None = None
    ended: bool | None = None
    #: SSE only: how many keep-alive comments the read saw (a number or a matcher).
    keep_alives: Expected = None
    #: Long-poll only: the read must fail with this error payload.
    error: str | dict[str, Expected] | None = None


def _check_capture(value: str | dict[str, str]) -> Any:
    if isinstance(value, dict) and len(value) != 1:
        raise ValueError("a capture is a JSONPath string, {jsonPath: ...} or {header: NAME}")
    path = value if isinstance(value, str) else value.get("jsonPath")
    if path is not None:
        check_jsonpath(path)
    return value


#: A JSONPath string, `{jsonPath: ...}`, or `{header: NAME}`.
Capture = Annotated[str | dict[Literal["jsonPath", "header"], str], AfterValidator(_check_capture)]


class _Step(_Model):
    """A step: a mapping with exactly one kind key (the class's `KIND`)."""

    KIND: ClassVar[str]
    #: How a step without a name is shown in reports (`step` is the step).
    SHOWN: ClassVar[str] = "{step.KIND}"
    name: str | None = None

    def title(self) -> str:
        return self.name or self.SHOWN.format(step=self)

    def defines(self) -> list[str]:
        """Variables this step sets."""
        return list(getattr(self, "capture", ()))


class _Captures(_Step):
    capture: dict[VariableName, Capture] = Field(default_factory=dict)


class HttpRequest(_Model):
    """Any HTTP request to the bridge."""

    method: str = "GET"
    path: str
    query: dict[str, str | int | bool] | None = None
    headers: dict[str, str] | None = None
    json_body: Any = Field(default=None, alias="json")
    body: str | None = None
    auth: AuthSpec = True
    timeout_ms: PositiveInt = 30_000

    @model_validator(mode="after")
    def _one_body(self) -> HttpRequest:
        if self.given("json_body") and self.body is not None:
            raise ValueError("give `json` or `body`, not both")
        return self


class _Background(_Captures):
    """`background: NAME` sends the request and goes on; `await: NAME` checks it later."""

    background: VariableName | None = None

    @model_validator(mode="after")
    def _checked_later(self) -> _Background:
        extra = [f"`{key}`" for key in ("expect", "capture", "until") if self.given(key)]
        if self.background is not None and extra:
            move = f"move {', '.join(extra)} there"
            raise ValueError(f"a `background` request is checked by its `await` step; {move}")
        return self


class HttpStep(_Background):
    """`http:` one request, with expectations and captures."""

    KIND = "http"
    http: HttpRequest
    expect: HttpExpect | None = None
    until: Until | None = None

    def title(self) -> str:
        return self.name or f"http {self.http.method.upper()} {self.http.path}"


class CallSpec(_Model):
    """A raw JSON-RPC call: in a session, or sessionless without `session`."""

    method: str
    session: str | None = None
    params: Any = None
    timeout_ms: PositiveInt | None = None
    options: dict[str, Any] | None = None
    auth: AuthSpec = True


class CallStep(_Background):
    """`call:` POST `/v1/sessions/{session}/call/{method}` (or `/v1/call/{method}`)."""

    KIND = "call"
    SHOWN = "call {step.call.method}"
    call: CallSpec
    expect: HttpExpect | None = None
    until: Until | None = None


class CreateSessionSpec(_Model):
    """Create a session and keep its id in the variable `as`."""

    as_: VariableName = Field(default="session", alias="as")
    options: dict[str, Any] | None = None
    auth: AuthSpec = True


def _session_shorthand(value: Any) -> Any:
    shorthand = value is None or value is True
    return {"as": value} if isinstance(value, str) else {} if shorthand else value


class CreateSessionStep(_Captures):
    """`createSession:` POST `/v1/sessions`; the id goes to `${session}` (or `as`)."""

    KIND = "createSession"
    SHOWN = "createSession {step.create_session.as_}"
    create_session: CreateSessionSpec
    expect: HttpExpect | None = None

    _shorthand = field_validator(
        "create_session", mode="before", json_schema_input_type=CreateSessionSpec | str | None
    )(_session_shorthand)

    def defines(self) -> list[str]:
        return [self.create_session.as_, *self.capture]


class ReplyErrorSpec(_Model):
    code: int
    message: str
    data: Any = None


class ReplyRequest(_Model):
    """Answer a server request: `result`, or `error`."""

    session: str
    request_key: str
    result: Any = None
    error: ReplyErrorSpec | None = None
    auth: AuthSpec = True

    @model_validator(mode="after")
    def _one_outcome(self) -> ReplyRequest:
        if self.given("result") == (self.error is not None):
            raise ValueError("give exactly one of `result` or `error`")
        return self


class ReplyStep(_Captures):
    """`reply:` POST `.../requests/{requestKey}/result` (or `/error`)."""

    KIND = "reply"
    reply: ReplyRequest
    expect: HttpExpect | None = None


class _ReadUntil(_Model):
    count: NonNegativeInt | None = None
    through: EventMatcher = None
    timeout_ms: PositiveInt = 10_000


class PollSpec(_ReadUntil):
    """Long-poll `GET .../events` until `count` events, or `through` one that matches."""

    session: str
    wait_ms: PositiveInt = 10_000
    #: Read after this seq (the cursor stays); later reads go on from the last one.
    after: int | str | None = None
    auth: AuthSpec = True

    @model_validator(mode="after")
    def _stop(self) -> PollSpec:
        if self.count is not None and self.through is not None:
            raise ValueError("give `count` or `through`, not both")
        return self


class PollStep(_Captures):
    """`poll:` read events by long-poll."""

    KIND = "poll"
    poll: PollSpec
    expect: EventsExpect | None = None


class StreamSpec(_Model):
    """Open `GET .../events/stream` and keep it open under the name `as`."""

    as_: VariableName = Field(default="stream", alias="as")
    session: str | None = None
    path: str | None = None
    last_event_id: int | str | None = None
    after: int | str | None = None
    headers: dict[str, str] | None = None
    auth: AuthSpec = True
    timeout_ms: PositiveInt = 10_000

    @model_validator(mode="after")
    def _target(self) -> StreamSpec:
        if (self.session is None) == (self.path is None):
            raise ValueError("give exactly one of `session` or `path`")
        return self


class StreamStep(_Step):
    """`stream:` open an SSE stream."""

    KIND = "stream"
    SHOWN = "stream {step.stream.as_}"
    stream: StreamSpec
    expect: HttpExpect | None = None


class ReadSpec(_ReadUntil):
    """Read frames from an open stream: `count`, `through` a match, or `toEnd`."""

    stream: str = "stream"
    to_end: bool = False

    @model_validator(mode="after")
    def _stop(self) -> ReadSpec:
        given = [self.count is not None, self.through is not None, self.to_end]
        if sum(given) > 1:
            raise ValueError("give one of `count`, `through` or `toEnd`")
        return self


class ReadStep(_Captures):
    """`read:` frames of an open SSE stream."""

    KIND = "read"
    SHOWN = "read {step.read.stream}"
    read: ReadSpec
    expect: EventsExpect | None = None


class CloseStep(_Step):
    """`close:` close an open stream."""

    KIND = "close"
    close: str


class AwaitSpec(_Model):
    """Wait for a `background` request's response."""

    request: str
    timeout_ms: PositiveInt = 30_000


def _await_shorthand(value: Any) -> Any:
    return {"request": value} if isinstance(value, str) else value


class AwaitStep(_Captures):
    """`await:` the response of a request sent with `background: NAME`."""

    KIND = "await"
    SHOWN = "await {step.await_.request}"
    await_: AwaitSpec = Field(alias="await")
    expect: HttpExpect | None = None

    _shorthand = field_validator("await_", mode="before", json_schema_input_type=AwaitSpec | str)(
        _await_shorthand
    )


STEP_TYPES: tuple[type[_Step], ...] = (
    HttpStep,
    CallStep,
    CreateSessionStep,
    ReplyStep,
    PollStep,
    StreamStep,
    ReadStep,
    CloseStep,
    AwaitStep,
)
STEP_KINDS = frozenset(step.KIND for step in STEP_TYPES)
_KINDS = STEP_KINDS | FAKE_STEP_KINDS


if TYPE_CHECKING:
    Step = _Step
else:
    Step = one_key_union(STEP_TYPES)


class Scenario(_Model):
    """A whole scenario: the bridge, the app-server (or model) script, and the steps."""

    scenario: Literal[1] = Field(description="The format version.")
    name: str | None = None
    description: str | None = None
    tags: list[str] = Field(default_factory=list)
    #: False: never run beside other scenarios (e.g. it uses a fixed file path).
    parallel: bool = True
    timeout_ms: PositiveInt = 120_000
    bridge: BridgeSpec = Field(default_factory=BridgeSpec)
    app_server: AppServerScript | None = None
    model: ModelScript | None = None
    steps: list[Step] = Field(min_length=1)
    checks: Checks = Field(default_factory=Checks)

    @model_validator(mode="after")
    def _one_backend(self) -> Scenario:
        if self.app_server is not None and self.model is not None:
            raise ValueError(
                "give `appServer` (run on fake-codex) or `model` (run the real codex with "
                "a scripted model), not both"
            )
        return self

    @property
    def real_codex(self) -> bool:
        """Whether the scenario runs the real codex (it scripts the model)."""
        return self.model is not None


@dataclass
class LoadedScenario:
    """A validated scenario and where it came from (to point at its lines)."""

    scenario: Scenario
    source: str
    path: Path | None = None
    text: str | None = None
    #: The document as parsed, before validation.
    data: Any = field(default=None, repr=False)
    _root: Any = field(default=None, repr=False)

    @property
    def name(self) -> str:
        shown = self.path.name.split(".")[0] if self.path is not None else self.source
        return self.scenario.name or shown

    def where(self, loc: tuple[Any, ...], *, column: bool = False) -> str:
        """`file:line` (`file:line:column`) of the node at `loc` (the file alone when
        unknown)."""
        if self.text is not None and self._root is None:
            self._root = _compose(self.text) or False
        if not self._root:
            return self.source
        line, at = _mark(self._root, loc)
        return f"{self.source}:{line}:{at}" if column else f"{self.source}:{line}"


def load_scenario(path: str | os.PathLike[str]) -> LoadedScenario:
    """Read and validate the scenario at `path`; raise ScenarioError naming the problem."""
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"{source}: cannot read the scenario: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ScenarioError(f"{source}: not UTF-8 text") from None
    return parse_scenario_text(text, source, Path(path))


def parse_scenario_text(text: str, source: str, path: Path | None = None) -> LoadedScenario:
    """Validate a scenario given as YAML or JSON text."""
    try:
        data = parse_yaml(text, source)
    except ScriptError as exc:
        raise ScenarioError(str(exc)) from None
    return parse_scenario(data, source, text, path)


def parse_scenario(
    data: Any, source: str = "<scenario>", text: str | None = None, path: Path | None = None
) -> LoadedScenario:
    """Validate an already-parsed scenario (a mapping, e.g. built in Python)."""
    if not isinstance(data, dict) or "scenario" not in data:
        raise ScenarioError(
            f"{source}:1: not a scenario: a scenario is a mapping whose first key is "
            f"`scenario: {FORMAT_VERSION}` (the format version)"
        )
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(
            describe_errors(
                exc, source, text, (), title="invalid scenario", tags=_KINDS, message=_message
            )
        ) from None
    loaded = LoadedScenario(scenario, source, path, text, data)
    lines = [
        f"  {loaded.where(loc)}: {_format_path(loc)}: {why}"
        for loc, why in _static_problems(scenario)
    ]
    if lines:
        raise ScenarioError("\n".join([f"invalid scenario {source}:", *lines]))
    return loaded


def _message(error: Any) -> str:
    if error["type"] == "step_kind":
        if error["loc"][:1] == ("appServer",):  # a fake-codex step, with its own kinds
            return _step_kind_problem(error.get("input"), FAKE_STEP_KINDS, _FAKE_STEP_EXTRAS)
        return _step_kind_problem(error.get("input"), STEP_KINDS, _STEP_EXTRAS)
    return str(error["msg"]).removeprefix("Value error, ")


#: The keys a step may have besides its kind: a scenario's, and fake-codex's.
_STEP_EXTRAS = frozenset({"name", "expect", "capture", "until", "background"})
_FAKE_STEP_EXTRAS = frozenset({"onReply", "newline"})


def _step_kind_problem(step: Any, known: frozenset[str], extras: frozenset[str]) -> str:
    """Why `step` has no kind: the keys it has instead, named, and the kinds there are."""
    kinds = ", ".join(sorted(known))
    if not isinstance(step, dict):
        what = json_type(step)
        return f"a step is a mapping with exactly one of the keys {kinds}; this is a JSON {what}"
    present = [key for key in step if key in known]
    if len(present) > 1:
        return f"a step has exactly one kind; this one has {', '.join(present)}"
    unknown = [str(key) for key in step if key not in extras]
    if not unknown:
        return f"the step has no kind: add one of the keys {kinds}"
    guesses = [repr(key) + _did_you_mean(key, known) for key in unknown]
    noun = "kind" if len(unknown) == 1 else "kinds"
    return f"unknown step {noun} {', '.join(guesses)}; a step's kind is one of {kinds}"


def _did_you_mean(key: str, known: frozenset[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _static_problems(scenario: Scenario) -> Iterator[tuple[tuple[Any, ...], str]]:
    """Variables used before they are set, streams read before they are opened."""
    defined = set(BUILTIN_VARIABLES)
    streams: set[str] = set()
    background: set[str] = set()
    for index, step in enumerate(scenario.steps):
        loc = ("steps", index)
        body = step.model_dump(by_alias=True, exclude={"capture", "name"})
        for sub_loc, name in _variables(body, ()):
            if name not in defined:
                known = ", ".join(sorted(defined))
                yield (
                    (*loc, *sub_loc),
                    f"${{{name}}} is not defined here (defined so far: {known}); a "
                    "variable is set by an earlier step's `capture` or `createSession`",
                )
        if isinstance(step, HttpStep | CallStep) and step.background is not None:
            background.add(step.background)
        elif isinstance(step, AwaitStep) and step.await_.request not in background:
            started = ", ".join(sorted(background)) or "none"
            yield (
                (*loc, "await"),
                f"no request named {step.await_.request!r} was sent in the background "
                f"before this step (sent: {started}); give a step `background: NAME`",
            )
        if isinstance(step, StreamStep):
            streams.add(step.stream.as_)
        elif isinstance(step, ReadStep | CloseStep):
            name = step.read.stream if isinstance(step, ReadStep) else step.close
            if name not in streams:
                opened = ", ".join(sorted(streams)) or "none"
                yield (
                    (*loc, step.KIND),
                    f"stream {name!r} is not open here (open: {opened}); open it with a "
                    "`stream:` step first",
                )
            if isinstance(step, CloseStep):
                streams.discard(name)
        defined.update(step.defines())


def _variables(value: Any, loc: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], str]]:
    if isinstance(value, str):
        for found in VARIABLE.finditer(value):
            yield loc, found.group(1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):  # JSONPath keys of `jsonPath:` may use variables too
                yield from _variables(key, (*loc, key))
            yield from _variables(item, (*loc, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _variables(item, (*loc, index))


def dump_yaml(data: Any) -> str:
    """YAML text of `data` (for writing scenarios built in Python)."""
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
