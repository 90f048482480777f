"""The respx fixture as a host suite meets it: its own pytest process, the plugin found
by its entry point, a scenario file beside the tests, its cassette recorded on first
use, then replayed; a changed scenario makes it stale until re-recorded."""

from __future__ import annotations

import textwrap

import pytest
from front_here import in_process

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
"""


def test_a_host_suite_uses_the_respx_fixture(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "")  # a missing cassette is recorded (not under CI=true)
    scenario = pytester.path / "host.scenario.yaml"
    scenario.write_text(textwrap.dedent(SCENARIO).lstrip())
    pytester.makepyfile(host_code=HOST_CODE, test_host=HOST_TESTS)
    first = in_process(pytester, *QUIET, "-p", "no:xdist", "-rA", "test_host.py")
    first.assert_outcomes(passed=2, failed=1, errors=1)
    first.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_stops_halfway*",
            "*scenario host-turn: * recorded exchange(s) the host never made (assert_all_called):",
            "*step 2 (call thread/start, *host.scenario.yaml:9): POST /v1/sessions/*/call/"
            "thread/start never requested",
        ]
    )
    # A test that failed on its own is not buried under the mock's end check.
    assert "ERROR at teardown of test_fails_itself" not in first.stdout.str()
    cassette = pytester.path / "cassettes" / "host.yaml"
    recorded = cassette.read_text()
    assert "Hello, host." in recorded

    # CI=true replays what is there, and never records.
    monkeypatch.setenv("CI", "true")
    again = in_process(pytester, *QUIET, "-p", "no:xdist", "test_host.py::test_a_turn")
    again.assert_outcomes(passed=1)
    assert cassette.read_text() == recorded

    scenario.write_text(scenario.read_text().replace("Hello, host.", "Hello again, host."))
    stale = in_process(pytester, *QUIET, "-p", "no:xdist", "test_host.py::test_a_turn")
    stale.assert_outcomes(failed=1)
    stale.stdout.fnmatch_lines(
        [
            "*host.yaml is older than its scenario *host.scenario.yaml*regenerate it: python -m "
            "scenarios.cassette record *host.scenario.yaml"
        ]
    )
    monkeypatch.setenv("CI", "")
    refreshed = in_process(
        pytester, *QUIET, "-p", "no:xdist", "--codex-record-cassettes", "test_host.py::test_a_turn"
    )
    refreshed.assert_outcomes(failed=1)  # the host code still expects the old text
    assert "Hello again, host." in cassette.read_text()
