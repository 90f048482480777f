"""fake-codex's protocol profiles: generated from real codex binaries, never by hand.

The drift test regenerates the profile of the installed real codex and compares it with
the one the fake ships (its method lists and its messages' shapes); it fails on the day
a profile no longer says what that release says (run
`python -m fakes.app_server.protocol CODEX_BINARY` to regenerate)."""

from __future__ import annotations

import pytest

from bridge import codex_window
from fakes.app_server import protocol


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
