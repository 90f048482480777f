"""Shared mode: a session is a tenant of the shared app-server (fake-codex `--listen`).

fake-codex serves every connection from one store of threads and tells every connection
of every thread, as codex 0.169.0 does (tests/fakes/test_listen.py): the bridge is what
keeps a session to its own threads. The same rules are proved against the real codex in
tests/e2e/test_shared_mode.py.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from session_logs import blanked, session_log

from bridge.app import trusted_bridge_app
from bridge.limits import AppServerSettings, RestLimits
from scenarios.harness import fake_app_server_command
from scenarios.sse import SseReader

pytestmark = pytest.mark.asyncio

SHARED = AppServerSettings(mode="shared")
WAIT = 60.0
#: A thread id no session of these tests owns.
FOREIGN = str(uuid.uuid4())
#: A sub-agent the scripted turn "spawns", and one it only sends a message to.
SUB_AGENT = str(uuid.uuid4())
MESSAGED = str(uuid.uuid4())


def _agent_call(tool: str, receiver: str) -> dict[str, Any]:
    item = {
        "type": "collabAgentToolCall",
        "id": f"call_{tool}",
        "tool": tool,
        "status": "completed",
        "senderThreadId": "${threadId}",
        "receiverThreadIds": [receiver],
        "prompt": "Say hi.",
        "agentsStates": {},
    }
    params = {"threadId": "${threadId}", "turnId": "${turnId}", "item": item}
    return {"notify": {"method": "item/completed", "params": params}}


def _status(thread_id: str) -> dict[str, Any]:
    params = {"threadId": thread_id, "status": {"type": "idle"}}
    return {"notify": {"method": "thread/status/changed", "params": params}}


SCRIPT: dict[str, Any] = {
    "methods": {
        # An app-server that tells this connection of a thread that is not its own.
        "x/news": {
            "steps": [
                {
                    "notify": {
                        "method": "thread/status/changed",
                        "params": {"threadId": FOREIGN, "status": {"type": "idle"}},
                    }
                },
                {
                    "notify": {
                        "method": "thread/name/updated",
                        "params": {"threadId": "${threadId}", "threadName": "mine"},
                    }
                },
            ],
            "result": {},
        },
        # And one that asks this connection about a thread that is not its own.
        "x/asks": {
            "steps": [
                {
                    "request": {
                        "method": "item/tool/requestUserInput",
                        "params": {"threadId": FOREIGN},
                        "wait": False,
                    }
                },
                {
                    "request": {
                        "method": "item/tool/requestUserInput",
                        "params": {"threadId": "${threadId}"},
                        "wait": False,
                    }
                },
            ],
            "result": {},
        },
    },
    "turns": [
        {
            # As codex may: the sub-agent's first news before the item that names it.
            "match": {"input": [{"type": "text", "text": "Spawn."}]},
            "steps": [
                _status(SUB_AGENT),
                _status(MESSAGED),
                _agent_call("spawnAgent", SUB_AGENT),
                _agent_call("sendInput", MESSAGED),
                _status(MESSAGED),
                {"agentMessage": "ok"},
            ],
        },
        {
            "match": {"input": [{"type": "text", "text": "Ask me."}]},
            "steps": [{"commandApproval": {"command": "touch marker"}}, {"agentMessage": "ok"}],
        },
    ],
}


@pytest_asyncio.fixture
async def base(serve: Any, write_script: Any) -> str:
    command = fake_app_server_command(write_script(SCRIPT))
    return str(await serve(trusted_bridge_app(command, RestLimits(), SHARED)))


async def post(http: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.post(url, json=body or {}) as response:
        return response.status, await response.json()


async def new_session(http: aiohttp.ClientSession, base: str) -> str:
    status, body = await post(http, f"{base}/v1/sessions")
    assert status == 201, body
    return str(body["sessionId"])


async def call(
    http: aiohttp.ClientSession, base: str, session_id: str, method: str, params: Any
) -> tuple[int, Any]:
    return await post(http, f"{base}/v1/sessions/{session_id}/call/{method}", {"params": params})


async def start_thread(http: aiohttp.ClientSession, base: str, session_id: str) -> str:
    status, body = await call(http, base, session_id, "thread/start", {})
    assert status == 200, body
    return str(body["result"]["thread"]["id"])


async def run_turn(
    http: aiohttp.ClientSession, base: str, session_id: str, thread_id: str, text: str = "Hi."
) -> None:
    async with http.get(f"{base}/v1/sessions/{session_id}/events/stream") as stream:
        reader = SseReader(stream)
        params = {"threadId": thread_id, "input": [{"type": "text", "text": text}]}
        status, body = await call(http, base, session_id, "turn/start", params)
        assert status == 200, body
        await reader.until(lambda f: f.json().get("method") == "turn/completed", timeout=WAIT)


async def test_another_sessions_thread_is_answered_as_an_unknown_one(base, http):
    owner, other = await new_session(http, base), await new_session(http, base)
    thread_id = await start_thread(http, base, owner)
    await run_turn(http, base, owner, thread_id, "My secret prompt.")
    for method, params in (
        ("thread/read", {"includeTurns": True}),
        ("thread/resume", {}),
        ("thread/fork", {}),
        ("turn/start", {"input": [{"type": "text", "text": "x"}]}),
        ("turn/interrupt", {"turnId": "t"}),
        ("thread/name/set", {"name": "taken"}),
        ("thread/archive", {}),
        ("thread/unarchive", {}),
    ):
        stranger = str(uuid.uuid4())
        got = await call(http, base, other, method, {**params, "threadId": thread_id})
        unknown = await call(http, base, other, method, {**params, "threadId": stranger})
        assert (got[0], blanked(got[1], thread_id)) == (unknown[0], blanked(unknown[1], stranger))
        assert "secret" not in json.dumps(got[1]), method
    # The same id in another spelling (upper case, urn:) is still not the other's.
    for spelling in (thread_id.upper(), f"urn:uuid:{thread_id}"):
        status, body = await call(http, base, other, "thread/read", {"threadId": spelling})
        assert status == 502, body
        assert "secret" not in json.dumps(body)
    status, body = await call(
        http, base, owner, "thread/read", {"threadId": thread_id, "includeTurns": True}
    )
    assert status == 200, body
    assert body["result"]["thread"]["name"] is None
    assert "My secret prompt." in json.dumps(body)


async def test_thread_list_pages_through_own_threads_only(base, http):
    first, second = await new_session(http, base), await new_session(http, base)
    owned: dict[str, list[str]] = {first: [], second: []}
    for session_id in (first, second, second, first, second, first):
        thread_id = await start_thread(http, base, session_id)
        await run_turn(http, base, session_id, thread_id)
        owned[session_id].append(thread_id)
    for session_id, threads in owned.items():
        for limit in (1, 2, 10):
            seen: list[str] = []
            cursor = None
            for _ in range(10):
                status, body = await call(
                    http, base, session_id, "thread/list", {"limit": limit, "cursor": cursor}
                )
                assert status == 200, body
                page = body["result"]
                assert len(page["data"]) <= limit
                seen += [thread["id"] for thread in page["data"]]
                assert set(page["readStates"]) <= set(seen)
                cursor = page["nextCursor"]
                if cursor is None:
                    break
                # The bridge's token, not fake-codex's cursor (which names a thread).
                assert not any(t in cursor for t in owned[first] + owned[second])
            assert seen == sorted(threads, reverse=True), (limit, seen)
    # A token of one session means nothing to another: codex's own answer to a bad cursor.
    status, body = await call(http, base, first, "thread/list", {"limit": 1})
    token = body["result"]["nextCursor"]
    status, body = await call(http, base, second, "thread/list", {"limit": 1, "cursor": token})
    assert status == 502, body
    assert body["message"] == f"invalid cursor: {token}"
    # A session with no thread of its own sees an empty listing with no cursor at all:
    # nothing says that other threads are there.
    newcomer = await new_session(http, base)
    for params in ({}, {"limit": 1}, {"limit": 100}):
        status, body = await call(http, base, newcomer, "thread/list", params)
        assert status == 200, body
        page = body["result"]
        assert (page["data"], page["nextCursor"], page["backwardsCursor"]) == ([], None, None)
        assert page["readStates"] == {}


async def test_a_bystander_hears_nothing_of_other_sessions_threads(base, http):
    bystander, worker = await new_session(http, base), await new_session(http, base)
    thread_id = await start_thread(http, base, worker)
    await run_turn(http, base, worker, thread_id)
    status, body = await call(
        http, base, worker, "thread/name/set", {"threadId": thread_id, "name": "n"}
    )
    assert status == 200, body
    status, body = await call(http, base, worker, "thread/archive", {"threadId": thread_id})
    assert status == 200, body
    worker_heard = [e["method"] for e in await session_log(http, base, worker)]
    assert {"thread/name/updated", "thread/archived", "turn/completed"} <= set(worker_heard)
    own = await start_thread(http, base, bystander)
    heard = await session_log(http, base, bystander)
    threads = [e for e in heard if e["method"] != "remoteControl/status/changed"]
    assert [(e["method"], e["params"]["thread"]["id"]) for e in threads] == [
        ("thread/started", own)
    ]
    assert thread_id not in json.dumps(heard)


async def test_news_of_a_thread_the_session_does_not_own_is_not_passed_on(base, http):
    """An app-server that tells a connection of someone else's thread: dropped."""
    session_id = await new_session(http, base)
    own = await start_thread(http, base, session_id)
    status, body = await call(http, base, session_id, "x/news", {"threadId": own})
    assert status == 200, body
    heard = await session_log(http, base, session_id)
    assert FOREIGN not in json.dumps(heard)
    named = [e for e in heard if e["method"] == "thread/name/updated"]
    assert [e["params"] for e in named] == [{"threadId": own, "threadName": "mine"}]


