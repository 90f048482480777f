"""The thread methods, as `codex app-server` 0.169.0 answers them.

`thread/start`, `thread/read`, `thread/list`, `thread/loaded/list`, `thread/name/set`,
`thread/resume`, `thread/fork`, `thread/archive`, `thread/unarchive` and `turn/steer`: results, the
notifications around them and the error messages were recorded from the real server
(see the README). Threads live in this process only; there are no rollout files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

from fakes.app_server import shapes
from fakes.app_server.replies import Call, Reply, invalid, missing_field
from fakes.app_server.turns import ThreadState
from fakes.app_server.wire import notification, now_s

if TYPE_CHECKING:
    from fakes.app_server.host import Host

USER_INPUT_TYPES = ("text", "image", "localImage", "audio", "localAudio", "skill", "mention")

_READ_HYDRATION_NOTICE = (
    "Full-history hydration is deprecated for paginated threads; omit `includeTurns` or "
    "set it to `false`, then page with `thread/turns/list` and `thread/items/list`."
)
_RESUME_HYDRATION_NOTICE = (
    "Full-history hydration is deprecated for paginated threads; use `excludeTurns: true`, "
    "then page with `thread/turns/list` and `thread/items/list`."
)
# Settings a fork inherits unless its params set them: param, and the results it drives.
_INHERITED = (
    ("approvalPolicy", ()),
    ("approvalsReviewer", ()),
    ("sandbox", ("activePermissionProfile",)),
)


def check_input(inputs: Any) -> Reply | None:
    """The real error for `input` that is not a list of known user-input kinds."""
    if not isinstance(inputs, list):
        return invalid("Invalid request: invalid type: expected a sequence for `input`")
    for entry in inputs:
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind not in USER_INPUT_TYPES:
            expected = ", ".join(f"`{name}`" for name in USER_INPUT_TYPES)
            return invalid(f"Invalid request: unknown variant `{kind}`, expected one of {expected}")
    return None


def _no_rollout(thread_id: Any) -> Reply:
    return invalid(f"no rollout found for thread id {thread_id}")


class ThreadMethods:
    """The built-in thread methods of one server."""

    def __init__(self, server: Host) -> None:
        self.server = server

    def handlers(self) -> dict[str, Callable[[Call], Reply]]:
        """Method name → handler, for the server's built-ins."""
        return {
            "thread/start": self.start,
            "thread/read": self.read,
            "thread/list": self.list,
            "thread/loaded/list": self.loaded,
            "thread/name/set": self.set_name,
            "thread/resume": self.resume,
            "thread/fork": self.fork,
            "thread/archive": self.archive,
            "thread/unarchive": self.unarchive,
            "turn/steer": self.steer,
        }

    def _notify(self, method: str, params: Any) -> None:
        params = self.server.fit.notification(method, params)
        self.server.out.send(notification(method, params))

    def _find(self, call: Call, *required: str) -> tuple[ThreadState | None, Reply | None]:
        """The thread `call` names, or the reply for a missing field (thread None)."""
        missing = missing_field(call.params, "threadId", *required)
        if missing:
            return None, missing
        return self.server.threads.get(str(call.params["threadId"])), None

    def create(self, params: dict[str, Any], source: ThreadState | None = None) -> ThreadState:
        """A new thread from `thread/start` params, or a fork of `source`."""
        cwd = str(params.get("cwd") or (source.cwd if source else os.getcwd()))
        inherited = source.settings if source else {}
        thread_id = self.server.ids.uuid7()
        info = shapes.thread_object(
            thread_id=thread_id,
            cwd=cwd,
            model=params.get("model") or inherited.get("model") or shapes.DEFAULT_MODEL,
            model_provider=params.get("modelProvider")
            or inherited.get("modelProvider")
            or shapes.DEFAULT_MODEL_PROVIDER,
            version=self.server.version,
            originator=str(self.server.client_info.get("name", "")),
            created_at=now_s(),
        )
        settings = shapes.thread_start_result(info, params)
        del settings["thread"]
        if source is not None:
            info["forkedFromId"] = source.id
            # A fork keeps the source's policies unless the params change them.
            for key, follows in _INHERITED:
                if params.get(key) is None:
                    for name in (key, *follows):
                        settings[name] = inherited[name]
        thread = ThreadState(thread_id, cwd, info=info, settings=settings)
        self.server.threads[thread_id] = thread
        return thread

    def start(self, call: Call) -> Reply:
        """`thread/start`: the result, then `thread/started`."""
        thread = self.create(call.params)
        return Reply(
            {"thread": thread.info, **thread.settings},
            after=lambda: self._notify("thread/started", {"thread": thread.info}),
        )

    def read(self, call: Call) -> Reply:
        """`thread/read`: the thread, its turns only with `includeTurns` (deprecated)."""
        thread, missing = self._find(call)
        if missing:
            return missing
        if thread is None:
            return invalid(f"thread not loaded: {call.params['threadId']}")
        include = call.params.get("includeTurns") is True
        if include:
            self._notify("deprecationNotice", {"summary": _READ_HYDRATION_NOTICE, "details": None})
        return Reply({"thread": thread.view(turns=include), "readState": self._read_state(thread)})

    def _read_state(self, thread: ThreadState) -> shapes.Json | None:
        if not thread.history:
            return None
        if thread.read_revision is None:
            thread.read_revision = self.server.ids.uuid4()
        first_unread = None
        if not thread.read_revision.startswith("initial:"):
            first_unread = {"type": "turn", "turnId": thread.history[0]["id"]}
        return {"firstUnread": first_unread, "revision": thread.read_revision}

    def list(self, call: Call) -> Reply:
        """`thread/list`: threads with a rollout (at least one turn), newest first."""
        archived = call.params.get("archived") is True
        threads = [
            thread
            for thread in self.server.threads.values()
            if thread.history and thread.archived == archived
        ]
        threads.sort(key=lambda thread: thread.id, reverse=True)
        after = call.params.get("cursor")
        if isinstance(after, str):
            # The real cursor: the last listed thread's creation second and id.
            _, bar, last_id = after.rpartition("|")
            if not bar or not last_id:
                return invalid(f"invalid cursor: {after}")
            threads = [thread for thread in threads if thread.id < last_id]
        limit = call.params.get("limit")
        next_cursor = None
        if isinstance(limit, int) and 0 < limit < len(threads):
            threads = threads[:limit]
            last = threads[-1]
            created = datetime.fromtimestamp(int(last.info["createdAt"]), UTC)
            next_cursor = created.strftime("%Y-%m-%dT%H:%M:%SZ") + f"|{last.id}"
        cursor = None
        if threads:
            millis = int(threads[0].id.replace("-", "")[:12], 16)
            stamp = datetime.fromtimestamp(millis / 1000, UTC)
            cursor = stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{millis % 1000:03d}Z"
        return Reply(
            {
                "data": [_listed(thread) for thread in threads],
                "readStates": {thread.id: self._read_state(thread) for thread in threads},
                "nextCursor": next_cursor,
                "backwardsCursor": cursor,
            }
        )

    def loaded(self, call: Call) -> Reply:
        """`thread/loaded/list`: the ids of the threads in memory, oldest first; with a
        `limit` short of the rest, `nextCursor` is the last id listed."""
        ids = sorted(thread.id for thread in self.server.threads.values() if not thread.archived)
        after = call.params.get("cursor")
        if isinstance(after, str):
            ids = [thread_id for thread_id in ids if thread_id > after]
        limit = call.params.get("limit")
        next_cursor = None
        if isinstance(limit, int) and 0 < limit < len(ids):
            ids = ids[:limit]
            next_cursor = ids[-1]
        return Reply({"data": ids, "nextCursor": next_cursor})

    def set_name(self, call: Call) -> Reply:
        """`thread/name/set`: `{}`, then `thread/name/updated`."""
        thread, missing = self._find(call, "name")
        if missing:
            return missing
        if thread is None:
            return _no_rollout(call.params["threadId"])
        thread.name = call.params["name"]
        update = {"threadId": thread.id, "threadName": thread.name}
        return Reply({}, after=lambda: self._notify("thread/name/updated", update))

    def resume(self, call: Call) -> Reply:
        """`thread/resume`: the thread with its settings, then its token usage."""
        thread, missing = self._find(call)
        if missing:
            return missing
        if thread is None:
            return _no_rollout(call.params["threadId"])
        exclude = call.params.get("excludeTurns") is True
        if not exclude:
            self._notify(
                "deprecationNotice", {"summary": _RESUME_HYDRATION_NOTICE, "details": None}
            )
        if not thread.loaded:
            thread.loaded = True
            thread.status = {"type": "idle"}
            self._notify("thread/status/changed", {"threadId": thread.id, "status": thread.status})
        settings = dict(thread.settings)
        multi_agent = settings.pop("multiAgentMode")
        result = {
            "thread": thread.view(turns=not exclude),
            **settings,
            "collaborationMode": {
                "mode": "default",
                "settings": {
                    "model": settings["model"],
                    "reasoning_effort": None,
                    "developer_instructions": None,
                },
            },
            "multiAgentMode": multi_agent,
            "initialTurnsPage": None,
            "turnsBackwardsCursor": _cursor(thread, "turns", len(thread.history)),
            "itemsBackwardsCursor": _cursor(
                thread,
                "itemsByCreatedAtOrdinal",
                sum(len(turn["items"]) for turn in thread.history),
            ),
        }

        def after() -> None:
            self._report_usage(thread, thread)
            self._notify("thread/goal/cleared", {"threadId": thread.id})

        return Reply(result, after=after)

    def _report_usage(self, source: ThreadState, thread: ThreadState) -> None:
        if source.last_usage is not None and source.history:
            usage = shapes.thread_token_usage(source.total_usage, source.last_usage)
            self._notify(
                "thread/tokenUsage/updated",
                {"threadId": thread.id, "turnId": source.history[-1]["id"], "tokenUsage": usage},
            )

    def fork(self, call: Call) -> Reply:
        """`thread/fork`: a new thread with the source's history, then `thread/started`."""
        source, missing = self._find(call)
        if missing:
            return missing
        if source is None or not source.history:
            # A thread gets its rollout with its first turn; before that there is none.
            return _no_rollout(call.params["threadId"])
        exclude = call.params.get("excludeTurns") is True
        if not exclude:
            self._notify(
                "deprecationNotice", {"summary": _RESUME_HYDRATION_NOTICE, "details": None}
            )
        thread = self.create(call.params, source)
        thread.name = source.name
        thread.preview = source.preview
        thread.history = list(source.history)
        thread.total_usage = source.total_usage
        thread.last_usage = source.last_usage
        thread.read_revision = f"initial:{thread.id}"

        def after() -> None:
            self._report_usage(source, thread)
            self._notify("thread/started", {"thread": thread.view()})

        return Reply({"thread": thread.view(turns=not exclude), **thread.settings}, after=after)

    def archive(self, call: Call) -> Reply:
        """`thread/archive`: the thread is unloaded, `{}`, then `thread/archived`."""
        thread, missing = self._find(call)
        if missing:
            return missing
        if thread is None or thread.archived:
            return _no_rollout(call.params["threadId"])
        thread.archived = True
        thread.loaded = False
        thread.status = {"type": "notLoaded"}
        self._notify("thread/status/changed", {"threadId": thread.id, "status": thread.status})
        archived = {"threadId": thread.id}
        return Reply({}, after=lambda: self._notify("thread/archived", archived))

    def unarchive(self, call: Call) -> Reply:
        """`thread/unarchive`: the thread (still not loaded), then `thread/unarchived`."""
        thread, missing = self._find(call)
        if missing:
            return missing
        if thread is None:
            return invalid(f"no archived rollout found for thread id {call.params['threadId']}")
        if not thread.archived:
            return invalid(f"thread {thread.id} already has an active writer")
        thread.archived = False
        thread.updated_at = now_s()
        view = thread.view()
        view.update(environments=None, canAcceptDirectInput=None)
        unarchived = {"threadId": thread.id}
        return Reply({"thread": view}, after=lambda: self._notify("thread/unarchived", unarchived))

    def steer(self, call: Call) -> Reply:
        """`turn/steer`: more input for the running turn, which must be the expected one."""
        thread, missing = self._find(call, "expectedTurnId", "input")
        if missing:
            return missing
        inputs = call.params["input"]
        bad_input = check_input(inputs)
        if bad_input:
            return bad_input
        turn = thread.active_turn if thread is not None and thread.loaded else None
        if thread is None or not thread.loaded:
            return invalid(f"thread not found: {call.params['threadId']}")
        if turn is None:
            return invalid("no active turn to steer")
        expected = call.params["expectedTurnId"]
        if expected != turn.id:
            return invalid(f"expected active turn id `{expected}` but found `{turn.id}`")
        return Reply({"turnId": turn.id}, after=lambda: turn.add_user_input(inputs))


def _listed(thread: ThreadState) -> shapes.Json:
    """A thread as `thread/list` shows it: no turns, and archived ones unloaded."""
    view = thread.view()
    view["canAcceptDirectInput"] = None
    if thread.archived:
        name = os.path.basename(view["path"])
        view.update(
            environments=None,
            path=os.path.join(shapes.codex_home(), "archived_sessions", name),
        )
    return view


def _cursor(thread: ThreadState, scope: str, ordinal: int) -> str | None:
    if not thread.history:
        return None
    cursor = {
        "requestedThreadId": thread.id,
        "rolloutOrdinal": ordinal,
        "includeAnchor": True,
        "scope": {"kind": scope},
    }
    return orjson.dumps(cursor).decode()
