"""Tests of the KV-cache block allocator, its prefix cache, block tables and the sizing helpers."""

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
    hash_block,
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


# ------------------------------------------------------------------ prefix cache


def chain(blocks: list[list[int]], lora: str | None = None) -> list[bytes]:
    """The chained hashes of a sequence of blocks."""
    out: list[bytes] = []
    for tokens in blocks:
        out.append(hash_block(out[-1] if out else None, tokens, lora))
    return out


def cached_blocks(a: BlockAllocator, blocks: list[list[int]], lora: str | None = None) -> list[int]:
    """Allocate one block per token list, register each under its chained hash, free them all;
    returns the block ids (now free but cached)."""
    ids = a.allocate(len(blocks))
    for b, h in zip(ids, chain(blocks, lora)):
        assert a.register(b, h)
    a.free(ids)
    return ids


def test_block_hash_depends_on_tokens_prefix_and_adapter():
    root = hash_block(None, [1, 2, 3, 4])
    assert root == hash_block(None, (1, 2, 3, 4)) and len(root) == 32  # deterministic
    child = hash_block(root, [5, 6, 7, 8])
    assert child == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    others = [
        hash_block(None, [1, 2, 3, 5]),  # one token differs
        hash_block(None, [2, 1, 3, 4]),  # order differs
        hash_block(None, [1, 2, 3]),  # length differs
        hash_block(None, [1, 2, 3, 4], "sql"),  # adapter differs
        hash_block(None, [1, 2, 3, 4], ""),  # an empty adapter name is still an adapter
        hash_block(root, [1, 2, 3, 4]),  # a parent
        hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8]),  # same block, other prefix
        hash_block(root, [5, 6, 7, 8], "sql"),
        hash_block(hash_block(None, [1, 2, 3, 4], "sql"), [5, 6, 7, 8]),  # adapter of the prefix
    ]
    assert len({root, child, *others}) == 2 + len(others)
    assert hash_block(None, [1, 2, 3, 4], "sql") == hash_block(None, [1, 2, 3, 4], "sql")
    # token ids are not confused by their byte encoding
    assert hash_block(None, [256]) != hash_block(None, [1, 0])


def test_lookup_returns_the_longest_cached_prefix():
    a = BlockAllocator(8, 2)
    ids = cached_blocks(a, [[1, 2], [3, 4], [5, 6]])
    assert a.num_cached == 3 and a.num_evictable == 3 and a.num_free == 8
    assert a.lookup(chain([[1, 2], [3, 4], [5, 6], [7, 8]])) == ids
    assert a.lookup(chain([[1, 2], [3, 4], [9, 9]])) == ids[:2]
    assert a.lookup(chain([[1, 2], [3, 4]], lora="sql")) == []  # another adapter
    assert a.lookup(chain([[3, 4]])) == []  # the same block after another prefix
    assert a.lookup([]) == []

    def lazy():  # consumed only up to the first miss
        yield from chain([[1, 2], [0, 0]])
        raise AssertionError("read past the first miss")

    assert a.lookup(lazy()) == ids[:1]
    assert a.cached_block(chain([[1, 2]])[0]) == ids[0] and a.block_hash(ids[0]) is not None


def test_shared_blocks_are_reference_counted():
    a = BlockAllocator(4, 2)
    (b,) = cached_blocks(a, [[1, 2]])
    assert a.ref_count(b) == 0 and not a.is_allocated(b)
    a.acquire([b])
    a.acquire([b])
    assert a.ref_count(b) == 2 and a.num_used == 1 and a.num_free == 3 and a.num_evictable == 0
    a.free([b])
    assert a.ref_count(b) == 1 and a.is_allocated(b) and a.num_free == 3
    a.free([b])
    assert a.ref_count(b) == 0 and a.num_free == 4 and a.num_evictable == 1
    with pytest.raises(BlockManagerError, match="not allocated"):
        a.free([b])
    with pytest.raises(BlockManagerError, match="twice"):
        a.acquire([b, b])
    empty = next(x for x in range(4) if x != b)
    with pytest.raises(BlockManagerError, match="no cached content"):
        a.acquire([b, empty])
    assert a.ref_count(b) == 0  # the failed call took nothing
    with pytest.raises(BlockManagerError, match="does not belong"):
        a.ref_count(4)


def test_empty_blocks_go_first_then_cached_ones_least_recently_freed_first():
    a = BlockAllocator(6, 2)
    first = cached_blocks(a, [[1, 2], [3, 4]])
    second = cached_blocks(a, [[5, 6], [7, 8]])
    assert a.num_free == 6 and a.num_evictable == 4
    empty = a.allocate(2)  # the two blocks never cached, before any cached one
    assert not set(empty) & set(first + second) and a.num_evictions == 0 and a.num_cached == 4
    # a freed sequence is evicted deepest block first; "first" was freed before "second"
    assert a.allocate(1) == [first[1]]
    assert a.num_evictions == 1 and a.block_hash(first[1]) is None
    assert a.lookup(chain([[1, 2], [3, 4]])) == first[:1]
    # reusing a block makes it the most recently used when it is freed again
    a.acquire(first[:1])
    a.free(first[:1])
    assert a.allocate(3) == [second[1], second[0], first[0]]
    assert a.num_cached == 0 and a.num_free == 0 and a.num_evictions == 4
    with pytest.raises(OutOfBlocksError):
        a.allocate(1)


