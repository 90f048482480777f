"""The front: nginx's configuration for several replicas, generated from their list.

``rest-bridge front-config --replica bridge-0=127.0.0.1:8001 --replica ...`` prints it:
``nginx.conf.template`` (beside this module, shipped with the package: nginx.conf as an
operator reads it, with placeholders) filled in by :func:`render` from the replicas, the
limits and :class:`FrontSettings`; the error payloads the front answers by itself come
from one table, :func:`front_pages`. What the configuration does:

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
  replica that misses its health probes, :mod:`bridge_ops.cluster`) is ``down`` in every
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

import argparse
import functools
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from bridge import TOKEN_VARIABLE, credentials, errors
from bridge.auth import token_problem
from bridge.limits import ReplicaSettingsError, RestLimits, RestLimitsEnvError, validate_replica_id
from bridge.replica import PEER_TIMEOUT_SECONDS
from bridge.settings import LimitVariables

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
#: A listen address, directory or path nginx reads as one word (``[::1]:8787`` too).
_NGINX_WORD = re.compile(r"[A-Za-z0-9._+@%=,:/\[\]-]+")
#: nginx's worker_processes: a count, or ``auto``.
_WORKERS = re.compile(r"auto|[1-9][0-9]{0,3}")

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
    def flags(self) -> str:
        """What follows the address in an upstream's ``server`` line."""
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

    def __post_init__(self) -> None:
        """Each value is one word of nginx.conf, so none can end its directive and add
        another; a bad one raises ValueError naming it."""
        for what, value in (
            ("listen address", self.listen),
            ("runtime directory", self.runtime_dir),
            ("error log", self.error_log),
        ):
            if (value or what == "listen address") and _NGINX_WORD.fullmatch(value) is None:
                raise ValueError(
                    f"the {what} {value[:120]!r} is not one word of nginx.conf "
                    "(no space, quote, brace, semicolon, # or $)"
                )
        if _WORKERS.fullmatch(self.workers) is None:
            raise ValueError(f"workers {self.workers[:40]!r}: a number of processes, or auto")


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


@dataclass(frozen=True, slots=True)
class FrontPage:
    """An answer the front gives by itself: an error payload, its status and headers."""

    status: int
    kind: str
    message: str
    #: ``data`` of the payload, as JSON text; empty: none.
    data: str = ""
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def payload(self) -> str:
        data = f',"data":{self.data}' if self.data else ""
        return _json(f'{{"error":"{self.kind}","message":"{self.message}"{data}}}')


#: Where each status nginx answers by itself goes: an internal location of that URI
#: (asked for directly, it is a 404, or the 401 without the token) returning the error
#: payload. Not named locations: a request whose request line nginx could not read
#: (``OPTIONS *``, ``CONNECT``, a NUL byte, a lower-case method, ``..`` above the root)
#: has no URI, and nginx cannot send it to a named location (its HTML 500 instead).
FRONT_ERRORS = "/.front/"
#: The replicas' 401 message (the body is then the same, byte for byte).
UNAUTHORIZED_MESSAGE = errors.unauthorized().message
#: Where nginx's 414 goes (internal: asked for directly, it is a 404, or the 401).
URI_TOO_LONG = f"{FRONT_ERRORS}414"
#: The pages that would tell a stranger something the token should guard: the body
#: limit (413), the bound on a request head (494), and that the front's internal paths
#: exist (404: a client's request for one of them, or for the listing's internal URI).
#: With a token map, a request whose token nginx did not see there gets the 401 instead.
GUARDED_PAGES = (404, 413, 494)


