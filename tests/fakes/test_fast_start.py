"""The fast start (fakes/app_server/fast.py) is invisible on the wire.

A script-less fake-codex answers its opening without asyncio, then hands over to the
asyncio server. Under one seed, every conversation here must give the same bytes with
the fast start on and off (`FAKE_CODEX_FAST=0`), whatever comes first: a clean opening,
garbage, a request before `initialize`, a second `initialize`, a last line without a
newline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from fakes.app_server.cli import _parser, _parser_defaults

FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
TIMEOUT = 20

INITIALIZE = b'{"id":1,"method":"initialize","params":{"clientInfo":{"name":"t","version":"1"}}}'
INITIALIZED = b'{"method":"initialized"}'
THREAD_START = b'{"id":2,"method":"thread/start","params":{}}'


def turn_start(thread_id: str) -> bytes:
    params = {"threadId": thread_id, "input": [{"type": "text", "text": "hi"}]}
    return orjson.dumps({"id": 3, "method": "turn/start", "params": params})


def fake(tmp_path: Path, fast: bool) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CODEX")}
    env.update(
        FAKE_CODEX_SEED="11",
        FAKE_CODEX_FAST="1" if fast else "0",
        CODEX_HOME=str(tmp_path / "codex-home"),
        TERM="dumb",
    )
    return subprocess.Popen(
        [FAKE_CODEX, "app-server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )


def read_until(proc: subprocess.Popen[bytes], done: bytes) -> list[bytes]:
    """Lines of stdout up to and including the first that contains ``done``."""
    assert proc.stdout is not None
    lines = []
    for line in iter(proc.stdout.readline, b""):
        lines.append(line)
        if done in line:
            return lines
    raise AssertionError(f"stdout ended before {done!r}: {lines}")


def conversation(tmp_path: Path, fast: bool, opening: list[bytes]) -> tuple[list[bytes], bytes]:
    """``opening``, then (if it initialized) a thread and a turn to its end; stdout lines
    and stderr, after the fake exits at the end of its input."""
    proc = fake(tmp_path, fast)
    assert proc.stdin is not None
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        proc.stdin.write(b"".join(line + b"\n" for line in opening) + THREAD_START + b"\n")
        proc.stdin.flush()
        lines = read_until(proc, b'"id":2,')
        answer = orjson.loads(lines[-1])
        if "result" in answer:
            proc.stdin.write(turn_start(answer["result"]["thread"]["id"]) + b"\n")
            proc.stdin.flush()
            lines += read_until(proc, b'"turn/completed"')
        proc.stdin.close()
        lines += proc.stdout.readlines()
        stderr = proc.stderr.read()
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return lines, stderr


OPENINGS = {
    "clean": [INITIALIZE, INITIALIZED],
    "blank lines first": [b"", b"   ", INITIALIZE, b"", INITIALIZED],
    "no initialized notification": [INITIALIZE],
    "garbage first": [b"not json", b"[1, 2]", INITIALIZE, INITIALIZED],
    "request before initialize": [b'{"id":9,"method":"model/list","params":{}}', INITIALIZE],
    "initialize twice": [INITIALIZE, INITIALIZED, INITIALIZE.replace(b'"id":1', b'"id":5')],
    "initialize without params": [b'{"id":1,"method":"initialize"}', INITIALIZE],
    "clientInfo not an object": [INITIALIZE.replace(b'{"name":"t","version":"1"}', b"7")],
    "initialized before initialize": [INITIALIZED, INITIALIZE, INITIALIZED],
    "boolean id": [INITIALIZE.replace(b'"id":1', b'"id":true'), INITIALIZE],
}


@pytest.mark.parametrize("opening", list(OPENINGS))
def test_the_fast_start_writes_what_the_server_writes(tmp_path, opening):
    fast_lines, fast_err = conversation(tmp_path, True, OPENINGS[opening])
    slow_lines, slow_err = conversation(tmp_path, False, OPENINGS[opening])
    assert fast_lines == slow_lines
    assert fast_err == slow_err
    assert len(fast_lines) >= 2


@pytest.mark.parametrize("fast", [True, False])
def test_a_last_line_without_a_newline_is_answered_then_the_fake_exits(tmp_path, fast):
    proc = fake(tmp_path, fast)
    out, err = proc.communicate(INITIALIZE, timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert [orjson.loads(line).get("id") for line in out.splitlines()] == [1, None]


OPEN_THEN_EXIT = """
import sys
sys.argv = ["fake-codex", "app-server"]
from fakes.app_server.cli import main
code = main()
sys.stderr.write("asyncio imported: %s\\n" % ("asyncio" in sys.modules))
sys.exit(code)
"""


@pytest.mark.parametrize(
    ("lines", "imported"),
    [([INITIALIZE, INITIALIZED], False), ([INITIALIZE, INITIALIZED, THREAD_START], True)],
)
def test_asyncio_is_imported_only_when_the_session_goes_on(tmp_path, lines, imported):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CODEX")}
    env["CODEX_HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", OPEN_THEN_EXIT],
        input=b"".join(line + b"\n" for line in lines),
        capture_output=True,
        env=env,
        timeout=TIMEOUT,
        check=True,
    )
    assert done.stderr.decode().strip().endswith(f"asyncio imported: {imported}")
    ids = [orjson.loads(line).get("id") for line in done.stdout.splitlines()]
    assert ids[:2] == [1, None]
    assert (2 in ids) == imported


@pytest.mark.quick
def test_the_bare_command_line_parses_as_argparse_would():
    assert vars(_parser_defaults()) == vars(_parser().parse_args(["app-server"]))
