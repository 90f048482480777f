"""A request body's JSON (bridge.routes.validate_body): numbers JSON cannot carry are
refused as invalid JSON wherever they stand, and look-alikes inside strings are text."""

import pytest

from bridge import errors
from bridge.routes import CallBody, validate_body

pytestmark = pytest.mark.quick

NOT_JSON = "The request body is not valid JSON."


@pytest.mark.parametrize(
    "number",
    [
        b"NaN",
        b"Infinity",
        b"-Infinity",
        b"1e400",
        b"1E400",
        b"-2.5e999",
        b"9" * 310,
        b"9" * 320 + b".5",
        b"[%s,%s]" % (b"9" * 299, b"9" * 310),
    ],
    ids=[
        "NaN",
        "Infinity",
        "-Infinity",
        "1e400",
        "1E400",
        "-2.5e999",
        "310 digits",
        "320 digits.5",
        "310 digits after 299",
    ],
)
@pytest.mark.parametrize("where", ["alone", "after text", "nested"])
def test_a_number_json_cannot_carry_is_invalid_json(number, where):
    params = {
        "alone": b"%s",
        "after text": b'{"text":"abc NI 12 e","x":%s}',
        "nested": b'{"a":[1,{"b":[%s]}]}',
    }[where] % number
    with pytest.raises(errors.RestError) as refused:
        validate_body(CallBody, b'{"params":%s}' % params)
    assert refused.value.status == 400
    assert refused.value.message == NOT_JSON


@pytest.mark.parametrize(
    "params",
    [
        b'{"x":1e5}',
        b'{"x":2E-3}',
        b'{"x":"NaN Infinity 1e400"}',
        b'{"x":%s}' % (b"9" * 299),
        b'{"x":[%s,%s]}' % (b"9" * 299, b"9" * 299),
    ],
    ids=["exponent", "capital exponent", "words in a string", "299 digits", "two 299-digit runs"],
)
def test_numbers_json_carries_and_text_pass(params):
    assert validate_body(CallBody, b'{"params":%s}' % params).params is not None
