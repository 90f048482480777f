"""`rest-bridge codex-diff`: the protocol's changes between two codex releases, and which
of a host's files use them. Quick tests compare small bundles written here; the real
codex's own bundle is diffed against an edited copy of itself at the end."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge.cli import main

BUNDLE = "codex_app_server_protocol.schemas.json"


def _request(method: str, params: str) -> dict[str, Any]:
    return {
        "properties": {
            "id": {"type": "integer"},
            "method": {"enum": [method], "type": "string"},
            "params": {"$ref": f"#/definitions/v2/{params}"},
        },
        "required": ["id", "method", "params"],
    }


def _notification(method: str, params: str) -> dict[str, Any]:
    return {
        "properties": {
            "method": {"enum": [method], "type": "string"},
            "params": {"$ref": f"#/definitions/v2/{params}"},
        }
    }


def _bundle() -> dict[str, Any]:
    """A small protocol in codex's layout: message unions at the top, types under v2."""
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {
            "ClientRequest": {
                "oneOf": [
                    _request("thread/start", "ThreadStartParams"),
                    _request("thread/list", "ThreadListParams"),
                ]
            },
            "ServerRequest": {"oneOf": [_request("clock/read", "ClockReadParams")]},
            "ServerNotification": {"oneOf": [_notification("turn/completed", "Turn")]},
            "v2": {
                "ThreadStartParams": {
                    "type": "object",
                    "properties": {
                        "cwd": {"type": ["string", "null"]},
                        "model": {"type": "string"},
                    },
                },
                "ThreadStartResponse": {
                    "type": "object",
                    "properties": {"thread": {"$ref": "#/definitions/v2/Thread"}},
                    "required": ["thread"],
                },
                "ThreadListParams": {
                    "type": "object",
                    "properties": {"limit": {"type": "integer"}},
                },
                "ThreadListResponse": {"type": "object", "properties": {"data": {"type": "array"}}},
                "Thread": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "display": {"$ref": "#/definitions/v2/Display"},
                        "error": {"$ref": "#/definitions/v2/ErrorInfo"},
                    },
                    "required": ["id"],
                },
                "Display": {"type": "object", "properties": {"text": {"type": "string"}}},
                "ErrorInfo": {"type": "string", "enum": ["overloaded", "unauthorized"]},
                "Turn": {"type": "object", "properties": {"id": {"type": "string"}}},
                "ClockReadParams": {"type": "object", "properties": {}},
            },
        },
    }


def _write(folder: Path, bundle: dict[str, Any], stable: dict[str, Any] | None = None) -> str:
    folder.mkdir(parents=True)
    (folder / BUNDLE).write_text(json.dumps(bundle))
    if stable is not None:
        (folder / "stable").mkdir()
        (folder / "stable" / BUNDLE).write_text(json.dumps(stable))
    return str(folder)


def _newer(bundle: dict[str, Any]) -> dict[str, Any]:
    """The next release: one of each kind of change."""
    new = copy.deepcopy(bundle)
    defs = new["definitions"]
    v2 = defs["v2"]
    defs["ClientRequest"]["oneOf"].append(_request("project/rename", "ProjectRenameParams"))
    v2["ProjectRenameParams"] = {"type": "object", "properties": {"name": {"type": "string"}}}
    defs["ServerRequest"]["oneOf"] = []  # clock/read removed
    del v2["ClockReadParams"]
    v2["ThreadStartParams"]["properties"]["workingDirectory"] = v2["ThreadStartParams"][
        "properties"
    ].pop("cwd")
    v2["ThreadStartParams"]["required"] = ["model"]
    v2["ThreadListParams"]["properties"]["archived"] = {"type": "boolean"}
    v2["ErrorInfo"]["enum"] = ["overloaded", "bioPolicy"]
    v2["Display"] = {"oneOf": [{"type": "object", "properties": {"mode": {"enum": ["plain"]}}}]}
    return new


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["codex-diff", *argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.quick
def test_each_kind_of_change_is_named_and_marked_breaking_or_additive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path / "old", _bundle())
    new = _write(tmp_path / "new", _newer(_bundle()))
    status, out, _ = _run(capsys, old, new, "--json")
    report = json.loads(out)
    found = {(c["subject"], c["what"]): c["breaking"] for c in report["changes"]}
    assert found == {
        ("clock/read", "server request removed"): True,
        ("project/rename", "client request added"): False,
        ("v2/ClockReadParams", "type removed"): True,
        ("v2/ThreadStartParams", "field 'cwd' renamed to 'workingDirectory'"): True,
        ("v2/ThreadStartParams", "field 'model' is now required"): True,
        ("v2/ThreadListParams", "field 'archived' added"): False,
        ("v2/ErrorInfo", "value 'unauthorized' removed"): True,
        ("v2/ErrorInfo", "value 'bioPolicy' added"): False,
        ("v2/Display", "was an object, is now a union of variants"): True,
    }
    assert status == 1