def front_pages(limits: RestLimits) -> dict[int | str, FrontPage]:
    """Every error payload the front answers by itself, in one table: by the status
    nginx gives it (each an internal location ``/.front/<status>``), and the three the
    configuration answers by name (``session_not_found``, ``session_replica_down``,
    ``no_replica``)."""
    allowed = "DELETE, GET, HEAD, POST"
    return {
        400: FrontPage(400, "bad_request", "The request could not be read."),
        # The replicas' own 401 (the front answers it with a token map: FrontSettings).
        401: FrontPage(
            401, "unauthorized", UNAUTHORIZED_MESSAGE, headers=(("WWW-Authenticate", "Bearer"),)
        ),
        404: FrontPage(404, "not_found", "No such route."),
        405: FrontPage(
            405,
            "method_not_allowed",
            f"The front does not pass this method on; allowed: {allowed}.",
            headers=(("Allow", f'"{allowed}"'),),
        ),
        408: FrontPage(408, "request_timeout", "The request did not arrive in time."),
        411: FrontPage(411, "length_required", "The request body needs a length."),
        414: FrontPage(414, "uri_too_long", "The request line is over 8 KiB."),
        500: FrontPage(500, "internal_error", "The front hit an internal error."),
        501: FrontPage(
            501,
            "not_implemented",
            "The front reads request bodies whose Transfer-Encoding is chunked, or none.",
        ),
        504: FrontPage(
            504, "timeout", "The replica did not answer within the deadline of the front."
        ),
        505: FrontPage(
            505, "http_version_not_supported", "The front speaks HTTP/1.0 and HTTP/1.1."
        ),
        413: FrontPage(
            413,
            "payload_too_large",
            f"The request body exceeds the limit of {limits.max_body_bytes} bytes.",
            data=f'{{"limitBytes":{limits.max_body_bytes}}}',
        ),
        # nginx's own code for a request head over its buffers, answered as 431.
        494: FrontPage(
            431,
            "headers_too_large",
            "The request head is over the limits: "
            f"{limits.max_header_bytes} bytes in all (MAX_HEADER_BYTES), 8 KiB a line.",
            data=f'{{"limitBytes":{limits.max_header_bytes}}}',
        ),
        "session_not_found": FrontPage(404, "session_not_found", "No session with this id."),
        "session_replica_down": FrontPage(
            503,
            "replica_unavailable",
            "The replica that holds this session cannot be reached.",
        ),
        "no_replica": FrontPage(503, "replica_unavailable", "No replica could take the request."),
    }


# -- the template ---------------------------------------------------------------------------

#: The configuration, as an operator reads it: nginx.conf with placeholders, and the
#: blocks repeated for each replica, pool and error page (its preamble says how to read it).
TEMPLATE = "nginx.conf.template"
#: ``${NAME}`` alone on its line (a block of lines, indented as the line), or in a line.
_PLACEHOLDER = re.compile(
    r"^(?P<indent>[ ]*)\$\{(?P<block>[A-Z][A-Z0-9_]*)\}\n|\$\{(?P<name>[A-Z][A-Z0-9_]*)\}",
    re.MULTILINE,
)


@functools.cache
def template_blocks() -> dict[str, str]:
    """The template's blocks by name (read once, from the package)."""
    text = resources.files(__package__).joinpath(TEMPLATE).read_text(encoding="utf-8")
    blocks: dict[str, str] = {}
    for part in re.split(r"^#> ", text, flags=re.MULTILINE)[1:]:
        name, _, body = part.partition("\n")
        blocks[name.strip()] = body.rstrip("\n") + "\n"
    return blocks


def fill(block: str, **values: object) -> str:
    """The template's ``block`` with its placeholders filled in, in one pass (a value is
    never read as a template); a placeholder without a value raises KeyError."""

    def value(match: re.Match[str]) -> str:
        if match["block"] is None:
            return str(values[match["name"]])
        lines = str(values[match["block"]]).splitlines()
        return "".join(f"{match['indent']}{line}\n" if line else "\n" for line in lines)

    return _PLACEHOLDER.sub(value, template_blocks()[block])


def _blocks(block: str, items: Sequence[dict[str, object]]) -> str:
    return "".join(fill(block, **item) for item in items)


def _error_pages(pages: Mapping[int | str, FrontPage], unreachable: str) -> str:
    """nginx's own errors as the payload; ``unreachable`` answers when no replica did."""
    targets = [(str(s), f"{FRONT_ERRORS}{s}") for s in pages if isinstance(s, int)]
    targets.append(("502", unreachable))
    return _blocks("error page", [{"STATUS": s, "TARGET": t} for s, t in sorted(targets)])


