"""The JSON-RPC peer over a stdio channel, against small real child processes."""

import asyncio
import os
import sys
import textwrap

import pytest

from bridge.process.peer import JsonRpcPeer, ProcessGone, RpcError
from bridge.process.stdio import StdioChannel

pytestmark = pytest.mark.asyncio


async def spawn(code: str, max_line_bytes: int = 1 << 20) -> JsonRpcPeer:
    channel = StdioChannel(max_line_bytes=max_line_bytes)
    peer = JsonRpcPeer(channel)
    await channel.spawn([sys.executable, "-c", textwrap.dedent(code)])
    return peer


ECHO = """
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("method") == "fail":
        error = {"code": -32000, "message": "no", "data": [1]}
        print(json.dumps({"id": msg["id"], "error": error}), flush=True)
    elif "id" in msg and "method" in msg:
        print(json.dumps({"id": msg["id"], "result": {"echo": msg.get("params")}}), flush=True)
"""


async def test_call_returns_the_result():
    process = await spawn(ECHO)
    assert await process.call("x", {"a": 1}, 10) == {"echo": {"a": 1}}
    info = await process.shutdown(5)
    assert info.exit_code == 0


async def test_error_reply_raises_rpc_error_with_code_message_data():
    process = await spawn(ECHO)
    with pytest.raises(RpcError) as info:
        await process.call("fail", None, 10)
    assert (info.value.code, info.value.message, info.value.data) == (-32000, "no", [1])
    await process.shutdown(5)


async def test_message_with_method_is_a_request_even_if_its_id_is_pending():
    process = await spawn(
        """
        import json, sys
        line = sys.stdin.readline()
        msg = json.loads(line)
        # A server request reusing the client's id, then the real answer.
        print(json.dumps({"id": msg["id"], "method": "item/tool/call", "params": {}}), flush=True)
        print(json.dumps({"method": "note", "params": {"n": 1}}), flush=True)
        print(json.dumps({"id": msg["id"], "result": "answer"}), flush=True)
        sys.stdin.read()
        """
    )
    requests, notes = [], []
    process.on_request = lambda i, m, p: requests.append((i, m))
    process.on_notification = lambda m, p: notes.append((m, p))
    assert await process.call("go", None, 10) == "answer"
    assert requests == [(1, "item/tool/call")]
    assert notes == [("note", {"n": 1})]
    await process.shutdown(5)


async def test_non_json_line_fails_pending_calls_with_protocol_error():
    process = await spawn(
        """
        import sys
        sys.stdin.readline()
        print("this is not json", flush=True)
        sys.stdin.read()
        """
    )
    with pytest.raises(ProcessGone) as info:
        await process.call("go", None, 10)
    assert info.value.exit_info.protocol_error == "the app-server wrote a line that is not JSON"
    assert not process.running


async def test_line_over_the_limit_fails_the_process_without_buffering_it():
    process = await spawn(
        """
        import sys
        sys.stdin.readline()
        sys.stdout.write("x" * 5_000_000)
        sys.stdout.flush()
        sys.stdin.read()
        """,
        max_line_bytes=100_000,
    )
    with pytest.raises(ProcessGone) as info:
        await process.call("go", None, 10)
    assert "MAX_LINE_BYTES" in (info.value.exit_info.protocol_error or "")


async def test_exit_mid_call_fails_the_call_with_exit_code_and_stderr_tail():
    process = await spawn(
        """
        import sys
        sys.stdin.readline()
        sys.stderr.write("\\x1b[31mfatal: out of cheese\\x1b[0m\\n")
        sys.exit(3)
        """
    )
    with pytest.raises(ProcessGone) as info:
        await process.call("go", None, 10)
    exit_info = info.value.exit_info
    assert exit_info.exit_code == 3
    assert exit_info.signal is None
    assert exit_info.stderr_tail == "fatal: out of cheese\n"


async def test_stderr_flood_keeps_only_a_bounded_tail():
    process = await spawn(
        """
        import sys
        chunk = "e" * 65536
        for _ in range(300):
            sys.stderr.write(chunk)
        sys.stderr.write("THE END")
        sys.stderr.flush()
        """
    )
    info = await process.wait()
    assert info.stderr_tail.endswith("THE END")
    assert len(info.stderr_tail) <= 8192


