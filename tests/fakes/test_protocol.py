"""fake-codex's protocol profiles: generated from real codex binaries, never by hand.

The drift test regenerates the profile of the installed real codex and compares it with
the one the fake ships (its method lists and its messages' shapes); it fails on the day
a profile no longer says what that release says (run
`python -m fakes.app_server.protocol CODEX_BINARY` to regenerate)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bridge import codex_schema, codex_window
from fakes.app_server import protocol

FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))


@pytest.mark.quick
def test_every_shipped_profile_names_its_own_release_and_the_default_is_one() -> None:
    assert protocol.DEFAULT_VERSION in protocol.versions()
    for version in protocol.versions():
        shipped = protocol.profile(version)
        assert shipped.codex_version == version
        assert shipped.client_requests[0] == "initialize"
        assert len(set(shipped.client_requests)) == len(shipped.client_requests)
        assert shipped.experimental_client_requests <= set(shipped.client_requests)


@pytest.mark.quick
def test_a_release_without_a_profile_speaks_the_default_releases_protocol() -> None:
    assert protocol.profile("9.9.9") == protocol.profile(protocol.DEFAULT_VERSION)


def test_the_shipped_profile_is_what_the_real_codex_generates(codex_bin: str) -> None:
    made, shaped = protocol.generate(codex_bin)
    assert made.codex_version in protocol.versions(), (
        f"no profile ships for codex {made.codex_version}: "
        "run python -m fakes.app_server.protocol on its binary"
    )
    assert protocol.render(made) == protocol.render(protocol.profile(made.codex_version))
    # The shapes of its messages, generated with it, have not drifted either.
    assert protocol.render_shapes(shaped) == protocol.shipped_shapes(made.codex_version)


@pytest.mark.quick
def test_the_fake_can_emulate_every_release_of_the_support_window() -> None:
    """Moving the window (bridge/codex_window.py) means generating the new release's
    profile; the fake's default is the window's pin."""
    assert set(codex_window.TESTED) <= set(protocol.versions())
    assert protocol.DEFAULT_VERSION == codex_window.PIN


def test_the_fakes_json_schema_has_the_params_fields_of_the_release_it_emulates(
    codex_bin: str, tmp_path: Path
) -> None:
    """`fake-codex app-server generate-json-schema` (which clients such as the official
    SDK read to learn what a runtime takes) writes, for the release it emulates, the
    fields that release's own command writes, with and without `--experimental`."""
    version = subprocess.run(
        [codex_bin, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()[-1]
    for flags in ([], ["--experimental"]):
        real, fake = tmp_path / f"real{len(flags)}", tmp_path / f"fake{len(flags)}"
        codex_schema.generate(codex_bin, real, experimental=bool(flags))
        subprocess.run(
            [
                FAKE_CODEX,
                "app-server",
                "--codex-version",
                version,
                "generate-json-schema",
                *flags,
                "--out",
                str(fake),
            ],
            check=True,
            timeout=60,
        )
        definitions = codex_schema.read_bundle(real)
        for name, key in protocol.PARAM_FILES.items():
            written = json.loads((fake / f"{name}.json").read_text(encoding="utf-8"))
            assert set(written["properties"]) == set(definitions[key]["properties"]), name
            assert written.get("required", []) == sorted(definitions[key].get("required", []))
