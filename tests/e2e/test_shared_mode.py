"""Shared mode end to end: one real ``codex app-server --listen``, each session a connection.

The bridge starts the pinned codex itself (``--listen unix://PATH`` appended to the
command), with its ``CODEX_HOME``, working directory and scripted model in the command:
in shared mode those ClientOptions are refused, so they cannot come per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from processes import exited, live_children
from session_logs import session_log

from bridge import codex_schema
from bridge.app import trusted_bridge_app
from bridge.codex_window import release
from bridge.limits import AppServerSettings, RestLimits
from bridge.process import tenancy
from bridge.routes import BACKEND
from fakes.model_provider import ModelProviderServer
from scenarios.sse import SseReader
from tests.e2e.test_real_codex import (
    COMMAND_APPROVAL,
    WAIT,
    call,
    command_items,
    create_session,
    events,
    method_is,
    start_thread,
    start_turn,
    untrusted_thread,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.real_codex]

SHARED = AppServerSettings(mode="shared")


@pytest_asyncio.fixture
async def shared_bridge(
    model: ModelProviderServer,
    codex_home: Path,
    workspace: Path,
    serve: Callable[[web.Application], Any],
    codex_bin: str,
) -> str:
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    return str(await serve(trusted_bridge_app(command, RestLimits(), SHARED)))


def process_groups(pids: set[int]) -> set[int]:
    """The process groups of ``pids``: one per app-server (codex runs helpers in its own)."""
    return {os.getpgid(pid) for pid in pids}


async def shared_state(http, base) -> dict[str, Any]:
    async with http.get(f"{base}/v1/compatibility") as response:
        assert response.status == 200
        body = await response.json()
    assert body["appServer"]["mode"] == "shared"
    return body["appServer"]["shared"]


async def test_sessions_calls_and_text_turns_share_one_codex_process(
    shared_bridge, http, model, workspace, codex_version
):
    before = live_children()
    assert (await shared_state(http, shared_bridge))["state"] == "idle"
    sessions = [await create_session(http, shared_bridge, None) for _ in range(3)]
    state = await shared_state(http, shared_bridge)
    assert state["state"] == "running"
    assert state["connections"] == 3
    assert process_groups(live_children() - before) == {state["pid"]}
    # Each session is its own connection with its own threads.
    threads = {await start_thread(http, shared_bridge, s, cwd=str(workspace)) for s in sessions}
    assert len(threads) == 3
    # A sessionless call and a text turn are connections too: no process is spawned.
    body = {"params": {}}
    async with http.post(f"{shared_bridge}/v1/call/model/list", json=body) as response:
        payload = await response.json()
        assert response.status == 200, payload
    assert payload["result"]["data"]
    model.model.add({"text": "Shared hello."})
    turn = {"text": "Say hello.", "threadParams": {"cwd": str(workspace)}, "timeoutMs": 30000}
    async with http.post(f"{shared_bridge}/v1/text-turn", json=turn) as response:
        payload = await response.json()
        assert response.status == 200, payload
    assert payload["text"] == "Shared hello."
    assert payload["status"] == "completed"
    assert process_groups(live_children() - before) == {state["pid"]}
    state = await shared_state(http, shared_bridge)
    assert state["connections"] == 3
    assert state["userAgent"].startswith(f"codex_rest_bridge/{release(codex_version)} ")


async def test_a_session_hears_of_its_own_threads_only(shared_bridge, http, workspace):
    """codex 0.169.0 sends every connection a `thread/started` for every new thread; the
    bridge keeps other sessions' thread ids from a session (and its event log)."""
    sessions = [await create_session(http, shared_bridge, None) for _ in range(4)]
    threads = [await start_thread(http, shared_bridge, s, cwd=str(workspace)) for s in sessions]
    # A thread/start on the last session, answered after every other: all are announced.
    for session_id, thread_id in zip(sessions, threads, strict=True):
        started = [
            e["params"]["thread"]["id"]
            for e in await session_log(http, shared_bridge, session_id)
            if e["method"] == "thread/started"
        ]
        assert started == [thread_id]


