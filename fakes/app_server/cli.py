"""`fake-codex`: a command line shaped like the real `codex` binary's.

    fake-codex --version
    fake-codex [-c key=value]... app-server [--listen URL] [-c key=value]... [--script PATH]
        [--ws-auth capability-token (--ws-token-file PATH | --ws-token-sha256 HEX)]
    fake-codex [-c key=value]... app-server generate-json-schema [--experimental] --out DIR

As with the real CLI, `-c`/`--config`, `--enable` and `--disable` go before the
subcommand, after it, or both. The script comes from `--script PATH`, else
`$FAKE_CODEX_SCRIPT`, else `-c fake_codex.script="PATH"`. `$FAKE_CODEX_SEED` (an
integer) overrides the script's `seed`. Usage errors exit with status 2, like the real
CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from bridge import codex_window
from bridge.console import collector_off
from fakes.app_server.shapes import DEFAULT_VERSION_OUTPUT, cli_version

if TYPE_CHECKING:
    from fakes.app_server.script import AppServerScript

SCRIPT_ENV = "FAKE_CODEX_SCRIPT"
SEED_ENV = "FAKE_CODEX_SEED"
SCRIPT_CONFIG_KEY = "fake_codex.script"
USAGE_ERROR = 2


class UsageError(Exception):
    """A bad command line or environment; the message goes to stderr."""


def _config_options(parser: argparse.ArgumentParser, level: str) -> None:
    """`-c`, `--enable`, `--disable`, accepted at every level as by the real CLI.

    Each level keeps its own list (argparse would let a subcommand's defaults wipe out
    the values given before it); `_overrides` joins them.
    """
    parser.add_argument(
        "-c",
        "--config",
        action="append",
        default=[],
        dest=f"{level}_config",
        metavar="key=value",
        help="config override (TOML value)",
    )
    parser.add_argument(
        "--enable", action="append", default=[], dest=f"{level}_enable", metavar="FEATURE"
    )
    parser.add_argument(
        "--disable", action="append", default=[], dest=f"{level}_disable", metavar="FEATURE"
    )


def _overrides(args: argparse.Namespace) -> list[str]:
    """Every `-c key=value`, outermost level first (so the innermost wins)."""
    overrides: list[str] = []
    for level in ("global", "server", "tool"):
        overrides += getattr(args, f"{level}_config", [])
    return overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fake-codex", description="A scriptable fake codex.")
    parser.add_argument("-V", "--version", action="store_true", help="print the version and exit")
    parser.add_argument(
        "--codex-version",
        type=_codex_version,
        dest="global_codex_version",
        metavar="VERSION",
        help="the codex release to emulate, for --version (app-server takes it too)",
    )
    _config_options(parser, "global")
    commands = parser.add_subparsers(dest="command")
    server = commands.add_parser("app-server", help="serve the app-server protocol on stdio")
    server.add_argument(
        "--listen",
        default="stdio://",
        help="stdio:// (default), unix://, unix://PATH or ws://IP:PORT (see listen.py)",
    )
    server.add_argument("--stdio", action="store_true", help="same as --listen stdio://")
    _config_options(server, "server")
    server.add_argument("--strict-config", action="store_true")
    server.add_argument("--analytics-default-enabled", action="store_true")
    server.add_argument("--script", help="the YAML/JSON script to follow")
    server.add_argument(
        "--codex-version",
        type=_codex_version,
        metavar="VERSION",
        help="the codex release whose protocol to speak and version to report",
    )
    server.add_argument("--ws-auth", choices=("capability-token", "signed-bearer-token"))
    server.add_argument("--ws-token-file", metavar="PATH")
    server.add_argument("--ws-token-sha256", metavar="HEX")
    server.add_argument("--ws-shared-secret-file", metavar="PATH")
    tools = server.add_subparsers(dest="tool")
    schema = tools.add_parser(
        "generate-json-schema", help="write the JSON Schema of the params the fake knows"
    )
    _config_options(schema, "tool")
    schema.add_argument("-o", "--out", required=True, metavar="DIR", help="output directory")
    schema.add_argument("--experimental", action="store_true", help="include experimental fields")
    return parser


def config_script(overrides: list[str]) -> str | None:
    """The path given as `-c fake_codex.script=...`, TOML-quoted or not (last one wins)."""
    path = None
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.strip() == SCRIPT_CONFIG_KEY:
            path = _toml_string(value.strip())
    return path


def _toml_string(value: str) -> str:
    """A TOML string value, or the raw text if it is not one (as the real CLI does)."""
    if value[:1] not in ("'", '"'):
        return value
    import tomllib

    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value
    return parsed if isinstance(parsed, str) else value


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """For imports and loading whose objects live as long as the process (pydantic,
    the script's models and validator, asyncio, the server, the fast start): made with
    Python's cyclic collector off, and frozen (`gc.freeze`) before it is on again.

    Everything made while the collector is off is still in its youngest generation, so
    its first collection afterwards would walk all of it, and the interpreter's
    collections at exit walk it all again: frozen, neither does. A scripted start spent
    about 70 M instructions (some 35 ms of CPU: walking the heap misses the caches) in
    those collections, a start without a script about 18 M (some 5 ms).
    """
    with collector_off():
        yield
        gc.freeze()


def _load(path: str) -> AppServerScript:
    # pydantic looks for plugins in every installed distribution's entry points when it
    # builds its first schema: ~20 ms of each scripted start, for plugins the fake has
    # no use for.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    with loading():
        from fakes.app_server.script import ScriptError, load_script

        try:
            return load_script(path)
        except ScriptError as exc:
            raise UsageError(str(exc)) from None


def _env_seed() -> int | None:
    raw = os.environ.get(SEED_ENV)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{SEED_ENV} must be an integer, got {raw!r}") from None


#: The release to emulate when neither `--codex-version` nor the script names one.
VERSION_ENV = "FAKE_CODEX_VERSION"


def _version_output(script: AppServerScript | None, codex_version: str | None = None) -> str:
    """What `--version` prints and `initialize` quotes; the fake speaks that release's
    protocol (fakes/app_server/protocol.py). `--codex-version` wins over the script, and
    the script over `$FAKE_CODEX_VERSION`."""
    if codex_version is not None:
        return f"codex-cli {codex_version}"
    if script is not None and script.version_output:
        return script.version_output
    if script is not None and script.codex_version:
        return f"codex-cli {script.codex_version}"
    from_env = os.environ.get(VERSION_ENV, "").strip()
    if from_env:
        try:
            return f"codex-cli {_codex_version(from_env)}"
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"{VERSION_ENV}: {exc}") from None
    return DEFAULT_VERSION_OUTPUT


def _codex_version(text: str) -> str:
    """An argparse type: a release fake-codex has the protocol of."""
    from fakes.app_server import protocol

    if text not in protocol.versions():
        known = ", ".join(protocol.versions())
        raise argparse.ArgumentTypeError(f"fake-codex emulates codex {known}, not {text!r}")
    return text


def _generate_json_schema(args: argparse.Namespace) -> int:
    from fakes.app_server.schema import write_schema

    path = args.script or os.environ.get(SCRIPT_ENV)
    script = _load(path) if path else None
    version = cli_version(_version_output(script, _emulated(args)))
    try:
        write_schema(args.out, experimental=args.experimental, version=version)
    except OSError as exc:
        raise UsageError(f"error: cannot write the schema to {args.out}: {exc}") from None
    return 0


def fast_start_allowed() -> bool:
    """The fast start is on unless `FAKE_CODEX_FAST=0`, and off while a report is kept
    (`FAKE_CODEX_REPORT` records the whole session from the first byte)."""
    return os.environ.get("FAKE_CODEX_FAST", "1").strip() != "0" and not os.environ.get(
        "FAKE_CODEX_REPORT"
    )


def _app_server(args: argparse.Namespace) -> int:
    if args.tool == "generate-json-schema":
        return _generate_json_schema(args)
    if args.stdio:
        args.listen = "stdio://"
    endpoint = None
    if args.listen != "stdio://":
        from fakes.app_server.listen import ListenError, parse_listen, token_digest

        try:
            endpoint = parse_listen(args.listen)
            token = token_digest(args.ws_auth, args.ws_token_file, args.ws_token_sha256)
        except ListenError as exc:
            raise UsageError(str(exc)) from None
    path = args.script or os.environ.get(SCRIPT_ENV) or config_script(_overrides(args))
    script = _load(path) if path else None
    seed = _env_seed()
    if seed is None and script is not None:
        seed = script.seed
    version_output = _version_output(script, _emulated(args))
    if endpoint is not None:
        from fakes.app_server.listen import serve_listen

        return serve_listen(endpoint, script, seed=seed, version_output=version_output, token=token)
    resume = None
    if script is None and fast_start_allowed():
        # Script-less: the opening is answered before asyncio is imported (fast.py).
        with loading():
            from fakes.app_server.fast import serve_fast

        ended = serve_fast(seed=seed, version_output=version_output)
        if isinstance(ended, int):
            return ended
        resume = ended
    # Imported here so that `--version` (and a session the fast start saw to its end)
    # does not pay for asyncio.
    with loading():
        from fakes.app_server.server import serve

    return serve(script, seed=seed, version_output=version_output, resume=resume)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fake-codex` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv == ["app-server"]:
            # How bridges start it: nothing to parse, so the building of argparse's
            # parser (which imports shutil) is not paid for.
            return _app_server(_parser_defaults())
        parser = _parser()
        args = parser.parse_args(argv)
        if args.version:  # the script found as app-server finds it (but for --script)
            path = os.environ.get(SCRIPT_ENV) or config_script(_overrides(args))
            said = _version_output(_load(path) if path else None, _emulated(args))
            print(said)
            if os.environ.get(codex_window.IDENTIFY_VARIABLE):
                # Asked by a bridge's start-up probe: say what it is, on a line of its own.
                print(f"{codex_window.FAKE_TOKEN}{cli_version(said)}")
            return 0
        if args.command == "app-server":
            return _app_server(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return USAGE_ERROR
    parser.print_usage(sys.stderr)
    return USAGE_ERROR


def _emulated(args: argparse.Namespace) -> str | None:
    """`--codex-version`, given after `app-server` or before it."""
    given: str | None = getattr(args, "codex_version", None) or args.global_codex_version
    return given


def _parser_defaults() -> argparse.Namespace:
    """What `_parser()` makes of `app-server` alone."""
    return argparse.Namespace(
        version=False,
        command="app-server",
        tool=None,
        listen="stdio://",
        stdio=False,
        strict_config=False,
        analytics_default_enabled=False,
        script=None,
        codex_version=None,
        global_codex_version=None,
        ws_auth=None,
        ws_token_file=None,
        ws_token_sha256=None,
        ws_shared_secret_file=None,
        **{
            f"{level}_{kind}": []
            for level in ("global", "server")
            for kind in ("config", "enable", "disable")
        },
    )


if __name__ == "__main__":
    sys.exit(main())
