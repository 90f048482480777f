"""`rest-bridge scenarios`: run (pytest with the plugin, on scenario files only), check,
schema, record, record-cassettes and check-cassettes; scenarios/README.md ("Running")
has each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

USAGE_ERROR = 2
NOTHING_TO_DO = 5  # pytest's number for it
#: The front's own options, and the plugin's options they stand for.
FRONT_OPTIONS = {
    "--codex": "--codex-bin",
    "--target": "--codex-target",
    "--target-script": "--codex-target-script",
    # What the runner before pytest called them.
    "-j": "-n",
    "--jobs": "-n",
    "--junit": "--junitxml",
}
#: The plugin's options that take a value. pytest picks its rootdir and configuration file
#: before it knows a plugin's options, so the value of one given as `--opt VALUE` is taken
#: for a path there (another rootdir, test ids like `../../x::name`): the front joins them.
PLUGIN_VALUES = ("--codex-bin", "--codex-target", "--codex-target-script", "--codex-timeout")
#: Collect scenario files only (a file named on the command line is always collected).
#: Skip reasons are shown too (`-r` given again replaces `-rfEs`). An option of the
#: directory's pytest configuration that no installed plugin knows (`timeout` without
#: pytest-timeout) is a warning, even where that configuration makes warnings errors: the
#: run does not depend on the plugins the directory's own tests need.
SCENARIOS_ONLY = [
    *("-p", "scenarios.pytest_plugin", "-o", "python_files=", "-rfEs"),
    *("-W", "default::pytest.PytestConfigWarning"),
]


def pytest_arguments(argv: Sequence[str]) -> list[str]:
    """`argv` for pytest: the front's options renamed, the plugin's joined to their value
    (`--codex-bin=PATH`), a `-n` without `--dist` given `--dist loadgroup` (so
    `parallel: false` scenarios share one worker)."""
    args: list[str] = []
    rest = iter(argv)
    for arg in rest:
        name, equals, value = arg.partition("=")
        if name not in FRONT_OPTIONS and name not in PLUGIN_VALUES:
            args.append(arg)
            continue
        name = FRONT_OPTIONS.get(name, name)
        if name in PLUGIN_VALUES and not equals:
            given = next(rest, None)  # none: pytest says the option wants one
            args.append(name if given is None else f"{name}={given}")
        else:
            args.append(name + equals + value)
    workers = any(arg == "-n" or arg.startswith(("-n", "--numprocesses")) for arg in args)
    if workers and not any(arg.startswith("--dist") for arg in args):
        args.append("--dist=loadgroup")
    return [*SCENARIOS_ONLY, *args]


#: The signals that stop a run; the first goes on to pytest as SIGINT (its way to stop
#: cleanly), a second one kills it.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: How long the last sweep waits for what it killed to exit.
SWEEP_SECONDS = 10.0


class _Stopper:
    """The runner's handler of STOP_SIGNALS while its pytest runs."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.received: list[int] = []
        self.forwarded = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        self.forward()

    def forward(self) -> None:
        """Pass each signal received and not yet passed on to pytest (once started)."""
        child = self.child
        while child is not None and self.forwarded < len(self.received):
            self.forwarded += 1
            if self.forwarded > 1:
                child.kill()
            elif self.received[0] != signal.SIGINT or not _terminal_delivered_it():
                child.send_signal(signal.SIGINT)


def _terminal_delivered_it() -> bool:
    """Whether a SIGINT came from the terminal (Ctrl-C), which sends it to the whole
    foreground process group, pytest included: this process is in that group."""
    try:
        terminal = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(terminal) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(terminal)


