"""The route table and the router presets.

Every preset is a function returning an :class:`aiohttp.web.Application`. The
route table below is the single description of the HTTP API: it mounts the
handlers and it is what the OpenAPI document is built from.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import orjson
from aiohttp import web

from bridge import errors, logs, models, routes
from bridge.auth import AUTH, admitted, with_bearer_auth
from bridge.backend import Backend
from bridge.limits import AppServerSettings, RestLimits
from bridge.observe import observed_expect
from bridge.openapi import build_openapi
from bridge.policy import HOST_METHODS, HOST_PARAMS, MethodPolicy, MethodRules
from bridge.process.backend import ProcessBackend
from bridge.process.shared import ConnectShared
from bridge.process.startup import DEFAULT_COMMAND
from bridge.routes import QueryParam as QueryParam
from bridge.routes import Route as Route
from bridge.server import SERVER_SETTINGS as SERVER_SETTINGS
from bridge.server import ParserRefusals, head_middleware, head_problem
from bridge.settings import AppServerVariables, MethodPolicyVariables

_SESSION = (404, 409)
#: What any route that reads a body can answer about it.
_BODY = (400, 408, 413, 415)
_SPAWN = (403, 429, 502, 503, 504)

ROUTES: tuple[Route, ...] = (
    Route(
        "openapi",
        "GET",
        "/v1/openapi.json",
        routes.openapi_document,
        "The OpenAPI 3.1.0 document of this router",
        response_schema={"type": "object"},
    ),
    Route("health", "GET", "/health", routes.health, "Liveness", response=models.Health),
    Route("v1_health", "GET", "/v1/health", routes.health, "Liveness", response=models.Health),
    Route(
        "compatibility",
        "GET",
        "/v1/compatibility",
        routes.compatibility,
        "Bridge and app-server versions",
        response=models.Compatibility,
    ),
    Route(
        "text_turn",
        "POST",
        "/v1/text-turn",
        routes.text_turn,
        "Run one text turn on a fresh app-server process",
        body=models.TextTurnRequest,
        response=models.TextTurnResponse,
        errors=(*_BODY, *_SPAWN),
    ),
    Route(
        "call",
        "POST",
        "/v1/call/{method:(?s:.+)}",
        routes.call,
        "Call a raw method on an app-server process spawned for this call",
        body=models.SessionlessCallBody,
        response=models.CallResponse,
        errors=(*_BODY, *_SPAWN),
    ),
    Route(
        "list_sessions",
        "GET",
        "/v1/sessions",
        routes.list_sessions,
        "List sessions",
        response=models.SessionList,
    ),
    Route(
        "create_session",
        "POST",
        "/v1/sessions",
        routes.create_session,
        "Create a session (spawn and initialize an app-server process)",
        body=models.SessionCreateRequest,
        status=201,
        response=models.SessionCreated,
        errors=(*_BODY, *_SPAWN),
    ),
    Route(
        "delete_session",
        "DELETE",
        "/v1/sessions/{sessionId}",
        routes.delete_session,
        "Delete a session and stop its process",
        response=models.StatusResponse,
        errors=(404,),
    ),
    Route(
        "session_call",
        "POST",
        "/v1/sessions/{sessionId}/call/{method:(?s:.+)}",
        routes.session_call,
        "Call a raw method in a session",
        body=models.CallBody,
        response=models.CallResponse,
        errors=(*_BODY, 429, 502, 503, 504, *_SESSION),
    ),
    Route(
        "events",
        "GET",
        "/v1/sessions/{sessionId}/events",
        routes.events,
        "Long-poll the next event of a session",
        response=models.EventResponse,
        errors=(400, *_SESSION),
        extra_statuses=(204,),
        query=(
            QueryParam("waitMs", "How long to wait for an event (capped by MAX_WAIT_MS)."),
            QueryParam("after", "Read the first event with a larger seq; the cursor stays."),
        ),
    ),
    Route(
        "events_stream",
        "GET",
        "/v1/sessions/{sessionId}/events/stream",
        routes.events_stream,
        "Stream the events of a session as Server-Sent Events",
        response=models.EventResponse,
        errors=(400, *_SESSION),
        event_stream=True,
        query=(
            QueryParam("after", "Start after this seq instead of at the cursor."),
            QueryParam("Last-Event-ID", "Resume after this seq.", header=True),
        ),
    ),
    Route(
        "reply_result",
        "POST",
        "/v1/sessions/{sessionId}/requests/{requestKey:(?s:.+)}/result",
        routes.reply_result,
        "Answer a server-originated request with a result",
        body=models.ReplyResult,
        response=models.StatusResponse,
        errors=(*_BODY, 429, 502, 404, 409),
    ),
    Route(
        "reply_error",
        "POST",
        "/v1/sessions/{sessionId}/requests/{requestKey:(?s:.+)}/error",
        routes.reply_error,
        "Answer a server-originated request with a JSON-RPC error",
        body=models.ReplyError,
        response=models.StatusResponse,
        errors=(*_BODY, 429, 502, 404, 409),
    ),
)

#: The routes by name (their OpenAPI operationId).
ROUTE_BY_NAME: dict[str, Route] = {r.name: r for r in ROUTES}


ALL_ROUTES = frozenset(r.name for r in ROUTES)
#: Mounted first: aiohttp tries these before the other routes under `/v1/sessions`.
HOT_ROUTES = frozenset({"session_call"})
TEXT_TURN_ROUTES = frozenset({"health", "v1_health", "compatibility", "text_turn", "openapi"})
DEFAULT_ROUTES = ALL_ROUTES - {"call"}
DEFAULT_CLIENT_OPTIONS = frozenset({"clientInfo", "optOutNotificationMethods"})


@dataclass(frozen=True)
class RouterOptions:
    """What a router mounts and which ClientOptions fields its callers may set."""

    routes: frozenset[str] = ALL_ROUTES
    #: Wire names of allowed ClientOptions fields; None allows every field.
    allowed_client_options: frozenset[str] | None = None
    limits: RestLimits = field(default_factory=RestLimits)
    #: Rules of the preset: the app-server methods it refuses (bridge.policy).
    refused_methods: frozenset[str] = frozenset()
    #: The host's method rules, which win over the preset's.
    method_policy: MethodPolicy = field(default_factory=MethodPolicy)
    #: Method → params a call of it may not carry (the preset's; bridge.policy).
    refused_params: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.routes) - ALL_ROUTES
        if unknown:
            raise ValueError(f"unknown routes: {sorted(unknown)}")


MOUNTED = web.AppKey("bridge.routes", tuple)


def mounted_routes(app: web.Application) -> tuple[Route, ...]:
    """The routes an application built here serves."""
    return app[MOUNTED]


def router_method_rules(app: web.Application) -> MethodRules:
    """The method policy of an application built here (for its OpenAPI document)."""
    return app[routes.CONFIG].method_rules


def create_app(
    backend: Backend, options: RouterOptions | None = None, *, token: str | None = None
) -> web.Application:
    """The whole bridge: ``options.routes`` served from ``backend``.

    Everything is the application's, through aiohttp's public hooks, so a host that
    serves it in a runner of its own (with :data:`SERVER_SETTINGS`) gets it all: the
    error payload for every failure, bounded request heads (:mod:`bridge.server`),
    the bearer ``token`` when one is given (:func:`bridge.auth.with_bearer_auth`), and
    the backend started and closed with the application (``cleanup_ctx``).
    """
    options = options or RouterOptions()
    limits = options.limits
    app = web.Application(
        client_max_size=limits.max_body_bytes,
        middlewares=[head_middleware(limits.max_header_bytes, limits.max_body_bytes)],
    )
    app[routes.BACKEND] = backend
    method_rules = MethodRules(
        options.refused_methods, options.method_policy, options.refused_params
    )
    app[routes.CONFIG] = routes.RouterConfig(
        limits=limits,
        allowed_client_options=options.allowed_client_options,
        method_rules=method_rules,
    )
    mounted = tuple(r for r in ROUTES if r.name in options.routes)
    app[MOUNTED] = mounted
    openapi: Callable[[], bytes] = functools.cache(
        lambda: orjson.dumps(build_openapi(mounted, auth=app.get(AUTH), method_rules=method_rules))
    )
    app[routes.OPENAPI] = openapi
    # aiohttp tries the routes under a common prefix in the order they were added, and
    # no two routes match the same path: the busiest goes first (the order of
    # ROUTES, and of the OpenAPI document, stays).
    expect = observed_expect(errors.expect_handler(expect_refusal(limits.max_header_bytes)))
    for route in sorted(mounted, key=lambda r: r.name not in HOT_ROUTES):
        handler = route.handler
        app.router.add_route(
            route.method, route.path, handler, name=route.name, expect_handler=expect
        )
        if route.answers_head:
            app.router.add_route(
                "HEAD", route.path, handler, name=f"{route.name}_head", expect_handler=expect
            )
    add_no_route(app, expect)

    closed = False

    async def close_backend(app: web.Application) -> None:
        nonlocal closed
        if not closed:
            closed = True
            await backend.close()
            if backend.peers is not None:
                await backend.peers.close()

    async def backend_lifecycle(app: web.Application) -> AsyncIterator[None]:
        await backend.start()
        yield
        await close_backend(app)

    app.cleanup_ctx.append(backend_lifecycle)
    # At shutdown, before aiohttp waits for the handlers still running: closing the
    # backend ends their streams, long-polls and calls, so they need not time out.
    app.on_shutdown.append(close_backend)
    # aiohttp's log of the requests its parser refuses: no bytes, no traceback.
    app.on_startup.append(quiet_parser_refusals)
    app.on_cleanup.append(count_held_refusals)
    if token is not None:
        with_bearer_auth(app, token)
    return app


async def quiet_parser_refusals(app: web.Application) -> None:
    ParserRefusals.install()


async def count_held_refusals(app: web.Application) -> None:
    # The count of every line held back (refusals, start failures: bridge.logs.Throttle).
    logs.flush_held()


#: The path of the last route of every application built here: any method, any path.
NO_ROUTE_PATH = "/{path:(?s:.*)}"


def expect_refusal(max_header_bytes: int) -> Callable[[web.Request], errors.RestError | None]:
    """What refuses a request with an ``Expect`` header before any ``100 Continue``: the
    token (the 401), then the head's bound, as the middlewares would after it."""

    def refusal(request: web.Request) -> errors.RestError | None:
        if not admitted(request):
            return errors.unauthorized()
        return head_problem(request, max_header_bytes)

    return refusal


