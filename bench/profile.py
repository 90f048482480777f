"""py-spy on the bridge process while it works: the frames that cost the most."""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_LINE = re.compile(r":\d+\)")


def py_spy() -> str | None:
    candidate = Path(sys.executable).with_name("py-spy")
    return str(candidate) if candidate.exists() else shutil.which("py-spy")


def start(pid: int, seconds: float, rate: int = 250) -> tuple[subprocess.Popen[bytes], Path] | None:
    """Start sampling ``pid`` for ``seconds`` (non-blocking sampling: no pauses)."""
    binary = py_spy()
    if binary is None:
        return None
    out = Path(tempfile.mkstemp(prefix="bench-pyspy-", suffix=".txt")[1])
    argv = [binary, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(rate)]
    argv += ["--nonblocking", "-f", "raw", "-o", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, out


def finish(handle: tuple[subprocess.Popen[bytes], Path] | None, top: int = 14) -> str:
    """Wait for py-spy and summarise: self time and inclusive time of the top frames."""
    if handle is None:
        return "(py-spy not available)"
    proc, out = handle
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "(py-spy did not finish)"
    if proc.returncode != 0 or not out.exists() or out.stat().st_size == 0:
        return f"(py-spy failed: {err.decode(errors='replace').strip()[-300:]})"
    text = summarise(out.read_text(), top)
    out.unlink(missing_ok=True)
    return text


def summarise(raw: str, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = [_LINE.sub(")", frame) for frame in stack.split(";")]
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    if total == 0:
        return "(no samples)"
    lines = [f"{total} samples. Self time (the frame itself):"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines.append("Inclusive time, bridge and aiohttp frames (the frame and what it calls):")
    interesting = [
        (frame, n)
        for frame, n in inclusive.most_common()
        if ("bridge/" in frame or "aiohttp/" in frame or "asyncio/" in frame)
        and "run_forever" not in frame
        and "run_until_complete" not in frame
        and "_run_once" not in frame
        and "Runner.run" not in frame
        and "runners.py" not in frame
        and "main (bridge/cli.py)" not in frame
    ]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in interesting[:top]]
    return "\n".join(lines)
