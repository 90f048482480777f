"""`rest-bridge scenarios`: run scenario files, check them, print the format's JSON Schema.

    rest-bridge scenarios run PATH... [--junit FILE] [-j N] [--codex PATH] [--keep-tmp]
    rest-bridge scenarios check PATH...
    rest-bridge scenarios schema
    rest-bridge scenarios record IN.scenario.yaml -o OUT.scenario.yaml [--codex PATH]

Folders are searched for `*.scenario.yaml` / `*.scenario.yml`, skipping what pytest
skips (hidden folders, virtual environments, node_modules, build, dist); files are taken
as they are. Every file is validated before anything runs (a malformed one: exit status 2).
Scenarios run in parallel, each in its own thread, event loop, bridge and temporary
directory, except those with `parallel: false`, which run alone afterwards. Exit
status 0 only when none failed; skipped ones (the real codex missing) do not fail
unless `CI=true`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import TextIO

from scenarios.format import LoadedScenario, ScenarioError, load_scenario
from scenarios.harness import CodexNotFound, find_codex
from scenarios.reporting import format_result, write_junit
from scenarios.runner import RunOptions, ScenarioResult, run_scenario_sync

PATTERNS = ("*.scenario.yaml", "*.scenario.yml")
USAGE_ERROR = 2


#: Folders a search does not enter, as pytest does not: virtual environments (a
#: project's `.venv` holds the installed package's own library of scenarios), hidden
#: folders, build output and installed JavaScript.
SKIPPED_FOLDERS = frozenset(
    {"node_modules", "__pycache__", "build", "dist", "venv", "site-packages"}
)


def scenario_files(folder: Path) -> list[Path]:
    """The scenario files under `folder`, sorted, outside the folders a search skips."""
    found: set[Path] = set()
    for directory, subdirectories, files in os.walk(folder):
        subdirectories[:] = [
            name
            for name in subdirectories
            if not name.startswith(".")
            and name not in SKIPPED_FOLDERS
            and not name.endswith(".egg-info")
            and not (Path(directory, name, "pyvenv.cfg")).exists()
        ]
        found.update(
            Path(directory, name)
            for name in files
            if any(fnmatch.fnmatch(name, pattern) for pattern in PATTERNS)
        )
    return sorted(found)


def collect(paths: Iterable[str]) -> tuple[list[Path], list[tuple[str, str]]]:
    """Scenario files under `paths` (sorted, no repeats), and paths that do not exist."""
    files: list[Path] = []
    missing: list[tuple[str, str]] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = scenario_files(path)
            if not found:
                missing.append((raw, f"{raw}: no *.scenario.yaml files in this folder"))
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            missing.append((raw, f"{raw}: no such file or folder"))
    unique: dict[Path, None] = {}
    for file in files:
        unique.setdefault(file, None)
    return list(unique), missing


def load_all(files: Sequence[Path]) -> tuple[list[LoadedScenario], list[tuple[str, str]]]:
    loaded, errors = [], []
    for file in files:
        try:
            loaded.append(load_scenario(file))
        except ScenarioError as exc:
            errors.append((str(file), str(exc)))
    return loaded, errors


class Progress:
    """Results as they come; on a terminal, also a live line of what is running."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.done = 0
        self.running: dict[str, None] = {}
        self.live = out.isatty()
        self.lock = threading.Lock()

    def started(self, name: str) -> None:
        with self.lock:
            self.running[name] = None
            self._status()

    def finished(self, result: ScenarioResult) -> None:
        with self.lock:
            self.done += 1
            self.running.pop(result.loaded.name, None)
            mark = {"passed": "PASSED ", "failed": "FAILED ", "skipped": "SKIPPED"}[result.outcome]
            line = (
                f"[{self.done}/{self.total}] {mark} {result.loaded.name} "
                f"({result.loaded.source}) {result.duration:.2f}s"
            )
            if result.outcome == "skipped":
                line += f" - {result.skip_reason}"
            self._clear()
            print(line, file=self.out, flush=True)
            self._status()

    def _clear(self) -> None:
        if self.live:
            self.out.write("\r\x1b[K")

    def _status(self) -> None:
        if self.live and self.running:
            names = ", ".join(self.running)
            status = f"running {len(self.running)}: {names}"
            self.out.write(f"\r\x1b[K{status[:150]}")
            self.out.flush()


def run_all(
    scenarios: Sequence[LoadedScenario], options: RunOptions, jobs: int, out: TextIO
) -> list[ScenarioResult]:
    """Run `scenarios`, parallel ones `jobs` at a time, then the others one by one."""
    progress = Progress(len(scenarios), out)
    results: dict[int, ScenarioResult] = {}

    def one(index: int) -> ScenarioResult:
        loaded = scenarios[index]
        progress.started(loaded.name)
        result = run_scenario_sync(loaded, options)
        results[index] = result
        progress.finished(result)
        return result

    parallel = [i for i, s in enumerate(scenarios) if s.scenario.parallel]
    serial = [i for i, s in enumerate(scenarios) if not s.scenario.parallel]
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="scenario") as pool:
        for future in as_completed([pool.submit(one, i) for i in parallel]):
            future.result()
    for index in serial:
        one(index)
    progress._clear()
    return [results[i] for i in range(len(scenarios))]


