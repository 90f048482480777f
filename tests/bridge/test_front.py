"""The front's nginx configuration: generated, accepted by nginx, and what Kubernetes gets."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from processes import nginx_binary, start_nginx

from bridge.app import ROUTES
from bridge.auth import BearerToken, presented_token
from bridge.cli import main
from bridge.limits import RestLimits
from bridge.settings import LimitVariables
from bridge_ops.cluster import free_port
from bridge_ops.front import (
    POOLS,
    READ_NEXT,
    UNAUTHORIZED_MESSAGE,
    WORK_NEXT,
    FrontSettings,
    Replica,
    fill,
    front_pages,
    parse_replica,
    render,
    replace_config_map,
    token_map_text,
)

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes" / "bridge.yaml"
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))


def nginx_accepts(config: str, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "nginx.conf").write_text(config)
    checked = subprocess.run(
        [
            nginx_binary(),
            "-t",
            "-p",
            f"{directory}/",
            "-c",
            f"{directory}/nginx.conf",
            "-e",
            "stderr",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr


def front_config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`rest-bridge front-config ARGS` (with this environment, else the suite's)."""
    return subprocess.run(
        [REST_BRIDGE, "front-config", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def front_config_here(*args: str) -> subprocess.CompletedProcess[str]:
    """`rest-bridge front-config ARGS` by the CLI's own main, in this process: what the
    command prints and returns, for the checks of its arguments, without a Python
    process each (the tests above and below run the console script itself)."""
    out, err = io.StringIO(), io.StringIO()
    root, handlers = logging.getLogger(), list(logging.getLogger().handlers)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["front-config", *args])
            except SystemExit as exit_:  # argparse's refusals: a process's exit status
                code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
    finally:
        root.handlers[:] = handlers
    return subprocess.CompletedProcess(
        ["front-config", *args], code, out.getvalue(), err.getvalue()
    )


def test_front_config_is_accepted_by_nginx(tmp_path):
    done = front_config(
        *("--replica", "bridge-0=127.0.0.1:8001", "--replica", "bridge-1=[::1]:8002"),
        *("--listen", f"127.0.0.1:{free_port('127.0.0.1')}"),
        env={**os.environ, "REST_ADAPTER_MAX_WAIT_MS": "45000"},
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    assert "location ^~ /v1/sessions/bridge-0. {" in printed
    assert "least_conn;" in printed
    assert "proxy_next_upstream error timeout http_429 http_503 non_idempotent;" in printed
    # The long-poll's read timeout follows MAX_WAIT_MS (45 s) plus the margin.
    assert "proxy_read_timeout 50s;" in printed
    nginx_accepts(printed, tmp_path / "front")


@pytest.mark.quick
@pytest.mark.parametrize(
    "bad", ["bridge-0", "Bridge=127.0.0.1:1", "a=127.0.0.1", "a=127.0.0.1:0", "a=host:99999"]
)
def test_front_config_refuses_bad_replicas(bad):
    done = front_config_here("--replica", bad)
    assert done.returncode == 2
    assert "rest-bridge front-config:" in done.stderr


@pytest.mark.quick
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--listen", "127.0.0.1:80; include /etc/passwd"),
        ("--listen", "127.0.0.1:80;x"),
        ("--listen", "${LISTEN}"),
        ("--listen", ""),
        ("--runtime-dir", "/tmp/a;b"),
        ("--runtime-dir", "/tmp/a b"),
        ("--error-log", "/x{y"),
        ("--error-log", "/x#y"),
        ("--workers", "1;x"),
        ("--workers", "0"),
        ("--workers", "two"),
    ],
)
def test_front_config_refuses_what_nginx_would_read_as_more_than_one_word(option, value):
    """No option can end its directive and add one of its own: exit 2, nothing printed."""
    done = front_config_here("--replica", "a=h:1", option, value)
    assert done.returncode == 2, done.stdout
    assert done.stdout == ""
    assert done.stderr.startswith("rest-bridge front-config: "), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.quick
@pytest.mark.parametrize(
    ("option", "value"),
    [("--listen", "[::1]:8787"), ("--listen", "8787"), ("--listen", "unix:/run/f.sock")],
)
def test_front_config_takes_every_form_of_listen_address(tmp_path, option, value):
    done = front_config_here("--replica", "a=127.0.0.1:1", option, value)
    assert done.returncode == 0, done.stderr
    assert f"listen {value};" in done.stdout


def test_the_template_is_filled_in_one_pass():
    """A value is never read as a template; a placeholder without a value is an error;
    a block placeholder whose value is empty leaves no line."""
    assert fill("error page", STATUS="${TARGET}", TARGET="x") == "error_page ${TARGET} = x;\n"
    with pytest.raises(KeyError):
        fill("error page", STATUS="400")
    page = fill("front page", URI="/u", GUARD="", HEADERS="", STATUS=400, PAYLOAD="'{}'")
    assert page == (
        "location = /u {\n    internal;\n    client_max_body_size 0;\n    return 400 '{}';\n}\n"
    )
    # nginx's own variables pass through untouched.
    assert "$bridge_stranger" in fill("token check", TOKEN_MAP="t", FRONT_PAGE_URIS="x")


def test_duplicate_replicas_are_refused():
    with pytest.raises(ValueError, match="unique"):
        render([Replica("a", "h:1"), Replica("a", "h:2")], RestLimits())


def documents() -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFESTS.read_text())
    }


