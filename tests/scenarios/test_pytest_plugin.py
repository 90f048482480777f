"""The pytest plugin as a host suite meets it: found by its entry point, with pytest-asyncio
in strict and auto modes, xdist and rerunfailures; in a pytest process of its own where
processes are the point (xdist, deadlines, imports), else in this one (`here`)."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from front_here import in_process

pytest_plugins = ["pytester"]

#: Plugins of this venv that have nothing to do with these tests and are slow to import.
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:faker")
QUIET += ("-p", "no:schemathesis")

HOST_TESTS = """
import pytest

TOKEN = "t0k3n"


@pytest.mark.asyncio
async def test_health(codex_client):
    async with codex_client.get("/health") as response:
        assert response.status == 200


@pytest.mark.asyncio
@pytest.mark.codex_bridge(
    script={"turns": ["Hi from the script."]}, token=TOKEN, limits={"maxSessions": 2}
)
async def test_a_turn_over_sse_with_auth_and_limits(codex_bridge, codex_client, codex_sse):
    async with codex_client.post("/v1/sessions", json={}) as response:
        session = (await response.json())["sessionId"]
    reader = await codex_sse(f"/v1/sessions/{session}/events/stream")
    base = f"/v1/sessions/{session}/call"
    async with codex_client.post(f"{base}/thread/start", json={"params": {}}) as response:
        thread = (await response.json())["result"]["thread"]["id"]
    params = {"threadId": thread, "input": [{"type": "text", "text": "hi"}]}
    async with codex_client.post(f"{base}/turn/start", json={"params": params}) as response:
        assert response.status == 200
    frames = await reader.until(lambda f: f.json()["method"] == "turn/completed", timeout=10)
    texts = [f.json()["params"]["item"].get("text") for f in frames
             if f.json()["method"] == "item/completed"]
    assert "Hi from the script." in texts
    assert [int(f.id) for f in frames] == list(range(1, len(frames) + 1))
    async with codex_bridge.client(auth=False).get("/v1/sessions") as response:
        assert response.status == 401
    for _ in range(2):
        async with codex_client.post("/v1/sessions", json={}) as response:
            pass
    assert response.status == 429


@pytest.mark.asyncio
async def test_start_bridge_builds_any_preset(codex_start_bridge):
    bridge = await codex_start_bridge(preset="default")
    async with bridge.client().post("/v1/call/model/list", json={"params": {}}) as response:
        assert response.status == 404


@pytest.mark.asyncio
async def test_run_scenario_from_python(codex_run_scenario):
    result = await codex_run_scenario(
        {"steps": [{"http": {"path": "/health"}, "expect": {"jsonSubset": {"status": "ok"}}}]}
    )
    assert result.passed
"""

GOOD_SCENARIO = """
scenario: 1
name: health-is-ok
steps:
  - http: {path: /health}
    expect: {json: {status: ok, version: {$type: string}}}
"""

BROKEN_SCENARIO = """
scenario: 1
name: wrong-status
steps:
  - http: {path: /v1/sessions}
    expect: {status: 201}
