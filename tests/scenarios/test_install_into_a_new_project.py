"""A host team's first hour: install the package as README.md says, write the scenario
and the test of scenarios/README.md's first example, and both run green.

The install commands are read from README.md's "Install" block and run as written (by
bash, `BRIDGE` set to a clone of this checkout, `pip` the one of a fresh venv), one
test per command; the example files are read from scenarios/README.md. So the docs
cannot drift from what works: change either, and this test runs the new text.

Those runs are marked `full_run` (each form: venv 5 s, install 20 s, the runs 15 s; the
wheel builds first; about 110 s of CPU in all): `make reliability` runs them, `make test`
leaves them out and runs the cheaper check at the end of this module instead (the wheel
builds, installs into a fresh venv and its console scripts start). pip runs as the machine
has it set up (its index and find-links configuration).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from bridge import __version__

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SCENARIOS_README = ROOT / "scenarios" / "README.md"
#: The comment just before the block of install commands in README.md.
INSTALL_MARKER = "tests/scenarios/test_install_into_a_new_project.py runs each line"

# One xdist worker: the tests share the module's clone and its wheel.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("install")]
#: A fresh venv and an install from the index: `make reliability` runs it, not `make test`.
full_run = pytest.mark.full_run

VERSIONS = """
import subprocess, sys
from importlib.metadata import version
import bridge
print(version("codex-rest-bridge"), bridge.__version__)
said = subprocess.run(["rest-bridge", "--version"], capture_output=True, text=True).stdout
print(said.split()[-1])
"""


def documented_installs() -> dict[str, str]:
    """README.md's install commands, by form: `checkout`, `git`, `wheel`."""
    text = README.read_text(encoding="utf-8")
    assert INSTALL_MARKER in text, "README.md lost its install block's marker"
    block = text.split(INSTALL_MARKER, 1)[1].split("```sh\n", 1)[1].split("\n```", 1)[0]
    commands: dict[str, str] = {}
    for line in block.splitlines():
        command = line.split("  #", 1)[0].strip()
        if not command:
            continue
        form = "git" if "git+" in command else "wheel" if " dist" in command else "checkout"
        assert form not in commands, f"two {form} commands in README.md's install block"
        commands[form] = command
    assert set(commands) == {"checkout", "git", "wheel"}, commands
    return commands


def documented_file(name: str) -> str:
    """The code block of scenarios/README.md whose first line is `# NAME`."""
    text = SCENARIOS_README.read_text(encoding="utf-8")
    found = re.search(rf"```\w+\n# {re.escape(name)}\n(.*?)```", text, re.DOTALL)
    assert found, f"scenarios/README.md has no `# {name}` example"
    return found.group(1)


def run(
    args: list[str], cwd: Path, env: dict[str, str], *, status: int = 0
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == status, f"{' '.join(args)}\n{done.stdout}\n{done.stderr}"
    return done


def host_environment() -> dict[str, str]:
    """The host's environment: none of this checkout's Python settings leak in."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "CI")
        and not key.startswith(("FAKE_CODEX_", "REST_ADAPTER_", "PYTEST_XDIST"))
    }


def tracked_files() -> list[str]:
    """What a clone of this checkout holds: its files, committed or not, minus ignored."""
    if shutil.which("git") and (ROOT / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode()  # fmt: skip
        return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]
    ignored = {".venv", ".venv-build", ".codex-npm", "dist", "build", ".git"}
    return [
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*")
        if path.is_file()
        and not ignored & set(path.relative_to(ROOT).parts)
        and "__pycache__" not in path.parts
    ]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone of this checkout as a newcomer has it: a git repository of its files
    (uncommitted changes included, so the test runs what is being tested)."""
    target = tmp_path_factory.mktemp("clone") / "codex-rest-bridge"
    for name in tracked_files():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)
    env = host_environment()
    identity = ["-c", "user.name=first hour", "-c", "user.email=first-hour@example.invalid"]
    run(["git", "init", "--quiet"], target, env)
    run(["git", "add", "--all"], target, env)
    run(["git", *identity, "commit", "--quiet", "-m", "clone"], target, env)
    return target


@full_run
@pytest.mark.parametrize("form", ["checkout", "git", "wheel"])
def test_the_documented_install_then_a_scenario_and_a_test_run_green(
    tmp_path: Path, clone: Path, form: str
) -> None:
    command = documented_installs()[form]
    env = host_environment()
    timings: dict[str, float] = {}

    # The project keeps its venv inside, as `.venv`, the way most do.
    project = tmp_path / "host-project"
    project.mkdir()
    started = time.monotonic()
    venv = project / ".venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    timings["make the venv"] = time.monotonic() - started
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["BRIDGE"] = str(clone)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    started = time.monotonic()
    run(["bash", "-euo", "pipefail", "-c", command], tmp_path, env)
    timings[command] = time.monotonic() - started
    python = str(venv / "bin" / "python")
    where = run(
        [python, "-c", "import scenarios.pytest_plugin as p; print(p.__file__)"], tmp_path, env
    )
    assert where.stdout.startswith(str(venv)), where.stdout  # installed, not the clone's
    # One version: the package's metadata, `rest-bridge --version`, bridge.__version__.
    version = run([python, "-c", VERSIONS], tmp_path, env).stdout.split()
    assert version == [__version__] * 3, version
    if form == "wheel":
        (wheel,) = (clone / "dist").glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
        assert {"bridge/py.typed", "fakes/py.typed", "scenarios/py.typed"} <= names
        assert "bridge_ops/nginx.conf.template" in names
    # The front's configuration, from the template the package ships.
    front = run(["rest-bridge", "front-config", "--replica", "a=127.0.0.1:1"], tmp_path, env)
    assert "upstream replica_a {" in front.stdout, front.stdout + front.stderr

    (project / "hello.scenario.yaml").write_text(documented_file("hello.scenario.yaml"))
    (project / "test_bridge.py").write_text(documented_file("test_bridge.py"))

    started = time.monotonic()
    done = run(["pytest", "-q", "-n", "2", "-p", "no:cacheprovider"], project, env)
    timings["pytest -n 2"] = time.monotonic() - started
    output = done.stdout + done.stderr
    assert "2 passed" in done.stdout, output
    assert "PytestDeprecationWarning" not in output
    assert "asyncio_default_fixture_loop_scope" not in output
    assert str(ROOT) not in output  # the plugin came from the venv, not this checkout

    started = time.monotonic()
    done = run(["rest-bridge", "scenarios", "run", "."], project, env)
    timings["rest-bridge scenarios run"] = time.monotonic() - started
    assert "1 passed in" in done.stdout, done.stdout  # the scenario, not the venv's library
    assert "warning" not in done.stdout.lower(), done.stdout

    # The `respx` extra is not installed: its fixtures say which extra to install.
    mocked = tmp_path / "respx-project"
    mocked.mkdir()
    (mocked / "test_mock.py").write_text(
        "def test_mock(codex_respx):\n"
        "    codex_respx({'scenario': 1, 'steps': [{'http': {'path': '/health'}}]})\n"
    )
    done = run(["pytest", "-q", "-p", "no:cacheprovider"], mocked, env, status=1)
    assert "install codex-rest-bridge with its `respx` extra" in done.stdout, done.stdout
    print("timings:", ", ".join(f"{name}: {seconds:.1f}s" for name, seconds in timings.items()))


