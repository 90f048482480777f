"""The Makefile says what it does: `make serve` names the app-server it serves on.

`make -n` prints the commands without running them; `-o .venv/.installed` keeps the
venv's stamp out of it, so nothing is installed either.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_n(*args: str, venvs_made: bool = True) -> str:
    """What `make -n ARGS` would run; with ``venvs_made``, as if the venvs were made."""
    made = ["-o", ".venv/.installed", "-o", ".venv/.installed-serve"] if venvs_made else []
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("APP_SERVER", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    }
    done = subprocess.run(
        ["make", "-n", *made, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_serve_names_the_app_server_it_was_given() -> None:
    command = "/opt/codex/bin/codex app-server"
    out = make_n("serve", f"APP_SERVER={command}")
    assert f'echo "Serving on the app-server command you gave: {command}"' in out
    assert "bundled fake" not in out
    assert f'--app-server "{command}"' in out


def test_make_serve_without_one_says_it_serves_the_fake() -> None:
    out = make_n("serve")
    assert 'echo "Serving on the bundled fake app-server.' in out
    assert "/fake-codex app-server" in out


def test_the_way_to_the_real_codex_is_a_target_that_finds_its_native_binary_when_run() -> None:
    # The note is printed before `make codex` may have run: it names a target, not a path
    # (a stranger was sent to the Node launcher, read at parse time on a fresh machine).
    assert "To front the real Codex instead: make serve-codex" in make_n("serve")
    out = make_n("serve-codex", "-o", "codex")
    assert "-m scenarios.codex_install .codex-npm" in out
    assert '--app-server "$codex app-server"' in out


def test_make_serve_installs_the_package_alone_not_the_development_tools() -> None:
    """The first `make serve` installed the whole `dev` extra (mypy, ruff, schemathesis,
    py-spy ...): about 50 s spent on what serving never runs."""
    env = {k: v for k, v in os.environ.items() if k != "MAKEFLAGS"}
    for target in ("serve", "serve-codex", "serve-codex-offline"):
        done = subprocess.run(
            ["make", "-n", "-B", "-o", "codex", target],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "pip install --quiet -C editable_mode=compat -e .;" in done.stdout, done.stdout
        assert "[dev]" not in done.stdout, done.stdout
        assert "openai-codex" not in done.stdout, done.stdout


def test_the_venvs_are_installed_by_uv_which_pip_brings_in_through_the_interpreter() -> None:
    """pip spent about 24 CPU-s on .venv and 20 on .venv-lowest of a clean clone, its
    cache warm or cold; uv about 11 and 7, byte-compiling included. uv itself comes from
    PyPI through pip, run by the interpreter (not a launcher such as pyenv's shim, which
    after `-m pip` waited a minute on a lock of its own and failed)."""
    out = make_n("-B", ".venv/.installed", ".venv-lowest/.installed", venvs_made=False)
    interpreter = subprocess.run(
        ["python3", "-c", "import sys; print(sys.executable)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert f"{interpreter} -m pip install --quiet --target .uv uv==" in out, out
    dev = "VIRTUAL_ENV=.venv .uv/bin/uv pip install --quiet --compile-bytecode"
    assert f"{dev} -C editable_mode=compat -e '.[dev]'" in out, out
    # Every editable install is a plain path, not setuptools' import hook, which each
    # Python process of the venv would import at start.
    editable = [line for line in out.splitlines() if " -e " in line]
    assert len(editable) == 2, out
    assert all("-C editable_mode=compat -e " in line for line in editable), out
    assert "VIRTUAL_ENV=.venv-lowest .uv/bin/uv pip install --quiet --compile-bytecode" in out
    assert ".uv/bin/uv venv --quiet --seed" in out  # the tests run the venv's own pip
    assert "bin/pip install" not in out, out


def test_the_real_codex_offline_is_one_target_on_the_scripted_model() -> None:
    out = make_n("serve-codex-offline", "-o", "codex")
    assert "-m scenarios.codex_install .codex-npm" in out
    assert '--bridge "$codex" -- --preset trusted' in out
    assert "--script" not in out
    out = make_n("serve-codex-offline", "-o", "codex", "MODEL_SCRIPT=replies.yaml")
    assert "-m fakes.model_provider --script replies.yaml" in out


def test_make_cluster_leaves_the_replica_count_to_the_cluster_unless_given() -> None:
    assert "--replicas" not in make_n("cluster", "-o", "nginx")
    assert "--replicas 3 " in make_n("cluster", "-o", "nginx", "REPLICAS=3")


def test_make_dist_builds_an_sdist_and_a_wheel_into_dist() -> None:
    out = make_n("-o", ".venv-build/.installed", "dist")
    assert "-m build --outdir dist ." in out


def test_make_check_runs_the_quick_tier() -> None:
    out = make_n("check")
    assert "pytest -q -m quick tests" in out


def test_make_test_shares_the_tests_out_between_xdist_workers() -> None:
    # Two per core: the tests wait on their processes much of the time.
    prepared = ("-o", "codex", "-o", "nginx")
    workers = 2 * (os.cpu_count() or 1)
    assert f"pytest -n {workers} --dist loadgroup" in make_n("pytest", *prepared)
    assert "pytest -n 3 --dist loadgroup" in make_n("pytest", *prepared, "JOBS=3")
    # The lowest versions' run beside it: one per core.
    lowest = ("-o", ".venv-lowest/.installed", *prepared)
    assert "pytest tests/bridge -q -p no:cacheprovider -n auto " in make_n("test-lowest", *lowest)


def test_make_test_runs_the_lint_the_types_and_both_test_runs_side_by_side() -> None:
    # The test runs mostly wait on child processes: side by side they fill the cores, and
    # each run's output is printed whole when it ends, not mixed line by line.
    first = make_n("test").splitlines()[0]
    assert "-j4 --output-sync=target lint typecheck pytest test-lowest" in first


def test_the_full_size_install_runs_are_left_to_make_reliability() -> None:
    # Fresh venvs installed from the index (marked `full_run`): minutes of CPU that
    # `make test` leaves out; `make reliability` runs them after its own suite.
    assert '--dist loadgroup -m "not full_run"' in make_n("pytest", "-o", "codex", "-o", "nginx")
    assert "pytest -m full_run tests" in make_n("reliability")


def test_test_lowest_leaves_out_only_tests_that_call_no_aiohttp() -> None:
    out = make_n("test-lowest", "-o", ".venv-lowest/.installed", "-o", "codex", "-o", "nginx")
    ignored = {word.split("=", 1)[1] for word in out.split() if word.startswith("--ignore=")}
    assert ignored == {
        "tests/bridge/test_codex_diff.py",
        "tests/bridge/test_codex_window.py",
        "tests/bridge/test_cli.py",
    }
    for path in ignored:  # none of them reaches aiohttp
        assert "aiohttp" not in (ROOT / path).read_text(), path


#: What a test may not reach to be left out of the lowest run: the libraries whose
#: versions that run changes (LOWEST_PINS in the Makefile), and sockets (a test that
#: takes a port to make `serve` fail has it reach its listening, aiohttp's part).
RANGED = {"aiohttp", "orjson", "faker", "Faker", "socket"}


def reached_from(test: ast.FunctionDef, functions: dict[str, ast.AST]) -> list[ast.AST]:
    """The test and every function of its module it calls, however indirectly."""
    seen: dict[str, ast.AST] = {test.name: test}
    todo: list[ast.AST] = [test]
    while todo:
        for node in ast.walk(todo.pop()):
            if isinstance(node, ast.Name) and node.id in functions and node.id not in seen:
                seen[node.id] = functions[node.id]
                todo.append(functions[node.id])
    return list(seen.values())


def test_test_lowest_leaves_out_test_by_test_only_refusals_at_start_that_reach_no_ranged_library():
    """Each test the lowest run deselects runs a command of the bridge that exits 2 at
    start (a bad setting, option or secret file): no fixture, nothing of aiohttp, orjson,
    faker or sockets in it or in any function of its module it calls, an exit status of 2
    asserted. A test that serves, or calls through aiohttp, fails this check."""
    out = make_n("test-lowest", "-o", ".venv-lowest/.installed", "-o", "codex", "-o", "nginx")
    deselected = [word.split("=", 1)[1] for word in out.split() if word.startswith("--deselect=")]
    assert deselected
    for nodeid in deselected:
        path, name = nodeid.split("::")
        tree = ast.parse((ROOT / path).read_text())
        functions: dict[str, ast.AST] = {
            node.name: node
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        # --deselect takes a prefix of node ids: it must name this test alone.
        assert [f for f in functions if f.startswith(name)] == [name], nodeid
        test = functions[name]
        assert isinstance(test, ast.FunctionDef), f"{nodeid}: a coroutine needs an event loop"
        parametrized = {
            argument.strip()
            for decorator in test.decorator_list
            if isinstance(decorator, ast.Call)
            and ast.unparse(decorator.func).endswith("parametrize")
            for names in [ast.literal_eval(decorator.args[0])]
            for argument in ([names] if isinstance(names, str) else names)
            for argument in argument.split(",")
        }
        fixtures = {a.arg for a in test.args.args} - parametrized - {"tmp_path"}
        assert not fixtures, (nodeid, fixtures)
        used = {
            node.id if isinstance(node, ast.Name) else node.attr
            for function in reached_from(test, functions)
            for node in ast.walk(function)
            if isinstance(node, ast.Name | ast.Attribute)
        }
        assert not used & RANGED, (nodeid, used & RANGED)
        assert any(
            isinstance(node, ast.Assert)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.ops[0], ast.Eq)
            and ast.unparse(node.test.comparators[0]) == "2"
            for node in ast.walk(test)
        ), f"{nodeid}: no exit status of 2 asserted"


def recipe_environment(**given: str) -> dict[str, str]:
    """The environment make gives its recipes, run with ``given`` added to ours."""
    ours = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in ours}
    done = subprocess.run(
        ["make", "--no-print-directory", "--eval", "shown-env: ; @env", "shown-env"],
        cwd=ROOT,
        env={**env, **given},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_the_bytecode_is_kept_in_the_venv_even_where_the_environment_says_not_to() -> None:
    # Each Python process `make test` starts compiled the project again when the
    # environment set PYTHONDONTWRITEBYTECODE: about 1.6 CPU-s per pytest start.
    variables = recipe_environment(PYTHONDONTWRITEBYTECODE="1")
    assert "PYTHONDONTWRITEBYTECODE" not in variables
    assert variables["PYTHONPYCACHEPREFIX"] == str(ROOT / ".venv" / "pycache")
    # A prefix of the caller's own is kept.
    own = recipe_environment(PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX="/elsewhere")
    assert own["PYTHONPYCACHEPREFIX"] == "/elsewhere"
