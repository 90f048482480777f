"""Schemathesis, from each preset's own OpenAPI document, against `rest-bridge serve`.

One test per operation of each preset, with auth off and on. Requests are generated
from the document, valid and invalid, and sent to a real bridge on fake-codex. Every
response must be documented for its operation and match its schema, and every error
must be exactly the spec's payload. A 500 always fails. A 502, 503 or 504 is the
contract's answer when the app-server refuses what it was asked (an unknown method, a
`cwd` that does not exist), so those pass only as the documented kinds.

The run is bounded and reproducible: a fixed seed, derandomized generation, no example
database, and a request timeout. Each operation gets schemathesis's coverage phase first:
every boundary and invalid case its schema defines (the missing field, the wrong type,
the value just out of range), whatever the count below, and most of the cases in
`make test` (the trusted preset with auth off runs 679 cases with 5 random examples, 724
with 10). Then RELIABILITY_FUZZ_EXAMPLES random examples per operation and mode: 5 in
`make test`, valid and invalid values the coverage phase does not combine; 100 with
RELIABILITY_SOAK=full, as `make reliability` sets, for the rare combinations only
volume finds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import hypothesis
import orjson
import pytest
import requests
import schemathesis
from schemathesis import GenerationMode

from bridge.app import (
    default_app,
    mounted_routes,
    router_method_rules,
    text_turn_app,
    trusted_bridge_app,
)
from bridge.auth import AuthSettings
from bridge.openapi import build_openapi

THEME = "Fuzzing from the contract"
SEED = 20261122
TOKEN = "fuzz-token-7d0c"
FULL = os.environ.get("RELIABILITY_SOAK", "").lower() == "full"
EXAMPLES = int(os.environ.get("RELIABILITY_FUZZ_EXAMPLES", "100" if FULL else "5"))
PRESETS: dict[str, Callable[..., Any]] = {
    "trusted": trusted_bridge_app,
    "default": default_app,
    "text-turn": text_turn_app,
}
#: Small limits, so that what the fuzzer starts is bounded and cleaned up quickly.
BRIDGE_ENV = {
    "REST_ADAPTER_MAX_SESSIONS": "6",
    "REST_ADAPTER_SESSION_IDLE_TIMEOUT_MS": "2000",
    "REST_ADAPTER_MAX_WAIT_MS": "200",
    "REST_ADAPTER_SSE_KEEPALIVE_MS": "100",
    "REST_ADAPTER_CALL_TIMEOUT_MS": "5000",
    "REST_ADAPTER_TEXT_TURN_TIMEOUT_MS": "10000",
    "REST_ADAPTER_SPAWN_TIMEOUT_MS": "5000",
    "REST_ADAPTER_SHUTDOWN_GRACE_MS": "400",
}
GATEWAY_KINDS = {
    502: {"app_server_error", "app_server_exited", "app_server_spawn_failed", "protocol_error"},
    503: {"app_server_overloaded"},
    504: {"timeout"},
}


def document(preset: str, auth: bool) -> dict[str, Any]:
    app = PRESETS[preset](["fake-codex", "app-server"], None, None)
    settings = AuthSettings(exempt_health=True) if auth else None
    return build_openapi(mounted_routes(app), auth=settings, method_rules=router_method_rules(app))


@schemathesis.check
def no_internal_error(ctx: Any, response: Any, case: Any) -> None:
    """No 500, and a gateway status only with its documented kinds."""
    status = response.status_code
    if status < 500:
        return
    kind = orjson.loads(response.content).get("error") if response.content else None
    if status == 500 or kind not in GATEWAY_KINDS.get(status, set()):
        raise AssertionError(f"{status} {kind}: {response.content[:300]!r}")


@schemathesis.check
def error_payload(ctx: Any, response: Any, case: Any) -> None:
    """Every error body is exactly {error, message, code?, data?}."""
    if response.status_code < 400:
        return
    body = orjson.loads(response.content)
    assert isinstance(body, dict), body
    assert set(body) <= {"error", "message", "code", "data"}, body
    assert isinstance(body.get("error"), str), body
    assert body["error"]
    assert isinstance(body.get("message"), str), body
    assert body.get("code") is None or isinstance(body["code"], int), body


def load(preset: str, auth: bool) -> Any:
    schema = schemathesis.openapi.from_dict(document(preset, auth))
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        max_examples=EXAMPLES,
        deterministic=True,
        database="none",
    )
    schema.config.seed = SEED
    schema.config.update(request_timeout=30)
    schema.config.max_stream_events = 5
    return schema


def bridge_group(preset: str, auth: bool) -> pytest.MarkDecorator:
    """The xdist group of the tests on one preset's bridge in one auth mode.

    One worker runs them in order: each operation's fuzzing on the one bridge, then the
    check that the same bridge serves the fuzzed document and ends clean. Six bridges, six
    groups: the workers share the fuzzing out instead of one worker running all of it.
    """
    return pytest.mark.xdist_group(f"fuzz-{preset}-auth-{'on' if auth else 'off'}")


def fuzz_test(preset: str, auth: bool) -> Callable[..., None]:
    schema = load(preset, auth)

    # The parametrization names each item: pytest 9 builds an unparametrized item's id
    # from its original name, which schemathesis sets to the bare function name, so the
    # operation label would otherwise be lost and every operation share one node id.
    @bridge_group(preset, auth)
    @pytest.mark.parametrize("examples", [EXAMPLES], ids=[f"{EXAMPLES} examples"])
    @schema.parametrize()
    @hypothesis.settings(
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        print_blob=False,
    )
    def test(case: Any, shared_bridge_process: Any, report: Any, examples: int) -> None:
        served = shared_bridge_process(preset=preset, token=TOKEN if auth else None, env=BRIDGE_ENV)
        report.case = f"{preset} preset, auth {'on' if auth else 'off'}: {case.operation.label}"
        headers = {"Authorization": f"Bearer {TOKEN}"} if auth else {}
        try:
            response = case.call(base_url=served.base, headers=headers, timeout=30)
        except requests.exceptions.ConnectionError as exc:
            raise AssertionError(f"the bridge dropped the connection: {exc}") from None
        figures = report.figures
        figures["cases"] = figures.get("cases", 0) + 1
        statuses = figures.setdefault("statuses", {})
        statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1
        case.validate_response(
            response,
            headers=headers,
            excluded_checks=[schemathesis.checks.not_a_server_error],
            additional_checks=[no_internal_error, error_payload],
        )
        report.survived = report.nothing_lost = True
        report.outcome = "every response documented, schema-valid, errors the spec's payload"

    return test


test_trusted_auth_off = fuzz_test("trusted", False)
test_trusted_auth_on = fuzz_test("trusted", True)
test_default_auth_off = fuzz_test("default", False)
test_default_auth_on = fuzz_test("default", True)
test_text_turn_auth_off = fuzz_test("text-turn", False)
test_text_turn_auth_on = fuzz_test("text-turn", True)


@pytest.mark.parametrize(
    ("auth", "preset"),
    [
        pytest.param(auth, preset, marks=bridge_group(preset, auth), id=f"auth {mode}-{preset}")
        for auth, mode in ((False, "off"), (True, "on"))
        for preset in PRESETS
    ],
)
def test_served_document_is_the_one_fuzzed_and_the_bridge_ends_clean(
    shared_bridge_process, report, preset, auth
):
    """The served /v1/openapi.json is the fuzzed one; afterwards nothing is left"""
    served = shared_bridge_process(preset=preset, token=TOKEN if auth else None, env=BRIDGE_ENV)
    headers = {"Authorization": f"Bearer {TOKEN}"} if auth else {}
    served_document = requests.get(served.base + "/v1/openapi.json", headers=headers, timeout=10)
    assert served_document.json() == document(preset, auth)
    if "/v1/sessions" in served_document.json()["paths"]:
        listing = requests.get(served.base + "/v1/sessions", headers=headers, timeout=10).json()
        for summary in listing["sessions"]:
            deleted = requests.delete(
                f"{served.base}/v1/sessions/{summary['sessionId']}", headers=headers, timeout=30
            )
            assert deleted.status_code in (200, 404)
    served.signal(__import__("signal").SIGTERM)
    assert served.wait(30) == 0, served.output
    assert served.resources.processes() == frozenset()
    assert "Traceback" not in served.output
    report.survived = report.nothing_lost = report.no_leak = True
    report.outcome = "same document; after the fuzzing: exit 0, no process left, no traceback"


def test_every_generated_case_has_a_node_id_of_its_own(request, report):
    """Each operation of each preset and auth mode is an item with a node id of its own

    One collection of the module (it builds every schema) serves a second check: each
    bridge's tests are one xdist group of their own, and the check that the bridge ends
    clean comes after its fuzzing there (else it would start a fresh bridge, on whatever
    worker, and check that one).
    """

    def items(node: pytest.Collector) -> list[pytest.Item]:
        found: list[pytest.Item] = []
        for child in node.collect():
            found += [child] if isinstance(child, pytest.Item) else items(child)
        return found

    # This module collected afresh, whatever `-k` or `--lf` selected this run.
    collected = items(request.node.parent)
    ids = [item.nodeid for item in collected]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})[:5]
    operations = 0
    for preset in PRESETS:
        for auth in (False, True):
            paths = document(preset, auth)["paths"].values()
            operations += sum(len(methods) for methods in paths)
    generated = [i for i in ids if "_auth_o" in i.split("::", 1)[1].split("[", 1)[0]]
    assert len(generated) == operations
    assert_each_bridge_is_fuzzed_then_checked_in_its_group(collected)
    report.survived = report.nothing_lost = report.no_leak = True
    report.figures["items"] = len(ids)
    report.outcome = (
        "unique node ids, one per operation (so -k, --lf, xdist and the progress count see each)"
    )


def assert_each_bridge_is_fuzzed_then_checked_in_its_group(items: list[pytest.Item]) -> None:
    def group(item: pytest.Item) -> str | None:
        marker = item.get_closest_marker("xdist_group")
        return str(marker.args[0]) if marker is not None and marker.args else None

    order = {item.nodeid: index for index, item in enumerate(items)}
    checks = [i for i in items if i.name.startswith("test_served_document_is_the_one_fuzzed")]
    assert len(checks) == len(PRESETS) * 2
    groups = set()
    for check in checks:
        preset, auth = check.callspec.params["preset"], check.callspec.params["auth"]
        fuzzed = [i for i in items if i.name.startswith(f"test_{preset.replace('-', '_')}_auth_")]
        fuzzed = [i for i in fuzzed if ("_auth_on" in i.name) == auth]
        assert fuzzed, check.nodeid
        assert group(check) is not None, check.nodeid
        assert {group(i) for i in fuzzed} == {group(check)}, check.nodeid
        assert max(order[i.nodeid] for i in fuzzed) < order[check.nodeid], check.nodeid
        groups.add(group(check))
    assert len(groups) == len(checks)
