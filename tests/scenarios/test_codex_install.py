"""Finding the pinned real codex: the native binary first, the Node launcher second."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge import codex_window
from scenarios.codex_install import native_relative_path, pinned_codex
from scenarios.harness import find_codex

ROOT = Path(__file__).resolve().parents[2]


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.mark.quick
@pytest.mark.parametrize(
    ("system", "machine", "expected"),
    [
        ("linux", "x86_64", "@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"),
        (
            "linux",
            "aarch64",
            "@openai/codex-linux-arm64/vendor/aarch64-unknown-linux-musl/bin/codex",
        ),
        ("linux", "arm64", "@openai/codex-linux-arm64/vendor/aarch64-unknown-linux-musl/bin/codex"),
        ("darwin", "arm64", "@openai/codex-darwin-arm64/vendor/aarch64-apple-darwin/bin/codex"),
        ("darwin", "x86_64", "@openai/codex-darwin-x64/vendor/x86_64-apple-darwin/bin/codex"),
        ("win32", "AMD64", "@openai/codex-win32-x64/vendor/x86_64-pc-windows-msvc/bin/codex.exe"),
    ],
)
def test_the_native_binary_path_follows_the_launchers_table(
    system: str, machine: str, expected: str
) -> None:
    assert native_relative_path(system, machine) == Path(expected)


@pytest.mark.quick
def test_a_platform_the_package_does_not_ship_has_no_native_path() -> None:
    assert native_relative_path("linux", "riscv64") is None


@pytest.mark.quick
def test_the_native_binary_is_preferred_over_the_launcher(tmp_path: Path) -> None:
    npm = tmp_path / ".codex-npm"
    launcher = _executable(npm / "node_modules" / ".bin" / "codex")
    relative = native_relative_path()
    assert relative is not None, "this test runs on a platform the package ships"
    fallback = pinned_codex(npm)
    assert fallback is not None
    assert fallback[0] == str(launcher)
    assert "Node launcher" in str(fallback[1])
    native = _executable(npm / "node_modules" / relative)
    assert pinned_codex(npm) == (str(native), None)


@pytest.mark.quick
def test_each_release_of_the_window_is_found_in_its_own_folder(tmp_path: Path) -> None:
    npm = tmp_path / ".codex-npm"
    relative = native_relative_path()
    assert relative is not None
    flat = _executable(npm / "node_modules" / relative)
    natives = {
        version: _executable(npm / version / "node_modules" / relative)
        for version in codex_window.TESTED
    }
    for version, native in natives.items():
        assert pinned_codex(npm, version) == (str(native), None)
    # The pin, when none is named: its own folder before a flat install of old.
    assert pinned_codex(npm) == (str(natives[codex_window.PIN]), None)
    assert pinned_codex(npm, "0.1.0") is None
    assert str(flat) != pinned_codex(npm)[0]  # type: ignore[index]


@pytest.mark.quick
def test_nothing_installed_is_none(tmp_path: Path) -> None:
    assert pinned_codex(tmp_path / ".codex-npm") is None


@pytest.mark.quick
def test_find_codex_picks_the_native_binary_of_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CODEX_BIN", raising=False)
    npm = tmp_path / ".codex-npm" / "node_modules"
    _executable(npm / ".bin" / "codex")
    relative = native_relative_path()
    assert relative is not None
    native = _executable(npm / relative)
    assert find_codex(None, root=tmp_path) == str(native)


def test_the_makefile_helper_prints_the_native_binary(tmp_path: Path) -> None:
    relative = native_relative_path()
    assert relative is not None
    native = _executable(tmp_path / "node_modules" / relative)
    printed = subprocess.run(
        [sys.executable, "-m", "scenarios.codex_install", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert printed.stdout.strip() == str(native)


def test_the_makefile_helper_says_when_no_codex_is_installed(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "scenarios.codex_install", str(tmp_path / ".codex-npm")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert f"no codex {codex_window.PIN} installed in {tmp_path / '.codex-npm'}/" in done.stderr
    assert "make codex" in done.stderr


def _npm_global(prefix: Path, native_at: str | None) -> Path:
    """A global npm install of @openai/codex under `prefix` (bin/codex links to the
    launcher), its platform package hoisted beside it, nested in it, or missing."""
    package = prefix / "lib" / "node_modules" / "@openai" / "codex"
    _executable(package / "bin" / "codex.js")
    relative = native_relative_path()
    assert relative is not None
    if native_at == "hoisted":
        _executable(package.parent.parent / relative)
    elif native_at == "nested":
        _executable(package / "node_modules" / relative)
    link = prefix / "bin" / "codex"
    link.parent.mkdir(parents=True)
    link.symlink_to(package / "bin" / "codex.js")
    return link


@pytest.mark.quick
@pytest.mark.parametrize("native_at", ["hoisted", "nested"])
def test_a_codex_installed_elsewhere_runs_the_native_binary_beside_its_launcher(
    tmp_path: Path, native_at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _npm_global(tmp_path / "npm", native_at)
    found = find_codex(str(launcher), root=tmp_path)
    assert found is not None
    assert found.endswith(str(native_relative_path())), found
    monkeypatch.setenv("PATH", str(launcher.parent))
    monkeypatch.delenv("CODEX_BIN", raising=False)
    monkeypatch.chdir(tmp_path)
    assert find_codex(None, root=tmp_path) == found  # found on PATH


@pytest.mark.quick
def test_without_the_native_binary_the_launcher_is_used_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    launcher = _npm_global(tmp_path / "npm", None)
    assert find_codex(str(launcher), root=tmp_path) == str(launcher)
    note = capsys.readouterr().err
    assert f"note: using the Node launcher {launcher}: no native codex binary" in note


@pytest.mark.quick
def test_a_codex_that_is_not_the_npm_launcher_is_run_as_given(tmp_path: Path) -> None:
    codex = _executable(tmp_path / "bin" / "codex")
    assert find_codex(str(codex), root=tmp_path) == str(codex)
