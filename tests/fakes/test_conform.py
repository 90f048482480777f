"""fake-codex's payloads fitted to the release it emulates (fakes/app_server/conform.py).

The real check is between releases: for every ordered pair of the support window, a
payload of each notification, server request and result of the first release (built
from that release's real schema, every field it declares filled in) is fitted by the
second release's shapes, then must match the second release's real schema, made strict
(no field it does not declare). Unfitted, the payloads of 0.169.0 fail 0.171.0's schema
(`Project.position`, the old `AgentMessageDisplay`) and the other way round (the new
`AgentMessageDisplay` arms, `environmentId`...): the test says how many, so the fitting
is seen to do the work. Both schemas come from the real binaries, at test time.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from itertools import permutations
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bridge import codex_schema, codex_window
from fakes.app_server import protocol
from fakes.app_server.conform import RESPONSES, SERVER_REQUESTS, Shapes, compile_shapes
from scenarios.codex_install import pinned_codex
from scenarios.harness import NO_CODEX
from tests.fakes.test_schema_over_library import strict

ROOT = Path(__file__).resolve().parents[2]
PAIRS = list(permutations(codex_window.TESTED, 2))


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each release of the window -> its real schema bundle (`--experimental`)."""
    found = {}
    for version in codex_window.TESTED:
        pinned = pinned_codex(ROOT / ".codex-npm", version)
        if pinned is None:
            missing = f"codex {version} is not in .codex-npm/{version}/: make codex"
            if os.environ.get("CI") == "true":
                pytest.fail(f"CI=true: {missing}", pytrace=False)
            pytest.skip(f"{missing} ({NO_CODEX})")
        out = tmp_path_factory.mktemp(f"schema-{version}")
        codex_schema.generate(pinned[0], out, experimental=True)
        found[version] = json.loads((out / codex_schema.BUNDLE).read_text(encoding="utf-8"))
    return found


def messages(bundle: dict[str, Any]) -> dict[tuple[str, str], str]:
    """(kind, method) -> the definition key of its payload, as `$ref` names it."""
    definitions = codex_schema.flatten(bundle)
    found = {}
    for union, kind in (
        ("ServerNotification", "notifications"),
        ("ServerRequest", SERVER_REQUESTS),
    ):
        for variant in definitions[union]["oneOf"]:
            ref = variant["properties"].get("params", {}).get("$ref", "")
            for method in variant["properties"]["method"]["enum"]:
                if ref:
                    found[(kind, method)] = ref.removeprefix("#/definitions/")
    for variant in definitions["ClientRequest"]["oneOf"]:
        ref = variant["properties"].get("params", {}).get("$ref", "").removeprefix("#/definitions/")
        response = ref.removesuffix("Params") + "Response"
        if ref.endswith("Params") and response in definitions:
            for method in variant["properties"]["method"]["enum"]:
                found[(RESPONSES, method)] = response
    return found


def instance(schema: Any, definitions: dict[str, Any], depth: int = 7) -> Any:
    """A value of ``schema`` with every declared field filled in (the first variant of
    a union, the first value of an enum)."""
    while isinstance(schema, dict) and "$ref" in schema:
        schema = definitions[schema["$ref"].removeprefix("#/definitions/")]
    if not isinstance(schema, dict) or depth <= 0:
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    variants = [
        v
        for v in schema.get("oneOf", []) + schema.get("anyOf", []) + schema.get("allOf", [])
        if not (isinstance(v, dict) and v.get("type") == "null")
    ]
    value: Any = None
    if "properties" in schema:
        value = {
            name: instance(prop, definitions, depth - 1)
            for name, prop in schema["properties"].items()
        }
        if variants and isinstance(first := instance(variants[0], definitions, depth - 1), dict):
            value.update(first)
        return value
    if variants:
        return instance(variants[0], definitions, depth - 1)
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    for kind, plain in (("string", "x"), ("integer", 1), ("number", 1), ("boolean", True)):
        if kind in types:
            return plain
    if "array" in types:
        item = instance(schema.get("items"), definitions, depth - 1)
        return [] if item is None else [item]
    if "object" in types:
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            return {"key": instance(extra, definitions, depth - 1)}
        return {}
    return None


def validator(bundle: dict[str, Any], key: str) -> jsonschema.Draft7Validator:
    schema = {"definitions": bundle["definitions"], "allOf": [{"$ref": f"#/definitions/{key}"}]}
    return jsonschema.Draft7Validator(schema)