"""


def here(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """pytest on `pytester`'s folder in this process: for what the plugin does in a host's
    run; the runs about processes (xdist's workers, a deadline stopping a hung test, what
    an environment without httpx imports) are started as processes."""
    return in_process(pytester, *args)


def host_project(pytester: pytest.Pytester, **files: str) -> None:
    pytester.makepyfile(test_host=HOST_TESTS)
    for name, text in files.items():
        (pytester.path / name).write_text(textwrap.dedent(text).lstrip())


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_the_fixtures_work_in_both_asyncio_modes(pytester: pytest.Pytester, mode: str) -> None:
    host_project(pytester, **{"health.scenario.yaml": GOOD_SCENARIO})
    result = here(pytester, *QUIET, f"--asyncio-mode={mode}")
    result.assert_outcomes(passed=5)


def test_scenario_files_are_tests_and_their_failures_read_well(pytester: pytest.Pytester) -> None:
    host_project(
        pytester,
        **{"health.scenario.yaml": GOOD_SCENARIO, "wrong.scenario.yaml": BROKEN_SCENARIO},
    )
    result = here(pytester, *QUIET)
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*FAILED  wrong-status*",
            "*step 1 of 1: http GET /v1/sessions*wrong.scenario.yaml:4)",
            "*expected status 201, received 200*",
            "*transcript (client and bridge):*",
        ]
    )


def test_a_malformed_scenario_is_a_collection_error_with_its_line(
    pytester: pytest.Pytester,
) -> None:
    (pytester.path / "bad.scenario.yaml").write_text(
        "scenario: 1\nsteps:\n  - http: {path: /health}\n    expect: {stauts: 200}\n"
    )
    result = here(pytester, *QUIET)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*bad.scenario.yaml:4:14: steps?0?.expect.stauts: Extra*"])


def test_xdist_and_rerunfailures_leave_scenarios_alone(pytester: pytest.Pytester) -> None:
    host_project(
        pytester,
        **{
            "a.scenario.yaml": GOOD_SCENARIO,
            "b.scenario.yaml": GOOD_SCENARIO.replace("health-is-ok", "health-again"),
        },
    )
    pytester.makepyfile(
        test_flaky="""
        import pathlib

        def test_fails_once(tmp_path_factory):
            flag = tmp_path_factory.getbasetemp().parent / "flaky-flag"
            if not flag.exists():
                flag.write_text("failed once")
                raise AssertionError("the first try fails")
        """
    )
    result = pytester.runpytest_subprocess(*QUIET, "-n", "2", "--reruns", "2")
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("rerun"), outcomes.get("failed")) == (7, 1, None)


def test_files_given_to_the_fixtures_are_found_beside_the_test_file(
    pytester: pytest.Pytester,
) -> None:
    """Run from the project's root (`pytest tests3`), a relative script or scenario is
    the one beside the test file, for every fixture; a missing one fails naming the paths
    tried, without a traceback."""
    folder = pytester.path / "tests3"
    folder.mkdir()
    (folder / "approve.yaml").write_text("version: 1\n")
    (folder / "health.scenario.yaml").write_text(textwrap.dedent(GOOD_SCENARIO).lstrip())
    (folder / "test_paths.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.asyncio
            @pytest.mark.codex_bridge(script="approve.yaml")
            async def test_the_markers_script(codex_client):
                async with codex_client.get("/health") as response:
                    assert response.status == 200

            @pytest.mark.asyncio
            async def test_a_scenario_by_path(codex_run_scenario):
                assert (await codex_run_scenario("health.scenario.yaml")).passed

            @pytest.mark.asyncio
            async def test_a_missing_scenario(codex_run_scenario):
                await codex_run_scenario("nowhere.scenario.yaml")

            @pytest.mark.asyncio
            async def test_a_missing_script(codex_start_bridge):
                await codex_start_bridge(script="nowhere.yaml")
            """
        )
    )
    result = here(pytester, *QUIET, "tests3")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(
        [
            f"*nowhere.scenario.yaml: no such file ({folder / 'nowhere.scenario.yaml'} nor "
            f"{pytester.path / 'nowhere.scenario.yaml'})*",
            f"*nowhere.yaml: no such file ({folder / 'nowhere.yaml'} nor *",
        ]
    )
    assert "Traceback" not in result.stdout.str()
    assert "ScriptError" not in result.stdout.str()


