"""`fake-codex app-server generate-json-schema`: the request params the fake knows.

The real command writes the whole protocol as JSON Schema. Clients read parts of it to
learn what a runtime supports: the official Python SDK, facing an unversioned CLI,
reads the `properties` of `v2/TurnStartParams.json`, `v2/ThreadResumeParams.json` and
`v2/ThreadForkParams.json`. The fake writes a minimal bundle built here, at run time,
from the protocol profile of the release it emulates (protocols/<version>.json: each
params type's required, stable and experimental fields, generated from that release's
own schema); types are loose, by field name. Experimental fields appear only with
`--experimental`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_DRAFT = "http://json-schema.org/draft-07/schema#"

_STRING = {"type": "string"}
_NULLABLE_STRING = {"type": ["string", "null"]}
_NULLABLE_BOOL = {"type": ["boolean", "null"]}
_NULLABLE_INT = {"type": ["integer", "null"], "format": "uint32", "minimum": 0}
_STRINGS = {"type": ["array", "null"], "items": {"type": "string"}}
_OBJECT = {"type": ["object", "null"], "additionalProperties": True}
_ANY: dict[str, Any] = {}

# Field types by name; any field not listed takes any value.
_TYPES: dict[str, dict[str, Any]] = {
    "threadId": _STRING,
    "turnId": _STRING,
    "expectedTurnId": _STRING,
    "name": _STRING,
    "input": {"type": "array", "items": {"type": "object"}},
    "cwd": _NULLABLE_STRING,
    "model": _NULLABLE_STRING,
    "modelProvider": _NULLABLE_STRING,
    "baseInstructions": _NULLABLE_STRING,
    "developerInstructions": _NULLABLE_STRING,
    "serviceTier": _NULLABLE_STRING,
    "serviceTierForTurn": _NULLABLE_STRING,
    "serviceName": _NULLABLE_STRING,
    "turnTrigger": _NULLABLE_STRING,
    "clientUserMessageId": _NULLABLE_STRING,
    "parentTurnId": _NULLABLE_STRING,
    "rootTurnId": _NULLABLE_STRING,
    "lastTurnId": _NULLABLE_STRING,
    "beforeTurnId": _NULLABLE_STRING,
    "cursor": _NULLABLE_STRING,
    "searchTerm": _NULLABLE_STRING,
    "sectionId": _NULLABLE_STRING,
    "projectId": _NULLABLE_STRING,
    "permissions": _NULLABLE_STRING,
    "path": _NULLABLE_STRING,
    "ephemeral": _NULLABLE_BOOL,
    "excludeTurns": _NULLABLE_BOOL,
    "includeTurns": {"type": "boolean"},
    "includeHidden": _NULLABLE_BOOL,
    "archived": _NULLABLE_BOOL,
    "useStateDbOnly": _NULLABLE_BOOL,
    "currentAccountOnly": _NULLABLE_BOOL,
    "limit": _NULLABLE_INT,
    "config": _OBJECT,
    "disabledPluginIds": _STRINGS,
    "modelProviders": _STRINGS,
    "originators": _STRINGS,
    "excludedThreadIds": _STRINGS,
    "runtimeWorkspaceRoots": _STRINGS,
    "approvalPolicy": {
        "anyOf": [
            {"enum": ["untrusted", "on-request", "never"], "type": "string"},
            {"type": "object"},
            {"type": "null"},
        ]
    },
    "approvalsReviewer": {
        "anyOf": [
            {"enum": ["user", "auto_review", "guardian_subagent"], "type": "string"},
            {"type": "null"},
        ]
    },
    "sandbox": {
        "anyOf": [
            {"enum": ["read-only", "workspace-write", "danger-full-access"], "type": "string"},
            {"type": "null"},
        ]
    },
    "clientInfo": {
        "type": "object",
        "properties": {"name": _STRING, "title": _NULLABLE_STRING, "version": _STRING},
        "required": ["name", "version"],
    },
}


def schema_bundle(*, experimental: bool, version: str) -> dict[str, dict[str, Any]]:
    """Relative file path → JSON Schema document, for the release ``version``."""
    from fakes.app_server import protocol

    bundle = {}
    for name, fields_of in protocol.profile(version).params.items():
        required = fields_of["required"]
        extra = fields_of["experimental"] if experimental else []
        fields = sorted({*fields_of["stable"], *extra})
        document: dict[str, Any] = {
            "$schema": _DRAFT,
            "properties": {field: _TYPES.get(field, _ANY) for field in fields},
            "title": name.rsplit("/", 1)[-1],
            "type": "object",
        }
        if required:
            document["required"] = sorted(required)
        bundle[f"{name}.json"] = document
    return bundle


def write_schema(out: str | Path, *, experimental: bool, version: str) -> None:
    """Write the bundle of ``version`` under `out` (created if need be), like the real
    command."""
    root = Path(out)
    for relative, document in schema_bundle(experimental=experimental, version=version).items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