def add_no_route(app: web.Application, expect: errors.ExpectHandler) -> None:
    """Answer a request no route takes with the error payload: 404, or 405 with ``Allow``.

    Added last, with the shortest prefix, this route is tried after every other and asks
    them which methods they take on the path, as aiohttp's router does. A route a host
    adds afterwards whose path begins with a parameter (``/{name}``) is never reached:
    add it before, or mount the bridge as a sub-application.
    """
    own: list[web.AbstractResource] = []

    async def no_route(request: web.Request) -> web.StreamResponse:
        allowed: set[str] = set()
        for resource in request.app.router.resources():
            if resource not in own:
                allowed |= (await resource.resolve(request))[1]
        if allowed:
            raise errors.method_not_allowed(request.method, allowed)
        raise errors.of_kind("not_found")

    route = app.router.add_route("*", NO_ROUTE_PATH, no_route, expect_handler=expect)
    own.append(route.resource)  # type: ignore[arg-type]


#: The rules of the ``default`` preset: it refuses the methods that reach the host.
DEFAULT_REFUSED_METHODS = frozenset(HOST_METHODS)
#: ... and the params of thread methods that reach it all the same.
DEFAULT_REFUSED_PARAMS = {method: frozenset(params) for method, params in HOST_PARAMS.items()}