def _front_pages(pages: Mapping[int | str, FrontPage], token_map: str) -> str:
    """The internal location of each error page. Whatever the body, no 413 there: nginx
    already refused or is discarding it, and a second error would get its HTML page."""
    guard = fill("guard", UNAUTHORIZED_URI=f"{FRONT_ERRORS}401")
    return _blocks(
        "front page",
        [
            {
                "URI": f"{FRONT_ERRORS}{status}",
                "GUARD": guard if token_map and status in GUARDED_PAGES else "",
                "HEADERS": _blocks("header", [{"NAME": n, "VALUE": v} for n, v in page.headers]),
                "STATUS": page.status,
                "PAYLOAD": page.payload,
            }
            for status, page in pages.items()
            if isinstance(status, int)
        ],
    )


def _token_check(pages: Mapping[int | str, FrontPage], token_map: str) -> str:
    """The map of ``$bridge_stranger``: 1 for a request that needs the token and lacks it.

    Its key is ``token-ok:method:content-length:transfer-encoding:uri``. Exempt are the
    front's own error pages (a request nginx could not read gets its 400, 414 or 505,
    never a 401 for headers nginx never read; a client asking for one of them meets its
    ``internal``, whose 404 page sends a request without the token to the 401) and what
    a replica exempts from the token (bridge.auth: GET or HEAD of the two health paths),
    with no body (no Content-Length but 0, no Transfer-Encoding): a stranger's health
    request with a body gets the 401, whatever its length, so that no length tells the
    body limit (a 413) from one under it.
    """
    if not token_map:
        return ""
    # Exactly the pages there are: any other /.front/ path goes to a replica.
    uris = "|".join(sorted(str(s) for s in pages if isinstance(s, int)))
    escaped = FRONT_ERRORS.replace(".", "\\.")
    return fill("token check", TOKEN_MAP=token_map, FRONT_PAGE_URIS=f"{escaped}({uris})")


