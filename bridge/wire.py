"""JSON encoding of what the bridge sends: orjson, and the standard library as a fallback.

orjson refuses values nested deeper than 254 levels, but decodes up to 1024, so an
app-server message can be read and then not written back. Such values go through
the standard library instead, which manages nearly as deep as orjson reads.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    """``value`` as compact JSON bytes."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
