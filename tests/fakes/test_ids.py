"""The fake's UUIDv7 ids sort in the order they were made, as the real server's do."""

from __future__ import annotations

import pytest

from fakes.app_server.ids import IdFactory
from fakes.app_server.wire import use_virtual_clock

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("seed", [None, 7])
def test_ids_of_one_millisecond_sort_in_creation_order(seed: int | None) -> None:
    """Hundreds of ids in a few milliseconds (the seeded clock often stands still):
    sorted, they are the order they were made in, and all are UUIDv7."""
    use_virtual_clock(seed)
    try:
        ids = IdFactory(seed)
        made = [ids.uuid7() for _ in range(500)]
    finally:
        use_virtual_clock(None)
    assert sorted(made) == made
    assert len(set(made)) == len(made)
    assert {value[14] for value in made} == {"7"}
    assert {value[19] for value in made} <= set("89ab")


def test_a_full_counter_carries_into_the_next_millisecond() -> None:
    """An id after the largest of its millisecond still sorts after it (the counter
    carries into the timestamp rather than wrapping into the variant bits)."""
    use_virtual_clock(3)
    try:
        ids = IdFactory(3)
        first = ids.uuid7()
        ids._last_v7 = (int(first.replace("-", "")[:12], 16) + 10**6, (1 << 74) - 1)
        after = ids.uuid7()
    finally:
        use_virtual_clock(None)
    assert after > first
    assert after[19] in "89ab"
