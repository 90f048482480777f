"""HTTP handlers: parse and check the request, call the backend, render the record.

Handlers hold no state of their own; the backend and the router's configuration
come from the application (:data:`BACKEND`, :data:`CONFIG`). :class:`Route` is the record
of one route (the table of them is :data:`bridge.app.ROUTES`), which the OpenAPI document
reads too.
"""

from __future__ import annotations

import asyncio
import functools
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict
from pydantic import BaseModel, TypeAdapter, ValidationError

from bridge import __version__, credentials, errors, sse
from bridge.auth import HEALTH_PATHS
from bridge.backend import PEER_QUERY_HEADER, Backend
from bridge.limits import RestLimits
from bridge.models import (
    CallBody,
    ClientOptions,
    ReplyError,
    ReplyResult,
    SessionCreateRequest,
    SessionlessCallBody,
    TextTurnRequest,
)
from bridge.policy import MethodPolicy, MethodRules
from bridge.wire import dumps

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """What a router preset decides beyond its route set."""

    limits: RestLimits
    #: Wire names of the ClientOptions fields callers may set; None allows all.
    allowed_client_options: frozenset[str] | None = None
    #: Which app-server methods the raw call routes (and the text turn) may call.
    method_rules: MethodRules = field(default_factory=lambda: MethodRules((), MethodPolicy()))


@dataclass(frozen=True, slots=True)
class QueryParam:
    name: str
    description: str
    kind: str = "integer"
    header: bool = False


@dataclass(frozen=True, slots=True)
class Route:
    """One route of the API: how to mount it and how to document it."""

    name: str
    method: str
    path: str
    handler: Handler
    summary: str
    body: type[BaseModel] | None = None
    status: int = 200
    response: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    query: tuple[QueryParam, ...] = ()
    tags: tuple[str, ...] = ()
    extra_statuses: tuple[int, ...] = ()
    event_stream: bool = False
    description: str = ""
    #: A plain JSON Schema for a response that has no wire model.
    response_schema: dict[str, Any] | None = None

    @property
    def answers_head(self) -> bool:
        """A health check, which load balancers make with HEAD too. Other GET routes answer
        HEAD with 405: it would open a stream or wait on a poll."""
        return self.method == "GET" and self.path in HEALTH_PATHS


BACKEND = web.AppKey("bridge.backend", Backend)
CONFIG = web.AppKey("bridge.config", RouterConfig)


# -- request parsing ---------------------------------------------------------------


#: The headers of a JSON answer, built once (aiohttp copies them into each response).
_JSON_HEADERS = CIMultiDict({"Content-Type": "application/json"})


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=dumps(body), headers=_JSON_HEADERS)


def dump(model: BaseModel) -> Any:
    return model.model_dump(mode="json", by_alias=True, exclude_none=False)


#: The content codings a request body may use (``Content-Encoding``).
DECODED_ENCODINGS = frozenset({"", "identity", "gzip", "x-gzip", "deflate"})


async def read_raw_body(request: web.Request, limits: RestLimits) -> bytes:
    """The request body's bytes, decoded: within BODY_TIMEOUT_MS (else 408, the connection
    closed), in a coding the bridge decodes (else 415), and within MAX_BODY_BYTES (413)."""
    limit = limits.max_body_bytes
    encoding = request.headers.get("Content-Encoding")
    if encoding:
        encoding = encoding.strip().lower()
        if encoding not in DECODED_ENCODINGS:
            raise errors.of_kind(
                "unsupported_media_type",
                "The request body's Content-Encoding is not one the bridge decodes "
                "(identity, gzip, deflate).",
                data={"contentEncoding": encoding[:100]},
            )
    try:
        content = request.content
        if content.is_eof():
            # The whole body has arrived (a small body comes with its headers): it is
            # taken as it is buffered, with no deadline (no timer per request) and no wait,
            # and its size is its own (Content-Length need not be read).
            raw = content.read_nowait()
            if len(raw) > limit:
                raise errors.payload_too_large(limit)
        else:
            length = request.content_length
            if length is not None and length > limit:
                raise errors.payload_too_large(limit)
            async with asyncio.timeout(limits.body_timeout_ms / 1000):
                raw = await request.read()
    except TimeoutError:
        raise errors.request_timeout(limits.body_timeout_ms) from None
    except web.RequestPayloadError:
        # A body that cannot be decoded, e.g. `Content-Encoding: gzip` over plain bytes.
        # Its rest cannot be skipped, so aiohttp drops the connection after the response:
        # say so, or a keep-alive client would send its next request into a closed one.
        raise errors.bad_request(
            "The request body could not be read.", close_connection=True
        ) from None
    if encoding and encoding != "identity" and content.total_compressed_bytes is None:
        # The server was run without automatic decompression (as `rest-bridge serve`
        # runs it): decode here, never past the limit.
        raw = decompress_body(raw, encoding, limit)
    return raw


