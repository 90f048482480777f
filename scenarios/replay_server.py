"""`rest-bridge-scenarios replay`: recorded cassettes served over HTTP, for host code in
any language (what WireMock's standalone playback is to a Java team).

Each request goes to the respx mock's own router (`scenarios.respx_mock.ScenarioRouter`)
of each cassette in turn, so it is matched, answered and streamed exactly as the respx
mock does it in-process; the server only carries bytes between a socket and that router.
What no cassette answers gets the error payload (kind `not_recorded`) and is kept for the
report; `GET /__replay/report` answers the report at any time, and a stop (SIGTERM,
SIGINT) prints it and sets the exit status. scenarios/README.md ("The replay server")
documents it for its users.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from multidict import CIMultiDict

from bridge.errors import failure_response, of_kind, request_timeout
from bridge.runtime import address, stop_on_first_signal
from bridge.server import SERVER_SETTINGS
from scenarios.cassette import ORIGIN, CassetteError, cassette_for, cassette_path
from scenarios.format import LoadedScenario, ScenarioError, load_scenario

if TYPE_CHECKING:  # the respx extra; imported once a replay starts, not for `--help`
    import httpx

    from scenarios.respx_mock import ScenarioRouter

#: The replay server's own routes: no route of the bridge starts with it.
ADMIN_PREFIX = "/__replay"
REPORT_ROUTE = f"{ADMIN_PREFIX}/report"
#: The error kind of a request no cassette answers (in bridge/errors.py's table).
NOT_RECORDED = "not_recorded"
#: Request bodies above this are refused with 413 (`--max-body-bytes`).
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: A request body must arrive within this, else 408 (`--body-timeout-ms`).
DEFAULT_BODY_TIMEOUT_MS = 10_000
#: Unmatched requests the report lists (it counts every one).
MAX_UNMATCHED = 100
#: How much of a reason the report keeps.
MAX_REASON_CHARS = 2000
#: How long a recorded event waits for the request it came after (`--release-timeout`).
DEFAULT_RELEASE_SECONDS = 30.0
#: Streams and long-polls that may wait at once for the request they follow.
WAITING_THREADS = 64
#: A handler still running this long after the stop is cancelled.
SHUTDOWN_SECONDS = 1.0
#: Exit statuses: every recorded exchange made and nothing unmatched; else; bad usage.
PASSED, FAILED, USAGE_ERROR = 0, 1, 2
#: Recorded response headers the server does not repeat: its own framing decides them.
_NOT_REPEATED = {"connection", "keep-alive", "content-length", "transfer-encoding", "date"}
_NOT_REPEATED |= {"server"}


class ReplayError(Exception):
    """The replay cannot start (a file that is not a cassette, a stale one...)."""


@dataclass
class Replayed:
    """One cassette being served."""

    path: Path
    loaded: LoadedScenario
    router: ScenarioRouter


@dataclass
class Replay:
    """The cassettes, in the order a request tries them, and what went wrong so far."""

    cassettes: list[Replayed]
    max_unmatched: int = MAX_UNMATCHED
    body_timeout_ms: int = DEFAULT_BODY_TIMEOUT_MS
    unmatched: list[dict[str, Any]] = field(default_factory=list)
    unmatched_total: int = 0
    cut: list[dict[str, Any]] = field(default_factory=list)  # streams that stopped early

    def report(self) -> dict[str, Any]:
        """What was never requested and what matched nothing (scenarios/README.md)."""
        cassettes, unused = [], []
        for item in self.cassettes:
            missing = item.router.unserved()
            cassettes.append(
                {
                    "path": str(item.path),
                    "scenario": item.router.cassette.scenario,
                    "exchanges": len(item.router.cassette.interactions),
                    "unused": len(missing),
                }
            )
            unused += [{"cassette": str(item.path), "exchange": text} for text in missing]
        passed = not unused and not self.unmatched_total and not self.cut
        return {
            "passed": passed,
            "cassettes": cassettes,
            "unused": unused,
            "unmatched": self.unmatched,
            "unmatchedTotal": self.unmatched_total,
            "cut": self.cut,
        }

    def _note(self, kept: list[dict[str, Any]], method: str, path: str, reason: str) -> None:
        if len(kept) < self.max_unmatched:
            kept.append({"method": method, "path": path, "reason": reason[:MAX_REASON_CHARS]})

    async def answer(self, request: web.Request) -> web.StreamResponse:
        """Any request but the replay server's own: the first cassette's answer to it."""
        import httpx

        from scenarios.respx_mock import ScenarioMockError, UnmatchedRequest

        if request.path.startswith(ADMIN_PREFIX + "/") or request.path == ADMIN_PREFIX:
            raise of_kind(
                "not_found", f"the replay server has no route {request.method} {request.path}"
            )
        try:  # at most client_max_size (else 413), within body_timeout_ms (else 408)
            async with asyncio.timeout(self.body_timeout_ms / 1000):
                body = await request.read()
        except TimeoutError:
            raise request_timeout(self.body_timeout_ms) from None
        outgoing = httpx.Request(
            request.method,
            ORIGIN + request.raw_path,
            headers=[(k, v) for k, v in request.headers.items() if k.lower() != "host"],
            content=body,
        )
        reasons = []
        for item in self.cassettes:
            try:
                resolved = await item.router.aresolve(outgoing)
            except UnmatchedRequest:
                continue
            except ScenarioMockError as exc:
                reasons.append(f"{item.path.name}: {str(exc).replace(ORIGIN, '')}")
                continue
            finally:  # respx keeps every call; a server must not
                item.router.reset()
                item.router.unmatched.clear()
            assert isinstance(resolved.response, httpx.Response)
            return await self._send(request, resolved.response)
        if reasons:
            reason = "; ".join(reasons)
        else:
            routes = f"GET {REPORT_ROUTE} lists the cassettes"
            reason = f"no cassette records a request to {request.method} {request.path} ({routes})"
        self.unmatched_total += 1
        self._note(self.unmatched, request.method, request.raw_path, reason)
        raise of_kind(
            NOT_RECORDED,
            f"no recorded exchange answers {request.method} {request.raw_path}: {reason}",
            data={"method": request.method, "path": request.raw_path},
        )

    async def _send(self, request: web.Request, response: httpx.Response) -> web.StreamResponse:
        import httpx

        from scenarios.respx_mock import ScenarioMockError

        headers = CIMultiDict(
            (key, value)
            for key, value in response.headers.multi_items()
            if key.lower() not in _NOT_REPEATED
        )
        try:
            content = response.content  # read already: not a stream
        except httpx.ResponseNotRead:
            pass
        else:
            return web.Response(status=response.status_code, body=content, headers=headers)
        out = web.StreamResponse(status=response.status_code, headers=headers)
        await out.prepare(request)
        try:
            async for chunk in response.aiter_raw():
                await out.write(chunk)
        except ScenarioMockError as exc:  # the request its next part waits for never came
            self._note(self.cut, request.method, request.raw_path, str(exc))
            return out
        finally:
            await response.aclose()
        await out.write_eof()
        return out

    async def report_route(self, request: web.Request) -> web.Response:
        return web.json_response(self.report())

    def release(self) -> None:
        """Wake every wait on a request that will now never come (the replay is over)."""
        for item in self.cassettes:
            item.router.release()


def _error_payloads(max_body_bytes: int) -> Any:
    """Every failure as the bridge's error payload (the bridge's own applications do this
    in their head middleware, which a replay server does not need)."""

    @web.middleware
    async def middleware(
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as exc:
            return await failure_response(request, exc, max_body_bytes)

    return middleware


def load_replay(
    paths: Sequence[Path],
    *,
    release_timeout: float = DEFAULT_RELEASE_SECONDS,
    max_idle_polls: int = 20,
    max_unmatched: int = MAX_UNMATCHED,
) -> Replay:
    """The cassettes of `paths`: each a scenario file (its cassette beside it, in
    `cassettes/`) or a cassette (its scenario one folder up); never recorded here."""
    from scenarios.respx_mock import ScenarioRouter

    cassettes = []
    for path in paths:
        if not path.is_file():
            raise ReplayError(f"{path}: no such file")
        scenario = path
        if not re.search(r"\.scenario\.(yaml|yml|json)$", path.name):
            folder = path.parent.parent
            found = [folder / f"{path.stem}.scenario.{kind}" for kind in ("yaml", "yml", "json")]
            if path.parent.name == "cassettes":
                scenario = next((name for name in found if name.is_file()), path)
            if scenario == path:
                raise ReplayError(
                    f"{path}: its scenario is not there: give the scenario file, or keep the "
                    "cassette as cassettes/NAME.yaml beside NAME.scenario.yaml"
                )
        try:
            loaded = load_scenario(scenario)
            cassette = cassette_for(loaded, record="none")
        except (ScenarioError, CassetteError) as exc:
            raise ReplayError(str(exc)) from None
        router = ScenarioRouter(
            loaded,
            cassette,
            base_url=ORIGIN,
            release_timeout=release_timeout,
            max_idle_polls=max_idle_polls,
        )
        cassettes.append(Replayed(cassette_path(scenario), loaded, router))
    return Replay(cassettes, max_unmatched=max_unmatched)


def make_app(replay: Replay, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    app = web.Application(
        client_max_size=max_body_bytes, middlewares=[_error_payloads(max_body_bytes)]
    )
    app.router.add_get(REPORT_ROUTE, replay.report_route, allow_head=False)
    app.router.add_route("*", "/{tail:.*}", replay.answer)
    return app


async def serve(replay: Replay, host: str, port: int, max_body_bytes: int) -> dict[str, Any]:
    """Serve until SIGTERM or SIGINT; the report at that moment."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # A stream or long-poll waiting for the request its answer follows holds a thread
    # (the respx router waits on threading events) for at most --release-timeout.
    loop.set_default_executor(ThreadPoolExecutor(WAITING_THREADS, "replay-wait"))
    # The first SIGTERM or SIGINT stops it; later ones, a storm included, are ignored
    # (also while the report is printed and the interpreter exits).
    stop_on_first_signal(stop)
    runner = web.AppRunner(
        make_app(replay, max_body_bytes),
        access_log=None,
        shutdown_timeout=SHUTDOWN_SECONDS,
        **SERVER_SETTINGS,
    )
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise ReplayError(f"cannot listen on {address(host, port)}: {exc.strerror}") from None
        bound = runner.addresses[0]
        print(f"rest-bridge-scenarios replay listening on http://{address(*bound[:2])}", flush=True)
        await stop.wait()
        report = replay.report()
    finally:
        await runner.cleanup()
        replay.release()
    return report


