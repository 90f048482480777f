"""The front: nginx's configuration for several replicas, generated from their list.

``rest-bridge front-config --replica bridge-0=127.0.0.1:8001 --replica ...`` prints it.
What the configuration does:

- **Sessions go to their replica.** A session id names its replica
  (``<replica>.<uuid4>``, :mod:`bridge.replica`); one prefix location per replica
  (``location ^~ /v1/sessions/<replica>.``) sends it to the replica's own upstream,
  found in nginx's tree of locations rather than by a regular expression per replica,
  and a request for an id that names no replica of the list is a 404
  ``session_not_found``. A session never moves: no retry on another replica
  (``proxy_next_upstream off``). When its replica cannot be reached, the answer is a
  503 ``replica_unavailable`` error payload.
- **Everything else is balanced** (least connections) over every replica, in pools
  of the same replicas, one per kind of work (session creation, text turns, sessionless
  calls) and one for reads (health, compatibility, the OpenAPI document, the listing,
  any other path). Work that a replica refuses, 429 (full) or 503 (draining, or its
  app-server overloaded), or that cannot reach it, passes to the next replica
  (``proxy_next_upstream``) and marks the replica as failed for 2 s, in that pool only
  (nginx counts failures per upstream); when none can take the request the last answer
  stands, or a 503 ``replica_unavailable`` if none answered or all are marked. Reads
  pass over, and mark, only a replica that cannot be reached or does not answer: a
  refused creation never makes ``/health`` or the listing fail. ``/v1/sessions`` is
  both: ``GET`` and ``HEAD`` are rewritten, in the server block, to an internal location
  of the reads (:data:`LISTING`, its own read timeout), anything else creates.
- **A replica marked down** (:attr:`Replica.down`; ``rest-bridge cluster`` marks a
  replica that misses its health probes, :mod:`bridge.cluster`) is ``down`` in every
  pool and in its own upstream: no work or read is sent to it, and a request on one of
  its sessions finds no live server in its upstream, which nginx answers at once with
  the 503 ``replica_unavailable`` (its 502 goes there), not after a read timeout.
- **Streams pass unbuffered.** SSE and long-poll responses are not buffered, and every
  read timeout is derived from the limits (``REST_ADAPTER_*``, read when the
  configuration is generated): the SSE keep-alive interval for streams, MAX_WAIT_MS for
  long-polls, SPAWN_TIMEOUT_MS for creation, TEXT_TURN_TIMEOUT_MS for text turns,
  CALL_TIMEOUT_MS for session calls, each plus :data:`MARGIN_SECONDS`, and
  :data:`READ_SECONDS` for reads (which wait on nothing: a replica that does not answer
  one by then is hung, and the read passes on; reads then pass it over for
  :data:`READ_FAIL_SECONDS`). Plain routes keep
  nginx's buffering, which costs it less CPU per call.
- **Keep-alive to the replicas**, HTTP/1.1, and request bodies bounded by
  MAX_BODY_BYTES as the replicas bound them. A replica on the same machine may be
  reached over a unix socket (``id=unix:/path``): about 10 µs less CPU per call for
  the replica, and a little less for nginx, than over TCP on the loopback
  (bench/FINDINGS.md); nginx's workers need write permission on the socket.
- **Every error nginx itself produces is the error payload** (JSON), never its HTML
  pages: each status nginx can answer by itself has an ``error_page`` to an internal
  location (a URI, not a named location: a request whose request line nginx could not
  read has no URI, and a named location cannot take it).
- **Strangers learn nothing but 401.** Given a token map (``token_map``: the path of
  the file :func:`token_map` writes, which nginx includes), the front checks the
  bearer token itself, before it routes by session id, applies the body limit or picks
  a replica: a request that needs the token and lacks it gets the replicas' own 401,
  whether its session id names a live replica, a dead one or none. The replicas still
  check every request (the ``Authorization`` header passes through untouched); the
  front's check only keeps strangers from mapping the replicas. Nor does a stranger
  learn the front's own bounds or pages: the pages of a body over the limit (413), a
  head over its bound (494) and an internal path asked for (404) answer the 401 to a
  request whose token nginx did not see, even on the health paths (which need no
  token, and take no body a stranger could measure the limit with). The token is in the
  map file (0600), never in nginx.conf, which is printed, committed and mounted from
  a ConfigMap.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from bridge import errors
from bridge.auth import token_problem
from bridge.limits import RestLimits
from bridge.replica import PEER_TIMEOUT_SECONDS, ReplicaSettingsError, validate_replica_id

#: Added to every read timeout derived from a limit: the replica answers first.
MARGIN_SECONDS = 5
#: Idle keep-alive connections nginx keeps to each replica (per worker): above the
#: connections in flight, or nginx closes and reopens connections under steady load
#: (32 against 64 in flight cost each replica about 50 µs of CPU per call more).
KEEPALIVE_CONNECTIONS = 256
_HOST_PORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")
#: An absolute socket path nginx reads as one word (no space, quote, brace, semicolon).
_UNIX_PATH = re.compile(r"/[A-Za-z0-9._+@%=,:/-]*")
#: A path (absolute, or relative to nginx.conf's directory) nginx reads as one word.
_NGINX_PATH = re.compile(r"[A-Za-z0-9._+@%=,:/-]+")

#: The balanced pools: every replica in each, each pool with its own record of which
#: replica failed lately (nginx keeps ``max_fails`` per upstream), so that a replica
#: refusing one kind of work (full: 429; draining: 503) is passed over for that kind
#: only, and never for reads.
CREATE_POOL = "bridge_create"
TEXT_TURN_POOL = "bridge_text_turns"
CALL_POOL = "bridge_calls"
READ_POOL = "bridge_reads"
POOLS = (
    (CREATE_POOL, "Session creation (POST /v1/sessions)."),
    (TEXT_TURN_POOL, "Text turns."),
    (CALL_POOL, "Sessionless calls."),
    (READ_POOL, "Reads: health, compatibility, OpenAPI, the listing; anything else."),
)
#: Work passes over a replica that refuses it or cannot be reached, and each of those
#: marks the replica as failed in the pool; even after the replica received it.
WORK_NEXT = "error timeout http_429 http_503 non_idempotent"
#: Reads pass over, and mark, only a replica that cannot be reached or does not answer.
READ_NEXT = "error timeout"
#: How long a read (health, compatibility, the OpenAPI document, any other path but the
#: listing) may take: none waits on anything, so a replica that has not answered by then
#: is hung (stopped, its kernel still accepting connections), and the read passes on.
READ_SECONDS = 3 + MARGIN_SECONDS
#: Where the listing (``GET /v1/sessions``) goes, internally: a read, unlike a creation.
LISTING = "/.front/sessions"
#: The listing's read timeout: a replica may wait PEER_TIMEOUT_SECONDS for its peers.
LISTING_SECONDS = math.ceil(PEER_TIMEOUT_SECONDS) + MARGIN_SECONDS
#: How long a replica that failed a request stays passed over: 2 s for work (a full
#: replica refuses it, 429, and may take it again soon), 30 s for reads, which mark a
#: replica only when it cannot be reached or hangs: a hung replica costs one read
#: READ_SECONDS once every 30 s, not every 2 s.
WORK_FAIL_SECONDS = 2
READ_FAIL_SECONDS = 30


def _fail_seconds(pool: str) -> int:
    return READ_FAIL_SECONDS if pool == READ_POOL else WORK_FAIL_SECONDS


@dataclass(frozen=True, slots=True)
class Replica:
    """One replica: its id and where nginx reaches it (``host:port`` or ``unix:/path``).

    ``down``: marked ``down`` in every upstream (``rest-bridge cluster`` does, while the
    replica does not answer its ``/health``): no pool sends it anything, and a request
    on one of its sessions is a 503 ``replica_unavailable`` at once.
    """

    id: str
    address: str
    down: bool = False

    @property
    def server_flags(self) -> str:
        return " down" if self.down else ""

    @property
    def upstream(self) -> str:
        return f"replica_{self.id}"


def parse_replica(text: str) -> Replica:
    """``id=host:port`` or ``id=unix:/path`` as a :class:`Replica`; a bad one raises ValueError."""
    name, equals, address = text.partition("=")
    address = address.strip()
    if address.startswith("http://"):
        address = address.removeprefix("http://").rstrip("/")
    if address.startswith("unix:"):
        if not equals or _UNIX_PATH.fullmatch(address.removeprefix("unix:")) is None:
            raise ValueError(f"{text[:120]!r} is not of the form id=unix:/absolute/path")
    else:
        match = _HOST_PORT.fullmatch(address)
        if not equals or match is None or not 0 < int(match.group(2)) < 65536:
            raise ValueError(f"{text[:120]!r} is not of the form id=host:port")
    try:
        return Replica(validate_replica_id(name.strip()), address)
    except ReplicaSettingsError:
        raise ValueError(f"{name[:80]!r} is not a valid replica id (a DNS label)") from None


@dataclass(frozen=True, slots=True)
class FrontSettings:
    """Where nginx listens and keeps its files, and how many workers it runs."""

    listen: str = "127.0.0.1:8787"
    workers: str = "1"
    #: Directory of the pid file and temporary files; empty: relative to nginx's prefix.
    runtime_dir: str = ""
    #: ``stderr`` or a path; empty: ``error.log`` in the runtime directory.
    error_log: str = ""
    access_log: bool = False
    #: A file nginx includes that defines ``$bridge_token_ok`` (:func:`token_map_text`):
    #: the front then answers every request that needs the token and lacks it with the
    #: 401. Empty: the front checks no token (the replicas still do).
    token_map: str = ""


#: What a replica exempts from the token (bridge.auth: GET or HEAD, two exact paths), as
#: keys of ``$bridge_stranger``'s map: ``method:content-length:transfer-encoding:path``.
#: The front exempts a plain health check only: no body (no Content-Length but 0, no
#: Transfer-Encoding). A stranger's health request with a body gets the 401, whatever
#: its length, so that no length tells the body limit (a 413) from one under it.
EXEMPT = tuple(
    f"{m}:{length}::{p}"
    for m in ("GET", "HEAD")
    for length in ("", "0")
    for p in ("/health", "/v1/health")
)
#: Around the token, what a replica trims (Python's str.strip): ASCII whitespace, the
#: separators \x1c-\x1f, and any byte of a multi-byte UTF-8 character (a superset of
#: the Unicode spaces): the front may admit a little more than a replica, never less.
_TRIMMED = r"[\s\x1c-\x1f\x80-\xff]*"


def token_map_text(token: str) -> str:
    """The file a front includes to check ``token``: ``$bridge_token_ok`` is 1 when the
    ``Authorization`` header presents it (the scheme ``Bearer`` in any case, one space,
    then the token with what a replica trims around it), else 0.

    The token is written byte by byte as ``\\xHH`` escapes, so no character of it can
    end the string, the regular expression or the directive. Keep the file private
    (0600): it holds the token.
    """
    problem = token_problem(token)
    if problem is not None:
        raise ValueError(f"the bearer token {problem}")
    escaped = "".join(f"\\x{byte:02x}" for byte in token.encode("utf-8", "surrogateescape"))
    scheme = "".join(f"[{c.upper()}{c}]" for c in "bearer")
    return (
        "# Generated by `rest-bridge front-config --print-token-map`: holds the bearer\n"
        "# token. Keep it private (0600); regenerate it when the token changes.\n"
        "map $http_authorization $bridge_token_ok {\n"
        "    default 0;\n"
        f'    "~^{scheme} {_TRIMMED}{escaped}{_TRIMMED}$" 1;\n'
        "}\n"
    )


def _json(text: str) -> str:
    """``text`` as one nginx string literal (single-quoted; the payload has no quote)."""
    if "'" in text or "\\" in text:
        raise ValueError("a payload for nginx cannot hold a quote or a backslash")
    return f"'{text}'"


def _payload(kind: str, message: str, extra: str = "") -> str:
    return _json(f'{{"error":"{kind}","message":"{message}"{extra}}}')


#: Where each status nginx answers by itself goes: an internal location of that URI
#: (asked for directly, it is a 404, or the 401 without the token) returning the error
#: payload. Not named locations: a request whose request line nginx could not read
#: (``OPTIONS *``, ``CONNECT``, a NUL byte, a lower-case method, ``..`` above the root)
#: has no URI, and nginx cannot send it to a named location (its HTML 500 instead).
FRONT_ERRORS = "/.front/"
#: The replicas' 401 message (the body is then the same, byte for byte).
UNAUTHORIZED_MESSAGE = errors.unauthorized().message
_FRONT_PAGES = (
    # status, kind, message, extra payload fields (JSON text), extra headers
    (400, "bad_request", "The request could not be read.", "", ()),
    # The replicas' own 401 (the front answers it with a token map: FrontSettings).
    (401, "unauthorized", UNAUTHORIZED_MESSAGE, "", (("WWW-Authenticate", "Bearer"),)),
    (404, "not_found", "No such route.", "", ()),
    (
        405,
        "method_not_allowed",
        "The front does not pass this method on; allowed: DELETE, GET, HEAD, POST.",
        "",
        (("Allow", '"DELETE, GET, HEAD, POST"'),),
    ),
    (408, "request_timeout", "The request did not arrive in time.", "", ()),
    (411, "length_required", "The request body needs a length.", "", ()),
    (414, "uri_too_long", "The request line is over 8 KiB.", "", ()),
    (500, "internal_error", "The front hit an internal error.", "", ()),
    (
        501,
        "not_implemented",
        "The front reads request bodies whose Transfer-Encoding is chunked, or none.",
        "",
        (),
    ),
    (504, "timeout", "The replica did not answer within the deadline of the front.", "", ()),
    (505, "http_version_not_supported", "The front speaks HTTP/1.0 and HTTP/1.1.", "", ()),
)
#: Where nginx's 414 goes (internal: asked for directly, it is a 404, or the 401).
URI_TOO_LONG = f"{FRONT_ERRORS}414"


def _error_pages(indent: str, unreachable: str) -> list[str]:
    """nginx's own errors as the payload; ``unreachable`` answers when no replica did."""
    pages = [(str(status), f"{FRONT_ERRORS}{status}") for status, *_ in _FRONT_PAGES]
    pages += [("413", f"{FRONT_ERRORS}413"), ("494", f"{FRONT_ERRORS}494"), ("502", unreachable)]
    return [f"{indent}error_page {codes} = {target};" for codes, target in sorted(pages)]


