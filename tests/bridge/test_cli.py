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
        "print(sorted(m for m in sys.modules if m in "
        "('bridge.replica', 'bridge.front', 'bridge.cluster', 'bridge.cli')))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
