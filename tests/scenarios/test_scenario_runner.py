"""`rest-bridge scenarios run` (pytest with the plugin): the library passes, broken
scenarios say what and where, pytest's options work."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from front_here import run_here
from processes import live_children, marked_processes, quiet_pytest

from scenarios import harness
from scenarios.cli import SCENARIOS_ONLY, pytest_arguments
from scenarios.format import load_scenario, parse_scenario
from scenarios.runner import RunOptions, run_scenario_sync

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "scenarios" / "library"
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))

pytest_plugins = ["pytester"]


def run_cli(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [REST_BRIDGE, "scenarios", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=quiet_pytest({**os.environ, **env}),
        timeout=300,
        check=False,
    )


def test_a_checkout_with_the_harness_extra_alone_runs_its_library() -> None:
    """In this checkout, with neither pytest-timeout nor pytest-rerunfailures (the `test`
    extra's), as after `pip install -e '.[harness]'`: the checkout's pytest configuration
    names no option of theirs, so pytest does not stop on an unknown one."""
    scenario = LIBRARY / "auth-rejection.scenario.yaml"
    done = run_cli("run", str(scenario), "-n", "2", "-p", "no:timeout", "-p", "no:rerunfailures")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout, done.stdout
    assert "INTERNALERROR" not in done.stdout + done.stderr


def test_a_directory_whose_pytest_configuration_needs_a_missing_plugin_still_runs(
    pytester: pytest.Pytester,
) -> None:
    """A host folder whose configuration sets pytest-timeout's `timeout` and makes pytest's
    warnings errors, run without pytest-timeout: the unknown option is a warning, not an
    INTERNALERROR (it was, before the run ever started)."""
    (pytester.path / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\ntimeout = 5\nfilterwarnings = ["error::pytest.PytestWarning"]\n'
    )
    shutil.copy(LIBRARY / "auth-rejection.scenario.yaml", pytester.path)
    done = run_here(pytester, "run", "auth-rejection.scenario.yaml", "-p", "no:timeout")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout, done.stdout
    assert "Unknown config option: timeout" in done.stdout, done.stdout


def test_the_codex_path_with_a_space_or_an_equals_sign_gives_the_same_ids(
    pytester: pytest.Pytester,
) -> None:
    """`--codex PATH`, as documented, once made pytest take PATH for a path to test, so
    another rootdir (ids like `../../x::name`, JUnit `classname=""`)."""
    tmp_path = pytester.path
    shutil.copy(LIBRARY / "auth-rejection.scenario.yaml", tmp_path)
    codex = sys.executable  # never run: the scenario does not need the real codex
    seen = []
    for spelling in (["--codex", codex], [f"--codex={codex}"]):
        junit = tmp_path / "junit.xml"
        args = ["auth-rejection.scenario.yaml", *spelling, "-v", "--junitxml", str(junit)]
        done = run_here(pytester, "run", *args)
        assert done.returncode == 0, done.stdout + done.stderr
        case = ET.parse(junit).getroot().find("testsuite/testcase")
        assert case is not None
        seen.append(
            (f"rootdir: {tmp_path}" in done.stdout, case.get("classname"), case.get("name"))
        )
        assert "auth-rejection.scenario.yaml::auth-rejection PASSED" in done.stdout, done.stdout
    assert seen[0] == seen[1] == (True, "auth-rejection.scenario.yaml", "auth-rejection"), seen


def test_a_passing_run_without_basetemp_leaves_no_directory_behind(tmp_path: Path) -> None:
    scenario = LIBRARY / "auth-rejection.scenario.yaml"
    done = run_cli("run", str(scenario), TMPDIR=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list(tmp_path.glob("pytest-scenarios-*"))


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


#: Library scenarios run through the CLI on xdist's workers. That every scenario of the
#: library passes, the project's own pytest run of scenarios/library shows (and the
#: respx cross-check, which records each one on the bridge); these stand for it here.
JUNIT_SAMPLE = ("turn-stream-and-resume", "approval-long-poll", "auth-rejection")


# Through the CLI (its subprocess is allowed 300 s): longer than the default guard of
# 120 s for a single case on a very busy machine.
@pytest.mark.timeout(600)
def test_the_library_passes_and_the_junit_report_says_so(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    files = [str(LIBRARY / f"{name}.scenario.yaml") for name in JUNIT_SAMPLE]
    done = run_cli("run", *files, "--junitxml", str(junit), "-n", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(files)} passed in" in done.stdout, done.stdout
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert suite.get("tests") == str(len(files))
    assert "created: 2/2 workers" in done.stdout  # pytest-xdist ran them
    assert suite.get("failures") == "0"
    assert suite.get("errors") == "0"
    names = {case.get("name") for case in suite.iter("testcase")}
    assert set(JUNIT_SAMPLE) <= names


BROKEN = """
    scenario: 1
    name: broken-on-purpose
    appServer:
      version: 1
      methods:
        x/fail: {error: {code: -32050, message: nope}}
    steps:
      - createSession: s
      - name: expects the wrong code
        call: {session: "${s}", method: x/fail, params: {}}
        expect:
          status: 502
          error: {error: app_server_error, code: -32051}
"""


def test_a_broken_scenario_shows_the_step_expected_received_and_the_transcripts(
    pytester: pytest.Pytester,
) -> None:
    tmp_path = pytester.path
    path = write(tmp_path, "broken.scenario.yaml", BROKEN)
    junit = tmp_path / "junit.xml"
    runs = tmp_path / "runs"
    done = run_here(pytester, "run", str(path), "--junitxml", str(junit), "--basetemp", str(runs))
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    # The failed run's directory is kept, named, and where it was asked to go.
    (kept,) = (runs / "scenarios").iterdir()
    assert f"run directory (kept): {kept}" in out
    expected_in_order = [
        f"{path}:9: step 2 of 2: expects the wrong code",
        "FAILED  broken-on-purpose",
        f"step 2 of 2: expects the wrong code  ({path}:9)",
        f"✗ expect.error  ({path}:13)",
        "at $.code: expected -32051, received -32050",
        "--- expected",
        "+++ received",
        '-  "code": -32051',
        '+  "code": -32050',
        "transcript (client and bridge):",
        "step 2: expects the wrong code",
        "→ POST /v1/sessions/",
        '← 502 {"error":"app_server_error","message":"nope","code":-32050}',
        "fake-codex pid",
        '→ fake {"id":2,"method":"x/fail"',
        '← fake {"error":{"code":-32050,"message":"nope"},"id":2}',
        f"{path.name}::broken-on-purpose",
        "1 failed in",
    ]
    position = 0
    for fragment in expected_in_order:
        found = out.find(fragment, position)
        assert found >= 0, f"{fragment!r} missing (or out of order) in:\n{out}"
        position = found
    # No traceback, no Python internals: a person's report.
    assert "Traceback" not in out + done.stderr
    case = ET.parse(junit).getroot().find("testsuite/testcase")
    assert case is not None
    failure = case.find("failure")
    assert failure is not None
    assert (failure.get("message") or "").startswith(f"{path}:9: step 2 of 2")
    assert "expected -32051, received -32050" in (failure.text or "")
    assert "--- expected" in (failure.text or "")
    assert "fake-codex pid" in (failure.text or "")
    # --tb=short: the report without the transcript.
    brief = run_here(pytester, "run", str(path), "--tb=short", "-p", "no:cacheprovider").stdout
    assert "expected -32051, received -32050" in brief
    assert "transcript (client and bridge):" not in brief


def test_the_end_checks_report_unused_script_entries_and_unanswered_requests(
    pytester: pytest.Pytester,
) -> None:
    tmp_path = pytester.path
    path = write(
        tmp_path,
        "leftovers.scenario.yaml",
        """
        scenario: 1
        name: leftovers
        appServer:
          version: 1
          methods:
            x/ask:
              steps: [{request: {method: item/tool/call, wait: false}}]
              result: {}
            x/unused: [{result: 1}, {result: 2}]
          turns:
            - Never started.
        steps:
          - createSession: s
          - call: {session: "${s}", method: x/ask, params: {}}
        """,
    )
    runs = tmp_path / "runs"
    done = run_here(pytester, "run", str(path), "--basetemp", str(runs))
    out = done.stdout
    assert done.returncode == 1, out
    (kept,) = (runs / "scenarios").iterdir()
    assert f"run directory (kept): {kept}" in out
    assert "end of run checks" in out
    assert "sent the server request item/tool/call (id 0), and it was never answered" in out
    assert f"({path}:9)" in out  # x/unused[0]
    assert "the scripted reply to x/unused[0] was never requested" in out
    assert "the scripted reply to x/unused[1] was never requested" in out
    assert f"({path}:11)" in out  # turns[0]
    assert "scripted turn 0 was never started" in out


def test_the_end_checks_can_be_turned_off(pytester: pytest.Pytester) -> None:
    path = write(
        pytester.path,
        "allowed.scenario.yaml",
        """
        scenario: 1
        appServer:
          version: 1
          methods: {x/unused: {result: 1}}
        checks: {scriptUsed: false}
        steps:
          - http: {path: /health}
        """,
    )
    assert run_here(pytester, "run", str(path)).returncode == 0


def test_a_malformed_file_stops_everything_before_anything_runs(
    pytester: pytest.Pytester,
) -> None:
    tmp_path = pytester.path
    good = write(tmp_path, "good.scenario.yaml", "scenario: 1\nsteps: [{http: {path: /health}}]\n")
    bad = write(
        tmp_path,
        "bad.scenario.yaml",
        """
        scenario: 1
        steps:
          - http: {path: /health}
            expect: {stauts: 200}
        """,
    )
    junit = tmp_path / "junit.xml"
    done = run_here(pytester, "run", str(tmp_path), "--junitxml", str(junit), "-v")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{bad}:4:14: steps[0].expect.stauts: Extra inputs are not permitted" in done.stdout
    assert "Interrupted: 1 error during collection" in done.stdout
    assert "PASSED" not in done.stdout
    assert f"{good.name}::" not in done.stdout
    error = ET.parse(junit).getroot().find("testsuite/testcase/error")
    assert error is not None
    assert "stauts" in (error.text or "")


def test_two_scenarios_of_one_name_in_a_run_are_a_collection_error(
    pytester: pytest.Pytester,
) -> None:
    tmp_path = pytester.path
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    body = "scenario: 1\nsteps: [{http: {path: /health}}]\n"
    first = write(tmp_path / "a", "same.scenario.yaml", body)
    second = write(tmp_path / "b", "other.scenario.yaml", "name: same\n" + body)
    done = run_here(pytester, "run", str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        f"{second}:1:1: the scenario name 'same' is taken by {first}:1:1; names are unique"
    ) in done.stdout
    assert "PASSED" not in done.stdout


@pytest.mark.asyncio
async def test_a_scenario_past_its_timeout_names_the_step_and_what_it_waited_for(
    tmp_path: Path,
) -> None:
    from scenarios.format import load_scenario
    from scenarios.runner import RunOptions, run_scenario

    path = write(
        tmp_path,
        "late.scenario.yaml",
        """
        scenario: 1
        timeoutMs: 5000
        appServer: {version: 1}
        steps:
          - createSession: s
          - poll: {session: "${s}", through: {kind: request}, timeoutMs: 600000}
        """,
    )
    result = await run_scenario(load_scenario(path), RunOptions(tmp_root=tmp_path))
    [failure] = result.failures
    assert failure.title == "step 2 of 2: poll"
    [problem] = failure.problems
    assert problem.message.startswith(
        "the scenario ran past its timeoutMs (5000 ms) in step 2, poll, waiting for an event "
        'matching {"kind": "request"}'
    ), problem.message


def test_a_missing_path_is_a_usage_error(pytester: pytest.Pytester, tmp_path: Path) -> None:
    done = run_here(pytester, "run", str(tmp_path / "nope"))
    assert done.returncode == 4
    assert f"file or directory not found: {tmp_path / 'nope'}" in done.stderr


def test_check_validates_without_running(pytester: pytest.Pytester) -> None:
    done = run_here(pytester, "check", str(LIBRARY))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(".scenario.yaml::") == len(list(LIBRARY.glob("*.scenario.yaml")))


def test_tags_are_marks_and_names_are_keywords(pytester: pytest.Pytester) -> None:
    """`-m TAG` and `-k NAME` pick scenarios, even under --strict-markers."""
    tmp_path = pytester.path
    tagged = (("one", "[smoke, sse]"), ("two", "[slow-ones, _x, 'a b']"), ("three", "[]"))
    for name, tags in tagged:
        write(tmp_path, f"{name}.scenario.yaml", f"""
            scenario: 1
            name: {name}
            tags: {tags}
            steps: [{{http: {{path: /health}}}}]
        """)  # fmt: skip
    strict = ("--strict-markers", "-p", "no:cacheprovider", "-v")
    done = run_here(pytester, "run", str(tmp_path), "-m", "smoke or slow-ones", *strict)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed, 1 deselected" in done.stdout, done.stdout
    done = run_here(pytester, "run", str(tmp_path), "-k", "three", *strict)
    assert "1 passed, 2 deselected" in done.stdout, done.stdout
    done = run_here(pytester, "run", str(tmp_path), "-m", "not sse", *strict)
    assert "2 passed, 1 deselected" in done.stdout, done.stdout


def test_last_failed_reruns_only_what_failed(pytester: pytest.Pytester) -> None:
    write(pytester.path, "good.scenario.yaml", "scenario: 1\nsteps: [{http: {path: /health}}]\n")
    write(pytester.path, "bad.scenario.yaml", BROKEN)
    first = run_here(pytester, "run", ".")
    assert first.returncode == 1
    assert "1 failed, 1 passed" in first.stdout, first.stdout
    again = run_here(pytester, "run", ".", "--lf")
    assert "rerun previous 1 failure" in again.stdout, again.stdout
    assert "1 failed in" in again.stdout, again.stdout


def test_parallel_runs_share_nothing(tmp_path: Path) -> None:
    """Four runs at once, each allowed one session: a shared bridge would answer 429."""
    loaded = parse_scenario(
        {
            "scenario": 1,
            "bridge": {"limits": {"maxSessions": 1}},
            "appServer": {"version": 1, "methods": {"x/mine": {"result": "only mine"}}},
            "steps": [
                {"createSession": "s"},
                {"createSession": "again", "expect": {"error": "session_limit_reached"}},
                {
                    "call": {"session": "${s}", "method": "x/mine", "params": {}},
                    "expect": {"json": {"result": "only mine"}},
                },
            ],
        }
    )
    with ThreadPoolExecutor(4) as pool:
        runs = [
            pool.submit(run_scenario_sync, loaded, RunOptions(tmp_root=tmp_path)) for _ in "abcd"
        ]
        results = [run.result() for run in runs]
    assert [r.outcome for r in results] == ["passed"] * 4, [r.failures for r in results]
    assert len({r.transcript.entries[0][2] for r in results}) == 4  # four bridges, four ports
    assert live_children() == set()


def test_a_scenario_built_in_python_runs_from_a_temporary_script(tmp_path: Path) -> None:
    loaded = parse_scenario(
        {
            "scenario": 1,
            "appServer": {"version": 1, "methods": {"x/hello": {"result": {"hi": True}}}},
            "steps": [
                {"createSession": "s"},
                {
                    "call": {"session": "${s}", "method": "x/hello", "params": {}},
                    "expect": {"json": {"result": {"hi": True}}},
                },
            ],
        }
    )
    result = run_scenario_sync(loaded, RunOptions(tmp_root=tmp_path, keep_tmp=True))
    assert result.passed, result.failures
    assert result.tmp is not None
    assert (result.tmp / "app-server.yaml").exists()


def keep_alive_scenario(expect: dict[str, object], read: str = "read") -> dict[str, object]:
    step = (
        {"read": {"count": 0}, "expect": expect}
        if read == "read"
        else {"poll": {"session": "${s}", "after": 0, "count": 1}, "expect": expect}
    )
    return {
        "scenario": 1,
        "bridge": {"limits": {"sseKeepaliveMs": 50}},
        "steps": [
            {"createSession": "s"},
            {"stream": {"session": "${s}"}},
            {"read": {"count": 1}, "expect": {"methods": ["remoteControl/status/changed"]}},
            step,
        ],
    }


def test_keep_alive_comments_are_counted_and_never_read_as_events(tmp_path: Path) -> None:
    options = RunOptions(tmp_root=tmp_path)
    counted = parse_scenario(keep_alive_scenario({"quietMs": 300, "keepAlives": {"$gte": 1}}))
    result = run_scenario_sync(counted, options)
    assert result.passed, result.failures
    wrong = parse_scenario(keep_alive_scenario({"quietMs": 300, "keepAlives": 0}))
    result = run_scenario_sync(wrong, options)
    assert not result.passed
    (problem,) = result.failures[0].problems
    assert problem.loc == ("expect", "keepAlives")
    assert problem.message.startswith("keep-alive comments seen: at keepAlives: expected 0")
    on_poll = parse_scenario(keep_alive_scenario({"keepAlives": 0}, read="poll"))
    result = run_scenario_sync(on_poll, options)
    assert [p.message for p in result.failures[0].problems] == [
        "`keepAlives` applies to `read` only"
    ]


@pytest.mark.quick
def test_a_real_codex_scenario_skips_without_codex_and_fails_under_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("CODEX_BIN", raising=False)
    loaded = load_scenario(LIBRARY / "real-codex-scripted-model.scenario.yaml")
    skipped = run_scenario_sync(loaded, RunOptions(require_codex=False))
    assert skipped.outcome == "skipped"
    assert skipped.skip_reason == harness.NO_CODEX
    failed = run_scenario_sync(loaded, RunOptions(require_codex=True))
    assert failed.outcome == "failed"
    assert failed.failures[0].problems[0].message == f"CI=true: {harness.NO_CODEX}"


MODEL_SCENARIO = """
    scenario: 1
    name: needs-the-real-codex
    model: {replies: [{text: hi}]}
    steps:
      - http: {method: POST, path: /v1/text-turn, json: {text: hi}}
"""


@pytest.mark.parametrize("given", ["--codex", "CODEX_BIN"])
@pytest.mark.parametrize("problem", ["missing", "directory", "not executable"])
def test_a_codex_path_given_that_does_not_work_fails_naming_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, given: str, problem: str
) -> None:
    tmp_path = pytester.path
    scenario = write(tmp_path, "model.scenario.yaml", MODEL_SCENARIO)
    codex = tmp_path / "bin" / "codex"
    if problem == "directory":
        codex.mkdir(parents=True)
    elif problem == "not executable":
        codex.parent.mkdir()
        codex.write_text("#!/bin/sh\n")
    args = ["run", str(scenario)]
    if given == "--codex":
        args += ["--codex", str(codex)]
    else:
        monkeypatch.setenv("CODEX_BIN", str(codex))
    done = run_here(pytester, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    # `--codex` is the plugin's `--codex-bin`: the message names the plugin's option.
    setting = f"--codex-bin {codex}" if given == "--codex" else f"CODEX_BIN={codex}"
    why = {"missing": "no such file", "directory": "a directory"}.get(problem, problem)
    assert f"{setting}: {why}" in done.stdout, done.stdout
    assert "1 failed in" in done.stdout
    assert "SKIPPED" not in done.stdout


def test_without_any_codex_the_cli_skips_with_the_plugins_words(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario = write(pytester.path, "model.scenario.yaml", MODEL_SCENARIO)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "CODEX_BIN": "", "CI": ""}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    done = run_here(pytester, "run", str(scenario))
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED [1] ")]
    assert scenario.name in line, line
    assert line.endswith(harness.NO_CODEX), line


def test_schema_into_a_pipe_whose_reader_is_gone_exits_quietly() -> None:
    """`rest-bridge scenarios schema | head`: no BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte is written
    try:
        done = subprocess.run(
            [REST_BRIDGE, "scenarios", "schema"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_folder_search_skips_virtual_environments_and_hidden_folders(
    pytester: pytest.Pytester,
) -> None:
    """`rest-bridge scenarios run .` in a project whose venv is `.venv` runs the project's
    scenarios, not the library the installed package carries in site-packages."""
    tmp_path = pytester.path
    good = "scenario: 1\nsteps: [{http: {path: /health}}]\n"
    wanted = [tmp_path / "a.scenario.yaml", tmp_path / "sub" / "b.scenario.yml"]
    skipped = [
        tmp_path / ".venv" / "lib" / "site-packages" / "library" / "x.scenario.yaml",
        tmp_path / "env" / "lib" / "y.scenario.yaml",  # a venv by its pyvenv.cfg
        tmp_path / ".hidden" / "z.scenario.yaml",
        tmp_path / "node_modules" / "pkg" / "z.scenario.yaml",
        tmp_path / "build" / "z.scenario.yaml",
    ]
    for path in wanted + skipped:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(good)
    (tmp_path / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (tmp_path / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    done = run_here(pytester, "check", ".")
    assert done.returncode == 0, done.stderr
    listed = [line.split("::")[0] for line in done.stdout.splitlines() if "::" in line]
    assert listed == ["a.scenario.yaml", "sub/b.scenario.yml"]
    # Named on the command line, a file is taken wherever it is.
    done = run_here(pytester, "check", str(skipped[2]))
    assert done.returncode == 0, done.stderr
    assert ".hidden/z.scenario.yaml::z" in done.stdout, done.stdout


@pytest.mark.quick
def test_the_fronts_options_become_the_plugins_and_the_old_ones_still_work() -> None:
    args = ["x.scenario.yaml", "--target", "http://h:1", "--codex=/c", "-j", "2", "--junit", "j"]
    assert pytest_arguments(args) == [
        *SCENARIOS_ONLY,
        *("x.scenario.yaml", "--codex-target=http://h:1", "--codex-bin=/c"),
        *("-n", "2", "--junitxml", "j", "--dist=loadgroup"),
    ]
    # A --dist of the user's own stays theirs; no -n, no --dist.
    own = ["-n", "2", "--dist", "load"]
    assert pytest_arguments(own) == [*SCENARIOS_ONLY, *own]
    assert not any(arg.startswith("--dist") for arg in pytest_arguments(["-k", "x"]))


# -- nothing a run starts outlives it --------------------------------------------------------

#: A grandchild that stays in fake-codex's group and environment, and one that escapes
#: both (a cleared environment, a session of its own, a double fork: re-parented away
#: from fake-codex). Each sends its pid to the test's listener once it runs, then waits.
TELL = (
    "s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
    "s.sendall(str(os.getpid()).encode()); s.close(); signal.pause()"
)
REPORT = "import os, signal, socket, sys; " + TELL
ESCAPE = "import os, signal, socket, sys; os.setsid(); os.fork() and os._exit(0); " + TELL


#: A last step that waits until the run is stopped: `x/hang` never answers. With its
#: `params` (the fake, as codex, answers a request without them with -32600 at once,
#: and the run then ended by itself, racing the signal the test sends it).
HANG = '{call: {session: "${s}", method: x/hang, params: {}}}'


def spawning_scenario(tmp_path: Path, port: int, last_step: str) -> Path:
    python = sys.executable
    return write(
        tmp_path,
        "spawning.scenario.yaml",
        f"""
        scenario: 1
        name: spawning
        timeoutMs: 600000
        appServer:
          version: 1
          methods:
            x/spawn:
              steps:
                - spawnChild: {{command: [{python}, -c, "{REPORT}", "{port}"]}}
                - spawnChild:
                    command: [env, -i, {python}, -c, "{ESCAPE}", "{port}"]
                    wait: true
              result: {{}}
            x/hang: {{noReply: true}}
        steps:
          - createSession: s
          - call: {{session: "${{s}}", method: x/spawn, params: {{}}}}
          - {last_step}
        """,
    )


def reported_pids(listener: socket.socket, count: int) -> list[int]:
    """The pids the scenario's grandchildren send, as each connects (120 s at most)."""
    pids = []
    for _ in range(count):
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(120)
            pids.append(int(connection.recv(64)))
    return pids


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def left_behind(pids: list[int], mark: str) -> set[int]:
    """What still runs, of `pids` and of the processes carrying the test's mark, as the
    runner has exited (no grace: it returns once what it stopped is gone). Killed, so
    that a failing test leaves nothing either."""
    left = {pid for pid in pids if running(pid)} | marked_processes(MARK, mark)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


MARK = "SCENARIOS_RUN_TEST_MARK"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_run_stopped_by_a_signal_leaves_nothing_behind(tmp_path: Path, sig: int) -> None:
    """`rest-bridge scenarios run` killed mid-run: its pytest, the bridge's fake-codex and
    their grandchildren (one escaped from the group and the environment) all go with it,
    and the runner ends by the signal it received."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(120)
        scenario = spawning_scenario(tmp_path, listener.getsockname()[1], HANG)
        mark = secrets.token_hex(8)
        runner = subprocess.Popen(
            [REST_BRIDGE, "scenarios", "run", "-p", "no:cacheprovider", str(scenario)],
            env=quiet_pytest({**os.environ, MARK: mark}),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        try:
            pids = reported_pids(listener, 2)
            pytest_pids = marked_processes(MARK, mark) - {runner.pid}
            assert pytest_pids, "the run's pytest and fake-codex carry the mark"
            runner.send_signal(sig)
            code = runner.wait(120)
            left = left_behind([*pids, *pytest_pids], mark)
        finally:
            if runner.poll() is None:
                runner.kill()
            assert runner.stdout is not None
            output = runner.stdout.read().decode()
            runner.stdout.close()
    assert code == -sig, output
    assert left == set(), output
    assert "KeyboardInterrupt" in output, output  # pytest stopped as on Ctrl-C, and said so
    # What the scenario's clean-up did not stop (at least the escaped grandchild), the
    # runner killed, and said so.
    assert re.search(r"rest-bridge scenarios run: killed \d+ process(es)? the run left", output)


def test_a_failing_run_leaves_nothing_behind(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(120)
        failing = "{http: {path: /v1/health}, expect: {status: 299}}"
        scenario = spawning_scenario(tmp_path, listener.getsockname()[1], failing)
        mark = secrets.token_hex(8)
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(
                run_cli,
                "run",
                "-p",
                "no:cacheprovider",
                str(scenario),
                cwd=tmp_path,
                **{MARK: mark},
            )
            pids = reported_pids(listener, 2)
            result = done.result()
            left = left_behind(pids, mark)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "expected status 299, received 200" in result.stdout, result.stdout
    assert left == set(), result.stdout + result.stderr
    assert "killed 1 process the run left behind" in result.stderr, result.stderr


def test_a_billion_laughs_scenario_is_a_collection_error_and_nothing_runs(
    pytester: pytest.Pytester,
) -> None:
    """Its appServer script would make fake-codex build 387 million strings: refused at
    load time (by the scenario loader, the same function as fake-codex's), file and line."""
    levels = "".join(
        f"    x/{b}: {{result: &{b} [{', '.join([f'*{a}'] * 9)}]}}\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    laughs = pytester.path / "laughs.scenario.yaml"
    laughs.write_text(
        "scenario: 1\nname: laughs\nappServer:\n  version: 1\n  methods:\n"
        "    x/a: {result: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]}\n"
        + levels
        + "steps:\n  - createSession: s\n"
    )
    for args in (("run", "-p", "no:cacheprovider"), ("check",)):
        done = run_here(pytester, *args, str(laughs))
        assert done.returncode == 2, done.stdout + done.stderr
        where = f"{laughs}:11:23: invalid YAML: its aliases stand for more than 100000 nodes"
        assert where in done.stdout, done.stdout
        assert "error during collection" in done.stdout, done.stdout


def test_ctrl_c_in_a_terminal_stops_the_run_once_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """In a terminal, Ctrl-C reaches the runner and its pytest alike (one foreground
    process group): the runner sends pytest no second SIGINT (a second signal means
    "kill it now"), waits for it to stop, sweeps what is left and ends by SIGINT."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(120)
        scenario = spawning_scenario(tmp_path, listener.getsockname()[1], HANG)
        mark = secrets.token_hex(8)
        controller, terminal = pty.openpty()
        command = [REST_BRIDGE, "scenarios", "run", "-p", "no:cacheprovider", str(scenario)]
        # setsid --ctty: a session of its own, the pseudo-terminal as its controlling one.
        runner = subprocess.Popen(
            ["setsid", "--ctty", *command],
            env=quiet_pytest({**os.environ, MARK: mark}),
            stdin=terminal,
            stdout=terminal,
            stderr=terminal,
            cwd=tmp_path,
        )
        os.close(terminal)
        output = bytearray()

        def drain() -> None:
            with contextlib.suppress(OSError):  # EIO once every holder of the terminal is gone
                while chunk := os.read(controller, 65536):
                    output.extend(chunk)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            pids = reported_pids(listener, 2)
            os.write(controller, b"\x03")  # the terminal's interrupt character
            code = runner.wait(120)
            left = left_behind(pids, mark)
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait()
            reader.join(30)
            os.close(controller)
    text = output.decode(errors="replace")
    assert code == -signal.SIGINT, text
    assert left == set(), text
    assert "KeyboardInterrupt" in text, text  # pytest stopped as it does on Ctrl-C
    assert re.search(r"rest-bridge scenarios run: killed \d+ process(es)? the run left", text)
