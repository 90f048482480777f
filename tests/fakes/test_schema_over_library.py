"""Every message fake-codex writes in every scenario of the library matches the JSON
Schema that the pinned real codex generates.

The fake tees its stdout to files (``$FAKE_CODEX_WIRE_LOG``); after the whole library
has run through the bridge, each line is checked: notifications against
``ServerNotification.json``, server requests against ``ServerRequest.json``, and every
response against the JSON-RPC envelope. Lines a script writes on purpose (garbage, or
notifications of methods the real server does not have) are counted and named, never
silently passed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import pytest_asyncio

from fakes.app_server.wire import WIRE_LOG_ENV
from scenarios.format import load_scenario
from scenarios.runner import RunOptions, run_scenario

LIBRARY = Path(__file__).resolve().parents[2] / "scenarios" / "library"

# One worker runs both releases' tests, so that the library (`library_wire`) runs once.
pytestmark = [pytest.mark.real_codex, pytest.mark.xdist_group("schema-over-library")]


def _validator(schema_dir: Path, name: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((schema_dir / name).read_text()))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def library_wire(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of what fake-codex wrote in every fake-backed scenario of the library.

    The library runs once per module: what the fake writes does not depend on the real
    codex whose schema it is then checked against, so each release of the window checks
    the same lines (its tests share one xdist group, so one worker runs the library).
    """
    tmp_root = tmp_path_factory.mktemp("library")
    wire_dir = tmp_root / "wire"
    wire_dir.mkdir()
    fake_backed = [
        loaded
        for path in sorted(LIBRARY.glob("*.scenario.yaml"))
        if not (loaded := load_scenario(path)).scenario.real_codex
    ]
    assert fake_backed
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(WIRE_LOG_ENV, str(wire_dir))
        for loaded in fake_backed:
            result = await run_scenario(loaded, RunOptions(tmp_root=tmp_root))
            assert result.passed, loaded.name
    return wire_dir


@pytest.mark.asyncio
# The whole library, one scenario after another (in the fixture): a minute on a busy
# machine, more on a very busy one; the default guard of 120 s is for a single case.
@pytest.mark.timeout(600)
async def test_every_library_message_matches_the_real_schema(
    codex_bin: str, tmp_path: Path, library_wire: Path
) -> None:
    schema_dir = tmp_path / "schema"
    proc = await asyncio.create_subprocess_exec(
        codex_bin, "app-server", "generate-json-schema", "--out", str(schema_dir)
    )
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    notifications = _validator(schema_dir, "ServerNotification.json")
    requests = _validator(schema_dir, "ServerRequest.json")
    envelope = _validator(schema_dir, "JSONRPCMessage.json")
    known = {
        branch["properties"]["method"]["enum"][0]
        for branch in json.loads((schema_dir / "ServerNotification.json").read_text())["oneOf"]
    }
    wire_dir = library_wire

    checked = 0
    problems: list[str] = []
    scripted: dict[str, int] = {}
    for log in sorted(wire_dir.glob("*.out")):
        for raw in log.read_bytes().split(b"\n"):
            if not raw:
                continue
            try:
                message: Any = json.loads(raw)
            except ValueError:
                scripted["<not JSON>"] = scripted.get("<not JSON>", 0) + 1
                continue
            broken = _not_json_rpc(message)
            if broken is not None:
                scripted[broken] = scripted.get(broken, 0) + 1
                continue
            method = message.get("method")
            if method is not None and "id" not in message and method not in known:
                scripted[method] = scripted.get(method, 0) + 1
                continue
            checker = envelope
            if method is not None:
                checker = requests if "id" in message else notifications
            checked += 1
            problems += [f"{log.name}: {e.message}"[:300] for e in checker.iter_errors(message)]
    assert problems == []
    assert checked > 50
    # What the library's scripts write on purpose, beyond the real protocol:
    on_purpose = {"<not JSON>", *BROKEN_ON_PURPOSE.values(), *SCRIPTED_NOTIFICATIONS}
    assert set(scripted) <= on_purpose, scripted


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
