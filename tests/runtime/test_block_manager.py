"""Tests of the KV-cache block allocator, block tables and the sizing helpers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tgraph.errors import ConfigError, TGraphError
from tgraph.runtime.block_manager import (
    BlockAllocator,
    BlockManagerError,
    BlockTable,
    OutOfBlocksError,
    kv_block_bytes,
    num_blocks_from_memory,
)

# ------------------------------------------------------------------ allocator


def test_allocate_hands_out_distinct_ids_in_range():
    a = BlockAllocator(num_blocks=6, block_size=4)
    assert (a.num_free, a.num_used, a.capacity_tokens) == (6, 0, 24)
    ids = a.allocate(4)
    assert len(set(ids)) == 4 and all(0 <= b < 6 for b in ids)
    assert (a.num_free, a.num_used) == (2, 4)
    assert all(a.is_allocated(b) for b in ids)
    rest = a.allocate(2)
    assert sorted(ids + rest) == list(range(6))
    assert a.num_free == 0 and not a.can_allocate(1) and a.can_allocate(0)


def test_allocation_is_all_or_nothing():
    a = BlockAllocator(4, 2)
    a.allocate(3)
    with pytest.raises(OutOfBlocksError, match="cannot allocate 2 .* only 1 of 4"):
        a.allocate(2)
    assert a.num_free == 1  # the failed call took nothing
    assert a.allocate(0) == []


def test_freed_blocks_are_reused():
    a = BlockAllocator(3, 2)
    first = a.allocate(3)
    a.free([first[1]])
    assert a.num_free == 1 and not a.is_allocated(first[1])
    assert a.allocate(1) == [first[1]]
    a.free(first)
    assert a.num_free == 3
    assert sorted(a.allocate(3)) == [0, 1, 2]


def test_double_free_and_foreign_ids_are_refused_without_side_effects():
    a = BlockAllocator(4, 2)
    ids = a.allocate(2)
    a.free([ids[0]])
    with pytest.raises(BlockManagerError, match="not allocated"):
        a.free([ids[0]])
    with pytest.raises(BlockManagerError, match="does not belong.*0..3"):
        a.free([4])
    with pytest.raises(BlockManagerError, match=">= 0"):
        a.free([-1])
    never = next(b for b in range(4) if not a.is_allocated(b))
    with pytest.raises(BlockManagerError, match="not allocated"):
        a.free([never])
    with pytest.raises(BlockManagerError, match="twice"):
        a.free([ids[1], ids[1]])
    # a bad id in the middle of a batch frees nothing
    with pytest.raises(BlockManagerError):
        a.free([ids[1], 99])
    assert a.is_allocated(ids[1]) and a.num_free == 3
    with pytest.raises(TypeError, match="int"):
        a.free([1.0])
    with pytest.raises(TypeError, match="bool"):
        a.free([True])
    # errors are tgraph errors and ValueErrors for callers that do not know tgraph
    assert issubclass(BlockManagerError, TGraphError) and issubclass(BlockManagerError, ValueError)


@pytest.mark.parametrize(
    ("args", "exc"),
    [((0, 4), ConfigError), ((4, 0), ConfigError), ((4.0, 4), TypeError), ((4, True), TypeError)],
)
def test_allocator_rejects_bad_sizes(args, exc):
    with pytest.raises(exc):
        BlockAllocator(*args)


def test_allocate_rejects_negative_count():
    a = BlockAllocator(2, 2)
    with pytest.raises(BlockManagerError, match=">= 0"):
        a.allocate(-1)
    with pytest.raises(BlockManagerError, match=">= 0"):
        a.can_allocate(-1)


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12), st.integers(0, 2**16)), max_size=60),
)
def test_random_alloc_free_never_hands_out_a_block_twice(num_blocks, ops):
    """Model check: the allocator agrees with a set of held ids after every operation."""
    a = BlockAllocator(num_blocks, 2)
    held: set[int] = set()
    for is_alloc, n, pick in ops:
        if is_alloc:
            if n <= num_blocks - len(held):
                new = a.allocate(n)
                assert len(new) == n and len(set(new)) == n
                assert not set(new) & held, "a held block was handed out again"
                assert all(0 <= b < num_blocks for b in new)
                held.update(new)
            else:
                with pytest.raises(OutOfBlocksError):
                    a.allocate(n)
        elif held:
            # free a pseudo-random subset, then check the same ids are refused a second time
            ordered = sorted(held)
            subset = [b for i, b in enumerate(ordered) if (pick >> (i % 16)) & 1] or ordered[:1]
            a.free(subset)
            held.difference_update(subset)
            with pytest.raises(BlockManagerError):
                a.free(subset[:1])
        assert a.num_free == num_blocks - len(held)
        assert a.num_used == len(held)
        assert all(a.is_allocated(b) == (b in held) for b in range(num_blocks))
    a.free(sorted(held))
    assert a.num_free == num_blocks


# ------------------------------------------------------------------ block table


def test_block_table_allocates_on_demand_and_maps_slots():
    a = BlockAllocator(8, 4)
    a.allocate(1)  # make the table's physical blocks differ from its logical ones
    t = BlockTable(a)
    assert t.capacity_tokens == 0 and t.blocks_needed(1) == 1 and t.blocks_needed(0) == 0
    assert t.ensure_capacity(5) != [] and t.num_blocks == 2 and t.capacity_tokens == 8
    assert t.ensure_capacity(8) == []  # already large enough
    new = t.ensure_capacity(9)
    assert len(new) == 1 and t.num_blocks == 3
    blocks = t.block_ids
    for pos in range(t.capacity_tokens):
        assert t.slot(pos) == blocks[pos // 4] * 4 + pos % 4
    assert t.slots(3, 6) == [t.slot(p) for p in range(3, 9)]
    assert t.slots(5, 0) == []
    # slots of one table are distinct and lie in its own blocks
    all_slots = t.slots(0, t.capacity_tokens)
    assert len(set(all_slots)) == len(all_slots)
    assert {s // 4 for s in all_slots} == set(blocks)
    assert a.num_free == 8 - 1 - 3


def test_block_table_errors_and_free():
    a = BlockAllocator(3, 2)
    t = BlockTable(a)
    t.ensure_capacity(3)
    with pytest.raises(BlockManagerError, match="position 4 is beyond .* 4 tokens"):
        t.slot(4)
    with pytest.raises(BlockManagerError):
        t.slots(2, 3)
    with pytest.raises(BlockManagerError):
        t.slot(-1)
    with pytest.raises(OutOfBlocksError):
        t.ensure_capacity(7)  # needs 4 blocks in all, the cache has 3
    assert t.num_blocks == 2 and a.num_free == 1  # unchanged by the failure
    assert t.free() == 2
    assert t.num_blocks == 0 and a.num_free == 3
    with pytest.raises(TypeError, match="BlockAllocator"):
        BlockTable(object())


def test_two_tables_never_share_slots():
    a = BlockAllocator(6, 3)
    t1, t2 = BlockTable(a), BlockTable(a)
    for n in range(1, 10):
        t1.ensure_capacity(n)
        t2.ensure_capacity(n)
    assert not set(t1.slots(0, 9)) & set(t2.slots(0, 9))


# ------------------------------------------------------------------ sizing


def test_num_blocks_from_memory():
    per_block = kv_block_bytes(
        block_size=16, num_layers=2, num_kv_heads=4, head_dim=64, element_size=2
    )
    assert per_block == 2 * 2 * 16 * 4 * 64 * 2
    assert num_blocks_from_memory(10 * per_block, 1.0, per_block) == 10
    assert num_blocks_from_memory(10 * per_block, 0.9, per_block) == 9
    assert num_blocks_from_memory(10 * per_block - 1, 1.0, per_block) == 9  # floors
    assert num_blocks_from_memory(0, 0.5, per_block) == 0
    # an 80 GiB device at 0.5 with 1 MiB blocks
    assert num_blocks_from_memory(80 * 2**30, 0.5, 2**20) == 40 * 2**10


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((100, 0.0, 10), ConfigError),
        ((100, 1.5, 10), ConfigError),
        ((100, 0.5, 0), ConfigError),
        ((-1, 0.5, 10), ConfigError),
        ((100, "0.5", 10), TypeError),
        ((100.0, 0.5, 10), TypeError),
    ],
)
def test_num_blocks_from_memory_rejects_bad_input(args, exc):
    with pytest.raises(exc):
        num_blocks_from_memory(*args)


def test_kv_block_bytes_rejects_zero():
    with pytest.raises(ConfigError, match="head_dim"):
        kv_block_bytes(16, 2, 4, 0, 2)