def _balanced(match: str, next_upstream: str, tries: int, timeout: int, pool: str) -> list[str]:
    """A location balanced over ``pool``, passing on to the next replica on ``next_upstream``."""
    return [
        f"        location {match} {{",
        *(["            internal;"] if match.startswith(f"= {FRONT_ERRORS}") else []),
        *_error_pages("            ", "@no_replica"),
        f"            proxy_next_upstream {next_upstream};",
        f"            proxy_next_upstream_tries {tries};",
        f"            proxy_read_timeout {timeout}s;",
        f"            proxy_pass http://{pool};",
        "        }",
    ]


def _stranger_check(settings: FrontSettings) -> list[str]:
    """The 401 for a request that needs the token and lacks it, before any routing.

    In the server block, nginx's rewrite phase for the server: before it picks a
    location (so before a session id is routed), applies the body limit or waits for a
    body (no ``100 Continue``).
    """
    if not settings.token_map:
        return []
    return [
        "        # Strangers learn nothing but 401: checked before a location is chosen.",
        # Not `return 401`: nginx's if in a server block takes no add_header, and an
        # error_page would meet the cached $bridge_stranger again (nginx's HTML then).
        "        if ($bridge_stranger) {",
        f"            rewrite ^ {FRONT_ERRORS}401 last;",
        "        }",
        "",
    ]


