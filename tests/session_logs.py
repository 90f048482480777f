"""Reading a session's log over HTTP, for tests that compare what sessions were told."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp


async def session_log(
    http: aiohttp.ClientSession,
    base: str,
    session_id: str,
    headers: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Every event the session's log holds now (long-polls with `after`: the session's
    cursor is left where it was)."""
    seen: list[dict[str, Any]] = []
    while True:
        after = seen[-1]["seq"] if seen else 0
        url = f"{base}/v1/sessions/{session_id}/events?after={after}&waitMs=1"
        async with http.get(url, headers=headers) as response:
            if response.status == 204:
                return seen
            seen.append(await response.json())


def blanked(body: Any, thread_id: str) -> str:
    """`body` as JSON with `thread_id` replaced, to compare an answer about one thread
    with the answer about another."""
    return json.dumps(body, sort_keys=True).replace(thread_id, "<thread>")
