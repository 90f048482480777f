"""The respx mock built from each preset's OpenAPI document: one route per operation,
schema-valid examples, the bridge's own 400, 401 and 403, overrides per operationId."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from bridge import errors
from bridge.app import ROUTES
from bridge.auth import AuthSettings
from bridge.models import EventResponse
from bridge.openapi import build_openapi
from scenarios.mock_bridge import PRESETS, preset_document
from scenarios.openapi_check import OpenApiChecker
from scenarios.respx_mock import UnmatchedRequest, openapi_router

TOKEN = "t0k3n-for-the-mock"

#: A valid request for each operation: path parameters and body.
VALID: dict[str, tuple[dict[str, str], Any]] = {
    "text_turn": ({}, {"text": "hi", "includeEvents": True}),
    "call": ({"method": "model/list"}, {"params": {}}),
    "create_session": ({}, {"options": {"clientInfo": {"name": "host", "version": "1.0"}}}),
    "session_call": ({"sessionId": "s-1", "method": "thread/start"}, {"params": {}}),
    "reply_result": ({"sessionId": "s-1", "requestKey": "0"}, {"result": {"decision": "accept"}}),
    "reply_error": ({"sessionId": "s-1", "requestKey": "0"}, {"code": -32000, "message": "no"}),
}


def _operations(document: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (method.upper(), path, op["operationId"])
        for path, methods in document["paths"].items()
        for method, op in methods.items()
    ]


def _url(path: str, params: dict[str, str]) -> str:
    defaults = {"sessionId": "s-1", "requestKey": "0", "method": "thread/start", **params}
    for name, value in defaults.items():
        path = path.replace("{" + name + "}", value)
    return path


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-auth", "bearer"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_operation_answers_a_schema_valid_example(preset: str, token: str | None) -> None:
    document = preset_document(preset, token=token)
    checker = OpenApiChecker(document)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with openapi_router(preset, token=token) as bridge:
        assert bridge.document == document
        client = httpx.Client(base_url=bridge.base_url, headers=headers)
        for method, path, name in _operations(document):
            params, body = VALID.get(name, ({}, None))
            url = _url(path, params)
            kwargs = {"json": body} if body is not None else {}
            response = client.request(method, url, **kwargs)
            documented = sorted(
                int(code) for code in document["paths"][path][method.lower()]["responses"]
            )
            success = next(code for code in documented if code < 300)
            assert response.status_code == success, (name, response.text)
            content_type = response.headers["Content-Type"]
            streaming = content_type.startswith("text/event-stream")
            checker.check(method, url, response.status_code, content_type, response.content)
            if streaming:
                data = [line[6:] for line in response.text.splitlines() if line[:6] == "data: "]
                events = [EventResponse.model_validate_json(item) for item in data]
                assert [event.kind for event in events] == ["notification", "exit"]
    assert checker.checked == len(document["paths"]) + sum(
        len(methods) - 1 for methods in document["paths"].values()
    )


def test_examples_look_like_the_bridges_answers() -> None:
    with openapi_router("trusted") as bridge:
        client = httpx.Client(base_url=bridge.base_url)
        assert client.get("/health").json()["status"] == "ok"
        assert client.get("/v1/openapi.json").json() == bridge.document
        created = client.post("/v1/sessions", json=VALID["create_session"][1])
        assert created.json()["initialize"]["userAgent"].startswith("host/")
        thread = client.post("/v1/sessions/s-9/call/thread%2Fstart", json={"params": {}})
        assert thread.json()["result"]["thread"]["id"]
        deleted = client.delete("/v1/sessions/s-9")
        assert deleted.json() == {"status": "deleted", "sessionId": "s-9"}
        event = client.get("/v1/sessions/s-9/events", params={"after": 41}).json()
        assert event["seq"] == 42
        turn = client.post("/v1/text-turn", json={"text": "hello"}).json()
        assert turn["text"] == "Hello from fake-codex. You said: hello"


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [
        ("/v1/sessions", {"options": {"bogus": 1}}, "bad_request"),
        ("/v1/text-turn", {"text": ""}, "bad_request"),
        ("/v1/text-turn", b"{not json", "bad_request"),
        ("/v1/sessions/s-1/requests/0/error", {"code": "x", "message": "m"}, "bad_request"),
    ],
)
@pytest.mark.asyncio
async def test_an_invalid_body_gets_exactly_the_bridges_400(
    codex_start_bridge: Any, path: str, body: Any, kind: str
) -> None:
    bridge = await codex_start_bridge(check_script=False)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    async with bridge.client().post(path, data=content, headers=headers) as response:
        real = (response.status, await response.json())
    with openapi_router("trusted") as mock:
        async with httpx.AsyncClient(base_url=mock.base_url) as client:
            mocked = await client.post(path, content=content, headers=headers)
    assert real[0] == 400
    assert (mocked.status_code, mocked.json()) == real
    assert mocked.json()["error"] == kind


def test_auth_without_the_right_bearer_is_the_bridges_401() -> None:
    with openapi_router("trusted", token=TOKEN) as bridge:
        client = httpx.Client(base_url=bridge.base_url)
        assert client.get("/health").status_code == 200
        assert client.get("/v1/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic eDp5"}):
            response = client.get("/v1/compatibility", headers=headers)
            assert response.status_code == 401
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert response.json() == errors.unauthorized().payload()
        rejected = client.post("/v1/sessions", json={"bogus": True})
        assert rejected.status_code == 401  # auth first, as the bridge's layer does
        ok = client.get("/v1/compatibility", headers={"Authorization": f"bearer  {TOKEN} "})
        assert ok.status_code == 200
    with openapi_router("text-turn", token=TOKEN, exempt_health=False) as bridge:
        assert httpx.get(f"{bridge.base_url}/health").status_code == 401


def test_the_default_preset_refuses_options_and_mounts_no_sessionless_calls() -> None:
    with openapi_router("default") as bridge:
        client = httpx.Client(base_url=bridge.base_url)
        refused = client.post("/v1/sessions", json={"options": {"env": {"X": "1"}}})
        assert refused.status_code == 403
        assert refused.json() == errors.options_not_allowed(["env"]).payload()
        with pytest.raises(UnmatchedRequest) as raised:
            client.post("/v1/call/model/list", json={})
    message = str(raised.value)
    assert message.startswith(
        "no route of the mocked bridge matches POST http://bridge.test/v1/call/model/list"
    )
    assert "  POST http://bridge.test/v1/sessions (create_session)" in message
    assert "/v1/call/{method}" not in message


def test_overrides_per_operation_id() -> None:
    seen: list[tuple[str, str]] = []

    def call(request: httpx.Request, sessionId: str, method: str) -> Any:
        seen.append((sessionId, method))
        return {"result": {"echo": json.loads(request.content)["params"]}}

    overrides = {
        "list_sessions": {"sessions": []},
        "create_session": httpx.Response(429, json=errors.session_limit_reached(2).payload()),
        "session_call": call,
    }
    with openapi_router("trusted", overrides=overrides) as bridge:
        client = httpx.Client(base_url=bridge.base_url)
        assert client.get("/v1/sessions").json() == {"sessions": []}
        assert client.post("/v1/sessions", json={}).status_code == 429
        echoed = client.post("/v1/sessions/s-2/call/thread/start", json={"params": {"a": 1}})
        assert echoed.json() == {"result": {"echo": {"a": 1}}}
        # The front still checks what it would check: a bad body never reaches an override.
        assert client.post("/v1/sessions/s-2/call/x", json={"bogus": 1}).status_code == 400
    assert seen == [("s-2", "thread/start")]
    with pytest.raises(ValueError, match="unknown operations"):
        openapi_router("text-turn", overrides={"list_sessions": {}})


@pytest.mark.asyncio
async def test_a_document_given_as_such_and_async_clients() -> None:
    routes = [route for route in ROUTES if route.name in ("v1_health", "create_session")]
    document = build_openapi(routes, auth=AuthSettings(exempt_health=True))
    with pytest.raises(ValueError, match="requires a bearer token"):
        openapi_router(document)
    with openapi_router(document, token=TOKEN, base_url="http://mock.test:8787") as bridge:
        async with httpx.AsyncClient(base_url=bridge.base_url) as client:
            assert (await client.get("/v1/health")).status_code == 200
            anonymous = await client.post("/v1/sessions", json={})
            assert anonymous.status_code == 401
            auth = {"Authorization": f"Bearer {TOKEN}"}
            created = await client.post("/v1/sessions", json={}, headers=auth)
            assert created.status_code == 201
            with pytest.raises(UnmatchedRequest, match=r"GET http://mock\.test:8787/health"):
                await client.get("/health")


def test_assert_all_called_names_the_operations_never_called() -> None:
    bridge = openapi_router("text-turn", assert_all_called=True)
    bridge.start()
    httpx.get(f"{bridge.base_url}/health")
    with pytest.raises(AssertionError) as raised:
        bridge.stop()
    message = str(raised.value)
    assert "4 route(s) never called" in message
    assert "POST http://bridge.test/v1/text-turn (text_turn)" in message
    assert "(health)" not in message
