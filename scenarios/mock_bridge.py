"""The parts of a bridge that need no app-server: its front and plausible records.

The respx mocks (`scenarios.respx_mock`) answer as the bridge would wherever the answer
does not depend on an app-server process:

- :class:`BridgeFront` — bearer auth (the bridge's own token check), routing (404 for an
  unmounted route, 405 with `Allow`), the body limit (413), request bodies validated by
  the bridge's own wire models (400 with the same `data`), ClientOptions a preset
  refuses (403), and the integer query parameters and `Last-Event-ID` (400). It is built
  from an OpenAPI document, so it knows exactly the routes and security that document
  describes; bodies of the bridge's own operations are validated by the bridge's
  pydantic models (`bridge.routes.validate_body`), others by the document's schema.
- natural records — the body a bridge would plausibly send for an operation (health,
  compatibility, a created session, a raw call's result shaped like fake-codex's),
  error payloads by kind (`bridge.errors`), and event params shaped like the
  notifications codex sends around a turn.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel

from bridge import __version__, errors
from bridge.app import (
    ALL_ROUTES,
    DEFAULT_CLIENT_OPTIONS,
    DEFAULT_ROUTES,
    ROUTES,
    SLASHED_PARAMS,
    TEXT_TURN_ROUTES,
    Route,
)
from bridge.auth import AuthSettings, BearerToken, presented_token
from bridge.errors import RestError
from bridge.limits import RestLimits
from bridge.models import ClientOptions
from bridge.openapi import build_openapi
from bridge.process.startup import CHECK_COMMAND
from bridge.routes import parse_query_int, parse_sse_position, refuse_options, validate_body
from bridge.wire import dumps
from scenarios.synth import Schemas, Values

__all__ = [
    "PRESETS",
    "BridgeFront",
    "Incoming",
    "Operation",
    "error_of_kind",
    "preset_document",
]

#: Route names and the ClientOptions policy of each preset (as `bridge.app` builds them).
PRESETS: dict[str, tuple[frozenset[str], frozenset[str] | None]] = {
    "trusted": (ALL_ROUTES, None),
    "default": (DEFAULT_ROUTES, DEFAULT_CLIENT_OPTIONS),
    "text-turn": (TEXT_TURN_ROUTES, None),
}
JSON_CONTENT_TYPE = "application/json"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
#: The cli version fake-codex (and the codex the bridge is pinned to) reports.
APP_SERVER_VERSION = "0.169.0"
_BY_NAME: dict[str, Route] = {route.name: route for route in ROUTES}


def preset_routes(preset: str) -> tuple[Route, ...]:
    """The routes `preset` mounts, in the bridge's order."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}")
    names = PRESETS[preset][0]
    return tuple(route for route in ROUTES if route.name in names)


def preset_document(
    preset: str, *, token: str | None = None, exempt_health: bool = True
) -> dict[str, Any]:
    """The OpenAPI document `preset` serves (with the bearer scheme when `token` is set)."""
    auth = AuthSettings(exempt_health=exempt_health) if token is not None else None
    return build_openapi(preset_routes(preset), auth=auth)


# -- requests --------------------------------------------------------------------------


@dataclass
class Incoming:
    """A request as the front sees it: the path decoded (`%2F` is `/`), headers by
    lower-case name."""

    method: str
    path: str
    headers: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        for key, value in self.headers.items():
            if key.lower() == lowered:
                return value
        return None

    def json(self) -> Any:
        try:
            return orjson.loads(self.body) if self.body.strip() else {}
        except orjson.JSONDecodeError:
            return None


@dataclass(frozen=True)
class Operation:
    """One operation of an OpenAPI document, as the front routes and checks it."""

    operation_id: str
    method: str
    path: str
    pattern: re.Pattern[str]
    secured: bool
    success_status: int
    response_schema: dict[str, Any] | None
    event_stream: bool
    body_model: type[BaseModel] | None
    body_schema: dict[str, Any] | None
    query: tuple[tuple[str, str], ...]

    def params(self, path: str) -> dict[str, str] | None:
        found = self.pattern.match(path)
        return found.groupdict() if found else None


def _path_pattern(path: str) -> re.Pattern[str]:
    regex = ""
    for part in re.split(r"(\{\w+\})", path):
        name = part[1:-1] if part.startswith("{") else None
        if name is None:
            regex += re.escape(part)
        elif name in SLASHED_PARAMS:
            regex += f"(?P<{name}>.+)"
        else:
            regex += f"(?P<{name}>[^/]+)"
    return re.compile(f"^{regex}$")


