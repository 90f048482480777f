"""Script text: parsing YAML, and pointing validation errors at the lines they concern."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml
from pydantic import ValidationError

# libyaml when available: much faster on large scripts.
_Base: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MERGE_TAG = "tag:yaml.org,2002:merge"
#: The tags of values YAML builds that JSON has no form for.
_NOT_JSON = frozenset({"tag:yaml.org,2002:binary", "tag:yaml.org,2002:set"})


class _Loader(_Base):  # type: ignore[valid-type,misc]
    """The safe loader, refusing two things it would otherwise let through: a key given
    twice in one mapping (YAML keeps the last and says nothing, so a typo'd copy of a
    key silently replaces the first), and a scalar it resolves to a type it then cannot
    build (a 5,000-digit integer, the date 2020-13-45), which would escape as a bare
    ValueError. Both become errors at the node's line and column."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        if node.tag in _NOT_JSON:
            # Bytes and sets: YAML builds them, no JSON line can carry them.
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"a YAML {node.tag.rsplit(':', 1)[-1]} is not a JSON value; write it as a "
                "string or a list",
                node.start_mark,
            )
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, OverflowError) as exc:
            kind = str(node.tag).rsplit(":", 1)[-1]
            shown = str(node.value)
            shown = shown if len(shown) <= 40 else f"{shown[:20]}... ({len(shown)} characters)"
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{shown!r} reads as a YAML {kind} that cannot be built "
                f"({str(exc).split(';')[0]}); quote it "
                "to keep it a string",
                node.start_mark,
            ) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue  # `<<: *base` may be overridden by the keys beside it
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, str) and isinstance(key_node, yaml.ScalarNode):
                    # A JSON object's keys are strings: `1: a` would fail when it is sent.
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"the key {key_node.value!r} reads as a YAML "
                        f"{str(key_node.tag).rsplit(':', 1)[-1]}, and a key is a string in "
                        "JSON; quote it",
                        key_node.start_mark,
                    )
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: the base constructor refuses it
                if seen is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"the key {key!r} is given twice in one mapping (first on line "
                        f"{seen.start_mark.line + 1}); give each key once",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep)


class ScriptError(ValueError):
    """A script that cannot be used; the message names the file, the line and the problem."""


#: How many nodes YAML aliases (`*name`) may stand for in one document, all told: an
#: alias repeats its anchor's whole node, so nested ones multiply (a "billion laughs"
#: file of a few hundred bytes stands for a billion strings). Past it, the file is refused.
MAX_ALIAS_NODES = 100_000
#: How many characters of scalars YAML aliases may repeat in one document, all told: a
#: few aliases of a long string stand for gigabytes in a file of kilobytes.
MAX_ALIAS_CHARS = 4 * 1024 * 1024
#: How many maps and lists a script may nest inside each other. A reply, notification or
#: request is written as one JSON line, and the JSON writer refuses to nest much deeper
#: than 250 levels: a script past this bound is refused when it is read, rather than
#: failing the fake when the line is due.
MAX_DEPTH = 200


