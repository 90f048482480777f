"""A test's deadline: the pytest plugin runs an async test that uses its `codex_` fixtures
inside `bounded`, which at the deadline asks the test's bridges what is still pending (a
server request nobody answered, a request or stream still open), then cancels the test
and fails it with that first.

Why not pytest-timeout: it is not in the `harness` extra, its signal method cannot stop
a test waiting on an event loop kindly, and it knows nothing of the bridge. Here the
test's own task is cancelled on its own loop, so its `async with` blocks and the
fixtures' teardown run as after any failure, under xdist as anywhere.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from scenarios.harness import RunningBridge

#: The default, in seconds: below the 120 s a pytest-timeout setting often has, so the
#: plugin's message (what was pending) comes first.
DEFAULT_SECONDS = 90.0
#: How long asking the bridges what is pending may take.
ASK_SECONDS = 5.0
#: The events read to find a pending server request's method.
EVENTS_READ = 1000


@dataclass
class Watch:
    """What a test under a deadline has started: its bridges, the scenario it runs."""

    seconds: float
    setting: str
    bridges: list[RunningBridge]
    scenario: str | None = None
    #: Whether the deadline passed (the test then failed saying what was pending).
    expired: bool = False


async def pending(bridges: Sequence[RunningBridge], open_now: list[str]) -> list[str]:
    """What is still pending at `bridges`, most telling first: each server request nobody
    answered (its method and key, its session), then each request still open (an SSE
    stream the test was reading, a call waiting), as `open_now` has them."""
    from bridge.routes import BACKEND

    found: list[str] = []
    for bridge in bridges:
        backend = bridge.app.get(BACKEND) if bridge.app is not None else None
        if backend is None:
            continue
        try:
            async with asyncio.timeout(ASK_SECONDS):
                for session in await backend.list_sessions():
                    keys = list(session.pending_requests)
                    if keys:
                        found += await _requests(backend, session.session_id, keys)
        except Exception as exc:  # what it could not learn, said, never a traceback
            found.append(f"(could not ask the bridge at {bridge.url}: {exc!r})")
    return found + open_now


async def _requests(backend: Any, session_id: str, keys: list[str]) -> list[str]:
    methods: dict[str, str] = {}
    try:
        events = await backend.read_events(session_id, after=0, wait_ms=0, limit=EVENTS_READ)
    except Exception:  # an exited session: its keys alone
        events = []
    for event in events:
        if event.kind == "request" and event.request_key in keys:
            methods[event.request_key] = event.method or "?"
    return [
        f"the server request {methods.get(key, '(method not in the log)')} (requestKey {key}) "
        f"of session {session_id}, never answered"
        for key in keys
    ]


def open_requests(bridges: Sequence[RunningBridge], now: float) -> list[str]:
    """The requests the bridges are still serving (streams included), oldest first."""
    rows = sorted(
        (started, method, path) for bridge in bridges for method, path, started in bridge.open()
    )
    return [
        f"{method} {path}, open for {now - started:.1f} s" + _what(path)
        for started, method, path in rows
    ]


def _what(path: str) -> str:
    if path.split("?")[0].endswith("/events/stream"):
        return " (an event stream: the test was waiting for an event)"
    return ""


def message(watch: Watch, found: list[str]) -> str:
    """The failure: its first line names what was pending."""
    head = f"the test ran past its {watch.seconds:g} s deadline ({watch.setting})"
    if watch.scenario is not None:
        found = [*found, f"the scenario {watch.scenario}, still running"]
    if not found:
        first = (
            f"{head}; nothing was pending at its bridges "
            "(no unanswered server request, no request open)"
        )
        rest: list[str] = []
    else:
        first, rest = f"{head}, still pending: {found[0]}", found[1:]
    lines = [first, *(f"  also pending: {each}" for each in rest)]
    lines.append(
        "  (change the deadline with @pytest.mark.codex_timeout(SECONDS), --codex-timeout, "
        "$CODEX_TEST_TIMEOUT or the ini option codex_timeout; 0 turns it off)"
    )
    return "\n".join(lines)


def bounded(
    test: Callable[..., Coroutine[Any, Any, Any]], watch: Watch
) -> Callable[..., Coroutine[Any, Any, Any]]:
    """`test`, failing (`pytest.fail`, no traceback) once it has run `watch.seconds`."""

    @functools.wraps(test)
    async def run(*args: Any, **kwargs: Any) -> Any:
        try:
            task = asyncio.current_task()
        except RuntimeError:  # not on an asyncio loop (anyio on trio, say): no deadline
            task = None
        if task is None:
            return await test(*args, **kwargs)
        said: list[str] = []

        async def at_deadline() -> None:
            await asyncio.sleep(watch.seconds)
            loop = asyncio.get_running_loop()
            open_now = open_requests(watch.bridges, loop.time())  # before the test closes them
            said.append(message(watch, await pending(watch.bridges, open_now)))
            watch.expired = True
            task.cancel()

        watcher = asyncio.create_task(at_deadline())
        try:
            result = await test(*args, **kwargs)
        except asyncio.CancelledError:
            if not said:
                raise
            task.uncancel()
        finally:
            watcher.cancel()
        if said:
            pytest.fail(said[0], pytrace=False)
        return result

    return run
