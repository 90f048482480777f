"""rest-bridge: OpenAI Codex's app-server behind JSON-over-HTTP."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bridge import TOKEN_VARIABLE, __version__, codex_window, credentials, logs, replica
from bridge.app import PRESETS, mounted_routes, router_method_rules
from bridge.auth import AuthSettings, token_problem, with_bearer_auth
from bridge.codex_binary import native_command
from bridge.limits import (
    APP_SERVER_MODES,
    APP_SERVER_TOKEN_VARIABLE,
    APP_SERVER_VARIABLES,
    DRAIN_TIMEOUT_VARIABLE,
    PEERS_VARIABLE,
    REPLICA_ID_VARIABLE,
    AppServerSettings,
    ReplicaSettingsError,
    RestLimits,
    RestLimitsEnvError,
)
from bridge.openapi import build_openapi
from bridge.policy import POLICY_VARIABLES, MethodPolicy
from bridge.process import startup
from bridge.process.startup import DEFAULT_COMMAND, parse_command
from bridge.routes import BACKEND
from bridge.runtime import (
    DEFAULT_LOOP,
    LOOPS,
    ServeProcess,
    StartupError,
    address,
    event_loop_factory,
    return_big_buffers_to_the_os,
)
from bridge.settings import BridgeSettings
from bridge_ops import codex_diff

LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(RestLimits))


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not from {low} to {high}")
        return value

    return parse


def add_log_options(parser: argparse.ArgumentParser, whose: str = "") -> None:
    parser.add_argument(
        "--log-format",
        choices=logs.LOG_FORMATS,
        default=None,
        help=f"{whose}log lines (stderr) and banner (stdout) as text or one JSON object a "
        "line (default: $REST_ADAPTER_LOG_FORMAT, else text)",
    )
    parser.add_argument(
        "--log-level",
        choices=logs.LOG_LEVELS,
        default=None,
        help=f"{whose}least level logged; access lines are info (default: "
        "$REST_ADAPTER_LOG_LEVEL, else info)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rest-bridge", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rest-bridge {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve the HTTP API",
        description="Serve the HTTP API (docs/API.md) in front of app-server processes.",
        epilog=(
            f"Environment: {TOKEN_VARIABLE} turns bearer auth on (never a command-line "
            f"option), or {TOKEN_VARIABLE}_FILE, a file holding the token (the same goes "
            f"for {APP_SERVER_TOKEN_VARIABLE}_FILE); both are read once at start and then "
            "removed from serve's environment. REST_ADAPTER_<LIMIT> sets a limit, e.g. "
            "REST_ADAPTER_MAX_SESSIONS=16 "
            f"({', '.join(RestLimits.env_variable(f) for f in LIMIT_FIELDS)}). "
            "A limit that is not a positive integer stops serve with exit status 2; an "
            "unknown REST_ADAPTER_* variable is reported at start. "
            f"Replicas: {REPLICA_ID_VARIABLE}, {PEERS_VARIABLE}, {DRAIN_TIMEOUT_VARIABLE} "
            "(docs/SCALING.md). Shared mode: "
            f"{', '.join(sorted(APP_SERVER_VARIABLES))} (docs/API.md). Method policy: "
            f"{', '.join(sorted(POLICY_VARIABLES))}, comma-separated method names or "
            "prefixes ending in '/' (docs/API.md)."
        ),
    )
    serve.add_argument("--preset", choices=sorted(PRESETS), default="trusted")
    serve.add_argument(
        "--app-server",
        default=" ".join(DEFAULT_COMMAND),
        help="command that starts an app-server on stdio (default: %(default)s)",
    )
    serve.add_argument(
        "--app-server-mode",
        choices=APP_SERVER_MODES,
        default=None,
        help="process: an app-server per session (default); shared: one app-server, each "
        "session a connection to it (default: $REST_ADAPTER_APP_SERVER_MODE)",
    )
    serve.add_argument(
        "--app-server-url",
        default=None,
        metavar="URL",
        help="shared mode: connect to a running app-server (unix://PATH or ws://HOST:PORT, "
        "its token in $REST_ADAPTER_APP_SERVER_TOKEN) instead of starting one",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=8787, help="0 picks a free port")
    serve.add_argument(
        "--ops-port",
        type=port_number,
        default=None,
        help="serve /metrics, /livez and /readyz on this port of their own (0: a free one; "
        "default: $REST_ADAPTER_OPS_PORT, else off)",
    )
    serve.add_argument(
        "--ops-host",
        default=None,
        help="the operations listener's address (default: $REST_ADAPTER_OPS_HOST, else 127.0.0.1)",
    )
    serve.add_argument(
        "--loop",
        choices=LOOPS,
        default=DEFAULT_LOOP,
        help="event loop: uvloop spends less CPU per call, asyncio is the standard "
        f"library's; auto: uvloop when installed, else asyncio (default: {DEFAULT_LOOP})",
    )
    add_log_options(serve)
    front_config = commands.add_parser(
        "front-config",
        help="print nginx's configuration for a front over several replicas",
        description="nginx.conf routing each session to the replica named in its id and "
        "balancing the rest; read timeouts come from the REST_ADAPTER_* limits.",
    )
    front_config.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="ID=HOST:PORT",
        help="a replica (repeat for each); ID is its REST_ADAPTER_REPLICA_ID",
    )
    front_config.add_argument("--listen", default="127.0.0.1:8787", help="nginx's listen address")
    front_config.add_argument("--workers", default="1", help="nginx worker processes (or auto)")
    front_config.add_argument(
        "--runtime-dir", default="", help="pid and temporary files (default: nginx's prefix)"
    )
    front_config.add_argument(
        "--error-log", default="", help="stderr or a path (default: error.log)"
    )
    front_config.add_argument(
        "--token-map",
        default="",
        metavar="FILE",
        help="the front checks the bearer token itself, from this file (nginx includes it; "
        "write it with --print-token-map): strangers get the 401 before any routing",
    )
    front_config.add_argument(
        "--print-token-map",
        action="store_true",
        help=f"print the token map for ${TOKEN_VARIABLE} (or the file "
        f"${TOKEN_VARIABLE}{credentials.FILE_SUFFIX} names; the map holds the token: keep it "
        "0600) instead of the configuration",
    )
    front_config.add_argument(
        "--write-config-map",
        metavar="FILE",
        help="instead of printing it, replace the `nginx.conf: |` block of this manifest",
    )
    cluster_parser = commands.add_parser(
        "cluster", help="run N replicas behind nginx on this machine (Ctrl-C stops them all)"
    )
    cluster_parser.add_argument(
        "--replicas", type=int, default=0, help="how many (default: one per core)"
    )
    cluster_parser.add_argument("--preset", choices=sorted(PRESETS), default="trusted")
    cluster_parser.add_argument("--app-server", default=" ".join(DEFAULT_COMMAND))
    cluster_parser.add_argument("--host", default="127.0.0.1")
    cluster_parser.add_argument("--port", type=int, default=8787, help="the front's port (0: any)")
    cluster_parser.add_argument("--nginx", help="the nginx binary (default: from PATH)")
    cluster_parser.add_argument("--dir", help="nginx's prefix directory (default: a temporary one)")
    cluster_parser.add_argument("--workers", default="1", help="nginx worker processes (or auto)")
    cluster_parser.add_argument("--id-prefix", default="replica", help="replica ids are PREFIX-N")
    cluster_parser.add_argument(
        "--ops-port",
        type=port_number,
        default=None,
        help="each replica's operations listener: replica N on this port + N (0: free ports; "
        "default: off)",
    )
    cluster_parser.add_argument(
        "--loop", choices=LOOPS, default=DEFAULT_LOOP, help="the replicas' event loop"
    )
    cluster_parser.add_argument(
        "--probe-interval-ms",
        type=bounded_int(100, 60000),
        default=1000,
        help="ask each replica's /health (its /livez with --ops-port) this often (100 to 60000; "
        "default 1000)",
    )
    cluster_parser.add_argument(
        "--probe-timeout-ms",
        type=bounded_int(100, 60000),
        default=2000,
        help="a probe not answered by then is missed (100 to 60000; default 2000)",
    )
    cluster_parser.add_argument(
        "--probe-misses",
        type=bounded_int(1, 100),
        default=2,
        help="probes missed in a row that mark a replica down at the front (default 2)",
    )
    add_log_options(cluster_parser, "the replicas' ")
    openapi = commands.add_parser("openapi", help="print a preset's OpenAPI 3.1.0 document")
    openapi.add_argument("--preset", choices=sorted(PRESETS), default="trusted")
    openapi.add_argument(
        "--auth", action="store_true", help="document the bearer scheme, as when a token is set"
    )
    codex_diff.add_arguments(
        commands.add_parser(
            "codex-diff",
            help="what changed in the app-server protocol between two codex releases",
            description=codex_diff.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    # Listed for --help only: `main` hands everything after `scenarios` to scenarios.cli.
    commands.add_parser(
        "scenarios",
        help="run YAML scenarios against the bridge (run, check, record, ...: see its --help)",
        add_help=False,
    )
    return parser


#: What the scenario runner needs beyond the bridge (the `harness` extra), by module.
HARNESS_MODULES = ("pytest", "pytest_asyncio", "jsonschema", "jsonpath_ng")
SCENARIOS_SCRIPT = "rest-bridge-scenarios"


def run_scenarios(argv: Sequence[str]) -> int:
    """`rest-bridge scenarios ...`: the scenario runner's own program, in this process's
    place (as git runs its external subcommands); the bridge never imports it.

    It needs the `harness` extra (pytest, jsonschema, jsonpath-ng), which serving does not.
    """
    missing = [name for name in HARNESS_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"rest-bridge scenarios: {', '.join(missing)} not installed; install "
            "codex-rest-bridge with its `harness` extra, e.g. from a clone: "
            'pip install "/path/to/codex-rest-bridge[harness]"',
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    script = Path(sys.executable).with_name(SCENARIOS_SCRIPT)
    if script.is_file() and os.access(script, os.X_OK):
        os.execv(script, [str(script), *argv])
    # No console script beside this interpreter (a source tree, a `pip install --user`):
    # the package this process finds, run with -P, which, unlike -m, puts no working
    # directory (and so no `scenarios` package of whoever's directory) first on sys.path.
    spec = importlib.util.find_spec("scenarios")
    locations = list(spec.submodule_search_locations or []) if spec else []
    root = str(Path(locations[0]).parent) if locations else ""
    os.execv(sys.executable, [sys.executable, "-P", "-c", _RUN_SCENARIOS, root, *argv])


#: The harness's entry point, run with its package's directory (argv[1]) first on sys.path.
_RUN_SCENARIOS = (
    "import sys; root = sys.argv.pop(1); root and sys.path.insert(0, root); "
    "from scenarios.cli import main; sys.exit(main())"
)


def print_openapi(preset: str, auth: bool) -> None:
    app = PRESETS[preset](DEFAULT_COMMAND, None, AppServerSettings())
    settings = AuthSettings(exempt_health=True) if auth else None
    document = build_openapi(
        mounted_routes(app), auth=settings, method_rules=router_method_rules(app)
    )
    sys.stdout.write(json.dumps(document, indent=2) + "\n")
    sys.stdout.flush()


def unstartable(command: Sequence[str]) -> str | None:
    """Why ``command`` cannot be started from here (its program missing, a directory,
    not executable), or None when its program resolves as ``PATH`` stands now."""
    program = command[0]
    if shutil.which(program):
        return None
    if "/" not in program:
        return f"{program}: not found on PATH"
    if not os.path.exists(program):
        return f"{program}: no such file"
    if os.path.isdir(program):
        return f"{program}: is a directory"
    return f"{program}: not executable"


async def describe_command(command: Sequence[str]) -> tuple[str, str | None]:
    """One line for ``rest-bridge serve``'s start: the command, where its program is, and
    the version it reports, or why it cannot start (the bridge serves anyway: a request's
    ``options.cwd`` or ``options.env`` may still make it startable); and that version."""
    shown = shlex.join(command)
    problem = unstartable(command)
    if problem is not None:
        line = (
            f"app-server: {shown}: cannot start: {problem}; every request that starts an "
            "app-server will fail (502 app_server_spawn_failed) until --app-server names "
            "a command that exists"
        )
        if os.path.basename(command[0]) == "codex":
            line += (
                " (install codex: npm install -g @openai/codex; or serve the bundled fake: "
                "--app-server 'fake-codex app-server')"
            )
        return line, None
    found = _absolute(shutil.which(command[0]) or command[0])
    version, error, kind = await startup.probe_app_server(startup.version_command(command))
    # Printed as it came unless it holds control characters (a terminal's escapes, a NUL
    # that makes grep take the output for binary): those are written escaped.
    printable = version is None or version.isprintable()
    details = [(version if printable else repr(version)) or f"version unknown: {error}"]
    if kind is not None:
        details.append(f"kind: {kind}")
    if found != command[0]:
        details.insert(0, found)
    if "app-server" not in command:
        details.append("note: no `app-server` in the command, which codex needs to serve")
    return f"app-server: {shown} ({'; '.join(details)})", version


def _absolute(path: str) -> str:
    return os.path.abspath(path)


async def serve(
    preset: str,
    command: list[str],
    host: str,
    port: int,
    app_server: AppServerSettings | None = None,
    token: str | None = None,
    variables: BridgeSettings | None = None,
    ops: tuple[str, int] | None = None,
) -> None:
    """Serve until stopped; ``token`` (None: auth off) turns bearer auth on; ``ops``
    (host, port) turns the operations listener on."""
    variables = variables or BridgeSettings.from_env()
    limits = variables.limits()
    app_server = app_server or variables.app_server()
    # codex's npm launcher given: its native binary runs instead, said in the banner.
    command, native_note = native_command(command)
    # Read once: the policy the banner describes is the one the preset enforces.
    method_policy = variables.method_policy()
    app = PRESETS[preset](command, limits, app_server, method_policy)
    settings = variables.replica()
    drain = replica.configure(app[BACKEND], settings)
    if token is not None:
        with_bearer_auth(app, token)
    listener = None
    if ops is not None:
        # The operations listener (and prometheus-client with it) is loaded when asked
        # for, here at start; a bridge without it does not pay for it.
        from bridge.ops import OpsListener

        listener = OpsListener(app)
    async with ServeProcess(drain.start) as process:
        # The `--version` probe runs here, once this process is the subreaper of what it
        # starts: a daemon the probe leaves comes to the bridge, not init, and dies.
        if app_server.url is not None:
            described = f"app-server: shared, connecting to {app_server.url} (not started here)"
            window = (
                f"tested on {codex_window.window()}; GET /v1/compatibility says whether the "
                "app-server that answers is one of them"
            )
        else:
            described, version = await describe_command(command)
            window = codex_window.status(version)
            if app_server.shared:
                described = described.replace(
                    "app-server: ", "app-server (shared, one process on a private socket): ", 1
                )
        bound = await process.serve(app, host, port, logs.access_log_class(settings.replica_id))
        operations = "" if listener is None or ops is None else await listener.start(*ops)
        auth = (
            "on"
            if token is not None
            else f"off (set {TOKEN_VARIABLE} or {TOKEN_VARIABLE}_FILE to require a token)"
        )
        url = f"http://{address(*bound[:2])}"
        logs.say(f"rest-bridge {__version__} listening on {url}", event="listening", url=url)
        loop = asyncio.get_running_loop()
        loop_name = "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
        logs.say(f"  preset: {preset}; auth: {auth}; loop: {loop_name}")
        changed = ", ".join(f"{name}={value}" for name, value in limits.changed().items())
        logs.say(f"  limits: {changed or 'the defaults'}")
        logs.say(f"  methods: {describe_policy(preset, method_policy)}")
        for variable in BridgeSettings.unknown_variables():
            logs.say(f"  ignoring {variable}: not a variable rest-bridge reads (misspelt?)")
        logs.say(f"  {described}", event="app_server")
        if native_note is not None:
            logs.say(f"  {native_note}")
        logs.say(f"  {window}")
        logs.say(f"  {process.descriptors}")
        if operations:
            logs.say(f"  operations: http://{operations} (/metrics, /livez, /readyz)")
        if settings.replica_id is not None:
            logs.say(
                f"  replica: {settings.replica_id}; peers: {', '.join(settings.peers) or 'none'}"
            )
        try:
            await process.stop.wait()
        finally:
            stopping = {logs.FIELDS: {"event": "stopping"}}
            logging.getLogger("bridge").info("rest-bridge: stopping", extra=stopping)
            drain.cancel()
            if listener is not None:
                await listener.close()


def read_secrets(
    app_server: AppServerSettings, variables: BridgeSettings | None = None
) -> tuple[str | None, AppServerSettings]:
    """The bearer token (from its variable or its ``_FILE``), once ``app_server`` has its
    own; then both leave this process's environment for good.

    Raises ValueError (naming the variable, never the secret) for a secret that cannot be
    used, or that cannot be removed from ``/proc/self/environ``.
    """
    misspelt = misspelt_secret_variables()
    if misspelt:
        raise ValueError(
            f"{misspelt[0]} is not a variable rest-bridge reads, and a misspelt secret would "
            f"leave auth off: the token goes in {TOKEN_VARIABLE} or "
            f"{TOKEN_VARIABLE}{credentials.FILE_SUFFIX} (fix or unset {misspelt[0]})"
        )
    variables = variables or BridgeSettings.from_env()
    token = variables.bearer_token()
    problem = None if token is None else token_problem(token)
    if problem is not None:
        shown = TOKEN_VARIABLE
        if variables.token_file is not None:
            shown = f"the token in {TOKEN_VARIABLE}{credentials.FILE_SUFFIX}"
        raise ValueError(f"{shown} {problem}: no request could match it")
    # Read by AppServerVariables (bridge.settings), from the variable or its _FILE.
    app_server_token = app_server.token
    problem = None if app_server_token is None else token_problem(app_server_token)
    if problem is not None:
        # Sent in a header: one the HTTP client would refuse to write, or that the
        # app-server would read trimmed, could never be accepted.
        raise ValueError(f"{APP_SERVER_TOKEN_VARIABLE} {problem}: no header could carry it")
    in_environment = [v for v in credentials.SECRET_VARIABLES if os.environ.get(v) is not None]
    if not credentials.forget_secrets() and in_environment:
        raise ValueError(
            f"cannot remove {', '.join(in_environment)} from this process's /proc/self/environ, "
            "where every process of the same user could read it: give it in "
            f"{in_environment[0]}{credentials.FILE_SUFFIX} instead"
        )
    if token is not None or app_server_token:
        credentials.make_undumpable()
    return token, app_server


def misspelt_secret_variables() -> list[str]:
    """The ``REST_ADAPTER_*`` variables set that rest-bridge does not read and that look
    like a secret's (a ``TOKEN`` in the name, or close to one of the secrets' names):
    starting without the secret they meant would serve without auth."""
    unknown = BridgeSettings.unknown_variables()
    names = sorted(credentials.HIDDEN_VARIABLES)
    return [
        variable
        for variable in unknown
        if "TOKEN" in variable.upper()
        or difflib.get_close_matches(variable.upper(), names, n=1, cutoff=0.85)
    ]


def describe_policy(preset: str, policy: MethodPolicy) -> str:
    """The banner's line on the method policy."""
    said = [
        f"{name} {', '.join(sorted(rules))}"
        for name, rules in (("allowed:", policy.allow), ("refused:", policy.refuse))
        if rules
    ]
    base = "the host-reaching ones refused" if preset == "default" else "all allowed"
    return "; ".join([base, *said])


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["scenarios"]:
        return run_scenarios(arguments[1:])
    args = build_parser().parse_args(arguments)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.command == "openapi":
        try:
            print_openapi(args.preset, args.auth)
        except BrokenPipeError:  # `rest-bridge openapi | head`: the reader has what it wanted
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
    elif args.command == "front-config":
        from bridge_ops import front

        return front.main(args)
    elif args.command == "codex-diff":
        return codex_diff.main(args)
    elif args.command == "cluster":
        from bridge_ops import cluster

        return cluster.main(args)
    elif args.command == "serve":
        try:
            try:
                command = parse_command(args.app_server)
            except ValueError as exc:
                raise ValueError(f"--app-server {args.app_server!r}: {exc}") from None
            variables = BridgeSettings.from_env()
            app_server = variables.app_server(mode=args.app_server_mode, url=args.app_server_url)
            token, app_server = read_secrets(app_server, variables)
            logs.configure(
                args.log_format or variables.log_format, args.log_level or variables.log_level
            )
        except (RestLimitsEnvError, ReplicaSettingsError, ValueError) as exc:
            print(f"rest-bridge: {exc}", file=sys.stderr)
            return 2
        return_big_buffers_to_the_os()
        loop_factory = event_loop_factory(args.loop)
        if loop_factory is None:
            print("rest-bridge: --loop uvloop needs the uvloop package", file=sys.stderr)
            return 2
        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                ops_port = args.ops_port if args.ops_port is not None else variables.ops_port
                ops = None if ops_port is None else (args.ops_host or variables.ops_host, ops_port)
                runner.run(
                    serve(
                        args.preset,
                        command,
                        args.host,
                        args.port,
                        app_server,
                        token,
                        variables,
                        ops,
                    )
                )
        except StartupError as exc:
            print(f"rest-bridge: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
