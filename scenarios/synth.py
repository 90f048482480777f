"""Making up JSON that satisfies an expectation: the inverse of `scenarios.matching`.

The respx mocks (`scenarios.respx_mock`) answer host code with the responses a
scenario's steps describe. Where a step gives an exact value that value is used; where
it gives a subset, a matcher (`{$type: string}`, `{$regex: ...}`) or a JSONPath, the
missing parts come from a *base* (the value the bridge would plausibly send) or are
made up to fit the bridge's OpenAPI schema. Everything made up here is checked again
with `scenarios.matching` by the caller; what cannot be made up raises
:class:`SynthesisError` naming the expectation.

- :func:`conform` — a value matching `expected` (exactly or as a subset), keeping
  whatever of `base` already matches;
- :func:`write_jsonpath` — make `expression` select a value matching `expected`;
- :func:`fill` — a value valid against a JSON Schema (OpenAPI components resolved);
- :func:`regex_witness` — a string in which a regular expression is found.
"""

from __future__ import annotations

import importlib
import random
import re
from collections.abc import Callable
from typing import Any

from bridge.events import rfc3339
from scenarios.matching import (
    MISSING,
    compile_jsonpath,
    is_matcher,
    json_type,
    match,
    match_jsonpath,
    render,
)

__all__ = [
    "MISSING",
    "Schemas",
    "SynthesisError",
    "Values",
    "conform",
    "fill",
    "regex_witness",
    "write_jsonpath",
]

Schema = dict[str, Any] | None


class SynthesisError(ValueError):
    """An expectation no made-up value can satisfy (or that this module cannot invert)."""


# -- deterministic values ------------------------------------------------------------


#: Made-up timestamps count from here (2026-01-01T00:00:00Z), like fake-codex's seeded clock.
EPOCH_MS = 1_767_225_600_000


class Values:
    """Deterministic identifiers, words and timestamps from one seed."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(f"codex-rest-bridge respx mock {seed}")
        self._ms = EPOCH_MS

    def now_ms(self) -> int:
        """A clock that moves a few milliseconds per reading."""
        self._ms += self.rng.choice((1, 2, 3, 5, 8, 13))
        return self._ms

    def timestamp(self) -> str:
        """An RFC 3339 timestamp with milliseconds, as the bridge writes them."""
        return rfc3339(self.now_ms() / 1000)

    def uuid4(self) -> str:
        value = self.rng.getrandbits(128)
        value = value & ~(0xF << 76) | 0x4 << 76
        value = value & ~(0b11 << 62) | 0b10 << 62
        return _dashed(value)

    def uuid7(self) -> str:
        """A UUIDv7, the format of codex's thread, turn and item ids."""
        millis = self.now_ms()
        value = (millis & (1 << 48) - 1) << 80 | 0x7 << 76 | self.rng.getrandbits(12) << 64
        value |= 0b10 << 62 | self.rng.getrandbits(62)
        return _dashed(value)

    def hex(self, digits: int) -> str:
        return f"{self.rng.getrandbits(digits * 4):0{digits}x}"

    def string(self, hint: str = "value") -> str:
        """A made-up string, recognisable as such: `<hint>-<8 hex digits>`."""
        stem = re.sub(r"[^A-Za-z0-9_]+", "-", hint).strip("-") or "value"
        return f"{stem}-{self.hex(8)}"


def _dashed(value: int) -> str:
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


# -- regular expressions -------------------------------------------------------------

#: The regular expression parser of the standard library (private, stable since 3.11).
_sre_parse: Any = importlib.import_module("re._parser")

_CATEGORY_CHARS = {
    "CATEGORY_DIGIT": "0",
    "CATEGORY_NOT_DIGIT": "a",
    "CATEGORY_SPACE": " ",
    "CATEGORY_NOT_SPACE": "a",
    "CATEGORY_WORD": "a",
    "CATEGORY_NOT_WORD": "-",
}
_FALLBACK_CHARS = "a0x-_ .Z9"


