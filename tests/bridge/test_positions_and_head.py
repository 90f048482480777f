"""Stream positions (``Last-Event-ID``, ``?after=``) read strictly, the ``exit`` event
always ending an open stream, and ``HEAD`` on the health routes."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from bridge.app import trusted_bridge_app
from bridge.auth import with_bearer_auth
from bridge.limits import RestLimits
from bridge.routes import MAX_QUERY_INT, parse_sse_position, plain_int
from scenarios.sse import SseReader

pytestmark = pytest.mark.asyncio

#: What int() reads as a number and the bridge does not: ASCII digits only.
NOT_PLAIN = ["\u0663", "\uff13", "+3", " 3", "3 ", "1_0", "-1", "", "0x10", "3.0", str(2**63)]


@pytest.fixture
def bridge(serve, fake_codex):
    async def start(token: str | None = None, **limits) -> str:
        app = trusted_bridge_app(fake_codex, RestLimits(**limits))
        if token is not None:
            with_bearer_auth(app, token)
        return await serve(app)

    return start


async def new_session(http, base) -> str:
    async with http.post(f"{base}/v1/sessions", json={}) as response:
        assert response.status == 201
        return str((await response.json())["sessionId"])


@pytest.mark.quick
@pytest.mark.parametrize("raw", NOT_PLAIN)
async def test_only_ascii_digits_are_a_position(raw):
    assert plain_int(raw) is None


@pytest.mark.quick
async def test_positions_up_to_the_largest_signed_64_bit_integer():
    assert plain_int("0") == 0
    assert plain_int("0042") == 42
    assert plain_int(str(MAX_QUERY_INT)) == MAX_QUERY_INT
    assert parse_sse_position(None, "\t7 ") == 7  # the header's surrounding blanks


@pytest.mark.parametrize("raw", NOT_PLAIN)
async def test_a_stream_position_not_in_ascii_digits_is_400(bridge, http, raw):
    base = await bridge()
    session = await new_session(http, base)
    url = f"{base}/v1/sessions/{session}/events/stream"
    async with http.get(url, params={"after": raw}) as response:
        assert response.status == 400
        assert (await response.json())["message"] == (
            "Query parameter 'after' must be a non-negative integer."
        )
    # Blanks around a header's value are not part of it (HTTP): " 3" is 3, "" no header.
    if raw.strip(" \t") == raw and raw:
        async with http.get(url, headers={"Last-Event-ID": raw}) as response:
            assert response.status == 400
            body = await response.json()
            assert body == {
                "error": "bad_request",
                "message": "Last-Event-ID must be a non-negative integer.",
            }
    # So is a long-poll's.
    async with http.get(f"{base}/v1/sessions/{session}/events", params={"after": raw}) as response:
        assert response.status == 400


async def test_two_positions_are_400(bridge, http):
    base = await bridge()
    session = await new_session(http, base)
    url = f"{base}/v1/sessions/{session}/events/stream"
    headers = CIMultiDict([("Last-Event-ID", "1"), ("Last-Event-ID", "2")])
    async with http.get(url, headers=headers) as response:
        assert response.status == 400
        assert (await response.json())["message"] == "Last-Event-ID must be sent at most once."
    async with http.get(f"{url}?after=1&after=2") as response:
        assert response.status == 400
        assert (await response.json())["error"] == "bad_request"


@pytest.mark.parametrize("position", [{"after": "1000000"}, {"Last-Event-ID": str(MAX_QUERY_INT)}])
async def test_a_stream_past_the_end_still_ends_with_the_exit_event(bridge, http, position):
    base = await bridge(sse_keepalive_ms=50)
    session = await new_session(http, base)
    url = f"{base}/v1/sessions/{session}/events/stream"
    params = {k: v for k, v in position.items() if k == "after"}
    headers = {k: v for k, v in position.items() if k != "after"}
    async with http.get(url, params=params, headers=headers) as response:
        assert response.status == 200
        reader = SseReader(response, comments=True)
        first = await reader.next()  # the stream is open: a keep-alive, nothing to send
        assert first is not None
        assert first.comment == "keep-alive"
        async with http.delete(f"{base}/v1/sessions/{session}") as deleted:
            assert deleted.status == 200
        frames = [f for f in await reader.rest() if f.comment is None]
    assert [f.event for f in frames] == ["exit"]
    assert int(frames[0].id) < 1000000


async def test_a_stream_opened_past_the_end_of_an_ended_session_is_a_json_error(bridge, http):
    """Not open before the exit: nothing is owed, the answer is the JSON error as before."""
    base = await bridge()
    session = await new_session(http, base)
    url = f"{base}/v1/sessions/{session}/events/stream"
    async with http.get(url, params={"after": "0"}) as response:
        reader = SseReader(response)
        async with http.delete(f"{base}/v1/sessions/{session}") as deleted:
            assert deleted.status == 200
        exit_seq = int((await reader.rest())[-1].id)
    async with http.get(url, params={"after": str(exit_seq + 5)}) as response:
        assert response.status >= 400
        assert response.content_type == "application/json"


@pytest.mark.quick
@pytest.mark.parametrize("path", ["/health", "/v1/health"])
async def test_head_on_health_is_gets_status_and_headers_without_a_body(bridge, http, path):
    base = await bridge(token="s3cret")  # a load balancer has no token: none is needed
    async with http.get(f"{base}{path}") as got:
        assert got.status == 200
    async with http.head(f"{base}{path}") as head:
        assert head.status == 200
        assert head.headers["Content-Type"] == got.headers["Content-Type"]
        assert head.headers["Content-Length"] == got.headers["Content-Length"]
        assert await head.read() == b""


@pytest.mark.quick
async def test_head_on_other_routes_is_405_and_health_allows_it(bridge, http):
    base = await bridge()
    # Through `http`, whose contract check knows a HEAD's answer has no body.
    async with http.head(f"{base}/v1/sessions") as response:
        assert response.status == 405
        assert "HEAD" not in response.headers["Allow"]
        assert await response.read() == b""
    async with http.post(f"{base}/health") as response:
        assert response.status == 405
        assert set(response.headers["Allow"].split(", ")) == {"GET", "HEAD"}


@pytest.mark.quick
async def test_the_openapi_document_has_head_on_health_only(bridge, http):
    base = await bridge(token="s3cret")
    async with http.get(f"{base}/v1/openapi.json", headers={"Authorization": "Bearer s3cret"}) as r:
        document = await r.json()
    with_head = sorted(path for path, ops in document["paths"].items() if "head" in ops)
    assert with_head == ["/health", "/v1/health"]
    head = document["paths"]["/health"]["head"]
    assert head["security"] == []
    assert all("content" not in answer for answer in head["responses"].values())
