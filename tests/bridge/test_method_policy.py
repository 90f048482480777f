"""The method policy: which app-server methods the raw call routes may call.

Real parts: `rest-bridge serve` and fake-codex processes, real sockets, raw request
lines for the odd spellings; the pinned codex's own generated schema for the list.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_runs import main_here
from openapi_spec_validator import validate

from bridge.app import DEFAULT_REFUSED_METHODS, default_app, text_turn_app, trusted_bridge_app
from bridge.limits import RestLimitsEnvError
from bridge.policy import HOST_METHODS, MethodPolicy, MethodRules, canonical
from bridge.routes import OPENAPI
from bridge.settings import MethodPolicyVariables
from scenarios.format import dump_yaml

REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
WAIT = 60.0
#: A method the fake answers after notifying `test/marker`: everything the bridge sent
#: before it has been read by the fake by then.
MARKER = "test/marker"
REACHED = "test/reached"


def concrete(rule: str) -> str:
    """A method name a rule refuses (a prefix gets a made-up method under it)."""
    return rule + "anything" if rule.endswith("/") else rule


#: One method per rule of the default preset, plus the four of the issue's report.
HOST_CALLS = sorted(
    {concrete(rule) for rule in HOST_METHODS}
    | {"command/exec", "fs/readFile", "fs/writeFile", "config/value/write"}
)


def fake_script(tmp_path: Path) -> Path:
    """A fake-codex script that notifies REACHED for every host method it is sent."""
    reached = {"steps": [{"notify": {"method": REACHED, "params": {"method": "${method}"}}}]}
    script = {
        "version": 1,
        "methods": {
            **{method: {**reached, "result": {"reached": True}} for method in HOST_CALLS},
            MARKER: {"steps": [{"notify": {"method": MARKER}}], "result": {}},
        },
        "unknownMethods": {**reached, "error": {"code": -32600, "message": "unknown ${method}"}},
    }
    path = tmp_path / "script.yaml"
    path.write_text(dump_yaml(script))
    return path


@dataclass
class Served:
    process: subprocess.Popen[str]
    port: int
    banner: list[str]
    stderr: Path

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """One request whose request line carries ``path`` byte for byte."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT)
        try:
            data = None if body is None else json.dumps(body).encode()
            sent = {"Content-Type": "application/json"} if data is not None else {}
            connection.request(method, path, body=data, headers={**sent, **(headers or {})})
            response = connection.getresponse()
            payload = response.read()
            return response.status, json.loads(payload) if payload else None
        finally:
            connection.close()

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=WAIT)
        assert self.process.stdout is not None
        self.process.stdout.close()
        return self.stderr.read_text()


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Any]:
    """Start `rest-bridge serve` with the given preset, app-server and variables."""
    started: list[Served] = []

    def start(preset: str, app_server: str, **variables: str) -> Served:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
        env.update(variables)
        stderr = tmp_path / f"bridge-{len(started)}.stderr"
        with stderr.open("w") as err:
            process = subprocess.Popen(
                [
                    REST_BRIDGE,
                    "serve",
                    "--preset",
                    preset,
                    "--port",
                    "0",
                    "--app-server",
                    app_server,
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        assert process.stdout is not None
        banner: list[str] = []
        port = 0
        for line in process.stdout:  # the bridge's own words, up to its descriptor budget
            banner.append(line.rstrip("\n"))
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
            if line.startswith("  methods: "):
                break
        served = Served(process, port, banner, stderr)
        started.append(served)
        assert port, (banner, stderr.read_text())
        return served

    yield start
    for served in started:
        served.stop()
        assert served.process.returncode == 0


def session(served: Served) -> str:
    status, created = served.request("POST", "/v1/sessions", {})
    assert status == 201, created
    return str(created["sessionId"])


def notifications_until_marker(served: Served, session_id: str) -> list[dict[str, Any]]:
    """Call MARKER, then read the session's events up to its notification."""
    status, body = served.request(
        "POST", f"/v1/sessions/{session_id}/call/{MARKER}", {"params": {}}
    )
    assert status == 200, body
    seen = []
    while True:
        status, event = served.request(
            "GET", f"/v1/sessions/{session_id}/events?waitMs=30000", None
        )
        assert status == 200, (status, event, seen)
        seen.append(event)
        if event["method"] == MARKER:
            return seen


def reached(events: list[dict[str, Any]]) -> list[str]:
    return [e["params"]["method"] for e in events if e["method"] == REACHED]


# -- the default preset refuses what reaches the host -----------------------------------


@pytest.mark.parametrize("mode", ["process", "shared"])
def test_default_preset_refuses_every_host_method_before_the_app_server_sees_it(
    serve_process, tmp_path, mode
):
    served = serve_process(
        "default",
        f"{FAKE_CODEX} app-server --script {fake_script(tmp_path)}",
        REST_ADAPTER_APP_SERVER_MODE=mode,
    )
    session_id = session(served)
    for method in HOST_CALLS:
        params = {"command": ["cat", "/etc/shadow"], "sandboxPolicy": {"type": "dangerFullAccess"}}
        status, body = served.request(
            "POST", f"/v1/sessions/{session_id}/call/{method}", {"params": params}
        )
        assert status == 403, (method, body)
        assert body == {
            "error": "method_not_allowed",
            "message": f"This router does not allow the app-server method {method!r}.",
            "data": {"method": method},
        }
    assert reached(notifications_until_marker(served, session_id)) == []
    # A thread method goes through to the app-server, as before.
    status, body = served.request(
        "POST", f"/v1/sessions/{session_id}/call/thread/start", {"params": {}}
    )
    assert status == 200, body
    assert "thread" in body["result"]
    assert any(line == "  methods: the host-reaching ones refused" for line in served.banner)


ODD_SPELLINGS = [
    "FS/readFile",
    "Fs/ReadFile",
    "fs//readFile",
    "fs/readFile/",
    "/fs/readFile",
    "fs%2FreadFile",
    "fs%2freadFile",
    "fs%252FreadFile",
    "%66s/readFile",
    "./fs/readFile",
    "fs/./readFile",
    "thread/../fs/readFile",
    "thread/%2E%2E/fs/readFile",
    "thread%2F..%2Ffs%2FreadFile",
    "command%2Fexec",
    "COMMAND/EXEC",
    "command/exec/write",
    "config/value/write/",
    "thread/shellCommand/",
    "thread/SHELLCOMMAND",
    "thread/shellCommand%20",
    "thread/shellCommand%00",
    "thread/shellCommand%0A",
    "%09thread/shellCommand",
]


def test_odd_spellings_of_a_refused_method_are_refused_too(serve_process, tmp_path):
    """The request line carries each spelling byte for byte (no client normalises it)."""
    served = serve_process("default", f"{FAKE_CODEX} app-server --script {fake_script(tmp_path)}")
    session_id = session(served)
    for spelling in ODD_SPELLINGS:
        status, body = served.request(
            "POST", f"/v1/sessions/{session_id}/call/{spelling}", {"params": {}}
        )
        assert status == 403, (spelling, status, body)
        assert body["error"] == "method_not_allowed", spelling
    assert reached(notifications_until_marker(served, session_id)) == []


def test_the_host_allows_and_refuses_methods_from_the_environment(serve_process, tmp_path):
    served = serve_process(
        "default",
        f"{FAKE_CODEX} app-server --script {fake_script(tmp_path)}",
        REST_ADAPTER_ALLOW_METHODS="fs/readFile, config/",
        REST_ADAPTER_REFUSE_METHODS="thread/delete,config/batchWrite",
    )
    assert (
        "  methods: the host-reaching ones refused; allowed: config/, fs/readFile; "
        "refused: config/batchWrite, thread/delete"
    ) in served.banner
    session_id = session(served)
    expected = {
        "fs/readFile": 200,  # the host's name rule beats the preset's `fs/`
        "fs/writeFile": 403,
        "config/value/write": 200,  # the host's `config/` beats the preset's
        "config/batchWrite": 403,  # the host's name rule beats its own prefix
        "thread/delete": 403,  # refused by the host in a preset that allows it
        "command/exec": 403,
    }
    for method, status_expected in expected.items():
        status, body = served.request(
            "POST", f"/v1/sessions/{session_id}/call/{method}", {"params": {}}
        )
        assert status == status_expected, (method, body)
    assert reached(notifications_until_marker(served, session_id)) == [
        "fs/readFile",
        "config/value/write",
    ]


def test_trusted_refuses_a_sessionless_call_before_spawning_anything(serve_process, tmp_path):
    """The app-server command does not exist: any spawn would be a 502."""
    missing = str(tmp_path / "no-such-codex") + " app-server"
    served = serve_process("trusted", missing, REST_ADAPTER_REFUSE_METHODS="command/exec,fs/")
    for method in ("command/exec", "command%2Fexec", "fs/readFile", "FS/writeFile"):
        status, body = served.request("POST", f"/v1/call/{method}", {"params": {}})
        assert (status, body["error"]) == (403, "method_not_allowed"), method
    # What the policy allows does try to spawn: the 502 shows the 403 came first.
    status, body = served.request("POST", "/v1/call/model/list", {})
    assert (status, body["error"]) == (502, "app_server_spawn_failed")
    status, body = served.request("POST", "/v1/call/command/execute", {})
    assert (status, body["error"]) == (502, "app_server_spawn_failed")


def test_a_text_turn_is_refused_when_its_methods_are(serve_process, tmp_path):
    missing = str(tmp_path / "no-such-codex") + " app-server"
    served = serve_process("text-turn", missing, REST_ADAPTER_REFUSE_METHODS="turn/start")
    status, body = served.request("POST", "/v1/text-turn", {"text": "hi"})
    assert status == 403, body
    assert body["data"] == {"method": "turn/start"}


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("REST_ADAPTER_ALLOW_METHODS", "fs/readFile,../x"),
        ("REST_ADAPTER_REFUSE_METHODS", "fs/read%46ile"),
        ("REST_ADAPTER_REFUSE_METHODS", "fs/ readFile"),
        ("REST_ADAPTER_ALLOW_METHODS", "fs//"),
    ],
)
@pytest.mark.quick
def test_a_method_rule_that_is_not_one_stops_the_start_naming_the_variable(
    variable, value, monkeypatch
):
    """Run by the CLI's own main in this process (tests/cli_runs.py)."""
    argv = ["serve", "--port", "0", "--app-server", f"{FAKE_CODEX} app-server"]
    done = main_here(argv, monkeypatch, {variable: value})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"rest-bridge: {variable}={value!r} is not a valid "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