#: What each preset mounts and refuses; its limits and the host's method rules are
#: given to its factory.
PRESET_OPTIONS = {
    "trusted": RouterOptions(),
    "default": RouterOptions(
        routes=DEFAULT_ROUTES,
        allowed_client_options=DEFAULT_CLIENT_OPTIONS,
        refused_methods=DEFAULT_REFUSED_METHODS,
        refused_params=DEFAULT_REFUSED_PARAMS,
    ),
    "text-turn": RouterOptions(routes=TEXT_TURN_ROUTES),
}


def _build_preset(
    preset: str,
    app_server_command: str | Sequence[str],
    limits: RestLimits | None,
    app_server: AppServerSettings | None,
    method_policy: MethodPolicy | None,
) -> web.Application:
    """The preset's application over the bundled backend, in the mode ``app_server`` says;
    what is not given comes from the environment (``REST_ADAPTER_APP_SERVER_MODE``,
    ``REST_ADAPTER_ALLOW_METHODS``, ``REST_ADAPTER_REFUSE_METHODS``)."""
    limits = limits or RestLimits()
    settings = app_server or AppServerVariables.from_env().app_server()
    if settings.shared:
        shared = ConnectShared(app_server_command, limits, settings)
        backend = ProcessBackend(limits=limits, launcher=shared)
    else:
        backend = ProcessBackend(app_server_command, limits)
    if method_policy is None:
        method_policy = MethodPolicyVariables.from_env().method_policy()
    options = replace(PRESET_OPTIONS[preset], limits=limits, method_policy=method_policy)
    return create_app(backend, options)


