"""JSON encoding of what the bridge sends: orjson, and the standard library as a fallback.

orjson refuses values nested deeper than 254 levels, but decodes up to 1024, so an
app-server message can be read and then not written back. Such values go through
the standard library instead, with the interpreter's recursion limit raised for the
call so that anything orjson could read (a few more than 1,000 levels: more than the
default limit allows) can be written.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import orjson

#: Enough for a value of orjson's maximum read depth (1024), with room for the caller.
_DEEP_RECURSION_LIMIT = 4096


def dumps(value: Any) -> bytes:
    """``value`` as compact JSON bytes."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        pass
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, _DEEP_RECURSION_LIMIT))
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    finally:
        sys.setrecursionlimit(limit)