async def test_a_command_approval_is_asked_of_the_owner_alone(base, http, tmp_path):
    owner, other = await new_session(http, base), await new_session(http, base)
    thread_id = await start_thread(http, base, owner)
    async with http.get(f"{base}/v1/sessions/{owner}/events/stream") as stream:
        reader = SseReader(stream)
        params = {"threadId": thread_id, "input": [{"type": "text", "text": "Ask me."}]}
        status, body = await call(http, base, owner, "turn/start", params)
        assert status == 200, body
        frames = await reader.until(lambda f: f.event == "request", timeout=WAIT)
        request = frames[-1].json()
        async with http.get(f"{base}/v1/sessions") as response:
            sessions = {s["sessionId"]: s for s in (await response.json())["sessions"]}
        assert sessions[owner]["pendingRequests"] == [request["requestKey"]]
        assert sessions[other]["pendingRequests"] == []
        # The other cannot subscribe to the thread to hear it either.
        status, body = await call(http, base, other, "thread/resume", {"threadId": thread_id})
        assert status == 502, body
        url = f"{base}/v1/sessions/{owner}/requests/{request['requestKey']}/result"
        status, body = await post(http, url, {"result": {"decision": "accept"}})
        assert status == 200, body
        await reader.until(lambda f: f.json().get("method") == "turn/completed", timeout=WAIT)
    assert thread_id not in json.dumps(await session_log(http, base, other))