def parse_yaml(text: str, source: str) -> Any:
    """The document in `text` (YAML, or JSON, which YAML reads too). Aliases are bounded
    (:data:`MAX_ALIAS_NODES` nodes, :data:`MAX_ALIAS_CHARS` characters); one inside the
    node it names (a recursive document) is refused: either is a ScriptError naming the
    file, line and column of the alias. So is a key given twice in one mapping, and a
    value YAML reads as a type it cannot build (a 5,000-digit integer, a 13th month)."""
    try:
        if "*" in text:  # an alias is written `*name`: without one, nothing to count
            _check_aliases(text, source)
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise ScriptError(f"{where}: invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ScriptError(f"{source}: invalid YAML: {exc}") from None
    except RecursionError:
        raise ScriptError(f"{source}: invalid YAML: nested too deep to read") from None


def _check_aliases(text: str, source: str) -> None:
    """Count, event by event (nothing is built), what each alias stands for: nodes, and
    characters of scalars."""
    sizes: dict[str, tuple[int, int]] = {}  # a finished anchor: its nodes and characters
    open_nodes: list[tuple[str | None, int, int]] = []  # collections being read
    added_nodes = added_chars = 0

    def count(nodes: int, chars: int) -> None:
        if open_nodes:
            anchor, held, held_chars = open_nodes[-1]
            open_nodes[-1] = (anchor, held + nodes, held_chars + chars)

    for event in yaml.parse(text, Loader=_Base):
        if isinstance(event, yaml.AliasEvent):
            mark = event.start_mark
            where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
            if any(anchor == event.anchor for anchor, _, _ in open_nodes):
                raise ScriptError(
                    f"{where}: invalid YAML: the alias *{event.anchor} is inside the node "
                    f"&{event.anchor} names (a document without end)"
                )
            size = sizes.get(event.anchor or "")
            if size is None:
                continue  # an undefined alias: the loader says so
            nodes, chars = size
            added_nodes += nodes
            added_chars += chars
            if added_nodes > MAX_ALIAS_NODES:
                raise ScriptError(
                    f"{where}: invalid YAML: its aliases stand for more than "
                    f"{MAX_ALIAS_NODES} nodes (*{event.anchor} repeats {nodes}); a file of "
                    "aliases inside aliases can stand for billions: write the values out"
                )
            if added_chars > MAX_ALIAS_CHARS:
                raise ScriptError(
                    f"{where}: invalid YAML: its aliases repeat more than {MAX_ALIAS_CHARS} "
                    f"characters (*{event.anchor} repeats {chars}); write the values out"
                )
            count(nodes, chars)
        elif isinstance(event, yaml.ScalarEvent):
            chars = len(event.value)
            if event.anchor is not None:
                sizes[event.anchor] = (1, chars)
            count(1, chars)
        elif isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append((event.anchor, 1, 0))
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, nodes, chars = open_nodes.pop()
            if anchor is not None:
                sizes[anchor] = (nodes, chars)
            count(nodes, chars)


def check_depth(
    data: Any,
    source: str,
    text: str | None,
    prefix: tuple[str, ...] = (),
    *,
    title: str = "invalid fake-codex script",
) -> None:
    """Refuse `data` if it nests more than :data:`MAX_DEPTH` maps and lists: a
    ScriptError naming the first such place (file, line and column with `text`).
    Iterative, so that no depth makes it fail otherwise."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(data, 0, ())]
    while stack:
        value, depth, loc = stack.pop()
        if isinstance(value, dict):
            children: Any = value.items()
        elif isinstance(value, list):
            children = enumerate(value)
        else:
            continue
        if depth == MAX_DEPTH:
            root = _compose(text) if text is not None else None
            where = prefix + loc
            mark = _mark(root, where) if root is not None else None
            place = f"{source}:{mark[0]}:{mark[1]}" if mark else source
            path = _format_path(where[:8]) + ("..." if len(where) > 8 else "")
            raise ScriptError(
                f"{title} {source}:\n  {place}: {path or '(top level)'}: "
                f"nests more than {MAX_DEPTH} maps and lists inside each other"
            )
        stack.extend((child, depth + 1, (*loc, key)) for key, child in reversed(list(children)))


def describe_errors(
    exc: ValidationError,
    source: str,
    text: str | None,
    prefix: tuple[str, ...],
    *,
    title: str = "invalid fake-codex script",
    tags: frozenset[str] = frozenset(),
    message: Callable[[Any], str] = lambda error: str(error["msg"]),
) -> str:
    """One line per problem: `file:line:column: path.to.key: message`.

    `tags`: the step kinds of a one-key union, left out of the path where pydantic
    inserts them after a list index (the tag repeats the step's kind key, which would
    send the line finder into `http:` instead of its sibling `expect:`).
    """
    root = _compose(text) if text is not None else None
    lines = [f"{title} {source}:"]
    for error in exc.errors():
        loc = prefix + tuple(error["loc"])
        loc = tuple(
            key
            for index, key in enumerate(loc)
            if not (index and isinstance(loc[index - 1], int) and key in tags)
        )
        mark = _mark(root, loc) if root is not None else None
        where = f"{source}:{mark[0]}:{mark[1]}" if mark else source
        line = f"  {where}: {_format_path(loc) or '(top level)'}: {message(error)}"
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def _compose(text: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=_Base)
    except yaml.YAMLError:
        return None


def _mark(root: yaml.Node, loc: tuple[Any, ...]) -> tuple[int, int]:
    """Line and column (1-based) of the deepest node `loc` reaches.

    Elements that match nothing (the step-kind tags pydantic adds, or a missing key)
    are skipped, so a missing key points at the mapping that lacks it.
    """
    node = root
    mark = node.start_mark
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node.value == str(key):
                    node, mark = value_node, key_node.start_mark
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            mark = node.start_mark
    return mark.line + 1, mark.column + 1


def _format_path(loc: tuple[Any, ...]) -> str:
    """`turns[0].steps[1].commandApproval.command`, without pydantic's repeated tags."""
    path = ""
    previous: Any = None
    for key in loc:
        if isinstance(key, int):
            path += f"[{key}]"
        elif key != previous:
            path += f".{key}" if path else str(key)
        previous = key
    return path
