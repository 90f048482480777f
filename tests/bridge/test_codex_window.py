"""The support window (bridge/codex_window.py): what the bridge says of the app-server it
fronts, at start-up and in `/v1/compatibility`. The real codex's side is in
tests/e2e/test_real_codex.py; here fake-codex plays releases inside and outside it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge import codex_window
from bridge.app import trusted_bridge_app
from scenarios.harness import fake_app_server_command

REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = "codex-cli 0.150.0"


@pytest.mark.quick
def test_the_window_is_named_once_and_holds_the_pin() -> None:
    assert codex_window.PIN in codex_window.TESTED
    assert list(codex_window.TESTED) == sorted(
        codex_window.TESTED, key=lambda v: tuple(map(int, v.split(".")))
    )
    assert all(codex_window.release(f"codex-cli {v}") == v for v in codex_window.TESTED)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("version", "tested"),
    [
        (f"codex-cli {codex_window.TESTED[-1]}", True),
        (OUTSIDE, False),
        ("codex-cli 0.171.0-alpha.2", False),
        ("something else 1.0", None),
        (None, None),
    ],
)
def test_a_version_line_is_inside_the_window_or_not_or_unknown(
    version: str | None, tested: bool | None
) -> None:
    assert codex_window.is_tested(version) is tested
    warning = codex_window.warning(version)
    if tested:
        assert warning is None
    else:
        assert warning is not None
        assert "\n" not in warning
        assert codex_window.window() in warning


@pytest.mark.quick
@pytest.mark.parametrize(
    ("user_agent", "kind", "release"),
    [
        ("app/0.171.0 (Debian 12.0.0; x86_64) xterm (app; 1.0)", "codex", "0.171.0"),
        (
            "app/0.169.0 (Linux 6.1.0; x86_64) xterm fake-codex/0.169.0 (app; 1.0)",
            "fake-codex",
            "0.169.0",
        ),
        ("ws/1", "codex", None),
        (None, None, None),
    ],
)
def test_the_user_agent_tells_the_fake_from_codex_and_names_a_release(
    user_agent: str | None, kind: str | None, release: str | None
) -> None:
    assert codex_window.kind(user_agent) == kind
    assert codex_window.agent_release(user_agent) == release


@pytest.mark.quick
def test_an_app_server_known_only_by_its_user_agent_is_judged_by_the_release_it_names() -> None:
    assessed = codex_window.assess(None, "app/0.150.0 (Linux; x86_64) xterm (app; 1)")
    assert assessed["tested"] is False
    assert assessed["warning"] is not None
    assert "codex-cli 0.150.0" in assessed["warning"]


@pytest.mark.quick
@pytest.mark.parametrize(
    ("output", "kind"),
    [
        (f"codex-cli {codex_window.PIN}", "codex"),
        (f"codex-cli {codex_window.PIN}\nfake-codex/{codex_window.PIN}\n", "fake-codex"),
        (f"{OUTSIDE}\nfake-codex/0.150.0", "fake-codex"),
        ("something else 1.0\nfake-codex/1.0", "fake-codex"),
        ("something else 1.0", None),
        ("", None),
        (None, None),
    ],
)
def test_a_version_probe_tells_the_fake_from_codex(output: str | None, kind: str | None) -> None:
    assert codex_window.version_kind(output) == kind


@pytest.mark.parametrize("version", [f"codex-cli {codex_window.PIN}", OUTSIDE])
def test_serve_says_at_start_that_the_app_server_is_fake_codex(
    banner, write_script, version: str
) -> None:
    """Before any `initialize` (which `/v1/compatibility` reads the kind from), the
    banner's app-server line already tells fake-codex from a real codex."""
    lines = banner(fake_app_server_command(write_script({"versionOutput": version})))
    described = [line for line in lines if line.startswith("  app-server: ")]
    assert len(described) == 1, lines
    assert f"{version}; kind: fake-codex" in described[0], lines


def test_a_version_with_control_characters_is_written_escaped(banner, write_script) -> None:
    """A terminal's escapes or a NUL in what `--version` prints reach the start-up lines
    escaped: they neither drive the terminal nor make grep take the output for binary."""
    version = "codex-cli \x1b[31mred\x00"
    lines = banner(fake_app_server_command(write_script({"versionOutput": version})))
    described = [line for line in lines if line.startswith("  app-server: ")]
    assert len(described) == 1, lines
    assert repr(version) in described[0], lines
    assert all(line.isprintable() for line in lines), lines


@pytest.mark.real_codex
def test_serve_says_at_start_that_a_real_codex_is_codex(
    banner, codex_bin: str, codex_version: str
) -> None:
    lines = banner([codex_bin, "app-server"])
    described = [line for line in lines if line.startswith("  app-server: ")]
    assert len(described) == 1, lines
    assert f"{codex_version}; kind: codex)" in described[0], lines


