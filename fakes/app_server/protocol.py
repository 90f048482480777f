"""Which protocol fake-codex speaks: each codex release's, as that release describes it.

A profile (``protocols/<version>.json``) is generated from a real codex binary by
``python -m fakes.app_server.protocol BINARY...``, never written by hand: the client
request methods in the order the real server lists them in its "unknown variant" error
(that order is only in the error: the schema leaves out three legacy methods), which of
them are experimental, and the server requests and notifications, from
``codex app-server generate-json-schema`` with and without ``--experimental``. The suite
regenerates the profile of every installed release it supports and fails when one
differs from the profile shipped here (tests/fakes/test_protocol.py).

The fake speaks the protocol of the version it reports (``--codex-version``, the
script's ``codexVersion``, or the release in ``versionOutput``), or the default
release's when it reports one no profile describes.
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

from bridge import codex_window

if TYPE_CHECKING:
    from fakes.app_server.conform import Shapes

# subprocess, tempfile and bridge.codex_schema are imported where a profile is generated:
# fake-codex's fast start reads a profile and should not pay for them.

#: The release fake-codex emulates unless told otherwise: the project's pinned codex.
DEFAULT_VERSION = codex_window.PIN
#: The release whose payloads the fake's builders (shapes.py, server_requests.py) write,
#: field for field; what it sends as any other release passes through that release's
#: shapes (`fitting`). The schema check over the scenario library holds the builders to it.
BUILT_FOR = "0.169.0"
_FOLDER = "protocols"
#: The file beside ``<version>.json`` that holds the release's message shapes.
SHAPES_SUFFIX = ".shapes.json"
#: The request params `fake-codex app-server generate-json-schema` writes, as files of the
#: real command's layout, and their keys in the schema: the ones clients read (the
#: official SDK reads turn/start's, thread/resume's and thread/fork's).
PARAM_FILES = {
    "v1/InitializeParams": "InitializeParams",
    **{
        f"v2/{name}Params": f"v2/{name}Params"
        for name in (
            "ThreadStart",
            "ThreadResume",
            "ThreadFork",
            "ThreadRead",
            "ThreadList",
            "ThreadArchive",
            "ThreadUnarchive",
            "ThreadSetName",
            "TurnStart",
            "TurnSteer",
            "TurnInterrupt",
            "ModelList",
        )
    },
}
_UNKNOWN_VARIANT = re.compile(r"unknown variant `[^`]*`, expected one of (.*)$")
_MESSAGES = {
    "ClientRequest": "clientRequests",
    "ServerRequest": "serverRequests",
    "ServerNotification": "serverNotifications",
    "ClientNotification": "clientNotifications",
}


class Profile:
    """One release's messages: what the fake answers, refuses and may send.

    (A plain class: `dataclasses` would cost fake-codex's fast start its imports.)
    """

    __slots__ = (
        "client_notifications",
        "client_requests",
        "codex_version",
        "experimental_client_requests",
        "params",
        "server_notifications",
        "server_requests",
    )

    def __init__(
        self,
        *,
        codex_version: str,
        client_requests: tuple[str, ...],
        experimental_client_requests: frozenset[str],
        server_requests: tuple[str, ...],
        server_notifications: tuple[str, ...],
        client_notifications: tuple[str, ...],
        params: dict[str, dict[str, list[str]]] | None = None,
    ) -> None:
        self.codex_version = codex_version
        self.client_requests = client_requests
        self.experimental_client_requests = experimental_client_requests
        self.server_requests = server_requests
        self.server_notifications = server_notifications
        self.client_notifications = client_notifications
        #: Each of PARAM_FILES: its `required`, `stable` and `experimental` fields.
        self.params = params or {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Profile) and self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    def to_json(self) -> dict[str, Any]:
        return {
            "codexVersion": self.codex_version,
            "clientRequests": list(self.client_requests),
            "experimentalClientRequests": sorted(self.experimental_client_requests),
            "serverRequests": list(self.server_requests),
            "serverNotifications": list(self.server_notifications),
            "clientNotifications": list(self.client_notifications),
            "params": self.params,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        return cls(
            codex_version=data["codexVersion"],
            client_requests=tuple(data["clientRequests"]),
            experimental_client_requests=frozenset(data["experimentalClientRequests"]),
            server_requests=tuple(data["serverRequests"]),
            server_notifications=tuple(data["serverNotifications"]),
            client_notifications=tuple(data["clientNotifications"]),
            params=data.get("params", {}),
        )


def versions() -> tuple[str, ...]:
    """The releases a profile ships for, oldest first."""
    names = [
        name.removesuffix(".json")
        for name in os.listdir(_folder())
        if not name.endswith(SHAPES_SUFFIX)
    ]
    return tuple(sorted((n for n in names if _is_version(n)), key=_version_key))


@cache
def profile(version: str) -> Profile:
    """The profile of ``version``; the default release's when none ships for it."""
    if version not in versions():
        version = DEFAULT_VERSION
    with open(os.path.join(_folder(), f"{version}.json"), encoding="utf-8") as file:
        return Profile.from_json(json.load(file))


@cache
def shapes(version: str) -> Shapes:
    """What ``version``'s messages may and must carry (``protocols/<version>.shapes.json``,
    generated with the profile); the default release's when none ships for it."""
    import orjson

    from fakes.app_server.conform import Shapes

    if version not in versions():
        version = DEFAULT_VERSION
    with open(os.path.join(_folder(), f"{version}{SHAPES_SUFFIX}"), "rb") as file:
        return Shapes(orjson.loads(file.read()))


class Fit(Protocol):
    """What fits a payload the fake built to the release it emulates (`conform.Shapes`)."""

    def notification(self, method: str, params: Any) -> Any: ...
    def request(self, method: str, params: Any) -> Any: ...
    def result(self, method: str, result: Any) -> Any: ...


class AsBuilt:
    """The payloads as the builders write them: the fit of `BUILT_FOR` itself."""

    __slots__ = ()

    def notification(self, method: str, params: Any) -> Any:
        return params

    def request(self, method: str, params: Any) -> Any:
        return params

    def result(self, method: str, result: Any) -> Any:
        return result


@cache
def fitting(version: str) -> Fit:
    """What fits the fake's payloads to ``version`` (the default release when no profile
    ships for it): nothing to do for the release its builders write (`BUILT_FOR`), so
    the usual fake pays nothing, not even the import of conform.py; that release's
    shapes otherwise."""
    if version not in versions():
        version = DEFAULT_VERSION
    return AsBuilt() if version == BUILT_FOR else shapes(version)


def _folder() -> str:
    return os.path.join(os.path.dirname(__file__), _FOLDER)


def _is_version(text: str) -> bool:
    parts = text.split(".")
    return len(parts) == 3 and all(part.isdecimal() and part.isascii() for part in parts)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


# Generating a profile from a real binary --------------------------------------------------


def _messages(definitions: dict[str, Any]) -> dict[str, list[str]]:
    """The message names of each union (``ClientRequest``, ...), in the schema's order."""
    found: dict[str, list[str]] = {}
    for union, key in _MESSAGES.items():
        variants = definitions.get(union, {}).get("oneOf", [])
        found[key] = [name for v in variants for name in v["properties"]["method"].get("enum", [])]
    return found


def _listed_order(binary: str, home: str) -> list[str]:
    """The client requests as the real server lists them, asked with an unknown one."""
    import subprocess

    lines = [
        {
            "id": 0,
            "method": "initialize",
            "params": {"clientInfo": {"name": "probe", "version": "0"}},
        },
        {"method": "initialized"},
        {"id": 1, "method": "fake-codex/probe", "params": {}},
    ]
    with subprocess.Popen(
        [binary, "app-server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "CODEX_HOME": home, "RUST_LOG": "off"},
        text=True,
    ) as server:
        assert server.stdin is not None
        assert server.stdout is not None
        server.stdin.write("".join(json.dumps(line) + "\n" for line in lines))
        server.stdin.flush()
        try:
            for raw in server.stdout:
                message = json.loads(raw)
                if message.get("id") == 1:
                    match = _UNKNOWN_VARIANT.search(message["error"]["message"])
                    if match is None:
                        raise ValueError(f"unexpected answer: {message}")
                    return re.findall(r"`([^`]*)`", match.group(1))
        finally:
            server.kill()
    raise ValueError(f"{binary} app-server ended without answering")


def generate(binary: str) -> tuple[Profile, dict[str, Any]]:
    """The profile of the codex at ``binary`` (its native binary or npm launcher), and its
    messages' shapes (`conform.compile_shapes`)."""
    import subprocess
    import tempfile

    from bridge import codex_schema
    from fakes.app_server.conform import compile_shapes

    with tempfile.TemporaryDirectory(prefix="fake-protocol-home-") as home:
        done = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, check=True, timeout=60
        )
        version = done.stdout.split()[-1]
        order = _listed_order(binary, home)
    full_schema, stable_schema = codex_schema.bundles(binary)
    full, stable = _messages(full_schema), _messages(stable_schema)
    made = Profile(
        codex_version=version,
        client_requests=tuple(order),
        experimental_client_requests=frozenset(
            set(full["clientRequests"]) - set(stable["clientRequests"])
        ),
        server_requests=tuple(full["serverRequests"]),
        server_notifications=tuple(full["serverNotifications"]),
        client_notifications=tuple(full["clientNotifications"]),
        params={n: _fields(full_schema, stable_schema, k) for n, k in PARAM_FILES.items()},
    )
    return made, compile_shapes(full_schema)


def _fields(full: dict[str, Any], stable: dict[str, Any], key: str) -> dict[str, list[str]]:
    """The fields of the params type ``key``: required, stable (in the schema without
    ``--experimental``) and experimental (only in the one with it)."""
    everything = set(full.get(key, {}).get("properties", {}))
    listed = set(stable.get(key, {}).get("properties", {}))
    return {
        "required": sorted(full.get(key, {}).get("required", [])),
        "stable": sorted(listed),
        "experimental": sorted(everything - listed),
    }


def render(profile: Profile) -> str:
    """A profile as the file it ships in."""
    return json.dumps(profile.to_json(), indent=1) + "\n"


def render_shapes(shapes: dict[str, Any]) -> str:
    """A release's compiled shapes as the file they ship in (one line a type or message,
    so that a new release's diff reads type by type)."""
    lines = []
    for section, entries in shapes.items():
        rows = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in entries.items()]
        lines.append(f" {json.dumps(section)}: {{\n" + ",\n".join(rows) + ("\n }" if rows else "}"))
    return "{\n" + ",\n".join(lines) + "\n}\n"


def shipped_shapes(version: str) -> str:
    """The text of the shapes file shipped for ``version``."""
    with open(os.path.join(_folder(), f"{version}{SHAPES_SUFFIX}"), encoding="utf-8") as file:
        return file.read()


def main(argv: list[str] | None = None) -> int:
    """`python -m fakes.app_server.protocol BINARY...`: (re)write each binary's profile."""
    binaries = sys.argv[1:] if argv is None else argv
    if not binaries:
        print("usage: python -m fakes.app_server.protocol CODEX_BINARY...", file=sys.stderr)
        return 2
    for binary in binaries:
        made, shaped = generate(binary)
        name = f"{made.codex_version}.json"
        with open(os.path.join(_folder(), name), "w", encoding="utf-8") as file:
            file.write(render(made))
        shapes_name = f"{made.codex_version}{SHAPES_SUFFIX}"
        with open(os.path.join(_folder(), shapes_name), "w", encoding="utf-8") as file:
            file.write(render_shapes(shaped))
        print(f"{name}: {len(made.client_requests)} client requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