def _pytest(argv: Sequence[str]) -> int:
    """pytest in a fresh interpreter: there, pytest imports the package itself (an import
    made before it would cost a warning that its asserts cannot be rewritten).

    Nothing it starts outlives the run. This process adopts what its tree orphans (a
    child subreaper, on Linux); a SIGINT, SIGTERM or SIGHUP goes on to pytest as SIGINT
    (a second one kills it); once pytest has exited, every process left below this one
    is killed. A run stopped by a signal then ends by that signal (SIGTERM: status 143).
    """
    # The process tree's supervision alone: serving's runtime would bring aiohttp into a
    # process that only waits for pytest.
    from bridge import subreaper

    subreaper.become_subreaper()
    stopper = _Stopper()
    previous = {sig: signal.signal(sig, stopper) for sig in STOP_SIGNALS}
    try:
        stopper.child = subprocess.Popen([sys.executable, "-m", "pytest", *argv])
        stopper.forward()  # a signal that came while it started
        code = stopper.child.wait()
        left = asyncio.run(subreaper.end_all(SWEEP_SECONDS))
        if left:
            done = f"killed {left} process{'es' if left > 1 else ''} the run left behind"
            print(f"rest-bridge scenarios run: {done}", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopper.received:
        first = stopper.received[0]
        signal.signal(first, signal.SIG_DFL)
        os.kill(os.getpid(), first)
    return code


def _run(args: argparse.Namespace) -> int:
    return _pytest(pytest_arguments(args.rest))


def _quiet_logging() -> None:
    """Bridge logs go to each run's transcript, not to the terminal."""
    logging.getLogger().addHandler(logging.NullHandler())
    logging.getLogger("bridge").setLevel(logging.INFO)


def check_arguments(paths: Sequence[str]) -> list[str]:
    """`check PATH...` for pytest: the scenario files collected, none run."""
    return [*SCENARIOS_ONLY, "--collect-only", "-q", "-p", "no:cacheprovider", *paths]


def _check(args: argparse.Namespace) -> int:
    return _pytest(check_arguments(args.paths))


def _schema(args: argparse.Namespace) -> int:
    from scenarios.schema import scenario_schema

    print(json.dumps(scenario_schema(), indent=args.indent), flush=True)
    return 0


def _record(args: argparse.Namespace) -> int:
    """Record a `model:` scenario on the real codex; write and replay its fake-codex twin."""
    from scenarios.record import RecordError, record_scenario
    from scenarios.reporting import format_result

    _quiet_logging()
    options = {"codex": args.codex, "name": args.name, "keep_tmp": args.keep_tmp}
    try:
        recording = asyncio.run(
            record_scenario(args.source, args.output, verify=not args.no_verify, **options)
        )
    except RecordError as exc:
        print(f"rest-bridge scenarios record: {exc}", file=sys.stderr)
        return USAGE_ERROR
    for warning in recording.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"recorded {args.source} → {args.output} ({recording.codex_version})")
    if recording.directory is not None:
        print(f"the recording's directory (wire logs) is kept: {recording.directory}")
    replay = recording.replay_result
    if replay is not None:
        failed = f"FAILED (the file is written)\n\n{format_result(replay)}"
        print(f"replayed {args.output} on fake-codex: {'passed' if replay.passed else failed}")
    return 0 if replay is None or replay.passed else 1


