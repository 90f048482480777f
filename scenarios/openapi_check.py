"""Check HTTP responses against the bridge's own OpenAPI document.

Used by the project's tests (every response they receive is checked) and
available to host suites: a response whose status is not documented for its
operation, or whose JSON body does not match the documented schema, fails with
a message that says which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import orjson
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from bridge.app import path_pattern

_ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorPayload"}


class ContractViolation(AssertionError):
    """A response that the OpenAPI document does not allow."""


@dataclass(frozen=True)
class _Operation:
    path: str
    pattern: re.Pattern[str]
    method: str
    responses: dict[str, Any]


class OpenApiChecker:
    """Validates responses against one OpenAPI 3.1 document."""

    def __init__(self, document: dict[str, Any]) -> None:
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        self._registry: Registry[Any] = Registry().with_resource("urn:openapi", resource)
        self._operations = [
            _Operation(path, path_pattern(path), method.upper(), op.get("responses", {}))
            for path, ops in document.get("paths", {}).items()
            for method, op in ops.items()
        ]

    def _schema_validator(self, schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
        rooted = _reroot(schema)
        return jsonschema.Draft202012Validator(rooted, registry=self._registry)

    def check(
        self, method: str, path: str, status: int, content_type: str, body: bytes | None
    ) -> None:
        """Raise :class:`ContractViolation` unless the response is documented."""
        matches = [o for o in self._operations if o.pattern.match(path)]
        operation = next((o for o in matches if o.method == method.upper()), None)
        if operation is None:
            # Unmounted route or wrong method: the document says nothing, the
            # contract says it is a 404/405 with the error payload.
            if status not in (401, 404, 405, 413):
                raise ContractViolation(f"{method} {path}: undocumented status {status}")
            self._check_body(_ERROR_SCHEMA, method, path, status, body)
            return
        documented = operation.responses.get(str(status))
        if documented is None:
            raise ContractViolation(
                f"{method} {path}: status {status} is not documented for "
                f"{method.upper()} {operation.path} (documented: {sorted(operation.responses)})"
            )
        content = documented.get("content")
        if not content:
            if body:
                raise ContractViolation(f"{method} {path}: {status} must have no body")
            return
        media = content_type.split(";")[0].strip()
        if media not in content:
            raise ContractViolation(
                f"{method} {path}: {status} has Content-Type {media!r}, "
                f"documented {sorted(content)}"
            )
        if media == "application/json" and body is not None:
            self._check_body(content[media]["schema"], method, path, status, body)

    def _check_body(
        self, schema: dict[str, Any], method: str, path: str, status: int, body: bytes | None
    ) -> None:
        try:
            value = orjson.loads(body or b"")
        except orjson.JSONDecodeError as exc:
            raise ContractViolation(f"{method} {path}: {status} body is not JSON") from exc
        errors = sorted(self._schema_validator(schema).iter_errors(value), key=str)
        if errors:
            first = errors[0]
            where = "/".join(str(p) for p in first.absolute_path) or "(root)"
            raise ContractViolation(
                f"{method} {path}: {status} body does not match its schema at {where}: "
                f"{first.message}"
            )


def _reroot(schema: dict[str, Any]) -> dict[str, Any]:
    """Point local refs at the registered document."""
    text = orjson.dumps(schema).replace(b'"#/components/', b'"urn:openapi#/components/')
    rerooted: dict[str, Any] = orjson.loads(text)
    return rerooted