def regex_witness(pattern: str) -> str:
    """A short string in which `pattern` is found (`re.search`); SynthesisError if none.

    A pattern that matches its own text is its own witness; otherwise the pattern's
    parse tree is walked taking the first alternative, the first
    character of each class and the fewest repetitions; look-arounds are ignored and the
    result is checked, so a pattern this cannot satisfy fails loudly instead of lying.
    """
    try:
        compiled = re.compile(pattern)
        tree = _sre_parse.parse(pattern)
    except re.error as exc:
        raise SynthesisError(f"invalid regular expression /{pattern}/: {exc}") from None
    if compiled.search(pattern):
        return pattern  # a pattern that reads as its own example ("touch proof.txt")
    groups: dict[int, str] = {}
    for minimum in (True, False):
        text = _emit(tree, groups, minimum)
        if compiled.search(text):
            return text
    raise SynthesisError(
        f"cannot make up a string matching /{pattern}/ (look-arounds or back-references); "
        "give an exact value in the scenario"
    )


def _emit(items: Any, groups: dict[int, str], minimum: bool) -> str:
    out: list[str] = []
    for op, arg in items:
        name = str(op)
        char = _char(name, arg)
        if char is not None:
            out.append(char)
        elif name == "BRANCH":
            out.append(_emit(arg[1][0], groups, minimum))
        elif name == "SUBPATTERN":
            group, _, _, body = arg
            text = _emit(body, groups, minimum)
            if group is not None:
                groups[group] = text
            out.append(text)
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, body = arg
            count = low if minimum else max(low, min(1, high))
            out.append("".join(_emit(body, groups, minimum) for _ in range(count)))
        elif name == "GROUPREF":
            out.append(groups.get(arg, ""))
        elif name == "ATOMIC_GROUP":
            out.append(_emit(arg, groups, minimum))
        # AT (anchors), ASSERT, ASSERT_NOT: nothing to emit; the final check decides.
    return "".join(out)


def _char(name: str, arg: Any) -> str | None:
    """The character an item that stands for one character is made into (None: not one)."""
    if name == "LITERAL":
        return chr(arg)
    if name == "NOT_LITERAL":
        return next(c for c in _FALLBACK_CHARS if ord(c) != arg)
    if name == "ANY":
        return "x"
    if name == "IN":
        return _class_char(arg)
    if name == "RANGE":
        return chr(arg[0])
    if name == "CATEGORY":
        return _CATEGORY_CHARS.get(str(arg), "a")
    return None


def _class_char(items: Any) -> str:
    negate = any(str(op) == "NEGATE" for op, _ in items)
    allowed = [char for op, arg in items if (char := _char(str(op), arg)) is not None]
    if not negate:
        return allowed[0] if allowed else "a"
    # A negated class: the first fallback character that none of its members is.
    return next((c for c in _FALLBACK_CHARS if c not in allowed), "a")


# -- schemas ---------------------------------------------------------------------------


class Schemas:
    """JSON Schemas of one OpenAPI document: resolves `#/components/schemas/...` refs."""

    def __init__(self, document: dict[str, Any] | None = None) -> None:
        components = (document or {}).get("components", {})
        self.definitions: dict[str, Any] = dict(components.get("schemas", {}))

    def resolve(self, schema: Schema) -> dict[str, Any]:
        """`schema` with its `$ref` followed (an empty schema for None)."""
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema and seen < 32:
            name = str(schema["$ref"]).rsplit("/", 1)[-1]
            schema = self.definitions.get(name, {})
            seen += 1
        return schema if isinstance(schema, dict) else {}

    def named(self, name: str) -> dict[str, Any]:
        return self.resolve({"$ref": f"#/components/schemas/{name}"})

    def options(self, schema: Schema) -> list[dict[str, Any]]:
        """The alternatives of an `anyOf`/`oneOf` (or the schema itself)."""
        resolved = self.resolve(schema)
        for key in ("anyOf", "oneOf"):
            if key in resolved:
                return [self.resolve(option) for option in resolved[key]]
        return [resolved]

    def types(self, schema: Schema) -> set[str]:
        """The JSON types a schema allows (empty: anything)."""
        found: set[str] = set()
        for option in self.options(schema):
            kind = option.get("type")
            if isinstance(kind, list):
                found.update(kind)
            elif isinstance(kind, str):
                found.add(kind)
            elif "const" in option or "enum" in option:
                values = [option["const"]] if "const" in option else option["enum"]
                found.update(json_type(value) for value in values)
            elif option:
                return set()
        return found

    def prop(self, schema: Schema, key: str) -> Schema:
        """The schema of property `key` of an object schema (None: unknown)."""
        for option in self.options(schema):
            properties = option.get("properties", {})
            if key in properties:
                return properties[key]  # type: ignore[no-any-return]
            extra = option.get("additionalProperties")
            if isinstance(extra, dict):
                return extra
        return None

    def items(self, schema: Schema) -> Schema:
        for option in self.options(schema):
            if isinstance(option.get("items"), dict):
                return option["items"]  # type: ignore[no-any-return]
        return None


