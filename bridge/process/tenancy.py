"""Shared mode: a session is a tenant of the shared app-server, and its threads are its own.

codex serves every connection from one store of threads (any connection can read, list,
resume, answer for or delete any thread) and tells every connection of every thread. A
:class:`Tenant`, the filter of one connection's :class:`~bridge.process.peer.JsonRpcPeer`,
knows what that connection owns and applies the rules, in one place:

- It owns the threads its ``thread/start``, ``thread/fork`` or ``review/start`` answered,
  those codex announces as coming from them (a fork), and the sub-agents they spawn
  (codex 0.169.0 announces none: the parent's ``spawnAgent`` item names them).
- A call that names a thread it does not own (a UUID: anything else names no thread)
  goes to codex with a fresh random id in its place, and codex's answer comes back with
  the caller's id: what codex says of a thread that does not exist, so nothing tells "not
  yours" from "no such thread". The experimental ``path`` of ``thread/resume`` and
  ``thread/fork`` (any thread's rollout file) is replaced by a file that does not exist.
- A listing or search shows owned threads only (partial results only if all are), reading
  on through codex's pages to fill one; its cursors become the connection's own tokens.
- A notification or server request about another thread is not passed on (a server
  request is left to its owner, who answers it).
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections import OrderedDict, deque
from typing import Any

from bridge.process.peer import JsonRpcPeer, RpcError

#: Parameters that name a thread the call acts on.
THREAD_FIELDS = ("threadId", "beforeThreadId", "conversationId")
#: Calls whose answer names a thread the connection then owns, and where.
OPENERS = {
    "thread/start": ("thread", "id"),
    "thread/fork": ("thread", "id"),
    "review/start": ("reviewThreadId",),
}
#: Calls whose (experimental) ``path`` names a rollout file to open instead of a thread.
PATH_CALLS = frozenset({"thread/resume", "thread/fork"})
#: Fields of a thread that name the thread it came from (a fork, a sub-agent).
ORIGINS = ("parentThreadId", "forkedFromId", "attachedToThreadId")
#: Items of an owned thread whose receivers are new threads of the same owner.
SPAWNING_TOOLS = frozenset({"spawnAgent"})
#: Listings and searches (every thread of the process): where each item names its
#: thread (no key: the item is the id itself).
LISTINGS: dict[str, tuple[str, ...]] = {
    "thread/list": ("id",),
    "thread/loaded/list": (),
    "thread/attachmentOwner/list": ("threadId",),
    "thread/search": ("thread", "id"),
    "thread/search/stream": ("thread", "id"),
}
#: Pages of codex's a listing reads at most to fill one page of owned threads.
MAX_LIST_ROUNDS = 16
#: Cursor tokens a connection remembers (the oldest are forgotten first).
MAX_CURSORS = 256
#: Frames about threads a connection does not own, kept (the newest, up to this many
#: bytes, by a connection that owns a thread) in case one is about a sub-agent of its
#: own not yet named (see Tenant.admit_notification). A sub-agent's first frames are a
#: few hundred bytes.
LIMBO_BYTES = 16 * 1024


def canonical(thread_id: str) -> str | None:
    """The id as codex prints it (lower-case, hyphenated), or None when it is no UUID."""
    try:
        return str(uuid.UUID(thread_id))
    except ValueError:
        return None


def _dig(value: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _replace(value: Any, substitutes: dict[str, str]) -> Any:
    """``value`` with every substitute id (or token), wherever it appears in a string,
    put back."""
    if isinstance(value, str):
        for substitute, original in substitutes.items():
            value = value.replace(substitute, original)
        return value
    if isinstance(value, list):
        return [_replace(item, substitutes) for item in value]
    if isinstance(value, dict):
        return {key: _replace(item, substitutes) for key, item in value.items()}
    return value


def _undisguised(exc: RpcError, substitutes: dict[str, str]) -> RpcError:
    """codex's error with the caller's ids (or tokens) put back where it quotes ours."""
    return RpcError(exc.code, _replace(exc.message, substitutes), _replace(exc.data, substitutes))


class Tenant:
    """The filter of one connection's peer: the threads it owns, what it shows of
    codex's news and how it asks (see above)."""

    def __init__(self) -> None:
        self._owned: set[str] = set()
        #: Token → (the listing it came from, codex's cursor).
        self._cursors: OrderedDict[str, tuple[str, str]] = OrderedDict()
        #: The latest frames about threads not owned, and their size.
        self._limbo: deque[tuple[str, bytes]] = deque()
        self._limbo_bytes = 0

    def owns(self, thread_id: object) -> bool:
        return isinstance(thread_id, str) and (
            thread_id in self._owned or canonical(thread_id) in self._owned
        )

    def _add(self, thread_id: object) -> None:
        if isinstance(thread_id, str):
            self._owned.add(canonical(thread_id) or thread_id)

    def _foreign_thread(self, params: Any) -> str | None:
        """The thread, not the connection's own, that a message is about (or None)."""
        if not isinstance(params, dict):
            return None
        for field in THREAD_FIELDS:
            value = params.get(field)
            if isinstance(value, str) and not self.owns(value):
                thread_id = canonical(value)
                if thread_id is not None:
                    return thread_id
        return None

    # -- what codex sends ----------------------------------------------------------

    def admit_notification(self, method: str, params: Any, frame: bytes) -> bool:
        """codex tells every connection of every thread (`thread/started`, status, name,
        archive, ...): pass on only what concerns this connection's own threads (codex
        answers a `thread/start` before it announces it).

        codex may tell of a sub-agent (its status) before the parent's `spawnAgent` item
        names it: the latest such frames are kept, and passed on once it is named."""
        if method == "thread/started":
            return self._announced(params)
        if method == "thread/search/partial":
            # A search's provisional rows (its answer is filtered): all owned, or dropped.
            rows = _dig(params, ("data",))
            return bool(rows == self._owned_items("thread/search", rows))
        return self.admit_request(params, frame)

    def _announced(self, params: Any) -> bool:
        """``thread/started``: True (and owned from now on) if the thread is the
        connection's own or comes from one of its threads."""
        thread = params.get("thread") if isinstance(params, dict) else None
        if not isinstance(thread, dict) or not isinstance(thread.get("id"), str):
            return True  # names no thread
        if self.owns(thread["id"]) or any(self.owns(thread.get(key)) for key in ORIGINS):
            self._add(thread["id"])
            return True
        return False

    def admit_request(self, params: Any, frame: bytes) -> bool:
        """A server request about another connection's thread is not this one's to
        answer: it is left to the owner (an answer from here would settle it). Kept in
        limbo, as a notification is, in case it is about a sub-agent not yet named."""
        foreign = self._foreign_thread(params)
        if foreign is None:
            return True
        if len(frame) <= LIMBO_BYTES and self._owned:
            # (Too big for it, or no thread of its own to have a sub-agent: dropped.)
            self._limbo.append((foreign, frame))
            self._limbo_bytes += len(frame)
            while self._limbo_bytes > LIMBO_BYTES:
                self._limbo_bytes -= len(self._limbo.popleft()[1])
        return False

    def delivered(self, method: str, params: Any) -> list[bytes]:
        """The frames kept in limbo about the sub-agents this notification names as
        spawned by an owned thread, now owned too."""
        spawned = self._spawned(method, params)
        if not spawned or not self._limbo:
            return []
        owned = set(spawned)
        kept = [entry for entry in self._limbo if entry[0] not in owned]
        released = [frame for thread_id, frame in self._limbo if thread_id in owned]
        self._limbo = deque(kept)
        self._limbo_bytes = sum(len(frame) for _, frame in kept)
        return released

    def _spawned(self, method: str, params: Any) -> list[str]:
        """The sub-agents an owned thread's item says it spawned, now owned too (only a
        spawn: a tool call that sends to or resumes an agent names a thread it did not
        create)."""
        if method not in ("item/started", "item/completed") or not isinstance(params, dict):
            return []
        item = params.get("item")
        if not isinstance(item, dict) or item.get("tool") not in SPAWNING_TOOLS:
            return []
        receivers = item.get("receiverThreadIds")
        if item.get("type") != "collabAgentToolCall" or not isinstance(receivers, list):
            return []
        new = [r for r in receivers if isinstance(r, str) and not self.owns(r)]
        for thread_id in new:
            self._add(thread_id)
        return new

    # -- calls ---------------------------------------------------------------------

    async def call(self, peer: JsonRpcPeer, method: str, params: Any, timeout: float) -> Any:
        """A call on a thread this connection does not own is answered by codex as for
        a thread that does not exist; a listing shows this connection's threads only."""
        if method in LISTINGS:
            return await self._list_owned(peer, method, params, timeout)
        hook = None
        if method in OPENERS:
            opened = OPENERS[method]

            def hook(result: Any) -> None:
                # The thread the call opened is the connection's now.
                self._add(_dig(result, opened))

        disguised, substitutes = self._disguise(method, params)
        if not substitutes:
            return await peer.request(method, params, timeout, hook)
        try:
            result = await peer.request(method, disguised, timeout, hook)
        except RpcError as exc:
            raise _undisguised(exc, substitutes) from None
        return _replace(result, substitutes)

    def _disguise(self, method: str, params: Any) -> tuple[Any, dict[str, str]]:
        """``params`` with each thread the connection does not own replaced by a fresh
        random id, and the map from those ids back to the caller's (as codex prints an
        id: lower case, hyphenated)."""
        if not isinstance(params, dict):
            return params, {}
        substitutes: dict[str, str] = {}
        disguised = params
        path = params.get("path")
        if method in PATH_CALLS and isinstance(path, str) and path:
            substitute = f"/nonexistent-{uuid.uuid4()}/rollout.jsonl"
            substitutes[substitute] = path
            disguised = dict(params)
            disguised["path"] = substitute
        for field in THREAD_FIELDS:
            value = params.get(field)
            if not isinstance(value, str) or self.owns(value):
                continue
            original = canonical(value)
            if original is None:
                continue  # no UUID: codex refuses it as such, owned or not
            substitute = str(uuid.uuid4())
            substitutes[substitute] = original
            if disguised is params:
                disguised = dict(params)
            disguised[field] = substitute
        return disguised, substitutes

    # -- listings ------------------------------------------------------------------

    def _token_for(self, method: str, cursor: Any) -> Any:
        """A token of this connection's for a codex cursor (which may name a thread)."""
        if not isinstance(cursor, str):
            return cursor
        token = "tc_" + secrets.token_urlsafe(18)
        self._cursors[token] = (method, cursor)
        while len(self._cursors) > MAX_CURSORS:
            self._cursors.popitem(last=False)
        return token

    def _owned_items(self, method: str, items: Any) -> list[Any]:
        if not isinstance(items, list):
            return []
        return [item for item in items if self.owns(_dig(item, LISTINGS[method]))]

    async def _list_owned(self, peer: JsonRpcPeer, method: str, params: Any, timeout: float) -> Any:
        """Read codex's pages until one page of owned threads is full (or codex has no
        more, or :data:`MAX_LIST_ROUNDS` pages were read); cursors are tokens."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        asked = dict(params) if isinstance(params, dict) else {}
        #: A token of this connection's, and codex's cursor behind it, to put back.
        back: dict[str, str] = {}
        token = asked.get("cursor")
        if isinstance(token, str) and token in self._cursors:
            listing, cursor = self._cursors[token]
            # Else the value goes as is: codex judges it, and its answer names only it.
            if listing == method:
                self._cursors.move_to_end(token)
                asked["cursor"] = cursor
                if cursor != token:
                    back[cursor] = token
        limit = asked.get("limit")
        #: How many owned threads make a page (codex's own page size if none is asked).
        wanted = limit if isinstance(limit, int) and not isinstance(limit, bool) else -1
        first: dict[str, Any] | None = None
        kept: list[Any] = []
        after: Any = None
        for _ in range(MAX_LIST_ROUNDS):
            try:
                result = await peer.request(
                    method, asked if asked or params is not None else None, timeout
                )
            except RpcError as exc:
                if first is None:
                    # codex may quote its cursor, which names a thread: quote the token.
                    raise _undisguised(exc, back) from None
                break  # what was read so far is a page, and its cursor goes on from there
            except TimeoutError:
                if first is None:
                    raise
                break
            if not isinstance(result, dict):
                result = {}
            page = result.get("data")
            kept += self._owned_items(method, page)
            if first is None:
                first = result
                if wanted < 0:
                    wanted = len(page) if isinstance(page, list) else 0
            after = result.get("nextCursor")
            timeout = deadline - loop.time()
            if not isinstance(after, str) or len(kept) >= wanted or timeout <= 0:
                break
            asked["cursor"] = after
            asked["limit"] = wanted - len(kept)
        assert first is not None
        # The first page's result with the owned items, the last page's cursor and this
        # connection's tokens for the cursors. A page with nothing of the connection's
        # has no backwards cursor (codex's would say other threads are there).
        shown = dict(first)
        shown["data"] = kept
        if "nextCursor" in shown or after is not None:
            shown["nextCursor"] = self._token_for(method, after)
        if "backwardsCursor" in shown:
            backwards = shown["backwardsCursor"] if kept else None
            shown["backwardsCursor"] = self._token_for(method, backwards)
        states = shown.get("readStates")
        if isinstance(states, dict):
            shown["readStates"] = {key: state for key, state in states.items() if self.owns(key)}
        return shown
