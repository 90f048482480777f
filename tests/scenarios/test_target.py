"""`--codex-target URL`: scenarios against a bridge that is already running.

The target is a real `rest-bridge serve` child process; the scenarios run through
`rest-bridge scenarios run --target URL` (the plugin's `--codex-target`), as a team
runs them against its staging deployment. What cannot run there skips, saying why.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import socketserver
import subprocess
import sys
import textwrap
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
from front_here import Ran, run_here
from processes import quiet_pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "scenarios" / "library"
BIN = Path(sys.executable).parent
# Spaces, quotes, a colon and a hash: the scenarios' YAML could not carry it as text.
TOKEN = 'staging t0k3n: #1 "q"'

pytestmark = pytest.mark.timeout(600)
pytest_plugins = ["pytester"]


class Served:
    """`rest-bridge serve` on a free port; its URL once it says it listens."""

    def __init__(self, *args: str, token: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
        if token is not None:
            env["REST_ADAPTER_TOKEN"] = token
        self.process = subprocess.Popen(
            [str(BIN / "rest-bridge"), "serve", "--port", "0", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.process.stdout is not None
        seen = []
        for line in self.process.stdout:  # ends when the process does
            seen.append(line)
            if " listening on " in line:
                self.url = line.rsplit(" ", 1)[1].strip()
                return
        raise AssertionError("rest-bridge serve did not start:\n" + "".join(seen))

    def get(self, path: str, token: str | None = None, method: str = "GET") -> object:
        data = b"{}" if method == "POST" else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=30) as response:
            return orjson.loads(response.read())

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.fixture
def served() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for bridge in started:
        bridge.stop()


def fake(*script: str) -> list[str]:
    command = f"{BIN / 'fake-codex'} app-server"
    if script:
        command += f" --script {script[0]}"
    return ["--app-server", command]


def run(
    *args: str,
    token: str | None = None,
    ci: bool = False,
    pytest_itself: bool = False,
    token_file: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`rest-bridge scenarios run ARGS` (or pytest with the plugin's own options), with
    `CI` set to true or unset whatever the suite runs under."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    env.pop("CI", None)
    if ci:
        env["CI"] = "true"
    if token is not None:
        env["REST_ADAPTER_TOKEN"] = token
    if token_file is not None:
        env["REST_ADAPTER_TOKEN_FILE"] = str(token_file)
    front = (
        [sys.executable, "-m", "pytest"]
        if pytest_itself
        else [BIN / "rest-bridge", "scenarios", "run"]
    )
    return subprocess.run(
        [*map(str, front), "-p", "no:cacheprovider", "-v", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=quiet_pytest(env),
        timeout=500,
        check=False,
    )


Run = Callable[..., Ran]


@pytest.fixture
def here(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Run:
    """`run` in this process (`front_here`): the same arguments and environment, for the
    runs that are about what a run against a target does, not about its processes."""

    def run_in_process(
        *args: str,
        token: str | None = None,
        ci: bool = False,
        pytest_itself: bool = False,
        token_file: Path | None = None,
    ) -> Ran:
        with monkeypatch.context() as env:
            for name in [name for name in os.environ if name.startswith("REST_ADAPTER_")]:
                env.delenv(name)
            env.delenv("CI", raising=False)
            if ci:
                env.setenv("CI", "true")
            if token is not None:
                env.setenv("REST_ADAPTER_TOKEN", token)
            if token_file is not None:
                env.setenv("REST_ADAPTER_TOKEN_FILE", str(token_file))
            front = () if pytest_itself else ("run",)
            argv = (*front, "-p", "no:cacheprovider", "-v", *args)
            return run_here(pytester, *argv, front=not pytest_itself)

    return run_in_process


def outcomes(stdout: str) -> dict[str, str]:
    """`name: PASSED|FAILED|SKIPPED` from pytest's -v lines."""
    found = {}
    for line in stdout.splitlines():
        if ".scenario.yaml::" in line and line.split()[-2:-1]:
            node, _, rest = line.partition(" ")
            if rest.split()[:1] in (["PASSED"], ["FAILED"], ["SKIPPED"]):
                found[node.split("::")[1]] = rest.split()[0]
    return found


