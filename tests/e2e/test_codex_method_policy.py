"""The method policy in front of the real, pinned codex.

The list of methods the ``default`` preset refuses comes from what this codex declares
(its generated schema, produced here, never committed), and what it refuses is shown to
be real: the trusted preset lets the same calls read, write and run on the host.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge import codex_window
from bridge.app import DEFAULT_REFUSED_METHODS, default_app, trusted_bridge_app
from bridge.limits import RestLimits
from bridge.policy import HOST_METHODS, HOST_PARAMS, THREAD_METHODS, MethodPolicy, MethodRules
from scenarios.codex_install import pinned_codex

pytestmark = [pytest.mark.real_codex]

ROOT = Path(__file__).resolve().parents[2]


def client_requests(codex_bin: str, out: Path, *flags: str) -> dict[str, set[str]]:
    """The client request methods of the pinned codex's generated JSON Schema, each with
    the names of its params."""
    subprocess.run(
        [codex_bin, "app-server", "generate-json-schema", "--out", str(out), *flags],
        check=True,
        capture_output=True,
        timeout=120,
    )
    document = json.loads((out / "ClientRequest.json").read_text())
    methods = {}
    for request in document["oneOf"]:
        reference = request["properties"].get("params", {}).get("$ref", "")
        definition = document["definitions"].get(reference.rsplit("/", 1)[-1], {})
        methods[request["properties"]["method"]["enum"][0]] = set(definition.get("properties", {}))
    return methods


def schema_methods(codex_bin: str, out: Path, *flags: str) -> list[str]:
    return list(client_requests(codex_bin, out, *flags))


def window_methods(out: Path) -> set[str]:
    """Every client request method of every release of the tested window."""
    methods: set[str] = set()
    for version in codex_window.TESTED:
        found = pinned_codex(ROOT / ".codex-npm", version)
        assert found is not None, f"codex {version} of the tested window: run `make codex`"
        methods |= set(schema_methods(found[0], out / version, "--experimental"))
    return methods


def test_every_method_of_the_pinned_codex_is_classified(codex_bin, tmp_path):
    stable = schema_methods(codex_bin, tmp_path / "stable")
    every = schema_methods(codex_bin, tmp_path / "experimental", "--experimental")
    # The rules name methods of every release of the window: some are in only one.
    window = window_methods(tmp_path / "window")
    assert set(stable) <= set(every)
    assert len(stable) > 100
    assert {"command/exec", "fs/readFile", "fs/writeFile", "config/value/write"} <= set(stable)
    rules = MethodRules(DEFAULT_REFUSED_METHODS, MethodPolicy())
    allowed = {name for names in THREAD_METHODS.values() for name in names}
    # Every rule of the default preset refuses something this codex has.
    for rule in HOST_METHODS:
        one = MethodRules({rule}, MethodPolicy())
        assert any(not one.allows(m) for m in window), f"{rule} refuses no method of codex"
    # Every method is refused, or allowed by its exact name with a reason: a method a
    # new codex adds fails here until someone classifies it in bridge/policy.py.
    unclassified = [m for m in every if rules.allows(m) and m not in allowed]
    assert unclassified == [], "classify these in bridge/policy.py"
    # Nothing is both, and every name allowed is one a release of the window has.
    assert sorted(m for m in allowed if not rules.allows(m)) == []
    assert sorted(allowed - window) == []
    assert all(reason.strip() for reason in [*HOST_METHODS.values(), *THREAD_METHODS])


def test_every_param_the_default_preset_refuses_is_one_codex_takes(codex_bin, tmp_path):
    params = client_requests(codex_bin, tmp_path / "experimental", "--experimental")
    for method, names in HOST_PARAMS.items():
        assert set(names) <= params[method], method
        assert all(reason.strip() for reason in names.values())


ODD_SPELLINGS = [
    "fs/readFile",
    "FS/readFile",
    "fs//readFile",
    "fs/readFile/",
    "fs%2FreadFile",
    "fs%252FreadFile",
    "thread/%2E%2E/fs/readFile",
    "%66s/readFile",
]


async def call(http, base, session_id, method, params) -> tuple[int, Any]:
    url = f"{base}/v1/sessions/{session_id}/call/{method}"
    async with http.post(url, json={"params": params}) as response:
        return response.status, await response.json()


def default_preset_on(codex_bin: str, codex_home: Any, model: Any) -> Any:
    """The default preset (its own method policy, none from the environment) on the real
    codex, with this home and the scripted model: the same codex the trusted one ran."""
    command = [
        "env",
        f"CODEX_HOME={codex_home}",
        "OPENAI_API_KEY=x",
        codex_bin,
        "app-server",
        *model.codex_cli_args(),
    ]
    return default_app(command, RestLimits(), method_policy=MethodPolicy())


async def session(http, base, options=None) -> str:
    body = {"options": options} if options else {}
    async with http.post(f"{base}/v1/sessions", json=body) as response:
        created = await response.json()
        assert response.status == 201, created
    return str(created["sessionId"])


@pytest.mark.asyncio
async def test_the_default_preset_keeps_a_session_off_the_host_the_trusted_one_does_not(
    serve, http, codex_bin, codex_home, workspace, model, codex_options
):
    secret = workspace / "secret.txt"
    secret.write_text("root:$6$hash\n")
    written = workspace / "written.txt"
    config = codex_home / "config.toml"
    attacks: list[tuple[str, dict[str, Any]]] = [
        ("fs/readFile", {"path": str(secret)}),
        (
            "command/exec",
            {"command": ["cat", str(secret)], "sandboxPolicy": {"type": "dangerFullAccess"}},
        ),
        ("fs/writeFile", {"path": str(written), "dataBase64": base64.b64encode(b"x").decode()}),
        (
            "config/value/write",
            {"keyPath": "model", "value": "attacker-model", "mergeStrategy": "replace"},
        ),
    ]
    # The trusted preset: each call does what it says, on the host.
    trusted = await serve(trusted_bridge_app([codex_bin, "app-server"], RestLimits()))
    trusted_session = await session(http, trusted, codex_options)
    answers = {}
    for method, params in attacks:
        status, body = await call(http, trusted, trusted_session, method, params)
        assert status == 200, (method, body)
        answers[method] = body["result"]
    assert base64.b64decode(answers["fs/readFile"]["dataBase64"]) == secret.read_bytes()
    assert answers["command/exec"]["stdout"] == secret.read_text()
    assert written.read_bytes() == b"x"
    assert "attacker-model" in config.read_text()
    written.unlink()
    config.unlink()
    # Spellings: what codex takes as fs/readFile reads the file, the rest is unknown to it.
    reads = []
    for spelling in ODD_SPELLINGS:
        status, body = await call(http, trusted, trusted_session, spelling, {"path": str(secret)})
        if status == 200:
            reads.append(spelling)
        else:
            assert (status, body["code"]) == (502, -32600), (spelling, body)
            assert body["message"].startswith("Invalid request: unknown variant"), body
    # aiohttp decodes the path (`%2F`, `%66`, `%2E%2E` included) before the route sees it.
    assert {"fs/readFile", "fs%2FreadFile"} <= set(reads)
    # The default preset, on the same codex pointed at the same home and model.
    default = await serve(default_preset_on(codex_bin, codex_home, model))
    default_session = await session(http, default)
    for method, params in attacks:
        status, body = await call(http, default, default_session, method, params)
        assert status == 403, (method, body)
        assert body["error"] == "method_not_allowed"
        assert body["data"] == {"method": method}
    for spelling in ODD_SPELLINGS:
        status, body = await call(http, default, default_session, spelling, {"path": str(secret)})
        assert status == 403, (spelling, body)
    assert not written.exists()
    assert not config.exists()
    # The session itself is fine: a thread method is served.
    status, body = await call(
        http, default, default_session, "thread/start", {"cwd": str(workspace)}
    )
    assert status == 200, body


@pytest.mark.asyncio
async def test_thread_config_runs_a_host_command_in_trusted_and_is_refused_in_default(
    serve, http, codex_bin, codex_home, workspace, model, codex_options
):
    """`thread/start` with `config.mcp_servers`: codex starts the server's command at once.

    The command connects back to a socket this test listens on; the connection is the
    proof that it ran (waited on, not slept for).
    """
    connected: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await connected.put(await reader.read(100))
        writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    beacon = f"import socket; socket.create_connection(('127.0.0.1', {port})).sendall(b'ran')"
    params = {
        "cwd": str(workspace),
        "config": {"mcp_servers": {"beacon": {"command": sys.executable, "args": ["-c", beacon]}}},
    }
    try:
        trusted = await serve(trusted_bridge_app([codex_bin, "app-server"], RestLimits()))
        trusted_session = await session(http, trusted, codex_options)
        status, body = await call(http, trusted, trusted_session, "thread/start", params)
        assert status == 200, body
        assert await asyncio.wait_for(connected.get(), 30) == b"ran"
        default = await serve(default_preset_on(codex_bin, codex_home, model))
        default_session = await session(http, default)
        status, body = await call(http, default, default_session, "thread/start", params)
        assert status == 403, body
        assert body["data"] == {"method": "thread/start", "params": ["config"]}
        async with http.post(
            f"{default}/v1/text-turn", json={"text": "hi", "threadParams": params}
        ) as response:
            assert response.status == 403
        status, body = await call(
            http, default, default_session, "thread/start", {"cwd": str(workspace)}
        )
        assert status == 200, body
    finally:
        listener.close()
        await listener.wait_closed()