def decompress_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """``raw`` decoded from gzip or deflate: a 413 past ``limit`` bytes, a 400 if broken."""
    wbits = zlib.MAX_WBITS | 16 if encoding in ("gzip", "x-gzip") else zlib.MAX_WBITS
    if encoding == "deflate" and raw[:1] and raw[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS  # a raw deflate stream, as some clients send
    decoder = zlib.decompressobj(wbits)
    try:
        body = decoder.decompress(raw, limit + 1)
        if len(body) > limit:
            raise errors.payload_too_large(limit)
        if not decoder.eof or decoder.unused_data:
            raise zlib.error("truncated or trailing data")
    except zlib.error:
        raise errors.bad_request(
            "The request body could not be read.", close_connection=True
        ) from None
    return body


#: What makes pydantic's parser take a number JSON does not have: NaN, Infinity, and
#: values that overflow a double (an exponent, or a run of 300 digits) end up infinite.
#: Written to start with one class of bytes, so that the search skips every other byte
#: in one test (``NaN|Infinity|[0-9][eE]|[0-9]{300}`` tried each alternative at every
#: byte: 3 times the instructions on ``{"params":{}}``, 10 times on a long text), and
#: to count a run of digits from its first digit only (counted again from each of its
#: digits, a body of 299-digit numbers took time in the square of the run's length).
_SUSPECT_NUMBERS = re.compile(
    rb"""[NI0-9]
    (?: (?<=N) aN | (?<=I) nfinity | (?<=[0-9]) [eE]
      | (?<![0-9][0-9]) (?<=[0-9]) [0-9]{299} )""",
    re.VERBOSE,
)


# A request model's validator, made on its first use (the models defer building it):
# ``TypeAdapter.validate_json`` validates as ``model_validate_json`` does, with less
# Python around pydantic's core (about 1,500 instructions a call fewer).
@functools.cache
def _adapter(model: type[BaseModel]) -> TypeAdapter[Any]:
    return TypeAdapter(model)


def validate_body(model: type[M], raw: bytes) -> M:
    """``raw`` validated as ``model`` (empty counts as ``{}``), or the bridge's 400."""
    if not raw.strip():
        raw = b"{}"
    if _SUSPECT_NUMBERS.search(raw) is not None:
        # pydantic's parser takes these as numbers (infinite, or NaN); JSON has no such
        # numbers, and they would reach the app-server as null. Only a body that has
        # such text (a string may) pays for the second parse.
        try:
            orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise errors.bad_request(
                "The request body is not valid JSON.",
                data={
                    "errors": [{"loc": [], "msg": f"Invalid JSON: {exc}", "type": "json_invalid"}]
                },
            ) from None
    try:
        body: M = _adapter(model).validate_json(raw)
        return body
    except ValidationError as exc:
        details = [
            {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_input=False, include_context=False)
        ]
        invalid_json = any(d["type"] == "json_invalid" for d in details)
        message = (
            "The request body is not valid JSON."
            if invalid_json
            else "The request body does not match the expected shape."
        )
        raise errors.bad_request(message, data={"errors": details}) from None


def refuse_options(options: ClientOptions | None, allowed: frozenset[str] | None) -> None:
    """Raise the bridge's 403 for ClientOptions fields outside ``allowed`` (None: all)."""
    if options is None:
        return
    refused = sorted(f for f in options.set_fields() if allowed is not None and f not in allowed)
    if refused:
        message = "This router does not allow these client options: " + ", ".join(refused)
        raise errors.of_kind("options_not_allowed", message, data={"fields": refused})
    reserved = credentials.reserved_variables(options.env)
    if reserved:
        # The bridge's own variables (its secrets, its processes' marks), whatever backend.
        raise errors.reserved_variables(reserved)


def check_method(config: RouterConfig, method: str) -> None:
    """Refuse an app-server method the router's method policy refuses (403), before
    anything is spawned or sent."""
    rules = config.method_rules
    if not rules.allows_all and not rules.allows(method):
        raise errors.method_refused(method)


def check_params(config: RouterConfig, method: str, params: Any) -> None:
    """Refuse the params the router's method policy refuses ``method`` to carry (403)."""
    refused = config.method_rules.refused_params_of(method, params)
    if refused:
        raise errors.method_refused(method, refused)


def query_int(request: web.Request, name: str, default: int | None) -> int | None:
    return parse_query_int(name, request.query.get(name), default)


#: The largest position or count a request may name (a signed 64-bit integer).
MAX_QUERY_INT = 2**63 - 1


def plain_int(raw: str) -> int | None:
    """``raw`` as an integer if it is ASCII digits only (``[0-9]+``) up to MAX_QUERY_INT.

    Not ``int()``'s reading, which takes ``" 3"``, ``"+3"``, ``"1_0"`` (as 10) and digits
    of other scripts (``"\u0663"``, fullwidth): what the client sent is what is used.
    """
    if not raw or not raw.isascii() or not raw.isdigit() or len(raw) > 19:
        return None
    value = int(raw)
    return value if value <= MAX_QUERY_INT else None


def parse_query_int(name: str, raw: str | None, default: int | None) -> int | None:
    """A non-negative integer query parameter, ``default`` when absent, else the 400."""
    if raw is None:
        return default
    value = plain_int(raw)
    if value is None:
        raise errors.bad_request(f"Query parameter {name!r} must be a non-negative integer.")
    return value


def backend(request: web.Request) -> Backend:
    return request.app[BACKEND]


# -- handlers ----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok", "version": __version__})


async def compatibility(request: web.Request) -> web.Response:
    source = backend(request)
    info = await source.compatibility()
    info = info.model_copy(update={"replica": source.replica_id, "draining": source.draining})
    return json_response(dump(info))


#: The methods a text turn calls.
TEXT_TURN_METHODS = ("thread/start", "turn/start")


async def text_turn(request: web.Request) -> web.Response:
    app = request.app
    config = app[CONFIG]
    for method in TEXT_TURN_METHODS:
        check_method(config, method)
    body = validate_body(TextTurnRequest, await read_raw_body(request, config.limits))
    refuse_options(body.options, config.allowed_client_options)
    check_params(config, "thread/start", body.thread_params)
    check_params(config, "turn/start", body.turn_params)
    result = await app[BACKEND].text_turn(body)
    return json_response(result.model_dump(mode="json", by_alias=True, exclude_unset=True))


async def call(request: web.Request) -> web.Response:
    app = request.app
    config = app[CONFIG]
    method = request.match_info["method"]
    check_method(config, method)
    body = validate_body(SessionlessCallBody, await read_raw_body(request, config.limits))
    refuse_options(body.options, config.allowed_client_options)
    check_params(config, method, body.params)
    result = await app[BACKEND].call(
        method, body.params, options=body.options, timeout_ms=body.timeout_ms
    )
    return json_response({"result": result})


async def list_sessions(request: web.Request) -> web.Response:
    sessions = await backend(request).list_sessions()
    body: dict[str, Any] = {"sessions": [dump(s) for s in sessions]}
    # Behind a front with several replicas: every replica's sessions, unless this is
    # itself a replica's question (asked so, a replica answers with its own only).
    if request.headers.get(PEER_QUERY_HEADER) is None:
        peers = await backend(request).peer_sessions(request.headers.get("Authorization"))
        if peers is not None:
            body["sessions"].extend(peers.sessions)
            body["unavailableReplicas"] = peers.unavailable
    return json_response(body)


async def create_session(request: web.Request) -> web.Response:
    app = request.app
    config = app[CONFIG]
    body = validate_body(SessionCreateRequest, await read_raw_body(request, config.limits))
    refuse_options(body.options, config.allowed_client_options)
    created = await app[BACKEND].create_session(body.options)
    return json_response(dump(created), status=201)


async def delete_session(request: web.Request) -> web.Response:
    session_id = request.match_info["sessionId"]
    await backend(request).delete_session(session_id)
    return json_response({"status": "deleted", "sessionId": session_id})


async def session_call(request: web.Request) -> web.Response:
    app = request.app
    config = app[CONFIG]
    match_info = request.match_info
    method = match_info["method"]
    check_method(config, method)
    body = validate_body(CallBody, await read_raw_body(request, config.limits))
    check_params(config, method, body.params)
    result = await app[BACKEND].session_call(
        match_info["sessionId"], method, body.params, timeout_ms=body.timeout_ms
    )
    return json_response({"result": result})


async def events(request: web.Request) -> web.Response:
    """Long-poll: the next event (or the first after ``after``), or 204 after ``waitMs``."""
    limits = request.app[CONFIG].limits
    wait_ms = query_int(request, "waitMs", limits.max_wait_ms)
    after = query_int(request, "after", None)
    assert wait_ms is not None
    batch = await backend(request).read_events(
        request.match_info["sessionId"],
        after=after,
        wait_ms=min(wait_ms, limits.max_wait_ms),
        limit=1,
    )
    if not batch:
        return web.Response(status=204)
    return web.Response(body=batch[0].json(), content_type="application/json")


#: What an event stream answers with (the harness reads the same names); what it writes
#: is bridge.sse's.
SSE_CONTENT_TYPE = "text/event-stream"
SSE_HEADERS = {
    "Content-Type": SSE_CONTENT_TYPE,
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def sse_position(request: web.Request) -> int | None:
    """Where a stream starts; ``Last-Event-ID`` or ``after`` given twice is a 400."""
    headers = request.headers.getall("Last-Event-ID", [])
    if len(headers) > 1:
        raise errors.bad_request("Last-Event-ID must be sent at most once.")
    if len(request.query.getall("after", [])) > 1:
        raise errors.bad_request("Query parameter 'after' must be sent at most once.")
    return parse_sse_position(request.query.get("after"), headers[0] if headers else None)


def parse_sse_position(after_raw: str | None, header: str | None) -> int | None:
    """Where a stream starts: ``Last-Event-ID`` over ``?after=``; a bad value is a 400.

    Both are ASCII digits only (:func:`plain_int`); the header may be blank (absent).
    """
    # `after` is checked even when Last-Event-ID wins: a bad value is a 400 either way.
    after = parse_query_int("after", after_raw, None)
    if header is not None and header.strip(" \t"):
        value = plain_int(header.strip(" \t"))
        if value is None:
            raise errors.bad_request("Last-Event-ID must be a non-negative integer.")
        return value
    return after


async def events_stream(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: every event from the position on, until the ``exit`` event."""
    limits = request.app[CONFIG].limits
    after = sse_position(request)
    stream = await backend(request).open_stream(request.match_info["sessionId"], after)
    completed = False
    try:
        # Read once before answering, so an unknown or finished session is a JSON error.
        batch = await stream.next_batch(0, sse.BATCH)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        keepalive = limits.sse_keepalive_ms / 1000
        completed = await sse.write_events(request, response, stream, batch, keepalive)
        return response
    finally:
        stream.close(completed)


#: The application's OpenAPI document as bytes, built on first use (functools.cache).
OPENAPI = web.AppKey[Callable[[], bytes]]("bridge.openapi")


async def openapi_document(request: web.Request) -> web.Response:
    """The OpenAPI document of the routes this application mounts."""
    body = request.app[OPENAPI]()
    return web.Response(body=body, content_type="application/json")


async def reply_result(request: web.Request) -> web.Response:
    body = validate_body(ReplyResult, await read_raw_body(request, request.app[CONFIG].limits))
    key = request.match_info["requestKey"]
    await backend(request).reply_result(request.match_info["sessionId"], key, body.result)
    return json_response({"status": "sent", "requestKey": key})


async def reply_error(request: web.Request) -> web.Response:
    body = validate_body(ReplyError, await read_raw_body(request, request.app[CONFIG].limits))
    key = request.match_info["requestKey"]
    await backend(request).reply_error(
        request.match_info["sessionId"], key, body.code, body.message, body.data
    )
    return json_response({"status": "sent", "requestKey": key})
