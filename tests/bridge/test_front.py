"""The front's nginx configuration: generated, accepted by nginx, and what Kubernetes gets."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from processes import nginx_binary

from bridge.app import ROUTES
from bridge.auth import BearerToken, presented_token
from bridge.cluster import free_port
from bridge.front import (
    CREATE_POOL,
    LISTING,
    POOLS,
    READ_NEXT,
    READ_POOL,
    WORK_NEXT,
    FrontSettings,
    Replica,
    parse_replica,
    render,
    replace_config_map,
    token_map_text,
)
from bridge.limits import RestLimits

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


@pytest.mark.parametrize(
    "bad", ["bridge-0", "Bridge=127.0.0.1:1", "a=127.0.0.1", "a=127.0.0.1:0", "a=host:99999"]
)
def test_front_config_refuses_bad_replicas(bad):
    done = front_config("--replica", bad)
    assert done.returncode == 2
    assert "rest-bridge front-config:" in done.stderr


@pytest.mark.quick
def test_duplicate_replicas_are_refused():
    with pytest.raises(ValueError, match="unique"):
        render([Replica("a", "h:1"), Replica("a", "h:2")], RestLimits())


def documents() -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFESTS.read_text())
    }


@pytest.mark.quick
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
    limits = RestLimits.from_env({k: v["value"] for k, v in env.items() if "value" in v})
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
    expected = render([Replica("a", "h:1")], RestLimits.from_env({}))
    assert yaml.safe_load_all(text).__next__()["data"]["nginx.conf"] == expected
    assert text.endswith("---\nkind: Service\n")
    assert replace_config_map(text, expected) == text
    with pytest.raises(ValueError, match="exactly one"):
        replace_config_map("kind: Service\n", expected)


def parse_nginx(text: str) -> list[Block]:
    """nginx.conf as a tree of directives: enough of its grammar for what we generate."""
    tokens = re.findall(r"'[^']*'|\"[^\"]*\"|[{};]|[^\s{};]+", re.sub(r"#[^\n]*", "", text))
    root: list[Block] = []
    stack = [root]
    words: list[str] = []
    for token in tokens:
        if token == "{":
            block = Block(words, [])
            stack[-1].append(block)
            stack.append(block.children)
            words = []
        elif token == "}":
            stack.pop()
        elif token == ";":
            stack[-1].append(Block(words, []))
            words = []
        else:
            words.append(token.strip("'\""))
    assert len(stack) == 1, "unbalanced braces"
    return root


class Block:
    def __init__(self, words: list[str], children: list[Block]) -> None:
        self.words = words
        self.children = children

    def all(self, name: str) -> list[Block]:
        return [c for c in self.children if c.words[0] == name]

    def value(self, name: str) -> list[str] | None:
        found = self.all(name)
        return found[-1].words[1:] if found else None


def generated(replicas: list[Replica]) -> tuple[Block, Block]:
    tree = Block(["main"], parse_nginx(render(replicas, RestLimits())))
    http = tree.all("http")[0]
    return http, http.all("server")[0]


def session_locations(server: Block) -> dict[str, Block]:
    """The `location ^~ /v1/sessions/<id>.` blocks, by prefix."""
    return {
        loc.words[2]: loc
        for loc in server.all("location")
        if loc.words[1] == "^~" and loc.words[2].startswith("/v1/sessions/")
    }


def nginx_route(server: Block, path: str) -> str | None:
    """The upstream nginx picks for a session path: its longest matching `^~` prefix."""
    prefixes = [p for p in session_locations(server) if path.startswith(p)]
    if not prefixes:
        return None
    chosen = session_locations(server)[max(prefixes, key=len)]
    return chosen.value("proxy_pass")[0].removeprefix("http://")


@pytest.mark.quick
def test_replicas_whose_ids_share_a_prefix_are_never_confused():
    _, server = generated([Replica("b-1", "h:1"), Replica("b-10", "h:2")])
    assert sorted(session_locations(server)) == ["/v1/sessions/b-1.", "/v1/sessions/b-10."]
    assert nginx_route(server, "/v1/sessions/b-1.0b8e/call/x") == "replica_b-1"
    assert nginx_route(server, "/v1/sessions/b-10.0b8e/events/stream") == "replica_b-10"
    assert nginx_route(server, "/v1/sessions/b-1.0b8e") == "replica_b-1"
    assert nginx_route(server, "/v1/sessions/b-100.0b8e") is None
    assert nginx_route(server, "/v1/sessions/x/b-1.0b8e") is None
    # An id that names no replica: nginx's own 404, the error payload.
    unknown = [
        loc for loc in server.all("location") if loc.words[1:] == ["~", "^/v1/sessions/[^/]+"]
    ]
    assert unknown[0].value("return")[0] == "404"
    assert "session_not_found" in unknown[0].value("return")[1]


@pytest.mark.quick
def test_buffering_keepalive_and_routing_choices_of_the_generated_configuration():
    """What keeps nginx's CPU per call low, and streams flowing (bench/FINDINGS.md)."""
    replicas = [Replica(f"bridge-{n}", f"127.0.0.1:{8001 + n}") for n in range(3)]
    http, server = generated(replicas)
    assert http.value("access_log") == ["off"]
    assert int(http.value("keepalive_requests")[0]) >= 10_000
    # No per-request regular expressions over the replica list, no `if` in a location,
    # no map; one `if` in the server block, a regular expression on the method, for the
    # one path that is both a read and work (it rewrites the listing to a read).
    assert http.all("map") == []
    (listing,) = server.all("if")
    assert listing.words[1:] == ["($request_method", "~", "^(GET|HEAD)$", ")"]
    assert listing.value("rewrite") == ["^/v1/sessions$", LISTING, "last"]
    # HTTP/1.1 with keep-alive to the replicas: more idle connections than in flight.
    assert server.value("proxy_http_version") == ["1.1"]
    assert ["Connection", ""] in [d.words[1:] for d in server.all("proxy_set_header")]
    for upstream in http.all("upstream"):
        assert int(upstream.value("keepalive")[0]) >= 256
        assert int(upstream.value("keepalive_requests")[0]) >= 10_000
    locations = session_locations(server)
    assert sorted(locations) == [f"/v1/sessions/bridge-{n}." for n in range(3)]
    for n, location in enumerate(locations.values()):
        # Plain session routes keep nginx's buffering (on by default), never retried.
        assert location.value("proxy_buffering") is None
        assert location.value("proxy_next_upstream") == ["off"]
        assert location.value("proxy_pass") == [f"http://replica_bridge-{n}"]
        nested = {loc.words[2]: loc for loc in location.all("location")}
        assert sorted(nested) == [
            "^/v1/sessions/[^/]+/events$",
            "^/v1/sessions/[^/]+/events/stream$",
        ]
        for stream in nested.values():  # SSE and long-poll: unbuffered, same replica
            assert stream.value("proxy_buffering") == ["off"]
            assert stream.value("proxy_pass") == [f"http://replica_bridge-{n}"]
            # Without the error pages of their own, they inherit the session's.
            assert stream.all("error_page") == []
    for location in server.all("location"):
        assert location.all("if") == [], location.words
        if location.words[1] in ("=", "/") or location.words[1:] == ["/"]:
            assert location.value("proxy_buffering") is None  # balanced routes: buffered


