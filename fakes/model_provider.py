"""A scripted model behind the OpenAI Responses streaming API, for the real `codex`.

`codex app-server` needs a model only to run turns. Pointed at this server (see
`ModelProviderServer.codex_config_overrides`), it POSTs `/v1/responses` with
`"stream": true` and reads Server-Sent Events. Each POST consumes the next reply of a
`ModelScript`:

- `{text: "..."}`: an assistant message, streamed as `response.output_text.delta` events;
- `{execCommand: {cmd: "...", workdir?: "..."}}`: a `function_call` to `exec_command`;
  codex runs it (asking for approval when its policy says so) and POSTs again with a
  `function_call_output`, which the next reply answers;
- `{functionCall: {name: "...", arguments: {...}, namespace?: "..."}}`: a `function_call`
  to any tool codex offers (`spawn_agent` in the `multi_agent_v1` namespace starts a
  sub-agent, for one); its output comes back as for `execCommand`;
- `{httpError: {status: 500, body?: ...}}`: a plain HTTP error instead of a stream;
- `{disconnect: true, partialText?: "..."}`: the stream is cut before `response.completed`;
- `{stall: true}`: the stream opens and then stays silent until the server stops
  (for interrupting a turn mid-stream).

Once the script runs out every POST gets `default_text`. Every request is recorded,
headers without `authorization`, so tests can assert on what codex sent.

    async with ModelProviderServer([{"text": "hello"}]) as server:
        run codex with server.codex_cli_args()
        ...
        assert server.requests[0].body["stream"] is True
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, Literal, Self

import orjson
from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
)
from pydantic.alias_generators import to_camel

from fakes.app_server.script_source import ScriptError, describe_errors, parse_yaml

__all__ = [
    "DisconnectReply",
    "ExecCommand",
    "ExecCommandReply",
    "HttpError",
    "HttpErrorReply",
    "ModelProviderServer",
    "ModelReply",
    "ModelScript",
    "RecordedRequest",
    "ScriptedModel",
    "StallReply",
    "TextReply",
    "codex_config_overrides",
]


class _Record(BaseModel):
    # Scripts are written in camelCase (YAML, JSON); Python code may use either name.
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )


class TextReply(_Record):
    """An assistant message, streamed word by word."""

    text: str


class ExecCommand(_Record):
    """Arguments of codex's `exec_command` tool."""

    cmd: str
    workdir: str | None = None


class ExecCommandReply(_Record):
    """A `function_call` asking codex to run a shell command."""

    exec_command: ExecCommand


class FunctionCall(_Record):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    namespace: str | None = None


class FunctionCallReply(_Record):
    """A `function_call` to any tool codex offers, by name (and namespace)."""

    function_call: FunctionCall


class HttpError(_Record):
    """A non-streamed HTTP error; a `str` body is sent as text, anything else as JSON."""

    status: int = Field(default=500, ge=400, le=599)
    body: Any = None


class HttpErrorReply(_Record):
    """Answer the POST with an HTTP error status."""

    http_error: HttpError


class DisconnectReply(_Record):
    """Start streaming, then drop the connection before `response.completed`."""

    disconnect: Literal[True]
    partial_text: str = ""


class StallReply(_Record):
    """Start streaming, then send nothing more until the server stops."""

    stall: Literal[True]


_REPLY_KEYS = {
    "text": "text",
    "execCommand": "exec",
    "exec_command": "exec",
    "functionCall": "function",
    "function_call": "function",
    "httpError": "http",
    "http_error": "http",
    "disconnect": "disconnect",
    "stall": "stall",
}
_REPLY_TYPES: dict[type[BaseModel], str] = {
    TextReply: "text",
    ExecCommandReply: "exec",
    FunctionCallReply: "function",
    HttpErrorReply: "http",
    DisconnectReply: "disconnect",
    StallReply: "stall",
}


def _reply_kind(value: Any) -> str | None:
    if isinstance(value, Mapping):
        for key in value:
            if key in _REPLY_KEYS:
                return _REPLY_KEYS[key]
        return None
    return _REPLY_TYPES.get(type(value))


ModelReply = Annotated[
    Annotated[TextReply, Tag("text")]
    | Annotated[ExecCommandReply, Tag("exec")]
    | Annotated[FunctionCallReply, Tag("function")]
    | Annotated[HttpErrorReply, Tag("http")]
    | Annotated[DisconnectReply, Tag("disconnect")]
    | Annotated[StallReply, Tag("stall")],
    Discriminator(
        _reply_kind,
        custom_error_type="unknown_reply",
        custom_error_message=(
            "a reply needs one of: text, execCommand, functionCall, httpError, disconnect, stall"
        ),
    ),
]
"""One scripted answer to one `POST /v1/responses`."""

