"""Identifiers shaped like the real server's, reproducible under a seed."""

from __future__ import annotations

import random
import string

from fakes.app_server.wire import now_ms

_BASE62 = string.digits + string.ascii_letters


class IdFactory:
    """Makes thread, turn, item and call ids.

    With a seed every id is a pure function of the seed and the order of calls (UUIDv7
    timestamps then come from the seeded virtual clock, see `wire.now_ms`); without
    one, ids are random and timestamps follow the clock, like the real server's.
    """

    def __init__(self, seed: int | None) -> None:
        self._rng = random.Random(seed)
        self._last_v7 = (0, 0)

    @property
    def rng(self) -> random.Random:
        """The seeded generator, for anything else that must be reproducible."""
        return self._rng

    def uuid7(self) -> str:
        """A UUIDv7 string, the format of real thread, turn and user-message ids.

        Monotonic within the process, as the real server's (Rust's `Uuid::now_v7`): an
        id made in the same millisecond as the last one (or while the clock stands
        still or steps back) is the last one's successor, so ids sort in creation order.
        """
        millis = now_ms() & (1 << 48) - 1
        random_bits = self._rng.getrandbits(12) << 62 | self._rng.getrandbits(62)
        last_millis, last_bits = self._last_v7
        if millis <= last_millis:
            millis, random_bits = last_millis, last_bits + 1
            if random_bits >> 74:
                millis, random_bits = last_millis + 1, 0
        self._last_v7 = (millis, random_bits)
        rand_a, rand_b = random_bits >> 62, random_bits & (1 << 62) - 1
        value = millis << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
        return _dashed(value)

    def uuid4(self) -> str:
        """A random UUIDv4 string (installation ids, read-state revisions)."""
        value = self._rng.getrandbits(128)
        value = value & ~(0xF << 76) | 0x4 << 76
        value = value & ~(0b11 << 62) | 0b10 << 62
        return _dashed(value)

    def message_id(self) -> str:
        """A Responses API message id (`msg_` + 48 hex digits): an agentMessage item's id."""
        return f"msg_{self._rng.getrandbits(192):048x}"

    def call_id(self) -> str:
        """A Responses API tool call id (`call_` + 24 base62 characters)."""
        return "call_" + "".join(self._rng.choice(_BASE62) for _ in range(24))

    def process_id(self) -> str:
        """A plausible operating-system process id, as a string (`processId`)."""
        return str(self._rng.randint(1_000, 99_999))


def _dashed(value: int) -> str:
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