def _run(args: argparse.Namespace, out: TextIO) -> int:
    files, missing = collect(args.paths)
    loaded, errors = load_all(files)
    errors = missing + errors
    if errors:
        for _, message in errors:
            print(message, file=sys.stderr)
        print(
            f"{len(errors)} scenario file(s) could not be used; nothing was run",
            file=sys.stderr,
        )
        if args.junit:
            write_junit(args.junit, [], errors)
        return USAGE_ERROR
    names: dict[str, str] = {}
    for scenario in loaded:
        if scenario.name in names:
            print(
                f"{scenario.source}: the scenario name {scenario.name!r} is also used by "
                f"{names[scenario.name]}; names must be unique",
                file=sys.stderr,
            )
            return USAGE_ERROR
        names[scenario.name] = scenario.source
    if any(scenario.scenario.real_codex for scenario in loaded):
        try:
            find_codex(args.codex, option="--codex")
        except CodexNotFound as exc:
            print(f"rest-bridge scenarios: {exc}; nothing was run", file=sys.stderr)
            return USAGE_ERROR
    _quiet_logging()
    options = RunOptions(
        codex=args.codex,
        tmp_root=Path(args.tmp_dir) if args.tmp_dir else None,
        keep_tmp=args.keep_tmp,
    )
    started = time.monotonic()
    results = run_all(loaded, options, args.jobs, out)
    elapsed = time.monotonic() - started
    failed = [r for r in results if r.outcome == "failed"]
    for result in failed:
        print(file=out)
        print(format_result(result, transcript=not args.no_transcript), file=out)
    if args.junit:
        write_junit(args.junit, results)
    passed = sum(1 for r in results if r.outcome == "passed")
    skipped = sum(1 for r in results if r.outcome == "skipped")
    summary = f"{passed} passed, {len(failed)} failed"
    if skipped:
        summary += f", {skipped} skipped"
    print(f"\nscenarios: {summary} in {elapsed:.2f}s", file=out, flush=True)
    return 1 if failed else 0


def _quiet_logging() -> None:
    """Bridge logs go to each run's transcript, not to the terminal."""
    logging.getLogger().addHandler(logging.NullHandler())
    logging.getLogger("bridge").setLevel(logging.INFO)


def _check(args: argparse.Namespace, out: TextIO) -> int:
    files, missing = collect(args.paths)
    loaded, errors = load_all(files)
    for _, message in missing + errors:
        print(message, file=sys.stderr)
    for scenario in loaded:
        print(
            f"ok {scenario.source} ({scenario.name}, {len(scenario.scenario.steps)} steps)",
            file=out,
        )
    return USAGE_ERROR if missing or errors else 0


def _schema(args: argparse.Namespace, out: TextIO) -> int:
    from scenarios.schema import scenario_schema

    print(json.dumps(scenario_schema(), indent=args.indent), file=out)
    out.flush()
    return 0


def _record(args: argparse.Namespace, out: TextIO) -> int:
    """Record a `model:` scenario on the real codex; write and replay its fake-codex twin."""
    from scenarios.record import RecordError, record_scenario_sync

    _quiet_logging()
    try:
        recording = record_scenario_sync(
            args.source,
            args.output,
            codex=args.codex,
            name=args.name,
            verify=not args.no_verify,
            keep_tmp=args.keep_tmp,
        )
    except RecordError as exc:
        print(f"rest-bridge scenarios record: {exc}", file=sys.stderr)
        return USAGE_ERROR
    for warning in recording.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"recorded {args.source} → {args.output} ({recording.codex_version})", file=out)
    if recording.directory is not None:
        print(f"the recording's directory (wire logs) is kept: {recording.directory}", file=out)
    replay = recording.replay_result
    if replay is None:
        return 0
    if replay.passed:
        print(f"replayed {args.output} on fake-codex: passed", file=out)
        return 0
    print(f"replayed {args.output} on fake-codex: FAILED (the file is written)\n", file=out)
    print(format_result(replay), file=out)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rest-bridge scenarios",
        description="Run YAML scenarios against the bridge, on fake-codex or the real codex.",
    )
    commands = parser.add_subparsers(dest="action", required=True)
    run = commands.add_parser("run", help="run scenario files and folders")
    run.add_argument("paths", nargs="+", metavar="PATH")
    run.add_argument("--junit", metavar="FILE", help="write a JUnit XML report")
    run.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=min(8, 2 * (os.cpu_count() or 1)),
        help="scenarios run at once (default: %(default)s)",
    )
    run.add_argument("--codex", help="the real codex, for scenarios that script the model")
    run.add_argument("--tmp-dir", help="where run directories go (default: the system's)")
    run.add_argument(
        "--keep-tmp", action="store_true", help="keep run directories of passing runs too"
    )
    run.add_argument(
        "--no-transcript", action="store_true", help="leave transcripts out of failure reports"
    )
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
    record.add_argument(
        "--no-verify", action="store_true", help="do not replay the written file on fake-codex"
    )
    record.add_argument(
        "--keep-tmp", action="store_true", help="keep the recording's directory (wire logs)"
    )
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of `rest-bridge scenarios`; returns the exit status."""
    args = build_parser().parse_args(argv)
    stream = out or sys.stdout
    action = {"run": _run, "check": _check, "schema": _schema, "record": _record}[args.action]
    try:
        return action(args, stream)
    except BrokenPipeError:
        # The reader went away (`... | head`): what it wanted it has; no traceback.
        return reader_gone(stream, finished=args.action == "schema")


def reader_gone(stream: TextIO, *, finished: bool) -> int:
    """After a `BrokenPipeError` on `stream`: exit quietly.

    Whatever is still buffered for the closed pipe is dropped (Python would otherwise
    try to flush it at exit and complain). The status is 0 when the command had
    nothing left to do but print (`finished`), else 1: a run cut short did not finish.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # not a real file (a StringIO in tests)
        pass
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
