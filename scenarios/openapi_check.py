"""Check HTTP responses against the bridge's own OpenAPI document (the project's tests check
every response they receive; host suites may too): an undocumented status, or a JSON body
that does not match the documented schema, fails saying which."""

from __future__ import annotations

from typing import Any

import jsonschema
import orjson
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from bridge.route_paths import path_pattern

_ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorPayload"}


class ContractViolation(AssertionError):
    """A response that the OpenAPI document does not allow."""


class OpenApiChecker:
    """Validates responses against one OpenAPI 3.1 document."""

    def __init__(self, document: dict[str, Any]) -> None:
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        self._registry: Registry[Any] = Registry().with_resource("urn:openapi", resource)
        #: (path, its pattern, METHOD, responses) of each operation.
        self._operations = [
            (path, path_pattern(path), method.upper(), op.get("responses", {}))
            for path, ops in document.get("paths", {}).items()
            for method, op in ops.items()
        ]

    def check(
        self, method: str, path: str, status: int, content_type: str, body: bytes | None
    ) -> None:
        """Raise :class:`ContractViolation` unless the response is documented."""
        operation = next(
            (o for o in self._operations if o[1].match(path) and o[2] == method.upper()), None
        )
        if operation is None:
            # Unmounted route or wrong method: the document says nothing, the
            # contract says it is a 404/405 with the error payload.
            if status not in (401, 404, 405, 413):
                raise ContractViolation(f"{method} {path}: undocumented status {status}")
            if method.upper() != "HEAD":  # a HEAD's answer never has a body
                self._check_body(_ERROR_SCHEMA, method, path, status, body)
            return
        template, _, _, responses = operation
        documented = responses.get(str(status))
        if documented is None:
            raise ContractViolation(
                f"{method} {path}: status {status} is not documented for "
                f"{method.upper()} {template} (documented: {sorted(responses)})"
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
        # Local refs point into the registered document.
        text = orjson.dumps(schema).replace(b'"#/components/', b'"urn:openapi#/components/')
        validator = jsonschema.Draft202012Validator(orjson.loads(text), registry=self._registry)
        errors = sorted(validator.iter_errors(value), key=str)
        if errors:
            first = errors[0]
            where = "/".join(str(p) for p in first.absolute_path) or "(root)"
            raise ContractViolation(
                f"{method} {path}: {status} body does not match its schema at {where}: "
                f"{first.message}"
            )
