"""What a process imports before it does its job: nothing its job does not need.

The test suite starts hundreds of bridges, fakes and scenario runs, and most of their
start-up CPU is importing. Each test runs the real entry point (`main` of the console
script, in a fresh interpreter, with the arguments a user gives) and reads the modules
that process had imported when it ended: a feature that is off must not be paid for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCENARIO = ROOT / "scenarios" / "library" / "approvals-session-decisions.scenario.yaml"
INITIALIZE = (
    b'{"jsonrpc":"2.0","id":1,"method":"initialize",'
    b'"params":{"clientInfo":{"name":"t","version":"1"}}}\n'
)

#: Runs ``ENTRY(argv)`` and, as the interpreter exits, writes the top-level packages it
#: imported to the file named by argv[1].
PROGRAM = """
import atexit, importlib, json, sys
out, entry = sys.argv[1], sys.argv[2]
def record():
    with open(out, "w") as f:
        json.dump(sorted({name.split(".")[0] for name in sys.modules}), f)
atexit.register(record)
module, _, name = entry.partition(":")
sys.exit(getattr(importlib.import_module(module), name)(sys.argv[3:]))
"""


def start(tmp_path: Path, entry: str, argv: Sequence[str], **popen: object) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.Popen(
        [sys.executable, "-c", PROGRAM, str(tmp_path / "modules.json"), entry, *argv],
        env=env,
        cwd=tmp_path,
        **popen,  # type: ignore[call-overload]
    )


def imported(tmp_path: Path) -> set[str]:
    return set(json.loads((tmp_path / "modules.json").read_text()))


def serve_until_listening(tmp_path: Path, *options: str) -> set[str]:
    """The packages `rest-bridge serve` imported by the time it listened (and stopped)."""
    argv = ["serve", "--port", "0", "--app-server", f"{BIN / 'fake-codex'} app-server"]
    process = start(
        tmp_path,
        "bridge.cli:main",
        [*argv, *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if b"  file descriptors:" in line:  # the banner's last line before operations
                break
        assert any(b"listening on" in line for line in lines), lines
        if "--ops-port" in options:
            assert b"operations: http://" in process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return imported(tmp_path)


def test_serve_without_the_operations_listener_imports_no_prometheus_client(
    tmp_path: Path,
) -> None:
    assert "prometheus_client" not in serve_until_listening(tmp_path)


def test_serve_with_the_operations_listener_imports_prometheus_client_at_start(
    tmp_path: Path,
) -> None:
    assert "prometheus_client" in serve_until_listening(tmp_path, "--ops-port", "0")


def test_the_scenario_runners_front_imports_no_aiohttp(tmp_path: Path) -> None:
    # The front only supervises the pytest it starts (which imports what a run needs).
    done = start(
        tmp_path,
        "scenarios.cli:main",
        ["check", str(SCENARIO)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, (out, err)
    assert b"1 test collected" in out
    assert {"aiohttp", "prometheus_client", "pydantic"}.isdisjoint(imported(tmp_path))


@pytest.mark.parametrize("script", [False, True], ids=["bare", "scripted"])
def test_fake_codex_app_server_imports_pydantic_and_yaml_only_for_a_script(
    tmp_path: Path, script: bool
) -> None:
    argv = ["app-server", *(["--script", str(SCENARIO)] if script else [])]
    fake = start(
        tmp_path,
        "fakes.app_server.cli:main",
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = fake.communicate(INITIALIZE, timeout=60)
    assert fake.returncode == 0, err
    assert b'"id":1' in out
    packages = imported(tmp_path)
    assert {"pydantic", "yaml"} <= packages if script else packages.isdisjoint({"pydantic", "yaml"})
    assert "aiohttp" not in packages


#: Runs the `rest-bridge` console script as installed, and prints how many collections
#: Python's cyclic garbage collector made from then on.
COLLECTIONS = """
import atexit, gc, sys
from importlib.metadata import entry_points
(script,) = [e for e in entry_points(group="console_scripts") if e.name == "rest-bridge"]
before = sum(generation["collections"] for generation in gc.get_stats())
atexit.register(lambda: print(sum(g["collections"] for g in gc.get_stats()) - before))
sys.argv = ["rest-bridge", "--version"]
sys.exit(script.load()())
"""


def test_rest_bridge_imports_its_modules_without_the_cyclic_garbage_collector() -> None:
    # Importing the bridge builds tens of thousands of objects and frees next to none:
    # with the collector on, it ran about 140 collections over them.
    done = subprocess.run(
        [sys.executable, "-c", COLLECTIONS], capture_output=True, text=True, timeout=120
    )
    version, collections = done.stdout.split()[-3:-1], int(done.stdout.split()[-1])
    assert version[0] == "rest-bridge", done
    assert collections < 10


def test_a_scripted_fake_codex_loads_without_the_cyclic_garbage_collector(tmp_path: Path) -> None:
    # Loading a script and the server made about 100 collections over objects that were
    # not garbage (91 + 8 in this scripted start); what is left runs before and after.
    program = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print(sum(g['collections'] for g in gc.get_stats()),"
        " file=sys.stderr))\n"
        "from fakes.app_server.cli import main\n"
        f"sys.exit(main(['app-server', '--script', {str(SCENARIO)!r}]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], input=INITIALIZE, capture_output=True, timeout=120
    )
    assert b'"id":1' in done.stdout, done
    assert int(done.stderr.split()[-1]) < 50


#: Runs fake-codex's `main` on argv[2:] and, as the interpreter exits, writes to the file
#: argv[1] how many objects Python's cyclic collector holds frozen and how many it tracks.
FROZEN = """
import atexit, gc, json, sys
def record():
    with open(sys.argv[1], "w") as f:
        json.dump([gc.get_freeze_count(), len(gc.get_objects())], f)
