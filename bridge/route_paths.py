"""The paths of the route table, for clients and harnesses that build or match requests.

Not part of serving: the application mounts :data:`bridge.app.ROUTES` itself. The
harness (scenarios/) builds its requests and matches the OpenAPI document's paths with
these, so that it never restates the route table.
"""

from __future__ import annotations

import re

from bridge.app import ROUTE_BY_NAME

#: Path parameters whose values may hold a `/` (`thread/start`, a request key `a/b`):
#: in the route table they are `{name:(?s:.+)}` (any character, a decoded line feed too).
SLASHED_PARAMS = frozenset({"method", "requestKey"})

_PARAM = re.compile(r"\{(\w+)(?::[^}]*)?\}")


def path_pattern(template: str) -> re.Pattern[str]:
    """A pattern for the paths of a route template, one named group per parameter.

    ``template`` is a route's aiohttp path (``/v1/call/{method:(?s:.+)}``) or its OpenAPI
    path (``/v1/call/{method}``); the parameters in :data:`SLASHED_PARAMS` may hold a
    ``/``, the others may not.
    """
    regex, end = "", 0
    for found in _PARAM.finditer(template):
        name = found.group(1)
        regex += re.escape(template[end : found.start()])
        regex += f"(?P<{name}>{'(?s:.+)' if name in SLASHED_PARAMS else '[^/]+'})"
        end = found.end()
    return re.compile(f"^{regex}{re.escape(template[end:])}\\Z")


def route_path(name: str, **params: str) -> str:
    """The path of route ``name`` with its parameters filled in, as given (not quoted)."""

    def fill(found: re.Match[str]) -> str:
        return params[found.group(1)]

    return _PARAM.sub(fill, ROUTE_BY_NAME[name].path)
