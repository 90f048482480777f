"""Router presets: exact route sets, options policies, and the OpenAPI document."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from openapi_spec_validator import validate

from bridge.app import (
    ROUTES,
    backend_app,
    default_app,
    mounted_routes,
    router_method_rules,
    text_turn_app,
    trusted_bridge_app,
)
from bridge.auth import AuthSettings, with_bearer_auth
from bridge.backend import Backend
from bridge.openapi import build_openapi, openapi_path

SPEC_ROUTES = {
    ("GET", "/health"),
    ("GET", "/v1/health"),
    ("GET", "/v1/compatibility"),
    ("POST", "/v1/text-turn"),
    ("POST", "/v1/call/{method}"),
    ("GET", "/v1/sessions"),
    ("POST", "/v1/sessions"),
    ("DELETE", "/v1/sessions/{sessionId}"),
    ("POST", "/v1/sessions/{sessionId}/call/{method}"),
    ("GET", "/v1/sessions/{sessionId}/events"),
    ("GET", "/v1/sessions/{sessionId}/events/stream"),
    ("POST", "/v1/sessions/{sessionId}/requests/{requestKey}/result"),
    ("POST", "/v1/sessions/{sessionId}/requests/{requestKey}/error"),
}
OPENAPI_ROUTE = {("GET", "/v1/openapi.json")}
TEXT_TURN = {
    ("GET", "/health"),
    ("GET", "/v1/health"),
    ("GET", "/v1/compatibility"),
    ("POST", "/v1/text-turn"),
}

PRESETS = {
    "trusted": (lambda cmd: trusted_bridge_app(cmd), SPEC_ROUTES),
    "text-turn": (lambda cmd: text_turn_app(cmd), TEXT_TURN),
    "default": (lambda cmd: default_app(cmd), SPEC_ROUTES - {("POST", "/v1/call/{method}")}),
    "backend": (lambda cmd: backend_app(Backend()), SPEC_ROUTES),
}


def route_set(app):
    return {(r.method, openapi_path(r.path)) for r in mounted_routes(app)}


def served_routes(app):
    """What the application's router serves (HEAD on the health routes included)."""
    return {
        (r.method, openapi_path(r.resource.canonical))
        for r in app.router.routes()
        if r.method != "*" and r.resource is not None
    }


def concrete(path: str) -> str:
    return (
        path.replace("{method}", "thread/start")
        .replace("{sessionId}", "s1")
        .replace("{requestKey}", "0")
    )


@pytest.mark.quick
@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_mounts_exactly_its_routes(preset, fake_codex):
    factory, expected = PRESETS[preset]
    assert route_set(factory(fake_codex)) == expected | OPENAPI_ROUTE


@pytest.mark.quick
@pytest.mark.asyncio
@pytest.mark.parametrize("preset", list(PRESETS))
async def test_routes_a_preset_does_not_mount_are_404_with_the_payload(
    preset, fake_codex, serve, http
):
    factory, expected = PRESETS[preset]
    base = await serve(factory(fake_codex))
    for method, path in SPEC_ROUTES - expected:
        async with http.request(method, base + concrete(path), json={}) as response:
            assert response.status in (404, 405), (method, path)
            body = await response.json()
            assert body["error"] in ("not_found", "method_not_allowed")


@pytest.mark.asyncio
async def test_conservative_preset_refuses_process_shaping_options(fake_codex, serve, http):
    base = await serve(default_app(fake_codex))
    for field, value in [
        ("cwd", "/"),
        ("env", {"A": "b"}),
        ("configOverrides", ["model=x"]),
        ("experimentalApi", True),
    ]:
        async with http.post(f"{base}/v1/sessions", json={"options": {field: value}}) as response:
            assert response.status == 403, field
            body = await response.json()
            assert body["error"] == "options_not_allowed"
            assert body["data"] == {"fields": [field]}
    allowed = {"clientInfo": {"name": "host", "version": "1.0"}, "optOutNotificationMethods": []}
    async with http.post(f"{base}/v1/sessions", json={"options": allowed}) as response:
        assert response.status == 201


@pytest.mark.quick
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("auth", [False, True])
def test_openapi_document_is_valid_and_in_step_with_the_routes(preset, auth, fake_codex):
    app = PRESETS[preset][0](fake_codex)
    settings = AuthSettings(exempt_health=True) if auth else None
    document = build_openapi(
        mounted_routes(app), auth=settings, method_rules=router_method_rules(app)
    )
    validate(document)
    assert document["openapi"] == "3.1.0"
    documented = {
        (method.upper(), path)
        for path, operations in document["paths"].items()
        for method in operations
    }
    assert documented == served_routes(app)
    heads = {(m, p) for m, p in documented if m == "HEAD"}
    assert heads == {("HEAD", "/health"), ("HEAD", "/v1/health")} & documented
    assert ("bearerAuth" in document["components"].get("securitySchemes", {})) is auth


@pytest.mark.quick
@pytest.mark.asyncio
async def test_openapi_is_served_with_bearer_scheme_exactly_when_auth_is_on(
    fake_codex, serve, http
):
    plain = await serve(trusted_bridge_app(fake_codex))
    async with http.get(f"{plain}/v1/openapi.json") as response:
        document = await response.json()
    assert "securitySchemes" not in document["components"]
    protected = await serve(with_bearer_auth(trusted_bridge_app(fake_codex), "tok"))
    async with http.get(
        f"{protected}/v1/openapi.json", headers={"Authorization": "Bearer tok"}
    ) as response:
        document = await response.json()
    validate(document)
    assert document["components"]["securitySchemes"] == {
        "bearerAuth": {"type": "http", "scheme": "bearer"}
    }
    assert document["paths"]["/health"]["get"]["security"] == []
    assert "401" in document["paths"]["/v1/compatibility"]["get"]["responses"]


@pytest.mark.quick
def test_route_table_covers_every_route_of_the_spec():
    assert {(r.method, openapi_path(r.path)) for r in ROUTES} == SPEC_ROUTES | OPENAPI_ROUTE


def test_openapi_into_a_pipe_whose_reader_is_gone_exits_quietly() -> None:
    """`rest-bridge openapi | head`: no BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte is written
    try:
        done = subprocess.run(
            [str(Path(sys.executable).with_name("rest-bridge")), "openapi"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")