def balanced_route(http: Block, server: Block, method: str, path: str) -> tuple[str, Block]:
    """The pool nginx picks for a balanced route, and the location that picks it.

    Exact locations first, then the longest `^~` prefix, then `location /` (the
    configuration has no regular expression outside the session paths).
    """
    locations = server.all("location")
    if path == "/v1/sessions" and method in ("GET", "HEAD"):  # the server block's rewrite
        path = LISTING
    exact = [loc for loc in locations if loc.words[1:] == ["=", path]]
    prefixes = [loc for loc in locations if loc.words[1] == "^~" and path.startswith(loc.words[2])]
    if exact:
        location = exact[0]
    elif prefixes:
        location = max(prefixes, key=lambda loc: len(loc.words[2]))
    else:
        location = next(loc for loc in locations if loc.words[1:] == ["/"])
    target = location.value("proxy_pass")[0].removeprefix("http://")
    return target.removesuffix("$request_uri"), location


@pytest.mark.quick
def test_reads_and_each_kind_of_work_have_pools_of_their_own():
    """A refusal marks a replica in one pool only (nginx counts failures per upstream)."""
    replicas = [Replica(f"bridge-{n}", f"127.0.0.1:{8001 + n}") for n in range(3)]
    http, server = generated(replicas)
    upstreams = {u.words[1]: u for u in http.all("upstream")}
    for pool, _ in POOLS:
        servers = [s.words[1:] for s in upstreams[pool].all("server")]
        # A hung or unreachable replica is passed over by reads for 30 s, by work for 2 s.
        fail = "fail_timeout=30s" if pool == READ_POOL else "fail_timeout=2s"
        assert servers == [[r.address, "max_fails=1", fail] for r in replicas]
        assert upstreams[pool].value("least_conn") == []
    work_pools = set()
    for route in ROUTES:
        if route.path.startswith("/v1/sessions/"):
            continue  # a session's own replica (test_replicas_whose_ids_share_a_prefix_...)
        path = re.sub(r"\{(\w+)(:[^}]*)?\}", "x", route.path)
        pool, location = balanced_route(http, server, route.method, path)
        next_upstream = " ".join(location.value("proxy_next_upstream"))
        if 429 in route.errors:  # work a full replica refuses: passed over, and marked
            assert pool != READ_POOL, route.name
            assert next_upstream == WORK_NEXT, route.name
            work_pools.add(pool)
        else:  # reads: never refused for a refused work
            assert pool == READ_POOL, route.name
            if route.path != "/v1/sessions":
                assert next_upstream == READ_NEXT, route.name
    # Creation, text turns and sessionless calls: three pools, none shared.
    assert len(work_pools) == 3
    assert CREATE_POOL in work_pools
    assert balanced_route(http, server, "HEAD", "/v1/sessions")[0] == READ_POOL
    assert balanced_route(http, server, "GET", "/anything/else")[0] == READ_POOL