async def test_command_approval_answered_over_http_in_shared_mode(
    shared_bridge, http, model, workspace
):
    model.model.add({"execCommand": {"cmd": "touch shared.txt"}}, {"text": "Touched it."})
    session_id = await create_session(http, shared_bridge, None)
    async with http.get(f"{shared_bridge}/v1/sessions/{session_id}/events/stream") as stream:
        reader = SseReader(stream)
        thread_params = untrusted_thread(workspace)
        thread_id = await start_thread(http, shared_bridge, session_id, **thread_params)
        turn_id = await start_turn(http, shared_bridge, session_id, thread_id, "Touch the file.")
        before = await reader.until(lambda f: f.event == "request", timeout=WAIT)
        request = before[-1].json()
        assert request["method"] == COMMAND_APPROVAL
        assert request["params"]["turnId"] == turn_id
        key = request["requestKey"]
        url = f"{shared_bridge}/v1/sessions/{session_id}/requests/{key}/result"
        async with http.post(url, json={"result": {"decision": "accept"}}) as answered:
            assert answered.status == 200, await answered.text()
        async with http.post(url, json={"result": {"decision": "accept"}}) as again:
            assert again.status == 409
            assert (await again.json())["error"] == "request_already_answered"
        after = await reader.until(method_is("turn/completed"), timeout=WAIT)
    seen = events(before + after)
    assert seen[-1]["params"]["turn"]["status"] == "completed"
    assert [item["status"] for item in command_items(seen)] == ["completed"]
    assert (workspace / "shared.txt").exists()


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({"env": {"A": "b"}}, ["env"]),
        ({"cwd": "/"}, ["cwd"]),
        ({"configOverrides": ["model=x"]}, ["configOverrides"]),
        (
            {"env": {"A": "b"}, "cwd": "/", "clientInfo": {"name": "n", "version": "1"}},
            ["cwd", "env"],
        ),
    ],
)
async def test_options_that_need_a_process_of_their_own_are_403(
    shared_bridge, http, options, refused
):
    for path, body in (
        ("/v1/sessions", {"options": options}),
        ("/v1/call/model/list", {"params": {}, "options": options}),
        ("/v1/text-turn", {"text": "hi", "options": options}),
    ):
        async with http.post(f"{shared_bridge}{path}", json=body) as response:
            payload = await response.json()
            assert response.status == 403, (path, payload)
        assert payload["error"] == "options_not_allowed"
        assert payload["data"] == {"fields": refused, "mode": "shared"}
    assert (await shared_state(http, shared_bridge))["connections"] == 0


async def test_per_connection_options_still_apply(shared_bridge, http):
    options = {"clientInfo": {"name": "host_app", "version": "7.1"}, "experimentalApi": True}
    async with http.post(f"{shared_bridge}/v1/sessions", json={"options": options}) as response:
        payload = await response.json()
        assert response.status == 201, payload
    assert "host_app; 7.1" in payload["initialize"]["userAgent"]


async def test_delete_closes_that_connection_alone(shared_bridge, http, workspace):
    first = await create_session(http, shared_bridge, None)
    second = await create_session(http, shared_bridge, None)
    pid = (await shared_state(http, shared_bridge))["pid"]
    async with http.get(f"{shared_bridge}/v1/sessions/{first}/events/stream") as stream:
        reader = SseReader(stream)
        async with http.delete(f"{shared_bridge}/v1/sessions/{first}") as response:
            assert response.status == 200
        frames = await reader.until(lambda f: f.event == "exit", timeout=WAIT)
    exit_event = frames[-1].json()
    assert exit_event["params"] == {
        "exitCode": 0,
        "signal": None,
        "stderrTail": "",
        "connection": "closed by the bridge",
    }
    status, body = await call(http, shared_bridge, first, "thread/start", {})
    assert status == 404, body
    assert await start_thread(http, shared_bridge, second, cwd=str(workspace))
    state = await shared_state(http, shared_bridge)
    assert state["pid"] == pid
    assert state["connections"] == 1


async def test_a_killed_codex_ends_every_session_and_is_restarted(shared_bridge, http, workspace):
    sessions = [await create_session(http, shared_bridge, None) for _ in range(2)]
    pid = (await shared_state(http, shared_bridge))["pid"]
    streams = [
        await http.get(f"{shared_bridge}/v1/sessions/{s}/events/stream").__aenter__()
        for s in sessions
    ]
    try:
        os.kill(pid, signal.SIGKILL)
        for stream in streams:
            frames = await SseReader(stream).until(lambda f: f.event == "exit", timeout=WAIT)
            assert frames[-1].json()["params"] == {
                "exitCode": None,
                "signal": "SIGKILL",
                "stderrTail": "",
                "connection": "the shared app-server exited",
            }
    finally:
        for stream in streams:
            stream.release()
    for session_id in sessions:
        status, body = await call(http, shared_bridge, session_id, "thread/start", {})
        assert status == 409, body
        assert body["error"] == "session_exited"
    # New sessions get a new codex once the backoff has passed.
    fresh = await create_session(http, shared_bridge, None)
    assert await start_thread(http, shared_bridge, fresh, cwd=str(workspace))
    state = await shared_state(http, shared_bridge)
    assert state["restarts"] == 1
    assert state["lastExit"]["signal"] == "SIGKILL"
    assert state["state"] == "running"
    assert state["pid"] not in (None, pid)


