"""The bridge's secrets stay out of reach of what it runs (bridge/credentials.py).

Every test starts a real `rest-bridge serve` whose app-server command is a shell script
that saves the environment it was started with (``/proc/$$/environ``: exactly what the
bridge passed) and then runs fake-codex. The `--version` probe at start-up goes through
the same script, so every process the bridge ever starts leaves its environment behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from cli_runs import main_here
from processes import marked_processes, nginx_binary

from bridge.credentials import SecretError
from bridge.errors import RestError
from bridge.models import ClientOptions
from bridge.process.backend import ProcessBackend
from bridge.settings import AppServerVariables

REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
FAKE_CODEX = str(Path(sys.executable).with_name("fake-codex"))
TOKEN = "tok-5d0c-secrets-NEVER-IN-ENVIRON"
APP_SERVER_TOKEN = "ws-tok-77ab-secrets-NEVER-IN-ENVIRON"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MARK = "SECRETS_TEST_MARK"
WAIT = 60.0


@dataclass
class Served:
    process: subprocess.Popen[str]
    base: str
    mark: str
    dumps: Path
    stderr: Path
    first_lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def environments(self) -> dict[str, bytes]:
        """What every process the bridge started was given, by `<pid>-<first arg>`."""
        return {path.stem: path.read_bytes() for path in sorted(self.dumps.glob("*.env"))}

    def live_environments(self) -> dict[int, bytes]:
        """The environment blocks of the bridge and of every live process below it."""
        found = {}
        for pid in {self.pid, *marked_processes(MARK, self.mark)}:
            try:
                found[pid] = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
        return found

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(WAIT)
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.stderr.read_text()


def dumping_app_server(directory: Path) -> str:
    """A command that saves its environment in ``directory`` and then is fake-codex."""
    dumps = directory / "dumps"
    dumps.mkdir()
    script = directory / "app-server.sh"
    script.write_text(
        f'cat /proc/$$/environ > "{dumps}/$$-${{1#--}}.env"\nexec "{FAKE_CODEX}" "$@"\n'
    )
    return f"sh {script} app-server"


def bridge_environment(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    env.update(extra)
    return env


@pytest.fixture
def start_bridge(tmp_path: Path) -> Iterator[object]:
    started: list[Served] = []

    def start(
        env: dict[str, str], *, preset: str = "trusted", prefix: tuple[str, ...] = ()
    ) -> Served:
        directory = tmp_path / f"bridge-{len(started)}"
        directory.mkdir()
        mark = uuid.uuid4().hex
        command = dumping_app_server(directory)
        stderr = directory / "stderr"
        with stderr.open("w") as err:
            process = subprocess.Popen(
                [
                    *prefix,
                    *(REST_BRIDGE, "serve", "--preset", preset, "--port", "0"),
                    *("--app-server", command),
                ],
                env=bridge_environment({**env, MARK: mark}),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        assert process.stdout is not None
        lines = []
        for line in process.stdout:  # waits on the bridge's own words
            lines.append(line)
            if " listening on " in line:
                served = Served(
                    process, line.rsplit(" ", 1)[1].strip(), mark, directory / "dumps", stderr
                )
                lines.append(process.stdout.readline())  # preset, auth and loop
                served.first_lines = lines
                started.append(served)
                return served
        process.wait(WAIT)
        pytest.fail(f"the bridge did not start: {stderr.read_text()}")

    yield start
    for served in started:
        served.stop()
        for pid in marked_processes(MARK, served.mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


SECRET_NAMES = (
    b"REST_ADAPTER_TOKEN",
    b"REST_ADAPTER_TOKEN_FILE",
    b"REST_ADAPTER_APP_SERVER_TOKEN",
    b"REST_ADAPTER_APP_SERVER_TOKEN_FILE",
)


def assert_no_secret(environments: dict[object, bytes]) -> None:
    for owner, block in environments.items():
        assert TOKEN.encode() not in block, owner
        assert APP_SERVER_TOKEN.encode() not in block, owner
        names = {entry.split(b"=", 1)[0] for entry in block.split(b"\0")}
        assert not names & set(SECRET_NAMES), (owner, names & set(SECRET_NAMES))


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["process", "shared"])
@pytest.mark.parametrize("given", ["variables", "files"])
async def test_no_secret_in_the_environ_of_the_bridge_or_anything_it_starts(
    start_bridge, tmp_path: Path, given: str, mode: str
) -> None:
    if given == "variables":
        env = {"REST_ADAPTER_TOKEN": TOKEN, "REST_ADAPTER_APP_SERVER_TOKEN": APP_SERVER_TOKEN}
    else:
        # As Kubernetes and Docker mount them: the secret and a newline, or more.
        (tmp_path / "token").write_text(TOKEN + "\n")
        (tmp_path / "app-server-token").write_text(APP_SERVER_TOKEN + " \r\n\n")
        env = {
            "REST_ADAPTER_TOKEN_FILE": str(tmp_path / "token"),
            "REST_ADAPTER_APP_SERVER_TOKEN_FILE": str(tmp_path / "app-server-token"),
        }
    served = start_bridge({**env, "REST_ADAPTER_APP_SERVER_MODE": mode})
    assert "auth: on" in "".join(served.first_lines)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
        async with http.get(served.base + "/v1/sessions") as response:
            assert response.status == 401
        async with http.get(served.base + "/v1/sessions", headers=AUTH) as response:
            assert response.status == 200  # the file's newline is not part of the token
        async with http.post(served.base + "/v1/sessions", headers=AUTH, json={}) as response:
            assert response.status == 201, await response.text()
        async with http.get(served.base + "/v1/compatibility", headers=AUTH) as response:
            assert response.status == 200
        live = served.live_environments()
        environments = served.environments()
        # The bridge, its app-server, and the `--version` probe, each seen.
        assert served.pid in live, live.keys()
        assert len(live) >= 2, live.keys()
        assert any(name.endswith("-version") for name in environments), environments.keys()
        assert any(name.endswith("-app-server") for name in environments), environments.keys()
        assert_no_secret(live)
        assert_no_secret(environments)
        # The mark the test gave the bridge is still there: only the secrets went.
        assert all(f"{MARK}={served.mark}".encode() in block for block in live.values())
    assert "Traceback" not in served.stop()


#: Runs a program as root without any capability (an empty bounding set, as its `exec`
#: leaves it): the same as any user that is not root, to itself and to its own kind.
WITHOUT_CAPABILITIES = (
    "import ctypes, os, sys\n"
    "prctl = ctypes.CDLL(None, use_errno=True).prctl\n"
    "for cap in range(64):\n"
    "    prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; past the last one it fails: fine\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)
#: Opens a process's environ and mem and reads where its stdin leads: what each gave.
OPEN_PROC_FILES = (
    "import os, sys\n"
    "found = []\n"
    "for name in ('environ', 'mem', 'fd/0'):\n"
    "    path = f'/proc/{sys.argv[1]}/{name}'\n"
    "    try:\n"
    "        os.readlink(path) if name == 'fd/0' else open(path, 'rb').close()\n"
    "        found.append(f'{name}: opened')\n"
    "    except OSError as exc:\n"
    "        found.append(f'{name}: {exc.strerror}')\n"
    "print('; '.join(found))\n"
)


def open_as_its_user(pid: int) -> str:
    """What a process of the bridge's user (root without capabilities) can open."""
    reader = (sys.executable, "-c", OPEN_PROC_FILES, str(pid))
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_CAPABILITIES, *reader],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a bridge without capabilities")
def test_a_bridge_holding_a_token_cannot_be_read_by_a_process_of_its_user(start_bridge) -> None:
    """The bridge runs as root without capabilities, as it would as a user of its own;
    the reader, root without capabilities too, is another process of that user."""
    prefix = (sys.executable, "-c", WITHOUT_CAPABILITIES)
    without_token = start_bridge({}, prefix=prefix)
    with_token = start_bridge({"REST_ADAPTER_TOKEN": TOKEN}, prefix=prefix)
    assert with_token.first_lines[1].startswith("  preset: trusted; auth: on")
    # The reader opens all three of a bridge that holds no secret...
    opened = "environ: opened; mem: opened; fd/0: opened"
    assert open_as_its_user(without_token.pid) == opened
    # ...and none of one that does.
    refused = "environ: Permission denied; mem: Permission denied; fd/0: Permission denied"
    assert open_as_its_user(with_token.pid) == refused
    # A process with CAP_SYS_PTRACE (this one) still reads it: its descriptors, as the
    # reliability tests count them, and its environment, without the token.
    assert os.listdir(f"/proc/{with_token.pid}/fd")
    assert TOKEN.encode() not in Path(f"/proc/{with_token.pid}/environ").read_bytes()