def seconds(milliseconds: int) -> int:
    return -(-milliseconds // 1000) + MARGIN_SECONDS


def render(
    replicas: Sequence[Replica], limits: RestLimits, settings: FrontSettings | None = None
) -> str:
    """nginx.conf for ``replicas`` behind one server: the template, filled in."""
    if not replicas:
        raise ValueError("a front needs at least one replica")
    ids = [r.id for r in replicas]
    if len(set(ids)) != len(ids):
        raise ValueError("replica ids must be unique")
    settings = settings or FrontSettings()
    if settings.token_map and _NGINX_PATH.fullmatch(settings.token_map) is None:
        raise ValueError(f"{settings.token_map[:120]!r} is not a path nginx reads as one word")
    run = settings.runtime_dir.rstrip("/") + "/" if settings.runtime_dir else ""
    pages = front_pages(limits)
    error_pages = _error_pages(pages, "@no_replica")
    call = seconds(limits.call_timeout_ms)
    pools = [
        {
            "WHAT": what,
            "POOL": pool,
            "KEEPALIVE": KEEPALIVE_CONNECTIONS,
            "SERVERS": _blocks(
                "pool server",
                [
                    {"ADDRESS": r.address, "FAIL_SECONDS": _fail_seconds(pool), "DOWN": r.flags}
                    for r in replicas
                ],
            ),
        }
        for pool, what in POOLS
    ]
    upstreams = [
        {
            "UPSTREAM": r.upstream,
            "ADDRESS": r.address,
            "DOWN": r.flags,
            "KEEPALIVE": KEEPALIVE_CONNECTIONS,
        }
        for r in replicas
    ]
    sessions = [
        {
            "REPLICA_ID": r.id,
            "UPSTREAM": r.upstream,
            "ERROR_PAGES": _error_pages(pages, "@session_replica_down"),
            "CALL_SECONDS": call,
            "STREAM_SECONDS": 2 * seconds(limits.sse_keepalive_ms),
            "LONG_POLL_SECONDS": seconds(limits.max_wait_ms),
        }
        for r in replicas
    ]
    return fill(
        "nginx.conf",
        REPLICA_IDS=", ".join(ids),
        WORKERS=settings.workers,
        RUN=run,
        ERROR_LOG=settings.error_log or f"{run}error.log",
        ACCESS_LOG=f"{run}access.log" if settings.access_log else "off",
        MAX_BODY_BYTES=limits.max_body_bytes,
        # The replicas' bounds on a request head: a line, and MAX_HEADER_BYTES in all.
        HEADER_BUFFERS=max(2, -(-limits.max_header_bytes // 8192)),
        HEADER_TIMEOUT_MS=limits.header_timeout_ms,
        POOLS=_blocks("pool", pools),
        TOKEN_CHECK=_token_check(pages, settings.token_map),
        REPLICA_UPSTREAMS=_blocks("replica upstream", upstreams),
        # Several workers: one listening socket each, so the kernel spreads connections.
        LISTEN=settings.listen + ("" if settings.workers == "1" else " reuseport"),
        ERROR_PAGES=error_pages,
        STRANGER_CHECK=(
            fill("stranger check", UNAUTHORIZED_URI=f"{FRONT_ERRORS}401")
            if settings.token_map
            else ""
        ),
        BAD_REQUEST_URI=f"{FRONT_ERRORS}400",
        LISTING=LISTING,
        SESSION_LOCATIONS=_blocks("session location", sessions),
        SESSION_NOT_FOUND=pages["session_not_found"].payload,
        WORK_NEXT=WORK_NEXT,
        READ_NEXT=READ_NEXT,
        TRIES=len(replicas),
        SPAWN_SECONDS=seconds(limits.spawn_timeout_ms),
        TEXT_TURN_SECONDS=seconds(limits.text_turn_timeout_ms),
        CALL_SECONDS=call,
        READ_SECONDS=READ_SECONDS,
        LISTING_SECONDS=LISTING_SECONDS,
        SESSION_REPLICA_DOWN=pages["session_replica_down"].payload,
        NO_REPLICA=pages["no_replica"].payload,
        FRONT_PAGES=_front_pages(pages, settings.token_map),
    )


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


def main(args: argparse.Namespace) -> int:
    """``rest-bridge front-config``: print the configuration, write it into a ConfigMap's
    manifest, or print the token map; 2 on a bad argument, with one line saying why."""
    if args.print_token_map:
        try:
            token = credentials.read_secret(TOKEN_VARIABLE)
            if token is None:
                raise ValueError(
                    f"neither {TOKEN_VARIABLE} nor {TOKEN_VARIABLE}{credentials.FILE_SUFFIX} "
                    "is set: there is no token to check"
                )
            sys.stdout.write(token_map_text(token))
        except ValueError as exc:
            # The message names what is wrong with the token, never the token.
            print(f"rest-bridge front-config: {exc}", file=sys.stderr)
            return 2
        return 0
    if not args.replica:
        print("rest-bridge front-config: give at least one --replica ID=HOST:PORT", file=sys.stderr)
        return 2
    try:
        replicas = [parse_replica(text) for text in args.replica]
        config = render(
            replicas,
            LimitVariables.from_env().limits(),
            FrontSettings(
                listen=args.listen,
                workers=args.workers,
                runtime_dir=args.runtime_dir,
                error_log=args.error_log,
                token_map=args.token_map,
            ),
        )
    except (RestLimitsEnvError, ValueError) as exc:
        print(f"rest-bridge front-config: {exc}", file=sys.stderr)
        return 2
    if args.write_config_map:
        path = Path(args.write_config_map)
        try:
            path.write_text(replace_config_map(path.read_text(), config))
        except (OSError, ValueError) as exc:
            print(f"rest-bridge front-config: {exc}", file=sys.stderr)
            return 2
        return 0
    sys.stdout.write(config)
    return 0