def test_the_kubernetes_probes_are_patient_and_reach_what_exists():
    """A busy event loop is not a dead one: the probes wait longer than Kubernetes'
    default second, and liveness (a restart ends every session) waits longest; the front
    has probes too, on a route its configuration serves without the token, and its
    liveness does not depend on the replicas."""
    docs = documents()
    container = docs[("StatefulSet", "bridge")]["spec"]["template"]["spec"]["containers"][0]
    ops = int(container["command"][container["command"].index("--ops-port") + 1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    ready, alive = container["readinessProbe"], container["livenessProbe"]
    assert (ready["httpGet"]["path"], ports[ready["httpGet"]["port"]]) == ("/readyz", ops)
    assert (alive["httpGet"]["path"], ports[alive["httpGet"]["port"]]) == ("/livez", ops)
    for probe in (ready, alive):
        assert probe["timeoutSeconds"] >= 5
        assert probe["periodSeconds"] >= probe["timeoutSeconds"]
    assert alive["periodSeconds"] * alive["failureThreshold"] >= 60
    assert alive["periodSeconds"] * alive["failureThreshold"] > (
        ready["periodSeconds"] * ready["failureThreshold"]
    )

    nginx = docs[("Deployment", "bridge-front")]["spec"]["template"]["spec"]["containers"][0]
    front_ports = {p["name"]: p["containerPort"] for p in nginx["ports"]}
    ready, alive = nginx["readinessProbe"], nginx["livenessProbe"]
    assert ready["timeoutSeconds"] >= 5
    assert front_ports[ready["httpGet"]["port"]] == front_ports["http"]
    # The path is one the front serves without the token (its token map exempts it).
    config = docs[("ConfigMap", "bridge-front")]["data"]["nginx.conf"]
    assert f'"0:GET:::{ready["httpGet"]["path"]}" 0;' in config
    assert front_ports[alive["tcpSocket"]["port"]] == front_ports["http"]


def test_kubernetes_manifests_match_the_generated_configuration(tmp_path):
    docs = documents()
    service = docs[("Service", "bridge")]
    stateful = docs[("StatefulSet", "bridge")]
    config_map = docs[("ConfigMap", "bridge-front")]
    front = docs[("Deployment", "bridge-front")]

    # A headless service that names every pod, ready or not, and selects the pods.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    labels = stateful["spec"]["template"]["metadata"]["labels"]
    assert stateful["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert stateful["spec"]["serviceName"] == service["metadata"]["name"]

    # The pod's name is its replica id, and each knows every replica as a peer.
    container = stateful["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["REST_ADAPTER_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    port = int(container["command"][container["command"].index("--port") + 1])
    assert container["ports"][0]["containerPort"] == port == service["spec"]["ports"][0]["port"]
    count = stateful["spec"]["replicas"]
    name = stateful["metadata"]["name"]
    hosts = {
        f"{name}-{n}": f"{name}-{n}.{service['metadata']['name']}:{port}" for n in range(count)
    }
    peers = ",".join(f"{rid}=http://{host}" for rid, host in hosts.items())
    assert env["REST_ADAPTER_PEERS"]["value"] == peers
    # The token: a file mounted from a Secret, never inline nor in the environment.
    assert "REST_ADAPTER_TOKEN" not in env
    pod = stateful["spec"]["template"]["spec"]
    secret_mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    token_file = Path(env["REST_ADAPTER_TOKEN_FILE"]["value"])
    assert str(token_file.parent) == secret_mounts["token"]
    pod_volumes = {v["name"]: v for v in pod["volumes"]}
    assert pod_volumes["token"]["secret"]["secretName"] == "bridge-token"

    # Draining: SIGUSR1 before the pod stops, within its grace period.
    pre_stop = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -USR1 1" in pre_stop
    drain_ms = int(env["REST_ADAPTER_DRAIN_TIMEOUT_MS"]["value"])
    grace = stateful["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace * 1000 > drain_ms

    # The ConfigMap is exactly the generated configuration for these replicas and limits.
    limits = LimitVariables.from_env(
        {k: v["value"] for k, v in env.items() if "value" in v}
    ).limits()
    replicas = [parse_replica(f"{rid}={host}") for rid, host in hosts.items()]
    nginx = front["spec"]["template"]["spec"]["containers"][0]
    listen = str(nginx["ports"][0]["containerPort"])
    # The front checks the token from a Secret of its own (the token map), never the
    # ConfigMap, which holds no secret.
    mounts = {m["name"]: m["mountPath"] for m in nginx["volumeMounts"]}
    volumes = {v["name"]: v for v in front["spec"]["template"]["spec"]["volumes"]}
    assert volumes["token"]["secret"]["secretName"] == "bridge-front-token"
    token_map = f"{mounts['token']}/token-map.conf"
    settings = FrontSettings(
        listen=listen,
        workers="auto",
        runtime_dir="/tmp",
        error_log="stderr",
        token_map=token_map,
    )
    assert config_map["data"]["nginx.conf"] == render(replicas, limits, settings)
    mount = mounts["config"]
    assert nginx["command"][nginx["command"].index("-c") + 1] == f"{mount}/nginx.conf"
    # nginx takes it (loopback addresses instead of the pods' names, which only the
    # cluster's DNS resolves, and a runtime directory of the test's own).
    local = [Replica(r.id, f"127.0.0.1:{8001 + n}") for n, r in enumerate(replicas)]
    (tmp_path / "token-map.conf").write_text(token_map_text("a-token"))
    nginx_accepts(
        render(
            local,
            limits,
            FrontSettings(
                listen=f"127.0.0.1:{free_port('127.0.0.1')}",
                workers="auto",
                runtime_dir=str(tmp_path),
                token_map=str(tmp_path / "token-map.conf"),
            ),
        ),
        tmp_path / "k8s",
    )


def test_write_config_map_replaces_only_the_block(tmp_path):
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "kind: ConfigMap\ndata:\n  nginx.conf: |\n    old\n\n    stale\n---\nkind: Service\n"
    )
    done = front_config("--replica", "a=h:1", "--write-config-map", str(manifest))
    assert done.returncode == 0, done.stderr
    text = manifest.read_text()
    expected = render([Replica("a", "h:1")], LimitVariables.from_env({}).limits())
    assert yaml.safe_load_all(text).__next__()["data"]["nginx.conf"] == expected
    assert text.endswith("---\nkind: Service\n")
    assert replace_config_map(text, expected) == text
    with pytest.raises(ValueError, match="exactly one"):
        replace_config_map("kind: Service\n", expected)


# -- through a real nginx -------------------------------------------------------------------
#
# What the configuration does is asked of nginx itself: it runs the configuration, in
# front of stand-in replicas (real HTTP servers on loopback ports, in threads) that
# answer with their own id and record what reached them.


@dataclass
class Seen:
    """One request as a stand-in replica received it."""

    method: str
    path: str
    version: str
    connection: str | None
    #: The port nginx's connection to the replica came from: the same for two requests
    #: when nginx kept the connection alive.
    port: int


class StandIn:
    """A replica stand-in: answers ``{"replica": id}`` with ``status``, records requests.

    Under ``/accel`` it answers with ``X-Accel-Redirect`` to the rest of the path (nginx
    then serves that URI, internal locations included). With ``hold`` set, the event
    routes answer a first chunk at once and the rest once ``hold`` is set.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = 200
        self.seen: list[Seen] = []
        self.hold: threading.Event | None = None
        #: Connections open now (nginx keeps some alive): closed with the stand-in.
        self.connections: set[socket.socket] = set()
        self.closed = False
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                stand_in.seen.append(
                    Seen(
                        self.command,
                        self.path,
                        self.request_version,
                        self.headers.get("Connection"),
                        self.client_address[1],
                    )
                )
                if self.path.startswith("/accel/"):
                    self.send_response(200)
                    self.send_header("X-Accel-Redirect", self.path.removeprefix("/accel"))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                hold = stand_in.hold
                if hold is not None and re.search(r"/events(/stream)?$", self.path):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(b"6\r\nfirst\n\r\n")
                    self.wfile.flush()
                    hold.wait(60)
                    # The client may have gone with the first chunk (nginx then too).
                    with contextlib.suppress(OSError):
                        self.wfile.write(b"5\r\nlast\n\r\n0\r\n\r\n")
                    return
                body = json.dumps({"replica": stand_in.name}).encode()
                self.send_response(stand_in.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_POST = do_HEAD = do_DELETE = do_PUT = answer

            def setup(self) -> None:
                super().setup()
                stand_in.connections.add(self.request)

            def finish(self) -> None:
                stand_in.connections.discard(self.request)
                with contextlib.suppress(OSError):
                    super().finish()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop listening and end every connection: the replica is gone."""
        if self.closed:
            return
        self.closed = True
        if self.hold is not None:
            self.hold.set()
        self.server.shutdown()
        self.server.server_close()
        for connection in list(self.connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self.thread.join(30)

    def paths(self) -> list[str]:
        return [seen.path for seen in self.seen]


@contextlib.contextmanager
def nginx_running(prefix: Path, config: str) -> Iterator[subprocess.Popen[str]]:
    """nginx on ``config`` (its prefix directory ``prefix``), until the block ends."""
    front = start_nginx(prefix, config)
    try:
        yield front
    finally:
        front.terminate()
        front.wait(30)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Front:
    """nginx on the generated configuration, in front of stand-in replicas."""

    def __init__(self, port: int, replicas: dict[str, StandIn], config: str) -> None:
        self.port = port
        self.replicas = replicas
        self.config = config

    def ask(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return Answer(
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                response.read(),
            )
        finally:
            conn.close()

    def raw(self, request: bytes) -> Answer:
        """``request`` as bytes on a fresh connection: the answer, read to the end."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as conn:
            conn.sendall(request)
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                received += chunk
            head, _, body = received.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines[1:])
            headers = {k.lower(): v for k, v in headers.items()}
            length = 0 if request.startswith(b"HEAD ") else int(headers.get("content-length", 0))
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            return Answer(int(lines[0].split()[1]), headers, body)

    def answered_by(self, method: str, path: str, body: bytes | None = None) -> tuple[int, str]:
        """The status, and the replica that answered (or the error kind nginx answered)."""
        answer = self.ask(method, path, body)
        if method == "HEAD":
            return answer.status, ""
        payload = answer.json()
        return answer.status, payload.get("replica") or payload["error"]


@contextlib.contextmanager
def front_over(
    prefix: Path,
    ids: Sequence[str],
    limits: RestLimits | None = None,
    token: str | None = None,
) -> Iterator[Front]:
    """nginx on the configuration :func:`render` gives for stand-ins named ``ids``
    (with a token map for ``token``)."""
    replicas = {name: StandIn(name) for name in ids}
    try:
        port = free_port("127.0.0.1")
        token_map = ""
        if token is not None:
            prefix.mkdir(parents=True, exist_ok=True)
            (prefix / "token-map.conf").write_text(token_map_text(token))
            token_map = str(prefix / "token-map.conf")
        config = render(
            [Replica(name, r.address) for name, r in replicas.items()],
            limits or RestLimits(),
            FrontSettings(listen=f"127.0.0.1:{port}", runtime_dir=str(prefix), token_map=token_map),
        )
        with nginx_running(prefix, config):
            yield Front(port, replicas, config)
    finally:
        for replica in replicas.values():
            replica.close()


def lines(config: str) -> list[str]:
    return [line.strip() for line in config.splitlines()]


def test_replicas_whose_ids_share_a_prefix_are_never_confused(tmp_path):
    with front_over(tmp_path / "front", ["b-1", "b-10"]) as front:
        assert front.answered_by("POST", "/v1/sessions/b-1.0b8e/call/x", b"{}") == (200, "b-1")
        assert front.answered_by("GET", "/v1/sessions/b-10.0b8e/events/stream") == (200, "b-10")
        assert front.answered_by("DELETE", "/v1/sessions/b-1.0b8e") == (200, "b-1")
        # An id that names no replica: nginx's own 404, the error payload; no replica asked.
        for path in ("/v1/sessions/b-100.0b8e", "/v1/sessions/x/b-1.0b8e"):
            assert front.answered_by("GET", path) == (404, "session_not_found")
        assert front.replicas["b-1"].paths() == [
            "/v1/sessions/b-1.0b8e/call/x",
            "/v1/sessions/b-1.0b8e",
        ]
        assert front.replicas["b-10"].paths() == ["/v1/sessions/b-10.0b8e/events/stream"]


def read_first_chunk(front: Front, path: str) -> bytes:
    """GET ``path`` and read until the stand-in's first chunk arrives, while the
    stand-in holds back the rest."""
    conn = socket.create_connection(("127.0.0.1", front.port), timeout=30)
    with conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: front\r\n\r\n".encode())
        received = b""
        while b"first" not in received:
            chunk = conn.recv(65536)
            assert chunk, received
            received += chunk
        return received


def test_buffering_keepalive_and_routing_choices_of_the_generated_configuration(tmp_path):
    """What keeps nginx's CPU per call low, and streams flowing (bench/FINDINGS.md)."""
    ids = [f"bridge-{n}" for n in range(3)]
    with front_over(tmp_path / "front", ids) as front:
        config = lines(front.config)
        # Sessions go to their replica, each by the prefix of its id.
        for name in ids:
            assert front.answered_by("POST", f"/v1/sessions/{name}.0b8e/call/x", b"{}") == (
                200,
                name,
            )
        # HTTP/1.1 with keep-alive to the replicas: two calls in a row on one connection,
        # without `Connection: close`.
        for _ in range(2):
            assert front.answered_by("POST", "/v1/sessions/bridge-0.0b8e/call/y", b"{}")[0] == 200
        calls = front.replicas["bridge-0"].seen
        assert {seen.version for seen in calls} == {"HTTP/1.1"}
        assert {seen.connection for seen in calls} == {None}
        assert len({seen.port for seen in calls}) == 1, calls
        # SSE and long-poll flow: the first chunk arrives while the replica holds the
        # rest; on the session's own replica. (nginx passes a first chunk on with its
        # buffering on too: that it is off is checked on the configuration, below.)
        for name in ids:
            front.replicas[name].hold = threading.Event()
        try:
            for n, name in enumerate(ids):
                suffix = "events/stream" if n % 2 else "events"
                assert b"first" in read_first_chunk(front, f"/v1/sessions/{name}.0b8e/{suffix}")
                assert front.replicas[name].paths()[-1] == f"/v1/sessions/{name}.0b8e/{suffix}"
        finally:
            for name in ids:
                hold = front.replicas[name].hold
                assert hold is not None
                hold.set()
                front.replicas[name].hold = None
        # The listing is a read: GET and HEAD reach a replica as they were asked.
        assert front.answered_by("GET", "/v1/sessions")[0] == 200
        assert front.answered_by("HEAD", "/v1/sessions")[0] == 200
        asked = [(s.method, s.path) for r in front.replicas.values() for s in r.seen]
        assert ("GET", "/v1/sessions") in asked
        assert ("HEAD", "/v1/sessions") in asked
        # A replica gone: its streams answer with its sessions' 503 (they have no error
        # pages of their own, and inherit the session location's).
        front.replicas["bridge-2"].close()
        for suffix in ("", "/events", "/events/stream"):
            answer = front.ask("GET", f"/v1/sessions/bridge-2.0b8e{suffix}")
            assert answer.status == 503
            assert answer.json()["message"] == (
                "The replica that holds this session cannot be reached."
            )
        # No access log is written.
        assert not list((tmp_path / "front").rglob("access.log"))
    # The figures nginx does not show a client: keep-alive to clients and replicas well
    # above what is in flight, no `map` (without a token map), and two `if`s, in the
    # server block: on the method, for the one path that is both a read and work, and
    # on a control character in the Authorization value (aiohttp would quote the token).
    assert "access_log off;" in config
    assert [x for x in config if x.startswith("keepalive_requests ")] == [
        "keepalive_requests 100000;"
    ] * (1 + len(POOLS) + len(ids))
    assert [x for x in config if x.startswith("keepalive ")] == ["keepalive 256;"] * (
        len(POOLS) + len(ids)
    )
    assert not [x for x in config if x.startswith("map ")]
    assert [x for x in config if x.startswith("if ")] == [
        'if ($http_authorization ~ "[\\x01-\\x08\\x0a-\\x1f\\x7f]") {',
        'if ($request_method ~ "^(GET|HEAD)$") {',
    ]
    # Buffering is off in the two stream locations of each session only, and a session's
    # calls are never retried on another replica.
    unbuffered = [n for n, x in enumerate(config) if x.startswith("proxy_buffering ")]
    assert len(unbuffered) == 2 * len(ids)
    for n in unbuffered:
        assert config[n] == "proxy_buffering off;"
        assert config[n - 1] in (
            "location ~ ^/v1/sessions/[^/]+/events/stream$ {",
            "location ~ ^/v1/sessions/[^/]+/events$ {",
        )
    assert config.count("proxy_next_upstream off;") == len(ids)


@pytest.mark.parametrize("refusal", [429, 503])
def test_reads_and_each_kind_of_work_have_pools_of_their_own(tmp_path, refusal):
    """Work a replica refuses (full: 429; draining: 503) passes to the next replica,
    and marks the refusing one in that kind of work's pool only (nginx counts failures
    per upstream); reads are never passed over for a refusal, nor marked by one."""
    with front_over(tmp_path / "front", ["bridge-0", "bridge-1"]) as front:
        refusing, taking = front.replicas["bridge-0"], front.replicas["bridge-1"]
        refusing.status = refusal
        work_paths = set()
        for route in ROUTES:
            if route.path.startswith("/v1/sessions/"):
                continue  # a session's own replica (test_replicas_whose_ids_share_a_prefix_...)
            path = re.sub(r"\{(\w+)(:[^}]*)?\}", "x", route.path)
            body = b"{}" if route.method == "POST" else None
            # Two in a row: each pool's round robin offers both replicas.
            answers = {front.answered_by(route.method, path, body) for _ in range(2)}
            if 429 in route.errors:  # work: passed over, answered by the other replica
                assert answers == {(200, "bridge-1")}, route.name
                work_paths.add(path)
            else:  # reads: the refusal stands
                assert answers == {(200, "bridge-1"), (refusal, "bridge-0")}, route.name
        # Creation, text turns and sessionless calls: three kinds of work, and the
        # refusing replica was offered each (none was passed over for another's refusal).
        assert work_paths == {"/v1/sessions", "/v1/text-turn", "/v1/call/x"}
        assert {("POST", path) for path in work_paths} <= {
            (s.method, s.path) for s in refusing.seen
        }
        # A refused creation never makes a read fail over: both still answer them.
        assert {front.answered_by("HEAD", "/v1/sessions")[0] for _ in range(2)} == {200, refusal}
        answers = {front.answered_by("GET", "/anything/else") for _ in range(2)}
        assert answers == {(200, "bridge-1"), (refusal, "bridge-0")}
        assert taking.seen
        config = lines(front.config)
    # Every pool holds every replica, least connections first; a replica that cannot
    # be reached or hangs is passed over by reads for 30 s, by work for 2 s.
    assert config.count("least_conn;") == len(POOLS)
    for replica in front.replicas.values():
        assert config.count(f"server {replica.address} max_fails=1 fail_timeout=2s;") == 3
        assert config.count(f"server {replica.address} max_fails=1 fail_timeout=30s;") == 1
    assert config.count(f"proxy_next_upstream {WORK_NEXT};") == 3
    assert config.count(f"proxy_next_upstream {READ_NEXT};") == 2


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("b-0=unix:/run/bridge/b-0.sock", "unix:/run/bridge/b-0.sock"),
        ("b-0=unix:/tmp/x_y-z.1/s", "unix:/tmp/x_y-z.1/s"),
        ("b-0=127.0.0.1:8001", "127.0.0.1:8001"),
    ],
)
def test_a_replica_is_reached_over_tcp_or_a_unix_socket(text, address):
    assert parse_replica(text) == Replica("b-0", address)


@pytest.mark.parametrize(
    "bad",
    ["b=unix:relative.sock", "b=unix:/x;y", "b=unix:/x y", "b=unix:/x{", "b=unix:", "unix:/x"],
)
def test_a_unix_socket_path_nginx_would_misread_is_refused(bad):
    with pytest.raises(ValueError, match="not"):
        parse_replica(bad)


# The bridge's own `serve`, listening on a unix socket beside its TCP port (serve has no
# option for it yet): its socket site opens a unix site of the same runner as it starts.
UNIX_REPLICA = """
import os, socket, sys
import bridge.runtime
tcp = bridge.runtime.listening_sockets
def both(host, port):
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(os.environ["TEST_UNIX_SOCKET"])
    os.chmod(os.environ["TEST_UNIX_SOCKET"], 0o666)
    unix.listen(128)
    unix.setblocking(False)
    return tcp(host, port) + [unix]
bridge.runtime.listening_sockets = both
from bridge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_nginx_reaches_a_replica_over_its_unix_socket(tmp_path):
    """Sessions and balanced routes through the front to a replica on a unix socket."""
    # nginx's workers may run as another user (nobody, under root): the socket's
    # directory must be theirs to reach, which pytest's private tmp_path is not.
    sockets = Path(tempfile.mkdtemp(prefix="front-unix-"))
    sockets.chmod(0o755)
    sock = sockets / "bridge-0.sock"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")},
        "REST_ADAPTER_REPLICA_ID": "bridge-0",
        "TEST_UNIX_SOCKET": str(sock),
    }
    fake = str(Path(sys.executable).with_name("fake-codex")) + " app-server"
    replica = subprocess.Popen(
        [sys.executable, "-c", UNIX_REPLICA, "serve", "--port", "0", "--app-server", fake],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    front_port = free_port("127.0.0.1")
    prefix = tmp_path / "front"
    config = render(
        [Replica("bridge-0", f"unix:{sock}")],
        RestLimits(),
        FrontSettings(listen=f"127.0.0.1:{front_port}", runtime_dir=str(prefix)),
    )
    assert f"server unix:{sock};" in config
    try:
        assert replica.stdout is not None
        for line in replica.stdout:  # waits on the replica's own words, no polling
            if " listening on " in line:
                break
        else:
            pytest.fail("the replica did not start")
        with nginx_running(prefix, config):

            def call(method: str, path: str, body: str | None = None) -> tuple[int, Any]:
                conn = http.client.HTTPConnection("127.0.0.1", front_port, timeout=30)
                try:
                    conn.request(
                        method, path, body=body, headers={"Content-Type": "application/json"}
                    )
                    response = conn.getresponse()
                    return response.status, yaml.safe_load(response.read() or b"null")
                finally:
                    conn.close()

            status, created = call("POST", "/v1/sessions", "{}")
            assert status == 201, created
            session = created["sessionId"]
            assert session.startswith("bridge-0.")
            # A session call (buffered) and a long-poll (unbuffered), to the session's replica.
            status, answer = call(
                "POST", f"/v1/sessions/{session}/call/thread/start", '{"params":{}}'
            )
            assert status == 200, answer
            assert answer["result"]["thread"]["id"]
            status, event = call("GET", f"/v1/sessions/{session}/events?after=0&waitMs=5000")
            assert status == 200, event
            assert event["seq"] > 0
            status, listed = call("GET", "/v1/sessions")
            assert status == 200
            assert [s["sessionId"] for s in listed["sessions"]] == [session]
            # The replica gone: its sessions get the payload, not nginx's HTML.
            replica.terminate()
            replica.wait(30)
            status, body = call("GET", f"/v1/sessions/{session}/events?after=0&waitMs=0")
            assert status == 503
            assert body["error"] == "replica_unavailable"
    finally:
        if replica.poll() is None:
            replica.kill()
        replica.wait(30)
        shutil.rmtree(sockets, ignore_errors=True)


# -- strangers ---------------------------------------------------------------------------


HEADERS = [
    "Bearer s3cr3t",
    "bearer s3cr3t",
    "BEARER   s3cr3t  ",
    "Bearer s3cr3t\t",
    "Bearer \x1fs3cr3t\x1c",
    "Bearer s3cr3t\u00a0",
    "Bearer\ts3cr3t",
    "Bearer s3cr3tx",
    "Bearer xs3cr3t",
    "Bearer s3cr",
    "Basic s3cr3t",
    "s3cr3t",
    "Bearer  ",
    "Bearer S3CR3T",
    "",
]


@pytest.mark.parametrize("token", ["s3cr3t", "a\"b'c;d{e}$f\\g h", "t\u00e9k\u00e9n"])
def test_the_front_admits_every_token_a_replica_admits(token):
    """The token map's pattern against the replica's own check, header by header: the
    front never refuses what a replica accepts (it may let a little more through, which
    the replica then refuses), and the token is written only as escapes."""
    text = token_map_text(token)
    pattern = re.search(r'"~(.*)" 1;', text).group(1)
    assert token not in text
    assert "'" not in pattern
    assert '"' not in pattern
    admits = re.compile(pattern.encode())  # PCRE's and Python's syntax agree here
    secret = BearerToken(token)
    for header in [h.replace("s3cr3t", token) for h in HEADERS]:
        replica = secret.matches(presented_token(header))
        front = admits.search(header.encode("utf-8")) is not None
        assert front >= replica, (header, front, replica)
        if header.isascii():  # outside the multi-byte trimming, exactly the same
            assert front == replica, (header, front, replica)


def test_a_token_the_front_cannot_check_is_refused():
    with pytest.raises(ValueError, match="blank"):
        token_map_text("  ")
    with pytest.raises(ValueError, match="one word"):
        render([Replica("a", "h:1")], RestLimits(), FrontSettings(token_map="/x y;"))


TOKEN = "s3cr3t"
HOLDER = {"Authorization": f"Bearer {TOKEN}"}


def test_every_error_nginx_answers_itself_goes_to_an_internal_location(tmp_path):
    """Named locations cannot take a request whose request line nginx could not read:
    every error page is an internal URI that returns the error payload. Asked of nginx
    itself, with a token map, as a stranger (no token) and as the token's holder."""
    limits = LimitVariables.from_env({"REST_ADAPTER_MAX_BODY_BYTES": "1024"}).limits()
    pages = front_pages(limits)
    statuses = sorted(s for s in pages if isinstance(s, int))
    assert statuses == [400, 401, 404, 405, 408, 411, 413, 414, 494, 500, 501, 504, 505]
    with front_over(tmp_path / "front", ["b-0"], limits, token=TOKEN) as front:
        config = lines(front.config)
        for status in statuses:
            # Each status nginx answers by itself goes to its internal URI (asked of
            # nginx below, but for the statuses no test can make it answer in seconds)...
            if status in (408, 411, 500, 504):
                assert f"error_page {status} = /.front/{status};" in config
            # ...which returns the table's payload (a replica redirecting there shows it)...
            answer = front.ask("GET", f"/accel/.front/{status}", headers=HOLDER)
            page = pages[status]
            assert answer.status == page.status == (431 if status == 494 else status)
            assert answer.json()["error"] == page.kind
            assert set(answer.json()) >= {"error", "message"}
            for name, value in page.headers:
                assert answer.headers[name.lower()] == value.strip('"')
            # ...and is internal: asked for directly, a 404 (the 401 to a stranger).
            direct = front.ask("GET", f"/.front/{status}", headers=HOLDER)
            assert (direct.status, direct.json()["error"]) == (404, "not_found")
            stranger = front.ask("GET", f"/.front/{status}")
            assert (stranger.status, stranger.json()["error"]) == (401, "unauthorized")

        def both(request: bytes, status: int, kind: str) -> None:
            """What a stranger and the holder get for a request nginx answers itself."""
            for token in (b"", f"Authorization: Bearer {TOKEN}\r\n".encode()):
                answer = front.raw(request.replace(b"\r\n\r\n", b"\r\n" + token + b"\r\n", 1))
                assert (answer.status, answer.json()["error"]) == (status, kind), request

        # What nginx could not read gets its own page, token or not: never a 401 for
        # headers nginx never read.
        both(b"get / HTTP/1.1\r\nHost: f\r\n\r\n", 400, "bad_request")
        both(b"TRACE / HTTP/1.1\r\nHost: f\r\n\r\n", 405, "method_not_allowed")
        both(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: f\r\n\r\n", 414, "uri_too_long")
        both(
            b"POST /v1/sessions HTTP/1.1\r\nHost: f\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            501,
            "not_implemented",
        )
        both(b"GET / HTTP/2.0\r\nHost: f\r\n\r\n", 505, "http_version_not_supported")
        # A control character after the token: the map trims \x1c-\x1f as the replica
        # does, but aiohttp's parser would refuse the line and quote it back, token and
        # all. The front's 400 to the holder; the 401 to anyone else.
        for end, status, kind in ((b"\x1f", 400, "bad_request"), (b"\x01", 401, "unauthorized")):
            line = b"Authorization: Bearer " + TOKEN.encode() + end + b"\r\n"
            answer = front.raw(b"GET /v1/sessions HTTP/1.1\r\nHost: f\r\n" + line + b"\r\n")
            assert (answer.status, answer.json()["error"]) == (status, kind), end
        trace = front.raw(b"TRACE / HTTP/1.1\r\nHost: f\r\n\r\n")
        assert trace.headers["allow"] == "DELETE, GET, HEAD, POST"
        # The pages that would tell a stranger a bound, or that they exist (413, 494 and
        # 404), answer a stranger the 401, and the holder the page.
        big = b"x" * 1025
        assert front.ask("POST", "/v1/sessions", big).status == 401
        answer = front.ask("POST", "/v1/sessions", big, HOLDER)
        assert (answer.status, answer.json()["data"]) == (413, {"limitBytes": 1024})
        long_header = {"X-Long": "y" * 9000}
        assert front.ask("GET", "/health", headers=long_header).status == 401
        # The token comes first: nginx reads it before the header it cannot hold.
        answer = front.ask("GET", "/health", headers={**HOLDER, **long_header})
        assert (answer.status, answer.json()["error"]) == (431, "headers_too_large")
        unauthorized = front.ask("GET", "/v1/compatibility")
        assert unauthorized.headers["www-authenticate"] == "Bearer"
        assert unauthorized.json()["message"] == UNAUTHORIZED_MESSAGE
        # The token is checked before a location is chosen: a stranger cannot tell a
        # session id of a live replica from one of no replica.
        for path in ("/v1/sessions/b-0.0b8e/call/x", "/v1/sessions/zz.0b8e/call/x"):
            assert front.ask("POST", path, b"{}").status == 401

        # A stranger reaches a replica with a plain health check only (GET or HEAD, no
        # body), and the holder with anything; each line: the request, then whether it
        # reaches a replica. Anything else a stranger asks is the 401.
        asked = len(front.replicas["b-0"].seen)
        health = [
            (f"{method} {path} HTTP/1.1\r\nHost: f\r\n{length}\r\n".encode(), True)
            for method in ("GET", "HEAD")
            for path in ("/health", "/v1/health")
            for length in ("", "Content-Length: 0\r\n")
        ]
        for request, reaches in (
            *health,
            (b"GET /health HTTP/1.1\r\nHost: f\r\nContent-Length: 1\r\n\r\nx", False),
            (
                b"GET /health HTTP/1.1\r\nHost: f\r\nContent-Length: 999999999999\r\n\r\n",
                False,
            ),
            (
                b"HEAD /v1/health HTTP/1.1\r\nHost: f\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"0\r\n\r\n",
                False,
            ),
            (b"POST /health HTTP/1.1\r\nHost: f\r\n\r\n", False),
            (b"GET /v1/sessions HTTP/1.1\r\nHost: f\r\n\r\n", False),
            (b"GET /.front/401;x HTTP/1.1\r\nHost: f\r\n\r\n", False),
            (b"GET /.front/999 HTTP/1.1\r\nHost: f\r\n\r\n", False),
            (b"GET /.front/ HTTP/1.1\r\nHost: f\r\n\r\n", False),
            (b"GET /x:/.front/413 HTTP/1.1\r\nHost: f\r\n\r\n", False),
            (
                b"POST /v1/sessions HTTP/1.1\r\nHost: f\r\nContent-Length: 5\r\n"
                + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
                + b"{}   ",
                True,
            ),
            (
                b"GET /health HTTP/1.1\r\nHost: f\r\nContent-Length: 1000\r\n"
                + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
                + b"x" * 1000,
                True,
            ),
        ):
            answer = front.raw(request)
            if reaches:
                asked += 1
                assert answer.status == 200, request
            else:
                assert answer.status == 401, request
                assert request.startswith(b"HEAD ") or answer.json()["error"] == "unauthorized"
            assert len(front.replicas["b-0"].seen) == asked, request


def test_front_config_prints_the_token_map_and_includes_it(tmp_path):
    """The token comes from the environment only; the map holds it as escapes, the
    configuration names the map and never holds the token; nginx takes both."""
    secret = "front-s3cr3t"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    done = front_config("--print-token-map", env={**env, "REST_ADAPTER_TOKEN": secret})
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    assert printed == token_map_text(secret)
    assert secret not in printed
    (tmp_path / "token").write_text(secret + "\n")
    done = front_config(
        "--print-token-map", env={**env, "REST_ADAPTER_TOKEN_FILE": str(tmp_path / "token")}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == printed
    directory = tmp_path / "front"
    directory.mkdir()
    (directory / "token-map.conf").write_text(printed)
    done = front_config(
        *("--replica", "b-0=127.0.0.1:8001"),
        *("--listen", f"127.0.0.1:{free_port('127.0.0.1')}"),
        *("--token-map", "token-map.conf", "--runtime-dir", str(directory)),
        env={**env, "REST_ADAPTER_TOKEN": secret},
    )
    assert done.returncode == 0, done.stderr
    config = done.stdout
    assert "include token-map.conf;" in config
    assert secret not in config
    nginx_accepts(config, directory)
    # No token, or one no header could carry: exit 2, the token never echoed.
    for value in (None, "  ", " front-s3cr3t"):
        done = front_config(
            "--print-token-map", env=env if value is None else {**env, "REST_ADAPTER_TOKEN": value}
        )
        assert done.returncode == 2, done
        assert done.stdout == ""
        assert secret not in done.stderr
        assert "REST_ADAPTER_TOKEN" in done.stderr or "token" in done.stderr


# -- replicas marked down ------------------------------------------------------------------


def test_a_replica_marked_down_is_never_asked(tmp_path):
    """Replicas marked down (as `rest-bridge cluster` marks a hung one): every pool passes
    them over and their sessions get 503 replica_unavailable at once, nginx never even
    connecting to them. Each is a socket that listens and never accepts: hung, the
    kernel completing every handshake."""
    hung = {}
    for name in ("bridge-0", "bridge-1"):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        hung[name] = listener
    front_port = free_port("127.0.0.1")
    prefix = tmp_path / "front"
    replicas = [
        Replica(name, f"127.0.0.1:{listener.getsockname()[1]}", down=True)
        for name, listener in hung.items()
    ]
    config = render(
        replicas,
        RestLimits(),
        FrontSettings(listen=f"127.0.0.1:{front_port}", runtime_dir=str(prefix)),
    )
    servers = [x.strip() for x in config.splitlines() if x.strip().startswith("server 127.")]
    assert len(servers) == len(replicas) * (len(POOLS) + 1)
    assert all(line.endswith(" down;") for line in servers), servers
    try:
        with nginx_running(prefix, config):
            asked = [
                ("POST", "/v1/sessions", "{}"),
                ("POST", "/v1/call/thread/start", '{"params":{}}'),
                ("POST", "/v1/text-turn", '{"text":"hello"}'),
                ("GET", "/health", None),
                ("GET", "/v1/sessions", None),
                ("POST", "/v1/sessions/bridge-0.0b8e3c1c-0000-4000-8000-000000000000/call/x", "{}"),
                ("GET", "/v1/sessions/bridge-1.0b8e3c1c-0000-4000-8000-000000000000/events", None),
                (
                    "GET",
                    "/v1/sessions/bridge-1.0b8e3c1c-0000-4000-8000-000000000000/events/stream",
                    None,
                ),
            ]
            for method, path, body in asked:
                conn = http.client.HTTPConnection("127.0.0.1", front_port, timeout=60)
                try:
                    conn.request(
                        method, path, body=body, headers={"Content-Type": "application/json"}
                    )
                    response = conn.getresponse()
                    status, answer = response.status, json.loads(response.read())
                    retry_after = response.getheader("Retry-After")
                finally:
                    conn.close()
                assert (status, answer["error"]) == (503, "replica_unavailable"), (path, answer)
                assert retry_after == "1"
            # nginx never connected to either: nothing waits in their accept queues.
            for listener in hung.values():
                listener.setblocking(False)
                with pytest.raises(BlockingIOError):
                    listener.accept()
    finally:
        for listener in hung.values():
            listener.close()