def fitted_and_not(old: dict[str, Any], new: dict[str, Any]) -> tuple[int, list[str], list[str]]:
    """Every message both releases have, built as ``old`` writes it: how many were
    checked, and the problems ``new``'s strict schema finds with them unfitted and fitted
    by ``new``'s shapes."""
    old_defs = codex_schema.flatten(old)
    strict_old, strict_new = strict(copy.deepcopy(old)), strict(copy.deepcopy(new))
    compiled = compile_shapes(codex_schema.flatten(new))
    shapes = Shapes(compiled)
    fit = {"notifications": shapes.notification, SERVER_REQUESTS: shapes.request}
    fit[RESPONSES] = shapes.result
    old_messages, new_messages = messages(old), messages(new)
    checked, unfitted, fitted = 0, [], []
    for (kind, method), key in sorted(old_messages.items()):
        new_key = new_messages.get((kind, method))
        if new_key is None:
            continue  # the newer release does not have it: nothing to send
        payload = instance({"$ref": f"#/definitions/{key}"}, old_defs)
        if not validator(strict_old, key).is_valid(payload):
            continue  # a union this sketch of a payload cannot fill in
        checked += 1
        target = validator(strict_new, new_key)
        unfitted += [f"{kind} {method}: {e.message}"[:200] for e in target.iter_errors(payload)]
        shaped = fit[kind](method, copy.deepcopy(payload))
        fitted += [f"{kind} {method}: {e.message}"[:200] for e in target.iter_errors(shaped)]
    # Every type both have that a message the server sends reaches (so a union's later
    # arms too, which the messages above fill with their first).
    for key in sorted(set(old_defs) & set(compiled["types"])):
        payload = instance({"$ref": f"#/definitions/{key}"}, old_defs)
        if payload is None or not validator(strict_old, key).is_valid(payload):
            continue
        checked += 1
        target = validator(strict_new, key)
        unfitted += [f"type {key}: {e.message}"[:200] for e in target.iter_errors(payload)]
        shaped = shapes.value(key, copy.deepcopy(payload))
        fitted += [f"type {key}: {e.message}"[:200] for e in target.iter_errors(shaped)]
    return checked, unfitted, fitted


@pytest.mark.real_codex
@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_a_payload_of_one_release_fitted_to_another_matches_its_real_schema(
    bundles: dict[str, dict[str, Any]], old: str, new: str
) -> None:
    checked, unfitted, fitted = fitted_and_not(bundles[old], bundles[new])
    assert checked > 500
    assert fitted == []
    # Without the fitting, the other release's schema refuses some of them.
    assert unfitted != []


@pytest.mark.quick
def test_a_payload_already_fitting_is_sent_as_it_is_and_never_modified() -> None:
    shapes = protocol.shapes(codex_window.TESTED[-1])
    item = {"type": "agentMessage", "id": "m", "text": "hi", "phase": None}
    params = {"threadId": "t", "turnId": "u", "item": item, "completedAtMs": 1}
    assert shapes.notification("item/completed", params) is params
    extra = {**params, "item": {**item, "notAField": 1}}
    fitted = shapes.notification("item/completed", extra)
    assert fitted["item"] == item
    assert extra["item"]["notAField"] == 1  # the builder's own object is left alone


def test_the_fake_pays_nothing_for_the_release_its_builders_write() -> None:
    fit = protocol.fitting(protocol.BUILT_FOR)
    params = {"anything": object()}
    assert fit.notification("item/completed", params) is params
    assert fit.result("thread/start", params) is params
    # Not even the module that fits is imported (each fake-codex start would pay for it).
    probe = (
        "import sys; from fakes.app_server import protocol; "
        "protocol.fitting(protocol.BUILT_FOR); print('fakes.app_server.conform' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == "False\n"


def test_the_fake_speaks_the_release_named_in_its_environment() -> None:
    fake = str(Path(sys.executable).with_name("fake-codex"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CODEX")}
    newest = codex_window.TESTED[-1]
    lines = [
        {"id": 0, "method": "initialize", "params": {"clientInfo": {"name": "t", "version": "1"}}},
        {"method": "initialized"},
    ]
    done = subprocess.run(
        [fake, "app-server"],
        input="".join(json.dumps(line) + "\n" for line in lines),
        env={**env, "FAKE_CODEX_VERSION": newest},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert f"fake-codex/{newest} " in json.loads(done.stdout.splitlines()[0])["result"]["userAgent"]
    refused = subprocess.run(
        [fake, "app-server"],
        input="",
        env={**env, "FAKE_CODEX_VERSION": "9.9.9"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2
    assert refused.stderr.startswith("FAKE_CODEX_VERSION: fake-codex emulates codex ")
    assert "Traceback" not in refused.stderr


@pytest.mark.quick
@pytest.mark.parametrize(
    "payload",
    [
        None,
        "a string",
        42,
        [],
        {"item": "not an object"},
        {"item": ["a", "list"]},
        {"item": {"type": 7}},
        {"item": {"type": None}},
        {"item": {"type": "noSuchItemType", "extra": 1}},
        {"item": {"type": ["agentMessage"]}},
    ],
    ids=repr,
)
def test_a_payload_of_the_wrong_shape_is_sent_as_it_is(payload: Any) -> None:
    """Fitting only ever removes what the release does not declare and adds what it
    requires; a value of another type than the schema's, or a union arm the release does
    not know, is left exactly as the builder wrote it (no exception, nothing guessed)."""
    shapes = protocol.shapes(codex_window.TESTED[-1])
    before = copy.deepcopy(payload)
    fitted = shapes.notification("item/completed", payload)
    assert payload == before
    if isinstance(payload, dict):
        assert fitted["item"] == payload["item"]
    else:
        assert fitted is payload


@pytest.mark.quick
def test_a_deep_payload_is_fitted_without_recursing_past_the_schema() -> None:
    """A value nested far deeper than any type of the schema (a client's `config`, a
    tool's arguments) is walked only as deep as the plan goes."""
    shapes = protocol.shapes(codex_window.TESTED[-1])
    deep: Any = "bottom"
    for _ in range(5000):
        deep = {"nested": deep}
    params = {"threadId": "t", "turnId": "u", "callId": "c", "tool": "x", "arguments": deep}
    fitted = shapes.request("item/tool/call", params)
    assert fitted["arguments"] is deep
