"""The server as the rest of the fake sees it: what a step or a thread method may use.

`server.py` is the only module that knows the whole server (`AppServer`); the step
interpreter (`steps.py`) and the built-in thread methods (`threads.py`) are handed the
server typed as one of these protocols, so that they depend on this narrow surface and
never import the server. A turn (`turns.py`) needs less still: the `Sink` its lines go
to (`wire.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fakes.app_server.ids import IdFactory
    from fakes.app_server.protocol import Fit
    from fakes.app_server.replies import Call, Reply
    from fakes.app_server.script import ReplySpec
    from fakes.app_server.turns import ThreadState, TurnRun
    from fakes.app_server.wire import Message, RequestId, Sink


class Host(Protocol):
    """What the built-in thread methods need: the ids, who the client is, the threads,
    and where notifications go."""

    @property
    def ids(self) -> IdFactory: ...
    @property
    def version(self) -> str: ...
    @property
    def client_info(self) -> dict[str, Any]: ...
    @property
    def threads(self) -> dict[str, ThreadState]: ...
    @property
    def out(self) -> Sink: ...
    @property
    def fit(self) -> Fit:
        """Fits what the fake builds to the release it emulates (conform.py)."""
        ...


class StepHost(Host, Protocol):
    """What a script's steps need besides: tasks, replies, server requests, and the ways
    a process ends."""

    @property
    def seed(self) -> int | None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` as a task the server cancels when it exits."""
        ...

    def answer(self, call: Call, reply: Reply) -> None:
        """Send `reply` to `call`, then run what must follow it."""
        ...

    def scripted_reply(self, call: Call, spec: ReplySpec) -> Reply:
        """The reply a script gives: its result or error, else the built-in reply."""
        ...

    def send_request(
        self,
        method: str,
        params: Any,
        request_id: RequestId | None = None,
        turn: TurnRun | None = None,
    ) -> tuple[RequestId, asyncio.Future[Message]]:
        """Send a server request; the future resolves with the client's response."""
        ...

    def resolved(self, thread_id: str | None, request_id: RequestId) -> None:
        """Announce that a server request is settled."""
        ...

    def exit(self, code: int) -> None:
        """End the session with status `code`."""
        ...

    async def kill_self(self, signame: str) -> None:
        """End the session as death by signal `signame` would."""
        ...

    async def end_process(self, code: int, signame: str | None) -> None:
        """End the whole process (`exit` with `server: true`)."""
        ...

    async def stall(self, *, ignore_term: bool, exit_on_eof: bool) -> None:
        """Stop everything else and never do anything again."""
        ...
