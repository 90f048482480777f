"""The experimental surface, on purpose: the bridge asks for codex's experimental API only
when a client sets `options.experimentalApi`, a caller without it gets codex's own error,
and docs/API.md lists the methods each release of the window gates behind it (read here
from that release's own `generate-json-schema`, with and without `--experimental`)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bridge import codex_window
from tests.e2e.test_real_codex import call, create_session

pytestmark = [pytest.mark.real_codex]

API_MD = Path(__file__).resolve().parents[2] / "docs" / "API.md"
#: A method every release of the window gates, whose params (none) parse before the gate.
EXPERIMENTAL = "mock/experimentalMethod"


def client_methods(codex_bin: str, out: Path, *, experimental: bool) -> set[str]:
    """The client request methods of the schema `codex_bin` generates."""
    flag = ["--experimental"] if experimental else []
    subprocess.run(
        [codex_bin, "app-server", "generate-json-schema", *flag, "--out", str(out)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    schema = json.loads((out / "ClientRequest.json").read_text())
    return {
        method
        for variant in schema["oneOf"]
        for method in variant["properties"]["method"].get("enum", [])
    }


def documented() -> tuple[set[str], dict[str, set[str]]]:
    """docs/API.md's lists: the methods every release gates, and those only some do."""
    text = API_MD.read_text()
    start = text.index("<!-- experimental methods -->")
    end = text.index("<!-- /experimental methods -->")
    common: set[str] = set()
    only: dict[str, set[str]] = {}
    for item in text[start:end].split("\n- ")[1:]:
        names = set(re.findall(r"`([^`]+)`", item.split(":", 1)[-1]))
        if item.startswith("Every release of the window"):
            common = names
        elif found := re.match(r"Only codex ([\d.]+)", item):
            only[found.group(1)] = names
    return common, only


def test_the_documented_experimental_methods_are_the_ones_this_release_gates(
    codex_bin: str, codex_version: str, tmp_path: Path
) -> None:
    release = codex_window.release(codex_version)
    stable = client_methods(codex_bin, tmp_path / "stable", experimental=False)
    every = client_methods(codex_bin, tmp_path / "experimental", experimental=True)
    gated = every - stable
    common, only = documented()
    assert set(only) <= set(codex_window.TESTED), "a release outside the window is listed"
    listed = common | only.get(str(release), set())
    assert listed == gated, (
        f"docs/API.md's experimental methods for codex {release}: "
        f"missing {sorted(gated - listed)}, not gated {sorted(listed - gated)}"
    )


@pytest.mark.asyncio
async def test_an_experimental_method_needs_the_option_and_answers_with_codexs_own_error(
    bridge: str, http: Any, codex_options: dict[str, Any]
) -> None:
    plain = await create_session(http, bridge, codex_options)
    status, body = await call(http, bridge, plain, EXPERIMENTAL, {})
    assert status == 502, body
    assert body == {
        "error": "app_server_error",
        "message": f"{EXPERIMENTAL} requires experimentalApi capability",
        "code": -32600,
    }

    asked = await create_session(http, bridge, {**codex_options, "experimentalApi": True})
    status, body = await call(http, bridge, asked, EXPERIMENTAL, {})
    assert status == 200, body