def test_the_fakes_version_line_is_the_releases_unless_a_bridge_asks_what_it_is() -> None:
    fake = str(Path(sys.executable).with_name("fake-codex"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CODEX")}
    plain = subprocess.run(
        [fake, "--version"], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert plain.stdout == f"codex-cli {codex_window.PIN}\n"
    asked = subprocess.run(
        [fake, "--version"],
        env={**env, codex_window.IDENTIFY_VARIABLE: "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert asked.stdout == f"codex-cli {codex_window.PIN}\nfake-codex/{codex_window.PIN}\n"


async def compatibility(http, base: str) -> dict:
    async with http.get(f"{base}/v1/compatibility") as response:
        assert response.status == 200
        body = await response.json()
    return body["appServer"]


@pytest.mark.asyncio
async def test_compatibility_says_a_release_outside_the_window_and_that_it_is_the_fake(
    serve, http, write_script
) -> None:
    command = fake_app_server_command(write_script({"versionOutput": OUTSIDE}))
    base = await serve(trusted_bridge_app(command))
    before = await compatibility(http, base)
    assert before["version"] == OUTSIDE
    assert before["tested"] is False
    assert before["testedVersions"] == list(codex_window.TESTED)
    assert before["warning"] == (
        f"{OUTSIDE} is outside the tested window ({codex_window.window()}); it may still work"
    )
    # No app-server has answered `initialize` yet: the `--version` probe tells, as in
    # `serve`'s start-up line.
    assert before["kind"] == "fake-codex"

    async with http.post(f"{base}/v1/sessions", json={}) as response:
        assert response.status == 201, await response.text()
    after = await compatibility(http, base)
    assert after["kind"] == "fake-codex"
    assert after["tested"] is False


@pytest.fixture
def banner(tmp_path: Path) -> Iterator:
    """`rest-bridge serve` on a command; returns its start-up lines, up to the one after
    the app-server's."""
    started: list[subprocess.Popen[str]] = []

    def start(command: list[str]) -> list[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
        process = subprocess.Popen(
            [REST_BRIDGE, "serve", "--port", "0", "--app-server", shlex.join(command)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        started.append(process)
        assert process.stdout is not None
        lines: list[str] = []
        for line in process.stdout:  # up to the line after the app-server's
            lines.append(line.rstrip("\n"))
            if len(lines) > 1 and lines[-2].startswith("  app-server: "):
                break
        return lines

    yield start
    for process in started:
        process.send_signal(signal.SIGTERM)
        assert process.communicate(timeout=60)[0] is not None
        assert process.returncode == 0


@pytest.mark.parametrize("version", [f"codex-cli {codex_window.PIN}", OUTSIDE])
def test_serve_says_at_start_whether_the_app_server_is_a_tested_release(
    banner, write_script, version: str
) -> None:
    lines = banner(fake_app_server_command(write_script({"versionOutput": version})))
    window = [line for line in lines if line.startswith(("  tested: ", "  warning: "))]
    if version == OUTSIDE:
        assert window == [
            f"  warning: {OUTSIDE} is outside the tested window ({codex_window.window()}); "
            "it may still work"
        ], lines
    else:
        assert window == [
            f"  tested: {version} is a release this bridge is tested on ({codex_window.window()})"
        ], lines


@pytest.mark.asyncio
async def test_a_scripted_initialize_result_is_sent_as_written_and_reported_as_codex(
    serve, http, write_script
) -> None:
    """A recorded replay answers `initialize` with what the real codex said: the fake
    sends it as written, so the bridge reports that codex (docs/API.md)."""
    recorded = "codex_rest_bridge/0.150.0 (os; arch) terminal (codex_rest_bridge; 0.1.0)"
    script = {"initialize": {"result": {"userAgent": recorded, "codexHome": "/home/codex"}}}
    base = await serve(trusted_bridge_app(fake_app_server_command(write_script(script))))
    async with http.post(f"{base}/v1/sessions", json={}) as response:
        assert response.status == 201, await response.text()
    app_server = await compatibility(http, base)
    assert app_server["kind"] == "codex"
    assert app_server["version"] == f"codex-cli {codex_window.PIN}"  # `--version`, unscripted
    assert app_server["tested"] is True


def _npm_install(prefix: Path, native_script: str | None) -> Path:
    """A global npm install of codex under `prefix`: `bin/codex` linked to the package's
    Node launcher (which here only fails, so running it shows), and, unless None, this
    platform's native binary (a script) hoisted beside the package."""
    from bridge.codex_binary import native_relative_path

    package = prefix / "lib" / "node_modules" / "@openai" / "codex"
    launcher = package / "bin" / "codex.js"
    launcher.parent.mkdir(parents=True)
    launcher.write_text("#!/bin/sh\necho 'the launcher ran' >&2\nexit 3\n")
    launcher.chmod(0o755)
    relative = native_relative_path()
    assert relative is not None
    if native_script is not None:
        native = package.parent.parent / relative
        native.parent.mkdir(parents=True)
        native.write_text(native_script)
        native.chmod(0o755)
    link = prefix / "bin" / "codex"
    link.parent.mkdir(parents=True)
    link.symlink_to(launcher)
    return link


def test_serve_given_codex_npm_launcher_runs_the_native_binary_beside_it_and_says_so(
    banner, tmp_path: Path
) -> None:
    """`--app-server '.../bin/codex app-server'` of an npm install: the bridge runs the
    platform's native binary (here a script that runs fake-codex), not the Node launcher."""
    fake = shlex.join(fake_app_server_command()[:-1])  # `env ... fake-codex`
    link = _npm_install(tmp_path / "npm", f'#!/bin/sh\nexec {fake} "$@"\n')
    lines = banner([str(link), "app-server"])
    from bridge.codex_binary import native_relative_path

    native = str(native_relative_path())
    notes = [line for line in lines if "npm launcher" in line]
    assert len(notes) == 1, lines
    assert notes[0].startswith("  running the native codex binary "), notes
    assert native in notes[0], notes
    assert str(link) in notes[0], notes
    app_server = next(line for line in lines if line.startswith("  app-server: "))
    assert native in app_server, app_server
    assert "version unknown" not in app_server, app_server


def test_serve_given_codex_npm_launcher_without_a_native_binary_says_it_runs_the_launcher(
    banner, tmp_path: Path
) -> None:
    link = _npm_install(tmp_path / "npm", None)
    lines = banner([str(link), "app-server"])
    notes = [line for line in lines if "Node launcher" in line]
    assert len(notes) == 1, lines
    assert notes[0].startswith(f"  using the Node launcher {link}: no native codex binary"), notes