# -- params of allowed methods that reach the host --------------------------------------

EVIL_CONFIG = {"mcp_servers": {"evil": {"command": "sh", "args": ["-c", "id > /tmp/x"]}}}


@pytest.mark.parametrize("mode", ["process", "shared"])
def test_default_preset_refuses_thread_config_and_paths(serve_process, tmp_path, mode):
    script = tmp_path / "threads.yaml"
    reached_step = {"notify": {"method": REACHED, "params": {"method": "${method}"}}}
    script.write_text(
        dump_yaml(
            {
                "version": 1,
                "methods": {
                    "thread/start": {"steps": [reached_step]},
                    "thread/resume": {"steps": [reached_step], "result": {}},
                    "thread/fork": {"steps": [reached_step], "result": {}},
                    MARKER: {"steps": [{"notify": {"method": MARKER}}], "result": {}},
                },
            }
        )
    )
    served = serve_process(
        "default", f"{FAKE_CODEX} app-server --script {script}", REST_ADAPTER_APP_SERVER_MODE=mode
    )
    session_id = session(served)
    refused = [
        ("thread/start", {"config": EVIL_CONFIG}, ["config"]),
        ("thread/start", {"Config": EVIL_CONFIG}, ["Config"]),
        ("thread/start", {"config": None, "cwd": str(tmp_path)}, ["config"]),
        ("Thread/Start", {"config": {}}, ["config"]),
        ("thread/resume", {"threadId": "t", "path": "/etc/shadow"}, ["path"]),
        ("thread/fork", {"threadId": "t", "config": {}, "path": "/x"}, ["config", "path"]),
    ]
    for method, params, names in refused:
        status, body = served.request(
            "POST", f"/v1/sessions/{session_id}/call/{method}", {"params": params}
        )
        assert status == 403, (method, params, body)
        assert body["error"] == "method_not_allowed"
        assert body["data"] == {"method": method, "params": names}
    # The text turn's threadParams go to thread/start: the same refusal, nothing spawned.
    status, body = served.request(
        "POST", "/v1/text-turn", {"text": "hi", "threadParams": {"config": EVIL_CONFIG}}
    )
    assert (status, body["data"]) == (403, {"method": "thread/start", "params": ["config"]})
    assert reached(notifications_until_marker(served, session_id)) == []
    status, body = served.request(
        "POST", f"/v1/sessions/{session_id}/call/thread/start", {"params": {"cwd": "/tmp"}}
    )
    assert status == 200, body
    assert reached(notifications_until_marker(served, session_id)) == ["thread/start"]


