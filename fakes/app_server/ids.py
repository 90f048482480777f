"""Identifiers shaped like the real server's, reproducible under a seed."""

from __future__ import annotations

import random
import time

# Seeded runs must not depend on the clock, so their UUIDv7 timestamps count up from
# here (2026-01-01T00:00:00Z) instead.
_SEEDED_EPOCH_MS = 1_767_225_600_000


class IdFactory:
    """Makes thread, turn, item and call ids.

    With a seed every id is a pure function of the seed and the order of calls; without
    one, ids are random and UUIDv7 timestamps follow the clock, like the real server's.
    """

    def __init__(self, seed: int | None) -> None:
        self._rng = random.Random(seed)
        self._seeded = seed is not None
        self._clock_ms = _SEEDED_EPOCH_MS

    @property
    def rng(self) -> random.Random:
        """The seeded generator, for anything else that must be reproducible."""
        return self._rng

    def uuid7(self) -> str:
        """A UUIDv7 string, the format of real thread, turn and user-message ids."""
        if self._seeded:
            self._clock_ms += 1
            millis = self._clock_ms
        else:
            millis = time.time_ns() // 1_000_000
        rand_a = self._rng.getrandbits(12)
        rand_b = self._rng.getrandbits(62)
        value = (millis & (1 << 48) - 1) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
        text = f"{value:032x}"
        return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"

    def token(self, prefix: str) -> str:
        """A short opaque id such as `msg_…` or `call_…` (model-provider item ids)."""
        return f"{prefix}{self._rng.getrandbits(64):016x}"