def fill(schema: Schema, schemas: Schemas, values: Values, hint: str = "value") -> Any:
    """A value valid against `schema`: required properties (and those with a default)
    filled in, the null option of a nullable type, the first of an enum."""
    options = schemas.options(schema)
    nullable = any(option.get("type") == "null" for option in options)
    if nullable and len(options) > 1:
        return None
    resolved = options[0] if options else {}
    if "const" in resolved:
        return resolved["const"]
    if resolved.get("enum"):
        return resolved["enum"][0]
    if "default" in resolved and resolved["default"] is not None:
        return resolved["default"]
    kind = resolved.get("type")
    if isinstance(kind, list):
        if "null" in kind:
            return None
        kind = kind[0] if kind else None
    if kind == "object" or (kind is None and "properties" in resolved):
        result: dict[str, Any] = {}
        required = set(resolved.get("required", []))
        for name, prop in resolved.get("properties", {}).items():
            prop_resolved = schemas.resolve(prop)
            if name in required:
                result[name] = fill(prop, schemas, values, name)
            elif prop_resolved.get("default") is not None:
                result[name] = prop_resolved["default"]
        return result
    if kind == "array":
        count = int(resolved.get("minItems", 0))
        return [fill(resolved.get("items"), schemas, values, hint) for _ in range(count)]
    if kind == "string":
        if resolved.get("format") == "date-time":
            return values.timestamp()
        if "pattern" in resolved:
            return regex_witness(str(resolved["pattern"]))
        text = values.string(hint)
        return text.ljust(int(resolved.get("minLength", 0)), "x")
    if kind in ("integer", "number"):
        return int(resolved.get("minimum", 0))
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    # No type at all (`Any` on the wire: params, results): an empty object.
    return {}


# -- values that match an expectation ------------------------------------------------------


def conform(
    expected: Any,
    base: Any,
    schema: Schema,
    schemas: Schemas,
    values: Values,
    *,
    subset: bool,
    hint: str = "value",
) -> Any:
    """A value that matches `expected` (as `scenarios.matching.match` does), built on `base`.

    `subset`: objects keep the keys of `base` that `expected` does not name (and, with
    no base, get the schema's required ones); otherwise they hold exactly the keys of
    `expected`. A matcher that `base` already satisfies keeps `base`. Returns MISSING for
    `{$absent: true}`.
    """
    if is_matcher(expected):
        if base is not MISSING and not match(expected, base, subset=subset):
            return base
        return _witness(expected, base, schema, schemas, values, subset=subset, hint=hint)
    if isinstance(expected, dict):
        if subset:
            start = base if isinstance(base, dict) else fill(schema, schemas, values, hint)
            result: dict[str, Any] = dict(start) if isinstance(start, dict) else {}
        else:
            result = {}
        for key, item in expected.items():
            current = result.get(key, MISSING)
            if current is MISSING and isinstance(base, dict):
                current = base.get(key, MISSING)
            value = conform(
                item,
                current,
                schemas.prop(schema, key),
                schemas,
                values,
                subset=subset,
                hint=str(key),
            )
            if value is MISSING:
                result.pop(key, None)
            else:
                result[key] = value
        return result
    if isinstance(expected, list):
        previous = base if isinstance(base, list) else []
        item_schema = schemas.items(schema)
        return [
            conform(
                item,
                previous[index] if index < len(previous) else MISSING,
                item_schema,
                schemas,
                values,
                subset=subset,
                hint=hint,
            )
            for index, item in enumerate(expected)
        ]
    return expected


