"""`rest-bridge-scenarios replay`: cassettes served over real sockets to a client that is
not the harness (here plain aiohttp reading SSE bytes; examples/node-host does it in
Node), matched as the respx mock matches, with the report on its route and at the stop.

Each test gets a copy of a library scenario and its cassette in its own temporary folder
(recorded from that scenario once per session: the real bridge and fake-codex run for
the recording only), then starts the replay server as a user would, on port 0, and
learns its URL from its first line.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from processes import storm_of_sigterm_after_sigint

from scenarios.cassette import Cassette, cassette_for, cassette_path
from scenarios.format import load_scenario
from scenarios.replay_server import MAX_REASON_CHARS, MAX_UNMATCHED, REPORT_ROUTE

LIBRARY = Path(__file__).resolve().parents[2] / "scenarios" / "library"
COMMAND = str(Path(sys.executable).with_name("rest-bridge-scenarios"))
LISTENING = "rest-bridge-scenarios replay listening on http://"


@pytest.fixture(scope="session")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A library scenario copied into a folder of this session, its cassette recorded
    there: once per scenario, however many tests replay it."""
    folder = tmp_path_factory.mktemp("recordings")
    done: dict[str, Path] = {}

    def record(name: str) -> Path:
        if name not in done:
            target = folder / f"{name}.scenario.yaml"
            shutil.copy(LIBRARY / f"{name}.scenario.yaml", target)
            cassette_for(load_scenario(target), record="once")
            done[name] = target
        return done[name]

    return record


@pytest.fixture
def cassette(tmp_path: Path, recordings: Any) -> Any:
    """A library scenario copied into this test's folder, with its cassette (recorded
    from it, as `record="once"` does, in `recordings`): a test may change its copies."""

    def record(name: str) -> Path:
        recorded = recordings(name)
        target = tmp_path / recorded.name
        shutil.copy(recorded, target)
        cassette_path(target).parent.mkdir(exist_ok=True)
        shutil.copy(cassette_path(recorded), cassette_path(target))
        return cassette_path(target)

    return record


class Replay:
    """A running `rest-bridge-scenarios replay`."""

    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process, self.url = process, url

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, dict[str, Any], str]:
        """Its exit status, the report it printed, and its stderr."""
        self.process.send_signal(sig)
        out, err = self.process.communicate(timeout=30)
        assert out.startswith("{"), (self.process.returncode, out, err)
        return self.process.returncode, json.loads(out), err


