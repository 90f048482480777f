"""Optional bearer-token authentication, a layer around any router (spec section 5).

Every rejection is the same response, whatever was wrong with the header, and a
rejected request never reaches a handler. The comparison hashes both sides to
SHA-256 digests first, so it takes the same time whether the tokens differ early,
late, or in length.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler

from bridge import errors

HEALTH_PATHS = frozenset({"/health", "/v1/health"})
#: A load balancer checks health with GET or HEAD (GET's status and headers, no body).
HEALTH_METHODS = frozenset({"GET", "HEAD"})


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """What the OpenAPI document needs to know of the auth layer (never the token)."""

    exempt_health: bool


AUTH = web.AppKey("bridge.auth", AuthSettings)


def token_problem(token: object) -> str | None:
    """Why ``token`` can never be presented in an ``Authorization`` header (a presented
    token is trimmed, a header carries no control characters), or None."""
    if not isinstance(token, str) or not token.strip():
        return "is empty or blank"
    if token != token.strip():
        return "has leading or trailing whitespace"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in token):
        return "holds control characters"
    return None


class BearerToken:
    """The one shared secret. Its repr never shows it."""

    __slots__ = ("_digest",)

    def __init__(self, token: str) -> None:
        problem = token_problem(token)
        if problem is not None:
            raise ValueError(f"the bearer token {problem}")
        self._digest = hashlib.sha256(token.encode()).digest()

    def matches(self, presented: str) -> bool:
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(digest, self._digest)

    def __repr__(self) -> str:
        return "BearerToken(<redacted>)"


def presented_token(header: str | None) -> str:
    """The token of an ``Authorization`` value, or "" when it is not a Bearer value."""
    if not header:
        return ""
    scheme, space, rest = header.partition(" ")
    if not space or scheme.lower() != "bearer":
        return ""
    return rest.strip()


#: The application's admission check, set by :func:`with_bearer_auth`: its middleware
#: asks it, and so does the ``Expect`` handler of :mod:`bridge.app`'s routes, which
#: aiohttp runs before any middleware.
CHECK = web.AppKey[Callable[[web.Request], bool]]("bridge.auth.check")


def admitted(request: web.Request) -> bool:
    """Whether the application serving ``request`` admits it (True without auth)."""
    check = request.app.get(CHECK)
    return check is None or check(request)


def with_bearer_auth(
    app: web.Application, token: str, *, exempt_health: bool = True
) -> web.Application:
    """Require ``Authorization: Bearer <token>`` on every route of ``app``; returns ``app``.

    Raises ``ValueError`` at once for an empty or blank token. Apply it before the
    application starts. The check is one middleware, outermost (a request that lacks the
    token meets nothing else of the application), and the application's :data:`CHECK`.
    """
    secret = BearerToken(token)

    def admits(request: web.Request) -> bool:
        if exempt_health and request.method in HEALTH_METHODS and request.path in HEALTH_PATHS:
            return True
        presented = request.headers.getall("Authorization", [])
        # Two headers are two answers: which one counts would be the proxy's guess.
        return len(presented) == 1 and secret.matches(presented_token(presented[0]))

    @web.middleware
    async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if admits(request):
            return await handler(request)
        if not request.path.startswith("/"):
            # CONNECT host:port, OPTIONS *: what follows the head may be a tunnel's bytes.
            return await errors.answer_and_close(request, errors.unauthorized())
        return errors.unauthorized().to_response()

    app[CHECK] = admits
    app.middlewares.insert(0, bearer_auth)
    app[AUTH] = AuthSettings(exempt_health=exempt_health)
    return app
