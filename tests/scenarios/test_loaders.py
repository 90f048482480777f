"""The three loaders of YAML files (scenario files, fake-codex scripts, cassettes) share
one parser: what it can read but not build, and a key given twice, are one error naming
the file, line and column, of the loader's own kind; and a few hundred mutated documents
raise nothing else."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from fakes.app_server.script import ScriptError, load_script
from fakes.model_provider import ModelScript
from scenarios.cassette import Cassette, CassetteError
from scenarios.format import ScenarioError, load_scenario

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCENARIO = (ROOT / "scenarios" / "library" / "approval-long-poll.scenario.yaml").read_text()
CASSETTE = ROOT / "tests" / "scenarios" / "data" / "format-1" / "cassettes" / "where.yaml"
SCRIPT = textwrap.dedent(
    """\
    version: 1
    seed: 7
    methods:
      model/list: {result: {data: []}}
    turns:
      - steps:
          - agentMessage: {text: hi, deltas: 2}
          - commandApproval: {command: ls}
            onReply:
              accept: [{agentMessage: done}]
    """
)

MODEL = textwrap.dedent(
    """\
    defaultText: Done.
    replies:
      - text: hi
      - execCommand: {command: [ls, -l]}
      - httpError: {status: 500}
    """
)

#: Each loader, with the kind of error it promises.
LOADERS: dict[str, tuple[Callable[[Path], object], type[Exception]]] = {
    "scenario": (load_scenario, ScenarioError),
    "script": (load_script, ScriptError),
    "cassette": (Cassette.load, CassetteError),
    "model": (ModelScript.load, ScriptError),
}
#: What YAML resolves to a type it then cannot build.
UNBUILDABLE = {"a long integer": "9" * 5000, "a 13th month": "2020-13-45", "Feb 30": "2020-02-30"}


def _documents() -> dict[str, str]:
    return {
        "scenario": SCENARIO,
        "script": SCRIPT,
        "cassette": CASSETTE.read_text(),
        "model": MODEL,
    }


#: What YAML builds and no JSON line can carry (found by a re-test: each failed only
#: when the fake or the runner came to send it).
NOT_JSON = {
    "bytes": ('!!binary "////"', "a YAML binary is not a JSON value"),
    "a set": ("!!set {a, b}", "a YAML set is not a JSON value"),
    "an integer key": ("{1: a}", "the key '1' reads as a YAML int"),
    "a null key": ("{~: a}", "the key '~' reads as a YAML null"),
}
#: Each odd value, what it is written as and what its error says.
ODD = {**{name: (text, "quote it") for name, text in UNBUILDABLE.items()}, **NOT_JSON}


@pytest.mark.quick
@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("value", sorted(ODD))
def test_a_value_yaml_cannot_build_or_json_cannot_carry_is_one_error_at_its_line_and_column(
    tmp_path: Path, loader: str, value: str
) -> None:
    load, kind = LOADERS[loader]
    written, said = ODD[value]
    path = tmp_path / f"odd.{loader}.yaml"
    path.write_text(f"x: 1\ny:\n  - {written}\n" + _documents()[loader])
    with pytest.raises(kind) as raised:
        load(path)
    assert f"{path}:3:{6 if value.endswith('key') else 5}: invalid YAML:" in str(raised.value)
    assert said in str(raised.value)
    assert type(raised.value) is kind


@pytest.mark.quick
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_key_given_twice_is_refused_at_the_second(tmp_path: Path, loader: str) -> None:
    load, kind = LOADERS[loader]
    path = tmp_path / f"twice.{loader}.yaml"
    path.write_text(_documents()[loader] + "zz: {a: 1,\n  a: 2}\n")
    lines = path.read_text().count("\n")
    with pytest.raises(kind) as raised:
        load(path)
    assert f"{path}:{lines}:3: invalid YAML: the key 'a' is given twice" in str(raised.value)
    assert f"(first on line {lines - 1})" in str(raised.value)


@pytest.mark.quick
def test_a_merge_key_is_not_a_key_given_twice(tmp_path: Path) -> None:
    path = tmp_path / "merged.yaml"
    path.write_text(
        "version: 1\nmethods:\n  a/b: &reply {result: 1}\n  c/d: {<<: *reply, result: 2}\n"
    )
    assert load_script(path).methods["c/d"][0].result == 2


DUPLICATED = {
    "two expects in a step": (
        """
        scenario: 1
        steps:
          - http: {path: /health}
            expect: {status: 200}
            expect: {status: 500}
        """,
        ":6:5:",
        "'expect'",
    ),
    "two http keys": (
        """
        scenario: 1
        steps:
          - http: {path: /health}
            http: {path: /v1/health}
        """,
        ":5:5:",
        "'http'",
    ),
    "two model/list entries": (
        """
        scenario: 1
        appServer:
          version: 1
          methods:
            model/list: {result: {data: [a]}}
            model/list: {result: {data: [b]}}
        steps:
          - http: {path: /health}
        """,
        ":7:5:",
        "'model/list'",
    ),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", sorted(DUPLICATED))
def test_the_duplicates_found_by_a_stranger_are_refused(tmp_path: Path, case: str) -> None:
    text, where, key = DUPLICATED[case]
    path = tmp_path / "dup.scenario.yaml"
    path.write_text(textwrap.dedent(text))  # `scenario: 1` on line 2
    with pytest.raises(ScenarioError) as raised:
        load_scenario(path)
    assert f"{path}{where} invalid YAML: the key {key} is given twice" in str(raised.value)


def _mutate(text: str, rng: random.Random) -> str:
    """`text` with a few random edits of the kinds a hand or a fuzzer makes."""
    pieces = [
        "9" * 5000, "2020-13-45", "&a [*a]", "*nope", "{", "]", ": ", "- ", "!!binary x",
        "\t", "  ", "\n", "'", '"', "~", "true", "1e999", "0x", "<<: 1", "? [1]", "!!set",
        "{a: 1, a: 2}", "[1]", "-1", "null", "\x00", "é", "\u0660.\u0661", "&b", "*b",
    ]  # fmt: skip
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(text) + 1)
        how = rng.randrange(4)
        if how == 0:
            text = text[:at] + rng.choice(pieces) + text[at:]
        elif how == 1:
            text = text[:at] + text[at + rng.randint(1, 20) :]
        elif how == 2:
            lines = text.splitlines(keepends=True)
            if len(lines) > 1:
                i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
                lines[i], lines[j] = lines[j], lines[i]
                text = "".join(lines)
        else:
            end = at + rng.randint(1, 8)
            text = text[:at] + rng.choice(pieces) + text[end:]
    return text


@pytest.mark.quick
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_mutated_documents_load_or_fail_with_the_loaders_own_error(
    tmp_path: Path, loader: str
) -> None:
    """Deterministic (seeded), and cheap: 300 documents per loader."""
    load, kind = LOADERS[loader]
    rng = random.Random(f"loaders-{loader}")
    original = _documents()[loader]
    path = tmp_path / f"fuzzed.{loader}.yaml"
    for _ in range(300):
        text = _mutate(original, rng)
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        problem: Exception | None = None
        try:
            load(path)
        except Exception as exc:
            problem = exc
        if problem is not None:
            shown = f"{type(problem).__name__}: {problem}\n--- the document:\n{text}"
            assert type(problem) is kind, shown
            assert str(path) in str(problem), shown


def test_a_model_script_that_is_not_one_stops_the_model_server_naming_its_line(
    tmp_path: Path,
) -> None:
    script = tmp_path / "model.yaml"
    script.write_text("replies:\n  - text: hi\n  - txt: hi\n")
    done = _run(sys.executable, "-m", "fakes.model_provider", "--script", str(script), cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert f"{script}:3:5: replies[1]: a reply needs one of: text" in done.stderr
    assert "Traceback" not in done.stderr


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )


def test_the_commands_refuse_an_unbuildable_value_naming_the_line_with_their_exit_status(
    tmp_path: Path,
) -> None:
    script = tmp_path / "big.yaml"
    script.write_text(f"version: 1\nseed: {'9' * 5000}\n")
    done = _run(str(BIN / "fake-codex"), "app-server", "--script", str(script), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"{script}:2:7: invalid YAML" in done.stderr
    assert "Traceback" not in done.stderr

    (tmp_path / "h.scenario.yaml").write_text("scenario: 1\nsteps:\n  - http: {path: /health}\n")
    (tmp_path / "cassettes").mkdir()
    for body, shown in [
        (
            "version: 1\ncodex: [1]\ninteractions: []\n",
            "cassettes/h.yaml:2:1: not a cassette of this tool (AttributeError",
        ),
        ("version: 1\ncodex: {hash: 2020-13-45}\ninteractions: []\n", ":2:15: invalid YAML"),
    ]:
        (tmp_path / "cassettes" / "h.yaml").write_text(body)
        done = _run(
            str(BIN / "rest-bridge"), "scenarios", "replay", "cassettes/h.yaml", cwd=tmp_path
        )
        assert done.returncode == 2, done.stderr
        assert shown in done.stderr
        assert "Traceback" not in done.stderr
