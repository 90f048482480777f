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
  both: its pool is chosen by method (a ``map`` on ``$request_method``).
- **Streams pass unbuffered.** SSE and long-poll responses are not buffered, and every
  read timeout is derived from the limits (``REST_ADAPTER_*``, read when the
  configuration is generated): the SSE keep-alive interval for streams, MAX_WAIT_MS for
  long-polls, SPAWN_TIMEOUT_MS for creation, TEXT_TURN_TIMEOUT_MS for text turns,
  CALL_TIMEOUT_MS for the rest, each plus :data:`MARGIN_SECONDS`. Plain routes keep
  nginx's buffering, which costs it less CPU per call.
- **Keep-alive to the replicas**, HTTP/1.1, and request bodies bounded by
  MAX_BODY_BYTES as the replicas bound them. A replica on the same machine may be
  reached over a unix socket (``id=unix:/path``): about 10 µs less CPU per call for
  the replica, and a little less for nginx, than over TCP on the loopback
  (bench/FINDINGS.md); nginx's workers need write permission on the socket.
- **Every error nginx itself produces is the error payload** (JSON), never its HTML
  pages. Authentication stays in the replicas: the ``Authorization`` header passes
  through untouched.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from bridge.limits import RestLimits
from bridge.replica import ReplicaSettingsError, validate_replica_id

#: Added to every read timeout derived from a limit: the replica answers first.
MARGIN_SECONDS = 5
#: Idle keep-alive connections nginx keeps to each replica (per worker): above the
#: connections in flight, or nginx closes and reopens connections under steady load
#: (32 against 64 in flight cost each replica about 50 µs of CPU per call more).
KEEPALIVE_CONNECTIONS = 256
_HOST_PORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")
#: An absolute socket path nginx reads as one word (no space, quote, brace, semicolon).
_UNIX_PATH = re.compile(r"/[A-Za-z0-9._+@%=,:/-]*")

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


@dataclass(frozen=True, slots=True)
class Replica:
    """One replica: its id and where nginx reaches it (``host:port`` or ``unix:/path``)."""

    id: str
    address: str

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


def _json(text: str) -> str:
    """``text`` as one nginx string literal (single-quoted; the payload has no quote)."""
    if "'" in text or "\\" in text:
        raise ValueError("a payload for nginx cannot hold a quote or a backslash")
    return f"'{text}'"


def _payload(kind: str, message: str, extra: str = "") -> str:
    return _json(f'{{"error":"{kind}","message":"{message}"{extra}}}')


#: Where nginx's 414 goes (internal: asked for directly, it is a 404).
URI_TOO_LONG = "/.front/uri-too-long"


def _error_pages(indent: str, unreachable: str) -> list[str]:
    """nginx's own errors as the payload; ``unreachable`` answers when no replica did."""
    pages = [
        ("400", "@bad_request"),
        ("413", "@payload_too_large"),
        ("404", "@not_found"),
        # A request line nginx could not read has no URI: a named location cannot take it.
        ("414", URI_TOO_LONG),
        ("494", "@headers_too_large"),
        ("500", "@internal_error"),
        ("502", unreachable),
        ("504", "@front_timeout"),
    ]
    return [f"{indent}error_page {codes} = {target};" for codes, target in pages]


def _balanced(match: str, next_upstream: str, tries: int, timeout: int, pool: str) -> list[str]:
    """A location balanced over ``pool``, passing on to the next replica on ``next_upstream``."""
    return [
        f"        location {match} {{",
        *_error_pages("            ", "@no_replica"),
        f"            proxy_next_upstream {next_upstream};",
        f"            proxy_next_upstream_tries {tries};",
        f"            proxy_read_timeout {timeout}s;",
        f"            proxy_pass http://{pool};",
        "        }",
    ]


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
        "    client_body_buffer_size 64k;",
        # The replicas' bounds on a request head: a line, and MAX_HEADER_BYTES in all.
        f"    large_client_header_buffers {max(2, -(-limits.max_header_bytes // 8192))} 8k;",
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
            *(f"        server {r.address} max_fails=1 fail_timeout=2s;" for r in replicas),
            f"        keepalive {KEEPALIVE_CONNECTIONS};",
            "        keepalive_requests 100000;",
            "    }",
        ]
    out += [
        "    # The listing is a read, a creation is work: the same path, two pools.",
        "    map $request_method $bridge_sessions_pool {",
        f"        default {CREATE_POOL};",
        f"        GET {READ_POOL};",
        f"        HEAD {READ_POOL};",
        "    }",
        "",
        "    # One upstream per replica, for the sessions it holds.",
    ]
    for r in replicas:
        out += [
            f"    upstream {r.upstream} {{",
            f"        server {r.address};",
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
        *_balanced("= /v1/sessions", WORK_NEXT, tries, spawn, "$bridge_sessions_pool"),
        *_balanced("= /v1/text-turn", WORK_NEXT, tries, text_turn, TEXT_TURN_POOL),
        *_balanced("^~ /v1/call/", WORK_NEXT, tries, call, CALL_POOL),
        "        # Reads (health, compatibility, the OpenAPI document, anything else): the next",
        "        # replica only when one cannot be reached; never refused for a refused work.",
        *_balanced("/", READ_NEXT, tries, call, READ_POOL),
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
        "        location @bad_request {",
        "            return 400 " + _payload("bad_request", "The request could not be read.") + ";",
        "        }",
        "        location @payload_too_large {",
        "            return 413 "
        + _payload(
            "payload_too_large",
            f"The request body exceeds the limit of {limits.max_body_bytes} bytes.",
            f',"data":{{"limitBytes":{limits.max_body_bytes}}}',
        )
        + ";",
        "        }",
        "        location @not_found {",
        "            return 404 " + _payload("not_found", "No such route.") + ";",
        "        }",
        f"        location = {URI_TOO_LONG} {{",
        "            internal;",
        "            return 414 "
        + _payload("uri_too_long", "The request line is over 8 KiB.")
        + ";",
        "        }",
        "        location @headers_too_large {",
        "            return 431 "
        + _payload(
            "headers_too_large",
            "The request head is over the limits: "
            f"{limits.max_header_bytes} bytes in all (MAX_HEADER_BYTES), 8 KiB a line.",
            f',"data":{{"limitBytes":{limits.max_header_bytes}}}',
        )
        + ";",
        "        }",
        "        location @internal_error {",
        "            return 500 "
        + _payload("internal_error", "The front hit an internal error.")
        + ";",
        "        }",
        "        location @front_timeout {",
        "            return 504 "
        + _payload("timeout", "The replica did not answer within the deadline of the front.")
        + ";",
        "        }",
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