_OP_ORDER = (
    "$eq",
    "$oneOf",
    "$subset",
    "$regex",
    "$contains",
    "$len",
    "$gt",
    "$gte",
    "$lt",
    "$lte",
    "$type",
    "$any",
)


def _witness(
    ops: dict[str, Any],
    base: Any,
    schema: Schema,
    schemas: Schemas,
    values: Values,
    *,
    subset: bool,
    hint: str,
) -> Any:
    if "$absent" in ops:
        if ops["$absent"]:
            return MISSING
        return base if base is not MISSING else fill(schema, schemas, values, hint)
    wanted_types = _wanted_types(ops, schema, schemas, base)
    makers: dict[str, Callable[[Any], list[Any]]] = {
        "$eq": lambda arg: [arg],
        "$oneOf": lambda arg: [
            conform(option, base, schema, schemas, values, subset=subset, hint=hint)
            for option in (arg if isinstance(arg, list) else [arg])
        ],
        "$subset": lambda arg: [
            conform(arg, base, schema, schemas, values, subset=True, hint=hint)
        ],
        "$regex": lambda arg: [regex_witness(str(arg))],
        "$contains": lambda arg: _contains(arg, base, schema, schemas, values, wanted_types),
        "$len": lambda arg: _sized(arg, base, schema, schemas, values, wanted_types, hint),
        "$gt": lambda _: [_number(ops, wanted_types)],
        "$gte": lambda _: [_number(ops, wanted_types)],
        "$lt": lambda _: [_number(ops, wanted_types)],
        "$lte": lambda _: [_number(ops, wanted_types)],
        "$type": lambda _: _typed(wanted_types, base, schema, schemas, values, hint),
        "$any": lambda _: [base if base is not MISSING else fill(schema, schemas, values, hint)],
    }
    for op in _OP_ORDER:
        if op not in ops:
            continue
        for candidate in makers[op](ops[op]):
            if candidate is not MISSING and not match(ops, candidate, subset=subset):
                return candidate
    raise SynthesisError(f"cannot make up a value matching {render(ops)}")


def _wanted_types(ops: dict[str, Any], schema: Schema, schemas: Schemas, base: Any) -> list[str]:
    if "$type" in ops:
        given = ops["$type"]
        return list(given) if isinstance(given, list) else [given]
    allowed = schemas.types(schema)
    if allowed:
        return sorted(allowed, key=lambda t: (t == "null", t))
    if base is not MISSING:
        return [json_type(base)]
    return []


def _contains(
    arg: Any,
    base: Any,
    schema: Schema,
    schemas: Schemas,
    values: Values,
    wanted: list[str],
) -> list[Any]:
    candidates: list[Any] = []
    if isinstance(arg, str) and (not wanted or "string" in wanted or isinstance(base, str)):
        candidates.append(arg)
        if isinstance(base, str):
            candidates.append(base + arg)
    element = conform(arg, MISSING, schemas.items(schema), schemas, values, subset=True)
    previous = base if isinstance(base, list) else []
    candidates.append([*previous, element])
    return candidates


def _sized(
    arg: Any,
    base: Any,
    schema: Schema,
    schemas: Schemas,
    values: Values,
    wanted: list[str],
    hint: str,
) -> list[Any]:
    size = arg if isinstance(arg, int) else _number(arg, ["integer"])
    if not isinstance(size, int) or size < 0:
        return []
    candidates: list[Any] = []
    for kind in wanted or ["array", "string"]:
        if kind == "array":
            previous = base if isinstance(base, list) else []
            items = list(previous[:size])
            while len(items) < size:
                items.append(fill(schemas.items(schema), schemas, values, hint))
            candidates.append(items)
        elif kind == "string":
            text = base if isinstance(base, str) else ""
            candidates.append((text + "x" * size)[:size])
        elif kind == "object":
            candidates.append({f"{hint}{index}": None for index in range(size)})
    return candidates