def test_the_fixture_bridges_check_their_script_like_scenarios(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.asyncio
        @pytest.mark.codex_bridge(script={"turns": ["Nobody starts me."]})
        async def test_never_starts_the_turn(codex_client):
            async with codex_client.get("/health") as response:
                assert response.status == 200
        """
    )
    result = here(pytester, *QUIET)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*scripted turn 0 was never started*"])


@pytest.mark.parametrize("autoload", [True, False])
def test_a_conftest_registering_it_too_is_harmless(
    pytester: pytest.Pytester, autoload: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry point is named after the module, so `pytest_plugins` finds it registered."""
    pytester.makeconftest('pytest_plugins = ["scenarios.pytest_plugin"]')
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.asyncio
        async def test_health(codex_client):
            async with codex_client.get("/health") as response:
                assert response.status == 200
        """
    )
    args = list(QUIET)
    if not autoload:
        monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        args += ["-p", "pytest_asyncio.plugin"]
    result = here(pytester, *args)
    result.assert_outcomes(passed=1)


# -- what a new host project meets first ---------------------------------------------------


def test_a_host_project_hears_nothing_about_the_loop_scope_and_its_fixtures_keep_their_loop(
    pytester: pytest.Pytester,
) -> None:
    """pytest-asyncio warns when `asyncio_default_fixture_loop_scope` is unset; the plugin
    settles it without changing any fixture's loop (a session fixture keeps its own)."""
    pytester.makepyfile(
        """
        import asyncio

        import pytest
        import pytest_asyncio

        @pytest_asyncio.fixture(scope="session")
        async def session_loop():
            return asyncio.get_running_loop()

        @pytest.mark.asyncio(loop_scope="session")
        async def test_one(session_loop):
            assert session_loop is asyncio.get_running_loop()

        @pytest.mark.asyncio(loop_scope="session")
        async def test_two(session_loop):
            assert session_loop is asyncio.get_running_loop()

        @pytest.mark.asyncio
        async def test_the_plugins_fixtures(codex_client):
            async with codex_client.get("/health") as response:
                assert response.status == 200
        """
    )
    result = pytester.runpytest_subprocess(*QUIET, "-W", "error::DeprecationWarning")
    result.assert_outcomes(passed=3)
    output = "\n".join(result.outlines + result.errlines)
    assert "asyncio_default_fixture_loop_scope" not in output.replace(
        "asyncio_default_fixture_loop_scope=fixture-scope", ""
    ), output
    assert "PytestDeprecationWarning" not in output
    # A value the host sets is the one used.
    chosen = pytester.runpytest_subprocess(
        *QUIET, "--collect-only", "-o", "asyncio_default_fixture_loop_scope=function"
    )
    chosen.stdout.fnmatch_lines(["asyncio: *asyncio_default_fixture_loop_scope=function,*"])


def test_with_pytest_asyncio_turned_off_the_loop_scope_is_not_declared(
    pytester: pytest.Pytester,
) -> None:
    """Under `-p no:asyncio` the plugin leaves pytest-asyncio's option alone: a host's
    configuration that sets it is then an unknown option, as without the plugin."""
    pytester.makepyfile("def test_sync():\n    assert True\n")
    result = here(pytester, *QUIET, "-p", "no:asyncio", "--help")
    assert "asyncio_default_fixture_loop_scope" not in result.stdout.str()
    result = here(pytester, *QUIET, "-p", "no:asyncio")
    result.assert_outcomes(passed=1)


MODEL_SCENARIO = """
scenario: 1
name: needs-the-real-codex
model: {replies: [{text: hi}]}
steps:
  - http: {method: POST, path: /v1/text-turn, json: {text: hi}}
"""

REAL_CODEX_TEST = """
def test_uses_the_real_codex(codex_bin):
    assert codex_bin
"""


def no_codex_anywhere(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """No CODEX_BIN, no .codex-npm/ in the project, no codex on PATH, not under CI."""
    monkeypatch.delenv("CODEX_BIN", raising=False)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")
    (pytester.path / "model.scenario.yaml").write_text(MODEL_SCENARIO.lstrip())
    pytester.makepyfile(test_real=REAL_CODEX_TEST)


@pytest.mark.parametrize("given", ["--codex-bin", "CODEX_BIN"])
def test_a_codex_path_given_that_does_not_work_fails_naming_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    no_codex_anywhere(pytester, monkeypatch)
    codex = "/nonexistent/codex"
    args = list(QUIET)
    if given == "--codex-bin":
        args += ["--codex-bin", codex]
    else:
        monkeypatch.setenv("CODEX_BIN", codex)
    result = here(pytester, *args, "-rA")
    # The fixture's test errors in setup, the scenario fails; nothing is skipped.
    result.assert_outcomes(failed=1, errors=1)
    setting = f"--codex-bin {codex}" if given == "--codex-bin" else f"CODEX_BIN={codex}"
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_uses_the_real_codex*",
            f"{setting}: no such file (a codex you name is used as given*",
            "FAILED  needs-the-real-codex*",
            "*setup*",
            f"*{setting}: no such file*",
            "ERROR test_real.py::test_uses_the_real_codex*",
            "FAILED model.scenario.yaml::needs-the-real-codex*",
        ]
    )


