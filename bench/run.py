"""``make bench``: run every benchmark, then rewrite bench/RESULTS.md.

.venv/bin/python -m bench.run [--repeats 3] [--only calls,events,...] [--loop uvloop]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import wrk
from bench.common import (
    Figure,
    Section,
    log,
    machine_summary,
    raise_fd_limit,
    speed_probe,
    wait_for_quiet,
)

BENCHMARKS = ("fake", "calls", "events", "sessions", "idle", "turns", "cluster")
HERE = Path(__file__).resolve().parent
DASH = "\u2013"  # en dash, for ranges
BUSY = 0.25  # other load above which RESULTS.md warns
TIMES = "\u00d7"  # multiplication sign, for ratios


def machine() -> dict[str, str]:
    cpu, memory_gib = machine_summary()

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "CPU": f"{os.cpu_count()} cores ({cpu})",
        "Memory": f"{memory_gib:.1f} GiB",
        "Kernel": platform.release(),
        "Python": platform.python_version(),
        "aiohttp": version("aiohttp"),
        "orjson": version("orjson"),
        "uvloop": version("uvloop"),
        "wrk": wrk.version(),
    }


def fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return DASH
    if unit in ("calls/s", "req/s", "events/s", "sessions/s"):
        return f"{value:,.0f}"
    if abs(value) >= 100 or value == int(value):
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def spread(values: list[float] | None, unit: str) -> str:
    if not values:
        return DASH
    if len(values) == 1:
        return fmt(values[0], unit)
    low, high = fmt(min(values), unit), fmt(max(values), unit)
    return f"{fmt(statistics.median(values), unit)} ({low}{DASH}{high})"


def verdict(figure: Figure) -> str:
    if figure.met is None:
        return ""
    return "met" if figure.met else "**missed**"


def render(
    sections: list[Section],
    info: dict[str, str],
    args: Any,
    seconds: float,
    conditions: list[tuple[str, float, float, float, float]],
) -> str:
    out = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`python -m bench.run`); do not edit by hand: the hand-written",
        "analysis at the end comes from `bench/FINDINGS.md`.",
        "",
        f"Run: {time.strftime('%Y-%m-%d %H:%M %Z')}, {args.repeats} repeats per figure, "
        f"event loops of the bridge: {', '.join(args.loops)} (calls and SSE), {args.loops[0]}"
        f" (the rest); total {seconds:.0f} s.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    out += [f"| {key} | {value} |" for key, value in info.items()]
    out += [
        "",
        "Conditions per benchmark: the machine is shared, so each benchmark waits (at most",
        "5 s) for other work to fall under 15% of the CPU, and records what it found and how",
        "fast Python ran (`sum(range(100_000))`; lower is faster).",
        "",
        "| Benchmark | Other load at start | Python speed probe, before / after | Took |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {title} | {busy:.0%} | {before:.2f} / {after:.2f} ms | {took:.0f} s |"
        for title, busy, before, after, took in conditions
    ]
    if any(busy > BUSY for _, busy, _, _, _ in conditions):
        out += [
            "",
            f"**Measured on a busy machine** (other work above {BUSY:.0%} of the CPU when a"
            " benchmark started): rates and latencies are depressed and noisy; ratios to the"
            " baseline, measured in turns with it, and CPU per call or per event (in the"
            " notes) are the robust figures. Run `make bench` again on a quiet machine.",
        ]
    out += [
        "",
        "## How it is measured",
        "",
        "- The bridge runs as its own process (`rest-bridge serve`, limits from `REST_ADAPTER_*`),",
        "  fronting `fake-codex` with `bench/fake_script.yaml`; its CPU and memory are read from",
        "  `/proc/<pid>/stat` and `/proc/<pid>/statm`.",
        "- **The baseline is the pipe**: the same work done directly over the stdio of a",
        "  `fake-codex` process with the same script, by a lean blocking client (`bench/pipe.py`).",
        "- Load: **wrk** (Debian's package, 1 thread) for calls; for SSE, long-poll, idle",
        "  connections and concurrent session creation, Python clients on raw sockets, each in its",
        "  own process (`bench/clients.py`), which report their own CPU time to show they were",
        "  not the bottleneck. Text turns are driven sequentially by the driver process.",
        f"- Each figure: median over the repeats, (min{DASH}max) in brackets. Ratio = bridge",
        "  median ÷ baseline median (for latencies and times lower is better, for rates higher).",
        "",
        "## Targets",
        "",
        "| Target | Figure | Bridge | Baseline | Ratio | Verdict |",
        "|---|---|---|---|---|---|",
    ]
    for section in sections:
        for figure in section.figures:
            if figure.met is None:
                continue
            out.append(
                f"| {figure.target} | {figure.name} | {spread(figure.bridge, figure.unit)} "
                f"{figure.unit} | {spread(figure.baseline, figure.unit)} | "
                f"{fmt(figure.ratio)}{TIMES if figure.ratio is not None else ''} | "
                f"{verdict(figure)} |"
            )
    for section in sections:
        out += [
            "",
            f"## {section.title}",
            "",
            f"| Figure | Unit | {section.subject} | Baseline | Ratio | Target |",
            "|---|---|---|---|---|---|",
        ]
        for figure in section.figures:
            base = spread(figure.baseline, figure.unit)
            if figure.baseline:
                base += f" ({figure.baseline_name})"
            target = f"{figure.target} {verdict(figure)}".strip()
            out.append(
                f"| {figure.name} | {figure.unit} | {spread(figure.bridge, figure.unit)} | "
                f"{base} | {fmt(figure.ratio)}{TIMES if figure.ratio is not None else ''} | "
                f"{target} |"
            )
        notes = [f.name + ": " + f.note for f in section.figures if f.note] + section.notes
        if notes:
            out.append("")
            out += [f"- {note}" for note in notes]
        if section.profile:
            out += ["", "Profile of the bridge (py-spy):", "", "```", section.profile, "```"]
    findings = HERE / "FINDINGS.md"
    if findings.exists():
        out += ["", findings.read_text().rstrip()]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(BENCHMARKS))
    parser.add_argument(
        "--loops",
        default="asyncio,uvloop",
        help="event loops of the bridge for calls and SSE (the first one serves the rest)",
    )
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args(argv)
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = set(wanted) - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmarks: {sorted(unknown)}")
    loops = [name.strip() for name in args.loops.split(",") if name.strip()]
    if not set(loops) <= {"asyncio", "uvloop"} or not loops:
        parser.error("--loops takes asyncio and/or uvloop")
    if "uvloop" in loops and importlib.util.find_spec("uvloop") is None:
        log("uvloop is not installed: measuring asyncio only")
        loops = [name for name in loops if name != "uvloop"] or ["asyncio"]
    args.loops = loops
    raise_fd_limit()
    info = machine()
    options = {"loops": loops, "loop": loops[0], "profile": not args.no_profile}
    started = time.monotonic()
    sections = []
    conditions = []
    for name in BENCHMARKS:
        if name in wanted:
            module = importlib.import_module(f"bench.b_{name}")
            busy = wait_for_quiet()
            probe = speed_probe()
            began = time.monotonic()
            sections.append(module.run(args.repeats, options))
            took = time.monotonic() - began
            log(f"{name}: {took:.0f} s")
            conditions.append((sections[-1].title, busy, probe, speed_probe(), took))
    seconds = time.monotonic() - started
    text = render(sections, info, args, seconds, conditions)
    Path(args.out).write_text(text)
    log(f"wrote {args.out} in {seconds:.0f} s")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
