"""Every ``REST_ADAPTER_*`` variable of the bridge, read and parsed in one place.

One pydantic-settings model per concern; :class:`BridgeSettings` is all of them. Each
field is one variable (the prefix and the field's name in capitals) with its default,
bounds and description: the model is also the list of the variables the bridge knows
(:meth:`BridgeSettings.unknown_variables`) and of docs/API.md's rows (a test compares).

One rule for integers: plain ASCII digits, a positive value (not ``" 5"``, ``"+5"``,
``"1_0"`` or digits of other scripts, which ``int()`` would take). A bad value raises its
concern's error (:class:`bridge.limits.RestLimitsEnvError` or
:class:`~bridge.limits.ReplicaSettingsError`), naming the variable and the value.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from bridge.credentials import read_secret
from bridge.limits import (
    APP_SERVER_MODES,
    DEFAULT_DRAIN_TIMEOUT_MS,
    ENV_PREFIX,
    AppServerSettings,
    ReplicaSettings,
    ReplicaSettingsError,
    RestLimits,
    RestLimitsEnvError,
    parse_peers,
    url_problem,
    validate_replica_id,
)
from bridge.logs import DEFAULT_FORMAT, DEFAULT_LEVEL, LOG_FORMATS, LOG_LEVELS
from bridge.policy import MethodPolicy, parse_rules

#: The most characters of a bad value an error message repeats.
SHOWN_CHARACTERS = 80
LIMIT_FIELDS = tuple(field.name for field in dataclasses.fields(RestLimits))


def variable_name(field_name: str) -> str:
    """The variable of a field: ``max_sessions`` → ``REST_ADAPTER_MAX_SESSIONS``."""
    return ENV_PREFIX + field_name.upper()


def positive_integer(variable: str, raw: str, error: type[ValueError] = RestLimitsEnvError) -> int:
    """``raw`` as a positive integer written in plain ASCII digits, or ``error`` naming
    ``variable`` and (its first :data:`SHOWN_CHARACTERS` characters of) ``raw``."""
    if raw.isascii() and raw.isdigit():
        try:
            value = int(raw)
        except ValueError:  # more digits than Python converts: no limit is that big
            value = 0
        if value >= 1:
            return value
    if error is RestLimitsEnvError:
        raise RestLimitsEnvError(variable, raw, "positive integer")
    raise error(f"{variable}={raw[:SHOWN_CHARACTERS]!r} is not a valid positive integer")


class Variables(BaseSettings):
    """A group of ``REST_ADAPTER_*`` variables, one field each, built by :meth:`from_env`
    from any mapping (the process's environment by default), never behind its back."""

    # defer_build: a group's validator is built when the group is first used, not at
    # import; `serve` uses BridgeSettings alone, and the eight groups it is made of were
    # built for nothing in every process that imports the bridge.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=True, frozen=True, defer_build=True
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # from_env reads the variables and passes them in; nothing else is a source.
        return (init_settings,)

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Field name → variable, for every variable of the group, in order."""
        return {name: variable_name(name) for name in cls.model_fields}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """The group's variables in ``environ`` (default: this process's environment);
        raises the error of the first one (in the model's order) set to what it cannot be."""
        env = os.environ if environ is None else environ
        given = {
            name: env[variable] for name, variable in cls.variables().items() if variable in env
        }
        try:
            return cls(**given)
        except ValidationError as exc:
            for error in exc.errors():
                cause = error.get("ctx", {}).get("error")
                if isinstance(cause, ValueError):
                    raise cause from None
            raise  # a type the rules above do not produce (a host passing a non-string)

    def _secret(self, name: str) -> str | None:
        """The secret of field ``name``, from its variable or the file its ``_FILE``
        variable names (:func:`bridge.credentials.read_secret`)."""
        given = {
            variable_name(field): value
            for field in (name, name + "_file")
            if (value := getattr(self, field)) is not None
        }
        return read_secret(variable_name(name), given)


class _LimitRules(Variables):
    """What :data:`LimitVariables` adds to its fields, made from RestLimits' own."""

    @field_validator(*LIMIT_FIELDS, mode="before", check_fields=False)
    @classmethod
    def _digits(cls, raw: Any, info: ValidationInfo) -> Any:
        if isinstance(raw, str):
            return positive_integer(variable_name(str(info.field_name)), raw)
        return raw

    def limits(self) -> RestLimits:
        return RestLimits(**{name: getattr(self, name) for name in LIMIT_FIELDS})


if TYPE_CHECKING:
    LimitVariables = _LimitRules
else:
    # One field for each of RestLimits', with its default and description: a new limit
    # is a variable (and a row the docs must have) at once.
    LimitVariables = create_model(
        "LimitVariables",
        __doc__="``REST_ADAPTER_<LIMIT>``: the fields of :class:`~bridge.limits.RestLimits`.",
        __base__=_LimitRules,
        __module__=__name__,
        **{
            field.name: (int, Field(field.default, ge=1, description=field.metadata["description"]))
            for field in dataclasses.fields(RestLimits)
        },
    )


class MethodPolicyVariables(Variables):
    """The host's method rules (:class:`~bridge.policy.MethodPolicy`)."""

    allow_methods: frozenset[str] = Field(
        frozenset(), description="method rules allowed over the preset's, comma-separated"
    )
    refuse_methods: frozenset[str] = Field(
        frozenset(), description="method rules refused, comma-separated"
    )

    @field_validator("allow_methods", "refuse_methods", mode="before")
    @classmethod
    def _rules(cls, raw: Any, info: ValidationInfo) -> Any:
        if isinstance(raw, str):
            return parse_rules(raw, variable_name(str(info.field_name)))
        return raw

    def method_policy(self) -> MethodPolicy:
        return MethodPolicy(allow=self.allow_methods, refuse=self.refuse_methods)


class AuthVariables(Variables):
    """The bearer token callers present, in its variable or in a file its ``_FILE`` names
    (:mod:`bridge.credentials`); never in a repr."""

    token: str | None = Field(None, repr=False, description="turns bearer auth on: the token")
    token_file: str | None = Field(None, description="a file holding the bearer token")

    def bearer_token(self) -> str | None:
        """The token, from the variable or the file its ``_FILE`` names (None: auth off);
        :class:`bridge.credentials.SecretError` when both are set or the file is no use."""
        return self._secret("token")


class AppServerVariables(Variables):
    """How app-servers are reached (:class:`~bridge.limits.AppServerSettings`); mode and
    URL are checked by :meth:`app_server`, as a command-line option may stand in for either."""

    app_server_mode: str | None = Field(
        None, description="process (one app-server per session) or shared"
    )
    app_server_url: str | None = Field(
        None, description="shared mode: a running app-server, unix://PATH or ws://HOST:PORT"
    )
    app_server_token: str | None = Field(
        None, repr=False, description="the token sent to a ws:// app-server"
    )
    app_server_token_file: str | None = Field(
        None, description="a file holding the app-server's token"
    )

    def app_server(self, *, mode: str | None = None, url: str | None = None) -> AppServerSettings:
        """How to reach app-servers; ``mode`` and ``url`` (command-line options) win over
        the variables, which are then not checked. Raises
        :class:`~bridge.limits.RestLimitsEnvError` for a variable set to what it cannot be
        (never repeating a token), :class:`bridge.credentials.SecretError` for a bad token file.
        """
        raw_mode = self.app_server_mode
        if mode is None and raw_mode is not None:
            if raw_mode not in APP_SERVER_MODES:
                raise RestLimitsEnvError(
                    variable_name("app_server_mode"), raw_mode, "mode (process or shared)"
                )
            mode = raw_mode
        raw_url = self.app_server_url
        if url is None and raw_url is not None:
            problem = url_problem(raw_url)
            if problem is not None and "@" in raw_url:  # never repeat the credentials
                raise RestLimitsEnvError(
                    variable_name("app_server_url"),
                    "...@...",
                    "URL without credentials (the token goes in REST_ADAPTER_APP_SERVER_TOKEN)",
                )
            if problem is not None:
                raise RestLimitsEnvError(
                    variable_name("app_server_url"), raw_url, "unix://PATH or ws://HOST:PORT"
                )
            url = raw_url
        if url is not None and mode is None:
            mode = "shared"
        token = self._secret("app_server_token") or None
        return AppServerSettings(mode=mode or "process", url=url, token=token)


class ReplicaVariables(Variables):
    """One bridge among several (:mod:`bridge.replica`)."""

    replica_id: str | None = Field(None, description="this replica's id, prefixed to session ids")
    peers: dict[str, str] = Field(
        default_factory=dict, description="the other replicas, id=http://host:port,..."
    )
    drain_timeout_ms: int = Field(
        DEFAULT_DRAIN_TIMEOUT_MS, ge=1, description="SIGUSR1: how long to wait for sessions"
    )

    @field_validator("replica_id", mode="before")
    @classmethod
    def _replica_id(cls, raw: Any) -> Any:
        return validate_replica_id(raw) if isinstance(raw, str) else raw

    @field_validator("peers", mode="before")
    @classmethod
    def _peers(cls, raw: Any) -> Any:
        return parse_peers(raw) if isinstance(raw, str) else raw

    @field_validator("drain_timeout_ms", mode="before")
    @classmethod
    def _drain(cls, raw: Any) -> Any:
        if isinstance(raw, str):
            return positive_integer(variable_name("drain_timeout_ms"), raw, ReplicaSettingsError)
        return raw

    @model_validator(mode="after")
    def _peers_need_an_id(self) -> Self:
        if self.peers and self.replica_id is None:
            raise ReplicaSettingsError(
                f"{variable_name('peers')} needs {variable_name('replica_id')} too"
            )
        return self

    def replica(self) -> ReplicaSettings:
        peers = {k: v for k, v in self.peers.items() if k != self.replica_id}
        return ReplicaSettings(
            replica_id=self.replica_id, peers=peers, drain_timeout_ms=self.drain_timeout_ms
        )


class OpsVariables(Variables):
    """The operations listener (:mod:`bridge.ops`): off unless a port is given."""

    ops_port: int | None = Field(
        None, description="turns the operations listener on: its port (0: a free one)"
    )
    ops_host: str = Field("127.0.0.1", description="the operations listener's address")

    @field_validator("ops_port", mode="before")
    @classmethod
    def _port(cls, raw: Any) -> Any:
        if isinstance(raw, str):
            if not (raw.isascii() and raw.isdigit() and len(raw) <= 5 and int(raw) <= 65535):
                raise RestLimitsEnvError(variable_name("ops_port"), raw, "port (0 to 65535)")
            return int(raw)
        return raw


class LogVariables(Variables):
    """How the bridge writes its log lines (:mod:`bridge.logs`); `--log-format` and
    `--log-level` win."""

    log_format: str = Field(DEFAULT_FORMAT, description="log lines as text or json")
    log_level: str = Field(DEFAULT_LEVEL, description="the least level logged")

    @field_validator("log_format", "log_level", mode="before")
    @classmethod
    def _choice(cls, raw: Any, info: ValidationInfo) -> Any:
        choices = LOG_FORMATS if info.field_name == "log_format" else LOG_LEVELS
        if isinstance(raw, str) and raw not in choices:
            raise RestLimitsEnvError(
                variable_name(str(info.field_name)), raw, f"choice ({', '.join(choices)})"
            )
        return raw


class MarkVariables(Variables):
    """Set by rest-bridge on the processes it starts, so it can find them again; never
    set by hand (the bridge does not read them, but knows them)."""

    process_mark: str | None = Field(
        None, description="set on each app-server, to find what it started"
    )
    cluster_mark: str | None = Field(None, description="set by rest-bridge cluster on its replicas")
    bridge_mark: str | None = Field(None, description="the marks its bridges' watchdogs look for")


# The fields of a class with several bases come in the reverse order of its bases: this
# is limits, method policy, app-server, secrets, replicas, operations, logs, marks, the
# order `serve` checks them in (the first bad one is the one reported).
class BridgeSettings(
    MarkVariables,
    LogVariables,
    OpsVariables,
    ReplicaVariables,
    AuthVariables,
    AppServerVariables,
    MethodPolicyVariables,
    LimitVariables,
):
    """Every ``REST_ADAPTER_*`` variable, read once (``BridgeSettings.from_env()``)."""

    @classmethod
    def unknown_variables(cls, environ: Mapping[str, str] | None = None) -> list[str]:
        """The ``REST_ADAPTER_*`` variables in ``environ`` that are none of the model's,
        sorted: a misspelt one would otherwise change nothing, silently."""
        env = os.environ if environ is None else environ
        known = set(cls.variables().values())
        return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
