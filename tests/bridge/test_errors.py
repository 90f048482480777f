"""The error table (bridge.errors.ERROR_KINDS): the constructors, the OpenAPI document
and docs/API.md's error table all agree with it."""

import re
from pathlib import Path

import pytest

from bridge import errors
from bridge.app import mounted_routes, trusted_bridge_app
from bridge.errors import ERROR_KINDS, error_kind
from bridge.openapi import build_openapi, status_description
from bridge.process.outcomes import rpc_failure
from bridge.process.peer import RpcError

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "API.md"

#: One call of each constructor.
CONSTRUCTED = [
    errors.bad_request("x"),
    errors.unauthorized(),
    errors.of_kind("options_not_allowed", "x", data={"fields": ["cwd"]}),
    errors.reserved_variables(["REST_ADAPTER_TOKEN"]),
    errors.of_kind("not_found"),
    errors.session_not_found("s"),
    errors.request_not_found("1"),
    errors.method_not_allowed("PUT", {"GET"}),
    errors.method_refused("fs/readFile"),
    errors.method_refused("thread/start", ["config"]),
    errors.session_exited("s"),
    errors.of_kind("request_already_answered", "x"),
    errors.request_timeout(5),
    errors.of_kind("unsupported_media_type", "x"),
    errors.payload_too_large(5),
    errors.of_kind("session_limit_reached", "x"),
    errors.of_kind("busy", "x"),
    rpc_failure(RpcError(-32000, "x"), "x"),
    rpc_failure(RpcError(-32001, "x"), "x"),
    errors.of_kind("app_server_exited", "x"),
    errors.of_kind("app_server_spawn_failed", "x"),
    errors.of_kind("protocol_error", "x"),
    errors.of_kind("timeout", "x"),
    errors.of_kind("internal_error"),
    errors.of_kind("expectation_failed"),
]


def test_each_kind_is_at_most_once_at_a_status():
    keys = [(e.status, e.kind) for e in ERROR_KINDS]
    assert len(keys) == len(set(keys))
    for entry in ERROR_KINDS:
        assert entry.description
        assert "\n" not in entry.description


@pytest.mark.parametrize("error", CONSTRUCTED, ids=lambda e: f"{e.status} {e.kind}")
def test_a_constructor_gives_its_rows_status_and_headers(error):
    entry = error_kind(error.kind, error.status)
    assert ("Retry-After" in error.headers) is entry.retry_after
    if entry.closes_connection:
        assert error.close_connection
    if entry.message is not None:
        assert error.message == entry.message


def test_every_kind_the_bridge_raises_is_a_row():
    """What the constructors do not build is built where it is raised: those too."""
    rows = {(e.status, e.kind) for e in ERROR_KINDS}
    raised = {(e.status, e.kind) for e in CONSTRUCTED}
    call = re.compile(r'RestError\(\s*(\d{3}),\s*"([a-z_]+)"')
    for source in sorted((ROOT / "bridge").rglob("*.py")):
        for status, kind in call.findall(source.read_text(encoding="utf-8")):
            raised.add((int(status), kind))
    assert raised <= rows, raised - rows


def test_aiohttp_exceptions_become_the_tables_kinds():
    for status, kind in errors.HTTP_EXCEPTION_KINDS.items():
        assert error_kind(kind, status).for_http_exception


def test_the_openapi_document_describes_each_status_from_the_table():
    """503 included: `replica_unavailable` beside `app_server_overloaded`."""
    app = trusted_bridge_app(["fake-codex"])
    document = build_openapi(mounted_routes(app))
    described: dict[str, str] = {}
    for operations in document["paths"].values():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                expected = status_description(int(status))
                if response.get("content", {}).get("application/json", {}).get("schema") != {
                    "$ref": "#/components/schemas/ErrorPayload"
                } or response["description"].startswith("App-server method refused"):
                    continue  # a success, or the method policy's 403 (its routes only)
                assert response["description"].startswith(expected), (status, response)
                described[status] = response["description"]
    for entry in ERROR_KINDS:
        if entry.on_every_route and str(entry.status) in described:
            assert f"`{entry.kind}`" in described[str(entry.status)], entry
    assert "`replica_unavailable`" in described["503"]


def documented_errors() -> dict[tuple[int, str], str]:
    """(status, kind) → the Extras cell of each row of docs/API.md's error table."""
    text = API.read_text(encoding="utf-8")
    section = text[text.index("\n## Errors\n") :]
    section = section[: section.index("\n## ", 1)]
    rows: dict[tuple[int, str], str] = {}
    for line in section.splitlines():
        match = re.match(r"\| (\d{3}) \| `([a-z_]+)` \|", line)
        if match:
            key = (int(match[1]), match[2])
            assert key not in rows, f"{key} has two rows"
            rows[key] = line.rstrip().rstrip("|").rsplit("|", 1)[1]
    return rows


def test_the_docs_error_table_is_the_tables_rows():
    documented = documented_errors()
    rows = {(e.status, e.kind): e for e in ERROR_KINDS if not e.front_only}
    assert set(documented) - set(rows) == set(), "docs rows that are no kind"
    assert set(rows) - set(documented) == set(), "kinds without a docs row"
    for key, extras in documented.items():
        assert ("Retry-After" in extras) is rows[key].retry_after, key
        assert ("connection closed" in extras) is rows[key].closes_connection, key


def test_the_docs_name_what_only_the_front_answers():
    text = " ".join(API.read_text(encoding="utf-8").split())
    for entry in ERROR_KINDS:
        if entry.front_only:
            assert f"{entry.status} `{entry.kind}`" in text, entry


def test_every_payload_the_front_answers_is_a_row():
    """nginx's own answers (rest-bridge front-config) are kinds of the table too."""
    from bridge.limits import RestLimits
    from bridge_ops.front import FrontSettings, Replica, render

    config = render([Replica("a", "h:1")], RestLimits(), FrontSettings(token_map="t.conf"))
    answered = re.findall(r"return (\d{3}) '\{\"error\":\"([a-z_]+)\"", config)
    rows = {(e.status, e.kind) for e in ERROR_KINDS}
    assert len(answered) > 10
    assert {(int(status), kind) for status, kind in answered} <= rows
    front_only = {(e.status, e.kind) for e in ERROR_KINDS if e.front_only}
    assert front_only <= {(int(status), kind) for status, kind in answered}


def test_of_kind_takes_the_status_and_headers_from_the_table():
    error = errors.of_kind("replica_unavailable", "draining")
    assert (error.status, error.kind, error.headers) == (
        503,
        "replica_unavailable",
        {"Retry-After": "1"},
    )
    assert errors.of_kind("method_not_allowed", "no", status=403).status == 403
    with pytest.raises(LookupError):
        errors.of_kind("method_not_allowed", "which status?")
    with pytest.raises(LookupError):
        errors.of_kind("no_such_kind", "x")
