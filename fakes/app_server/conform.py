"""What fake-codex sends, made to fit the release it emulates.

The fake's builders (shapes.py, server_requests.py) write one release's payloads. Each
release's generated JSON Schema says what every notification's and server request's
params, and every client request's result, may and must carry; `compile_shapes` reduces
that schema to a small plan per message (generated into
``protocols/<version>.shapes.json`` beside the profile, with it), and `Shapes` applies
the plan to a payload:

- a field the release's type does not declare is dropped;
- a field it requires and the payload lacks is added, with the schema's plainest value
  (the one value of an enum or constant, null where null is allowed, else an empty
  string, zero, false, an empty list, or an object of its own required fields);
- of a union keyed by a tag (``type``, ``mode``...), a payload without the tag is made
  the first variant; one whose tag the release does not know is left as it is.

The plan is compiled once per release (on the first message that needs it), never by
walking the schema per message; applying it walks the payload only where the schema
says something, and copies a dict or list only when it changes it (the builders' own
objects, such as a thread the fake keeps, are never modified).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

Json = dict[str, Any]

#: Where the plans of the three kinds of message are kept in a shapes file.
NOTIFICATIONS = "notifications"
SERVER_REQUESTS = "serverRequests"
RESPONSES = "responses"
_MESSAGES = {"ServerNotification": NOTIFICATIONS, "ServerRequest": SERVER_REQUESTS}
_DEFAULT_DEPTH = 6


# Compiling a release's schema into plans (when a profile is generated) ----------------


def compile_shapes(definitions: Mapping[str, Json]) -> Json:
    """The plans of every message of a release, from its flattened schema definitions
    (``bridge.codex_schema.flatten``): what `Shapes` reads."""
    compiler = _Compiler(definitions)
    found: Json = {NOTIFICATIONS: {}, SERVER_REQUESTS: {}, RESPONSES: {}}
    for union, key in _MESSAGES.items():
        for method, params in _variants(definitions, union):
            plan = compiler.node(params)
            if plan is not None:
                found[key][method] = plan
    for method, params in _variants(definitions, "ClientRequest"):
        ref = _ref(params)
        if ref is not None and ref.endswith("Params"):
            response = ref.removesuffix("Params") + "Response"
            if response in definitions:
                plan = compiler.node({"$ref": f"#/definitions/{response}"})
                if plan is not None:
                    found[RESPONSES][method] = plan
    found["types"] = {name: compiler.types[name] for name in sorted(compiler.used)}
    for key in (NOTIFICATIONS, SERVER_REQUESTS, RESPONSES):
        found[key] = dict(sorted(found[key].items()))
    return found


def _variants(definitions: Mapping[str, Json], union: str) -> Iterable[tuple[str, Json]]:
    for variant in definitions.get(union, {}).get("oneOf", []):
        props = variant.get("properties", {})
        for method in props.get("method", {}).get("enum", []):
            yield method, props.get("params") or {}


def _ref(schema: Any) -> str | None:
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    return ref.removeprefix("#/definitions/") if isinstance(ref, str) else None


class _Compiler:
    def __init__(self, definitions: Mapping[str, Json]) -> None:
        self.definitions = definitions
        self.types: dict[str, Json | None] = {}
        self.used: set[str] = set()

    def resolve(self, schema: Any) -> Any:
        seen = 0
        while (ref := _ref(schema)) is not None and seen < 20:
            schema = self.definitions.get(ref, {})
            seen += 1
        return schema

    def node(self, schema: Any) -> Any:
        """A plan for values of ``schema``: a type's name, a plan object, or None when
        nothing is to be done to them."""
        ref = _ref(schema)
        if ref is not None:
            if ref not in self.types:
                self.types[ref] = None  # a recursive type sees itself as done
                self.types[ref] = self._compile(self.definitions.get(ref, {}))
            if self.types[ref] is None:
                return None
            self.used.add(ref)
            return ref
        return self._compile(schema)

    def _compile(self, schema: Any) -> Any:
        if not isinstance(schema, dict):
            return None
        if len(schema.get("allOf", ())) == 1:
            return self.node(schema["allOf"][0])
        variants = [v for v in schema.get("oneOf", []) + schema.get("anyOf", []) if not _is_null(v)]
        if "properties" in schema:
            base = self._object(schema)
            if variants:
                union = self._union(variants, base)
                return union if union is not None else {**base, "allow": None}
            return base
        if len(variants) == 1:
            return self.node(variants[0])
        if variants:
            return self._union(variants, None)
        types = schema.get("type")
        if types == "array" or (isinstance(types, list) and "array" in types):
            items = self.node(schema.get("items"))
            return None if items is None else {"items": items}
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            values = self.node(extra)
            return None if values is None else {"values": values}
        return None

    def _object(self, schema: Json) -> Json:
        props: dict[str, Any] = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        plan: Json = {
            "allow": None if extra not in (None, False) else sorted(props),
            "add": {
                name: default(props.get(name, {}), self.definitions)
                for name in sorted(schema.get("required", []))
            },
            "props": {},
        }
        for name in sorted(props):
            sub = self.node(props[name])
            if sub is not None:
                plan["props"][name] = sub
        return plan

    def _union(self, variants: list[Any], base: Json | None) -> Json | None:
        """Variants that are objects told apart by one single-valued property: a plan
        per value of that tag (each with ``base``, a flattened object's own fields)."""
        objects = [self.resolve(v) for v in variants]
        if not all(isinstance(o, dict) and "properties" in o for o in objects):
            return None
        tag = next(
            (key for key in _tags(objects[0]) if all(key in _tags(o) for o in objects)), None
        )
        if tag is None:
            return None
        arms: dict[str, Json] = {}
        for variant in objects:
            arm = self._object(variant)
            if base is not None:
                arm = _merge(base, arm)
            arms.setdefault(str(_tags(variant)[tag]), arm)
        return {"tag": tag, "arms": arms}


def _tags(schema: Json) -> dict[str, Any]:
    """The properties of ``schema`` that admit exactly one value, with that value."""
    found: dict[str, Any] = {}
    for key, prop in schema.get("properties", {}).items():
        if isinstance(prop, dict):
            values = prop.get("enum")
            if isinstance(values, list) and len(values) == 1 and isinstance(values[0], str):
                found[key] = values[0]
            elif isinstance(prop.get("const"), str):
                found[key] = prop["const"]
    return found


def _merge(base: Json, arm: Json) -> Json:
    allow = None
    if base["allow"] is not None and arm["allow"] is not None:
        allow = sorted({*base["allow"], *arm["allow"]})
    return {
        "allow": allow,
        "add": {**base["add"], **arm["add"]},
        "props": {**base["props"], **arm["props"]},
    }


def _is_null(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "null"


def default(schema: Any, definitions: Mapping[str, Json], depth: int = _DEFAULT_DEPTH) -> Any:
    """The plainest value ``schema`` admits, for a required field a builder left out."""
    seen = 0
    while (ref := _ref(schema)) is not None and seen < 20:
        schema = definitions.get(ref, {})
        seen += 1
    if not isinstance(schema, dict) or depth <= 0:
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "null" in types:
        return None
    variants = schema.get("oneOf", []) + schema.get("anyOf", []) + schema.get("allOf", [])
    if variants:
        if any(_is_null(v) for v in variants):
            return None
        if "properties" not in schema:
            return default(variants[0], definitions, depth - 1)
    if "string" in types:
        return ""
    if "integer" in types or "number" in types:
        minimum = schema.get("minimum", 0)
        return int(minimum) if "integer" in types else minimum
    if "boolean" in types:
        return False
    if "array" in types:
        return []
    if "object" in types or "properties" in schema:
        props = schema.get("properties", {})
        value = {
            name: default(props.get(name, {}), definitions, depth - 1)
            for name in schema.get("required", [])
        }
        if variants:
            first = default(variants[0], definitions, depth - 1)
            if isinstance(first, dict):
                value.update(first)
        return value
    return None


# Applying the plans (every message the fake builds) -----------------------------------


class _Object:
    __slots__ = ("add", "allow", "props")

    def __init__(self) -> None:
        self.allow: frozenset[str] | None = None
        self.add: tuple[tuple[str, Any], ...] = ()
        self.props: tuple[tuple[str, _Plan], ...] = ()

    def apply(self, value: Any) -> Any:
        if type(value) is not dict:
            return value
        out = value
        if self.allow is not None and not value.keys() <= self.allow:
            out = {key: item for key, item in value.items() if key in self.allow}
        for key, plain in self.add:
            if key not in out:
                if out is value:
                    out = dict(value)
                out[key] = copy.deepcopy(plain)
        for key, plan in self.props:
            item = out.get(key)
            if item is not None:
                shaped = plan.apply(item)
                if shaped is not item:
                    if out is value:
                        out = dict(value)
                    out[key] = shaped
        return out


class _Union:
    __slots__ = ("arms", "first", "tag")

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.arms: dict[str, _Object] = {}
        self.first: _Object = _Object()

    def apply(self, value: Any) -> Any:
        if type(value) is not dict:
            return value
        if self.tag not in value:
            return self.first.apply(value)
        tag = value[self.tag]
        arm = self.arms.get(tag) if isinstance(tag, str) else None
        return value if arm is None else arm.apply(value)


class _Items:
    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: _Plan = _NOTHING

    def apply(self, value: Any) -> Any:
        if type(value) is not list:
            return value
        out = value
        for index, item in enumerate(value):
            shaped = self.items.apply(item)
            if shaped is not item:
                if out is value:
                    out = list(value)
                out[index] = shaped
        return out


class _Values:
    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: _Plan = _NOTHING

    def apply(self, value: Any) -> Any:
        if type(value) is not dict:
            return value
        out = value
        for key, item in value.items():
            shaped = self.values.apply(item)
            if shaped is not item:
                if out is value:
                    out = dict(value)
                out[key] = shaped
        return out


class _Nothing:
    __slots__ = ()

    def apply(self, value: Any) -> Any:
        return value


_Plan = _Object | _Union | _Items | _Values | _Nothing
_NOTHING = _Nothing()


class Shapes:
    """One release's plans, ready to apply: `notification`, `request` and `result` each
    return the payload fitted to the release (the same object when it already fits)."""

    def __init__(self, data: Json) -> None:
        types = data.get("types", {})
        made: dict[str, _Plan] = {}
        # Two passes: every named type exists before any plan refers to it (types refer
        # to each other, and to themselves).
        for name, plan in types.items():
            made[name] = _empty(plan)
        for name, plan in types.items():
            _fill(made[name], plan, made)

        def plans(key: str) -> dict[str, _Plan]:
            return {method: _build(plan, made) for method, plan in data.get(key, {}).items()}

        self._types = made
        self._notifications = plans(NOTIFICATIONS)
        self._requests = plans(SERVER_REQUESTS)
        self._results = plans(RESPONSES)

    def notification(self, method: str, params: Any) -> Any:
        """``params`` of the notification ``method``, as the release would send them."""
        plan = self._notifications.get(method)
        return params if plan is None else plan.apply(params)

    def request(self, method: str, params: Any) -> Any:
        """``params`` of the server request ``method``, as the release would send them."""
        plan = self._requests.get(method)
        return params if plan is None else plan.apply(params)

    def result(self, method: str, result: Any) -> Any:
        """The result of the client request ``method``, as the release would answer it."""
        plan = self._results.get(method)
        return result if plan is None else plan.apply(result)

    def value(self, type_name: str, value: Any) -> Any:
        """``value`` as the release writes its type ``type_name`` (``v2/Project``)."""
        plan = self._types.get(type_name)
        return value if plan is None else plan.apply(value)


def _empty(plan: Any) -> _Plan:
    if not isinstance(plan, dict):
        return _NOTHING
    if "tag" in plan:
        return _Union(plan["tag"])
    if "items" in plan:
        return _Items()
    if "values" in plan:
        return _Values()
    return _Object()


def _build(plan: Any, made: dict[str, _Plan]) -> _Plan:
    if isinstance(plan, str):
        return made.get(plan, _NOTHING)
    built = _empty(plan)
    _fill(built, plan, made)
    return built


def _fill(target: _Plan, plan: Any, made: dict[str, _Plan]) -> None:
    if isinstance(target, _Object):
        allow = plan.get("allow")
        target.allow = None if allow is None else frozenset(allow)
        target.add = tuple(plan.get("add", {}).items())
        target.props = tuple((key, _build(sub, made)) for key, sub in plan.get("props", {}).items())
    elif isinstance(target, _Union):
        for value, arm in plan["arms"].items():
            built = _Object()
            _fill(built, arm, made)
            target.arms[value] = built
        target.first = next(iter(target.arms.values()), _Object())
    elif isinstance(target, _Items):
        target.items = _build(plan["items"], made)
    elif isinstance(target, _Values):
        target.values = _build(plan["values"], made)
