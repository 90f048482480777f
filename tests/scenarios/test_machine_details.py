"""Recordings and cassettes a team can commit: nothing in them names the machine that
made them (its folders, host name, OS and kernel, process ids, software versions).
Cassettes hold placeholders (`${tmp}`, `${home}`, ...) where the machine was; a replay
matches any value there and serves back the host's own (scenarios/README.md, "Cassettes
carry no machine").

The first tests need no process; the next record cassettes from a bridge over
fake-codex; the last (`real_codex`) record from each codex of the tested window.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from scenarios.cassette import FORMAT, Cassette, CassetteError, record_cassette
from scenarios.format import load_scenario
from scenarios.record import record_scenario
from scenarios.respx_mock import MAX_PLACEHOLDER_CHARS, ScenarioRouter
from scenarios.runner import RunOptions
from scenarios.scrub import PLACEHOLDERS, Scrubber, escape, fill, pattern, rewrite

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "scenarios" / "library"
#: A cassette as the recorder of format 1 wrote it (its folder rewritten to a made-up
#: user's), kept to show that older cassettes replay, and that the check below sees
#: what they name.
FORMAT_1 = Path(__file__).parent / "data" / "format-1"
FORMAT_1_CASSETTE = FORMAT_1 / "cassettes" / "where.yaml"
#: Folders of the repository that hold no recording of the project's own.
NOT_SCANNED = {".git", ".venv", ".codex-npm", "node_modules", ".mypy_cache", ".ruff_cache"}

_TEMPORARY = re.compile(r"(?<![\w.$}-])/(?:tmp|var/tmp|var/folders|private/var)/")
_HOME = re.compile(r"(?<![\w.$}-])/(?:root|home/(?!codex\b)[\w.-]+|Users/[\w.-]+)(?=/|\b)")
_USER_AGENT = re.compile(r"userAgent\W+[^\s\"']+ \((?!os; arch\))[^()\"]*;[^()\"]*\)")
_SERVER = re.compile(r"\bServer: \[?(Python|aiohttp)", re.IGNORECASE)
_PROCESS_ID = re.compile(r"\b(?:processId|pid)\W+(?!100\d\b)\d{2,}")


def machine_details(text: str) -> list[str]:
    """What `text` (a recording or a cassette) says of the machine that made it."""
    found = [f"a temporary folder: {m.group(0)!r}" for m in _TEMPORARY.finditer(text)]
    found += [f"a home folder: {m.group(0)!r}" for m in _HOME.finditer(text)]
    found += [f"the OS in a userAgent: {m.group(0)!r}" for m in _USER_AGENT.finditer(text)]
    found += [f"the server's versions: {m.group(0)!r}" for m in _SERVER.finditer(text)]
    found += [f"a process id: {m.group(0)!r}" for m in _PROCESS_ID.finditer(text)]
    uname = os.uname()
    for what, detail in (("kernel", uname.release), ("kernel build", uname.version)):
        if detail in text:
            found.append(f"this machine's {what} {detail!r}")
    host = socket.gethostname()
    if re.search(rf"(\"|: ){re.escape(host)}(\"|$)", text, re.MULTILINE):
        found.append(f"this machine's host name {host!r}")
    return found


def committed() -> list[Path]:
    """The recordings and cassettes in the repository."""
    files = []
    for path in ROOT.rglob("*.y*ml"):
        if NOT_SCANNED & set(path.relative_to(ROOT).parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        recording = text.startswith("# Recorded by `rest-bridge scenarios record`")
        cassette = path.parent.name == "cassettes" or "\ninteractions:" in text
        if recording or cassette:
            files.append(path)
    return files


@pytest.mark.quick
def test_no_committed_recording_or_cassette_names_the_machine_that_made_it() -> None:
    files = committed()
    assert LIBRARY / "real-codex-scripted-model-replay.scenario.yaml" in files
    assert FORMAT_1_CASSETTE in files
    named = {
        str(path.relative_to(ROOT)): details
        for path in files
        if path != FORMAT_1_CASSETTE
        and (details := machine_details(path.read_text(encoding="utf-8")))
    }
    assert named == {}
    # The check sees what an older cassette keeps: the folder of the run, the server.
    old = " ".join(machine_details(FORMAT_1_CASSETTE.read_text(encoding="utf-8")))
    assert "a home folder: '/home/alice'" in old
    assert "the server's versions" in old


@pytest.mark.quick
def test_the_check_finds_each_kind_of_machine_detail() -> None:
    uname = os.uname()
    named = {
        "cwd: /tmp/pytest-of-me/x/work": "a temporary folder",
        '"path":"/var/folders/xy/T/run"': "a temporary folder",
        "codexHome: /root/.codex": "a home folder",
        '"cwd":"/home/alice/project"': "a home folder",
        "cwd: /Users/bob/src": "a home folder",
        "userAgent: codex_rest_bridge/0.169.0 (Debian 12; x86_64) xterm (c; 1)": "userAgent",
        '"userAgent":"c/1 (Mac OS 15.1; arm64) iTerm.app (c; 1)"': "userAgent",
        "Server: [Python/3.11 aiohttp/3.14.5]": "the server's versions",
        '"processId":"36160"': "a process id",
        f"kernel {uname.release}": "kernel",
        f'"serverName":"{socket.gethostname()}"': "host name",
    }
    for text, what in named.items():
        assert any(what in detail for detail in machine_details(text)), text
    clean = (
        "codexHome: /home/codex/.codex\ncwd: ${cwd}\npath: ${tmp}/work\nhome: ${home}/.codex\n"
        "userAgent: codex_rest_bridge/0.169.0 (os; arch) terminal (codex_rest_bridge; 0.1.0)\n"
        "command: \"/bin/bash -lc 'touch it'\"\nprocessId: '1001'\nserverName: ${host}\n"
    )
    assert machine_details(clean) == []


@pytest.mark.quick
def test_placeholders_are_written_matched_and_filled_exactly() -> None:
    scrubber = Scrubber({"/run/x": "tmp", "/run/x/home": "home", "/src": "scenarioDir"}, "box")
    said = (
        '{"cwd":"/run/x/work","codexHome":"/run/x/home/.codex","other":"/run/xy",'
        '"script":"/src/a.scenario.yaml","serverName":"box","boxed":"box2",'
        '"literal":"${tmp} $${home} $ref $5","processId":"4242","pid":4242,'
        '"userAgent":"c/1 (Linux 6.1; x86_64) xterm fake-codex/1 (c; 1)",'
        '"url":"file:///run/x/a","inside":"/y.d/run/x/a"}'
    )
    written = scrubber.text(said)
    assert written == (
        '{"cwd":"${tmp}/work","codexHome":"${home}/.codex","other":"/run/xy",'
        '"script":"${scenarioDir}/a.scenario.yaml","serverName":"${host}","boxed":"box2",'
        '"literal":"$${tmp} $$${home} $ref $5","processId":"1001","pid":1001,'
        '"userAgent":"c/1 (os; arch) terminal fake-codex/1 (c; 1)",'
        '"url":"file://${tmp}/a","inside":"/y.d/run/x/a"}'
    )
    values = {"tmp": '/my "work"', "home": "/h", "scenarioDir": "/s", "prefix": "/p"}
    served = fill(written, {**values, "host": "localhost"})
    assert '"cwd":"/my \\"work\\"/work"' in served  # JSON-escaped where it stands
    assert '"literal":"${tmp} $${home} $ref $5"' in served  # the literal given back
    # Escaping then filling gives back any text, whatever its dollars.
    for text in ("$", "$$", "${tmp}", "$${tmp}", "$$$${home}x${", "${other} $tmp {tmp}"):
        assert fill(escape(text), {}) == text
    # A placeholder matches any value, the same one each time it comes back.
    found = pattern("${tmp}/work:${tmp}/log $${tmp}").fullmatch("/a b/work:/a b/log ${tmp}")
    assert found is not None
    assert found.group("tmp") == "/a b"
    assert pattern("${tmp}/work:${tmp}/log").fullmatch("/a/work:/b/log") is None
    assert set(PLACEHOLDERS) == {"tmp", "home", "scenarioDir", "prefix", "host"}
    # The last placeholder takes the rest, so a folder may hold what follows it.
    assert pattern("${tmp}/work").fullmatch("/a/work/b/work").group("tmp") == "/a/work/b"


@pytest.mark.quick
@pytest.mark.timeout(10)
def test_a_host_cannot_make_placeholder_matching_take_forever() -> None:
    # A pattern free to go back tries every split of the value among the placeholders:
    # on half a megabyte, longer than the timeout by far. This one passes over it once.
    hostile = "a:" * 250_000
    assert pattern("${tmp}:${home}:${prefix}:${host}!").fullmatch(hostile) is None
    assert pattern("${tmp}:${home}:${tmp}!").fullmatch(hostile) is None


@pytest.mark.quick
def test_a_stream_scrubbed_part_by_part_keeps_its_marks_on_the_parts() -> None:
    body = 'id: 1\ndata: {"cwd":"/run/x/work"}\n\nid: 2\ndata: {"n":2}\n\n'
    second = body.index("id: 2")
    written, marks = rewrite(body, [[0, None], [second, 3]], Scrubber({"/run/x": "tmp"}).text)
    assert isinstance(written, str)
    assert marks == [[0, None], [written.index("id: 2"), 3]]
    assert written[: marks[1][0] or 0] == 'id: 1\ndata: {"cwd":"${tmp}/work"}\n\n'


def copy_scenario(source: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / (
        source.name.removesuffix(".yaml").removesuffix(".scenario") + ".scenario.yaml"
    )
    shutil.copy(source, target)
    return target


def this_machine(tmp_path: Path) -> list[str]:
    """Strings of this machine and this run a cassette must not hold."""
    details = [str(tmp_path), str(Path.home()) + "/", tempfile.gettempdir() + "/", str(ROOT)]
    details += [os.uname().release, f'"{socket.gethostname()}"']
    if sys.prefix != sys.base_prefix:
        details.append(sys.prefix)
    return details


@pytest.mark.asyncio
async def test_a_cassette_names_no_machine_and_holds_placeholders(tmp_path: Path) -> None:
    scenario = copy_scenario(LIBRARY / "routes-trusted.scenario.yaml", tmp_path / "project")
    cassette, _ = await record_cassette(load_scenario(scenario), RunOptions(tmp_root=tmp_path))
    text = cassette.dump()
    assert machine_details(text) == []
    for detail in this_machine(tmp_path):
        assert detail not in text, detail
    assert f"format: {FORMAT}" in text
    assert "codexHome" in text
    assert '"codexHome":"${home}/.codex"' in text
    assert '"cwd":"${tmp}/work"' in text
    assert '"serverName":"${host}"' in text
    assert "${scenarioDir}/routes-trusted.scenario.yaml" in text
    assert "(os; arch) terminal" in text
    # Saved and read back: the same file.
    cassette.save(tmp_path / "saved.yaml")
    assert Cassette.load(tmp_path / "saved.yaml").dump() == text


async def replay_where(cassette: Cassette, scenario: Path) -> None:
    """Replays the `where` scenario's cassette as a host working in its own folder would:
    its path is matched in place of the recorded one and served back."""
    with ScenarioRouter(load_scenario(scenario), cassette) as bridge:
        async with httpx.AsyncClient(base_url=bridge.base_url) as client:
            created = await client.post("/v1/sessions", json={})
            assert created.status_code == 201
            # Before the host has sent a path: the system's temporary folder.
            initialize = created.json()["initialize"]
            assert initialize["codexHome"] == f"{tempfile.gettempdir()}/work/codex-home"
            session = created.json()["sessionId"]
            params = {"cwd": '/elsewhere/my "project"/work', "note": "costs $5"}
            answer = await client.post(
                f"/v1/sessions/{session}/call/x/where", json={"params": params}
            )
            assert answer.status_code == 200, answer.text
            assert bridge.placeholders["tmp"] == '/elsewhere/my "project"'
            assert bridge.placeholders["home"] == str(Path.home())
            assert answer.json()["result"] == {
                "cwd": '/elsewhere/my "project"/work',
                "rollout": '/elsewhere/my "project"/work/sessions/rollout.jsonl',
                "price": "${tmp} and $5",
            }


@pytest.mark.asyncio
async def test_a_replay_matches_any_folder_and_serves_back_the_hosts_own(
    tmp_path: Path,
) -> None:
    scenario = copy_scenario(FORMAT_1 / "where.yaml", tmp_path / "project")
    cassette, _ = await record_cassette(load_scenario(scenario), RunOptions(tmp_root=tmp_path))
    text = cassette.dump()
    assert '"cwd":"${tmp}/work"' in text
    assert "$${tmp} and $5" in text
    await replay_where(cassette, scenario)


@pytest.mark.asyncio
async def test_a_host_value_too_long_for_a_path_matches_but_is_not_served_back(
    tmp_path: Path,
) -> None:
    scenario = copy_scenario(FORMAT_1 / "where.yaml", tmp_path / "project")
    cassette, _ = await record_cassette(load_scenario(scenario), RunOptions(tmp_root=tmp_path))
    long = "/" + "x" * MAX_PLACEHOLDER_CHARS
    with ScenarioRouter(load_scenario(scenario), cassette) as bridge:
        async with httpx.AsyncClient(base_url=bridge.base_url) as client:
            session = (await client.post("/v1/sessions", json={})).json()["sessionId"]
            params = {"cwd": f"{long}/work", "note": "costs $5"}
            answer = await client.post(
                f"/v1/sessions/{session}/call/x/where", json={"params": params}
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["result"]["cwd"] == f"{tempfile.gettempdir()}/work"
            assert bridge.placeholders["tmp"] == tempfile.gettempdir()


@pytest.mark.asyncio
async def test_a_cassette_written_before_placeholders_still_replays(tmp_path: Path) -> None:
    scenario = copy_scenario(FORMAT_1 / "where.yaml", tmp_path)
    old = Cassette.load(FORMAT_1_CASSETTE)
    # Read as if written today: its folder is a placeholder, its literal `${tmp}` escaped.
    assert "/home/alice" not in old.dump()
    assert machine_details(old.dump()) == ["the server's versions: 'Server: [Python'"] * 2
    await replay_where(old, scenario)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("format: 1", "format: 99"), "cassette format 99 is newer than this tool reads"),
        (("format: 1", "format: '2'"), r"not a cassette of this tool \(TypeError"),
        (("string: '{", "string: 5\n      was: '{"), "a body of POST /v1/sessions is not text"),
        (("tmp: /home", "tmp: [/home"), "not a cassette of this tool"),
    ],
)
def test_a_cassette_that_cannot_be_read_is_one_error_naming_it(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    odd = tmp_path / "odd.yaml"
    text = FORMAT_1_CASSETTE.read_text(encoding="utf-8")
    assert change[0] in text
    odd.write_text(text.replace(change[0], change[1], 1))
    with pytest.raises(CassetteError, match=message) as raised:
        Cassette.load(odd)
    assert "regenerate it: python -m scenarios.cassette record" in str(raised.value)


@pytest.mark.real_codex
@pytest.mark.asyncio
async def test_recordings_of_the_real_codex_name_no_machine(codex_bin: str, tmp_path: Path) -> None:
    scenario = copy_scenario(LIBRARY / "real-codex-scripted-model.scenario.yaml", tmp_path / "p")
    loaded = load_scenario(scenario)
    cassette, _ = await record_cassette(loaded, RunOptions(tmp_root=tmp_path, codex=codex_bin))
    text = cassette.dump()
    assert machine_details(text) == []
    for detail in this_machine(tmp_path):
        assert detail not in text, detail
    assert '"codexHome":"${tmp}/codex-home"' in text
    # codex's login shell ran with an empty HOME: no dotfile of this machine spoke.
    assert "pyenv" not in text
    assert "rehash" not in text
    recording = await record_scenario(loaded, None, codex=codex_bin, verify=False)
    assert machine_details(recording.text) == []