def operations(document: Mapping[str, Any]) -> list[Operation]:
    """The operations of an OpenAPI 3.1 document, in its order."""
    schemas = Schemas(dict(document))
    global_security = bool(document.get("security"))
    found: list[Operation] = []
    for path, methods in document.get("paths", {}).items():
        for method, op in methods.items():
            responses = op.get("responses", {})
            statuses = sorted(int(code) for code in responses if str(code).isdigit())
            success = next((code for code in statuses if 200 <= code < 300), 200)
            content = responses.get(str(success), {}).get("content", {})
            security = op.get("security")
            secured = bool(security) if security is not None else global_security
            name = str(op.get("operationId") or f"{method} {path}")
            route = _BY_NAME.get(name)
            body_schema = (
                op.get("requestBody", {}).get("content", {}).get("application/json", {})
            ).get("schema")
            query = tuple(
                (str(param["name"]), str(param.get("in", "query")))
                for param in op.get("parameters", [])
                if param.get("in") in ("query", "header")
            )
            found.append(
                Operation(
                    operation_id=name,
                    method=method.upper(),
                    path=path,
                    pattern=_path_pattern(path),
                    secured=secured,
                    success_status=success,
                    response_schema=schemas.resolve(
                        content.get("application/json", {}).get("schema")
                    )
                    if "application/json" in content
                    else None,
                    event_stream="text/event-stream" in content,
                    body_model=route.body if route is not None else None,
                    body_schema=body_schema,
                    query=query,
                )
            )
    return found


# -- the front -----------------------------------------------------------------------------


@dataclass
class Verdict:
    """What the front made of a request: its operation and path parameters, and the
    error the bridge would answer before any app-server is involved (None: let it in)."""

    operation: Operation | None
    params: dict[str, str]
    error: RestError | None
    body: Any = None


class BridgeFront:
    """Auth, routing and request checks of a bridge serving `document`."""

    def __init__(
        self,
        document: Mapping[str, Any],
        *,
        token: str | None = None,
        allowed_client_options: frozenset[str] | None = None,
        limits: RestLimits | None = None,
    ) -> None:
        self.document = dict(document)
        self.operations = operations(document)
        self.schemas = Schemas(self.document)
        self.limits = limits or RestLimits()
        self.allowed_client_options = allowed_client_options
        self._secured = bool(document.get("security")) or any(o.secured for o in self.operations)
        if self._secured and token is None:
            raise ValueError(
                "the OpenAPI document requires a bearer token (its `security`); pass token="
            )
        self._token = BearerToken(token) if token is not None else None

    @classmethod
    def for_preset(
        cls,
        preset: str,
        *,
        token: str | None = None,
        exempt_health: bool = True,
        limits: RestLimits | None = None,
    ) -> BridgeFront:
        document = preset_document(preset, token=token, exempt_health=exempt_health)
        return cls(
            document,
            token=token,
            allowed_client_options=PRESETS[preset][1],
            limits=limits,
        )

    def route(self, method: str, path: str) -> tuple[Operation | None, dict[str, str], set[str]]:
        """The operation for `method path`, its path parameters, and the methods the path
        allows (for a 405)."""
        allowed: set[str] = set()
        for operation in self.operations:
            params = operation.params(path)
            if params is None:
                continue
            if operation.method == method.upper():
                return operation, params, allowed
            allowed.add(operation.method)
        return None, {}, allowed

    def authorized(self, incoming: Incoming, operation: Operation | None) -> bool:
        if self._token is None:
            return True
        if operation is not None and not operation.secured:
            return True
        return self._token.matches(presented_token(incoming.header("Authorization")))

    def check(self, incoming: Incoming) -> Verdict:
        """The bridge's answer to `incoming` as far as it needs no app-server."""
        operation, params, allowed = self.route(incoming.method, incoming.path)
        if not self.authorized(incoming, operation):
            return Verdict(operation, params, errors.unauthorized())
        if operation is None:
            if allowed:
                return Verdict(None, {}, errors.method_not_allowed(incoming.method, allowed))
            return Verdict(None, {}, errors.not_found())
        try:
            body = self._check_body(operation, incoming)
            self._check_query(operation, incoming)
        except RestError as exc:
            return Verdict(operation, params, exc)
        return Verdict(operation, params, None, body)

    def _check_body(self, operation: Operation, incoming: Incoming) -> Any:
        if operation.body_model is None and operation.body_schema is None:
            return None
        limit = self.limits.max_body_bytes
        if len(incoming.body) > limit:
            raise errors.payload_too_large(limit)
        if operation.body_model is not None:
            model = validate_body(operation.body_model, incoming.body)
            refuse_options(getattr(model, "options", None), self.allowed_client_options)
            return model
        return self._check_schema(operation, incoming.body)

    def _check_schema(self, operation: Operation, raw: bytes) -> Any:
        import jsonschema

        try:
            value = orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            raise errors.bad_request(
                "The request body is not valid JSON.",
                data={"errors": [{"loc": [], "msg": "Invalid JSON", "type": "json_invalid"}]},
            ) from None
        root = {
            "$ref": "#/components/schemas/_body",
            "components": {"schemas": {**self.schemas.definitions, "_body": operation.body_schema}},
        }
        validator = jsonschema.Draft202012Validator(root)
        problems = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
        if problems:
            details = [
                {"loc": list(e.absolute_path), "msg": e.message, "type": str(e.validator)}
                for e in problems
            ]
            raise errors.bad_request(
                "The request body does not match the expected shape.", data={"errors": details}
            )
        return value

    def _check_query(self, operation: Operation, incoming: Incoming) -> None:
        names = {name for name, where in operation.query if where == "query"}
        if operation.event_stream:
            parse_sse_position(incoming.query.get("after"), incoming.header("Last-Event-ID"))
            return
        for name in sorted(names):
            parse_query_int(name, incoming.query.get(name), None)