async def test_a_sub_agent_is_its_spawners_with_the_news_that_came_first(base, http):
    """The status of a sub-agent that arrives before the `spawnAgent` item naming it is
    passed on once the item has; a thread a tool call only sends to is not adopted."""
    owner, bystander = await new_session(http, base), await new_session(http, base)
    thread_id = await start_thread(http, base, owner)
    await run_turn(http, base, owner, thread_id, "Spawn.")
    heard = await session_log(http, base, owner)
    about = [(e["method"], e["params"].get("threadId")) for e in heard]
    [spawn] = [
        index
        for index, e in enumerate(heard)
        if e["method"] == "item/completed" and e["params"]["item"].get("tool") == "spawnAgent"
    ]
    assert about[spawn + 1] == ("thread/status/changed", SUB_AGENT), about
    # Its own item names the agent it sent to, but that agent's news is not its.
    assert [thread for _, thread in about if thread == MESSAGED] == []
    told = json.dumps(await session_log(http, base, bystander))
    assert SUB_AGENT not in told
    assert thread_id not in told


async def test_a_server_request_about_a_foreign_thread_is_not_the_sessions_to_answer(base, http):
    """An app-server that asks this connection about someone else's thread: the request
    is not shown (its owner answers it), the one about the session's own thread is."""
    session_id = await new_session(http, base)
    own = await start_thread(http, base, session_id)
    status, body = await call(http, base, session_id, "x/asks", {"threadId": own})
    assert status == 200, body
    heard = await session_log(http, base, session_id)
    asked = [e for e in heard if e["kind"] == "request"]
    assert [e["params"]["threadId"] for e in asked] == [own]
    assert FOREIGN not in json.dumps(heard)
    async with http.get(f"{base}/v1/sessions") as response:
        [summary] = [s for s in (await response.json())["sessions"] if s["sessionId"] == session_id]
    assert summary["pendingRequests"] == [asked[0]["requestKey"]]