async def test_final_line_without_newline_is_still_delivered():
    process = await spawn(
        """
        import json, sys
        sys.stdin.readline()
        sys.stdout.write(json.dumps({"method": "last", "params": 1}))
        """
    )
    notes = []
    process.on_notification = lambda m, p: notes.append(m)
    process.notify("go")  # it speaks only once the handler is in place
    await process.wait()
    assert notes == ["last"]


async def test_shutdown_kills_a_process_that_ignores_eof_and_sigterm_and_its_children():
    process = await spawn(
        """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stdin.readline()
        sleeper = "import time; time.sleep(600)"  # sync-ok: the grandchild idles
        child = subprocess.Popen([sys.executable, "-c", sleeper])
        print('{"method": "child", "params": %d}' % child.pid, flush=True)
        while True:
            time.sleep(1)  # sync-ok: the child idles, ignoring SIGTERM
        """
    )
    child_pid = asyncio.get_running_loop().create_future()
    process.on_notification = lambda m, p: child_pid.set_result(p)
    process.notify("go")  # it speaks only once the handler is in place
    pid = await asyncio.wait_for(child_pid, 30)
    info = await process.shutdown(0.3)
    assert info.signal == "SIGKILL"
    assert await _dies(pid)


async def test_grandchild_dies_when_the_app_server_exits_on_its_own():
    process = await spawn(
        """
        import subprocess, sys
        sys.stdin.readline()
        sleeper = "import time; time.sleep(600)"  # sync-ok: the grandchild idles
        child = subprocess.Popen([sys.executable, "-c", sleeper])
        print('{"method": "child", "params": %d}' % child.pid, flush=True)
        sys.stdin.readline()
        """
    )
    child_pid = asyncio.get_running_loop().create_future()
    process.on_notification = lambda m, p: child_pid.set_result(p)
    process.notify("go")  # it speaks only once the handler is in place
    pid = await asyncio.wait_for(child_pid, 30)
    process.notify("bye")
    info = await process.wait()
    assert info.exit_code == 0
    assert await _dies(pid)


async def _dies(pid: int, within: float = 10.0) -> bool:
    """True once ``pid`` has exited: its pidfd becomes readable then (no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    try:
        await asyncio.wait_for(exited, within)
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return True


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def test_writing_after_exit_raises_process_gone():
    process = await spawn("pass")
    await process.wait()
    with pytest.raises(ProcessGone):
        process.notify("late")


STALLS = """
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" in msg and msg.get("method") != "stall":
        print(json.dumps({"id": msg["id"], "result": msg["id"]}), flush=True)
"""


async def test_a_short_timeout_fires_before_a_longer_one_already_in_flight():
    """One timer serves every call's deadline: a new, earlier deadline moves it forward."""
    process = await spawn(STALLS)
    # Tasks start in the order they were created: the long call's deadline comes first.
    long = asyncio.create_task(process.call("stall", None, 600))
    short = asyncio.create_task(process.call("stall", None, 0.2))
    with pytest.raises(TimeoutError):
        await short
    assert not long.done()
    assert await process.call("x", None, 10) == 3  # the process still answers
    await process.shutdown(5)
    with pytest.raises(ProcessGone):
        await long


async def test_answered_calls_leave_a_bounded_deadline_heap_and_a_stall_still_times_out():
    process = await spawn(STALLS)
    for batch in range(20):
        results = await asyncio.gather(*(process.call("x", None, 60) for _ in range(50)))
        assert results == list(range(batch * 50 + 1, batch * 50 + 51))
        # Compacted past twice the calls in flight (50) plus 64: never all 1,000 entries.
        assert len(process._deadlines) <= 2 * 50 + 64 + 1
    # A stalled call among a thousand answered ones (whose deadlines are later).
    with pytest.raises(TimeoutError):
        await process.call("stall", None, 0.2)
    await process.shutdown(5)
    assert process._deadline_timer is None
    assert process._deadlines == []
