"""The front's nginx configuration: generated, accepted by nginx, and what Kubernetes gets."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from bridge.cluster import free_port
from bridge.front import FrontSettings, Replica, parse_replica, render, replace_config_map
from bridge.limits import RestLimits

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes" / "bridge.yaml"
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else "")
    if not found:
        message = "nginx is not installed (make nginx installs Debian's package)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


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


def test_front_config_is_accepted_by_nginx(tmp_path):
    printed = subprocess.run(
        [
            REST_BRIDGE,
            "front-config",
            *("--replica", "bridge-0=127.0.0.1:8001", "--replica", "bridge-1=[::1]:8002"),
            *("--listen", f"127.0.0.1:{free_port('127.0.0.1')}"),
        ],
        env={**os.environ, "REST_ADAPTER_MAX_WAIT_MS": "45000"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "~^/v1/sessions/bridge-0\\.[^/]+(/|$) replica_bridge-0;" in printed
    assert "least_conn;" in printed
    assert "proxy_next_upstream error timeout http_429 http_503 non_idempotent;" in printed
    # The long-poll's read timeout follows MAX_WAIT_MS (45 s) plus the margin.
    assert "proxy_read_timeout 50s;" in printed
    nginx_accepts(printed, tmp_path / "front")


@pytest.mark.parametrize(
    "bad", ["bridge-0", "Bridge=127.0.0.1:1", "a=127.0.0.1", "a=127.0.0.1:0", "a=host:99999"]
)
def test_front_config_refuses_bad_replicas(bad):
    done = subprocess.run(
        [REST_BRIDGE, "front-config", "--replica", bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "rest-bridge front-config:" in done.stderr


def test_duplicate_replicas_are_refused():
    with pytest.raises(ValueError, match="unique"):
        render([Replica("a", "h:1"), Replica("a", "h:2")], RestLimits())


def documents() -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFESTS.read_text())
    }


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
    assert "valueFrom" in env["REST_ADAPTER_TOKEN"]  # from a Secret, never inline

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
    settings = FrontSettings(listen=listen, workers="auto", runtime_dir="/tmp", error_log="stderr")
    assert config_map["data"]["nginx.conf"] == render(replicas, limits, settings)
    mount = nginx["volumeMounts"][0]["mountPath"]
    assert nginx["command"][nginx["command"].index("-c") + 1] == f"{mount}/nginx.conf"
    # nginx takes it (loopback addresses instead of the pods' names, which only the
    # cluster's DNS resolves, and a runtime directory of the test's own).
    local = [Replica(r.id, f"127.0.0.1:{8001 + n}") for n, r in enumerate(replicas)]
    nginx_accepts(
        render(
            local,
            limits,
            FrontSettings(
                listen=f"127.0.0.1:{free_port('127.0.0.1')}",
                workers="auto",
                runtime_dir=str(tmp_path),
            ),
        ),
        tmp_path / "k8s",
    )


def test_write_config_map_replaces_only_the_block(tmp_path):
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "kind: ConfigMap\ndata:\n  nginx.conf: |\n    old\n\n    stale\n---\nkind: Service\n"
    )
    done = subprocess.run(
        [REST_BRIDGE, "front-config", "--replica", "a=h:1", "--write-config-map", str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    text = manifest.read_text()
    expected = render([Replica("a", "h:1")], RestLimits.from_env({}))
    assert yaml.safe_load_all(text).__next__()["data"]["nginx.conf"] == expected
    assert text.endswith("---\nkind: Service\n")
    assert replace_config_map(text, expected) == text
    with pytest.raises(ValueError, match="exactly one"):
        replace_config_map("kind: Service\n", expected)


def test_the_map_never_confuses_replicas_whose_ids_share_a_prefix():
    config = render([Replica("b-1", "h:1"), Replica("b-10", "h:2")], RestLimits())
    rules = re.findall(r"^\s+~(\S+) (replica_\S+);$", config, re.MULTILINE)
    assert [upstream for _, upstream in rules] == ["replica_b-1", "replica_b-10"]

    def route(path: str) -> list[str]:
        return [upstream for pattern, upstream in rules if re.search(pattern, path)]

    assert route("/v1/sessions/b-1.0b8e/call/x") == ["replica_b-1"]
    assert route("/v1/sessions/b-10.0b8e/events/stream") == ["replica_b-10"]
    assert route("/v1/sessions/b-1.0b8e") == ["replica_b-1"]
    assert route("/v1/sessions/b-100.0b8e") == []
    assert route("/v1/sessions/x/b-1.0b8e") == []
