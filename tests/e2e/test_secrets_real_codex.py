"""The real codex, asked by a caller to read the bridge's environment, finds no secret.

The attack as reported: a raw `fs/readFile` of `/proc/<bridge pid>/environ` returned the
bridge's token and the app-server token. The bridge here is a real `rest-bridge serve`
(the `trusted` preset, which lets every method through), with both tokens given in its
environment, in front of the pinned codex, in process and in shared mode.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

pytestmark = [pytest.mark.asyncio, pytest.mark.real_codex]

REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))
TOKEN = "tok-e2e-91f3-never-readable"
APP_SERVER_TOKEN = "ws-e2e-4c2a-never-readable"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT = 60.0


@pytest.mark.parametrize("mode", ["process", "shared"])
async def test_fs_read_file_of_the_bridge_environ_holds_no_secret(
    codex_bin: str, tmp_path: Path, mode: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REST_ADAPTER_")}
    env.update(
        {
            "REST_ADAPTER_TOKEN": TOKEN,
            "REST_ADAPTER_APP_SERVER_TOKEN": APP_SERVER_TOKEN,
            "REST_ADAPTER_APP_SERVER_MODE": mode,
            "CODEX_HOME": str(tmp_path),
            "OPENAI_API_KEY": "x",
        }
    )
    bridge = await asyncio.create_subprocess_exec(
        *(REST_BRIDGE, "serve", "--port", "0", "--app-server", f"{codex_bin} app-server"),
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert bridge.stdout is not None
        base = ""
        async with asyncio.timeout(WAIT):
            while not base and (line := await bridge.stdout.readline()):
                found = re.search(rb"listening on (http://\S+)", line)
                base = found.group(1).decode() if found else ""
        assert base, "the bridge did not start"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
            async with http.post(base + "/v1/sessions", headers=AUTH, json={}) as response:
                created = await response.json()
                assert response.status == 201, created
            url = f"{base}/v1/sessions/{created['sessionId']}/call/fs/readFile"
            params = {"path": f"/proc/{bridge.pid}/environ"}
            async with http.post(url, headers=AUTH, json={"params": params}) as response:
                answer = await response.json()
                assert response.status == 200, answer
        environ = base64.b64decode(answer["result"]["dataBase64"])
        # codex read the bridge's environment (its CODEX_HOME is there)...
        assert f"CODEX_HOME={tmp_path}".encode() in environ
        # ...and neither secret, nor the variables that held them.
        assert TOKEN.encode() not in environ
        assert APP_SERVER_TOKEN.encode() not in environ
        assert b"REST_ADAPTER_TOKEN=" not in environ
        assert b"REST_ADAPTER_APP_SERVER_TOKEN=" not in environ
    finally:
        if bridge.returncode is None:
            bridge.send_signal(signal.SIGTERM)
        async with asyncio.timeout(WAIT):
            await bridge.communicate()
    assert bridge.returncode == 0