#: The pages that would tell a stranger something the token should guard: the body
#: limit (413), the bound on a request head (494), and that the front's internal paths
#: exist (404: a client's request for one of them, or for the listing's internal URI).
#: With a token map, a request whose token nginx did not see there gets the 401 instead.
GUARDED_PAGES = ("404", "413", "494")


def _front_page(status: str, token_map: str, body: list[str]) -> list[str]:
    """The internal location of one error page. Whatever the body, no 413 here: nginx
    already refused or is discarding it, and a second error would get its HTML page."""
    guard = [
        "            if ($bridge_token_ok = 0) {",
        f"                rewrite ^ {FRONT_ERRORS}401 last;",
        "            }",
    ]
    return [
        f"        location = {FRONT_ERRORS}{status} {{",
        "            internal;",
        "            client_max_body_size 0;",
        *(guard if token_map and status in GUARDED_PAGES else []),
        *body,
        "        }",
    ]


def _front_error_locations(token_map: str) -> list[str]:
    out: list[str] = []
    for status, kind, message, extra, headers in _FRONT_PAGES:
        out += _front_page(
            str(status),
            token_map,
            [
                *(f"            add_header {name} {value} always;" for name, value in headers),
                f"            return {status} {_payload(kind, message, extra)};",
            ],
        )
    return out