async def test_a_cursor_token_serves_only_the_listing_that_gave_it(base, http):
    """codex's cursors name threads (thread/loaded/list's is a thread id), and a listing
    that reads its 16 pages without finding a thread of the session's own stops at one
    of another session's. Its token is a cursor for that listing only: given to another,
    codex's complaint quotes the token, never the thread id behind it."""
    crowd = await new_session(http, base)
    others = [await start_thread(http, base, crowd) for _ in range(17)]
    owner = await new_session(http, base)
    own = await start_thread(http, base, owner)
    status, body = await call(http, base, owner, "thread/loaded/list", {"limit": 1})
    assert status == 200, body
    page = body["result"]
    assert page["data"] == []  # 16 pages of others' threads: none of them shown
    token = page["nextCursor"]
    assert token.startswith("tc_")
    seen: list[str] = []
    while token is not None:
        status, body = await call(
            http, base, owner, "thread/loaded/list", {"limit": 1, "cursor": token}
        )
        assert status == 200, body
        seen += body["result"]["data"]
        token = body["result"]["nextCursor"]
    assert seen == [own]
    status, body = await call(http, base, owner, "thread/loaded/list", {"limit": 1})
    token = body["result"]["nextCursor"]
    status, body = await call(http, base, owner, "thread/list", {"cursor": token})
    assert (status, body["message"]) == (502, f"invalid cursor: {token}")
    assert not any(thread_id in json.dumps(body) for thread_id in others)


#: Two threads of two sessions, as a scripted `thread/start` opens them (matched on a
#: param), and what a search of the whole process finds of them.
VICTIM = str(uuid.uuid4())
MINE = str(uuid.uuid4())


def _found(thread_id: str, snippet: str) -> dict[str, Any]:
    thread = {"id": thread_id, "preview": snippet, "path": f"/rollouts/{thread_id}.jsonl"}
    return {"snippet": snippet, "thread": thread}


def _partial(*rows: dict[str, Any]) -> dict[str, Any]:
    params = {"requestId": 0, "data": list(rows)}
    return {"notify": {"method": "thread/search/partial", "params": params}}


SECRET_ROW = _found(VICTIM, "VICTIM-PASSWORD-hunter2")
OWN_ROW = _found(MINE, "my hunter2 note")
#: codex's first page holds the victim's thread only, with a cursor that names it.
SEARCH_PAGES = [
    {
        "match": {"cursor": f"c-{VICTIM}"},
        "repeat": True,
        "result": {"data": [OWN_ROW], "nextCursor": None, "backwardsCursor": f"c-{VICTIM}"},
    },
    {"result": {"data": [SECRET_ROW], "nextCursor": f"c-{VICTIM}", "backwardsCursor": None}},
]
SEARCH_SCRIPT: dict[str, Any] = {
    "methods": {
        "thread/start": [
            {
                "match": {"serviceName": "victim"},
                "repeat": True,
                "result": {"thread": {"id": VICTIM}},
            },
            {"match": {"serviceName": "me"}, "repeat": True, "result": {"thread": {"id": MINE}}},
        ],
        "thread/search": SEARCH_PAGES,
        "thread/search/stream": [
            {
                **page,
                "steps": [_partial(SECRET_ROW), _partial(OWN_ROW), _partial(SECRET_ROW, OWN_ROW)],
            }
            for page in SEARCH_PAGES
        ],
    }
}


@pytest_asyncio.fixture
async def searched(serve: Any, write_script: Any) -> str:
    command = fake_app_server_command(write_script(SEARCH_SCRIPT))
    return str(await serve(trusted_bridge_app(command, RestLimits(), SHARED)))


async def test_a_search_shows_a_session_its_own_threads_only(searched, http):
    """`thread/search` and `thread/search/stream` search every thread of the process: a
    session finds its own only, reading on through codex's pages, with cursors that name
    no thread; a partial result is passed on only when every row is the session's."""
    base = searched
    victim, me = await new_session(http, base), await new_session(http, base)
    for session_id, service in ((victim, "victim"), (me, "me")):
        status, body = await call(http, base, session_id, "thread/start", {"serviceName": service})
        assert status == 200, body
    for method in ("thread/search", "thread/search/stream"):
        status, body = await call(http, base, me, method, {"searchTerm": "hunter2"})
        assert status == 200, body
        assert body["result"] == {"data": [OWN_ROW], "nextCursor": None, "backwardsCursor": None}
        status, body = await call(http, base, victim, method, {"searchTerm": "hunter2"})
        assert status == 200, body
        page = body["result"]
        assert page["data"] == [SECRET_ROW]
        assert page["nextCursor"].startswith("tc_")
    # Of the three partial results each of codex's pages sent (the session's search read
    # two), the one all the session's own.
    heard = await session_log(http, base, me)
    partials = [e["params"]["data"] for e in heard if e["method"] == "thread/search/partial"]
    assert partials == [[OWN_ROW], [OWN_ROW]]
    assert VICTIM not in json.dumps(heard)
    assert "PASSWORD" not in json.dumps(heard)
    heard = await session_log(http, base, victim)
    partials = [e["params"]["data"] for e in heard if e["method"] == "thread/search/partial"]
    assert partials == [[SECRET_ROW]]