BASE_HOST_TEST = """
import pytest


@pytest.fixture
def sse():  # a host's own fixture named like the plugin's old ones
    return "the host's"


def test_the_hosts_own_fixture_wins(sse):
    assert sse == "the host's"


def test_asks_for_a_harness_fixture(codex_bridge):
    pass
"""


@full_run
def test_a_base_install_leaves_a_host_pytest_alone(tmp_path: Path, clone: Path) -> None:
    """Without the `harness` extra (pytest installed by the host itself), the plugin is
    there, collides with nothing, and a harness fixture says which extra it needs."""
    env = host_environment()
    project = tmp_path / "base-project"
    project.mkdir()
    venv = project / ".venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    run(["pip", "install", "--quiet", str(clone), "pytest"], tmp_path, env)
    python = str(venv / "bin" / "python")
    for absent in ("pytest_asyncio", "xdist", "jsonschema", "jsonpath_ng"):
        found = run([python, "-c", f"import importlib.util as u; print(u.find_spec({absent!r}))"],
                    tmp_path, env)  # fmt: skip
        assert found.stdout.strip() == "None", f"{absent} is installed: not a base install"
    (project / "test_host.py").write_text(BASE_HOST_TEST)
    done = run(["pytest", "-q", "-p", "no:cacheprovider", "-W", "error"], project, env, status=1)
    output = done.stdout + done.stderr
    assert "1 passed, 1 error" in done.stdout, output
    assert "needs pytest-asyncio: install codex-rest-bridge with its `harness` extra" in output
    plugins = run(["pytest", "--co", "-q", "-p", "no:cacheprovider"], project, env).stdout
    assert "2 tests collected" in plugins, plugins


def test_the_wheel_installs_into_a_fresh_venv_and_its_console_scripts_start(
    tmp_path: Path,
) -> None:
    """What `make test` keeps of the runs above, at a tenth of their cost: the wheel of
    this checkout builds, installs into a fresh venv, and what it installed runs there.

    The venv has no pip of its own and installs no dependency: this venv's pip installs
    the wheel alone into it (`--python`), and a path line (a `.pth` file) lends it this
    venv's site-packages for the dependencies. That path line processes none of the
    `.pth` files there, so this checkout's editable install stays out of it: what is
    imported is what the wheel installed (asserted below).
    """
    source = tmp_path / "codex-rest-bridge"
    for name in tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    env = host_environment()
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels),
         str(source)], tmp_path, env)  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {"bridge/py.typed", "fakes/py.typed", "scenarios/py.typed"} <= names
    assert "bridge_ops/nginx.conf.template" in names

    venv = tmp_path / "host" / ".venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = str(venv / "bin" / "python")
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  tmp_path, env).stdout.strip()  # fmt: skip
    Path(purelib, "lent-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
         str(wheel)], tmp_path, env)  # fmt: skip
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)

    where = run(
        [python, "-c", "import bridge, scenarios.pytest_plugin as p; print(bridge.__file__, "
         "p.__file__)"], tmp_path, env,
    ).stdout.split()  # fmt: skip
    assert all(path.startswith(purelib) for path in where), where  # the wheel's, no other
    plugin = run(
        [python, "-c", "from importlib.metadata import distribution as d; "
         "print(*(e.value for e in d('codex-rest-bridge').entry_points if e.group == 'pytest11'))"],
        tmp_path, env,
    ).stdout.split()  # fmt: skip
    assert plugin == ["scenarios.pytest_plugin"], plugin
    # One version: the package's metadata, `rest-bridge --version`, bridge.__version__.
    version = run([python, "-c", VERSIONS], tmp_path, env).stdout.split()
    assert version == [__version__] * 3, version
    for script in ("rest-bridge", "rest-bridge-scenarios", "fake-codex"):
        assert (venv / "bin" / script).exists(), script
        said = run([script, "--help"], tmp_path, env).stdout
        assert "usage:" in said, (script, said)
    # The front's configuration, from the template the wheel ships.
    front = run(["rest-bridge", "front-config", "--replica", "a=127.0.0.1:1"], tmp_path, env)
    assert "upstream replica_a {" in front.stdout, front.stdout + front.stderr
