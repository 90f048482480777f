"""The JSON Schema of the scenario format (`rest-bridge scenarios schema`; for editors),
generated from the pydantic models, never committed: they are the single description of
the format, shorthands included (each "before" validator declares what it accepts)."""

from __future__ import annotations

from typing import Any

from scenarios.format import FORMAT_VERSION, Scenario

SCHEMA_ID = "https://codex-rest-bridge.invalid/scenario.schema.json"


def scenario_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a scenario document."""
    schema = Scenario.model_json_schema(by_alias=True, mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": f"codex-rest-bridge scenario, format version {FORMAT_VERSION}",
        "description": "See scenarios/README.md.",
        **{k: v for k, v in schema.items() if k != "title"},
    }