def trusted_bridge_app(
    app_server_command: str | Sequence[str] = DEFAULT_COMMAND,
    limits: RestLimits | None = None,
    app_server: AppServerSettings | None = None,
    method_policy: MethodPolicy | None = None,
) -> web.Application:
    """Every route of spec section 4, every ClientOptions field, every method unless the
    host's ``method_policy`` refuses it, real processes."""
    return _build_preset("trusted", app_server_command, limits, app_server, method_policy)


def text_turn_app(
    app_server_command: str | Sequence[str] = DEFAULT_COMMAND,
    limits: RestLimits | None = None,
    app_server: AppServerSettings | None = None,
    method_policy: MethodPolicy | None = None,
) -> web.Application:
    """Health, compatibility and the one-shot text turn only (refused if the host's
    ``method_policy`` refuses ``thread/start`` or ``turn/start``)."""
    return _build_preset("text-turn", app_server_command, limits, app_server, method_policy)


def default_app(
    app_server_command: str | Sequence[str] = DEFAULT_COMMAND,
    limits: RestLimits | None = None,
    app_server: AppServerSettings | None = None,
    method_policy: MethodPolicy | None = None,
) -> web.Application:
    """The conservative router: no sessionless calls, no process-shaping options, none of
    the methods that reach the host (:data:`bridge.policy.HOST_METHODS`) unless the
    host's ``method_policy`` allows them."""
    return _build_preset("default", app_server_command, limits, app_server, method_policy)


def backend_app(backend: Backend, options: RouterOptions | None = None) -> web.Application:
    """The routes of ``options`` (all by default) served by a host-provided backend, its
    methods refused as ``options`` says (none by default; the environment is not read)."""
    return create_app(backend, options)


class Preset(Protocol):
    """A preset's factory: :func:`trusted_bridge_app`, :func:`default_app`,
    :func:`text_turn_app`."""

    def __call__(
        self,
        app_server_command: str | Sequence[str] = ...,
        limits: RestLimits | None = ...,
        app_server: AppServerSettings | None = ...,
        method_policy: MethodPolicy | None = ...,
    ) -> web.Application: ...


#: The presets by name (`rest-bridge serve --preset`, a scenario's `bridge.preset`).
PRESETS: dict[str, Preset] = {
    "trusted": trusted_bridge_app,
    "default": default_app,
    "text-turn": text_turn_app,
}
#: The routes each preset mounts (their names, the OpenAPI operationIds).
PRESET_ROUTES = {name: options.routes for name, options in PRESET_OPTIONS.items()}