def test_cached_blocks_never_reduce_capacity():
    a = BlockAllocator(5, 2)
    cached_blocks(a, [[i, i] for i in range(5)])
    assert a.num_free == 5 and a.can_allocate(5) and a.num_cached == 5
    ids = a.allocate(5)  # a request needing every block gets them all
    assert sorted(ids) == list(range(5)) and a.num_cached == 0


def test_register_keeps_the_first_copy_and_refuses_changes():
    a = BlockAllocator(4, 2)
    x, y = a.allocate(2)
    h = hash_block(None, [1, 2])
    assert a.register(x, h) and a.register(x, h)  # again: no-op
    assert not a.register(y, h)  # same content in another block: stays private
    assert a.num_cached == 1
    with pytest.raises(BlockManagerError, match="another hash"):
        a.register(x, hash_block(None, [3, 4]))
    a.free([x, y])
    assert a.num_evictable == 1 and a.lookup([h]) == [x]
    with pytest.raises(BlockManagerError, match="not allocated"):
        a.register(y, hash_block(None, [5, 6]))


def test_reset_prefix_cache_empties_free_and_held_blocks():
    a = BlockAllocator(4, 2)
    free_cached = cached_blocks(a, [[1, 2]])
    held = a.allocate(1)
    a.register(held[0], hash_block(None, [3, 4]))
    assert a.reset_prefix_cache() == 2
    assert a.num_cached == 0 and a.num_evictable == 0 and a.num_free == 3
    assert a.lookup(chain([[1, 2]])) == [] and a.is_allocated(held[0])
    a.free(held)
    assert a.num_evictable == 0 and a.num_free == 4
    with pytest.raises(BlockManagerError, match="no cached content"):
        a.acquire(free_cached)


def test_block_table_shares_a_cached_prefix_and_registers_its_full_blocks():
    a = BlockAllocator(8, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    hashes = chain([tokens[i:i + 2] for i in range(0, 6, 2)])
    t = BlockTable(a)
    t.ensure_capacity(7)
    assert t.register_full_blocks(hashes, 3) == 1  # only block 0 is full after 3 tokens
    assert t.register_full_blocks(hashes, 3) == 0 and t.num_cached_blocks == 1
    assert t.register_full_blocks(hashes, 7) == 2 and a.num_cached == 3
    with pytest.raises(BlockManagerError, match="hashes"):
        t.register_full_blocks(hashes, 8)  # 4 full blocks, 3 hashes
    other = BlockTable(a)
    hits = a.lookup(hashes)
    other.share_prefix(hits)
    assert other.block_ids == t.block_ids[:3] and other.num_cached_blocks == 3
    assert all(a.ref_count(b) == 2 for b in hits)
    other.ensure_capacity(8)  # one more, private block
    assert a.ref_count(other.block_ids[3]) == 1
    with pytest.raises(BlockManagerError, match="empty block table"):
        other.share_prefix(hits)
    t.free()
    assert all(a.ref_count(b) == 1 for b in hits) and a.num_used == 4
    other.free()
    assert a.num_free == 8 and a.num_evictable == 3 and other.num_cached_blocks == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=60))
def test_random_sharing_keeps_reference_counts_and_capacity(ops):
    """Model check: tables sharing cached prefixes against plain reference counts."""
    a = BlockAllocator(6, 1)
    tables: list[tuple[BlockTable, list[bytes]]] = []
    for kind, arg in ops:
        if kind == 0:  # a new sequence of ``arg`` + 1 tokens that shares what is cached
            hashes = chain([[t % 3] for t in range(arg + 1)])
            t = BlockTable(a)
            hits = a.lookup(hashes)
            revived = sum(1 for b in hits if a.ref_count(b) == 0)
            if a.can_allocate(len(hashes) - len(hits) + revived):
                t.share_prefix(hits)
                t.ensure_capacity(len(hashes))
                t.register_full_blocks(hashes, len(hashes))
                tables.append((t, hashes))
        elif tables and kind == 1:
            tables.pop(arg % len(tables))[0].free()
        elif kind == 2:
            a.reset_prefix_cache()
        refs: dict[int, int] = {}
        for t, _ in tables:
            for b in t.block_ids:
                refs[b] = refs.get(b, 0) + 1
        assert all(a.ref_count(b) == refs.get(b, 0) for b in range(6))
        assert a.num_used == len(refs) and a.num_free == 6 - len(refs)
        assert a.num_evictable <= a.num_free and a.num_cached <= 6
        for t, hashes in tables:  # a block found by hash holds the content of that hash
            for b, h in zip(t.block_ids, hashes):
                assert a.block_hash(b) in (None, h)
    for t, _ in tables:
        t.free()
    assert a.num_free == 6 and a.num_used == 0


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
