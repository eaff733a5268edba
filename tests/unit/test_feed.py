"""The front ends' arena: blocks never overlap while live, and space comes back."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from tiered.agent.feed import Arena
from tiered.agent.front_end import front_end_count

SIZE = 1000


def overlapping(blocks) -> bool:
    spans = sorted((b.start, b.end) for b in blocks)
    return any(end > start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_a_full_ring_after_wrapping_refuses_instead_of_overlapping():
    arena = Arena(SIZE)
    first, second = arena.allocate(500), arena.allocate(500)
    arena.free(first)
    third = arena.allocate(500)  # wraps to the start, before `second`
    assert third.start == 0
    assert arena.allocate(1) is None  # [0, 1000) is all live again
    arena.free(second)
    assert arena.allocate(500).start == 500
    arena.close()


def test_a_block_freed_out_of_order_comes_back_with_the_oldest():
    arena = Arena(SIZE)
    a, b = arena.allocate(400), arena.allocate(400)
    arena.free(b)
    assert arena.allocate(400) is None  # `a` still holds the ring's tail
    arena.free(a)
    assert arena.allocate(SIZE) is not None  # all of it is free again
    arena.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 600)), max_size=60))
def test_live_blocks_never_overlap_and_all_space_returns(operations):
    arena = Arena(SIZE)
    live = []
    for allocate, size in operations:
        if allocate or not live:
            block = arena.allocate(size)
            if block is not None:
                assert 0 <= block.start < block.end <= SIZE and block.end - block.start == size
                live.append(block)
        else:
            arena.free(live.pop(size % len(live)))
        assert not overlapping(live)
    for block in live:
        arena.free(block)
    assert arena.allocate(SIZE) is not None
    arena.close()


def test_the_profiles_front_ends_are_capped_by_the_cores():
    assert front_end_count(8, cores=16) == 8
    assert front_end_count(8, cores=6) == 3  # half the cores: the engine needs the rest
    assert front_end_count(8, cores=2) == 0  # too few cores: one process serves
    assert front_end_count(0, cores=64) == 0  # one process, as asked
    cores = len(os.sched_getaffinity(0))
    assert front_end_count(8) == front_end_count(8, cores)