@pytest.mark.quick
def test_the_same_protocol_twice_is_no_change_and_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path / "old", _bundle())
    same = _write(tmp_path / "same", _bundle())
    status, out, _ = _run(capsys, old, same)
    assert status == 0
    assert "0 changes, 0 breaking" in out


@pytest.mark.quick
def test_a_changed_description_is_no_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reworded = _bundle()
    reworded["definitions"]["v2"]["Thread"]["description"] = "Reworded."
    old = _write(tmp_path / "old", _bundle())
    new = _write(tmp_path / "new", reworded)
    assert _run(capsys, old, new)[0] == 0


@pytest.mark.quick
def test_a_host_file_is_flagged_only_for_what_reaches_the_methods_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """thread/start's result reaches Display and ErrorInfo through Thread, so a scenario
    that starts threads is hit; one that only lists them is hit only by the added field;
    one that names neither is untouched. The status follows the files given."""
    old = _write(tmp_path / "old", _bundle())
    new = _write(tmp_path / "new", _newer(_bundle()))
    starts = tmp_path / "starts.scenario.yaml"
    starts.write_text("steps:\n  - call: {session: a, method: thread/start, params: {}}\n")
    lists = tmp_path / "lists.json"
    lists.write_text(json.dumps({"request": {"body": {"method": "thread/list"}}}))
    neither = tmp_path / "health.scenario.yaml"
    neither.write_text("steps:\n  - health: {}\n")
    status, out, _ = _run(capsys, old, new, str(starts), str(lists), str(neither), "--json")
    uses = json.loads(out)["uses"]
    assert status == 1
    assert sorted(uses[str(neither)]) == []
    assert [c["what"] for c in uses[str(lists)]["thread/list"]] == ["field 'archived' added"]
    start_subjects = {c["subject"] for c in uses[str(starts)]["thread/start"]}
    assert start_subjects == {"v2/ThreadStartParams", "v2/Display", "v2/ErrorInfo"}

    assert _run(capsys, old, new, str(neither))[0] == 0
    # Only an addition reaches thread/list: not breaking.
    assert _run(capsys, old, new, str(lists), "--breaking-only")[0] == 0
    assert _run(capsys, old, new, str(lists))[0] == 1
    # A folder is walked for scenario files and cassettes.
    assert _run(capsys, old, new, str(tmp_path), "--breaking-only")[0] == 1


@pytest.mark.quick
def test_experimental_changes_are_marked_from_the_stable_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stable = copy.deepcopy(_bundle())
    stable["definitions"]["ServerRequest"]["oneOf"] = []
    del stable["definitions"]["v2"]["ClockReadParams"]
    old = _write(tmp_path / "old", _bundle(), stable)
    new = _write(tmp_path / "new", _newer(_bundle()), _newer(_bundle()))
    report = json.loads(_run(capsys, old, new, "--json")[1])
    experimental = {c["subject"] for c in report["changes"] if c["experimental"]}
    assert experimental == {"clock/read", "v2/ClockReadParams"}


@pytest.mark.quick
@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("0.1; rm -rf ~", "neither a codex binary, a version nor a folder"),
        ("@openai/codex@latest", "neither a codex binary, a version nor a folder"),
        ("no-such-codex-binary-here", "neither a codex binary, a version nor a folder"),
        ("echo", "(to use the 'echo' on PATH, give its path)"),
        ("\u0660.\u0661\u0667\u0661.\u0660", "neither a codex binary, a version nor a folder"),
        ("\U0001d7ce.\U0001d7cf.\U0001d7ce", "neither a codex binary, a version nor a folder"),
    ],
)
def test_what_is_not_a_binary_version_or_folder_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, says: str
) -> None:
    old = _write(tmp_path / "old", _bundle())
    status, out, err = _run(capsys, old, spec, "--cache", str(tmp_path / "cache"))
    assert status == 2
    assert says in err
    assert out == ""
    assert not (tmp_path / "cache").exists()