def _number(ops: Any, wanted: list[str]) -> Any:
    """The smallest integer (or number) within the bounds of `ops`."""
    if not isinstance(ops, dict):
        return ops
    low: float | None = None
    high: float | None = None
    if "$gte" in ops:
        low = ops["$gte"]
    if "$gt" in ops:
        strict = ops["$gt"] + (1 if isinstance(ops["$gt"], int) else 0.5)
        low = strict if low is None else max(low, strict)
    if "$lte" in ops:
        high = ops["$lte"]
    if "$lt" in ops:
        strict = ops["$lt"] - (1 if isinstance(ops["$lt"], int) else 0.5)
        high = strict if high is None else min(high, strict)
    if low is not None:
        value = low
    elif high is not None:
        value = min(0, high)
    else:
        value = 0
    if "integer" in wanted or not wanted or "number" not in wanted:
        as_int = int(value) if float(value).is_integer() else int(value) + 1
        if (low is None or as_int >= low) and (high is None or as_int <= high):
            return as_int
    return value


_EMPTY: dict[str, Any] = {"integer": 0, "number": 0, "boolean": False, "null": None}


def _typed(
    wanted: list[str],
    base: Any,
    schema: Schema,
    schemas: Schemas,
    values: Values,
    hint: str,
) -> list[Any]:
    candidates: list[Any] = []
    filled = fill(schema, schemas, values, hint) if schema else MISSING
    for kind in wanted:
        if filled is not MISSING and json_type(filled) == kind:
            candidates.append(filled)
        if kind == "string":
            candidates.append(values.string(hint))
        elif kind in ("object", "array"):
            candidates.append({} if kind == "object" else [])
        else:
            candidates.append(_EMPTY.get(kind))
    return candidates


# -- JSONPath ------------------------------------------------------------------------


class _Slot:
    """A place in a document: `holder[key]`, and the schema of what goes there."""

    __slots__ = ("holder", "key", "schema")

    def __init__(self, holder: Any, key: Any, schema: Schema) -> None:
        self.holder = holder
        self.key = key
        self.schema = schema

    def get(self) -> Any:
        if isinstance(self.holder, dict):
            return self.holder.get(self.key, MISSING)
        if isinstance(self.holder, list) and -len(self.holder) <= self.key < len(self.holder):
            return self.holder[self.key]
        return MISSING

    def set(self, value: Any) -> None:
        self.holder[self.key] = value

    def delete(self) -> None:
        if isinstance(self.holder, dict):
            self.holder.pop(self.key, None)
        else:
            del self.holder[self.key]


