"""Matching received JSON: exact and subset, matchers, JSONPath, and readable diffs."""

from __future__ import annotations

import pytest

from scenarios.matching import diff, match, match_jsonpath

pytestmark = pytest.mark.quick


def messages(expected, actual, *, subset=False):
    return [str(m) for m in match(expected, actual, subset=subset)]


def test_exact_matching_reports_missing_and_unexpected_keys() -> None:
    assert messages({"a": 1}, {"a": 1}) == []
    assert messages({"a": 1, "b": 2}, {"a": 1, "c": 3}) == [
        "at $.b: expected 2, found nothing",
        "at $.c: unexpected key (3)",
    ]


def test_subset_matching_ignores_extra_keys_but_not_list_lengths() -> None:
    assert messages({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}, "d": 3}, subset=True) == []
    assert messages({"x": [1]}, {"x": [1, 2]}, subset=True) == [
        "at $.x: expected 1 elements, received 2"
    ]


@pytest.mark.parametrize(
    ("expected", "actual"),
    [(True, 1), (1, True), (0, False), ("1", 1), (None, False), ([], {})],
)
def test_json_types_are_not_confused(expected, actual) -> None:
    assert messages(expected, actual)


def test_integers_equal_floats_as_in_json() -> None:
    assert messages(1, 1.0) == []


@pytest.mark.parametrize(
    ("matcher", "good", "bad"),
    [
        ({"$regex": "^thr_"}, "thr_1", "x_thr_1"),
        ({"$type": "string"}, "x", 1),
        ({"$type": ["integer", "null"]}, None, "1"),
        ({"$type": "integer"}, 3, True),
        ({"$len": 2}, [1, 2], [1]),
        ({"$len": {"$gte": 2}}, "abc", "a"),
        ({"$contains": {"k": 1}}, [{"k": 1, "z": 0}], [{"k": 2}]),
        ({"$contains": "lo w"}, "hello world", "hello"),
        ({"$eq": {"$regex": "x"}}, {"$regex": "x"}, "x"),
        ({"$gt": 1, "$lt": 3}, 2, 3),
        ({"$oneOf": ["a", "b"]}, "b", "c"),
        ({"$any": True}, None, ...),
    ],
)
def test_matchers(matcher, good, bad) -> None:
    assert messages({"v": matcher}, {"v": good}) == []
    if bad is ...:
        assert messages({"v": matcher}, {}) != []
    else:
        assert messages({"v": matcher}, {"v": bad}) != []


def test_absent_holds_only_for_a_missing_key() -> None:
    assert messages({"a": {"$absent": True}}, {"b": 1}, subset=True) == []
    assert messages({"a": {"$absent": True}}, {"a": None}, subset=True) == [
        "at $.a: expected nothing here, received null"
    ]


def test_subset_inside_an_exact_match() -> None:
    expected = {"a": 1, "b": {"$subset": {"c": 1}}}
    assert messages(expected, {"a": 1, "b": {"c": 1, "d": 2}}) == []
    assert messages(expected, {"a": 1, "b": {"c": 1}, "e": 0}) == ["at $.e: unexpected key (0)"]


def test_jsonpath_one_value_many_values_or_none() -> None:
    document = {"items": [{"id": 1, "ok": True}, {"id": 2, "ok": False}]}
    assert match_jsonpath("$.items[0].id", 1, document) == []
    assert match_jsonpath("$.items[*].id", [1, 2], document) == []
    assert match_jsonpath("$.items[?(@.ok == false)].id", 2, document) == []
    assert match_jsonpath("$.items[-1].id", 2, document) == []
    assert match_jsonpath("$.nothing", {"$absent": True}, document) == []
    [mismatch] = match_jsonpath("$.nothing", 1, document)
    assert str(mismatch) == "at $.nothing: expected 1, found nothing"


def test_the_diff_shows_only_what_the_expectation_mentions() -> None:
    expected = {"error": "app_server_error", "code": -32051, "id": {"$regex": "^s"}}
    actual = {"error": "app_server_error", "code": -32050, "id": "s-1", "noise": [1, 2, 3]}
    text = diff(expected, actual, subset=True)
    assert text.splitlines()[:2] == ["--- expected", "+++ received"]
    assert '-  "code": -32051,' in text
    assert '+  "code": -32050,' in text
    assert "noise" not in text
    # A value that satisfies its matcher is shown as the matcher: no noise in the diff.
    assert "s-1" not in text
