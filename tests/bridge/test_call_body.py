"""The session call's body read without pydantic (`routes.call_body`) gives exactly what
`validate_body(CallBody, ...)` gives: the same values, or the same 400."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge import errors
from bridge.models import CallBody
from bridge.routes import call_body, validate_body

pytestmark = pytest.mark.quick


def through_pydantic(raw: bytes) -> Any:
    try:
        body = validate_body(CallBody, raw)
    except errors.RestError as exc:
        return ("error", exc.status, exc.payload())
    return ("ok", body.params, body.timeout_ms)


def through_fast_path(raw: bytes) -> Any:
    try:
        params, timeout_ms = call_body(raw)
    except errors.RestError as exc:
        return ("error", exc.status, exc.payload())
    return ("ok", params, timeout_ms)


def same(raw: bytes) -> None:
    expected, got = through_pydantic(raw), through_fast_path(raw)
    # repr: tells 1 from 1.0 and True from 1, which == does not.
    assert repr(got) == repr(expected), raw


EDGES = [
    b"",
    b"  \n",
    b"{}",
    b'{"params":{}}',
    b'{"params":null,"timeoutMs":null}',
    b'{"timeoutMs":5}',
    b'{"timeoutMs":0}',
    b'{"timeoutMs":-1}',
    b'{"timeoutMs":1000.0}',
    b'{"timeoutMs":1000.5}',
    b'{"timeoutMs":"5"}',
    b'{"timeoutMs":true}',
    b'{"timeoutMs":9223372036854775807}',
    b'{"timeoutMs":9223372036854775808}',
    b'{"timeout_ms":5}',
    b'{"params":1,"extra":2}',
    b'{"params":1,"params":2}',
    b'{"params":123456789012345678901234567890}',
    b'{"params":-123456789012345678901234567890.5}',
    b'{"params":1e400}',
    b'{"params":NaN}',
    b'{"params":Infinity}',
    b'{"params":"\\ud800"}',
    b'{"params":"\xff"}',
    b'{"params":"a\x01b"}',
    b'{"params":[1,2,}',
    b"[]",
    b"null",
    b"1",
    b'"x"',
    b'\xef\xbb\xbf{"params":1}',
    b'{"params":{"a":[1.5,-0.0,1E2,true,false,null,"\\u00e9"]}}',
]


@pytest.mark.parametrize("raw", EDGES)
def test_edges(raw):
    same(raw)


@pytest.mark.parametrize("depth", [150, 198, 199, 200, 201, 253, 254, 300, 1023, 1024, 1100])
def test_nesting_depth(depth):
    same(b'{"params":' + b"[" * depth + b"]" * depth + b"}")
    same(b'{"params":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}")


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)
bodies = st.dictionaries(
    st.sampled_from(["params", "timeoutMs", "timeout_ms", "other"]),
    json_values | st.integers(min_value=-5, max_value=2**64),
    max_size=3,
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(bodies)
def test_any_body(body):
    same(json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass"))
