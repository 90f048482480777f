"""Placeholders for the recording machine in a cassette: its paths and host name become
`${tmp}`, `${home}`, `${scenarioDir}`, `${prefix}` and `${host}` when a cassette is
written, match any value in a request on replay, and are filled with what the replay
knows when an answer is served. scenarios/README.md ("Cassettes carry no machine") says
which is which and what is served.

A placeholder is `$` then one of the names in braces. A literal `${name}` in what the
bridge said is written with one more `$` in front (`$${tmp}`); reading takes it off
again, so the escape is exact both ways. Other `$` signs (`$ref`) are left alone.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

#: What stands for the machine in codex's `userAgent`, in cassettes and recordings.
USER_AGENT_MACHINE = "(os; arch) terminal"
#: The placeholders, each with what it stands for in the recording.
PLACEHOLDERS = {
    "tmp": "the recording run's temporary folder (the scenario's own ${tmp})",
    "home": "the home folder codex and fake-codex saw",
    "scenarioDir": "the folder of the scenario file",
    "prefix": "the Python environment that ran fake-codex (sys.prefix)",
    "host": "the machine's host name, where a value is exactly it",
}
_NAMES = "|".join(PLACEHOLDERS)
#: A run of `$` then `{name}`: one `$` is the placeholder, more are an escaped literal.
TOKEN = re.compile(r"(\$+)\{(" + _NAMES + r")\}")
#: What may come before and after a path in text (so `/tmp/ab` is taken neither out of
#: `/tmp/abc` nor out of `/x.tmp/ab`; `file:///tmp/ab` is).
_PATH_START = r"(?<![\w.~-])"
_PATH_END = r"(?=$|[/\s'\"`:;,)\]}\\])"
#: codex's userAgent in a JSON text: `<originator>/<version> (<os> <release>; <arch>)
#: <terminal> ...`; the parenthesis and the terminal name the recording machine.
_USER_AGENT = re.compile(r'("userAgent":\s*"[^"\s]+ )\([^()"]*\) [^\s"(]+')
#: A process id of the recording machine, in a JSON text (a number, or its digits).
_PROCESS_ID = re.compile(r'("(?:processId|pid)":\s*)("?)(\d+)\2(?=\s*[,}])')
#: Where process ids are numbered from (as `scenarios.record` numbers them).
FIRST_PROCESS_ID = 1001


def escape(text: str) -> str:
    """`text` with every literal `${name}` (any run of `$` before it) given one more `$`."""
    return TOKEN.sub(lambda found: "$" + found.group(0), text)


def fill(text: str, values: Mapping[str, str], *, json: bool = True) -> str:
    """`text` with its placeholders replaced by `values` (JSON-escaped, as they stand in
    JSON strings, unless `json` is False) and escaped literals given back."""

    def one(found: re.Match[str]) -> str:
        run, name = found.group(1), found.group(2)
        if len(run) > 1:
            return run[1:] + "{" + name + "}"
        value = values[name]
        return orjson.dumps(value).decode()[1:-1] if json else value

    return TOKEN.sub(one, text)


def has_placeholder(text: str) -> bool:
    return any(len(found.group(1)) == 1 for found in TOKEN.finditer(text))


def pattern(text: str) -> re.Pattern[str]:
    """A recorded string as a regex that any value matches in place of each placeholder
    (the same value where a placeholder comes back), named groups capturing them.

    Each placeholder takes the shortest text up to the literal after it, without going
    back (an atomic group), except one that ends the string, which takes the rest: so a
    match costs a pass over the value, whatever a host sends (a pattern free to go back
    would cost a power of the value's length, one per placeholder).
    """
    names: list[str] = []
    literals = [""]  # the text before the first placeholder, after each one
    position = 0
    for found in TOKEN.finditer(text):
        run, name = found.group(1), found.group(2)
        literals[-1] += text[position : found.start()]
        position = found.end()
        if len(run) > 1:
            literals[-1] += run[1:] + "{" + name + "}"
        else:
            names.append(name)
            literals.append("")
    literals[-1] += text[position:]
    out, seen = [re.escape(literals[0])], set()
    for index, name in enumerate(names):
        after = re.escape(literals[index + 1])
        if name in seen:
            out.append(f"(?P={name}){after}")
        elif index == len(names) - 1:  # the string's last placeholder: the rest is it
            out.append(f"(?P<{name}>.+){after}")
        else:
            out.append(f"(?>(?P<{name}>.+?){after})")
        seen.add(name)
    return re.compile(r"(?s)\A" + "".join(out) + r"\Z")


class Scrubber:
    """Takes the recording machine out of a cassette's texts: `paths` (a folder and the
    placeholder name it becomes), the host name where a JSON string is exactly it, the
    machine in codex's `userAgent` (`(os; arch) terminal`, as recordings have it), and
    process ids (numbered from 1001 in order of appearance)."""

    def __init__(self, paths: Mapping[str, str], hostname: str | None = None) -> None:
        forms: dict[str, str] = {}
        for path, name in paths.items():
            if name not in PLACEHOLDERS:
                raise ValueError(f"no placeholder ${{{name}}}")
            for shape in {path, os.path.realpath(path)}:
                shape = shape.rstrip("/")
                if len(shape) > 1:  # never `/` itself
                    forms.setdefault(shape, name)
                    forms.setdefault(orjson.dumps(shape).decode()[1:-1], name)
        self._names = forms
        longest_first = sorted(forms, key=len, reverse=True)
        either = "|".join(re.escape(form) for form in longest_first)
        self._paths = re.compile(f"{_PATH_START}(?:{either}){_PATH_END}") if either else None
        host = socket.gethostname() if hostname is None else hostname
        self._host = host if host not in ("", "localhost") else None
        self._pids: dict[str, int] = {}

    def text(self, text: str) -> str:
        text = escape(text)
        if self._paths is not None:
            text = self._paths.sub(lambda m: "${" + self._names[m.group(0)] + "}", text)
        if self._host is not None:
            text = text.replace(orjson.dumps(self._host).decode(), '"${host}"')
        text = _USER_AGENT.sub(rf"\1{USER_AGENT_MACHINE}", text)
        return _PROCESS_ID.sub(self._process_id, text)

    def _process_id(self, found: re.Match[str]) -> str:
        number = self._pids.setdefault(found.group(3), FIRST_PROCESS_ID + len(self._pids))
        return f"{found.group(1)}{found.group(2)}{number}{found.group(2)}"

    def body(self, body: str | bytes | None, marks: list[list[int | None]]) -> Any:
        """A body scrubbed (part by part where `marks` split it, the offsets moved to
        match); bytes that are not UTF-8 are kept as they are. Returns (body, marks)."""
        return rewrite(body, marks, self.text)


def rewrite(
    body: str | bytes | None, marks: list[list[int | None]], change: Callable[[str], str]
) -> tuple[str | bytes | None, list[list[int | None]]]:
    """`body` with `change` applied to each part `marks` splits it into (the whole body
    when it has none), the marks' offsets moved to where the parts now start."""
    if not isinstance(body, str | bytes):
        return body, marks
    raw = body.encode() if isinstance(body, str) else body
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return body, marks
    if not marks:
        return change(raw.decode("utf-8")), marks
    starts = [int(mark[0] or 0) for mark in marks]
    ends = [*starts[1:], len(raw)]
    moved: list[list[int | None]] = []
    out = b""
    for mark, start, end in zip(marks, starts, ends, strict=True):
        moved.append([len(out), mark[1]])
        out += change(raw[start:end].decode("utf-8")).encode()
    head = change(raw[: starts[0]].decode("utf-8")).encode() if starts[0] else b""
    if head:
        moved = [[int(offset or 0) + len(head), after] for offset, after in moved]
    text = (head + out).decode("utf-8")
    return (text if isinstance(body, str) else (head + out)), moved


def replay_values(scenario_path: Path | None) -> dict[str, str]:
    """What each placeholder is served as until the host's requests say otherwise: the
    system's temporary folder for `${tmp}`, this user's home, the scenario's folder here,
    this Python's environment, `localhost`."""
    return {
        "tmp": tempfile.gettempdir(),
        "home": str(Path.home()),
        "scenarioDir": str(scenario_path.parent.resolve()) if scenario_path else os.getcwd(),
        "prefix": sys.prefix,
        "host": "localhost",
    }
