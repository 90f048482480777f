"""deploy/grafana/rest-bridge.json asks only for series the bridge really exports.

The names come from a live registry (the metrics of an application in each app-server
mode, built in this process as `rest-bridge serve --ops-port` builds them), not from a
list kept by hand; tests/reliability/test_prometheus.py runs every query on a real
Prometheus.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bridge.app import trusted_bridge_app
from bridge.limits import AppServerSettings
from bridge.ops import OpsListener

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "rest-bridge.json"
SERIES = re.compile(r"\b(?:rest_bridge|http_server)_[a-z0-9_]+\b")


def dashboard_queries() -> list[str]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def exported_series() -> set[str]:
    names: set[str] = set()
    for mode in ("process", "shared"):
        app = trusted_bridge_app(["codex", "app-server"], None, AppServerSettings(mode=mode))
        names |= OpsListener(app).metrics.names()
    return names


def test_every_series_the_dashboard_asks_for_is_exported() -> None:
    exported = exported_series()
    asked = {name for query in dashboard_queries() for name in SERIES.findall(query)}
    assert asked, "the dashboard asks for nothing"
    assert asked - exported == set()


def test_the_dashboard_shows_what_operators_need() -> None:
    asked = " ".join(dashboard_queries())
    for needed in (
        "rest_bridge_sessions",
        "http_server_request_duration_seconds_count",
        "http_server_request_duration_seconds_bucket",
        "rest_bridge_app_server_exits_total",
        "rest_bridge_server_requests_pending",
        "rest_bridge_server_request_wait_seconds_bucket",
        "rest_bridge_events_appended_total",
        "rest_bridge_event_gaps_total",
    ):
        assert needed in asked, needed


def test_the_exported_names_follow_prometheus_conventions() -> None:
    for name in exported_series():
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        if "seconds" in name or "bytes" in name:
            assert re.search(r"_(seconds|bytes)(_bucket|_count|_sum)?$", name), name