# -- server requests are not calls ------------------------------------------------------


def test_approvals_are_answered_under_a_policy_that_refuses_all_but_turns(serve_process, tmp_path):
    script = tmp_path / "approval.yaml"
    script.write_text(
        dump_yaml(
            {
                "version": 1,
                "turns": [
                    {"steps": [{"commandApproval": {"command": "true"}}, {"agentMessage": "ok"}]}
                ],
            }
        )
    )
    served = serve_process(
        "default",
        f"{FAKE_CODEX} app-server --script {script}",
        REST_ADAPTER_REFUSE_METHODS="*",
        REST_ADAPTER_ALLOW_METHODS="thread/start,turn/start",
    )
    session_id = session(served)
    status, body = served.request(
        "POST", f"/v1/sessions/{session_id}/call/model/list", {"params": {}}
    )
    assert status == 403, body
    status, started = served.request(
        "POST", f"/v1/sessions/{session_id}/call/thread/start", {"params": {}}
    )
    assert status == 200, started
    thread_id = started["result"]["thread"]["id"]
    status, body = served.request(
        "POST",
        f"/v1/sessions/{session_id}/call/turn/start",
        {"params": {"threadId": thread_id, "input": [{"type": "text", "text": "go"}]}},
    )
    assert status == 200, body
    key = None
    while key is None:
        status, event = served.request("GET", f"/v1/sessions/{session_id}/events?waitMs=30000")
        assert status == 200, event
        if event["method"] == "item/commandExecution/requestApproval":
            key = event["requestKey"]
    status, body = served.request(
        "POST",
        f"/v1/sessions/{session_id}/requests/{key}/result",
        {"result": {"decision": "accept"}},
    )
    assert (status, body) == (200, {"status": "sent", "requestKey": key})
    while True:
        status, event = served.request("GET", f"/v1/sessions/{session_id}/events?waitMs=30000")
        assert status == 200, event
        if event["method"] == "turn/completed":
            assert event["params"]["turn"]["status"] == "completed"
            break


