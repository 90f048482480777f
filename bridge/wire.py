"""JSON in and out of the bridge: orjson, and the standard library where orjson falls short.

orjson reads integers beyond 64 bits as floats and refuses to write them, and writes no
value nested deeper than 254 levels though it reads up to 1024. So :func:`loads` reads a
text that holds a long run of digits with the standard library (every integer exact),
and :func:`dumps` writes what orjson refuses with it, the recursion limit raised for the
call: numbers and depth pass through unchanged. Numbers JSON cannot carry (``NaN``,
``Infinity``, ``1e400``) are refused on the way in: orjson reads every text first.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import orjson

#: Enough for a value of orjson's maximum read depth (1024), with room for the caller.
_DEEP_RECURSION_LIMIT = 4096
#: The longest 64-bit integer has 20 digits; a run of 19 may already be out of range.
#: Found as a substring of the text with every digit read as ``0`` (``bytes.translate``
#: and a search, both in C): a regular expression tries a match at every byte, which cost
#: more than orjson's whole parse on a short message, and 70 times as much on 100 KiB.
_LONG_DIGITS = b"0" * 19
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")

JSONDecodeError = orjson.JSONDecodeError


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


def dumps_line(value: Any) -> bytes:
    """``value`` as one line of JSON (a JSON-RPC message for the app-server's stdin)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError:
        return dumps(value) + b"\n"


def loads(data: bytes) -> Any:
    """Parse one JSON text; integers of any size stay exact. Raises
    :class:`JSONDecodeError` (a ``ValueError``) for anything that is not JSON."""
    if _LONG_DIGITS not in data.translate(_DIGITS_AS_ZERO):
        return orjson.loads(data)
    # Checked by orjson first: it refuses what JSON refuses, and knows the depth limit.
    orjson.loads(data)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, _DEEP_RECURSION_LIMIT))
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise JSONDecodeError(str(exc), "", 0) from None
    finally:
        sys.setrecursionlimit(limit)