def start_failure(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """`rest-bridge serve` with ``env`` (and no other ``REST_ADAPTER_*`` variable), run by
    the CLI's own main in this process (tests/cli_runs.py): its exit status and all it
    wrote. The FIFO test below and the tests that serve with secret files run the console
    script itself. Every refusal comes before the secrets leave the environment."""
    argv = ["serve", "--port", "0", "--app-server", f"{FAKE_CODEX} app-server"]
    done = main_here(argv, monkeypatch, env)
    return done.returncode, done.stdout + done.stderr


def write_secret_files(tmp: Path) -> None:
    """The files `secret_file_cases(tmp)` names."""
    (tmp / "blank").write_text(" \n\n")
    (tmp / "token").write_text(TOKEN + "\n")
    (tmp / "unreadable").mkdir()
    (tmp / "leading-space").write_text(" " + TOKEN + "\n")
    (tmp / "latin-1").write_bytes(b"caf\xe9\n")


def secret_file_cases(tmp: Path) -> list[tuple[dict[str, str], str]]:
    cases = []
    for variable in ("REST_ADAPTER_TOKEN", "REST_ADAPTER_APP_SERVER_TOKEN"):
        file_variable = variable + "_FILE"
        cases += [
            ({file_variable: str(tmp / "missing")}, f"{file_variable}: cannot read "),
            ({file_variable: str(tmp / "unreadable")}, f"{file_variable}: cannot read "),
            ({file_variable: str(tmp / "blank")}, f"{file_variable}: "),
            ({file_variable: ""}, f"{file_variable} is empty"),
            (
                {variable: TOKEN, file_variable: str(tmp / "token")},
                f"{variable} and {file_variable} are both set",
            ),
        ]
    cases.append(
        (
            {"REST_ADAPTER_TOKEN_FILE": str(tmp / "leading-space")},
            "the token in REST_ADAPTER_TOKEN_FILE has leading or trailing whitespace",
        )
    )
    cases.append(({"REST_ADAPTER_TOKEN_FILE": str(tmp / "latin-1")}, "is not UTF-8 text"))
    # Bigger than any token: refused before it is read whole.
    cases.append(({"REST_ADAPTER_TOKEN_FILE": "/dev/zero"}, "is larger than 65536 bytes"))
    # A misspelt secret variable would start the bridge with auth off: refused, by name.
    for misspelt in (
        "REST_ADAPTER_TOKN_FILE",
        "REST_ADAPTER_BEARER_TOKEN",
        "REST_ADAPTER_TOKEN_FIL",
    ):
        cases.append(({misspelt: str(tmp / "token")}, f"{misspelt} is not a variable"))
    # The app-server token goes in a header too: one no header can carry is refused.
    for token in ("ab\x01cd", " " + APP_SERVER_TOKEN):
        cases.append(
            (
                {"REST_ADAPTER_APP_SERVER_TOKEN": token, "REST_ADAPTER_APP_SERVER_MODE": "shared"},
                "REST_ADAPTER_APP_SERVER_TOKEN ",
            )
        )
    return cases


#: One test per case, each reported by name.
SECRET_CASES = secret_file_cases(Path("tmp"))


@pytest.mark.quick
@pytest.mark.parametrize(
    "index", range(len(SECRET_CASES)), ids=[",".join(env) for env, _ in SECRET_CASES]
)
def test_a_secret_file_that_cannot_be_used_stops_serve(
    tmp_path: Path, index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_secret_files(tmp_path)
    env, expected = secret_file_cases(tmp_path)[index]
    status, output = start_failure(env, monkeypatch)
    assert status == 2, (env, output)
    assert expected in output, (env, output)
    assert output.startswith("rest-bridge: "), output
    assert output.count("\n") == 1, output  # one line
    assert TOKEN not in output
    assert APP_SERVER_TOKEN not in output
    assert "Traceback" not in output


def test_a_secret_file_that_is_a_fifo_stops_serve_instead_of_waiting_for_a_writer(
    tmp_path: Path,
) -> None:
    """A FIFO no one writes to would hold `serve` at its start for ever: refused, by name."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for variable in ("REST_ADAPTER_TOKEN_FILE", "REST_ADAPTER_APP_SERVER_TOKEN_FILE"):
        env = {variable: str(fifo)}
        if variable.startswith("REST_ADAPTER_APP_SERVER"):
            env["REST_ADAPTER_APP_SERVER_MODE"] = "shared"
        process = subprocess.Popen(
            [REST_BRIDGE, "serve", "--port", "0", "--app-server", f"{FAKE_CODEX} app-server"],
            env=bridge_environment(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            output, _ = process.communicate(timeout=WAIT)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 2, output
        refusal = f"{variable}: {str(fifo)!r} is a FIFO: it would wait for a writer"
        assert output == f"rest-bridge: {refusal}\n"


RESERVED = {
    "REST_ADAPTER_CLUSTER_MARK": "x",
    "REST_ADAPTER_PROCESS_MARK": "y",
    "REST_ADAPTER_BRIDGE_MARK": "w",
    "REST_ADAPTER_TOKEN": "z",
}


@pytest.mark.asyncio
async def test_options_env_may_not_name_a_rest_adapter_variable(start_bridge) -> None:
    """In every preset and mode: 403 options_not_allowed, and nothing is started."""
    configurations = [
        ("trusted", "process", ["/v1/sessions", "/v1/call/model/list", "/v1/text-turn"]),
        ("text-turn", "process", ["/v1/text-turn"]),
        ("default", "process", ["/v1/sessions", "/v1/text-turn"]),
        ("trusted", "shared", ["/v1/sessions", "/v1/call/model/list", "/v1/text-turn"]),
    ]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
        for preset, mode, paths in configurations:
            served = start_bridge({"REST_ADAPTER_APP_SERVER_MODE": mode}, preset=preset)
            before = served.environments()
            for path in paths:
                for name, value in RESERVED.items():
                    body = {"options": {"env": {"SOMETHING": "fine", name: value}}}
                    if path == "/v1/text-turn":
                        body["text"] = "hi"
                    async with http.post(served.base + path, json=body) as response:
                        payload = await response.json()
                        where = (preset, mode, path, name)
                        assert response.status == 403, (where, payload)
                        assert payload["error"] == "options_not_allowed", (where, payload)
                        if preset != "default":  # which refuses `env` altogether
                            assert payload["data"] == {"fields": ["env"], "variables": [name]}
                            assert name in payload["message"]
            assert served.environments() == before  # nothing was started
            assert not marked_processes(MARK, served.mark) - {served.pid}


@pytest.mark.quick
@pytest.mark.asyncio
async def test_the_library_backend_refuses_a_rest_adapter_variable_too() -> None:
    """A host calling ProcessBackend itself, without a router in front."""
    backend = ProcessBackend([FAKE_CODEX, "app-server"])
    options = ClientOptions.model_validate({"env": {"REST_ADAPTER_CLUSTER_MARK": "x"}})
    try:
        with pytest.raises(RestError) as raised:
            await backend.create_session(options)
        assert (raised.value.status, raised.value.kind) == (403, "options_not_allowed")
        assert not backend.sessions()
    finally:
        await backend.close()


def status_of(method: str, url: str, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method)
    request.add_header("Content-Type", "application/json")
    for name, value in headers.items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        error.close()
        return error.code


def test_the_cluster_launcher_and_nginx_hold_no_secret(tmp_path: Path) -> None:
    """`rest-bridge cluster` hands the token to its replicas only, and forgets it."""
    mark = uuid.uuid4().hex
    command = dumping_app_server(tmp_path)
    # nginx writes its process title over its original environment: what it was given
    # is saved by a wrapper, as the app-servers' is.
    nginx = tmp_path / "nginx.sh"
    nginx.write_text(
        f'#!/bin/sh\ncat /proc/$$/environ > "{tmp_path}/dumps/$$-nginx.env"\n'
        f'exec "{nginx_binary()}" "$@"\n'
    )
    nginx.chmod(0o755)
    process = subprocess.Popen(
        [
            *(REST_BRIDGE, "cluster", "--replicas", "1", "--port", "0"),
            *("--nginx", str(nginx), "--dir", str(tmp_path / "front")),
            *("--app-server", command),
        ],
        env=bridge_environment({"REST_ADAPTER_TOKEN": TOKEN, MARK: mark}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "rest-bridge cluster: ready" in line or "rest-bridge cluster: stopped" in line:
                ready.set()
        ready.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert ready.wait(WAIT)
        front = next(line.split()[3] for line in lines if "rest-bridge cluster: front " in line)
        assert status_of("GET", front + "/v1/sessions", {}) == 401
        assert status_of("POST", front + "/v1/sessions", AUTH) == 201
        blocks = {}
        for pid in {process.pid, *marked_processes(MARK, mark)}:
            with contextlib.suppress(OSError):
                blocks[pid] = Path(f"/proc/{pid}/environ").read_bytes()
        # The launcher, the replica and its app-server, running...
        assert process.pid in blocks
        assert len(blocks) >= 3, blocks.keys()
        assert_no_secret(blocks)
        # ...and what nginx, the app-server and the probe were started with.
        environments = {p.stem: p.read_bytes() for p in (tmp_path / "dumps").glob("*.env")}
        for kind in ("-nginx", "-app-server", "-version"):
            assert any(name.endswith(kind) for name in environments), environments.keys()
        assert_no_secret(environments)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(WAIT)
        reader.join(WAIT)
        if process.stdout is not None:
            process.stdout.close()
        for pid in marked_processes(MARK, mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in "".join(lines)


@pytest.mark.quick
def test_app_server_settings_read_the_token_file_too(tmp_path: Path) -> None:
    """The library's way in (and the harness's): AppServerVariables.from_env(...).app_server()."""
    (tmp_path / "ws-token").write_text(APP_SERVER_TOKEN + "\n")
    url = {"REST_ADAPTER_APP_SERVER_URL": "ws://127.0.0.1:9"}
    env = {**url, "REST_ADAPTER_APP_SERVER_TOKEN_FILE": str(tmp_path / "ws-token")}
    assert AppServerVariables.from_env(env).app_server().token == APP_SERVER_TOKEN
    with pytest.raises(SecretError, match="are both set"):
        AppServerVariables.from_env({**env, "REST_ADAPTER_APP_SERVER_TOKEN": "x"}).app_server()
    assert APP_SERVER_TOKEN not in repr(AppServerVariables.from_env(env).app_server())