# -- the rules --------------------------------------------------------------------------


@pytest.mark.quick
def test_rules_decide_by_layer_then_specificity_and_refuse_wins_a_tie():
    preset = MethodRules(DEFAULT_REFUSED_METHODS, MethodPolicy())
    assert not preset.allows("fs/readFile")
    assert not preset.allows("command/exec/write")
    assert preset.allows("thread/start")
    assert preset.allows("command")  # `command/` covers the methods under it only
    host = MethodRules(
        DEFAULT_REFUSED_METHODS,
        MethodPolicy(allow=frozenset({"fs/", "thread/"}), refuse=frozenset({"fs/remove"})),
    )
    assert host.allows("fs/readFile")
    assert not host.allows("fs/remove")
    assert not host.allows("fs/remove/all")  # a name covers the methods under it
    assert not host.allows("thread/shellCommand")  # the preset's name rule, the host's prefix
    tie = MethodRules((), MethodPolicy(allow=frozenset({"a/b"}), refuse=frozenset({"A/B"})))
    assert not tie.allows("a/b")
    everything = MethodRules((), MethodPolicy(refuse=frozenset({"*"})))
    assert not everything.allows("")
    assert not everything.allows("model/list")
    assert MethodRules((), MethodPolicy()).allows_all
    assert not everything.allows_all


@pytest.mark.quick
def test_canonical_names_resolve_case_encoding_and_dot_segments():
    assert canonical("Thread/../FS//read%2546ile/.") == "fs/readfile"
    assert canonical("../../fs/readFile") == "fs/readfile"


@pytest.mark.quick
@pytest.mark.parametrize("rule", ["", " ", "fs//", "..", "./fs", "fs/*", "f s", "fs%2F", "é"])
def test_a_rule_that_is_not_a_name_or_prefix_is_refused_in_python(rule):
    with pytest.raises(ValueError, match="method rule"):
        MethodPolicy(refuse=frozenset({rule}))


@pytest.mark.quick
def test_policy_variables_parse_like_the_limits():
    policy = MethodPolicyVariables.from_env(
        {"REST_ADAPTER_ALLOW_METHODS": " fs/readFile ,, thread/", "REST_ADAPTER_REFUSE_METHODS": ""}
    ).method_policy()
    assert policy == MethodPolicy(allow=frozenset({"fs/readFile", "thread/"}))
    with pytest.raises(RestLimitsEnvError) as raised:
        MethodPolicyVariables.from_env({"REST_ADAPTER_REFUSE_METHODS": "fs/,x y"}).method_policy()
    assert raised.value.variable == "REST_ADAPTER_REFUSE_METHODS"