class _Writer:
    """Finds (and, when asked, creates) the places a JSONPath selects."""

    def __init__(self, schemas: Schemas, values: Values, create: bool) -> None:
        self.schemas = schemas
        self.values = values
        self.create = create

    def locate(self, node: Any, slots: list[_Slot]) -> list[_Slot]:
        kind = type(node).__name__
        if kind in ("Root", "This"):
            return slots
        if kind == "Child":
            return self.locate(node.right, self.locate(node.left, slots))
        found: list[_Slot] = []
        for slot in slots:
            found += self._step(kind, node, slot)
        return found

    def _container(self, slot: _Slot, wanted: type) -> Any:
        value = slot.get()
        if isinstance(value, wanted):
            return value
        if not self.create:
            return None
        value = fill(slot.schema, self.schemas, self.values) if wanted is dict else []
        if not isinstance(value, wanted):
            value = wanted()
        slot.set(value)
        return value

    def _element(self, schema: Schema) -> Any:
        return fill(schema, self.schemas, self.values)

    def _step(self, kind: str, node: Any, slot: _Slot) -> list[_Slot]:
        if kind == "Fields":
            holder = self._container(slot, dict)
            if holder is None:
                return []
            names = list(holder) if node.fields == ("*",) else list(node.fields)
            return [_Slot(holder, name, self.schemas.prop(slot.schema, name)) for name in names]
        if kind not in ("Index", "Slice", "Wildcard", "Filter"):
            raise SynthesisError(
                f"the JSONPath construct {node} cannot be written (use fields, indexes, [*] "
                "and == filters)"
            )
        holder = self._container(slot, list)
        if holder is None:
            return []
        item_schema = self.schemas.items(slot.schema)
        if kind == "Index":
            result = []
            for index in node.indices:
                needed = index + 1 if index >= 0 else -index
                while self.create and len(holder) < needed:
                    holder.append(self._element(item_schema))
                if -len(holder) <= index < len(holder):
                    result.append(_Slot(holder, index % len(holder), item_schema))
            return result
        if kind == "Filter":
            matching = [i for i, item in enumerate(holder) if _filter_holds(node, item)]
            if not matching and self.create:
                element = self._element(item_schema)
                if not isinstance(element, dict):
                    element = {}
                element.update(_filter_fields(node))
                holder.append(element)
                matching = [len(holder) - 1]
            return [_Slot(holder, index, item_schema) for index in matching]
        if kind == "Slice" and (node.start, node.end, node.step) != (None, None, None):
            raise SynthesisError("JSONPath slices cannot be written; use an index or [*]")
        if not holder and self.create:
            holder.append(self._element(item_schema))
        return [_Slot(holder, index, item_schema) for index in range(len(holder))]


def write_jsonpath(
    document: Any,
    expression: str,
    expected: Any,
    schema: Schema,
    schemas: Schemas,
    values: Values,
) -> Any:
    """`document` changed so that `expression` selects a value matching `expected`.

    `scenarios.matching.match_jsonpath` backwards: fields, indexes (negative too), `[*]`
    and `==` filters create what is missing (a filter that selects nothing gets a new
    element with the compared fields set); `{$absent: true}` deletes what is selected.
    A document that already matches is returned unchanged. Returns the (new) root.
    """
    if not match_jsonpath(expression, expected, document):
        return document
    tree = compile_jsonpath(expression)
    box: dict[str, Any] = {"root": document}
    if is_matcher(expected) and expected.get("$absent") is True:
        reader = _Writer(schemas, values, create=False)
        for slot in reversed(reader.locate(tree, [_Slot(box, "root", schema)])):
            if slot.get() is not MISSING:
                slot.delete()
        return box["root"]
    writer = _Writer(schemas, values, create=True)
    slots = writer.locate(tree, [_Slot(box, "root", schema)])
    if len(slots) == 1:
        slot = slots[0]
        value = conform(expected, slot.get(), slot.schema, schemas, values, subset=False)
        if value is MISSING:
            slot.delete()
        else:
            slot.set(value)
    elif isinstance(expected, list) and len(expected) == len(slots):
        for slot, item in zip(slots, expected, strict=True):
            slot.set(conform(item, slot.get(), slot.schema, schemas, values, subset=False))
    elif is_matcher(expected) and set(expected) == {"$contains"} and slots:
        slot = slots[0]
        slot.set(
            conform(expected["$contains"], slot.get(), slot.schema, schemas, values, subset=True)
        )
    else:
        raise SynthesisError(
            f"{expression} selects {len(slots)} values; cannot make them match {render(expected)}"
        )
    return box["root"]


def _filter_holds(node: Any, item: Any) -> bool:
    for expression in node.expressions:
        found = [m.value for m in expression.target.find(item)]
        if expression.op is None:
            if not found:
                return False
        elif expression.op != "==" or expression.value not in found:
            return False
    return True


def _filter_fields(node: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for expression in node.expressions:
        target = expression.target
        simple = (
            expression.op == "=="
            and type(target).__name__ == "Child"
            and type(target.left).__name__ == "This"
            and type(target.right).__name__ == "Fields"
            and len(target.right.fields) == 1
        )
        if not simple:
            raise SynthesisError(
                f"the filter {node} cannot be written (only `@.field == value` filters)"
            )
        fields[target.right.fields[0]] = expression.value
    return fields
