"""One bridge among several: its replica id, its peers, and draining.

A bridge is one event loop: one core, and one machine for all its sessions. Several
bridges (*replicas*) behind a proxy scale that out, and since a session is a live
process, every request about a session must reach the replica that holds it. So:

- ``REST_ADAPTER_REPLICA_ID`` names the replica (a DNS label, as a Kubernetes
  StatefulSet's pod names are), and the replica's session ids then read
  ``<replica>.<uuid4>``: a proxy routes ``/v1/sessions/<replica>.…`` by that prefix
  (``bridge_ops.front`` generates nginx's configuration). Without it the ids stay
  plain uuid4s and nothing changes.
- ``REST_ADAPTER_PEERS`` (``id=url,id=url``) lists the other replicas, so that
  ``GET /v1/sessions`` on any one of them lists every replica's sessions. The replica
  asks each peer with :data:`PEER_QUERY_HEADER` (a peer asked so answers with its own
  sessions only, so the question never travels further) and the caller's
  ``Authorization`` header, and names in ``unavailableReplicas`` the peers that could
  not be asked. A peer that did not answer in time (hung) is passed over by every
  listing until it answers its ``/health`` again (:class:`Peers`).
- ``SIGUSR1`` drains a replica (:class:`Drain`): it answers new sessions, sessionless
  calls and text turns with 503 ``replica_unavailable`` (so the proxy tries another
  replica), serves the sessions it has, and exits once the last one has ended, or at
  ``REST_ADAPTER_DRAIN_TIMEOUT_MS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from bridge import logs
from bridge.backend import PEER_QUERY_HEADER, SEPARATOR, Backend, PeerSessions
from bridge.limits import REPLICA_ID, ReplicaSettings

log = logging.getLogger("bridge.replica")

#: How long a replica waits for a peer's list of sessions (a peer that is alive answers
#: in milliseconds; one that is stopped, its kernel still accepting connections, never).
PEER_TIMEOUT_SECONDS = 3.0
#: How often a peer that did not answer in time is asked for its health, until it answers.
PEER_PROBE_SECONDS = 1.0


def replica_of(session_id: str) -> str | None:
    """The replica a session id names, if it names one."""
    name, separator, _ = session_id.partition(SEPARATOR)
    return name if separator and REPLICA_ID.fullmatch(name) else None


# -- the sessions of every replica --------------------------------------------------------


class Peers:
    """Asks the other replicas for their sessions, on behalf of ``GET /v1/sessions``
    (a backend's :attr:`bridge.backend.Backend.peers`)."""

    def __init__(
        self,
        peers: Mapping[str, str],
        timeout: float = PEER_TIMEOUT_SECONDS,
        probe_interval: float = PEER_PROBE_SECONDS,
    ) -> None:
        self.peers = dict(peers)
        self._timeout = timeout
        self._probe_interval = probe_interval
        self._client: aiohttp.ClientSession | None = None
        #: Peers that did not answer within the timeout (stopped, hung): passed over by
        #: every listing, each watched by a task that asks for its health until it
        #: answers. A listing costs the timeout once per such peer, not every time.
        self.unresponsive: dict[str, asyncio.Task[None]] = {}

    def client(self) -> aiohttp.ClientSession:
        if self._client is None or self._client.closed:
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            )
        return self._client

    async def close(self) -> None:
        watchers = list(self.unresponsive.values())
        self.unresponsive.clear()
        for watcher in watchers:
            watcher.cancel()
        for watcher in watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _pass_over(self, name: str) -> None:
        """``name`` did not answer in time: pass it over until it answers its health."""
        if name not in self.unresponsive:
            self.unresponsive[name] = asyncio.create_task(self._watch(name))

    async def _watch(self, name: str) -> None:
        url = f"{self.peers[name]}/health"
        while True:
            try:
                async with self.client().get(url) as response:
                    await response.read()
                    if response.status == 200:
                        break
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(self._probe_interval)
        log.warning("replica %s answers again: listed again", name)
        self.unresponsive.pop(name, None)

    async def _ask(self, url: str, authorization: str | None) -> list[Any]:
        headers = {PEER_QUERY_HEADER: "1"}
        if authorization is not None:
            headers["Authorization"] = authorization
        async with self.client().get(f"{url}/v1/sessions", headers=headers) as response:
            if response.status != 200:
                raise ValueError(f"status {response.status}")
            body = orjson.loads(await response.read())
            sessions = body["sessions"]
            if not isinstance(sessions, list):
                raise ValueError("not a list")
            return sessions

    async def sessions(self, authorization: str | None) -> PeerSessions:
        """The peers' sessions, asked with ``authorization``, and those not asked."""
        listed: list[Any] = []
        names = sorted(name for name in self.peers if name not in self.unresponsive)
        answers = await asyncio.gather(
            *(self._ask(self.peers[name], authorization) for name in names),
            return_exceptions=True,
        )
        unavailable = set(self.peers) - set(names)
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer
                log.warning("replica %s could not list its sessions: %s", name, _why(answer))
                unavailable.add(name)
                if isinstance(answer, TimeoutError):
                    self._pass_over(name)
            else:
                listed.extend(answer)
        return PeerSessions(listed, sorted(unavailable))