atexit.register(record)
from fakes.app_server.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("argv", "script"),
    [
        (["app-server", "--script", str(SCENARIO)], True),
        (["--version"], True),
        (["app-server"], False),
    ],
    ids=["serve", "version", "bare"],
)
def test_fake_codex_freezes_what_it_loaded(tmp_path: Path, argv: list[str], script: bool) -> None:
    # What loading the script, the server or the fast start made lives until the process
    # ends: frozen, the collector's first pass after loading and its passes at exit leave
    # it alone.
    out = tmp_path / "gc.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CODEX_")}
    if script:
        env["FAKE_CODEX_SCRIPT"] = str(SCENARIO)
    done = subprocess.run(
        [sys.executable, "-c", FROZEN, str(out), *argv],
        input=INITIALIZE,
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done
    frozen, tracked = json.loads(out.read_text())
    assert frozen > 4 * tracked, (frozen, tracked)


#: Imports what fake-codex's script module stands on, then imports it and loads the
#: script argv[1], printing each piece of text compiled meanwhile (pydantic compiles an
#: annotation given as text to evaluate it).
COMPILED = """
import sys
import importlib.metadata
import pydantic, pydantic.fields, pydantic.main, pydantic.types
import yaml
import fakes.app_server.protocol, fakes.app_server.script_source
compiled = []
def hook(event, args):
    if event == "compile" and args[1] == "<string>":
        compiled.append(args[0].decode() if isinstance(args[0], bytes) else str(args[0]))
sys.addaudithook(hook)
from fakes.app_server.script import load_script
load_script(sys.argv[1])
print("\\n".join(compiled))
"""


def test_loading_a_script_evaluates_no_annotation_text_but_the_recursive_step() -> None:
    # The script's models have real annotations: building them compiled the text of
    # every field's annotation (about 100 pieces) before.
    done = subprocess.run(
        [sys.executable, "-c", COMPILED, str(SCENARIO)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) <= {"Step"}, done.stdout