async def run_turn(http, base, session_id, thread_id, text) -> list[dict[str, Any]]:
    """A turn on the session's thread, and its events up to its `turn/completed`."""
    async with http.get(f"{base}/v1/sessions/{session_id}/events/stream") as stream:
        reader = SseReader(stream)
        await start_turn(http, base, session_id, thread_id, text)
        return events(await reader.until(method_is("turn/completed"), timeout=WAIT))


def without(body: Any, *thread_ids: str) -> str:
    """``body`` as JSON text with the thread ids blanked, to compare two answers."""
    text = json.dumps(body, sort_keys=True)
    for thread_id in thread_ids:
        text = text.replace(thread_id, "<thread>")
    return text


#: What codex tells a connection of itself once it is initialized (no thread in it).
CONNECTION_NEWS = ("configWarning", "remoteControl/status/changed")

#: Thread-scoped calls, each with the parameters it needs besides `threadId`.
THREAD_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("thread/read", {"includeTurns": True}),
    ("thread/turns/list", {}),
    ("thread/resume", {}),
    ("thread/fork", {}),
    ("turn/start", {"input": [{"type": "text", "text": "Steal it."}]}),
    ("turn/interrupt", {"turnId": "turn"}),
    ("thread/name/set", {"name": "taken"}),
    ("thread/compact/start", {}),
    ("review/start", {"target": {"type": "uncommittedChanges"}}),
    ("thread/goal/get", {}),
    ("thread/unsubscribe", {}),
    ("thread/archive", {}),
    ("thread/unarchive", {}),
    ("thread/delete", {}),
]


async def test_another_sessions_thread_is_answered_as_one_that_does_not_exist(
    shared_bridge, http, model, workspace
):
    """Every thread-scoped call on another session's thread (read, resume, fork, a turn,
    a name, archive, delete, ...) gets exactly what a thread id that never existed gets:
    nothing tells "not yours" from "no such thread", and the owner's thread is untouched."""
    owner = await create_session(http, shared_bridge, None)
    other = await create_session(http, shared_bridge, None)
    thread_id = await start_thread(http, shared_bridge, owner, cwd=str(workspace))
    model.model.add({"text": "The secret is 42."})
    await run_turn(http, shared_bridge, owner, thread_id, "Remember the secret prompt.")
    for method, params in THREAD_CALLS:
        stranger = str(uuid.uuid4())
        status, body = await call(
            http, shared_bridge, other, method, {**params, "threadId": thread_id}
        )
        nowhere_status, nowhere = await call(
            http, shared_bridge, other, method, {**params, "threadId": stranger}
        )
        assert (status, without(body, thread_id)) == (
            nowhere_status,
            without(nowhere, stranger),
        ), method
        assert "secret" not in json.dumps(body), method
    # Another spelling of the same id (codex reads it as the same thread) is no way in.
    spellings = (
        thread_id.upper(),
        f"urn:uuid:{thread_id}",
        f"{{{thread_id}}}",
        thread_id.replace("-", ""),
    )
    for spelling in spellings:
        status, body = await call(http, shared_bridge, other, "thread/read", {"threadId": spelling})
        assert status == 502, body
        assert body["message"] == f"thread not loaded: {thread_id}"
    for spelling in spellings:
        status, body = await call(http, shared_bridge, owner, "thread/read", {"threadId": spelling})
        assert (status, body["result"]["thread"]["id"]) == (200, thread_id)
    # The refusals reached nothing: the owner's thread is whole, named as before.
    status, body = await call(
        http, shared_bridge, owner, "thread/read", {"threadId": thread_id, "includeTurns": True}
    )
    assert status == 200, body
    thread = body["result"]["thread"]
    assert thread["name"] is None
    assert "Remember the secret prompt." in json.dumps(thread["turns"])
    listed = await list_threads(http, shared_bridge, owner, "thread/list", limit=10)
    assert listed == [thread_id]


async def list_threads(http, base, session_id, method, **params) -> list[str]:
    """Every thread id a listing gives, page by page, following its cursors."""
    seen: list[str] = []
    cursor = None
    for _ in range(20):
        status, body = await call(http, base, session_id, method, {**params, "cursor": cursor})
        assert status == 200, body
        result = body["result"]
        seen += [t if isinstance(t, str) else t["id"] for t in result["data"]]
        assert set(result.get("readStates", {})) <= set(seen)
        cursor = result["nextCursor"]
        if cursor is None:
            return seen
        # A cursor is the bridge's token, never codex's (which names a thread).
        assert cursor.startswith("tc_"), cursor
    raise AssertionError(f"{method} did not end: {seen}")


