"""`rest-bridge codex-diff OLD NEW`: what changed in the app-server protocol between two
codex releases, and which of a host's scenario files and cassettes use any of it.

OLD and NEW are each a codex binary (or its npm launcher) given by its path (a bare name
is not looked up on PATH), a version to install from npm (`0.171.0`, ASCII digits, into a
cache folder), or a folder that already holds a schema bundle written
by `codex app-server generate-json-schema --experimental --out DIR`. Each binary writes
its schema twice, with and without `--experimental`, so every change says whether it
touches the stable surface or the experimental one.

Exit status: 0 when nothing the given files use changed (with no files: when nothing
changed at all), 1 when something did, 2 when a schema could not be had. With
`--breaking-only`, additions (new methods, new optional fields, new enum values) do not
count toward the status; they are still printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.codex_schema import BUNDLE, SchemaUnavailable, bundles, read_bundle, run

#: The unions that list the protocol's messages, by what they carry.
KINDS = {
    "ClientRequest": "client request",
    "ServerRequest": "server request",
    "ServerNotification": "server notification",
    "ClientNotification": "client notification",
}
#: A release number, in ASCII digits only (`\d` would take Arabic-Indic digits too, for npm).
_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+(?:-[0-9A-Za-z.]+)?")
_INSTALL_TIMEOUT_S = 600

Json = dict[str, Any]


@dataclass(frozen=True)
class Method:
    name: str
    kind: str
    params: str | None  # a definition's key ("v2/ThreadStartParams"), or None
    experimental: bool


@dataclass(frozen=True)
class Schema:
    """One release's protocol: its definitions by key and its messages by name."""

    label: str
    definitions: Mapping[str, Json]
    methods: Mapping[str, Method]
    stable_definitions: Mapping[str, Json]

    def response_of(self, method: Method) -> str | None:
        """A client request's result type, named after its params by codex's convention."""
        if method.params and method.params.endswith("Params"):
            key = method.params.removesuffix("Params") + "Response"
            return key if key in self.definitions else None
        return None


@dataclass(frozen=True)
class Change:
    """One difference. ``subject`` is a method name or a definition key."""

    subject: str
    what: str
    breaking: bool
    experimental: bool

    def line(self) -> str:
        tags = ("breaking" if self.breaking else "additive") + (
            ", experimental" if self.experimental else ""
        )
        return f"{self.subject}: {self.what} [{tags}]"


@dataclass
class Report:
    old: str
    new: str
    changes: list[Change] = field(default_factory=list)
    #: file -> the changed methods it names, each with the changes that reach it
    uses: dict[str, dict[str, list[Change]]] = field(default_factory=dict)

    def to_json(self) -> Json:
        def change(c: Change) -> Json:
            return {
                "subject": c.subject,
                "what": c.what,
                "breaking": c.breaking,
                "experimental": c.experimental,
            }

        return {
            "old": self.old,
            "new": self.new,
            "changes": [change(c) for c in self.changes],
            "uses": {
                path: {name: [change(c) for c in found] for name, found in methods.items()}
                for path, methods in self.uses.items()
            },
        }


# Reading a bundle -------------------------------------------------------------------


def _ref(schema: Json | None) -> str | None:
    ref = (schema or {}).get("$ref")
    return ref.removeprefix("#/definitions/") if isinstance(ref, str) else None


def _messages(definitions: Mapping[str, Json]) -> dict[str, tuple[str, str | None]]:
    """Each message's name -> (kind, its params' definition key)."""
    found: dict[str, tuple[str, str | None]] = {}
    for union, kind in KINDS.items():
        for variant in definitions.get(union, {}).get("oneOf", []):
            props = variant.get("properties", {})
            names = props.get("method", {}).get("enum", [])
            for name in names:
                found[name] = (kind, _ref(props.get("params")))
    return found


def schema_from(label: str, full: dict[str, Json], stable: dict[str, Json]) -> Schema:
    stable_names = _messages(stable)
    methods = {
        name: Method(name, kind, params, experimental=name not in stable_names)
        for name, (kind, params) in _messages(full).items()
    }
    return Schema(label, full, methods, stable)


# Getting a bundle from a binary or a version --------------------------------------------


