"""`rest-bridge`, the console script: :func:`bridge.cli.main` with its imports made
without Python's cyclic garbage collector.

Importing the bridge builds some 90,000 objects (modules, classes, the validators of
the wire models) and frees next to none of them, yet Python's collector, counting
allocations, ran about 140 collections over them while they were made: 2% of the
instructions of `rest-bridge serve` up to listening. Off while the modules load, on
again before the program does anything; `serve` then collects once and freezes what
start-up built (:func:`bridge.runtime.settle_heap`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, as it was after: for imports that
    build many objects and free next to none (`fake-codex` loads its script so too)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def main() -> int:
    with collector_off():
        from bridge.cli import main as run
    return run()
