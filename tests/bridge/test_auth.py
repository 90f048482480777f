"""Bearer authentication, exactly spec section 5."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from multidict import CIMultiDict

from bridge.app import backend_app
from bridge.auth import BearerToken, presented_token, with_bearer_auth
from bridge.backend import Backend
from bridge.models import Compatibility

pytestmark = pytest.mark.quick

TOKEN = "s3cret-token-value"
UNAUTHORIZED = {
    "error": "unauthorized",
    "message": "A valid `Authorization: Bearer <token>` header is required.",
}


class CountingBackend(Backend):
    """A host backend that counts the calls that reach it."""

    def __init__(self) -> None:
        self.calls = 0

    async def compatibility(self) -> Compatibility:
        self.calls += 1
        return Compatibility.model_validate(
            {
                "bridgeVersion": "test",
                "appServer": {"command": ["x"], "version": "v", "versionError": None},
            }
        )

    async def list_sessions(self):
        self.calls += 1
        return []


@pytest.fixture
def protected(serve):
    async def start(exempt_health: bool = True):
        backend = CountingBackend()
        app = with_bearer_auth(backend_app(backend), TOKEN, exempt_health=exempt_health)
        return await serve(app), backend

    return start


REJECTED_HEADERS = {
    "missing": None,
    "basic": f"Basic {TOKEN}",
    "no space": f"Bearer{TOKEN}",
    "wrong token": "Bearer not-the-token",
    "empty token": "Bearer ",
    "only spaces": "Bearer     ",
    "right prefix, longer": f"Bearer {TOKEN}x",
    "right prefix, shorter": f"Bearer {TOKEN[:-1]}",
    "scheme only": "Bearer",
    "token as scheme": TOKEN,
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(REJECTED_HEADERS))
async def test_every_rejection_is_identical_and_never_reaches_the_router(protected, http, case):
    base, backend = await protected()
    header = REJECTED_HEADERS[case]
    headers = {"Authorization": header} if header is not None else {}
    for path in ("/v1/compatibility", "/v1/sessions", "/v1/no-such-route"):
        async with http.get(base + path, headers=headers) as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert await response.json() == UNAUTHORIZED
    assert backend.calls == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "header",
    [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer    {TOKEN}   "],
)
async def test_accepted_variants(protected, http, header):
    base, backend = await protected()
    async with http.get(base + "/v1/compatibility", headers={"Authorization": header}) as response:
        assert response.status == 200
    assert backend.calls == 1


@pytest.mark.asyncio
async def test_health_is_exempt_by_default_and_compatibility_is_not(protected, http):
    base, _ = await protected()
    for path in ("/health", "/v1/health"):
        async with http.get(base + path) as response:
            assert response.status == 200
    async with http.get(base + "/v1/compatibility") as response:
        assert response.status == 401


@pytest.mark.asyncio
async def test_only_the_exact_health_paths_are_exempt(protected, http):
    base, _ = await protected()
    for path in ("/health/", "/v1/health/x", "/v1/openapi.json"):
        async with http.get(base + path) as response:
            assert response.status == 401, path
    async with http.post(base + "/health") as response:
        assert response.status == 401


@pytest.mark.asyncio
async def test_health_needs_the_token_when_not_exempt(protected, http):
    base, _ = await protected(exempt_health=False)
    for path in ("/health", "/v1/health"):
        async with http.get(base + path) as response:
            assert response.status == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with http.get(base + path, headers=auth) as response:
            assert response.status == 200


@pytest.mark.parametrize("token", ["", " ", "\t\n "])
def test_blank_token_is_refused_at_construction(token):
    with pytest.raises(ValueError, match="empty or blank"):
        with_bearer_auth(backend_app(CountingBackend()), token)


@pytest.mark.parametrize(
    ("token", "problem"),
    [("  tok  ", "leading or trailing whitespace"), ("tok\n", "whitespace"), ("a\x00b", "control")],
)
def test_a_token_no_header_can_carry_is_refused_at_construction(token, problem):
    with pytest.raises(ValueError, match=problem):
        with_bearer_auth(backend_app(CountingBackend()), token)


@pytest.mark.asyncio
async def test_two_authorization_headers_are_refused(protected, http):
    base, _ = await protected()
    good, bad = f"Bearer {TOKEN}", "Bearer nope"
    for pair in ((good, bad), (bad, good), (good, good)):
        headers = CIMultiDict([("Authorization", pair[0]), ("Authorization", pair[1])])
        async with http.get(base + "/v1/sessions", headers=headers) as response:
            assert response.status == 401, pair


def test_header_parsing_splits_at_the_first_space_and_trims():
    assert presented_token("Bearer  abc  ") == "abc"
    assert presented_token("bearer a b") == "a b"
    assert presented_token("Basic abc") == ""
    assert presented_token("Bearerabc") == ""
    assert presented_token(None) == ""


def test_token_never_shows_in_repr():
    assert TOKEN not in repr(BearerToken(TOKEN))


@pytest.mark.asyncio
async def test_token_never_appears_in_logs(protected, http, caplog):
    caplog.set_level(logging.DEBUG)
    base, _ = await protected()
    for header in (f"Bearer {TOKEN}", f"Bearer {TOKEN}x", TOKEN):
        async with http.get(base + "/v1/sessions", headers={"Authorization": header}):
            pass
    assert TOKEN not in caplog.text


@pytest.mark.asyncio
async def test_auth_is_one_middleware_and_coexists_with_a_hosts(serve, http):
    """The token is checked by one middleware, outermost, and errors are rendered by the
    bridge's own; a host's middleware around them sees every answer, 401, 404 and 405
    included, and a token set on an application of the host's own is the same one
    middleware."""
    from aiohttp import web

    seen: list[tuple[str, int]] = []

    @web.middleware
    async def host_layer(request, handler):
        response = await handler(request)
        seen.append((request.path, response.status))
        return response

    app = with_bearer_auth(backend_app(CountingBackend()), TOKEN)
    assert len(app.middlewares) == 2  # the token's, then the bridge's own
    app.middlewares.insert(0, host_layer)
    base = await serve(app)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with http.put(base + "/v1/compatibility") as response:
        assert response.status == 401
    async with http.put(base + "/v1/compatibility", headers=auth) as response:
        assert response.status == 405
        assert response.headers["Allow"] == "GET"
        assert (await response.json())["error"] == "method_not_allowed"
    async with http.get(base + "/v1/nothing/here", headers=auth) as response:
        assert response.status == 404
        assert await response.json() == {"error": "not_found", "message": "No such route."}
    assert seen == [
        ("/v1/compatibility", 401),
        ("/v1/compatibility", 405),
        ("/v1/nothing/here", 404),
    ]

    async def hello(request):
        return web.json_response({"hello": True})

    foreign = web.Application()
    foreign.router.add_get("/hello", hello)
    with_bearer_auth(foreign, TOKEN)
    assert len(foreign.middlewares) == 1
    other = await serve(foreign)
    async with http.get(other + "/hello") as response:
        assert response.status == 401
        assert await response.json() == UNAUTHORIZED
    async with http.get(other + "/hello", headers=auth) as response:
        assert await response.json() == {"hello": True}


#: Paths whose values hold a decoded line feed or carriage return (`%0A`, `%0D`): once
#: matched by no route, not even the last one, and answered by aiohttp in plain text.
LINE_BREAK_PATHS = {
    "POST /v1/sessions/x%0A": (405, "method_not_allowed"),
    "POST /v1/call/a%0Ab": (None, None),  # a call for method "a\nb": the backend's answer
    "POST /v1/sessions/s/requests/k%0A/result": (None, None),
    "POST /v1/sessions/x%0A/events": (405, "method_not_allowed"),
    "GET /v1/nothing%0A": (404, "not_found"),
    "GET /v1/sessions/x%0D%0A/events": (None, None),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("request_line", list(LINE_BREAK_PATHS))
async def test_a_line_break_in_a_path_is_routed_like_any_character(protected, request_line):
    base, backend = await protected()
    host, port = base.removeprefix("http://").split(":")
    status, kind = LINE_BREAK_PATHS[request_line]
    for auth in ("", f"Authorization: Bearer {TOKEN}\r\n"):
        reader, writer = await asyncio.open_connection(host, int(port))
        head = f"{request_line} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 2\r\n"
        writer.write(f"{head}Connection: close\r\n\r\n{{}}".encode())
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        head_bytes, _, body = answer.partition(b"\r\n\r\n")
        assert b"application/json" in head_bytes, answer
        payload = json.loads(body)
        if not auth:  # 401 before any 404 or 405, as for every other path
            assert answer.startswith(b"HTTP/1.1 401 "), answer
            assert payload["error"] == "unauthorized"
        elif status is not None:
            assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer
            assert payload["error"] == kind
        else:
            assert set(payload) <= {"error", "message", "data"}, payload
    assert backend.calls == 0