_REPLIES: TypeAdapter[list[ModelReply]] = TypeAdapter(list[ModelReply])


class ModelScript(_Record):
    """The replies, consumed one per POST, and the text used once they run out."""

    replies: list[ModelReply] = Field(default_factory=list)
    default_text: str = "Done."

    @classmethod
    def from_yaml(cls, text: str, source: str = "the model script") -> ModelScript:
        """Parse a script: a mapping (`replies`, `defaultText`) or a bare list of replies."""
        data = parse_yaml(text, source)
        if data is None:
            return cls()
        if isinstance(data, list):
            return cls(replies=_REPLIES.validate_python(data))
        return cls.model_validate(data)

    @classmethod
    def load(cls, path: str | Path) -> ModelScript:
        """Read a YAML (or JSON) script file. Blocking: call at start-up. A file that
        cannot be read or is not a script is a ScriptError naming it, line and column."""
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ScriptError(f"{source}: cannot read the model script ({exc})") from None
        try:
            return cls.from_yaml(text, source)
        except ValidationError as exc:
            title = "invalid model script"
            raise ScriptError(describe_errors(exc, source, text, (), title=title)) from None


@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request as the server received it."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: Any
    """The parsed JSON body, or the raw text when it is not JSON, or None when empty."""

    @property
    def input(self) -> list[dict[str, Any]]:
        """The conversation codex sent (`body["input"]`)."""
        if isinstance(self.body, dict):
            items = self.body.get("input")
            if isinstance(items, list):
                return items
        return []

    def function_call_outputs(self) -> list[dict[str, Any]]:
        """The `function_call_output` items of the input: the results of tool calls."""
        return [item for item in self.input if item.get("type") == "function_call_output"]


ScriptLike = ModelScript | Sequence[ModelReply | Mapping[str, Any]]


class ScriptedModel:
    """The script being played and the requests received so far."""

    def __init__(self, script: ScriptLike = ()) -> None:
        if not isinstance(script, ModelScript):
            script = ModelScript(replies=_REPLIES.validate_python(list(script)))
        self.default_text = script.default_text
        self._pending: list[ModelReply] = list(script.replies)
        self.requests: list[RecordedRequest] = []
        self._changed = asyncio.Condition()

    @property
    def pending(self) -> Sequence[ModelReply]:
        """The replies not consumed yet."""
        return tuple(self._pending)

    def add(self, *replies: ModelReply | Mapping[str, Any]) -> None:
        """Append replies to the script."""
        self._pending.extend(_REPLIES.validate_python(list(replies)))

    def next_reply(self) -> ModelReply:
        """Consume the next reply, or the default text once the script is exhausted."""
        if self._pending:
            return self._pending.pop(0)
        return TextReply(text=self.default_text)

    async def record(self, request: RecordedRequest) -> None:
        """Keep a request and wake whoever waits for it."""
        async with self._changed:
            self.requests.append(request)
            self._changed.notify_all()

    async def wait_for_requests(self, count: int) -> list[RecordedRequest]:
        """Wait until at least `count` requests were received; return them all."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.requests) >= count)
            return list(self.requests)


class _ResponseStream:
    """One SSE response in the Responses API's shape, as codex parses it."""

    def __init__(self, response: web.StreamResponse, model: str, ids: Iterator[int]) -> None:
        self._response = response
        self._model = model
        self._ids = ids
        self.id = self.new_id("resp")
        self._output: list[dict[str, Any]] = []

    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids)}"

    async def send(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        await self._response.write(
            b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
        )

    def _envelope(self, status: str, **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "status": status,
            "model": self._model,
            "output": self._output,
            **extra,
        }

    async def created(self) -> None:
        await self.send({"type": "response.created", "response": self._envelope("in_progress")})

    async def message(self, text: str, *, complete: bool = True) -> None:
        item_id = self.new_id("msg")
        index = len(self._output)
        started = {"type": "message", "role": "assistant", "id": item_id, "content": []}
        await self.send(
            {"type": "response.output_item.added", "output_index": index, "item": started}
        )
        for delta in _words(text):
            await self.send(
                {
                    "type": "response.output_text.delta",
                    "item_id": item_id,
                    "output_index": index,
                    "content_index": 0,
                    "delta": delta,
                }
            )
        if complete:
            done = {**started, "content": [{"type": "output_text", "text": text}]}
            await self.item_done(done)

    async def item_done(self, item: dict[str, Any]) -> None:
        index = len(self._output)
        self._output.append(item)
        await self.send({"type": "response.output_item.done", "output_index": index, "item": item})

    async def completed(self, output_tokens: int) -> None:
        input_tokens = 10
        usage = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        }
        await self.send(
            {"type": "response.completed", "response": self._envelope("completed", usage=usage)}
        )


