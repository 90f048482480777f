"""Making up JSON that satisfies an expectation (`scenarios.synth`), which the respx mocks
build their responses with; every value made is checked with `scenarios.matching`."""

from __future__ import annotations

import re
from typing import Any

import pytest

from scenarios.matching import MISSING, match, match_jsonpath
from scenarios.mock_bridge import preset_document
from scenarios.synth import (
    Schemas,
    SynthesisError,
    Values,
    conform,
    fill,
    regex_witness,
    write_jsonpath,
)

SCHEMAS = Schemas(preset_document("trusted"))


@pytest.mark.parametrize(
    "pattern",
    [
        "^[0-9]+$",
        r"works\.$",
        "touch proof.txt",
        "^Invalid request: unknown variant `no/such/method`",
        "(ab|cd)e{2,3}f?",
        r"[^x0a]\d+\w\s\S",
        r"(?P<word>ab)-(?P=word)",
        r"^thr_[0-9a-f]{8}$",
        "(?i)bearer",
    ],
)
def test_a_regex_witness_matches_its_pattern(pattern: str) -> None:
    assert re.search(pattern, regex_witness(pattern))


def test_a_regex_nothing_can_match_fails_loudly() -> None:
    with pytest.raises(SynthesisError, match="cannot make up a string matching"):
        regex_witness("^(?=a)b")


@pytest.mark.parametrize(
    "expected",
    [
        {"$type": "string", "$regex": "^msg_"},
        {"$len": {"$gte": 2}, "$type": "array"},
        {"$contains": {"kind": "exit"}},
        {"$gt": 3, "$lt": 5},
        {"$gte": 1.5},
        {"$oneOf": [{"$type": "null"}, 3]},
        {"a": {"$subset": {"b": 1}}, "c": [1, {"$any": True}]},
        {"$eq": {"$not-a-matcher": 1}},
    ],
)
def test_conform_satisfies_matchers(expected: Any) -> None:
    for subset in (True, False):
        made = conform(expected, MISSING, None, SCHEMAS, Values(), subset=subset)
        assert match(expected, made, subset=subset) == []


def test_conform_keeps_what_already_matches_and_fills_the_schema() -> None:
    base = {"status": "ok", "version": "0.1.0"}
    kept = conform({"version": {"$type": "string"}}, base, None, SCHEMAS, Values(), subset=True)
    assert kept == base
    summary = SCHEMAS.named("SessionSummary")
    made = conform({"state": "exited"}, MISSING, summary, SCHEMAS, Values(), subset=True)
    assert set(made) == set(summary["required"])
    assert made["state"] == "exited"
    exact = conform({"state": "exited"}, MISSING, summary, SCHEMAS, Values(), subset=False)
    assert exact == {"state": "exited"}
    assert (
        conform({"gone": {"$absent": True}}, {"gone": 1}, None, SCHEMAS, Values(), subset=True)
        == {}
    )


def test_fill_makes_a_valid_value_of_a_schema() -> None:
    import jsonschema

    document = preset_document("trusted")
    for name in ("SessionSummary", "EventResponse", "TextTurnResponse", "Compatibility"):
        value = fill({"$ref": f"#/components/schemas/{name}"}, SCHEMAS, Values())
        root = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
        jsonschema.validate(value, root)


@pytest.mark.parametrize(
    ("document", "expression", "expected"),
    [
        ({}, "$.a.b", 1),
        ({"events": []}, "$.events[-1].method", "turn/completed"),
        (
            {"events": [{"kind": "request"}, {"kind": "exit"}]},
            "$.events[*].kind",
            {"$contains": "exit"},
        ),
        ({}, "$.events[*].kind", {"$contains": "notification"}),
        ({}, "$.sessions[?(@.sessionId == 'abc')].state", "exited"),
        (
            {"sessions": [{"sessionId": "x", "pendingRequests": ["1"]}]},
            "$.sessions[0].pendingRequests",
            [],
        ),
        ({"paths": {"/v1/call/{method}": {}}}, "$.paths['/v1/call/{method}']", {"$absent": True}),
        ({"a": [1, 2]}, "$.a[*]", [3, 4]),
    ],
)
def test_write_jsonpath_makes_the_path_select_a_match(
    document: Any, expression: str, expected: Any
) -> None:
    written = write_jsonpath(document, expression, expected, None, SCHEMAS, Values())
    assert match_jsonpath(expression, expected, written) == []


def test_write_jsonpath_fills_new_elements_from_the_schema() -> None:
    schema = SCHEMAS.named("SessionList")
    written = write_jsonpath(
        {"sessions": []}, "$.sessions[0].exitCode", 3, schema, SCHEMAS, Values()
    )
    assert written["sessions"][0]["exitCode"] == 3
    assert set(written["sessions"][0]) == set(SCHEMAS.named("SessionSummary")["required"])


@pytest.mark.parametrize("expression", ["$..x", "$.a[1:2]", "$.a[?(@.b > 1)]"])
def test_write_jsonpath_refuses_what_it_cannot_invert(expression: str) -> None:
    with pytest.raises(SynthesisError, match="cannot be written"):
        write_jsonpath({"a": []}, expression, 1, None, SCHEMAS, Values())


def test_values_are_deterministic_per_seed() -> None:
    first, again, other = Values(3), Values(3), Values(4)
    made = [first.uuid4(), first.uuid7(), first.timestamp(), first.string("thread")]
    assert made == [again.uuid4(), again.uuid7(), again.timestamp(), again.string("thread")]
    assert other.uuid4() != made[0]
    assert re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", made[1]
    )
    assert made[2].startswith("2026-01-01T00:00:00.")