# -- responses ---------------------------------------------------------------------------


#: The status each error kind has (docs/API.md, Errors).
KIND_STATUS: dict[str, int] = {
    "bad_request": 400,
    "unauthorized": 401,
    "options_not_allowed": 403,
    "forbidden": 403,
    "not_found": 404,
    "session_not_found": 404,
    "request_not_found": 404,
    "method_not_allowed": 405,
    "session_exited": 409,
    "request_already_answered": 409,
    "payload_too_large": 413,
    "session_limit_reached": 429,
    "busy": 429,
    "internal_error": 500,
    "app_server_error": 502,
    "app_server_exited": 502,
    "app_server_spawn_failed": 502,
    "protocol_error": 502,
    "app_server_overloaded": 503,
    "timeout": 504,
}
#: The kind a bare error status stands for.
STATUS_KIND: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "options_not_allowed",
    404: "not_found",
    405: "method_not_allowed",
    409: "session_exited",
    413: "payload_too_large",
    429: "busy",
    500: "internal_error",
    502: "app_server_error",
    503: "app_server_overloaded",
    504: "timeout",
}


def error_of_kind(
    kind: str,
    *,
    status: int | None = None,
    session_id: str | None = None,
    request_key: str | None = None,
    method: str = "GET",
    allowed: set[str] | None = None,
    limits: RestLimits | None = None,
    rpc_error: Mapping[str, Any] | None = None,
    exit_params: Mapping[str, Any] | None = None,
) -> RestError:
    """The error the bridge raises for `kind`, with what it would say in context."""
    limits = limits or RestLimits()
    rpc = dict(rpc_error or {})
    exited = dict(exit_params or {})
    session = session_id or "00000000-0000-4000-8000-000000000000"
    key = request_key or "0"
    code = exited.get("exitCode", 1)
    made: dict[str, Any] = {
        "bad_request": lambda: errors.bad_request(
            "The request body does not match the expected shape."
        ),
        "unauthorized": errors.unauthorized,
        "options_not_allowed": lambda: errors.options_not_allowed(["cwd"]),
        "not_found": errors.not_found,
        "session_not_found": lambda: errors.session_not_found(session),
        "request_not_found": lambda: errors.request_not_found(key),
        "method_not_allowed": lambda: errors.method_not_allowed(method, allowed or {"GET"}),
        "session_exited": lambda: errors.session_exited(session),
        "request_already_answered": lambda: errors.request_already_answered(key),
        "payload_too_large": lambda: errors.payload_too_large(limits.max_body_bytes),
        "session_limit_reached": lambda: errors.session_limit_reached(limits.max_sessions),
        "busy": lambda: errors.busy(
            f"The bridge is already running {limits.max_concurrent_text_turns} text turns; "
            "retry later."
        ),
        "internal_error": errors.internal_error,
        "app_server_error": lambda: errors.app_server_error(
            int(rpc.get("code", -32603)), str(rpc.get("message", "Internal error")), rpc.get("data")
        ),
        "app_server_overloaded": lambda: errors.app_server_error(
            -32001, str(rpc.get("message", "Server overloaded; retry later.")), rpc.get("data")
        ),
        "app_server_exited": lambda: errors.app_server_exited(
            f"the app-server process exited with code {code}",
            data={"exitCode": code, "signal": exited.get("signal")},
        ),
        "app_server_spawn_failed": lambda: errors.app_server_spawn_failed(
            f"Could not start the app-server (No such file or directory); {CHECK_COMMAND}."
        ),
        "protocol_error": lambda: errors.protocol_error(
            "the app-server broke the protocol: the app-server wrote a line that is not JSON"
        ),
        "timeout": lambda: errors.timeout("The call did not complete before its deadline."),
    }
    if kind in made:
        error: RestError = made[kind]()
    else:
        error = RestError(status or 500, kind, kind.replace("_", " ").capitalize() + ".")
    if status is not None and status != error.status:
        error = RestError(
            status,
            error.kind,
            error.message,
            code=error.code,
            data=error.data,
            headers=error.headers,
        )
    return error


