"""The real codex with nothing to reach: a text turn fails at once with a clear error.

codex 0.169.0 that cannot connect to its model (no network, nothing listening at the
provider's address) says `Reconnecting... waiting for network` in an `error`
notification and waits without end; a text turn used to sit there until its deadline
(10 minutes by default).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fakes.model_provider import codex_config_overrides


@pytest.mark.asyncio
async def test_a_text_turn_on_a_codex_that_cannot_reach_its_model_fails_fast(
    codex_bin: str, codex_start_bridge, codex_home: Path, workspace: Path
) -> None:
    # Bound, never listening: every connection to it is refused, and no one else gets it.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
        # codex's own retry policy (max_retries=None), as a codex with no network has it.
        overrides = codex_config_overrides(url, max_retries=None)
        command = ["env", "-C", str(workspace), f"CODEX_HOME={codex_home}", "OPENAI_API_KEY=x"]
        command += [codex_bin, "app-server", *(a for o in overrides for a in ("-c", o))]
        bridge = await codex_start_bridge(app_server=command)
        async with bridge.client().post("/v1/text-turn", json={"text": "hi"}) as response:
            body = await response.json()
    assert response.status == 504, body
    assert body["error"] == "timeout"
    assert body["message"].startswith("The app-server cannot reach its model"), body
    assert body["data"]["reason"] == "model_unreachable"
    assert "waiting for network" in body["data"]["lastError"], body