@contextmanager
def replay(*args: str | Path) -> Iterator[Replay]:
    process = subprocess.Popen(
        [COMMAND, "replay", *map(str, args), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(LISTENING), (line, process.stderr and process.stderr.read())
        yield Replay(process, line.split()[-1])
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


async def frames(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The SSE frames of `response`, parsed from its bytes: {"id", "event", "data"}."""
    frame: dict[str, Any] = {}
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if "data" in frame:
                yield frame
            frame = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            frame[name] = json.loads(value) if name == "data" else value


@pytest.mark.asyncio
async def test_a_host_reads_a_turn_over_sse_resumes_after_an_id_and_the_replay_passes(
    cassette: Any, tmp_path: Path
) -> None:
    path = cassette("turn-stream-and-resume")
    report_file = tmp_path / "report.json"
    with replay(path, "--report", report_file) as server:
        async with aiohttp.ClientSession(server.url) as http:
            created = await http.post("/v1/sessions", json={})
            assert created.status == 201
            session = (await created.json())["sessionId"]
            stream = await http.get(f"/v1/sessions/{session}/events/stream")
            assert stream.headers["Content-Type"].startswith("text/event-stream")
            started = await http.post(
                f"/v1/sessions/{session}/call/thread/start", json={"params": {}}
            )
            thread = (await started.json())["result"]["thread"]["id"]
            turn = await http.post(
                f"/v1/sessions/{session}/call/turn/start",
                json={"params": {"threadId": thread, "input": [{"type": "text", "text": "hi"}]}},
            )
            assert (await turn.json())["result"]["turn"]["status"] == "inProgress"
            seen = []
            async for frame in frames(stream):
                seen.append(frame)
                if frame["data"].get("method") == "turn/completed":
                    break
            stream.close()
            ids = [int(frame["id"]) for frame in seen]
            assert ids == list(range(1, len(ids) + 1))
            assert [frame["data"]["seq"] for frame in seen] == ids
            methods = [frame["data"]["method"] for frame in seen]
            assert methods.index("turn/started") < methods.index("turn/completed")

            resumed = await http.get(
                f"/v1/sessions/{session}/events/stream", headers={"Last-Event-ID": "3"}
            )
            again = [frame async for frame in frames(resumed)]
            assert [int(frame["id"]) for frame in again] == ids[3:]
            assert again == seen[3:]

            report = await (await http.get(REPORT_ROUTE)).json()
            assert report["passed"] is True, report
        status, printed, err = server.stop()
    assert status == 0, err
    assert printed == report == json.loads(report_file.read_text())
    assert printed["cassettes"] == [
        {"path": str(path), "scenario": "turn-stream-and-resume", "exchanges": 5, "unused": 0}
    ]


@pytest.mark.asyncio
async def test_unmatched_requests_get_the_payload_and_with_unused_ones_fail_the_replay(
    cassette: Any,
) -> None:
    path = cassette("auth-rejection")
    with replay(path) as server:
        async with aiohttp.ClientSession(server.url) as http:
            missing = await http.get("/v1/nothing/here?x=1")
            assert missing.status == 404
            body = await missing.json()
            assert body["error"] == "not_recorded"
            assert body["data"] == {"method": "GET", "path": "/v1/nothing/here?x=1"}
            assert "no cassette records a request to GET /v1/nothing/here" in body["message"]
            # A route the cassette has, asked with another token: the mock's reason, which
            # never shows the recorded token.
            other = await http.get("/v1/sessions", headers={"Authorization": "Bearer intruder"})
            assert other.status == 404
            reason = (await other.json())["message"]
            assert "auth-rejection" in reason, reason
            assert "differs" in reason, reason
            assert "Authorization: another value" in reason
            assert "s3cret" not in reason
            # The replay server's own prefix answers nothing but its report.
            admin = await http.post(REPORT_ROUTE)
            assert (admin.status, (await admin.json())["error"]) == (404, "not_found")
            report = await (await http.get(REPORT_ROUTE)).json()
        status, printed, err = server.stop(signal.SIGINT)
    assert status == 1
    assert printed == report
    assert printed["passed"] is False
    assert printed["unmatchedTotal"] == 2
    assert [(item["method"], item["path"]) for item in printed["unmatched"]] == [
        ("GET", "/v1/nothing/here?x=1"),
        ("GET", "/v1/sessions"),
    ]
    assert printed["unused"]
    assert all(item["cassette"] == str(path) for item in printed["unused"])
    assert printed["cassettes"][0]["unused"] == len(printed["unused"]) == 6
    assert "never requested" in printed["unused"][0]["exchange"]
    assert "matched nothing: GET /v1/nothing/here?x=1" in err
    assert "Traceback" not in err
    assert "s3cret" not in err + json.dumps(printed)


@pytest.mark.asyncio
async def test_an_attacker_cannot_grow_its_memory_or_reach_past_the_cassettes(
    cassette: Any,
) -> None:
    """Loopback by default; bodies over the bound are 413 before any matching; the
    unmatched list stops at its bound while the count goes on; no file is served."""
    path = cassette("auth-rejection")
    with replay(path, "--max-body-bytes", "1000") as server:
        assert server.url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession(server.url) as http:
            big = await http.post("/v1/sessions", data=b"x" * 5000)
            assert big.status == 413
            assert (await big.json())["error"] == "payload_too_large"
            for path_tried in (
                "/../../etc/passwd",
                "/%2e%2e/%2e%2e/etc/passwd",
                f"/cassettes/{path.name}",
                "/long" + "x" * 5000,  # its reason is cut in the report
            ):
                response = await http.get(path_tried)
                assert response.status == 404
                assert "root:" not in (text := await response.text())
                assert "interactions" not in text
            await asyncio.gather(
                *(http.get(f"/v1/sessions/{i}/events?after=0") for i in range(MAX_UNMATCHED + 20))
            )
        status, printed, _ = server.stop()
    assert status == 1
    assert printed["unmatchedTotal"] == MAX_UNMATCHED + 24
    assert len(printed["unmatched"]) == MAX_UNMATCHED
    assert max(len(item["reason"]) for item in printed["unmatched"]) == MAX_REASON_CHARS


@pytest.mark.asyncio
async def test_sigterm_during_an_open_stream_ends_it_and_the_replay(cassette: Any) -> None:
    path = cassette("turn-stream-and-resume")
    with replay(path) as server:
        async with aiohttp.ClientSession(server.url) as http:
            session = (await (await http.post("/v1/sessions", json={})).json())["sessionId"]
            stream = await http.get(f"/v1/sessions/{session}/events/stream")
            assert stream.status == 200
            status, printed, err = await asyncio.to_thread(server.stop)
            with pytest.raises(aiohttp.ClientPayloadError):
                await stream.content.read()
    assert status == 1
    assert any("SSE frame(s) never read" in item["exchange"] for item in printed["unused"])
    assert "Traceback" not in err


@pytest.mark.asyncio
async def test_a_stream_whose_next_part_waits_for_a_request_never_made_is_cut(
    cassette: Any,
) -> None:
    path = cassette("turn-stream-and-resume")
    with replay(path, "--release-timeout", "0.5") as server:
        async with aiohttp.ClientSession(server.url) as http:
            session = (await (await http.post("/v1/sessions", json={})).json())["sessionId"]
            stream = await http.get(f"/v1/sessions/{session}/events/stream")
            # The host never starts the turn: the stream ends where its events wait for it.
            seen = [frame async for frame in frames(stream)]
            assert all(frame["data"].get("method") != "turn/started" for frame in seen)
            report = await (await http.get(REPORT_ROUTE)).json()
            status, printed, _ = server.stop()
    assert status == 1
    assert printed == report
    [cut] = printed["cut"]
    assert cut["path"] == f"/v1/sessions/{session}/events/stream"
    assert "call/turn/start" in cut["reason"]
    assert "did not make it within 0.5 s" in cut["reason"]


@pytest.mark.parametrize(
    "case", ["stale", "not-a-cassette", "missing", "no-scenario", "port-taken"]
)
def test_what_cannot_be_replayed_stops_it_before_it_listens(
    cassette: Any, tmp_path: Path, case: str
) -> None:
    path = cassette("auth-rejection")
    if case == "stale":
        scenario = tmp_path / "auth-rejection.scenario.yaml"
        scenario.write_text(scenario.read_text().replace("tags: [auth,", "tags: [changed, auth,"))
        expected = "regenerate it: python -m scenarios.cassette record"
    elif case == "not-a-cassette":
        path.write_text("- just a list\n")
        expected = "not a cassette of this tool"
    elif case == "missing":
        path = tmp_path / "cassettes" / "nothing.yaml"
        expected = "no such file"
    elif case == "no-scenario":
        path = shutil.copy(path, tmp_path / "loose.yaml")
        path = Path(path)
        expected = "its scenario"
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1] if case == "port-taken" else 0
    if case == "port-taken":
        expected = f"cannot listen on 127.0.0.1:{port}"
    with taken:
        done = subprocess.run(
            [COMMAND, "replay", str(path), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_replay_runs_no_scenarios_package_of_the_working_directory(
    cassette: Any, tmp_path: Path
) -> None:
    """A host keeps its scenario files in a `scenarios/` folder: the replay server is
    still this project's, never a module of that folder."""
    path = cassette("auth-rejection")
    planted = tmp_path / "work" / "scenarios"
    planted.mkdir(parents=True)
    marker = tmp_path / "imported"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (planted / "replay_server.py").write_text("raise SystemExit(99)\n")
    process = subprocess.Popen(
        [COMMAND, "replay", str(path), "--port", "0"],
        cwd=planted.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().startswith(LISTENING)
    process.terminate()
    process.communicate(timeout=30)
    assert process.returncode == 1
    assert not marker.exists()


@pytest.mark.asyncio
async def test_several_cassettes_answer_in_the_order_given(cassette: Any) -> None:
    first, second = cassette("turn-stream-and-resume"), cassette("approval-long-poll")
    recorded = [
        json.loads(Cassette.load(path).interactions[0].response_body)["sessionId"]
        for path in (first, second)
    ]
    with replay(first, second) as server:
        async with aiohttp.ClientSession(server.url) as http:
            made = [
                (await (await http.post("/v1/sessions", json={})).json())["sessionId"]
                for _ in range(2)
            ]
            third = await http.post("/v1/sessions", json={})
            assert (await third.json())["error"] == "not_recorded"
            status, printed, _ = server.stop()
    assert made == recorded
    assert status == 1
    assert [item["path"] for item in printed["cassettes"]] == [str(first), str(second)]
    assert {item["cassette"] for item in printed["unused"]} == {str(first), str(second)}
    assert "answers this route 1 time(s)" in printed["unmatched"][0]["reason"]


@pytest.mark.asyncio
async def test_a_client_that_vanishes_mid_stream_or_resumes_elsewhere(cassette: Any) -> None:
    """A stream dropped half-read leaves the server serving; a resume from an id the
    recording never resumed from matches nothing, saying why."""
    path = cassette("turn-stream-and-resume")
    with replay(path) as server:
        async with aiohttp.ClientSession(server.url) as http:
            session = (await (await http.post("/v1/sessions", json={})).json())["sessionId"]
            stream = await http.get(f"/v1/sessions/{session}/events/stream")
            started = await http.post(
                f"/v1/sessions/{session}/call/thread/start", json={"params": {}}
            )
            thread = (await started.json())["result"]["thread"]["id"]
            turn = {"threadId": thread, "input": [{"type": "text", "text": "hi"}]}
            path = f"/v1/sessions/{session}/call/turn/start"
            assert (await http.post(path, json={"params": turn})).status == 200
            first = await anext(frames(stream))
            assert first["id"] == "1"
            stream.close()  # gone, with most of the stream unread
            elsewhere = await http.get(
                f"/v1/sessions/{session}/events/stream", headers={"Last-Event-ID": "2"}
            )
            assert elsewhere.status == 404
            reason = (await elsewhere.json())["message"]
            assert "Last-Event-ID: another value instead of '3'" in reason, reason
            still = await http.get(REPORT_ROUTE)  # still serving
            assert still.status == 200
            status, printed, err = server.stop()
    assert status == 1
    # What was sent counts as read (the server cannot see what the client read); the
    # recorded resume was never asked for.
    [unused] = printed["unused"]
    assert "never requested" in unused["exchange"]
    assert "resume after" in unused["exchange"]
    assert "Traceback" not in err


def test_a_storm_of_stop_signals_still_ends_with_the_whole_report(cassette: Any) -> None:
    path = cassette("auth-rejection")
    with replay(path) as server:  # the report is small: the pipe holds it all
        status = storm_of_sigterm_after_sigint(server.process)  # type: ignore[arg-type]
        assert server.process.stdout is not None
        printed = json.loads(server.process.stdout.read())
    assert status == 1
    assert printed["cassettes"][0]["unused"] == 6


def test_a_body_that_never_arrives_is_408_and_its_connection_closed(cassette: Any) -> None:
    path = cassette("auth-rejection")
    with replay(path, "--body-timeout-ms", "300") as server:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as slow:
            slow.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            answer = b""
            while chunk := slow.recv(65536):  # until the server closes the connection
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body) == {
            "error": "request_timeout",
            "message": "The request body did not arrive within 300 ms.",
            "data": {"limitMs": 300},
        }
        server.stop()
