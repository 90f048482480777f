"""The process policy of `rest-bridge serve` (bridge.runtime) that can run in a test."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from bridge import runtime

pytestmark = pytest.mark.quick


@pytest.fixture
def collector() -> Iterator[None]:
    """The test process's collector as it was, after the test."""
    threshold = gc.get_threshold()
    frozen = gc.get_freeze_count()
    yield
    if not frozen:
        gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settling_the_heap_leaves_what_start_up_built_out_of_collections(collector: None) -> None:
    built = {"start-up": [object()]}
    runtime.settle_heap()
    assert gc.get_freeze_count() > 0
    assert not any(found is built for found in gc.get_objects())
    allocated_later = {"a call": [object()]}
    assert any(found is allocated_later for found in gc.get_objects())


def test_settling_the_heap_collects_the_youngest_generation_less_often(collector: None) -> None:
    older = gc.get_threshold()[1:]
    runtime.settle_heap()
    assert gc.get_threshold() == (runtime.GC_YOUNG_THRESHOLD, *older)
    assert runtime.GC_YOUNG_THRESHOLD > 700  # Python's default
