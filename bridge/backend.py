"""The interface between the HTTP layer and whatever answers it.

The routes only ever talk to a :class:`Backend`. The bundled
:class:`bridge.process.backend.ProcessBackend` spawns real app-server processes;
a host application can pass its own subclass to
:func:`bridge.app.backend_app` instead. Every method a backend does not
override answers 404 ``not_found``, so a backend can implement just the part of
the API it serves.

Methods raise :class:`bridge.errors.RestError` for every failure the caller
should see; anything else becomes a 500 ``internal_error`` without details.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bridge import errors
from bridge.events import Event
from bridge.models import (
    ClientOptions,
    Compatibility,
    SessionCreated,
    SessionSummary,
    TextTurnRequest,
    TextTurnResponse,
)


class EventStream(Protocol):
    """The source of one SSE stream: batches of events from a position on.

    :meth:`Backend.open_stream` returns one; the route writes each batch, then reports
    it with :meth:`delivered`, and calls :meth:`close` when the stream ends.
    """

    async def next_batch(self, wait: float, limit: int) -> Sequence[Event]:
        """Up to ``limit`` events after the position, waiting up to ``wait`` seconds.

        Empty on timeout; raises ``session_exited`` once the log has ended and the
        stream is past its end.
        """
        raise NotImplementedError

    def delivered(self, seq: int) -> None:
        """Every event through ``seq`` has been written to the client."""
        return None

    def close(self, completed: bool = False) -> None:
        """The stream has ended: after its ``exit`` event (``completed``), or cut short."""
        return None

    def on_cut_loose(self, end: Callable[[], None]) -> None:
        """Call ``end`` if the stream is cut loose: it stopped taking events while the
        app-server waited for it. ``end`` ends the stream's connection; a stream that is
        never cut loose need not keep it."""
        return None


class PollingEventStream(EventStream):
    """A stream made of :meth:`Backend.read_events` calls (for backends that have no other)."""

    def __init__(self, backend: Backend, session_id: str, after: int | None) -> None:
        self._backend = backend
        self._session_id = session_id
        self._after = after

    async def next_batch(self, wait: float, limit: int) -> Sequence[Event]:
        return await self._backend.read_events(
            self._session_id, after=self._after, wait_ms=int(wait * 1000), limit=limit
        )

    def delivered(self, seq: int) -> None:
        if self._after is not None:
            self._after = seq


#: Sent by a replica that asks a peer for its sessions: answer with your own only.
PEER_QUERY_HEADER = "X-Rest-Bridge-Peer-Query"
#: Separates the replica id from the uuid in a session id (a replica id has no dot).
SEPARATOR = "."


def new_session_id(replica_id: str | None, uuid_text: str) -> str:
    """``<replica>.<uuid>`` with a replica id, the uuid alone without."""
    return uuid_text if replica_id is None else f"{replica_id}{SEPARATOR}{uuid_text}"


@dataclass(frozen=True, slots=True)
class PeerSessions:
    """What the other replicas said to ``GET /v1/sessions``."""

    #: Their sessions, as they listed them (wire records).
    sessions: list[Any]
    #: The replicas that could not be asked, by id.
    unavailable: list[str]


class PeerListing(Protocol):
    """The other replicas, as a backend asks them (:class:`bridge.replica.Peers`)."""

    async def sessions(self, authorization: str | None) -> PeerSessions: ...

    async def close(self) -> None: ...


def _unsupported(what: str) -> errors.RestError:
    return errors.of_kind("not_found", f"This bridge's backend does not support {what}.")


class Backend:
    """What the routes call. Subclass it and override what your backend serves."""

    #: This replica's id (``REST_ADAPTER_REPLICA_ID``): session ids then read
    #: ``<replica>.<uuid>`` (:func:`new_session_id`). None: a bridge on its own.
    replica_id: str | None = None
    #: The other replicas, whose sessions ``GET /v1/sessions`` lists too; None: none.
    peers: PeerListing | None = None
    #: Set by :meth:`start_drain`: no new sessions, sessionless calls or text turns.
    draining: bool = False

    async def start(self) -> None:
        """Called once when the application starts."""

    async def close(self) -> None:
        """Called once when the application shuts down; release every resource."""

    async def peer_sessions(self, authorization: str | None) -> PeerSessions | None:
        """The other replicas' sessions, asked with the caller's ``Authorization``
        header; None when this bridge has no peers."""
        if self.peers is None:
            return None
        return await self.peers.sessions(authorization)

    def held(self) -> int:
        """Sessions, sessionless calls and text turns held now (a drain waits for 0)."""
        return 0

    def sessions(self) -> Mapping[str, Any]:
        """The sessions held now, by id (a drain's log lines count them); like
        :meth:`held`, a backend that holds none need not say."""
        return {}

    def start_drain(self) -> None:
        """Take no new work from now on (serve what is held)."""
        self.draining = True

    async def wait_drained(self) -> None:
        """Return once, draining, nothing is held any more."""

    async def compatibility(self) -> Compatibility:
        """Versions of the bridge and of the app-server behind it."""
        raise _unsupported("compatibility information")

    async def call(
        self, method: str, params: Any, *, options: ClientOptions | None, timeout_ms: int | None
    ) -> Any:
        """Call ``method`` outside any session and return its JSON-RPC result."""
        raise _unsupported("sessionless calls")

    async def text_turn(self, request: TextTurnRequest) -> TextTurnResponse:
        """Run one text turn to completion."""
        raise _unsupported("text turns")

    async def create_session(self, options: ClientOptions | None) -> SessionCreated:
        raise _unsupported("sessions")

    async def list_sessions(self) -> Sequence[SessionSummary]:
        raise _unsupported("sessions")

    async def delete_session(self, session_id: str) -> None:
        raise _unsupported("sessions")

    async def session_call(
        self, session_id: str, method: str, params: Any, *, timeout_ms: int | None
    ) -> Any:
        """Call ``method`` in a session and return its JSON-RPC result."""
        raise _unsupported("sessions")

    async def read_events(
        self, session_id: str, *, after: int | None, wait_ms: int, limit: int
    ) -> Sequence[Event]:
        """Up to ``limit`` events with ``seq > after``, waiting up to ``wait_ms`` for one.

        With ``after=None`` read from the session's cursor and advance it past what
        is returned. Return an empty sequence on timeout; raise ``session_exited``
        once the log has ended and the reader is past its end.
        """
        raise _unsupported("events")

    async def open_stream(self, session_id: str, after: int | None) -> EventStream:
        """The source of an SSE stream that starts after ``after`` (None: the cursor).

        By default, :meth:`read_events` calls; raise ``session_not_found`` here or from
        the first batch.
        """
        return PollingEventStream(self, session_id, after)

    async def reply_result(self, session_id: str, request_key: str, result: Any) -> None:
        """Answer a server-originated request with a success result."""
        raise _unsupported("server requests")

    async def reply_error(
        self, session_id: str, request_key: str, code: int, message: str, data: Any
    ) -> None:
        """Answer a server-originated request with a JSON-RPC error."""
        raise _unsupported("server requests")