# -- the OpenAPI document ---------------------------------------------------------------


HOST_PARAMS_DOCUMENTED = {
    "thread/fork": ["config", "path"],
    "thread/resume": ["config", "path"],
    "thread/start": ["config"],
}


@pytest.mark.quick
@pytest.mark.parametrize(
    ("factory", "refused", "refused_params"),
    [
        (default_app, sorted(HOST_METHODS), HOST_PARAMS_DOCUMENTED),
        (trusted_bridge_app, [], {}),
        (text_turn_app, [], {}),
    ],
)
def test_openapi_describes_the_403_and_the_policy_of_the_preset(
    factory, refused, refused_params, fake_codex
):
    app = factory(fake_codex, method_policy=MethodPolicy(allow=frozenset({"fs/readFile"})))
    document = json.loads(app[OPENAPI]())
    validate(document)
    calling = {
        operation["operationId"]: operation
        for operations in document["paths"].values()
        for operation in operations.values()
        if "x-method-policy" in operation
    }
    expected = {
        default_app: {"session_call", "text_turn"},
        trusted_bridge_app: {"call", "session_call", "text_turn"},
        text_turn_app: {"text_turn"},
    }[factory]
    assert set(calling) == expected
    for operation in calling.values():
        assert operation["x-method-policy"] == {
            "presetRefuses": refused,
            "presetRefusesParams": refused_params,
            "hostAllows": ["fs/readFile"],
            "hostRefuses": [],
        }
        assert "`method_not_allowed`" in operation["responses"]["403"]["description"]
        assert "`data.method`" in operation["responses"]["403"]["description"]


def test_rest_bridge_openapi_prints_the_policy_the_served_document_has(serve_process, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    env["REST_ADAPTER_ALLOW_METHODS"] = "fs/readFile"
    printed = subprocess.run(
        [REST_BRIDGE, "openapi", "--preset", "default"],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=True,
    )
    document = json.loads(printed.stdout)
    served = serve_process(
        "default", f"{FAKE_CODEX} app-server", REST_ADAPTER_ALLOW_METHODS="fs/readFile"
    )
    status, served_document = served.request("GET", "/v1/openapi.json")
    assert status == 200
    assert document == served_document
    policy = document["paths"]["/v1/sessions/{sessionId}/call/{method}"]["post"]
    assert policy["x-method-policy"]["hostAllows"] == ["fs/readFile"]


@pytest.mark.asyncio
async def test_a_scenario_bridge_in_the_default_preset_refuses_host_methods(
    codex_start_bridge, http
):
    """The scenario harness and the pytest plugin build presets the same way."""
    bridge = await codex_start_bridge(preset="default")
    async with http.post(f"{bridge.url}/v1/sessions", json={}) as response:
        session_id = (await response.json())["sessionId"]
    url = f"{bridge.url}/v1/sessions/{session_id}/call/fs/readFile"
    async with http.post(url, json={"params": {"path": "/etc/shadow"}}) as response:
        assert response.status == 403
        assert await response.json() == {
            "error": "method_not_allowed",
            "message": "This router does not allow the app-server method 'fs/readFile'.",
            "data": {"method": "fs/readFile"},
        }


def test_authentication_comes_before_the_policy(serve_process, tmp_path):
    """Without the token, a refused method is a 401 like any other: the policy is not
    something an anonymous caller can probe."""
    token = "policy-test-token-5e1"
    served = serve_process(
        "trusted",
        f"{FAKE_CODEX} app-server",
        REST_ADAPTER_TOKEN=token,
        REST_ADAPTER_REFUSE_METHODS="fs/",
    )
    for method in ("model/list", "fs/readFile"):
        status, body = served.request("POST", f"/v1/call/{method}", {"params": {}})
        assert (status, body["error"]) == (401, "unauthorized"), method
    bearer = {"Authorization": f"Bearer {token}"}
    status, body = served.request("POST", "/v1/call/fs/readFile", {"params": {}}, bearer)
    assert (status, body["error"]) == (403, "method_not_allowed")
    status, body = served.request("POST", "/v1/call/model/list", {"params": {}}, bearer)
    assert status == 200, body