def sse_frame(event: Mapping[str, Any]) -> bytes:
    """`event` framed as the bridge's SSE route frames it."""
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (event["seq"], event["kind"].encode(), dumps(event))


def health_body() -> dict[str, Any]:
    return {"status": "ok", "version": __version__}


def compatibility_body(version: str = APP_SERVER_VERSION) -> dict[str, Any]:
    return {
        "bridgeVersion": __version__,
        "apiVersion": "v1",
        "openapi": "3.1.0",
        "appServer": {
            "command": ["codex", "app-server"],
            "version": version,
            "versionError": None,
            "mode": "process",
            "shared": None,
        },
    }


def text_turn_body(text: str, ctx: TurnContext) -> dict[str, Any]:
    """A completed text turn's answer (without `events`) in `ctx`'s thread and turn."""
    from fakes.app_server import shapes

    usage = shapes.token_usage_breakdown(100, 20, 0, 0)
    return {
        "text": text,
        "threadId": ctx.thread(),
        "turnId": ctx.turn(),
        "status": "completed",
        "error": None,
        "usage": shapes.thread_token_usage(usage, usage),
        "approvals": [],
    }


def initialize_result(client_info: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `initialize` result as fake-codex gives it, on a fixed (made-up) machine."""
    info = dict(client_info or {})
    name = str(info.get("name", "codex_rest_bridge"))
    version = str(info.get("version", __version__))
    return {
        "userAgent": f"{name}/{APP_SERVER_VERSION} (Linux 6.8.0; x86_64) xterm ({name}; {version})",
        "codexHome": "/home/codex/.codex",
        "platformFamily": "unix",
        "platformOs": "linux",
    }


def session_created(values: Values, options: Any) -> dict[str, Any]:
    client_info = None
    if isinstance(options, ClientOptions) and options.client_info is not None:
        client_info = options.client_info.model_dump(exclude_none=True)
    elif isinstance(options, Mapping):
        client_info = options.get("clientInfo")
    return {
        "sessionId": values.uuid4(),
        "createdAt": values.timestamp(),
        "initialize": initialize_result(client_info if isinstance(client_info, Mapping) else None),
    }


# -- app-server shapes -----------------------------------------------------------------------


@dataclass
class TurnContext:
    """The ids the notifications of one session refer to (what codex would put there)."""

    values: Values
    thread_id: str | None = None
    turn_id: str | None = None
    cwd: str = "/home/codex/work"
    agent_item: str | None = None
    item_ids: dict[str, str] = field(default_factory=dict)

    def thread(self) -> str:
        if self.thread_id is None:
            self.thread_id = self.values.uuid7()
        return self.thread_id

    def turn(self) -> str:
        if self.turn_id is None:
            self.turn_id = self.values.uuid7()
        return self.turn_id


def thread_object(ctx: TurnContext, thread_id: str) -> dict[str, Any]:
    from fakes.app_server import shapes

    created = ctx.values.now_ms() // 1000
    thread = shapes.thread_object(
        thread_id=thread_id,
        cwd=ctx.cwd,
        model=shapes.DEFAULT_MODEL,
        model_provider=shapes.DEFAULT_MODEL_PROVIDER,
        version=APP_SERVER_VERSION,
        originator="codex_rest_bridge",
        created_at=created,
    )
    thread["path"] = f"/home/codex/.codex/sessions/rollout-{thread_id}.jsonl"
    return thread


def call_result(method: str, params: Any, ctx: TurnContext) -> Any:
    """What fake-codex answers `method` with when nothing is scripted (else `{}`)."""
    from fakes.app_server import shapes

    params = params if isinstance(params, dict) else {}
    if method == "thread/start":
        ctx.thread_id = ctx.values.uuid7()
        ctx.turn_id = None
        return shapes.thread_start_result(thread_object(ctx, ctx.thread_id), params)
    if method == "turn/start":
        if isinstance(params.get("threadId"), str):
            ctx.thread_id = params["threadId"]
        ctx.turn_id = ctx.values.uuid7()
        return {"turn": shapes.turn_object(ctx.turn_id)}
    if method == "model/list":
        return shapes.model_list_result()
    return {}


def event_params(method: str | None, kind: str, ctx: TurnContext, item_type: str | None) -> Any:
    """Params shaped like what codex sends with `method` (an empty object if unknown)."""
    from fakes.app_server import shapes

    values = ctx.values
    if kind == "exit":
        return {"exitCode": 0, "signal": None, "stderrTail": ""}
    if kind == "gap":
        return {"dropped": 1, "fromSeq": 1, "toSeq": 1}
    if method == "remoteControl/status/changed":
        return {
            "status": "disabled",
            "serverName": "codex-host",
            "installationId": values.uuid4(),
            "environmentId": None,
        }
    thread = ctx.thread()
    if method == "thread/started":
        return {"thread": thread_object(ctx, thread)}
    if method == "thread/status/changed":
        return {"threadId": thread, "status": {"type": "active", "activeFlags": []}}
    if method == "turn/started":
        started = values.now_ms() // 1000
        return {"threadId": thread, "turn": shapes.turn_object(ctx.turn(), started_at=started)}
    if method == "turn/completed":
        return {
            "threadId": thread,
            "turn": shapes.turn_object(ctx.turn(), status="completed", items_view="summary"),
        }
    if method in ("item/started", "item/completed"):
        now = values.now_ms()
        completed = now if method == "item/completed" else None
        kind_of_item = item_type or "agentMessage"
        if method == "item/started":
            item_id = ctx.item_ids[kind_of_item] = values.uuid7()
        else:
            item_id = ctx.item_ids.pop(kind_of_item, "") or values.uuid7()
        if item_type == "userMessage":
            content = shapes.user_content([{"type": "text", "text": "hi"}])
            item = shapes.user_message_item(item_id, content, now, completed)
        elif item_type in (None, "agentMessage"):
            item = shapes.agent_message_item(ctx.agent_item or item_id, "", now, completed)
        else:
            item = {"type": item_type, "id": item_id}
        params: dict[str, Any] = {"item": item, "threadId": thread, "turnId": ctx.turn()}
        if method == "item/started":
            params["startedAtMs"] = now
        else:
            params.update(contentTokenCount=None, completedAtMs=now)
        return params
    if method == "item/agentMessage/delta":
        item_id = ctx.agent_item or f"msg_{values.hex(48)}"
        return {"threadId": thread, "turnId": ctx.turn(), "itemId": item_id, "delta": ""}
    if method == "thread/tokenUsage/updated":
        usage = shapes.token_usage_breakdown(100, 20, 0, 0)
        return {
            "threadId": thread,
            "turnId": ctx.turn(),
            "tokenUsage": shapes.thread_token_usage(usage, usage),
        }
    if method == "account/rateLimits/updated":
        return {"rateLimits": dict(shapes.RATE_LIMITS)}
    if method == "serverRequest/resolved":
        return {"threadId": thread, "requestId": 0}
    if method == "item/commandExecution/requestApproval":
        return {
            "kind": "command",
            "threadId": thread,
            "turnId": ctx.turn(),
            "itemId": values.uuid7(),
            "startedAtMs": values.now_ms(),
            "environmentId": "local",
            "command": "/bin/bash -lc 'echo hello'",
            "cwd": ctx.cwd,
            "commandActions": [{"type": "unknown", "command": "echo hello"}],
            "proposedExecpolicyAmendment": ["echo", "hello"],
            "availableDecisions": ["accept", "cancel"],
        }
    return {}