def seconds(milliseconds: int) -> int:
    return -(-milliseconds // 1000) + MARGIN_SECONDS


def render(
    replicas: Sequence[Replica], limits: RestLimits, settings: FrontSettings | None = None
) -> str:
    """nginx.conf for ``replicas`` behind one server."""
    if not replicas:
        raise ValueError("a front needs at least one replica")
    ids = [r.id for r in replicas]
    if len(set(ids)) != len(ids):
        raise ValueError("replica ids must be unique")
    settings = settings or FrontSettings()
    if settings.token_map and _NGINX_PATH.fullmatch(settings.token_map) is None:
        raise ValueError(f"{settings.token_map[:120]!r} is not a path nginx reads as one word")
    run = settings.runtime_dir.rstrip("/") + "/" if settings.runtime_dir else ""
    error_log = settings.error_log or f"{run}error.log"
    access_log = f"{run}access.log" if settings.access_log else "off"
    tries = len(replicas)
    call = seconds(limits.call_timeout_ms)
    spawn, text_turn = seconds(limits.spawn_timeout_ms), seconds(limits.text_turn_timeout_ms)
    # Several workers: one listening socket each, so the kernel spreads connections.
    reuseport = "" if settings.workers == "1" else " reuseport"
    out: list[str] = [
        "# Generated by `rest-bridge front-config`: nginx in front of codex-rest-bridge",
        f"# replicas ({', '.join(ids)}). Regenerate it rather than edit it.",
        f"worker_processes {settings.workers};",
        "pcre_jit on;",
        f"pid {run}nginx.pid;",
        f"error_log {error_log} warn;",
        "",
        "events {",
        "    worker_connections 4096;",
        "}",
        "",
        "http {",
        f"    access_log {access_log};",
        "    server_tokens off;",
        f"    client_body_temp_path {run}client_body_temp;",
        f"    proxy_temp_path {run}proxy_temp;",
        f"    fastcgi_temp_path {run}fastcgi_temp;",
        f"    uwsgi_temp_path {run}uwsgi_temp;",
        f"    scgi_temp_path {run}scgi_temp;",
        "    default_type application/json;",
        f"    client_max_body_size {limits.max_body_bytes};",
        # Bodies and answers stay in memory, never in temporary files: nginx's workers may
        # run as another user (nobody, under a root master) who cannot write in the
        # runtime directory (0700), which turned a 100 KB body into a 500. A body is
        # held whole by the replica anyway; an answer the client reads slowly holds nginx
        # back from the replica instead of filling a disk.
        f"    client_body_buffer_size {limits.max_body_bytes};",
        "    proxy_max_temp_file_size 0;",
        # The replicas' bounds on a request head: a line, and MAX_HEADER_BYTES in all.
        f"    large_client_header_buffers {max(2, -(-limits.max_header_bytes // 8192))} 8k;",
        # ... and the head's deadline, which aiohttp has no public hook for (bridge.server).
        f"    client_header_timeout {limits.header_timeout_ms}ms;",
        "    keepalive_timeout 75s;",
        "    keepalive_requests 100000;",
        "",
    ]
    # Balanced routes: one pool of every replica per kind of work, and one for reads.
    for pool, what in POOLS:
        out += [
            f"    # {what}",
            f"    upstream {pool} {{",
            "        least_conn;",
            *(
                f"        server {r.address} max_fails=1 fail_timeout={_fail_seconds(pool)}s"
                f"{r.server_flags};"
                for r in replicas
            ),
            f"        keepalive {KEEPALIVE_CONNECTIONS};",
            "        keepalive_requests 100000;",
            "    }",
        ]
    if settings.token_map:
        exempt = [f'        "0:{key}" 0;' for key in EXEMPT]
        # Exactly the pages there are: any other /.front/ path goes to a replica.
        pages = "|".join(sorted({str(status) for status, *_ in _FRONT_PAGES} | {"413", "494"}))
        front_pages = FRONT_ERRORS.replace(".", "\\.")
        out += [
            "    # The bearer token, checked before anything is routed ($bridge_token_ok).",
            f"    include {settings.token_map};",
            '    map "$bridge_token_ok:$request_method:$http_content_length:'
            '$http_transfer_encoding:$uri" $bridge_stranger {',
            "        default 1;",
            '        "~^1:" 0;',
            # The front's own error pages: a request nginx could not read gets its 400
            # (414, 505), never a 401 for headers nginx never read. A client asking
            # for one of them meets its `internal` (404), whose page, like the 413's
            # and the 494's, sends a request without the token to the 401.
            f'        "~^0:[^:]*:[^:]*:[^:]*:{front_pages}({pages})$" 0;',
            *exempt,
            "    }",
        ]
    out += [
        "",
        "    # One upstream per replica, for the sessions it holds.",
    ]
    for r in replicas:
        out += [
            f"    upstream {r.upstream} {{",
            f"        server {r.address}{r.server_flags};",
            f"        keepalive {KEEPALIVE_CONNECTIONS};",
            "        keepalive_requests 100000;",
            "    }",
        ]
    out += [
        "",
        "    server {",
        f"        listen {settings.listen}{reuseport};",
        "        proxy_http_version 1.1;",
        '        proxy_set_header Connection "";',
        "        proxy_set_header Host $http_host;",
        "        proxy_connect_timeout 2s;",
        "        proxy_send_timeout 60s;",
        "        proxy_intercept_errors off;",
        "",
        # Errors nginx itself answers: the error payload, never an HTML page. (A
        # location with an error_page of its own inherits none: each repeats them.)
        *_error_pages("        ", "@no_replica"),
        "",
        *_stranger_check(settings),
        "        # The listing is a read, a creation is work: the same path, two locations",
        "        # (each its own read timeout), chosen by method before a location is.",
        '        if ($request_method ~ "^(GET|HEAD)$") {',
        f"            rewrite ^/v1/sessions$ {LISTING} last;",
        "        }",
        "",
        "        # Sessions: a session id reads <replica>.<uuid>, and goes to that replica,",
        "        # never another. One prefix location per replica: a lookup in nginx's tree",
        "        # of locations, not a regular expression per replica; `^~` keeps the",
        "        # server's regex locations out, so a call tries only the two nested ones.",
    ]
    for r in replicas:
        out += [
            f"        location ^~ /v1/sessions/{r.id}. {{",
            *_error_pages("            ", "@session_replica_down"),
            "            proxy_next_upstream off;",
            f"            proxy_read_timeout {call}s;",
            f"            proxy_pass http://{r.upstream};",
            "            location ~ ^/v1/sessions/[^/]+/events/stream$ {",
            "                proxy_buffering off;",
            "                proxy_cache off;",
            f"                proxy_read_timeout {2 * seconds(limits.sse_keepalive_ms)}s;",
            f"                proxy_pass http://{r.upstream};",
            "            }",
            "            location ~ ^/v1/sessions/[^/]+/events$ {",
            "                proxy_buffering off;",
            f"                proxy_read_timeout {seconds(limits.max_wait_ms)}s;",
            f"                proxy_pass http://{r.upstream};",
            "            }",
            "        }",
        ]
    out += [
        "        # Any other session id names no replica of this front.",
        "        location ~ ^/v1/sessions/[^/]+ {",
        "            return 404 " + _payload("session_not_found", "No session with this id.") + ";",
        "        }",
        "",
        "        # Work is balanced: the next replica when one is full (429), draining (503)",
        "        # or down; a refusal marks the replica for this kind of work only.",
        *_balanced("= /v1/sessions", WORK_NEXT, tries, spawn, CREATE_POOL),
        *_balanced("= /v1/text-turn", WORK_NEXT, tries, text_turn, TEXT_TURN_POOL),
        *_balanced("^~ /v1/call/", WORK_NEXT, tries, call, CALL_POOL),
        "        # Reads (health, compatibility, the OpenAPI document, anything else): the next",
        "        # replica only when one cannot be reached; never refused for a refused work.",
        *_balanced("/", READ_NEXT, tries, READ_SECONDS, READ_POOL),
        "        # The listing (GET or HEAD /v1/sessions, rewritten here): a read that may wait",
        "        # for the peers' answers (PEER_TIMEOUT_SECONDS), passed on as it was asked.",
        *_balanced(f"= {LISTING}", READ_NEXT, tries, LISTING_SECONDS, READ_POOL + "$request_uri"),
        "",
        "        location @session_replica_down {",
        "            add_header Retry-After 1 always;",
        "            return 503 "
        + _payload(
            "replica_unavailable",
            "The replica that holds this session cannot be reached.",
        )
        + ";",
        "        }",
        "        location @no_replica {",
        "            add_header Retry-After 1 always;",
        "            return 503 "
        + _payload("replica_unavailable", "No replica could take the request.")
        + ";",
        "        }",
        *_front_error_locations(settings.token_map),
        *_front_page(
            "413",
            settings.token_map,
            [
                "            return 413 "
                + _payload(
                    "payload_too_large",
                    f"The request body exceeds the limit of {limits.max_body_bytes} bytes.",
                    f',"data":{{"limitBytes":{limits.max_body_bytes}}}',
                )
                + ";"
            ],
        ),
        *_front_page(
            "494",
            settings.token_map,
            [
                "            return 431 "
                + _payload(
                    "headers_too_large",
                    "The request head is over the limits: "
                    f"{limits.max_header_bytes} bytes in all (MAX_HEADER_BYTES), 8 KiB a line.",
                    f',"data":{{"limitBytes":{limits.max_header_bytes}}}',
                )
                + ";"
            ],
        ),
        "    }",
        "}",
    ]
    return "\n".join(out) + "\n"


def replace_config_map(manifest: str, config: str, key: str = "nginx.conf") -> str:
    """``manifest`` (YAML) with the block scalar ``<key>: |`` replaced by ``config``.

    The block runs from the line ``  <key>: |`` to the next document separator (``---``)
    or the end; the rest of the file is kept byte for byte.
    """
    lines = manifest.splitlines(keepends=True)
    starts = [n for n, line in enumerate(lines) if line.rstrip() == f"  {key}: |"]
    if len(starts) != 1:
        raise ValueError(f"the manifest must hold exactly one `  {key}: |` block")
    start = starts[0] + 1
    end = next((n for n in range(start, len(lines)) if lines[n].rstrip() == "---"), len(lines))
    block = [f"    {line}" if line.strip() else "\n" for line in config.splitlines(keepends=True)]
    return "".join(lines[:start] + block + lines[end:])
