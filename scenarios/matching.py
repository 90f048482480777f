"""Matching received JSON against expected JSON, with readable mismatches and diffs.

Expected values are plain JSON, compared exactly (`json:`) or as a subset (`jsonSubset:`,
event matchers), and may contain matcher mappings whose keys all start with `$`
(`{$regex: "^thr_"}`, `{$type: string}`, ...): scenarios/README.md has the table.
Several operators in one mapping must all hold.
"""

from __future__ import annotations

import difflib
import functools
import json
import operator
import re
from dataclasses import dataclass
from typing import Any

MISSING = object()
#: Each JSON type and its Python type (bool before int: True is not a number in JSON).
_JSON_TYPES = (
    (bool, "boolean"),
    (type(None), "null"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)
_TYPES = [name for _, name in _JSON_TYPES]

#: The operators a matcher mapping may use.
OPERATORS = frozenset(
    {"$regex", "$type", "$any", "$absent", "$len", "$contains", "$eq", "$subset"}
    | {"$gt", "$gte", "$lt", "$lte", "$oneOf"}
)


def check_matchers(value: Any, where: str = "") -> Any:
    """`value`, once no mapping in it uses an unknown `$operator`, mixes operators with
    plain keys, names an unknown `$type` or an invalid `$regex` (ValueError)."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            check_matchers(item, f"{where}[{index}]")
    if not isinstance(value, dict):
        return value
    ops = [key for key in value if isinstance(key, str) and key.startswith("$")]
    at = f" at {where}" if where else ""
    if ops and len(ops) != len(value):
        raise ValueError(
            f"a mapping{at} mixes matcher operators ({', '.join(ops)}) with plain keys; "
            "write a literal `$` key as {$eq: {...}}"
        )
    for op in ops:
        if op not in OPERATORS:
            raise ValueError(
                f"unknown matcher operator {op}{at}; known: {', '.join(sorted(OPERATORS))}"
            )
    if "$type" in value:
        types = value["$type"] if isinstance(value["$type"], list) else [value["$type"]]
        unknown = [t for t in types if t not in _TYPES]
        if unknown:
            raise ValueError(f"$type{at}: unknown type {unknown[0]!r}; use {sorted(_TYPES)}")
    if "$regex" in value:
        try:
            re.compile(str(value["$regex"]))
        except re.error as exc:
            raise ValueError(f"$regex{at}: invalid regular expression: {exc}") from None
    if "$eq" not in value:
        for key, item in value.items():
            check_matchers(item, f"{where}.{key}" if where else str(key))
    return value


@dataclass(frozen=True)
class Mismatch:
    """One difference: where (a JSONPath-like path) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"at {self.path}: {self.message}"


def is_matcher(value: Any) -> bool:
    """Whether `value` is a matcher mapping (every key starts with `$`)."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(key, str) and key.startswith("$") for key in value)
    )


def render(value: Any, limit: int = 200) -> str:
    """Compact JSON for messages, cut at `limit` characters."""
    if value is MISSING:
        return "(nothing)"
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def json_type(value: Any) -> str:
    """The JSON type of `value` (`integer` for ints; a Python type's name if not JSON)."""
    return next(
        (name for kind, name in _JSON_TYPES if isinstance(value, kind)), type(value).__name__
    )


def _has_type(value: Any, name: str) -> bool:
    found = json_type(value)
    return found == name or (name == "number" and found == "integer")


def _equal(expected: Any, actual: Any) -> bool:
    # JSON semantics: true is not 1, and 1 equals 1.0.
    if isinstance(expected, bool) or isinstance(actual, bool):
        return isinstance(expected, bool) and isinstance(actual, bool) and expected == actual
    if isinstance(expected, int | float) and isinstance(actual, int | float):
        return expected == actual
    if type(expected) is not type(actual):
        return False
    if isinstance(expected, dict):
        return expected.keys() == actual.keys() and all(
            _equal(expected[k], actual[k]) for k in expected
        )
    if isinstance(expected, list):
        return len(expected) == len(actual) and all(map(_equal, expected, actual))
    return bool(expected == actual)


def match(expected: Any, actual: Any, *, subset: bool, path: str = "$") -> list[Mismatch]:
    """Every way `actual` fails to match `expected` (empty when it matches).

    `subset`: mappings may have keys that `expected` does not mention. Lists always
    have to match element by element (use `$contains` for membership).
    """
    if is_matcher(expected):
        return _match_ops(expected, actual, subset=subset, path=path)
    if actual is MISSING:
        return [Mismatch(path, f"expected {render(expected)}, found nothing")]
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [Mismatch(path, f"expected an object, received {render(actual)}")]
        found: list[Mismatch] = []
        for key, item in expected.items():
            found += match(item, actual.get(key, MISSING), subset=subset, path=_child(path, key))
        if not subset:
            for key in actual:
                if key not in expected:
                    found.append(
                        Mismatch(_child(path, key), f"unexpected key ({render(actual[key])})")
                    )
        return found
    if isinstance(expected, list):
        if not isinstance(actual, list):
            return [Mismatch(path, f"expected an array, received {render(actual)}")]
        found = []
        for index, item in enumerate(expected[: len(actual)]):
            found += match(item, actual[index], subset=subset, path=f"{path}[{index}]")
        if len(expected) != len(actual):
            found.append(
                Mismatch(path, f"expected {len(expected)} elements, received {len(actual)}")
            )
        return found
    if not _equal(expected, actual):
        return [Mismatch(path, f"expected {render(expected)}, received {render(actual)}")]
    return []


def _child(path: str, key: Any) -> str:
    key = str(key)
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f"{path}[{key!r}]"


def _match_ops(ops: dict[str, Any], actual: Any, *, subset: bool, path: str) -> list[Mismatch]:
    if "$absent" in ops:
        if bool(ops["$absent"]) == (actual is MISSING):
            return []
        return [Mismatch(path, f"expected nothing here, received {render(actual)}")]
    if actual is MISSING:
        return [Mismatch(path, f"expected a value matching {render(ops)}, found nothing")]
    found = (_op(op, arg, actual, subset=subset, path=path) for op, arg in ops.items())
    return [problem for problem in found if problem is not None]


def _op(op: str, arg: Any, actual: Any, *, subset: bool, path: str) -> Mismatch | None:
    received = render(actual)
    if op == "$any":
        return None
    if op == "$eq":
        ok = _equal(arg, actual)
        return (
            None if ok else Mismatch(path, f"expected exactly {render(arg)}, received {received}")
        )
    if op == "$subset":
        problems = match(arg, actual, subset=True, path=path)
        return problems[0] if problems else None
    if op == "$regex":
        if isinstance(actual, str) and re.search(str(arg), actual):
            return None
        return Mismatch(path, f"expected a string matching /{arg}/, received {received}")
    if op == "$type":
        types = arg if isinstance(arg, list) else [arg]
        if any(_has_type(actual, name) for name in types):
            return None
        wanted = " or ".join(types)
        return Mismatch(path, f"expected type {wanted}, received {json_type(actual)} {received}")
    if op == "$len":
        if not isinstance(actual, str | list | dict):
            return Mismatch(path, f"expected something with a length, received {received}")
        problems = match(arg, len(actual), subset=subset, path=f"{path}.length")
        if problems:
            return Mismatch(path, f"expected length {render(arg)}, received {len(actual)}")
        return None
    if op == "$contains":
        if isinstance(actual, str) and isinstance(arg, str):
            ok = arg in actual
        elif isinstance(actual, list):
            ok = any(not match(arg, item, subset=True) for item in actual)
        else:
            ok = False
        return None if ok else Mismatch(path, f"expected it to contain {render(arg)}: {received}")
    if op in _COMPARE:
        if not isinstance(actual, int | float) or isinstance(actual, bool):
            return Mismatch(path, f"expected a number, received {received}")
        holds, symbol = _COMPARE[op]
        return (
            None
            if holds(actual, arg)
            else Mismatch(path, f"expected {symbol} {arg}, received {received}")
        )
    if op == "$oneOf":
        options = arg if isinstance(arg, list) else [arg]
        if any(not match(option, actual, subset=subset) for option in options):
            return None
        return Mismatch(path, f"expected one of {render(options)}, received {received}")
    return Mismatch(path, f"unknown matcher {op}")


_COMPARE = {
    "$gt": (operator.gt, ">"),
    "$gte": (operator.ge, ">="),
    "$lt": (operator.lt, "<"),
    "$lte": (operator.le, "<="),
}


def view(expected: Any, actual: Any, *, subset: bool) -> Any:
    """`actual` shaped like `expected`, for a diff that shows only what matters.

    Keys `expected` does not mention are left out (in subset mode), and values that
    satisfy a matcher are shown as the matcher, so they diff as equal.
    """
    if is_matcher(expected):
        if actual is MISSING and "$absent" in expected:
            return expected
        return expected if not _match_ops(expected, actual, subset=subset, path="$") else actual
    if isinstance(expected, dict) and isinstance(actual, dict):
        shaped: dict[str, Any] = {}
        for key, item in expected.items():
            if key in actual:
                shaped[key] = view(item, actual[key], subset=subset)
            elif is_matcher(item) and "$absent" in item:
                shaped[key] = item
        if not subset:
            for key, item in actual.items():
                if key not in expected:
                    shaped[key] = item
        return shaped
    if isinstance(expected, list) and isinstance(actual, list):
        shaped_list = [view(e, a, subset=subset) for e, a in zip(expected, actual, strict=False)]
        return shaped_list + actual[len(expected) :]
    return actual


def diff(expected: Any, actual: Any, *, subset: bool) -> str:
    """A unified diff of `expected` and the received value shaped like it."""
    left = json.dumps(expected, indent=2, ensure_ascii=False, default=str).splitlines()
    shaped = view(expected, actual, subset=subset)
    right = json.dumps(shaped, indent=2, ensure_ascii=False, default=str).splitlines()
    lines = difflib.unified_diff(left, right, "expected", "received", lineterm="", n=3)
    return "\n".join(lines)


@functools.lru_cache(maxsize=512)
def compile_jsonpath(expression: str) -> Any:
    """A parsed JSONPath (jsonpath-ng's extended syntax: filters, negative indexes)."""
    from jsonpath_ng.ext.parser import parse

    return parse(expression)


def find_jsonpath(expression: str, document: Any) -> list[Any]:
    """The values `expression` selects in `document`."""
    return [found.value for found in compile_jsonpath(expression).find(document)]


def match_jsonpath(expression: str, expected: Any, document: Any) -> list[Mismatch]:
    """Match what `expression` selects: one value as itself, several as a list.

    The comparison is exact (with matchers); `{$absent: true}` holds when nothing is
    selected.
    """
    values = find_jsonpath(expression, document)
    actual = MISSING if not values else values[0] if len(values) == 1 else values
    return match(expected, actual, subset=False, path=expression)
