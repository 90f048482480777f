"""`rest-bridge`'s own program: what it imports, and `rest-bridge scenarios` run apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_production_cli_imports_no_harness():
    done = python(
        "import sys; import bridge.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('scenarios', 'pytest', 'jsonschema')))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_rest_bridge_scenarios_runs_the_harness_program():
    done = subprocess.run(
        [REST_BRIDGE, "scenarios", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "rest-bridge scenarios" in done.stdout
    assert Path(sys.executable).with_name("rest-bridge-scenarios").is_file()


def test_without_the_harness_extra_scenarios_says_what_to_install():
    # jsonschema made unimportable, as in an install without the `harness` extra.
    done = python(
        "import sys; sys.modules['jsonschema'] = None; from bridge.cli import main; "
        "sys.exit(main(['scenarios', 'run']))"
    )
    assert done.returncode == 2
    assert "jsonschema not installed" in done.stderr
    assert 'pip install "/path/to/codex-rest-bridge[harness]"' in done.stderr
    assert "Traceback" not in done.stderr


def test_the_request_path_imports_no_replica_front_or_cluster_module():
    """Dependencies point one way: the app, its routes and the process backend know
    peers and draining through the Backend interface, never the ops tooling."""
    done = python(
        "import sys; import bridge.app, bridge.routes, bridge.process.backend; "
        "print(sorted(m for m in sys.modules "
        "if m in ('bridge.replica', 'bridge.cli') or m.split('.')[0] == 'bridge_ops'))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_scenarios_without_its_console_script_runs_no_module_of_the_working_directory(
    tmp_path: Path,
):
    """An interpreter with no `rest-bridge-scenarios` beside it (a `pip install --user`,
    whose scripts live elsewhere) runs the harness as a module: the one `rest-bridge`
    itself finds, never a `scenarios` package of the directory it is run in."""
    venv = Path(sys.prefix)
    bare = tmp_path / "bare"  # the same environment, with nothing in bin/ but python
    (bare / "bin").mkdir(parents=True)
    (bare / "bin" / "python").symlink_to(sys.executable)
    (bare / "lib").symlink_to(venv / "lib")
    (bare / "pyvenv.cfg").write_text((venv / "pyvenv.cfg").read_text())
    here = tmp_path / "here"
    (here / "scenarios").mkdir(parents=True)
    (here / "scenarios" / "__init__.py").write_text("")
    (here / "scenarios" / "cli.py").write_text("print('not the harness')\n")
    done = subprocess.run(
        # -P: as a console script, with no working directory on sys.path.
        [
            bare / "bin" / "python",
            "-P",
            "-c",
            "import sys; from bridge.cli import main; sys.exit(main(['scenarios', '--help']))",
        ],
        cwd=here,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "not the harness" not in done.stdout
    assert "rest-bridge scenarios" in done.stdout
