"""The JSON Schema of the scenario format, generated from the pydantic models.

`rest-bridge scenarios schema` prints it; editors use it to complete and check
scenario files (e.g. `# yaml-language-server: $schema=scenario.schema.json`). It is
generated, never committed: the models are the single description of the format.

Pydantic documents a field by its type, so the shorthands that fake-codex scripts
accept through "before" validators (`agentMessage: "text"`, `exit: 3`, `respond:
true`, a turn given as a string, a method given one behavior instead of a list) are
added here; `tests/scenarios/test_format.py` fails when the fake gains a shorthand
this table does not know.
"""

from __future__ import annotations

from typing import Any

from scenarios.format import FORMAT_VERSION, Scenario

SCHEMA_ID = "https://codex-rest-bridge.invalid/scenario.schema.json"
_FLAG: list[dict[str, Any]] = [{"const": True}, {"type": "null"}]

#: (model class, property) → the other forms its "before" validator accepts.
FIELD_SHORTHANDS: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("AgentMessageStep", "agentMessage"): [{"type": "string"}],
    ("ExitStep", "exit"): [{"type": "integer"}],
    ("RespondStep", "respond"): _FLAG,
    ("RespondTwiceStep", "respondTwice"): _FLAG,
    ("RespondUnknownIdStep", "respondUnknownId"): _FLAG,
    ("StallStep", "stall"): _FLAG,
    ("SpawnChildStep", "spawnChild"): _FLAG,
    ("CompleteTurnStep", "completeTurn"): _FLAG,
}
#: Model classes a "before" model validator lets be given as something else.
MODEL_SHORTHANDS: dict[str, list[dict[str, Any]]] = {
    "TurnScript": [{"type": "string", "description": "shorthand for one agentMessage"}],
}
#: (model class, property) whose mapping values may be one item instead of a list.
LISTIFIED: set[tuple[str, str]] = {("AppServerScript", "methods")}


def scenario_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a scenario document."""
    schema = Scenario.model_json_schema(by_alias=True, mode="validation")
    definitions: dict[str, Any] = schema.get("$defs", {})
    by_title = {definition.get("title"): name for name, definition in definitions.items()}
    for (model, prop), extra in FIELD_SHORTHANDS.items():
        definition = definitions.get(by_title.get(model, ""))
        if definition is not None and prop in definition.get("properties", {}):
            definition["properties"][prop] = _any_of(definition["properties"][prop], extra)
    for model, extra in MODEL_SHORTHANDS.items():
        name = by_title.get(model)
        if name is not None:
            original = definitions[name]
            definitions[name] = {
                "title": original.get("title"),
                "anyOf": [*extra, {k: v for k, v in original.items() if k != "title"}],
            }
    for model, prop in LISTIFIED:
        definition = definitions.get(by_title.get(model, ""))
        if definition is None or prop not in definition.get("properties", {}):
            continue
        mapping = definition["properties"][prop]
        items = mapping.get("additionalProperties", {})
        if items.get("type") == "array":
            mapping["additionalProperties"] = {"anyOf": [items["items"], items]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": f"codex-rest-bridge scenario, format version {FORMAT_VERSION}",
        "description": "See scenarios/README.md.",
        **{k: v for k, v in schema.items() if k != "title"},
    }


def _any_of(schema: dict[str, Any], extra: list[dict[str, Any]]) -> dict[str, Any]:
    kept = {k: v for k, v in schema.items() if k in ("title", "description", "default")}
    core = {k: v for k, v in schema.items() if k not in kept}
    return {**kept, "anyOf": [core, *extra]}