def test_without_any_codex_both_skip_with_the_clis_words(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scenarios.harness import NO_CODEX

    no_codex_anywhere(pytester, monkeypatch)
    result = here(pytester, *QUIET, "-rs")
    result.assert_outcomes(skipped=2)
    reasons = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert len(reasons) == 2, result.outlines
    assert all(line.endswith(NO_CODEX) for line in reasons), reasons


def test_the_respx_fixtures_name_the_extra_to_install(pytester: pytest.Pytester) -> None:
    """Installed with the `harness` extra alone, respx and httpx are missing."""
    pytester.makeconftest(
        """
        import sys

        # What an environment without the `respx` extra looks like to an import.
        sys.modules["httpx"] = None
        """
    )
    pytester.makepyfile(
        """
        def test_mocked(codex_respx):
            codex_respx({"scenario": 1, "steps": [{"http": {"path": "/health"}}]})
        """
    )
    result = pytester.runpytest_subprocess(*QUIET)
    result.assert_outcomes(errors=1)
    assert (
        "the respx mocks of the bridge need respx and httpx (no module named 'httpx'): "
        "install codex-rest-bridge with its `respx` extra, e.g. from a clone: "
        'pip install "/path/to/codex-rest-bridge[respx]"'
    ) in result.outlines
    assert "Traceback" not in result.stdout.str()
    assert "During handling" not in result.stdout.str()


def registered(pytester: pytest.Pytester, *args: str) -> dict[str, set[str]]:
    """What pytest lists: fixtures, markers, command-line options and ini keys."""
    fixtures = here(pytester, *args, "--fixtures").outlines
    markers = here(pytester, *args, "--markers").outlines
    helped = here(pytester, *args, "--help").outlines
    return {
        "fixture": {m[1] for line in fixtures if (m := re.match(r"(\w+)(?: \[.*?\])? -- ", line))},
        "marker": {m[1] for line in markers if (m := re.match(r"@pytest\.mark\.([\w-]+)", line))},
        "option": {m[1] for line in helped if (m := re.match(r"  (--[\w-]+)", line))},
        "ini": {m[1] for line in helped if (m := re.match(r"  (\w+) \(\w+\):", line))},
    }


def test_everything_the_plugin_registers_is_prefixed_and_documented(
    pytester: pytest.Pytester,
) -> None:
    """The plugin adds `codex_` names only (`--codex-` options), each in the README."""
    without = registered(pytester, *QUIET, "-p", "no:scenarios.pytest_plugin")
    with_it = registered(pytester, *QUIET)
    readme = (Path(__file__).parents[2] / "scenarios" / "README.md").read_text()
    added = {kind: with_it[kind] - without[kind] for kind in with_it}
    assert added["fixture"] >= {"codex_bridge", "codex_client", "codex_sse", "codex_bin"}, added
    options = {"--codex-bin", "--codex-target", "--codex-target-script", "--codex-timeout"}
    assert added["option"] >= options, added
    assert added["marker"] == {"codex_bridge", "codex_real", "codex_timeout"}, added
    assert added["ini"] == {"codex_scenario_patterns", "codex_timeout"}, added
    for kind, names in added.items():
        for name in names:
            assert name.startswith(("codex_", "--codex-")), (kind, name)
            assert f"`{name}" in readme, f"the {kind} {name} is not in scenarios/README.md"


@pytest.mark.parametrize("name", ["codex_client", "codex_bridge"])
def test_a_host_fixture_overriding_one_the_plugin_uses_fails_naming_the_clash(
    pytester: pytest.Pytester, name: str
) -> None:
    """pytest lets a host's fixture override the plugin's of the same name; the plugin's
    fixtures that use it then say so instead of failing on what they were given."""
    pytester.makeconftest(
        f"""
        import pytest

        @pytest.fixture
        def {name}():
            return "the host's own"
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.asyncio
        async def test_a_stream(codex_sse, codex_client):
            await codex_sse("/v1/sessions/x/events/stream")
        """
    )
    result = here(pytester, *QUIET)
    result.assert_outcomes(**({"failed": 1} if name == "codex_client" else {"errors": 1}))
    user = "codex_sse" if name == "codex_client" else "codex_client"
    result.stdout.fnmatch_lines(
        [
            f"*the fixture {name!r} is your suite's own (conftest.{name}), a str, and it "
            f"overrides the one of codex-rest-bridge's pytest plugin, which {user} uses: "
            "rename yours*"
        ]
    )
    assert "AttributeError" not in result.stdout.str()


HANGING_HOST = """
import httpx
import pytest

SCRIPT = {"turns": [{"steps": [{"commandApproval": {"command": "make deploy"}}]}]}


@pytest.mark.asyncio
@pytest.mark.codex_bridge(script=SCRIPT, limits={"sseKeepaliveMs": 100})
async def test_a_host_that_ignores_the_approval(codex_bridge):
    # A host service's way: httpx, a read timeout the stream's keep-alives keep resetting.
    async with httpx.AsyncClient(base_url=codex_bridge.url, timeout=2) as http:
        session = (await http.post("/v1/sessions", json={})).json()["sessionId"]
        call = f"/v1/sessions/{session}/call"
        thread = (await http.post(f"{call}/thread/start", json={"params": {}})).json()
        params = {"threadId": thread["result"]["thread"]["id"], "input": []}
        await http.post(f"{call}/turn/start", json={"params": params})
        stream = f"/v1/sessions/{session}/events/stream"
        async with http.stream("GET", stream) as events:
            async for line in events.aiter_lines():
                assert "turn/completed" not in line  # never: the approval is never answered
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["alone", "xdist"])
def test_a_host_test_that_hangs_fails_at_its_deadline_naming_what_was_pending(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """A host test that leaves a server request unanswered while reading SSE (keep-alives
    defeat httpx's read timeout) fails at the plugin's deadline, its first line naming the
    request; the stream it read comes next."""
    pytester.makepyfile(HANGING_HOST)
    result = pytester.runpytest_subprocess(*QUIET, "--codex-timeout", "2", *workers, timeout=120)
    result.assert_outcomes(failed=1)
    first = (
        "*the test ran past its 2 s deadline (--codex-timeout), still pending: the server "
        "request item/commandExecution/requestApproval (requestKey 0) of session *, never "
        "answered"
    )
    result.stdout.fnmatch_lines(
        [first, "*also pending: GET /v1/sessions/*/events/stream, open for * s (an event stream*"]
    )
    failure = result.stdout.str()
    assert "CancelledError" not in failure
    assert "Traceback" not in failure


def test_the_marker_wins_over_the_option_and_a_bad_value_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`codex_timeout` on a test beats `--codex-timeout 0` (off); a deadline that is not a
    number of seconds stops the run naming where it came from."""
    pytester.makepyfile(
        """
        import asyncio
        import pytest

        @pytest.mark.asyncio
        @pytest.mark.codex_timeout(0.5)
        async def test_waits_forever(codex_bridge):
            await asyncio.Event().wait()
        """
    )
    result = pytester.runpytest_subprocess(*QUIET, "--codex-timeout", "0", timeout=120)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*the test ran past its 0.5 s deadline (@pytest.mark.codex_timeout); nothing was pending*"]
    )
    monkeypatch.setenv("CODEX_TEST_TIMEOUT", "soon")
    result = pytester.runpytest_subprocess(*QUIET, timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*$CODEX_TEST_TIMEOUT: 'soon' is not a number of seconds*"])


SERIAL_CONFTEST = """
import fcntl
from pathlib import Path

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # The lock file every worker of the run shares, beside their own --basetemp folders.
    lock = Path(item.config.getoption("basetemp")).resolve().parent / "codex-serial.lock"
    with open(lock, "a+b") as other:  # another open file: flock excludes it too
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = True
        else:
            held = False
            fcntl.flock(other, fcntl.LOCK_UN)
    # A serial scenario holds the lock while it runs. (A parallel one may find it held
    # or free: a serial one on another worker may hold it meanwhile.)
    if "serial" in item.name:
        assert held, f"{item.name}: the serial lock is free"
    return (yield)
"""


@pytest.mark.parametrize("dist", ["load", "loadgroup"])
def test_serial_scenarios_hold_one_lock_whatever_spreads_them(
    pytester: pytest.Pytester, dist: str
) -> None:
    """`parallel: false` scenarios never run at once, even where xdist's groups do not hold
    (plain `-n`; `--dist loadgroup` on pytest 9.2): each runs holding a lock the run's
    workers share (a `parallel: true` one beside them runs too)."""
    pytester.makeconftest(SERIAL_CONFTEST)
    for name, parallel in [("serial-1", "false"), ("serial-2", "false"), ("free", "true")]:
        scenario = GOOD_SCENARIO.replace("health-is-ok", name)
        (pytester.path / f"{name}.scenario.yaml").write_text(
            textwrap.dedent(scenario).lstrip() + f"parallel: {parallel}\n"
        )
    result = pytester.runpytest_subprocess(*QUIET, "-n", "2", "--dist", dist)
    assert result.parseoutcomes().get("passed") == 3, result.stdout.str()


def test_a_synchronous_test_using_a_loop_fixture_fails_at_once_saying_what_to_write(
    pytester: pytest.Pytester,
) -> None:
    """The fixture's bridge runs on the event loop, which a plain `def` test never runs:
    it used to wait on its client's timeout, or forever without one."""
    pytester.makepyfile(
        test_sync="""
        import urllib.request

        def test_health(codex_bridge):
            urllib.request.urlopen(codex_bridge.url + "/health")  # no timeout: would hang
        """
    )
    result = pytester.runpytest_subprocess(*QUIET, "--codex-timeout", "0")
    assert result.parseoutcomes().get("errors") == 1, result.stdout.str()
    result.stdout.fnmatch_lines(
        ["*test_health is a synchronous test, but it uses codex_bridge*, whose bridge runs on*"]
    )
    assert "asyncio.to_thread" in result.stdout.str()