@pytest.mark.quick
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


@pytest.mark.quick
@pytest.mark.parametrize(
    "bad",
    ["b=unix:relative.sock", "b=unix:/x;y", "b=unix:/x y", "b=unix:/x{", "b=unix:", "unix:/x"],
)
def test_a_unix_socket_path_nginx_would_misread_is_refused(bad):
    with pytest.raises(ValueError, match="not"):
        parse_replica(bad)


# The bridge's own `serve`, listening on a unix socket beside its TCP port (serve has no
# option for it yet): aiohttp's TCP site opens a unix site as it starts.
UNIX_REPLICA = """
import os, sys
from aiohttp import web
class Both(web.TCPSite):
    async def start(self):
        await super().start()
        await web.UnixSite(self._runner, os.environ["TEST_UNIX_SOCKET"]).start()
        os.chmod(os.environ["TEST_UNIX_SOCKET"], 0o666)
web.TCPSite = Both
from bridge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_nginx_reaches_a_replica_over_its_unix_socket(tmp_path):
    """Sessions and balanced routes through the front to a replica on a unix socket."""
    nginx = nginx_binary()
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
    prefix.mkdir()
    config = render(
        [Replica("bridge-0", f"unix:{sock}")],
        RestLimits(),
        FrontSettings(listen=f"127.0.0.1:{front_port}", runtime_dir=str(prefix)),
    )
    assert f"server unix:{sock};" in config
    (prefix / "nginx.conf").write_text(config)
    front = None
    try:
        assert replica.stdout is not None
        for line in replica.stdout:  # waits on the replica's own words, no polling
            if " listening on " in line:
                break
        else:
            pytest.fail("the replica did not start")
        front = subprocess.Popen(
            [
                *(nginx, "-p", f"{prefix}/", "-c", f"{prefix}/nginx.conf", "-e", "stderr"),
                *("-g", "daemon off; error_log stderr notice;"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert front.stderr is not None
        for line in front.stderr:  # bound before its worker starts
            if "start worker process" in line:
                break
        else:
            pytest.fail("nginx did not start")

        def call(method: str, path: str, body: str | None = None) -> tuple[int, Any]:
            conn = http.client.HTTPConnection("127.0.0.1", front_port, timeout=30)
            try:
                conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                return response.status, yaml.safe_load(response.read() or b"null")
            finally:
                conn.close()

        status, created = call("POST", "/v1/sessions", "{}")
        assert status == 201, created
        session = created["sessionId"]
        assert session.startswith("bridge-0.")
        # A session call (buffered) and a long-poll (unbuffered), to the session's replica.
        status, answer = call("POST", f"/v1/sessions/{session}/call/thread/start", '{"params":{}}')
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
        if front is not None:
            front.terminate()
            front.wait(30)
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


@pytest.mark.quick
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


@pytest.mark.quick
def test_a_token_the_front_cannot_check_is_refused():
    with pytest.raises(ValueError, match="blank"):
        token_map_text("  ")
    with pytest.raises(ValueError, match="one word"):
        render([Replica("a", "h:1")], RestLimits(), FrontSettings(token_map="/x y;"))


@pytest.mark.quick
def test_every_error_nginx_answers_itself_goes_to_an_internal_location():
    """Named locations cannot take a request whose request line nginx could not read:
    every error page is an internal URI that returns the error payload."""
    replicas = [Replica("b-0", "h:1")]
    tree = Block(
        ["main"], parse_nginx(render(replicas, RestLimits(), FrontSettings(token_map="t")))
    )
    server = tree.all("http")[0].all("server")[0]
    pages = {p.words[1]: p.words[-1] for p in server.all("error_page")}
    for status in (
        "400",
        "401",
        "404",
        "405",
        "408",
        "411",
        "413",
        "414",
        "494",
        "500",
        "501",
        "504",
        "505",
    ):
        target = pages[status]
        assert target.startswith("/.front/"), (status, target)
        (location,) = [loc for loc in server.all("location") if loc.words[1:] == ["=", target]]
        assert location.value("internal") == []
        code, body = location.value("return")
        assert code == ("431" if status == "494" else status)
        assert set(json.loads(body)) >= {"error", "message"}
    # A stranger's request is exempt from the check only on those exact pages (where
    # nginx sends what it could not read), and on a plain health check (no body);
    # anything else is checked. The key: token:method:content-length:transfer-coding:uri.
    (stranger,) = [m for m in tree.all("http")[0].all("map") if m.words[2] == "$bridge_stranger"]
    assert stranger.words[1] == (
        "$bridge_token_ok:$request_method:$http_content_length:$http_transfer_encoding:$uri"
    )
    exempt = [c.words[0] for c in stranger.children if c.words[1] == "0"]
    patterns = [re.compile(e[1:]) for e in exempt if e.startswith("~")]

    def is_exempt(key: str) -> bool:
        return key in exempt or any(p.search(key) for p in patterns)

    for key in (
        "0:GET:::/.front/401",
        "0:POST:5::/.front/413",
        "0:POST::gzip, chunked:/.front/501",
        "0:HEAD:::/v1/health",
        "0:GET:0::/health",
        "1:POST:5::/v1/sessions",
        "1:GET:999999::/health",
    ):
        assert is_exempt(key), key
    for key in (
        "0:GET:::/.front/401;x",
        "0:GET:::/.front/999",
        "0:GET:::/.front/",
        "0:GET:::/v1/sessions",
        "0:GET:::/x:/.front/413",
        "0:GET:1::/health",
        "0:GET:999999999999::/health",
        "0:HEAD::chunked:/v1/health",
        "0:POST:::/health",
    ):
        assert not is_exempt(key), key
    # The pages that would tell a stranger a bound, or that they exist, send a request
    # without the token to the 401; the others (what nginx could not read) do not.
    for status, target in pages.items():
        if not target.startswith("/.front/"):
            continue
        (location,) = [loc for loc in server.all("location") if loc.words[1:] == ["=", target]]
        guards = [
            g
            for g in location.all("if")
            if g.words[1:] == ["($bridge_token_ok", "=", "0)"]
            and g.value("rewrite") == ["^", "/.front/401", "last"]
        ]
        assert len(guards) == (status in ("404", "413", "494")), (status, location)
    # The token check runs before a location is chosen: in the server block itself.
    (check,) = [c for c in server.all("if") if c.words[1] == "($bridge_stranger)"]
    assert check.words[1:] == ["($bridge_stranger)"]
    assert check.value("rewrite") == ["^", "/.front/401", "last"]


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
    import socket

    hung = {}
    for name in ("bridge-0", "bridge-1"):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        hung[name] = listener
    front_port = free_port("127.0.0.1")
    prefix = tmp_path / "front"
    prefix.mkdir()
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
    (prefix / "nginx.conf").write_text(config)
    front = subprocess.Popen(
        [
            *(nginx_binary(), "-p", f"{prefix}/", "-c", f"{prefix}/nginx.conf", "-e", "stderr"),
            *("-g", "daemon off; error_log stderr notice;"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert front.stderr is not None
        for line in front.stderr:  # bound before its worker starts
            if "start worker process" in line:
                break
        else:
            pytest.fail("nginx did not start")
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
                conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
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
        front.terminate()
        front.wait(30)
        for listener in hung.values():
            listener.close()