def test_the_library_runs_against_a_running_bridge_and_the_rest_skips_saying_why(
    served: list[Served], here: Run
) -> None:
    target = Served(*fake(), token=TOKEN)
    served.append(target)
    # Under CI=true too: skips beside scenarios that ran are no failure.
    done = here(str(LIBRARY), "--target", target.url, token=TOKEN, ci=True)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = outcomes(done.stdout)
    assert len(seen) == len(list(LIBRARY.glob("*.scenario.yaml"))), done.stdout
    # Auth on (a token), no appServer script, no limits, the trusted preset: these run.
    for name in ("auth-rejection", "auth-variants"):
        assert seen[name] == "PASSED", done.stdout
    # The rest skip, each with its reason.
    assert seen["errors-client-mistakes"] == "SKIPPED"
    assert seen["routes-text-turn-preset"] == "SKIPPED"
    assert seen["turn-stream-and-resume"] == "SKIPPED"
    reasons = done.stdout
    assert "the target has auth on, and the scenario is written for a bridge without it" in (
        reasons
    )
    assert "scripts the app-server (`appServer:`), and the target runs another" in reasons
    assert "scripts the model (`model:`)" in reasons
    assert "sets limits (`bridge.limits`)" in reasons
    assert TOKEN not in done.stdout + done.stderr  # the secret is never printed

    # A target with auth off runs the scenarios without a token, and skips the others.
    open_target = Served(*fake())
    served.append(open_target)
    done = here(str(LIBRARY), "--target", open_target.url, token=TOKEN)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = outcomes(done.stdout)
    assert seen["errors-client-mistakes"] == "PASSED", done.stdout
    assert seen["auth-variants"] == "SKIPPED", done.stdout
    assert "the scenario turns auth on (`bridge.token`); the target has auth off" in done.stdout
    assert "the scenario wants the text-turn preset; the target's routes are those of trusted" in (
        done.stdout
    )
    # They ran there: the sessions they created are the target's.
    listed = open_target.get("/v1/sessions")
    assert isinstance(listed, dict), listed
    assert listed["sessions"], listed


def test_a_scenario_without_a_token_skips_on_a_target_with_auth_on(
    served: list[Served], here: Run
) -> None:
    """It is written for a bridge without auth (routes-trusted checks that the OpenAPI
    document has no security scheme): skipped, with or without the target's token."""
    scenario = LIBRARY / "routes-trusted.scenario.yaml"
    target = Served(*fake(str(scenario)), token=TOKEN)
    served.append(target)
    for token in (TOKEN, None):
        done = here(
            str(scenario), "--target", target.url, "--target-script", str(scenario), token=token
        )
        assert outcomes(done.stdout) == {"routes-trusted": "SKIPPED"}, done.stdout
        assert "the target has auth on, and the scenario is written for a bridge without" in (
            done.stdout
        )


def test_without_the_token_a_scenario_that_turns_auth_on_skips(
    served: list[Served], here: Run
) -> None:
    target = Served(*fake(), token=TOKEN)
    served.append(target)
    scenario = str(LIBRARY / "auth-rejection.scenario.yaml")
    done = here(scenario, "--target", target.url)
    assert done.returncode == 0, done.stdout
    assert (
        "turns auth on: set REST_ADAPTER_TOKEN (or REST_ADAPTER_TOKEN_FILE) to the target's token"
        in done.stdout
    )
    # Under CI=true a run in which every scenario skipped checked nothing: it fails, from
    # the front, from pytest itself and under xdist (whose workers report to the main one).
    # Under xdist the workers are processes: that run starts pytest for real.
    for extra, pytest_itself in (((), False), ((), True), (("-n", "2"), True)):
        args = (scenario, "--codex-target" if pytest_itself else "--target", target.url)
        start = run if extra else here
        done = start(*args, *extra, ci=True, pytest_itself=pytest_itself)
        assert done.returncode == 1, done.stdout
        assert "turns auth on: set REST_ADAPTER_TOKEN" in done.stdout, done.stdout
        assert "CI=true: all 1 scenarios were skipped and none ran, which fails" in done.stdout, (
            done.stdout
        )
        assert "Skipped: Skipped:" not in done.stdout


