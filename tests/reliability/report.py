"""Render docs/RELIABILITY.md from a reliability run's results.

    RELIABILITY_RESULTS=results.json pytest tests/reliability   # writes the rows
    python tests/reliability/report.py results.json docs/RELIABILITY.md

`make reliability` does both, with the full soak (RELIABILITY_SOAK=full), and adds
the bearer-token timing benchmark (bench/auth_timing.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections import Counter, defaultdict
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.common import machine_summary

ROOT = Path(__file__).resolve().parents[2]
THEMES = (
    "Faults from the app-server",
    "Misbehaving clients",
    "Fuzzing from the contract",
    "Soak",
    "Shutdown",
    "Start-up",
    "Security",
)


def mark(value: bool | None) -> str:
    return {True: "yes", False: "**NO**", None: "n/a"}[value]


def result(row: dict[str, Any]) -> str:
    return "pass" if row["passed"] else "**FAIL**"


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def figures_text(figures: dict[str, Any]) -> str:
    parts = []
    for key, value in figures.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value))
        parts.append(f"{key}: {value}")
    return "; ".join(parts)


def machine() -> str:
    cpu, memory = machine_summary()
    versions = []
    for name in ("aiohttp", "schemathesis", "hypothesis"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    return (
        f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB, Linux {platform.release()}, "
        f"Python {platform.python_version()}, " + ", ".join(versions)
    )


def theme_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| case | outcome | survived | nothing lost | no leak | result |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        outcome = row["outcome"] or "-"
        if row["figures"]:
            outcome += f" ({figures_text(row['figures'])})"
        lines.append(
            f"| {cell(row['case'])} | {cell(outcome)} | {mark(row['survived'])} | "
            f"{mark(row['nothing_lost'])} | {mark(row['no_leak'])} | {result(row)} |"
        )
    return lines


def fuzz_table(rows: list[dict[str, Any]]) -> list[str]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        target = row["case"].split(":", 1)[0] if ":" in row["case"] else row["case"]
        groups[target].append(row)
    lines = [
        "| preset, auth | operations | cases sent | statuses seen | result |",
        "|---|---:|---:|---|---|",
    ]
    for target, members in groups.items():
        cases = sum(r["figures"].get("cases", 0) for r in members)
        statuses: Counter[str] = Counter()
        for member in members:
            statuses.update(member["figures"].get("statuses", {}))
        seen = ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))
        passed = all(r["passed"] for r in members)
        operations = len(members) if cases else "-"
        lines.append(
            f"| {cell(target)} | {operations} | {cases or '-'} | {seen or '-'} | "
            f"{'pass' if passed else '**FAIL**'} |"
        )
    return lines


def soak_section(rows: list[dict[str, Any]], full: bool) -> list[str]:
    lines: list[str] = []
    for row in rows:
        figures = row["figures"]
        if "cycles" not in figures:
            continue
        rss = figures["rssKiB"]
        lines += [
            f"Run: {'full (`make reliability`)' if full else 'short (`make test`)'}, "
            f"result: {result(row)}.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| session cycles (create → call → events → delete) | {figures['cycles']:,} |",
            f"| text turns | {figures['textTurns']:,} |",
            f"| concurrent clients | {figures['concurrency']} |",
            f"| events read, every seq in order | {figures['eventsRead']:,} |",
            f"| cycles per second | {figures['cyclesPerSecond']} |",
            f"| text turns per second | {figures['turnsPerSecond']} |",
            f"| bridge RSS: start / after warm-up / after cycles / after turns / end (KiB) | "
            f"{rss['start']:,} / {rss['afterWarmup']:,} / {rss['afterCycles']:,} / "
            f"{rss['afterTurns']:,} / {rss['end']:,} |",
            f"| bridge descriptors: start → end | {figures['descriptors']['start']} → "
            f"{figures['descriptors']['end']} |",
            f"| child processes: start → end | {figures['childProcesses']['start']} → "
            f"{figures['childProcesses']['end']} |",
            "",
        ]
    return lines


def render(data: dict[str, Any], timing: str | None) -> str:
    rows: list[dict[str, Any]] = data["rows"]
    by_theme: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_theme[row["theme"]].append(row)
    passed = sum(1 for r in rows if r["passed"])
    lines = [
        "# Reliability report",
        "",
        "Generated by `make reliability` (tests/reliability/report.py) from a run of",
        "`tests/reliability/` with the full soak; do not edit by hand. `make test` runs the",
        "same tests with a short soak and 5 fuzz examples per operation.",
        "",
        f"- Generated: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Machine: {machine()}",
        f"- Rows: {len(rows)}, passed: {passed}, failed: {len(rows) - passed}",
        "",
        "Each row injected one fault or sent one kind of bad input to a real bridge on real",
        "sockets with real child processes. *Survived*: the bridge went on serving (a witness",
        "session or a fresh one answered). *Nothing lost*: a session's log read from seq 1",
        "was complete and in order up to its `exit` event, or what was dropped was announced",
        "by a `gap`. *No leak*: once everything was deleted, the bridge's child processes",
        "(grandchildren included), zombies, open descriptors and asyncio tasks were back to",
        "the baseline taken before the case.",
        "",
    ]
    for theme in THEMES:
        members = by_theme.pop(theme, [])
        if not members:
            continue
        lines += [f"## {theme}", ""]
        if theme == "Fuzzing from the contract":
            fuzz = [r for r in members if "cases" in r["figures"]]
            others = [r for r in members if "cases" not in r["figures"]]
            total = sum(r["figures"]["cases"] for r in fuzz)
            lines += [
                f"Schemathesis, {total:,} generated requests in all (valid and invalid, "
                "examples and coverage phases), seeded and derandomized; checks: every built-in "
                "one but `not_a_server_error`, plus no 500 and gateway statuses only with "
                "their documented kinds, plus every error body exactly the error payload.",
                "",
                *fuzz_table(fuzz),
                "",
                *theme_table(others),
                "",
            ]
            continue
        if theme == "Soak":
            lines += soak_section(members, bool(data.get("full")))
        lines += [*theme_table(members), ""]
        if theme == "Security" and timing:
            lines += [
                "### Bearer token comparison cost (bench/auth_timing.py)",
                "",
                "The whole check (`presented_token` + `BearerToken.matches`) per presented",
                "value; the secret is 48 characters. The check hashes the presented value and",
                "compares SHA-256 digests with `hmac.compare_digest`, so no position or length",
                "of a difference changes what is compared; what remains is noise and the",
                "hashing of the caller's own bytes (a missing header has none to parse or",
                "hash, whatever the secret). A benchmark, not a pass/fail test.",
                "",
                timing,
                "",
            ]
    for theme, members in by_theme.items():
        lines += [f"## {theme}", "", *theme_table(members), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Render docs/RELIABILITY.md.")
    parser.add_argument("results", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--no-timing", action="store_true", help="skip the auth benchmark")
    args = parser.parse_args()
    data = json.loads(args.results.read_text())
    timing = None
    if not args.no_timing:
        sys.path.insert(0, str(ROOT))
        from bench.auth_timing import measure, table

        timing = table(measure())
    args.output.write_text(render(data, timing))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