def write_report(report: dict[str, Any], path: Path) -> None:
    """`report` as JSON at `path`, whole or not at all."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        json.dump(report, file, indent=2)
        file.write("\n")
    os.replace(temporary, path)


def summary(report: dict[str, Any]) -> list[str]:
    """The report in a few lines, for a person."""
    lines = [
        f"never requested: {item['exchange']} ({item['cassette']})" for item in report["unused"]
    ]
    lines += [
        f"matched nothing: {item['method']} {item['path']}: {item['reason']}"
        for item in report["unmatched"]
    ]
    if report["unmatchedTotal"] > len(report["unmatched"]):
        lines.append(f"... {report['unmatchedTotal']} unmatched requests in all")
    lines += [
        f"stream cut: {item['method']} {item['path']}: {item['reason']}" for item in report["cut"]
    ]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="CASSETTE",
        help="cassettes (cassettes/NAME.yaml beside NAME.scenario.yaml) or their scenario "
        "files; a request tries them in this order",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    parser.add_argument("--report", type=Path, metavar="FILE", help="also write the report here")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--body-timeout-ms",
        type=int,
        default=DEFAULT_BODY_TIMEOUT_MS,
        help=f"a body slower than this gets 408 (default {DEFAULT_BODY_TIMEOUT_MS})",
    )
    parser.add_argument(
        "--release-timeout",
        type=float,
        default=DEFAULT_RELEASE_SECONDS,
        metavar="SECONDS",
        help="how long a recorded event waits for the request it came after "
        f"(default {DEFAULT_RELEASE_SECONDS:g})",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`rest-bridge-scenarios replay ...` (which runs this); the exit status."""
    parser = argparse.ArgumentParser(
        prog="rest-bridge-scenarios replay",
        description="Serve cassettes over HTTP until SIGTERM or SIGINT, then print the "
        "report: exit 0 when every recorded exchange was made and nothing else, else 1.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.getLogger().addHandler(logging.NullHandler())
    return run(args)


def run(args: argparse.Namespace) -> int:
    """`rest-bridge-scenarios replay`: serve until stopped; 0 when the host made every
    recorded exchange and nothing else, 1 otherwise, 2 when it cannot start."""
    positive = (args.max_body_bytes, args.release_timeout, args.body_timeout_ms)
    if min(positive) <= 0 or not 0 <= args.port <= 65535:
        print(
            "rest-bridge-scenarios replay: --max-body-bytes, --body-timeout-ms and "
            "--release-timeout must be positive, --port within 0-65535",
            file=sys.stderr,
        )
        return USAGE_ERROR
    if args.report is not None and not args.report.resolve().parent.is_dir():
        print(
            f"rest-bridge-scenarios replay: --report {args.report}: no such folder", file=sys.stderr
        )
        return USAGE_ERROR
    try:
        replay = load_replay(args.paths, release_timeout=args.release_timeout)
        replay.body_timeout_ms = args.body_timeout_ms
        report = asyncio.run(serve(replay, args.host, args.port, args.max_body_bytes))
    except (ReplayError, ModuleNotFoundError) as exc:  # the latter: no `respx` extra
        print(f"rest-bridge-scenarios replay: {exc}", file=sys.stderr)
        return USAGE_ERROR
    with contextlib.suppress(BrokenPipeError):  # the reader went away: the status says it
        print(json.dumps(report, indent=2), flush=True)
    if args.report is not None:
        write_report(report, args.report)
    for line in summary(report):
        print(f"replay: {line}", file=sys.stderr)
    return PASSED if report["passed"] else FAILED