def _cassettes(args: argparse.Namespace) -> int:
    """Record the missing and stale cassettes (every one with --all), or name them."""
    from scenarios.cassette import cassette_for, cassette_path
    from scenarios.format import ScenarioError, load_scenario
    from scenarios.runner import RunOptions

    _quiet_logging()
    record = "none" if args.action == "check-cassettes" else "all" if args.all else "refresh"
    files = [
        found
        for name in map(Path, args.paths)
        for found in (sorted(name.rglob("*.scenario.y*ml")) if name.is_dir() else [name])
        if not any(part.startswith(".") for part in found.parts[len(name.parts) : -1])
    ]
    if not files:  # a check of nothing must not pass for a check
        print(f"no scenario files (*.scenario.yaml) in {' '.join(args.paths)}", file=sys.stderr)
        return NOTHING_TO_DO
    status = 0
    for path in files:
        try:
            cassette = cassette_for(
                load_scenario(path), record=record, options=RunOptions(args.codex)
            )
            print(f"ok  {cassette_path(path)}  ({len(cassette.interactions)} exchanges)")
        except ScenarioError as exc:
            print(f"FAILED  {exc}", file=sys.stderr)
            status = 1
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rest-bridge scenarios",
        description="Run YAML scenarios against the bridge, on fake-codex or the real codex.",
    )
    commands = parser.add_subparsers(dest="action", required=True)
    run = commands.add_parser(
        "run",
        help="run scenario files and folders: pytest with the plugin, pytest's options "
        "work (`run --help` lists them); --codex, --target and --target-script stand for "
        "the plugin's --codex-bin, --codex-target and --codex-target-script",
        add_help=False,
    )
    run.add_argument("rest", nargs="*", metavar="PATH|OPTION")
    check = commands.add_parser("check", help="validate scenario files without running them")
    check.add_argument("paths", nargs="+", metavar="PATH")
    schema = commands.add_parser("schema", help="print the JSON Schema of the scenario format")
    schema.add_argument("--indent", type=int, default=2)
    record = commands.add_parser(
        "record",
        help="run a `model:` scenario on the real codex and write it as a fake-codex scenario",
    )
    record.add_argument("source", metavar="IN", help="a scenario with a `model:` section")
    record.add_argument("-o", "--output", required=True, metavar="OUT", help="the file to write")
    record.add_argument("--codex", help="the real codex (default: as `run` finds it)")
    record.add_argument("--name", help="the written scenario's name (default: IN's + -replay)")
    record.add_argument("--no-verify", action="store_true", help="do not replay OUT on fake-codex")
    record.add_argument("--keep-tmp", action="store_true", help="keep the wire logs' directory")
    for action, what in (
        ("record", "record the cassettes the respx mock replays: the missing and stale ones"),
        ("check", "exit 1 naming each cassette that is missing or older than its scenario"),
    ):
        cassettes = commands.add_parser(
            f"{action}-cassettes", help=f"{what} (cassettes/NAME.yaml beside NAME.scenario.yaml)"
        )
        cassettes.add_argument("paths", nargs="+", metavar="PATH", help="scenario files or folders")
        cassettes.add_argument("--codex", help="the real codex, for scenarios with `model:`")
        if action == "record":
            cassettes.add_argument("--all", action="store_true", help="record the fresh ones too")
    replay = commands.add_parser(
        "replay",
        help="serve cassettes over HTTP (SSE included) for host code in any language; "
        "on SIGTERM or SIGINT print what was never requested and what matched nothing "
        "(`replay --help` has its options)",
        add_help=False,
    )
    replay.add_argument("rest", nargs="*", metavar="CASSETTE|OPTION")
    return parser


#: `replay` is a program of its own (scenarios.replay_server), run from this package's
#: directory (argv[1]), never from a `scenarios` folder of the working directory.
_RUN_REPLAY = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from scenarios.replay_server import main; sys.exit(main())"
)


def _replay(args: argparse.Namespace) -> int:
    """Become the replay server (exec: its signals and exit status are its own)."""
    root = str(Path(__file__).resolve().parents[1])
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-c", _RUN_REPLAY, root, *args.rest])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `rest-bridge scenarios`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["run"], ["replay"]):  # pytest's (the replay's) options are its own
        argv = [argv[0], "--", *argv[1:]]
    args = build_parser().parse_args(argv)
    actions = {"run": _run, "check": _check, "schema": _schema, "record": _record}
    actions["replay"] = _replay
    try:
        return actions.get(args.action, _cassettes)(args)
    except BrokenPipeError:
        # The reader went away (`... | head`): what it wanted it has; no traceback. What
        # is still buffered for the closed pipe is dropped (Python would complain at exit
        # flushing it). 0 when there was nothing left to do but print, else 1.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0 if args.action == "schema" else 1


if __name__ == "__main__":
    sys.exit(main())