def test_the_targets_token_can_come_from_a_file_as_serve_reads_it(
    served: list[Served], tmp_path: Path, here: Run
) -> None:
    """REST_ADAPTER_TOKEN_FILE, as a mounted secret gives it (a trailing newline); a file
    that cannot be used stops the run naming the variable's file, never a token."""
    target = Served(*fake(), token=TOKEN)
    served.append(target)
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    scenario = str(LIBRARY / "auth-variants.scenario.yaml")
    for pytest_itself in (False, True):
        args = (scenario, "--codex-target" if pytest_itself else "--target", target.url)
        done = here(*args, token_file=secret, pytest_itself=pytest_itself)
        assert done.returncode == 0, done.stdout + done.stderr
        assert outcomes(done.stdout) == {"auth-variants": "PASSED"}, done.stdout
        assert TOKEN not in done.stdout + done.stderr
    done = here(scenario, "--target", target.url, token_file=tmp_path / "missing")
    assert done.returncode not in (0, 1), done.stdout + done.stderr
    assert "REST_ADAPTER_TOKEN_FILE" in done.stdout + done.stderr or "missing" in (
        done.stdout + done.stderr
    )
    assert "Traceback" not in done.stdout + done.stderr


def test_a_wrong_token_is_said_to_be_refused_by_the_target_and_never_printed(
    served: list[Served], here: Run
) -> None:
    target = Served(*fake(), token=TOKEN)
    served.append(target)
    wrong = "wr0ng-s3cret-t0ken"
    done = here(str(LIBRARY / "auth-variants.scenario.yaml"), "--target", target.url, token=wrong)
    assert done.returncode == 1, done.stdout
    assert f"{target.url}: the target refused the token in $REST_ADAPTER_TOKEN (401 to GET " in (
        done.stdout
    ), done.stdout
    assert "TargetError" not in done.stdout, done.stdout
    assert wrong not in done.stdout + done.stderr
    assert TOKEN not in done.stdout + done.stderr


def test_a_scenario_whose_script_the_target_runs_runs_there(
    served: list[Served], tmp_path: Path, here: Run
) -> None:
    scenario = tmp_path / "hello.scenario.yaml"
    scenario.write_text(
        textwrap.dedent(
            """
            scenario: 1
            name: hello-from-the-target
            appServer:
              version: 1
              methods: {x/hello: {result: {from: the target's fake}}}
            steps:
              - createSession: s
              - call: {session: "${s}", method: x/hello, params: {}}
                expect: {json: {result: {from: the target's fake}}}
            """
        ).lstrip()
    )
    target = Served("--preset", "trusted", *fake(str(scenario)))
    served.append(target)
    done = here(str(scenario), "--target", target.url, "--target-script", str(scenario))
    assert outcomes(done.stdout) == {"hello-from-the-target": "PASSED"}, done.stdout
    # Without saying what the target runs, it skips.
    done = here(str(scenario), "--target", target.url)
    assert outcomes(done.stdout) == {"hello-from-the-target": "SKIPPED"}, done.stdout
    # And a target running another script fails it: it really ran there.
    other = Served(*fake())
    served.append(other)
    done = here(str(scenario), "--target", other.url, "--target-script", str(scenario))
    assert done.returncode == 1, done.stdout
    assert "hello.scenario.yaml:8: step 2 of 2" in done.stdout, done.stdout


def test_a_target_that_does_not_answer_fails_naming_it(here: Run) -> None:
    scenario = LIBRARY / "errors-client-mistakes.scenario.yaml"
    done = here(str(scenario), "--target", "http://127.0.0.1:9")
    assert done.returncode == 1, done.stdout
    assert "http://127.0.0.1:9: cannot reach the bridge" in done.stdout, done.stdout
    done = here(str(scenario), "--target", "http://127.0.0.1:9/some/path")
    assert "a target is an http(s)://host:port URL without a path" in done.stdout, done.stdout