def _why(exc: Exception) -> str:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timed out"
    return type(exc).__name__ if not isinstance(exc, ValueError) else str(exc)


# -- draining -----------------------------------------------------------------------------


class Drain:
    """Stop taking new work, serve what is held, and say when the replica may exit.

    Its lines are log lines of ``bridge.replica`` (with ``event`` ``drain_started``,
    ``drained`` or ``drain_deadline`` in JSON), each with the sessions left and what is
    held in all (sessions, sessionless calls and text turns)."""

    def __init__(self, backend: Backend, timeout_ms: int) -> None:
        self.backend = backend
        self.timeout = timeout_ms / 1000
        self._task: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self, done: asyncio.Event) -> None:
        """Begin draining (once); ``done`` is set when the replica may exit."""
        if self._task is not None:
            return
        self.backend.start_drain()
        sessions, held = self._left()
        log.info(
            "draining: no new work; sessions left: %d (held in all, with calls and text "
            "turns: %d); exiting when the last ends, at most %g s",
            sessions,
            held,
            self.timeout,
            extra=self._fields("drain_started", sessions, held, timeoutMs=self.timeout * 1000),
        )
        self._task = asyncio.create_task(self._wait(done))

    async def _wait(self, done: asyncio.Event) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.backend.wait_drained(), self.timeout)
        sessions, held = self._left()
        if held:
            log.warning(
                "drain deadline reached; sessions left: %d (held in all: %d); exiting",
                sessions,
                held,
                extra=self._fields("drain_deadline", sessions, held),
            )
        else:
            said = "drained; sessions left: %d; exiting"
            log.info(said, sessions, extra=self._fields("drained", sessions, 0))
        done.set()

    def _left(self) -> tuple[int, int]:
        """The sessions held now, and all it holds."""
        return len(self.backend.sessions()), self.backend.held()

    def _fields(self, event: str, sessions: int, held: int, **more: Any) -> dict[str, Any]:
        fields = {"event": event, "sessions": sessions, "held": held, **more}
        if self.backend.replica_id is not None:
            fields["replicaId"] = self.backend.replica_id
        return {logs.FIELDS: fields}

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


def configure(backend: Backend, settings: ReplicaSettings) -> Drain:
    """Make ``backend`` the replica ``settings`` describe: its id, its peers (closed with
    the application that serves it), and how it drains."""
    backend.replica_id = settings.replica_id
    others = {name: url for name, url in settings.peers.items() if name != settings.replica_id}
    if others:
        backend.peers = Peers(others)
    return Drain(backend, settings.drain_timeout_ms)
