"""JSON in and out (bridge.wire): big integers stay exact, and numbers JSON cannot carry
are refused on both reading paths (orjson alone, and the standard library's for texts
with long runs of digits)."""

import pytest

from bridge.wire import JSONDecodeError, dumps, loads

pytestmark = pytest.mark.quick

BIG = 123456789012345678901234567890


def test_a_big_integer_is_read_and_written_exactly():
    text = b'{"n":%d,"x":1.5}' % BIG
    assert loads(text) == {"n": BIG, "x": 1.5}
    assert dumps(loads(text)) == text


@pytest.mark.parametrize("number", [b"1e400", b"-1e400", b"NaN", b"Infinity", b"-Infinity"])
@pytest.mark.parametrize("with_big_integer", [False, True], ids=["orjson", "long digits"])
def test_a_number_json_cannot_carry_is_refused(number, with_big_integer):
    text = b"[%s]" % number if not with_big_integer else b"[%d, %s]" % (BIG, number)
    with pytest.raises(JSONDecodeError):
        loads(text)


def test_a_double_at_the_edge_of_its_range_is_read_alike_on_both_paths():
    edge = b"1.7976931348623157e308"
    assert loads(b"[%s]" % edge) == loads(b"[%d, %s]" % (BIG, edge))[1:]


@pytest.mark.parametrize(
    "number",
    [18446744073709551616, -9223372036854775809, 10**19, BIG],
    ids=["2**64", "below -2**63", "10**19", "30 digits"],
)
@pytest.mark.parametrize("where", ["alone", "first", "last"])
def test_an_integer_beyond_64_bits_is_exact_wherever_it_stands(number, where):
    text = {
        "alone": b"%d" % number,
        "first": b'[%d,"x",1.5]' % number,
        "last": b'{"a":"b12345678","n":%d}' % number,
    }[where]
    found = loads(text)
    value = found if where == "alone" else found[0] if where == "first" else found["n"]
    assert value == number
    assert isinstance(value, int)


def test_digits_in_strings_and_short_runs_read_as_orjson_reads_them():
    text = b'{"id":"123456789012345678","n":123456789012345678,"x":0.5}'
    assert loads(text) == {"id": "123456789012345678", "n": 123456789012345678, "x": 0.5}