def install(version: str, cache: Path) -> str:
    """The npm launcher of ``@openai/codex@version``, installed into ``cache`` once."""
    if not _VERSION.fullmatch(version):
        raise SchemaUnavailable(f"{version!r} is not a codex version (like 0.171.0)")
    prefix = cache / version
    launcher = prefix / "node_modules" / ".bin" / "codex"
    if launcher.exists():
        return str(launcher)
    npm = shutil.which("npm")
    if npm is None:
        raise SchemaUnavailable(f"installing codex {version} needs npm, which is not on PATH")
    prefix.mkdir(parents=True, exist_ok=True)
    command = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund"]
    command += ["--loglevel=error", f"@openai/codex@{version}"]
    status, last = run(command, _INSTALL_TIMEOUT_S, f"npm install of codex {version}")
    if status != 0 or not launcher.exists():
        raise SchemaUnavailable(f"npm could not install codex {version}: {last}")
    return str(launcher)


def check(spec: str) -> None:
    """Refuse OLD or NEW unless it is a folder, an existing file or a version number. A
    bare command name is not looked up on PATH: give its path (`$(command -v codex)`)."""
    if not spec or not (Path(spec).is_dir() or Path(spec).is_file() or _VERSION.fullmatch(spec)):
        hint = f" (to use the {spec!r} on PATH, give its path)" if shutil.which(spec) else ""
        raise SchemaUnavailable(f"{spec!r} is neither a codex binary, a version nor a folder{hint}")


def load(spec: str, cache: Path) -> Schema:
    """OLD or NEW: a bundle folder, a codex binary, or a version to install."""
    check(spec)
    path = Path(spec)
    if path.is_dir():
        full = read_bundle(path)
        stable_folder = path / "stable"
        stable = read_bundle(stable_folder) if (stable_folder / BUNDLE).exists() else full
        return schema_from(spec, full, stable)
    full, stable = bundles(spec if path.is_file() else install(spec, cache))
    return schema_from(spec, full, stable)


# Comparing ------------------------------------------------------------------------------