async def until_listed(http, base, session_id, threads: list[str]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while set(threads) - set(await list_threads(http, base, session_id, "thread/list")):
        assert loop.time() < deadline, f"codex never listed {threads}"


async def test_listings_show_a_session_its_own_threads_only(shared_bridge, http, model, workspace):
    """`thread/list` and `thread/loaded/list` show a session its own threads, one page
    after another, with cursors that name no thread of another session."""
    first = await create_session(http, shared_bridge, None)
    second = await create_session(http, shared_bridge, None)
    owned: dict[str, list[str]] = {first: [], second: []}
    for session_id in (first, second, first, second, first):
        thread_id = await start_thread(http, shared_bridge, session_id, cwd=str(workspace))
        await run_turn(http, shared_bridge, session_id, thread_id, "Hello.")
        owned[session_id].append(thread_id)
    # codex lists a thread a little after its turn's `turn/completed`, and announces
    # nothing when it does: ask until the last one is listed (each ask is answered).
    await until_listed(http, shared_bridge, first, owned[first])
    for session_id, threads in owned.items():
        newest_first = threads[::-1]
        for limit in (1, 2, 25):
            listed = await list_threads(http, shared_bridge, session_id, "thread/list", limit=limit)
            assert listed == newest_first, (limit, listed)
        assert sorted(await list_threads(http, shared_bridge, session_id, "thread/list")) == (
            sorted(threads)
        )
        for limit in (1, 10):
            loaded = await list_threads(
                http, shared_bridge, session_id, "thread/loaded/list", limit=limit
            )
            assert sorted(loaded) == sorted(threads)
    # A thread/list token is no cursor for another listing: codex's answer names the
    # token, never the cursor behind it (which names a thread).
    status, body = await call(http, shared_bridge, first, "thread/list", {"limit": 1})
    token = body["result"]["nextCursor"]
    params = {"attachmentType": "pr", "identityKey": "k", "cursor": token}
    status, body = await call(http, shared_bridge, first, "thread/attachmentOwner/list", params)
    never = {**params, "cursor": "tc_never-given"}
    _, nowhere = await call(http, shared_bridge, first, "thread/attachmentOwner/list", never)
    assert (status, body["message"]) == (502, nowhere["message"]), body
    assert all(t not in json.dumps(body) for t in owned[first] + owned[second]), body
    # A sessionless call is a connection of its own: it owns no thread, so lists none.
    async with http.post(f"{shared_bridge}/v1/call/thread/list", json={"params": {}}) as answer:
        assert answer.status == 200
        page = (await answer.json())["result"]
        assert (page["data"], page["nextCursor"], page["backwardsCursor"]) == ([], None, None)


#: What the victim's turn says, and what an attacker searches for.
SECRET = "VICTIM-PASSWORD-hunter2"
EXPERIMENTAL = {"experimentalApi": True}


async def search(http, base, session_id, method, term) -> tuple[list[str], str]:
    """The thread ids a search finds, page by page, and every page as JSON text."""
    seen: list[str] = []
    pages = ""
    cursor = None
    for _ in range(20):
        params = {"searchTerm": term, "cursor": cursor}
        status, body = await call(http, base, session_id, method, params)
        assert status == 200, body
        pages += json.dumps(body)
        seen += [row["thread"]["id"] for row in body["result"]["data"]]
        cursor = body["result"]["nextCursor"]
        if cursor is None:
            return seen, pages
        assert cursor.startswith("tc_"), cursor
    raise AssertionError(f"{method} did not end: {seen}")


async def test_a_search_finds_a_sessions_own_threads_only(
    shared_bridge, http, model, workspace, codex_version
):
    """`thread/search` (and 0.171.0's `thread/search/stream`, whose partial results come
    as notifications) searches every thread of the process: a session finds its own
    threads only, and learns nothing of another's (its id, preview, snippet, path)."""
    victim = await create_session(http, shared_bridge, EXPERIMENTAL)
    attacker = await create_session(http, shared_bridge, EXPERIMENTAL)
    secret = await start_thread(http, shared_bridge, victim, cwd=str(workspace))
    model.model.add({"text": "Noted."})
    await run_turn(http, shared_bridge, victim, secret, f"Remember {SECRET}.")
    own = await start_thread(http, shared_bridge, attacker, cwd=str(workspace))
    model.model.add({"text": "Noted."})
    await run_turn(http, shared_bridge, attacker, own, "My own hunter2 note.")
    methods = ["thread/search"]
    if release(codex_version) != "0.169.0":
        methods.append("thread/search/stream")
    for method in methods:
        # codex finds a thread a little after its turn: ask until the victim finds its own.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        for session_id, expected in ((victim, [secret]), (attacker, [own])):
            while (
                found := (await search(http, shared_bridge, session_id, method, "hunter2"))[0]
            ) != expected:
                assert loop.time() < deadline, (method, found, expected)
        for term in ("hunter2", "VICTIM", "PASSWORD"):
            _, pages = await search(http, shared_bridge, attacker, method, term)
            assert secret not in pages, (method, term)
            assert "VICTIM" not in pages, (method, term)
    told = json.dumps(await session_log(http, shared_bridge, attacker))
    assert secret not in told
    assert "VICTIM" not in told


def names_threads(definitions: dict[str, Any], schema: Any, seen: set[str]) -> bool:
    """Whether a schema can carry a thread (a `Thread`, a `ThreadId`, a property named
    `...threadId(s)`, or a string described as a thread id), through its references."""
    if isinstance(schema, list):
        return any(names_threads(definitions, item, seen) for item in schema)
    if not isinstance(schema, dict):
        return False
    for key, value in schema.items():
        if key == "$ref":
            name = value.rsplit("/definitions/", 1)[-1]
            if name in ("v2/Thread", "v2/ThreadId"):
                return True
            if name not in seen:
                seen.add(name)
                if names_threads(definitions, definitions.get(name), seen):
                    return True
        elif key == "properties" and isinstance(value, dict):
            if any(re.search(r"thread(id|ids)$", name, re.I) for name in value):
                return True
            if names_threads(definitions, list(value.values()), seen):
                return True
        elif key == "description":
            if isinstance(value, str) and re.search(r"thread ids?\b", value, re.I):
                return True
        elif names_threads(definitions, value, seen):
            return True
    return False


async def test_every_answer_or_news_of_threads_it_does_not_name_is_the_tenants_to_filter(
    codex_bin, tmp_path
):
    """Calls on a thread (`threadId` in their params) are the tenant's to disguise; the
    others whose answer can carry threads of the whole process (listings, searches) must
    be ones it filters or opens, and the news that carries a thread elsewhere than in
    such a field must be news it reads. A release that adds one fails here until
    bridge/process/tenancy.py handles it (as `thread/search` once went unfiltered)."""
    await asyncio.to_thread(codex_schema.generate, codex_bin, tmp_path, True)
    definitions = codex_schema.read_bundle(tmp_path)

    def about_a_thread(name: str | None) -> bool:
        fields = definitions.get(name or "", {}).get("properties", {})
        return any(field in fields for field in tenancy.THREAD_FIELDS)

    answering: dict[str, set[str]] = {}
    for request in definitions["ClientRequest"]["oneOf"]:
        params = request["properties"].get("params", {}).get("$ref", "").rsplit("/", 1)[-1]
        stem = params.removeprefix("v2/").removesuffix("Params")
        answering.setdefault(stem, set()).add(request["properties"]["method"]["enum"][0])
    shown: set[str] = set()
    for name, schema in definitions.items():
        if not name.endswith("Response") or not names_threads(definitions, schema, set()):
            continue
        if about_a_thread(name.removesuffix("Response") + "Params"):
            continue
        stem = name.removeprefix("v2/").removesuffix("Response")
        assert stem in answering, f"which call answers {name}? classify it in tenancy.py"
        shown |= answering[stem]
    assert shown - set(tenancy.LISTINGS) - set(tenancy.OPENERS) == set()
    assert {"thread/list", "thread/search", "thread/start"} <= shown
    news = {
        message["properties"]["method"]["enum"][0]
        for kind in ("ServerNotification", "ServerRequest")
        for message in definitions[kind]["oneOf"]
        if names_threads(definitions, message["properties"].get("params"), set())
        and not about_a_thread(
            message["properties"].get("params", {}).get("$ref", "").rsplit("/definitions/", 1)[-1]
        )
    }
    assert news - {"thread/started", "thread/search/partial"} == set()


SPAWN_AGENT = {
    "functionCall": {
        "name": "spawn_agent",
        "namespace": "multi_agent_v1",
        "arguments": {"message": "Say hi."},
    }
}


async def test_a_sub_agent_belongs_to_the_session_whose_thread_spawned_it(
    shared_bridge, http, model, workspace
):
    """codex 0.169.0 announces no `thread/started` for a sub-agent and tells every
    connection of its turn; the parent's `spawnAgent` item names it, and from then on
    it is the parent's session's: its news reaches that session alone (the earliest,
    sent before the item, too), and it is no other session's to read."""
    owner = await create_session(http, shared_bridge, None)
    bystander = await create_session(http, shared_bridge, None)
    thread_id = await start_thread(http, shared_bridge, owner, cwd=str(workspace))
    model.model.add(SPAWN_AGENT)
    async with http.get(f"{shared_bridge}/v1/sessions/{owner}/events/stream") as stream:
        reader = SseReader(stream)
        await start_turn(http, shared_bridge, owner, thread_id, "Spawn a helper.")
        completed: set[str] = set()

        def both_done(frame) -> bool:
            event = frame.json()
            if event["method"] == "turn/completed":
                completed.add(event["params"]["threadId"])
            return len(completed) == 2

        heard = events(await reader.until(both_done, timeout=WAIT))
    spawns = [
        e["params"]["item"]
        for e in heard
        if e["method"] == "item/completed" and e["params"]["item"]["type"] == "collabAgentToolCall"
    ]
    [agent] = spawns[0]["receiverThreadIds"]
    assert completed == {thread_id, agent}
    about_agent = [e["method"] for e in heard if e["params"].get("threadId") == agent]
    # Its first news, idle on creation, is there whether or not it came before the item.
    assert about_agent[0] == "thread/status/changed", about_agent
    assert {"turn/started", "item/agentMessage/delta", "turn/completed"} <= set(about_agent)
    status, body = await call(http, shared_bridge, owner, "thread/read", {"threadId": agent})
    assert status == 200, body
    status, body = await call(http, shared_bridge, bystander, "thread/read", {"threadId": agent})
    assert (status, body["message"]) == (502, f"thread not loaded: {agent}")
    told = json.dumps(await session_log(http, shared_bridge, bystander))
    assert agent not in told
    assert thread_id not in told


async def test_attachment_owners_are_the_sessions_own_threads(shared_bridge, http, workspace):
    """`thread/attachmentOwner/list` names every thread with an attachment of that
    identity; a session is shown its own (and the cursor, which names one, is a token)."""
    sessions = [await create_session(http, shared_bridge, None) for _ in range(2)]
    owned: dict[str, list[str]] = {s: [] for s in sessions}
    for session_id in (*sessions, *sessions):
        thread_id = await start_thread(http, shared_bridge, session_id, cwd=str(workspace))
        await run_turn(http, shared_bridge, session_id, thread_id, "Hello.")
        # codex takes an attachment on a thread it lists (a little after the turn).
        await until_listed(http, shared_bridge, session_id, [thread_id])
        attachment = {"attachmentType": "pr", "identityKey": "k1", "payload": {}}
        status, body = await call(
            http,
            shared_bridge,
            session_id,
            "thread/attachment/add",
            {**attachment, "threadId": thread_id},
        )
        assert status == 200, body
        owned[session_id].append(thread_id)
    for session_id, threads in owned.items():
        for limit in (1, 10):
            seen: list[str] = []
            cursor = None
            for _ in range(10):
                params = {"attachmentType": "pr", "identityKey": "k1", "limit": limit}
                status, body = await call(
                    http,
                    shared_bridge,
                    session_id,
                    "thread/attachmentOwner/list",
                    {**params, "cursor": cursor},
                )
                assert status == 200, body
                seen += [owner["threadId"] for owner in body["result"]["data"]]
                cursor = body["result"]["nextCursor"]
                if cursor is None:
                    break
                assert cursor.startswith("tc_"), cursor
            assert sorted(seen) == sorted(threads), (limit, seen)


async def test_an_idle_session_hears_nothing_of_other_sessions_threads(
    shared_bridge, http, model, workspace
):
    """codex tells every connection of every thread's status, name and archive; the
    bridge passes each session only its own threads' news, so a bystander's log stays
    empty however busy the others are."""
    bystander = await create_session(http, shared_bridge, None)
    worker = await create_session(http, shared_bridge, None)
    thread_id = await start_thread(http, shared_bridge, worker, cwd=str(workspace))
    async with http.get(f"{shared_bridge}/v1/sessions/{worker}/events/stream") as stream:
        reader = SseReader(stream)
        await start_turn(http, shared_bridge, worker, thread_id, "Work.")
        await reader.until(method_is("turn/completed"), timeout=WAIT)
        status, body = await call(
            http, shared_bridge, worker, "thread/name/set", {"threadId": thread_id, "name": "n"}
        )
        assert status == 200, body
        await reader.until(method_is("thread/name/updated"), timeout=WAIT)
        status, body = await call(
            http, shared_bridge, worker, "thread/archive", {"threadId": thread_id}
        )
        assert status == 200, body
        await reader.until(method_is("thread/archived"), timeout=WAIT)
    # The bystander's own thread: its announcement comes after all of the above.
    own = await start_thread(http, shared_bridge, bystander, cwd=str(workspace))
    heard = await session_log(http, shared_bridge, bystander)
    about_threads = [e for e in heard if e["method"] not in CONNECTION_NEWS]
    assert [e["method"] for e in about_threads] == ["thread/started"], heard
    assert about_threads[0]["params"]["thread"]["id"] == own
    assert thread_id not in json.dumps(heard)


async def test_a_server_request_reaches_only_the_session_whose_thread_raised_it(
    shared_bridge, http, model, workspace
):
    """Another session can neither subscribe to the thread (resume is refused) nor
    receive its command approval: only the owner is asked, and its answer runs it."""
    owner = await create_session(http, shared_bridge, None)
    other = await create_session(http, shared_bridge, None)
    thread_id = await start_thread(http, shared_bridge, owner, **untrusted_thread(workspace))
    await run_turn(http, shared_bridge, owner, thread_id, "Hello.")
    status, body = await call(http, shared_bridge, other, "thread/resume", {"threadId": thread_id})
    assert status == 502, body
    assert body["message"] == f"no rollout found for thread id {thread_id}"
    model.model.add({"execCommand": {"cmd": "touch owned.txt"}}, {"text": "Touched it."})
    async with http.get(f"{shared_bridge}/v1/sessions/{owner}/events/stream") as stream:
        reader = SseReader(stream)
        await start_turn(http, shared_bridge, owner, thread_id, "Touch the file.")
        request = (await reader.until(lambda f: f.event == "request", timeout=WAIT))[-1].json()
        assert request["method"] == COMMAND_APPROVAL
        async with http.get(f"{shared_bridge}/v1/sessions") as response:
            summaries = {s["sessionId"]: s for s in (await response.json())["sessions"]}
        assert summaries[owner]["pendingRequests"] == [request["requestKey"]]
        assert summaries[other]["pendingRequests"] == []
        url = f"{shared_bridge}/v1/sessions/{owner}/requests/{request['requestKey']}/result"
        async with http.post(url, json={"result": {"decision": "accept"}}) as answered:
            assert answered.status == 200, await answered.text()
        await reader.until(method_is("turn/completed"), timeout=WAIT)
    assert (workspace / "owned.txt").exists()
    heard = await session_log(http, shared_bridge, other)
    assert thread_id not in json.dumps(heard)


async def test_a_session_owns_what_it_forks_and_no_other_does(
    shared_bridge, http, model, workspace
):
    owner = await create_session(http, shared_bridge, None)
    other = await create_session(http, shared_bridge, None)
    thread_id = await start_thread(http, shared_bridge, owner, cwd=str(workspace))
    await run_turn(http, shared_bridge, owner, thread_id, "Hello.")
    status, body = await call(http, shared_bridge, owner, "thread/fork", {"threadId": thread_id})
    assert status == 200, body
    fork = body["result"]["thread"]["id"]
    await run_turn(http, shared_bridge, owner, fork, "Again.")
    status, body = await call(http, shared_bridge, owner, "thread/read", {"threadId": fork})
    assert status == 200, body
    status, body = await call(http, shared_bridge, other, "thread/read", {"threadId": fork})
    assert status == 502, body
    assert body["message"] == f"thread not loaded: {fork}"
    assert sorted(await list_threads(http, shared_bridge, owner, "thread/list")) == sorted(
        [thread_id, fork]
    )


async def test_a_running_codex_over_ws_with_its_token(
    model, codex_home, workspace, serve, codex_bin, http, tmp_path
):
    """`--app-server-url ws://...`: the bridge connects to a codex it did not start, with
    the token of `--ws-auth capability-token`; a wrong token is a 502, never shown."""
    token = "capability-" + os.urandom(8).hex()
    token_file = tmp_path / "ws-token"
    token_file.write_text(token)
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    listen = ["--listen", "ws://127.0.0.1:0", "--ws-auth", "capability-token"]
    codex = await asyncio.create_subprocess_exec(
        *command,
        *listen,
        "--ws-token-file",
        str(token_file),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert codex.stderr is not None
        url = None
        async with asyncio.timeout(WAIT):
            while url is None:
                line = (await codex.stderr.readline()).decode()
                assert line, "codex ended before it listened"
                if "listening on: ws://" in line:
                    url = line.split("listening on: ", 1)[1].strip()
        good = AppServerSettings(mode="shared", url=url, token=token)
        base = await serve(trusted_bridge_app(["unused"], RestLimits(), good))
        session_id = await create_session(http, base, None)
        assert await start_thread(http, base, session_id, cwd=str(workspace))
        state = await shared_state(http, base)
        assert (state["source"], state["state"], state["connections"]) == ("url", "external", 1)
        wrong = AppServerSettings(mode="shared", url=url, token="not-" + token)
        refused = await serve(trusted_bridge_app(["unused"], RestLimits(), wrong))
        async with http.post(f"{refused}/v1/sessions", json={}) as response:
            body = await response.text()
            assert response.status == 502, body
        assert "app_server_spawn_failed" in body
        assert token not in body
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(codex.pid, signal.SIGKILL)
        await codex.wait()


async def test_what_codex_listens_on_is_removed_and_only_its_directory_stays(
    model, codex_home, workspace, codex_bin, http, tmp_path, monkeypatch
):
    """codex 0.169.0 makes `--listen unix://PATH` a link to a socket of its own in
    `/tmp/codex-daemon-<uid>/` (a private TMPDIR does not move it). When the bridge stops,
    its own socket directory is gone, and so are codex's socket and lock; the directory
    `/tmp/codex-daemon-<uid>` is codex's, shared by every codex of the user, and stays."""
    from scenarios.harness import serve_app

    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    app = trusted_bridge_app(command, RestLimits(), SHARED)
    runner, base = await serve_app(app)
    try:
        await create_session(http, base, None)
        socket_dir = app[BACKEND].launcher.socket_dir
        assert socket_dir is not None
        target = os.readlink(os.path.join(socket_dir, "app-server.sock"))
        assert os.path.dirname(target) == f"/tmp/codex-daemon-{os.getuid()}"
        assert _present(target)
    finally:
        await runner.cleanup()
    assert not _present(socket_dir)
    assert not _present(target)
    assert not _present(target + ".lock")
    assert not list(private_tmp.iterdir())  # nothing in the TMPDIR codex was given either


def _present(path: str) -> bool:
    return os.path.lexists(path)


def _dead(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


#: A probe every 0.2 s; the real codex answers `thread/loaded/list` in milliseconds, and
#: has 5 s (it shares two cores with whatever else runs).
PROBED = RestLimits(liveness_interval_ms=200, liveness_timeout_ms=5000)
WEDGED = {
    "exitCode": None,
    "signal": "SIGKILL",
    "stderrTail": "",
    "connection": "the shared app-server stopped answering and was killed",
}


async def test_a_stopped_codex_is_found_wedged_killed_and_restarted(
    model, codex_home, workspace, serve, codex_bin, http
):
    """SIGSTOP of the shared codex (its whole group): the socket still accepts, nothing
    answers. The liveness probe finds it: every session ends with an `exit` event that
    says so, a call waiting on it fails, codex is killed and a new one serves."""
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    base = await serve(trusted_bridge_app(command, PROBED, SHARED))
    sessions = [await create_session(http, base, None) for _ in range(2)]
    await start_thread(http, base, sessions[0], cwd=str(workspace))
    first = await shared_state(http, base)
    pid = first["pid"]
    assert (first["connections"], first["restarts"]) == (2, 0)
    streams = [
        await http.get(f"{base}/v1/sessions/{s}/events/stream?after=0").__aenter__()
        for s in sessions
    ]
    try:
        os.killpg(pid, signal.SIGSTOP)
        waiting = asyncio.ensure_future(call(http, base, sessions[1], "thread/start", {}))
        for stream in streams:
            frames = await SseReader(stream).until(lambda f: f.event == "exit", timeout=WAIT)
            assert frames[-1].json()["params"] == WEDGED
        status, body = await waiting
        assert (status, body.get("error")) == (502, "app_server_exited"), body
        await exited([pid], WAIT)
        assert _dead(pid)
    finally:
        for stream in streams:
            stream.release()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)
    fresh = await create_session(http, base, None)
    assert await start_thread(http, base, fresh, cwd=str(workspace))
    state = await shared_state(http, base)
    assert (state["state"], state["restarts"], state["connections"]) == ("running", 1, 1)
    assert state["pid"] not in (None, pid)
    assert (state["lastExit"]["signal"], state["lastExit"]["wedged"]) == ("SIGKILL", True)


async def test_a_session_that_stops_its_codex_with_command_exec_does_not_hang_the_others(
    model, codex_home, workspace, serve, codex_bin, http
):
    """A session's `command/exec` of `kill -STOP $PPID` stops the shared codex itself
    (trusted preset: the method is allowed). The others are not left hanging: the probe
    finds it wedged, their sessions end, and a new codex serves new ones."""
    command = model.codex_command(codex_bin, codex_home=codex_home, cwd=workspace)
    base = await serve(trusted_bridge_app(command, PROBED, SHARED))
    attacker, bystander = [await create_session(http, base, None) for _ in range(2)]
    pid = (await shared_state(http, base))["pid"]
    async with http.get(f"{base}/v1/sessions/{bystander}/events/stream?after=0") as stream:
        try:
            # The shell stays (exec sleep) rather than exit at once: with it exiting, the
            # stopped codex went on and answered the call in about 1 run in 8 on a busy
            # machine (its child's exit woke it), and the test saw a 200, not a wedge.
            params = {
                "command": ["sh", "-c", "kill -STOP $PPID; exec sleep 30"],
                "sandboxPolicy": {"type": "dangerFullAccess"},
            }
            status, body = await call(http, base, attacker, "command/exec", params)
            assert (status, body.get("error")) == (502, "app_server_exited"), body
            frames = await SseReader(stream).until(lambda f: f.event == "exit", timeout=WAIT)
            assert frames[-1].json()["params"] == WEDGED
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)
    fresh = await create_session(http, base, None)
    assert await start_thread(http, base, fresh, cwd=str(workspace))
    state = await shared_state(http, base)
    assert (state["restarts"], state["lastExit"]["wedged"]) == (1, True)
