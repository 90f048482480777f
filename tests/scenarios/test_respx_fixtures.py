"""The respx fixtures as a host suite meets them: its own pytest process, the plugin found
by its entry point, a scenario file beside the tests, sync and async host code."""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:faker")
QUIET += ("-p", "no:schemathesis")

SCENARIO = """
scenario: 1
name: host-turn
bridge: {token: s3cret}
appServer:
  version: 1
  turns: ["Hello, host."]
steps:
  - createSession: s
  - call: {session: "${s}", method: thread/start, params: {}}
    capture: {thread: $.result.thread.id}
  - call:
      session: "${s}"
      method: turn/start
      params: {threadId: "${thread}", input: [{type: text, text: hi}]}
  - poll: {session: "${s}", through: turn/completed}
    expect:
      subsequence:
        - {method: item/completed, params: {item: {type: agentMessage, text: "Hello, host."}}}
        - turn/completed
"""

HOST_CODE = '''
import httpx


def turn(base_url, token, text):
    """Host code: one turn over the bridge, the agent's last message."""
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}) as http:
        session = http.post("/v1/sessions", json={}).json()["sessionId"]
        call = f"/v1/sessions/{session}/call"
        thread = http.post(f"{call}/thread/start", json={"params": {}}).json()
        thread_id = thread["result"]["thread"]["id"]
        params = {"threadId": thread_id, "input": [{"type": "text", "text": text}]}
        http.post(f"{call}/turn/start", json={"params": params}).raise_for_status()
        said = None
        while True:
            response = http.get(f"/v1/sessions/{session}/events", params={"waitMs": 5000})
            if response.status_code == 204:
                continue
            event = response.json()
            if event["method"] == "item/completed":
                said = event["params"]["item"].get("text", said)
            if event["method"] == "turn/completed":
                return said


async def health(base_url):
    async with httpx.AsyncClient(base_url=base_url) as http:
        return (await http.get("/health")).json()["status"]
'''

HOST_TESTS = """
import httpx
import pytest

from host_code import health, turn


def test_a_turn(codex_respx):
    bridge = codex_respx("host.scenario.yaml")
    assert turn(bridge.base_url, bridge.token, "hi") == "Hello, host."


def test_stops_halfway(codex_respx):
    bridge = codex_respx("host.scenario.yaml")
    httpx.post(f"{bridge.base_url}/v1/sessions", json={},
               headers={"Authorization": f"Bearer {bridge.token}"})


def test_fails_itself(codex_respx):
    codex_respx("host.scenario.yaml")
    assert False, "the host's own failure"


@pytest.mark.asyncio
async def test_from_the_openapi_document(codex_respx_openapi):
    bridge = codex_respx_openapi("text-turn", token="t0k3n")
    assert await health(bridge.base_url) == "ok"
    with pytest.raises(AssertionError, match="no route of the mocked bridge matches"):
        httpx.get(f"{bridge.base_url}/v1/sessions")
"""


def test_a_host_suite_uses_the_respx_fixtures(pytester: pytest.Pytester) -> None:
    (pytester.path / "host.scenario.yaml").write_text(textwrap.dedent(SCENARIO).lstrip())
    pytester.makepyfile(host_code=HOST_CODE, test_host=HOST_TESTS)
    result = pytester.runpytest_subprocess(*QUIET, "--asyncio-mode=strict", "-rA")
    # The scenario file is a test too (on the real bridge and fake-codex): 4 passed.
    result.assert_outcomes(passed=4, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_stops_halfway*",
            "*scenario host-turn: 3 step(s) the host never made (assert_all_called):",
            "*step 2 (call thread/start, *host.scenario.yaml:9): POST /v1/sessions/*/call/"
            "thread/start never requested",
        ]
    )
    # A test that failed on its own is not buried under the mock's end check.
    assert "ERROR at teardown of test_fails_itself" not in result.stdout.str()