def _shape(schema: Json) -> str:
    """A schema without its prose, to tell a changed type from a reworded one."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in ("description", "title")}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return json.dumps(strip(schema), sort_keys=True)


def _enum_values(schema: Json) -> set[str]:
    values = {v for v in schema.get("enum", []) if isinstance(v, str)}
    for variant in schema.get("oneOf", []) + schema.get("anyOf", []):
        if (
            isinstance(variant, dict)
            and set(variant.get("enum", []))
            and "properties" not in variant
        ):
            values |= {v for v in variant["enum"] if isinstance(v, str)}
    return values


def _variants(schema: Json) -> list[Json]:
    return [v for v in schema.get("oneOf", []) + schema.get("anyOf", []) if isinstance(v, dict)]


def _compare_definition(key: str, old: Json, new: Json, experimental: bool) -> Iterator[Change]:
    def change(what: str, breaking: bool) -> Change:
        return Change(key, what, breaking, experimental)

    old_props, new_props = old.get("properties", {}), new.get("properties", {})
    old_required, new_required = set(old.get("required", [])), set(new.get("required", []))
    is_params = key.endswith("Params")
    if old_props and not new_props and _variants(new):
        yield change("was an object, is now a union of variants", True)
        return
    removed = sorted(set(old_props) - set(new_props))
    added = sorted(set(new_props) - set(old_props))
    renamed: dict[str, str] = {}
    for gone in removed:
        twin = [a for a in added if _shape(new_props[a]) == _shape(old_props[gone])]
        if len(twin) == 1 and twin[0] not in renamed.values():
            renamed[gone] = twin[0]
    for gone in removed:
        if gone in renamed:
            yield change(f"field {gone!r} renamed to {renamed[gone]!r}", True)
        else:
            yield change(f"field {gone!r} removed", True)
    for new_name in added:
        if new_name in renamed.values():
            continue
        required = new_name in new_required
        # A new required field breaks whoever must send it: the client, for params.
        yield change(
            f"field {new_name!r} added" + (" (required)" if required else ""),
            required and is_params,
        )
    for name in sorted(set(old_props) & set(new_props)):
        if name in new_required and name not in old_required:
            yield change(f"field {name!r} is now required", is_params)
        elif name in old_required and name not in new_required:
            yield change(f"field {name!r} is no longer required", not is_params)
        if _shape(old_props[name]) != _shape(new_props[name]):
            yield change(f"field {name!r} changed type", True)
    old_values, new_values = _enum_values(old), _enum_values(new)
    for value in sorted(old_values - new_values):
        yield change(f"value {value!r} removed", True)
    for value in sorted(new_values - old_values):
        yield change(f"value {value!r} added", False)
    plain = not (old_props or new_props or old_values or new_values)
    if plain and _shape(old) != _shape(new):
        yield change("changed shape", True)


def compare(old: Schema, new: Schema) -> list[Change]:
    changes: list[Change] = []
    for name in sorted(set(old.methods) - set(new.methods)):
        method = old.methods[name]
        changes.append(Change(name, f"{method.kind} removed", True, method.experimental))
    for name in sorted(set(new.methods) - set(old.methods)):
        method = new.methods[name]
        changes.append(Change(name, f"{method.kind} added", False, method.experimental))
    for name in sorted(set(old.methods) & set(new.methods)):
        before, after = old.methods[name], new.methods[name]
        if before.experimental and not after.experimental:
            changes.append(Change(name, "now stable", False, False))
        elif after.experimental and not before.experimental:
            changes.append(Change(name, "now experimental only", True, False))
    for key in sorted(set(old.definitions) - set(new.definitions)):
        changes.append(Change(key, "type removed", True, key not in old.stable_definitions))
    for key in sorted(set(new.definitions) & set(old.definitions)):
        # The message unions changed as their messages did, said above.
        if key in KINDS or _shape(old.definitions[key]) == _shape(new.definitions[key]):
            continue
        experimental = key not in new.stable_definitions
        changes.extend(
            _compare_definition(key, old.definitions[key], new.definitions[key], experimental)
        )
    return changes


def _closure(schema: Schema, roots: Iterable[str | None]) -> set[str]:
    """Every definition reachable from ``roots`` through ``$ref``."""
    seen: set[str] = set()
    todo = [r for r in roots if r]
    while todo:
        key = todo.pop()
        if key in seen or key not in schema.definitions:
            continue
        seen.add(key)
        todo.extend(_refs(schema.definitions[key]))
    return seen


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = _ref(node)
        if ref:
            yield ref
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def touching(old: Schema, new: Schema, changes: list[Change], name: str) -> list[Change]:
    """The changes that reach the message ``name``: itself, its params, its result."""
    types: set[str] = set()
    for schema in (old, new):
        method = schema.methods.get(name)
        if method is not None:
            types |= _closure(schema, (method.params, schema.response_of(method)))
    return [c for c in changes if c.subject == name or c.subject in types]


_METHOD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?:/[A-Za-z][A-Za-z0-9_]*)+")


def files_of(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            yield from sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml", ".json")
            )
        else:
            yield path


def uses(paths: Iterable[Path], old: Schema, new: Schema, changes: list[Change]) -> Report:
    report = Report(old.label, new.label, changes)
    known = set(old.methods) | set(new.methods)
    for path in files_of(paths):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SchemaUnavailable(f"cannot read {path}: {exc}") from None
        named = sorted(set(_METHOD_NAME.findall(text)) & known)
        reached = {name: touching(old, new, changes, name) for name in named}
        report.uses[str(path)] = {name: found for name, found in reached.items() if found}
    return report


# The command ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", help="a codex binary, a version to install, or a schema folder")
    parser.add_argument("new", help="the same, for the release to compare with")
    parser.add_argument(
        "files",
        nargs="*",
        type=Path,
        help="scenario files, cassettes or folders of them: which use what changed",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--breaking-only",
        action="store_true",
        help="exit 1 only for removals and incompatible changes, not additions",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "codex-rest-bridge"
        / "codex",
        help="where versions named by number are installed (default: %(default)s)",
    )


def _counts(changes: list[Change], breaking_only: bool) -> list[Change]:
    return [c for c in changes if c.breaking or not breaking_only]


def main(args: argparse.Namespace) -> int:
    try:  # every argument is checked before anything runs or any folder is made
        check(args.old)
        check(args.new)
        for path in args.files:
            if not path.exists():
                raise SchemaUnavailable(f"{path}: no such file or folder")
            if not (path.is_file() or path.is_dir()):  # a FIFO or a device would block
                raise SchemaUnavailable(f"{path}: neither a regular file nor a folder")
        old, new = load(args.old, args.cache), load(args.new, args.cache)
        changes = compare(old, new)
        report = uses(args.files, old, new, changes)
    except SchemaUnavailable as exc:
        print(f"rest-bridge codex-diff: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print(report)
    if args.files:
        hit = any(
            _counts(found, args.breaking_only)
            for methods in report.uses.values()
            for found in methods.values()
        )
    else:
        hit = bool(_counts(changes, args.breaking_only))
    return 1 if hit else 0


def _print(report: Report) -> None:
    breaking = sum(c.breaking for c in report.changes)
    print(f"codex app-server protocol: {report.old} -> {report.new}")
    count = len(report.changes)
    print(f"{count} change{'' if count == 1 else 's'}, {breaking} breaking")
    for change in report.changes:
        print(f"  {change.line()}")
    for path, methods in report.uses.items():
        if not methods:
            print(f"{path}: uses nothing that changed")
            continue
        print(f"{path}: uses what changed")
        for name, found in methods.items():
            print(f"  {name}")
            for change in found:
                print(f"    {change.line()}")
