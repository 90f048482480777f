"""Every message fake-codex writes in every scenario of the library matches the JSON
Schema that the real codex of the same release generates.

Per release of the support window, the whole library runs (in this process, one
scenario at a time) with fake-codex emulating that release (``$FAKE_CODEX_VERSION``),
and the fake tees what it writes and reads to files
(``$FAKE_CODEX_WIRE_LOG``). Each line it wrote is then checked against that release's
schema, made strict (a field the schema does not declare is an error, as no real codex
sends one): notifications against ``ServerNotification.json``, server requests against
``ServerRequest.json``, and every answer against the result type of the request it
answers (``<Method>Response.json``, found through ``ClientRequest.json``). Lines a script
writes on purpose (garbage, notifications of methods the real server does not have,
results it spells out) are counted and named, never silently passed.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from scenario_runs import run_all

from bridge import codex_window
from fakes.app_server.cli import VERSION_ENV
from fakes.app_server.wire import WIRE_LOG_ENV
from scenarios.format import load_scenario
from scenarios.runner import RunOptions

LIBRARY = Path(__file__).resolve().parents[2] / "scenarios" / "library"

pytestmark = pytest.mark.real_codex


def strict(node: Any, flattened: bool = False) -> Any:
    """``node`` where every object schema that lists its properties allows no other
    (but an object flattened with a union, whose fields sit on both levels)."""
    if isinstance(node, dict):
        union = "properties" in node and any(k in node for k in ("oneOf", "anyOf"))
        for key, value in node.items():
            if key in ("oneOf", "anyOf"):
                for arm in value:
                    strict(arm, flattened=union)
            else:
                strict(value)
        open_fields = "additionalProperties" in node or union or flattened
        if "properties" in node and not open_fields:
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for value in node:
            strict(value)
    return node


def _validator(schema_dir: Path, name: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(json.loads((schema_dir / name).read_text())))


def _union_validators(
    schema_dir: Path, name: str
) -> tuple[jsonschema.Draft7Validator, dict[str, jsonschema.Draft7Validator]]:
    """A validator of a union of messages (``oneOf`` an arm per method), and for each
    method one of the same schema with its ``oneOf`` cut to that method's arm.

    For a message of that method the two say the same: every other arm requires a
    ``method`` its ``enum`` does not name, so none of them matches, and ``oneOf`` holds
    exactly when the one arm does. The cut one checks one arm instead of every arm (the
    whole union costs most of this test's own CPU). Where the arms are not all so, or a
    method is named by two arms, the whole union checks that method.
    """
    root = strict(json.loads((schema_dir / name).read_text()))
    whole = jsonschema.Draft7Validator(root)
    named: list[set[str]] = []
    for arm in root["oneOf"]:
        method = arm.get("properties", {}).get("method", {})
        if "method" not in arm.get("required", ()) or "enum" not in method:
            return whole, {}
        named.append(set(method["enum"]))
    cut = {
        method: jsonschema.Draft7Validator({**root, "oneOf": [arm]})
        for arm, methods in zip(root["oneOf"], named, strict=True)
        for method in methods
        if sum(method in other for other in named) == 1
    }
    return whole, cut


def _result_validators(schema_dir: Path) -> dict[str, jsonschema.Draft7Validator]:
    """Client request method -> a validator of its result, where the schema names one."""
    found = {}
    requests = json.loads((schema_dir / "ClientRequest.json").read_text())
    for variant in requests["oneOf"]:
        ref = variant["properties"].get("params", {}).get("$ref", "")
        name = ref.removeprefix("#/definitions/").removesuffix("Params")
        # The v1 types sit at the top of the folder, the v2 ones under v2/.
        paths = [schema_dir / f"{name}Response.json", schema_dir / "v2" / f"{name}Response.json"]
        path = next((p for p in paths if p.exists()), None)
        if ref and path is not None:
            checker = _validator(schema_dir, path.relative_to(schema_dir).as_posix())
            for method in variant["properties"]["method"]["enum"]:
                found[method] = checker
    return found


def _emulated(lines: list[Any]) -> str | None:
    """The release a fake-codex process said it emulates, in its `initialize` userAgent."""
    for message in lines:
        agent = message.get("result", {}).get("userAgent") if isinstance(message, dict) else None
        if isinstance(agent, str) and f" {codex_window.FAKE_TOKEN}" in agent:
            return agent.split(f" {codex_window.FAKE_TOKEN}", 1)[1].split(" ", 1)[0]
    return None


def _read(path: Path) -> list[Any]:
    found: list[Any] = []
    for raw in path.read_bytes().split(b"\n") if path.exists() else []:
        if raw:
            try:
                found.append(json.loads(raw))
            except ValueError:
                found.append(NOT_JSON)
    return found


NOT_JSON = "<not JSON>"


@pytest.mark.asyncio
# The whole library, one scenario at a time: a minute on a busy machine, more on
# a very busy one; the default guard of 120 s is for a single case.
@pytest.mark.timeout(600)
@pytest.mark.codex_timeout(600)
async def test_every_library_message_matches_the_real_schema(
    codex_bin: str, codex_version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = codex_window.release(codex_version)
    assert release is not None
    schema_dir = tmp_path / "schema"
    proc = await asyncio.create_subprocess_exec(
        codex_bin, "app-server", "generate-json-schema", "--experimental", "--out", str(schema_dir)
    )
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    notifications = _union_validators(schema_dir, "ServerNotification.json")
    requests = _union_validators(schema_dir, "ServerRequest.json")
    # Each union's cut validators cover most of its methods (checked, so the shortcut
    # cannot silently fall back to nothing).
    assert len(notifications[1]) > 50
    assert len(requests[1]) > 5
    envelope = _validator(schema_dir, "JSONRPCMessage.json")
    results = _result_validators(schema_dir)
    known = {
        branch["properties"]["method"]["enum"][0]
        for branch in json.loads((schema_dir / "ServerNotification.json").read_text())["oneOf"]
    }

    wire_dir = tmp_path / "wire"
    wire_dir.mkdir()
    monkeypatch.setenv(WIRE_LOG_ENV, str(wire_dir))
    monkeypatch.setenv(VERSION_ENV, release)
    fake_backed = [
        loaded
        for path in sorted(LIBRARY.glob("*.scenario.yaml"))
        if not (loaded := load_scenario(path)).scenario.real_codex
    ]
    assert fake_backed
    runs = await run_all(fake_backed, RunOptions(tmp_root=tmp_path))
    failed = [run for run in runs if not run.passed]
    assert [run.loaded.name for run in failed] == [], [run.failures for run in failed]

    checked: Counter[str] = Counter()
    problems: list[str] = []
    scripted: dict[str, int] = {}
    other_release: Counter[str] = Counter()
    for log in sorted(wire_dir.glob("*.out")):
        written = _read(log)
        emulated = _emulated(written)
        if emulated not in (None, release):
            # A script that names its release (`versionOutput`) is that release.
            other_release[emulated] += 1
            continue
        asked = {
            message["id"]: message["method"]
            for message in _read(log.with_suffix(".in"))
            if isinstance(message, dict) and "id" in message and "method" in message
        }
        for message in written:
            if message == NOT_JSON:
                scripted[NOT_JSON] = scripted.get(NOT_JSON, 0) + 1
                continue
            broken = _not_json_rpc(message)
            if broken is not None:
                scripted[broken] = scripted.get(broken, 0) + 1
                continue
            method = message.get("method")
            if method is not None and "id" not in message and method not in known:
                scripted[method] = scripted.get(method, 0) + 1
                continue
            if method is not None:
                whole, cut = requests if "id" in message else notifications
                checker = cut.get(method, whole)
                kind = "server request" if "id" in message else "notification"
                subject = method
            elif "result" in message and asked.get(message["id"]) in results:
                subject = asked[message["id"]]
                checker, kind = results[subject], "result"
                message = message["result"]
            else:
                checker, kind, subject = envelope, "answer", str(asked.get(message["id"]))
            checked[kind] += 1
            problems += [
                f"{log.name}: {kind} {subject}: {e.message}"[:300]
                for e in checker.iter_errors(message)
            ]
    assert problems == []
    assert checked["notification"] > 50
    assert checked["result"] > 20
    assert checked["server request"] > 5
    # What the library's scripts write on purpose, beyond the real protocol:
    on_purpose = {NOT_JSON, *BROKEN_ON_PURPOSE.values(), *SCRIPTED_NOTIFICATIONS}
    assert set(scripted) <= on_purpose, scripted
    # Every fake emulated this release, but where a script says which release it is.
    assert set(other_release) <= set(codex_window.TESTED) - {release}, other_release


#: Lines of app-server-protocol-errors.scenario.yaml that break the protocol on purpose.
BROKEN_ON_PURPOSE = {
    "object": "<JSON, not an object>",
    "method": "<a method that is not a string>",
    "message": "<an object that is no JSON-RPC message>",
}
#: Notifications the library's scripts invent (methods the real server does not have).
SCRIPTED_NOTIFICATIONS = {
    "custom/after",
    "custom/answered",
    "custom/hanging",
    "custom/hello",
    "custom/n",
    "custom/tick",
}


def _not_json_rpc(message: Any) -> str | None:
    """How a JSON line fails to be a JSON-RPC message at all, if it does."""
    if not isinstance(message, dict):
        return BROKEN_ON_PURPOSE["object"]
    if "method" in message and not isinstance(message["method"], str):
        return BROKEN_ON_PURPOSE["method"]
    if "method" not in message and "id" not in message:
        return BROKEN_ON_PURPOSE["message"]
    return None
