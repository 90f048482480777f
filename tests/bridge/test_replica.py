"""A bridge as one replica of several: its id in session ids, its peers, draining."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.app import backend_app, trusted_bridge_app
from bridge.auth import with_bearer_auth
from bridge.backend import Backend, PeerSessions
from bridge.limits import (
    ReplicaSettings,
    ReplicaSettingsError,
    RestLimits,
    parse_peers,
    validate_replica_id,
)
from bridge.replica import PEER_QUERY_HEADER, Drain, configure, replica_of
from bridge.routes import BACKEND
from bridge.settings import ReplicaVariables

FAKE_CODEX = [str(Path(sys.executable).with_name("fake-codex")), "app-server"]
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
UUID = "[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
TOKEN = "replica-test-token"


@pytest.mark.quick
@pytest.mark.parametrize("good", ["bridge-0", "a", "0", "replica-12", "x" * 63])
def test_replica_ids_are_dns_labels(good):
    assert validate_replica_id(good) == good


@pytest.mark.quick
@pytest.mark.parametrize(
    "bad", ["", "Bridge-0", "-a", "a-", "a.b", "a_b", "x" * 64, "a b", "bridge-0\n", "é"]
)
def test_other_replica_ids_are_refused(bad):
    with pytest.raises(ReplicaSettingsError):
        validate_replica_id(bad)


@pytest.mark.quick
def test_settings_from_the_environment():
    settings = ReplicaVariables.from_env(
        {
            "REST_ADAPTER_REPLICA_ID": "bridge-1",
            "REST_ADAPTER_PEERS": "bridge-0=http://a:1, bridge-1=http://b:2,bridge-2=http://c:3/",
            "REST_ADAPTER_DRAIN_TIMEOUT_MS": "5000",
        }
    ).replica()
    assert settings.replica_id == "bridge-1"
    assert dict(settings.peers) == {"bridge-0": "http://a:1", "bridge-2": "http://c:3"}
    assert settings.drain_timeout_ms == 5000
    assert ReplicaVariables.from_env({}).replica() == ReplicaSettings()


@pytest.mark.quick
@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"REST_ADAPTER_REPLICA_ID": "Bad_Id"}, "REST_ADAPTER_REPLICA_ID"),
        ({"REST_ADAPTER_PEERS": "a=http://x:1"}, "needs REST_ADAPTER_REPLICA_ID"),
        ({"REST_ADAPTER_REPLICA_ID": "a", "REST_ADAPTER_PEERS": "b=x:1"}, "id=http://"),
        ({"REST_ADAPTER_REPLICA_ID": "a", "REST_ADAPTER_PEERS": "b=http://x,b=http://y"}, "twice"),
        ({"REST_ADAPTER_DRAIN_TIMEOUT_MS": "0"}, "REST_ADAPTER_DRAIN_TIMEOUT_MS"),
    ],
)
def test_bad_settings_name_the_variable(env, needle):
    with pytest.raises(ReplicaSettingsError, match=re.escape(needle)):
        ReplicaVariables.from_env(env).replica()


@pytest.mark.quick
def test_peers_and_replica_of():
    assert parse_peers("") == {}
    assert replica_of("bridge-0.1234") == "bridge-0"
    assert replica_of("0b8e3c1c-0000-4000-8000-000000000000") is None


def test_serve_refuses_a_bad_replica_id():
    """`rest-bridge serve` exits 2 naming the variable, before listening."""
    done = subprocess.run(
        [REST_BRIDGE, "serve", "--port", "0"],
        env={"PATH": "/usr/bin:/bin", "REST_ADAPTER_REPLICA_ID": "Not_A_Label"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "REST_ADAPTER_REPLICA_ID" in done.stderr
    assert "listening" not in done.stdout


def replica_app(replica_id: str | None, peers: dict[str, str] | None = None, token: str = ""):
    app = trusted_bridge_app(FAKE_CODEX, RestLimits())
    configure(app[BACKEND], ReplicaSettings(replica_id=replica_id, peers=peers or {}))
    if token:
        with_bearer_auth(app, token)
    return app


@pytest.mark.asyncio
async def test_session_ids_carry_the_replica_id(serve, http):
    with_id = await serve(replica_app("bridge-7"))
    without = await serve(replica_app(None))
    async with http.post(f"{with_id}/v1/sessions") as response:
        assert response.status == 201
        session_id = (await response.json())["sessionId"]
    assert re.fullmatch(rf"bridge-7\.{UUID}", session_id), session_id
    async with http.post(
        f"{with_id}/v1/sessions/{session_id}/call/thread/start", json={"params": {}}
    ) as r:
        assert r.status == 200
    async with http.post(f"{without}/v1/sessions") as response:
        assert re.fullmatch(UUID, (await response.json())["sessionId"])
    async with http.get(f"{without}/v1/sessions") as response:
        assert "unavailableReplicas" not in await response.json()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.asyncio
async def test_the_listing_asks_every_peer_with_the_callers_token(serve, http):
    """A's listing holds B's sessions (asked with the caller's token) and names C, which is down."""
    b = await serve(replica_app("b", token=TOKEN))
    down = f"http://127.0.0.1:{closed_port()}"
    a = await serve(replica_app("a", {"a": "http://unused", "b": b, "c": down}, token=TOKEN))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    ids = []
    for base in (a, b, b):
        async with http.post(f"{base}/v1/sessions", headers=auth) as response:
            assert response.status == 201
            ids.append((await response.json())["sessionId"])
    async with http.get(f"{a}/v1/sessions", headers=auth) as response:
        assert response.status == 200
        listed = await response.json()
    assert sorted(s["sessionId"] for s in listed["sessions"]) == sorted(ids)
    assert listed["unavailableReplicas"] == ["c"]
    # Without the token: the 401, and the peers are not asked for anything.
    async with http.get(f"{a}/v1/sessions") as response:
        assert response.status == 401
    # A peer's question is answered with the replica's own sessions only.
    async with http.get(f"{a}/v1/sessions", headers={**auth, PEER_QUERY_HEADER: "1"}) as r:
        own = await r.json()
    assert [s["sessionId"] for s in own["sessions"]] == [ids[0]]
    assert "unavailableReplicas" not in own
    # A wrong token forwarded to B is B's 401: B is then unavailable, never bypassed.
    b_only = await serve(replica_app("d", {"b": b}, token="another-token"))
    async with http.get(
        f"{b_only}/v1/sessions", headers={"Authorization": "Bearer another-token"}
    ) as response:
        assert (await response.json())["unavailableReplicas"] == ["b"]


@pytest.mark.asyncio
async def test_a_draining_backend_takes_no_new_work(serve, http):
    app = replica_app("bridge-3")
    drain = configure(app[BACKEND], ReplicaSettings(replica_id="bridge-3"))
    base = await serve(app)
    async with http.post(f"{base}/v1/sessions") as response:
        session_id = (await response.json())["sessionId"]
    done = asyncio.Event()
    drain.start(done)
    for path, body in (
        ("/v1/sessions", {}),
        ("/v1/call/thread/start", {"params": {}}),
        ("/v1/text-turn", {"text": "hi"}),
    ):
        async with http.post(f"{base}{path}", json=body) as response:
            assert response.status == 503, path
            assert response.headers["Retry-After"] == "1"
            assert (await response.json())["error"] == "replica_unavailable"
    async with http.post(
        f"{base}/v1/sessions/{session_id}/call/thread/start", json={"params": {}}
    ) as r:
        assert r.status == 200
    assert not done.is_set()
    async with http.delete(f"{base}/v1/sessions/{session_id}") as response:
        assert response.status == 200
    await asyncio.wait_for(done.wait(), 30)


@pytest.mark.asyncio
async def test_a_drain_ends_at_its_deadline_with_sessions_left(serve, http, caplog):
    app = trusted_bridge_app(FAKE_CODEX, RestLimits())
    drain = configure(app[BACKEND], ReplicaSettings(replica_id="r", drain_timeout_ms=200))
    base = await serve(app)
    async with http.post(f"{base}/v1/sessions") as response:
        assert response.status == 201
    done = asyncio.Event()
    caplog.set_level(logging.INFO, logger="bridge.replica")
    drain.start(done)
    drain.start(done)  # a second signal changes nothing
    await asyncio.wait_for(done.wait(), 30)
    said = [r.getMessage() for r in caplog.records if r.name == "bridge.replica"]
    assert [x.split(";")[0] for x in said].count("draining: no new work") == 1, said
    assert (
        "draining: no new work; sessions left: 1 (held in all, with calls and text turns: 1)"
        in said[0]
    )
    assert said[1].startswith("drain deadline reached; sessions left: 1 (held in all: 1)")
    assert caplog.records[-1].levelname == "WARNING"
    # The session is still served until the bridge stops (stopping is serve's job).
    assert len(app[BACKEND].sessions()) == 1


@pytest.mark.asyncio
async def test_a_hosts_backend_lists_peers_through_the_backend_interface(serve, http):
    """Peers are a `Backend` method: the route asks it unless a replica is asking."""
    summary = {
        "sessionId": "elsewhere.1",
        "createdAt": "2026-01-01T00:00:00Z",
        "lastActivityAt": "2026-01-01T00:00:00Z",
        "state": "running",
        "exitCode": None,
        "pendingRequests": [],
        "nextSeq": 1,
        "bufferedEvents": 0,
    }
    asked: list[str | None] = []

    class WithPeers(Backend):
        async def list_sessions(self):
            return []

        async def peer_sessions(self, authorization):
            asked.append(authorization)
            return PeerSessions([summary], ["down-1"])

    base = await serve(backend_app(WithPeers()))
    async with http.get(f"{base}/v1/sessions", headers={"Authorization": "x"}) as response:
        assert await response.json() == {"sessions": [summary], "unavailableReplicas": ["down-1"]}
    async with http.get(f"{base}/v1/sessions", headers={PEER_QUERY_HEADER: "1"}) as response:
        assert await response.json() == {"sessions": []}
    assert asked == ["x"]


@pytest.mark.asyncio
async def test_a_backend_holding_nothing_drains_at_once(caplog):
    backend = Backend()
    drain = Drain(backend, 600_000)
    done = asyncio.Event()
    caplog.set_level(logging.INFO, logger="bridge.replica")
    drain.start(done)
    await asyncio.wait_for(done.wait(), 30)
    assert backend.draining
    assert "drained; sessions left: 0; exiting" in caplog.messages
