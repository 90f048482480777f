"""The OpenAPI 3.1.0 document, built from a preset's route table and the wire models.

Nothing here is written by hand beside the routes: paths, parameters, bodies and
responses all come from :data:`bridge.app.ROUTES` entries and the pydantic
models they name, and what each error status means from the error table
(:data:`bridge.errors.ERROR_KINDS`), so the document cannot drift from what is served.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from bridge import __version__
from bridge.auth import HEALTH_METHODS, HEALTH_PATHS, AuthSettings
from bridge.errors import ERROR_KINDS
from bridge.models import ErrorPayload, EventResponse
from bridge.routes import MAX_QUERY_INT, Route

if TYPE_CHECKING:
    from bridge.policy import MethodRules

REF = "#/components/schemas/{model}"
_PARAM = re.compile(r"\{(\w+)(?::[^}]*)?\}")
_PATH_PARAMS = {
    "method": "Name of the app-server method, slashes included (`thread/start`); "
    "`%2F`-encoded slashes are accepted too.",
    "sessionId": "Session identifier, as returned by `POST /v1/sessions`.",
    "requestKey": "Key of a server-originated request: its JSON-RPC id as a string.",
}


#: One event of the stream (OpenAPI 3.1 has a text/event-stream `schema` describe one
#: event; 3.2 would call it `itemSchema`): `data` holds an EventResponse as JSON.
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+$", "description": "The event's `seq`."},
        "event": {"enum": ["notification", "request", "exit", "gap"]},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"$ref": REF.format(model=EventResponse.__name__)},
        },
    },
    "required": ["id", "event", "data"],
}


def status_description(status: int) -> str:
    """What ``status`` means on a route that may answer it, from the table's rows."""
    rows = [e for e in ERROR_KINDS if e.status == status and e.on_every_route]
    if not rows:
        return "Error"
    text = "; ".join(f"{e.description} (`{e.kind}`)" for e in rows)
    if all(e.retry_after for e in rows):
        text += "; see Retry-After"
    if all(e.closes_connection for e in rows):
        text += "; the connection is closed"
    return text


def openapi_path(path: str) -> str:
    """``/v1/call/{method:.+}`` → ``/v1/call/{method}``."""
    return _PARAM.sub(r"{\1}", path)


def _schemas(routes: Iterable[Route]) -> dict[str, Any]:
    wanted: list[tuple[type[BaseModel], Any]] = [
        (ErrorPayload, "serialization"),
        (EventResponse, "serialization"),
    ]
    for route in routes:
        if route.body is not None:
            wanted.append((route.body, "validation"))
        if route.response is not None:
            wanted.append((route.response, "serialization"))
    unique = list(dict.fromkeys(wanted))
    _, definitions = models_json_schema(unique, ref_template=REF, by_alias=True)
    schemas: dict[str, Any] = definitions.get("$defs", {})
    return schemas


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _error_response(status: int) -> dict[str, Any]:
    return {
        "description": status_description(status),
        "content": {"application/json": {"schema": _ref(ErrorPayload)}},
    }


#: The routes that call app-server methods, which the method policy governs.
METHOD_ROUTES = frozenset({"call", "session_call", "text_turn"})
_REFUSED_METHOD = (
    "App-server method refused by this router's method policy (`method_not_allowed`; "
    "`data.method` names it). The policy is `x-method-policy`: the preset's refused rules, "
    "then the host's allowed and refused rules, which win. A rule is a method name (which "
    "covers the methods under it), a prefix ending in `/`, or `*`; the host's most specific "
    "matching rule decides, else the preset's, else the method is allowed; names are "
    "compared case-folded, percent-decoded, with `.`, `..` and empty segments resolved. "
    "`presetRefusesParams`: params an allowed method may not carry here (`data.params` "
    "names those a call had)"
)


def _method_policy(operation: dict[str, Any], rules: MethodRules | None) -> None:
    """Document the method policy on an operation that calls app-server methods."""
    responses = operation["responses"]
    refused = _REFUSED_METHOD + (
        " (`thread/start` and `turn/start` for a text turn)."
        if operation["operationId"] == "text_turn"
        else "."
    )
    if "403" in responses:
        responses["403"]["description"] += "; or: " + refused
    else:
        responses["403"] = _error_response(403) | {"description": refused}
    if rules is not None:
        operation["x-method-policy"] = rules.describe()