@pytest.mark.quick
@pytest.mark.parametrize(
    "rest", [("not a thing!",), ("",), ("BINARY", "missing.yaml"), ("BINARY", "FIFO")]
)
def test_every_argument_is_checked_before_the_first_binary_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rest: tuple[str, ...]
) -> None:
    """OLD is a binary that leaves a marker when run: a bad NEW or a missing FILES
    argument is refused with nothing run and no cache folder made."""
    marker = tmp_path / "ran"
    binary = tmp_path / "old.sh"
    binary.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    binary.chmod(0o755)
    argv = [str(binary) if arg == "BINARY" else arg for arg in rest]
    argv = [str(tmp_path / arg) if arg.endswith(".yaml") else arg for arg in argv]
    if "FIFO" in argv:  # reading it would wait for a writer forever
        os.mkfifo(tmp_path / "fifo")
        argv[argv.index("FIFO")] = str(tmp_path / "fifo")
    status, out, err = _run(capsys, str(binary), *argv, "--cache", str(tmp_path / "cache"))
    assert status == 2, err
    assert any(
        said in err
        for said in ("'not a thing!' is neither", "'' is neither", "no such file", "nor a folder")
    ), err
    assert out == ""
    assert not marker.exists()
    assert not (tmp_path / "cache").exists()


@pytest.mark.quick
def test_an_unreadable_bundle_or_missing_file_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path / "old", _bundle())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / BUNDLE).write_text("{not json")
    status, _, err = _run(capsys, old, str(broken))
    assert status == 2
    assert "cannot read" in err
    status, _, err = _run(capsys, old, old, str(tmp_path / "missing.yaml"))
    assert status == 2
    assert "no such file" in err


def test_a_real_codex_against_an_edited_copy_of_its_own_schema(
    codex_bin: str, tmp_path: Path
) -> None:
    """The pinned codex generates its bundle (with and without --experimental); a copy
    without `thread/start`'s `cwd` field is the NEW side. A scenario of the library that
    starts threads is hit, and the command's own output says so."""
    out = tmp_path / "real"
    for folder, extra in ((out, ["--experimental"]), (out / "stable", [])):
        subprocess.run(
            [codex_bin, "app-server", "generate-json-schema", "--out", str(folder), *extra],
            check=True,
            capture_output=True,
            env={"CODEX_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        )
    edited = tmp_path / "edited"
    for folder in (edited, edited / "stable"):
        source = out / folder.relative_to(edited) / BUNDLE
        bundle = json.loads(source.read_text())
        del bundle["definitions"]["v2"]["ThreadStartParams"]["properties"]["cwd"]
        folder.mkdir(parents=True)
        (folder / BUNDLE).write_text(json.dumps(bundle))
    library = Path(__file__).parents[2] / "scenarios" / "library"
    starts = library / "turn-stream-and-resume.scenario.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "codex-diff", codex_bin, str(edited), str(starts)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "v2/ThreadStartParams: field 'cwd' removed [breaking]" in done.stdout
    assert "1 change, 1 breaking" in done.stdout
    assert f"{starts}: uses what changed\n  thread/start\n" in done.stdout
    same = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "codex-diff", codex_bin, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert same.returncode == 0, same.stdout + same.stderr


def test_a_version_already_installed_in_the_cache_is_used_without_npm(
    codex_bin: str, tmp_path: Path
) -> None:
    """A version number names `CACHE/<version>/node_modules/.bin/codex`; once it is
    there, nothing is installed again (PATH here has no npm to install with)."""
    launcher = tmp_path / "cache" / "9.8.7" / "node_modules" / ".bin" / "codex"
    launcher.parent.mkdir(parents=True)
    launcher.symlink_to(codex_bin)
    codex_diff = [sys.executable, "-m", "bridge.cli", "codex-diff"]
    done = subprocess.run(
        [*codex_diff, "9.8.7", codex_bin, "--cache", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": str(tmp_path / "empty"), "HOME": str(tmp_path)},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 changes, 0 breaking" in done.stdout
    missing = subprocess.run(
        [*codex_diff, "9.8.8", codex_bin, "--cache", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": str(tmp_path / "empty"), "HOME": str(tmp_path)},
        check=False,
    )
    assert missing.returncode == 2
    assert "installing codex 9.8.8 needs npm, which is not on PATH" in missing.stderr
