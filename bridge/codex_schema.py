"""The JSON Schema a codex binary writes of its app-server protocol, generated and read.

`codex app-server generate-json-schema --out DIR` writes one bundle,
``codex_app_server_protocol.schemas.json``, whose ``definitions`` hold every type (the v2
types one level down, under ``v2``). ``--experimental`` adds the experimental methods and
fields. Both the drift report (`rest-bridge codex-diff`, bridge_ops/codex_diff.py) and
fake-codex's protocol profiles (fakes/app_server/protocol.py) read a release's protocol
through this module, so they cannot disagree on how a schema is had.

Standard library only; nothing here is on the request path.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

BUNDLE = "codex_app_server_protocol.schemas.json"
SCHEMA_TIMEOUT_S = 60

Json = dict[str, Any]


class SchemaUnavailable(Exception):
    """A schema could not be generated, installed or read; the message says why."""


def run(
    command: list[str], timeout: float, what: str, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``command`` (input closed); its exit status and the last line of its stderr.
    Raises SchemaUnavailable, naming ``what``, when it cannot run or overruns."""
    try:
        done = subprocess.run(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SchemaUnavailable(f"{what}: {exc}") from None
    return done.returncode, (done.stderr.strip().splitlines() or ["no output"])[-1][:300]


def generate(binary: str, out: Path, experimental: bool) -> None:
    """Have ``binary`` write its schema bundle into ``out``."""
    command = [binary, "app-server", "generate-json-schema", "--out", str(out)]
    if experimental:
        command.append("--experimental")
    with tempfile.TemporaryDirectory(prefix="codex-schema-home-") as home:
        # A codex home of its own: the user's configuration shapes nothing here.
        env = {**os.environ, "CODEX_HOME": home}
        status, last = run(command, SCHEMA_TIMEOUT_S, binary, env)
    if status != 0:
        raise SchemaUnavailable(f"{binary} exited {status}: {last}")


def flatten(bundle: Json) -> dict[str, Json]:
    """A bundle's definitions by key, the v2 ones as ``v2/Name`` (as ``$ref`` names them)."""
    found: dict[str, Json] = {}
    for key, value in bundle.get("definitions", {}).items():
        if key == "v2" and isinstance(value, dict) and "type" not in value:
            found.update({f"v2/{name}": schema for name, schema in value.items()})
        elif isinstance(value, dict):
            found[key] = value
    return found


def read_bundle(folder: Path) -> dict[str, Json]:
    """The flattened definitions of the bundle in ``folder``."""
    path = folder / BUNDLE
    try:
        return flatten(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:
        raise SchemaUnavailable(f"cannot read {path}: {exc}") from None


def bundles(binary: str) -> tuple[dict[str, Json], dict[str, Json]]:
    """The flattened definitions ``binary`` generates with ``--experimental`` and without."""
    with tempfile.TemporaryDirectory(prefix="codex-schema-") as scratch:
        full_dir, stable_dir = Path(scratch, "full"), Path(scratch, "stable")
        generate(binary, full_dir, experimental=True)
        generate(binary, stable_dir, experimental=False)
        return read_bundle(full_dir), read_bundle(stable_dir)