def _head_operation(get: dict[str, Any]) -> dict[str, Any]:
    """HEAD on a health route: the GET's status and headers, without a body."""
    head = {k: v for k, v in get.items() if k not in ("operationId", "responses")}
    head["operationId"] = f"{get['operationId']}_head"
    head["summary"] = f"{get['summary']} (HEAD: GET's status and headers, no body)"
    head["responses"] = {
        status: {"description": answer["description"]}
        for status, answer in get["responses"].items()
    }
    return head


def build_openapi(
    routes: Iterable[Route],
    *,
    auth: AuthSettings | None = None,
    method_rules: MethodRules | None = None,
) -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of exactly ``routes``, with the auth layer if given and
    the method policy (``x-method-policy`` on the routes that call methods)."""
    bearer_auth = auth is not None
    exempt = auth is not None and auth.exempt_health
    routes = list(routes)
    schemas = _schemas(routes)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        path = openapi_path(route.path)
        operation: dict[str, Any] = {
            "operationId": route.name,
            "summary": route.summary,
            "responses": {},
        }
        if route.description:
            operation["description"] = route.description
        parameters = [
            {
                "name": name,
                "in": "path",
                "required": True,
                "description": _PATH_PARAMS.get(name, name),
                "schema": {"type": "string"},
            }
            for name in _PARAM.findall(route.path)
        ]
        parameters += [
            {
                "name": q.name,
                "in": "header" if q.header else "query",
                "required": False,
                "description": q.description,
                "schema": {"type": "integer", "minimum": 0, "maximum": MAX_QUERY_INT},
            }
            for q in route.query
        ]
        if parameters:
            operation["parameters"] = parameters
        # Refusals of the request head, before any route (`rest-bridge serve`'s server).
        statuses = set(route.errors) | {408, 414, 417, 431, 500}
        if route.path not in HEALTH_PATHS:
            # A host backend may not serve every route it is mounted on.
            statuses.add(404)
        if route.body is not None:
            operation["requestBody"] = {
                # An empty body counts as `{}`: it is optional unless a field is required.
                "required": any(f.is_required() for f in route.body.model_fields.values()),
                "content": {"application/json": {"schema": _ref(route.body)}},
            }
            statuses |= {400, 413}
        responses = operation["responses"]
        if route.event_stream:
            responses[str(route.status)] = {
                "description": "A stream of Server-Sent Events: `id: <seq>`, `event: <kind>`, "
                "`data: <EventResponse JSON>`; `: keep-alive` comments while idle. The stream "
                "ends after the `exit` event.",
                "content": {"text/event-stream": {"schema": _SSE_EVENT}},
            }
        elif route.response is not None or route.response_schema is not None:
            schema = _ref(route.response) if route.response else route.response_schema
            responses[str(route.status)] = {
                "description": route.summary,
                "content": {"application/json": {"schema": schema}},
            }
        for status in route.extra_statuses:
            responses[str(status)] = {"description": "No event arrived within `waitMs`."}
        secured = bearer_auth and not (
            exempt and route.method in HEALTH_METHODS and route.path in HEALTH_PATHS
        )
        if secured:
            statuses.add(401)
        elif bearer_auth:
            operation["security"] = []
        for status in sorted(statuses):
            responses[str(status)] = _error_response(status)
        if route.name in METHOD_ROUTES:
            _method_policy(operation, method_rules)
        if route.tags:
            operation["tags"] = list(route.tags)
        paths.setdefault(path, {})[route.method.lower()] = operation
        if route.answers_head:
            paths[path]["head"] = _head_operation(operation)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "codex-rest-bridge",
            "version": __version__,
            "description": "OpenAI Codex's `codex app-server` behind JSON-over-HTTP. "
            "Every error response carries the error payload (`ErrorPayload`).",
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if bearer_auth:
        document["components"]["securitySchemes"] = {
            "bearerAuth": {"type": "http", "scheme": "bearer"}
        }
        document["security"] = [{"bearerAuth": []}]
    return document
