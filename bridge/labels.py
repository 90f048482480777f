"""The label values of the bridge's metrics, without Prometheus.

The request path computes them (a request's method and status class, an app-server's
exit reason) whether or not metrics are counted; :mod:`bridge.metrics`, which holds the
prometheus-client registry, is imported only where metrics are on (the operations
listener), so a bridge without them does not load prometheus-client at all.
"""

from __future__ import annotations

#: The HTTP methods that are their own label value (OpenTelemetry's known methods);
#: any other is ``_OTHER``, so a caller cannot grow the label set.
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
#: How an app-server conversation ended (``rest_bridge_app_server_exits_total``).
EXIT_REASONS = ("exited", "failed", "signal", "protocol_error", "connection_closed")


def class_number(status: int) -> int:
    """1 to 5 for 1xx to 5xx; a status outside 100-599 (aiohttp writes any integer a
    handler sets) is counted as 5xx."""
    return status // 100 if 100 <= status < 600 else 5


def status_class(status: int) -> str:
    return STATUS_CLASSES[class_number(status) - 1]


def exit_reason(exit_code: int | None, signal: str | None, protocol: bool, connection: bool) -> str:
    """One of :data:`EXIT_REASONS` for an ended conversation."""
    if protocol:
        return "protocol_error"
    if connection:
        return "connection_closed"
    if signal is not None:
        return "signal"
    return "exited" if exit_code == 0 else "failed"