def test_auth_variants_holds_beside_other_sessions_and_leaves_none_behind(
    served: list[Served], here: Run
) -> None:
    target = Served(*fake(), token=TOKEN)
    served.append(target)
    other = target.get("/v1/sessions", TOKEN, method="POST")
    assert isinstance(other, dict), other
    done = here(str(LIBRARY / "auth-variants.scenario.yaml"), "--target", target.url, token=TOKEN)
    assert outcomes(done.stdout) == {"auth-variants": "PASSED"}, done.stdout
    listed = target.get("/v1/sessions", TOKEN)
    assert isinstance(listed, dict), listed
    assert [s["sessionId"] for s in listed["sessions"]] == [other["sessionId"]], listed


class Recorder(socketserver.ThreadingTCPServer):
    """A TCP listener on loopback that records every byte a client sends it: forwarded to
    `upstream` (host, port) and its answers passed back, or else answered with an empty
    200 and closed (a stranger who would gladly take whatever comes)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream: tuple[str, int] | None = None) -> None:
        self.upstream = upstream
        self.received = bytearray()
        self.connections = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Relay)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, data: bytes) -> None:
        with self.lock:
            self.received += data

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Relay(socketserver.BaseRequestHandler):
    server: Recorder

    def handle(self) -> None:
        client: socket.socket = self.request
        with self.server.lock:
            self.server.connections += 1
        if self.server.upstream is None:
            head = b""
            while b"\r\n\r\n" not in head and (chunk := client.recv(65536)):
                head += chunk
            self.server.record(head)
            client.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            return
        with (
            socket.create_connection(self.server.upstream) as upstream,
            selectors.DefaultSelector() as sel,
        ):
            sel.register(client, selectors.EVENT_READ, upstream)
            sel.register(upstream, selectors.EVENT_READ, client)
            while True:
                for key, _ in sel.select():
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    if key.fileobj is client:
                        self.server.record(data)
                    key.data.sendall(data)


@pytest.fixture
def recorders() -> Iterator[list[Recorder]]:
    started: list[Recorder] = []
    yield started
    for recorder in started:
        recorder.close()


#: What the hostile scenarios write for the token; the target's is REAL.
WRITTEN = "scenario-placeholder-token"
REAL = "R3alTarg3tT0kenXq7"


def forms(secret: str) -> list[str]:
    """The token as it would appear in a URL, a JSON string or raw."""
    return [secret, urllib.parse.quote(secret), urllib.parse.quote_plus(secret)]


def test_the_token_goes_only_into_the_targets_authorization_header(
    served: list[Served], recorders: list[Recorder], tmp_path: Path, here: Run
) -> None:
    """A scenario file is the attacker: it writes `bridge.token` and `${token}` into
    every place a step carries a value. Against a target, the target's token goes only
    into `Authorization` on the target's origin; everywhere else (paths, queries, other
    headers, bodies, a call's params, expectations, the report, JUnit) the file's own
    text stays, and the real token is printed nowhere."""
    target = Served(*fake(), token=REAL)
    served.append(target)
    port = int(target.url.rsplit(":", 1)[1])
    front = Recorder(("127.0.0.1", port))  # what the target receives, byte for byte
    recorders.append(front)
    scenario = tmp_path / "carrier.scenario.yaml"
    scenario.write_text(
        textwrap.dedent(
            f"""
            scenario: 1
            name: carrier
            bridge: {{preset: trusted, token: {WRITTEN}}}
            steps:
              - http:
                  path: "/v1/nothing/${{token}}/{WRITTEN}?a=${{token}}&b={WRITTEN}"
                  method: POST
                  query: {{q: "${{token}}", r: {WRITTEN}}}
                  headers: {{X-Token: "${{token}}", X-Written: "Bearer {WRITTEN}"}}
                  json: {{a: "${{token}}", b: {WRITTEN}, c: ["${{token}}"]}}
                expect: {{status: 404, error: not_found}}
              - http:
                  method: PUT
                  path: /v1/nothing
                  body: "raw ${{token}} {WRITTEN}"
                  headers: {{Content-Type: text/plain, Cookie: "t=${{token}}"}}
                expect: {{status: 404}}
              - createSession: s
              - call: {{session: "${{s}}", method: model/list, params: {{t: "${{token}}"}}}}
              - stream: {{session: "${{s}}", headers: {{X-Token: "${{token}}"}}}}
              - close: stream
              - poll: {{session: "${{s}}", count: 0}}
              - name: an explicit auth is the written token, so the target's
                http: {{path: /v1/compatibility, auth: "${{token}}"}}
                capture: {{seen: $.apiVersion}}
              - name: an explicit Authorization header, in lower case
                http: {{path: /v1/compatibility, headers: {{authorization: "bearer {WRITTEN}"}}}}
              - http: {{method: DELETE, path: "/v1/sessions/${{s}}"}}
              - name: a failing step prints what it expected
                http: {{path: "/v1/compatibility?t=${{token}}"}}
                expect:
                  status: 299
                  headers: {{X-Token: "${{token}}"}}
                  jsonSubset: {{token: "${{token}}", also: {WRITTEN}}}
                  body: "${{token}}"
            """
        ).lstrip()
    )
    junit = tmp_path / "junit.xml"
    done = here(str(scenario), "--target", front.url, f"--junitxml={junit}", token=REAL)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    # Everything before the last step passed: the target's token was sent where it goes.
    assert "carrier.scenario.yaml:29: step 11 of 11: a failing step prints what it" in output, (
        output
    )
    report = junit.read_text()
    for secret in forms(REAL):
        assert secret not in output
        assert secret not in report
    assert WRITTEN in output  # the file's own text is what the report shows
    sent = bytes(front.received).decode("latin-1")
    lines = sent.split("\r\n")
    carrying = [line for line in lines if any(secret in line for secret in forms(REAL))]
    assert carrying, sent
    for line in carrying:
        name, _, value = line.partition(":")
        assert name.lower() == "authorization", line
        assert value.strip().lower() == f"bearer {REAL}".lower(), line
    # The written token travelled as written: the first step's path, query and headers.
    assert f"/v1/nothing/{WRITTEN}/{WRITTEN}?a={WRITTEN}" in sent, sent
    assert f"X-Token: {WRITTEN}" in sent, sent


@pytest.mark.parametrize(
    "path",
    [
        "{elsewhere}/steal",
        "{elsewhere}/v1/compatibility",
        "@127.0.0.1:{port}/v1/compatibility",
        "https://127.0.0.1:{port}/v1/compatibility",
    ],
)
def test_a_step_whose_path_leaves_the_target_fails_naming_the_step_and_sends_nothing(
    served: list[Served], recorders: list[Recorder], tmp_path: Path, path: str, here: Run
) -> None:
    target = Served(*fake(), token=REAL)
    served.append(target)
    elsewhere = Recorder()
    recorders.append(elsewhere)
    where = path.format(elsewhere=elsewhere.url, port=elsewhere.server_address[1])
    scenario = tmp_path / "escape.scenario.yaml"
    scenario.write_text(
        textwrap.dedent(
            f"""
            scenario: 1
            name: escape
            bridge: {{preset: trusted, token: {WRITTEN}}}
            steps:
              - http: {{path: /v1/compatibility}}
              - name: off to another origin
                http:
                  path: "{where}?t=${{token}}"
                  method: POST
                  headers: {{X-Token: "${{token}}"}}
                  json: {{t: "${{token}}"}}
              - stream: {{path: "{where}"}}
            """
        ).lstrip()
    )
    done = here(str(scenario), "--target", target.url, token=REAL)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "escape.scenario.yaml:6: step 2 of 3: off to another origin" in output, output
    assert f"is not on the bridge ({target.url})" in output, output
    assert "escape.scenario.yaml:8" in output, output  # the line of its `path`
    assert elsewhere.connections == 0, bytes(elsewhere.received)
    for secret in forms(REAL):
        assert secret not in output
