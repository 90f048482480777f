"""How results are shown: a readable failure report (pytest shows it, JUnit XML included)."""

from __future__ import annotations

import textwrap

from fakes.app_server.script_source import _format_path
from scenarios.expectations import Problem, cut
from scenarios.runner import Failure, ScenarioResult, Transcript

__all__ = ["format_failure", "format_result", "format_transcript"]

#: How much of a transcript a failure report shows.
BRIDGE_LINES = 120
FAKE_LINES = 60
LINE_WIDTH = 400


def format_result(result: ScenarioResult, *, transcript: bool = True) -> str:
    """One line for a pass or skip; for a failure, the problems, diffs and transcript."""
    head = f"{result.outcome.upper():7} {result.loaded.name}  ({result.loaded.source})"
    head += f"  {result.duration:.2f}s"
    if result.outcome == "skipped":
        return f"{head}\n  skipped: {result.skip_reason}"
    if result.outcome == "passed":
        return head
    if result.failures:  # the file and line of what failed first, as pytest shows places
        first = result.failures[0]
        head = f"{result.loaded.where(first.loc)}: {first.title}\n{head}"
    parts = [head, format_failure(result)]
    if transcript:
        parts.append(_indent(format_transcript(result.transcript), 2))
    if result.tmp is not None:
        parts.append(f"  run directory (kept): {result.tmp}")
    return "\n".join(parts)


def format_failure(result: ScenarioResult) -> str:
    """Each failure: the step and its line, then each problem with expected vs received."""
    lines: list[str] = []
    for failure in result.failures:
        lines.append(f"  {failure.title}  ({result.loaded.where(failure.loc)})")
        for problem in failure.problems:
            lines.append(_indent(_format_problem(result, failure, problem), 4))
    return "\n".join(lines)


def _format_problem(result: ScenarioResult, failure: Failure, problem: Problem) -> str:
    loc = (*failure.loc, *problem.loc)
    label = _format_path(problem.loc) if problem.loc else ""
    where = result.loaded.where(loc)
    first = f"✗ {label}  ({where})" if label else "✗"
    body = [f"{first}", _indent(problem.message, 2)]
    if problem.detail:
        body.append(_indent(problem.detail, 2))
    if problem.diff:
        body.append(_indent(problem.diff, 2))
    return "\n".join(body)


def format_transcript(transcript: Transcript) -> str:
    """The client's and the bridge's side, then what each fake-codex process saw."""
    lines = ["transcript (client and bridge):"]
    entries = transcript.entries
    if len(entries) > BRIDGE_LINES:
        lines.append(f"  ... {len(entries) - BRIDGE_LINES} earlier entries ...")
        entries = entries[-BRIDGE_LINES:]
    for at, source, text in entries:
        lines.append(f"  [+{at:7.3f}s] {source:4} {cut(text, LINE_WIDTH)}")
    for report in transcript.fakes:
        wire = report.get("wire", [])
        exit_info = report.get("exit")
        if exit_info is None:
            ended = "stopped by a signal or still running at the end"
        elif exit_info.get("signal"):
            ended = f"died by {exit_info['signal']}"
        else:
            ended = f"exit code {exit_info.get('code')}"
        dropped = report.get("wireDropped", 0)
        lines.append(f"fake-codex pid {report.get('pid')} ({ended}), protocol lines:")
        if dropped:
            lines.append(f"  ... {dropped} earlier lines not kept ...")
        if len(wire) > FAKE_LINES:
            lines.append(f"  ... {len(wire) - FAKE_LINES} earlier lines ...")
            wire = wire[-FAKE_LINES:]
        for entry in wire:
            arrow = "→ fake" if entry.get("dir") == "in" else "← fake"
            for text in str(entry.get("text")).splitlines() or [""]:
                lines.append(f"  {arrow} {cut(text, LINE_WIDTH)}")
    return "\n".join(lines)


def _indent(text: str, spaces: int) -> str:
    return textwrap.indent(text, " " * spaces)