def _words(text: str) -> list[str]:
    return re.findall(r"\s*\S+\s*", text) or ([text] if text else [])


class ModelProviderServer:
    """An aiohttp server on 127.0.0.1 that answers codex from a `ScriptedModel`."""

    def __init__(
        self, script: ScriptedModel | ScriptLike = (), *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.model = script if isinstance(script, ScriptedModel) else ScriptedModel(script)
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        self._ids = itertools.count(1)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, in order."""
        return self.model.requests

    @property
    def port(self) -> int:
        if self._runner is None:
            raise RuntimeError("the server is not started")
        for address in self._runner.addresses:
            return int(address[1])
        raise RuntimeError("the server has no address")

    @property
    def base_url(self) -> str:
        """What codex's `model_providers.<id>.base_url` should be."""
        return f"http://{self._host}:{self.port}/v1"

    def codex_config_overrides(
        self, *, provider_id: str = "fake", model: str = "gpt-fake", max_retries: int | None = 0
    ) -> list[str]:
        """The `-c key=value` overrides that point codex at this server.

        `max_retries` bounds codex's retries of failed requests and dropped streams, so
        by default each scripted failure fails the turn at once; None keeps codex's own
        retry policy (each retry then consumes the next scripted reply).
        """
        return codex_config_overrides(
            self.base_url, provider_id=provider_id, model=model, max_retries=max_retries
        )

    def codex_cli_args(self, **overrides: Any) -> list[str]:
        """`codex_config_overrides` as command-line arguments: `["-c", "k=v", ...]`."""
        return [arg for item in self.codex_config_overrides(**overrides) for arg in ("-c", item)]

    def codex_command(self, codex: str, *, codex_home: Path, cwd: Path) -> list[str]:
        """The command that runs the real `codex app-server` offline against this model,
        with its own `CODEX_HOME` and working directory."""
        return [
            "env",
            "-C",
            str(cwd),
            f"CODEX_HOME={codex_home}",
            "OPENAI_API_KEY=x",
            codex,
            "app-server",
            *self.codex_cli_args(),
        ]

    async def wait_for_requests(self, count: int) -> list[RecordedRequest]:
        """Wait until at least `count` requests were received; return them all."""
        return await self.model.wait_for_requests(count)

    async def start(self) -> None:
        """Listen; `port` 0 (the default) picks a free one."""
        self._closing.clear()
        app = web.Application()
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._port).start()

    async def close(self) -> None:
        """End stalled streams and stop listening."""
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def _record(self, request: web.Request) -> Any:
        raw = await request.read()
        body: Any = None
        if raw:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = raw.decode("utf-8", errors="replace")
        headers = {k.lower(): v for k, v in request.headers.items() if k.lower() != "authorization"}
        await self.model.record(RecordedRequest(request.method, request.path, headers, body))
        return body

    async def _unknown(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        return web.json_response(
            {"error": {"message": f"no route for {request.method} {request.path}"}}, status=404
        )

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        reply = self.model.next_reply()
        if isinstance(reply, HttpErrorReply):
            return _error_response(reply.http_error)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        model = body.get("model", "") if isinstance(body, dict) else ""
        stream = _ResponseStream(response, str(model), self._ids)
        await stream.created()
        if isinstance(reply, TextReply):
            await stream.message(reply.text)
            await stream.completed(output_tokens=len(_words(reply.text)) or 1)
        elif isinstance(reply, ExecCommandReply):
            arguments = reply.exec_command.model_dump(exclude_none=True)
            await stream.item_done(
                {
                    "type": "function_call",
                    "id": stream.new_id("fc"),
                    "call_id": stream.new_id("call"),
                    "name": "exec_command",
                    "arguments": json.dumps(arguments),
                }
            )
            await stream.completed(output_tokens=1)
        elif isinstance(reply, FunctionCallReply):
            call = reply.function_call
            item = {
                "type": "function_call",
                "id": stream.new_id("fc"),
                "call_id": stream.new_id("call"),
                "name": call.name,
                "arguments": json.dumps(call.arguments),
            }
            if call.namespace is not None:
                item["namespace"] = call.namespace
            await stream.item_done(item)
            await stream.completed(output_tokens=1)
        elif isinstance(reply, DisconnectReply):
            if reply.partial_text:
                await stream.message(reply.partial_text, complete=False)
            _drop_connection(request)
        else:
            await self._stall(request)
        return response

    async def _stall(self, request: web.Request) -> None:
        # Codex drops the connection when a turn is interrupted; the handler has no
        # cheap way to notice, so it holds until the server stops.
        await self._closing.wait()
        _drop_connection(request)


def _drop_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


def _error_response(error: HttpError) -> web.Response:
    if isinstance(error.body, str):
        return web.Response(status=error.status, text=error.body)
    body = error.body
    if body is None:
        body = {"error": {"message": "scripted failure", "type": "server_error", "code": None}}
    return web.json_response(body, status=error.status)


def codex_config_overrides(
    base_url: str,
    *,
    provider_id: str = "fake",
    model: str = "gpt-fake",
    max_retries: int | None = 0,
) -> list[str]:
    """The `-c key=value` overrides that point codex at a model endpoint at `base_url`
    (see `ModelProviderServer.codex_config_overrides`)."""
    provider = f"model_providers.{provider_id}"
    retries = (
        []
        if max_retries is None
        else [
            f"{provider}.request_max_retries={max_retries}",
            f"{provider}.stream_max_retries={max_retries}",
        ]
    )
    return [
        f"model_provider={_toml(provider_id)}",
        f"{provider}.name={_toml(provider_id)}",
        f"{provider}.base_url={_toml(base_url)}",
        f'{provider}.wire_api="responses"',
        f'{provider}.env_key="OPENAI_API_KEY"',
        *retries,
        f"model={_toml(model)}",
    ]


def _toml(value: str) -> str:
    # A JSON string literal is a valid TOML basic string for what we quote here.
    return json.dumps(value)


async def _serve(script: ModelScript, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with ModelProviderServer(script, host=host, port=port) as server:
        print(f"model provider at {server.base_url}", flush=True)
        print(shlex.join(server.codex_cli_args()), flush=True)
        await stop.wait()


async def _serve_bridge(
    script: ModelScript, host: str, port: int, codex: str, bridge_args: Sequence[str]
) -> int:
    """The model, and `rest-bridge serve` (a child process, given `bridge_args`) on the real
    `codex` behind it, in a CODEX_HOME of its own: a temporary folder, removed once the
    bridge has exited. A SIGINT or SIGTERM stops the bridge (its own way: it drains)."""
    async with ModelProviderServer(script, host=host, port=port) as server:
        with tempfile.TemporaryDirectory(prefix="codex-home-") as home:
            command = server.codex_command(codex, codex_home=Path(home), cwd=Path.cwd())
            print(
                f"model provider at {server.base_url}; codex runs in CODEX_HOME={home} "
                "(removed at exit), with no credentials and no network",
                flush=True,
            )
            serve = Path(sys.executable).with_name("rest-bridge")
            start = [str(serve)] if serve.exists() else [sys.executable, "-m", "bridge.cli"]
            bridge = await asyncio.create_subprocess_exec(
                *start, "serve", "--app-server", shlex.join(command), *bridge_args
            )
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                # The terminal's Ctrl-C reaches the bridge too; a second signal it ignores.
                loop.add_signal_handler(sig, _stop, bridge)
            try:
                return await bridge.wait()
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)


def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fakes.model_provider --port N --script FILE`: serve until interrupted.

    With `--print-codex-args`, print the `-c` arguments that point codex at `--host` and
    `--port` (one line, quoted for a shell) and exit, serving nothing. With `--bridge
    CODEX`, serve the bridge too, on that real codex behind the model, offline (the
    arguments after `--` go to `rest-bridge serve`); its exit status is the bridge's.
    """
    parser = argparse.ArgumentParser(
        prog="python -m fakes.model_provider", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--script", type=Path, help="YAML script of replies")
    parser.add_argument(
        "--print-codex-args",
        action="store_true",
        help="print the codex -c arguments for --host and --port, then exit",
    )
    parser.add_argument(
        "--bridge",
        metavar="CODEX",
        help="also serve the bridge on this real codex behind the model, in a temporary "
        "CODEX_HOME of its own; arguments after -- go to rest-bridge serve",
    )
    parser.add_argument("bridge_args", nargs="*", metavar="-- SERVE_ARGS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bridge_args and not args.bridge:
        parser.error(f"unrecognized arguments: {' '.join(args.bridge_args)}")
    if args.print_codex_args:
        if not args.port:
            parser.error("--print-codex-args needs the --port the server listens on")
        overrides = codex_config_overrides(f"http://{args.host}:{args.port}/v1")
        print(shlex.join([arg for item in overrides for arg in ("-c", item)]))
        return 0
    try:
        script = ModelScript.load(args.script) if args.script else ModelScript()
    except ScriptError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    if args.bridge:
        return asyncio.run(
            _serve_bridge(script, args.host, args.port, args.bridge, args.bridge_args)
        )
    asyncio.run(_serve(script, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
