"""Paged KV-cache bookkeeping: physical block ids, per-request block tables and the prefix cache.

The KV cache is one flat array of ``num_blocks * block_size`` token slots. A request owns a list
of blocks (its block table); token ``position`` of the request lives in slot
``block_ids[position // block_size] * block_size + position % block_size``. Nothing here touches
tensors: the allocator only hands out integers, the engine owns the memory.

Prefix cache: a full block, once written, can be registered under a content hash (its tokens,
chained with the hash of every block before it, plus the LoRA adapter, see :func:`hash_block`).
A later request whose prompt starts with the same blocks takes them instead of recomputing them.
Blocks are reference-counted; a registered block whose last holder lets go keeps its content and
stays findable, but still counts as free: it is evicted (least recently freed first) only when
no block without content is left, so the cache never reduces capacity.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from tgraph.errors import ConfigError, TGraphError

__all__ = [
    "BlockAllocator",
    "BlockHash",
    "BlockManagerError",
    "BlockTable",
    "OutOfBlocksError",
    "hash_block",
    "kv_block_bytes",
    "num_blocks_from_memory",
]

BlockHash = bytes
"""The content hash of one full block and everything before it (a SHA-256 digest)."""


class BlockManagerError(TGraphError, ValueError):
    """A block id was freed twice or is foreign to the allocator, or a slot is out of range."""


class OutOfBlocksError(TGraphError, RuntimeError):
    """More KV-cache blocks were asked for than are free."""


def _as_int(name: str, value: object, minimum: int, error: type[Exception]) -> int:
    """Return ``value`` as an int, refusing bools, non-integers and values below ``minimum``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        result = operator.index(value)  # accepts numpy / torch integer scalars, refuses floats
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if result < minimum:
        raise error(f"{name} must be >= {minimum}, got {result}")
    return result


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], lora: str | None = None
               ) -> BlockHash:
    """Content hash of one KV-cache block.

    The KV entries of a block depend on every token before it and on the adapter that computed
    them, so the hash covers the block's tokens, the hash of the block before it (``None`` for
    the first block) and the LoRA adapter name. The encoding is unambiguous and the digest is the
    same in every process (tensor-parallel ranks agree on cache hits).

    Args:
        parent: the previous block's hash, or None for a sequence's first block.
        token_ids: the block's token ids.
        lora: the request's LoRA adapter name, or None for the base model.

    Returns:
        A 32-byte SHA-256 digest.
    """
    h = hashlib.sha256()
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    if lora is None:
        h.update(b"\x00")
    else:
        name = lora.encode()
        h.update(b"\x01" + struct.pack("<Q", len(name)) + name)
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    return h.digest()


class BlockAllocator:
    """Hands out physical KV-cache block ids ``0 .. num_blocks - 1`` and keeps the prefix cache.

    Blocks are reference-counted: :meth:`allocate` hands out blocks with one reference,
    :meth:`acquire` adds a reference to a cached block (a shared prefix), :meth:`free` drops one.
    Allocation is all-or-nothing and every free is checked: a block id freed more often than it
    was taken, or never handed out, raises :class:`BlockManagerError` before any state changes.

    A free block is either empty or holds registered content (:meth:`register`). Allocation takes
    empty blocks first (oldest freed first) and only then evicts cached ones, least recently
    freed first; both kinds count in :attr:`num_free`.

    Args:
        num_blocks: number of physical blocks in the cache (>= 1).
        block_size: token slots per block (>= 1).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks: int = _as_int("num_blocks", num_blocks, 1, ConfigError)
        self.block_size: int = _as_int("block_size", block_size, 1, ConfigError)
        self._refs: list[int] = [0] * self.num_blocks
        self._num_used = 0
        # NOTE: FIFO reuse: a freed block goes to the back, so the block freed longest ago is
        # handed out first.
        self._empty: deque[int] = deque(range(self.num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and cached, LRU first
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0
        """Cached blocks whose content was dropped to make room, since creation."""

    @property
    def num_free(self) -> int:
        """Number of blocks that can be allocated now (empty or cached but unreferenced)."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Number of blocks currently referenced by at least one holder."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Number of blocks whose content is registered in the prefix cache (held or free)."""
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        """Number of free blocks that still hold cached content."""
        return len(self._evictable)

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole cache (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    def can_allocate(self, n: int) -> bool:
        """Return whether ``n`` blocks can be allocated now.

        Args:
            n: number of blocks (>= 0).

        Returns:
            True when at least ``n`` blocks are free (cached-but-free blocks included).
        """
        return _as_int("n", n, 0, BlockManagerError) <= self.num_free

    def allocate(self, n: int = 1) -> list[int]:
        """Allocate ``n`` blocks, all or none, evicting cached content only when needed.

        Args:
            n: number of blocks (>= 0).

        Returns:
            The allocated block ids, in allocation order, each with one reference.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are free (nothing is allocated).
        """
        n = _as_int("n", n, 0, BlockManagerError)
        if n > self.num_free:
            raise OutOfBlocksError(
                f"cannot allocate {n} KV-cache blocks: only {self.num_free} of "
                f"{self.num_blocks} are free"
            )
        ids = []
        for _ in range(n):
            if self._empty:
                b = self._empty.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self.num_evictions += 1
            self._refs[b] = 1
            ids.append(b)
        self._num_used += n
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds any more becomes free.

        All ids are checked before any is released, so a bad call leaves the allocator unchanged.
        A freed block with cached content stays findable until it is evicted; blocks released
        by one call are queued for eviction last first, so a sequence's deepest blocks (useless
        without the ones before them) go before its first ones.

        Args:
            block_ids: ids previously returned by :meth:`allocate` or taken by :meth:`acquire`,
                one reference each.

        Raises:
            BlockManagerError: an id is out of range, is not held, or appears twice in
                ``block_ids``.
        """
        ids = [_as_int("block id", b, 0, BlockManagerError) for b in block_ids]
        seen: set[int] = set()
        for b in ids:
            self._check_id(b)
            if b in seen:
                raise BlockManagerError(f"block id {b} appears twice in one free() call")
            if self._refs[b] == 0:
                raise BlockManagerError(f"block id {b} is not allocated (double free?)")
            seen.add(b)
        for b in reversed(ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._num_used -= 1
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._empty.append(b)

    def is_allocated(self, block_id: int) -> bool:
        """Return whether ``block_id`` is currently held by anyone."""
        return 0 <= block_id < self.num_blocks and self._refs[block_id] > 0

    def ref_count(self, block_id: int) -> int:
        """Return how many holders share ``block_id`` (0 when free)."""
        self._check_id(_as_int("block id", block_id, 0, BlockManagerError))
        return self._refs[block_id]

    # ---------------------------------------------------------------- prefix cache

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """Return the block registered under ``block_hash``, or None."""
        return self._block_of.get(block_hash)

    def block_hash(self, block_id: int) -> BlockHash | None:
        """Return the hash ``block_id`` is registered under, or None."""
        return self._hash_of.get(block_id)

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Return the cached blocks of the longest cached prefix of ``hashes``.

        Nothing changes: pass the result to :meth:`acquire` (or
        :meth:`BlockTable.share_prefix`) before allocating, or an allocation may evict it.
        ``hashes`` is consumed only up to its first miss, so it may be a lazy iterator.

        Args:
            hashes: chained block hashes of a sequence, first block first.

        Returns:
            One block id per leading hash found, stopping at the first miss.
        """
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each cached block (a request sharing a cached prefix).

        A block that was free leaves the eviction queue. All ids are checked first.

        Args:
            block_ids: blocks registered in the cache (held or free), each once.

        Raises:
            BlockManagerError: an id is out of range, appears twice, or is free without cached
                content (its slots hold nothing anyone may read).
        """
        ids = [_as_int("block id", b, 0, BlockManagerError) for b in block_ids]
        if len(set(ids)) != len(ids):
            raise BlockManagerError(f"a block id appears twice in one acquire() call: {ids}")
        for b in ids:
            self._check_id(b)
            if self._refs[b] == 0 and b not in self._evictable:
                raise BlockManagerError(f"block id {b} is free and holds no cached content")
        for b in ids:
            if self._refs[b] == 0:
                del self._evictable[b]
                self._num_used += 1
            self._refs[b] += 1

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register the content of a full, written block under ``block_hash``.

        Args:
            block_id: a held block whose every slot is written.
            block_hash: its :func:`hash_block`.

        Returns:
            True if the block is now cached under the hash; False when another block already
            holds the same content (this one stays private and is emptied when freed).

        Raises:
            BlockManagerError: the block is not held, or is already registered under another
                hash (a block's content never changes once full).
        """
        block_id = _as_int("block id", block_id, 0, BlockManagerError)
        self._check_id(block_id)
        if self._refs[block_id] == 0:
            raise BlockManagerError(f"block id {block_id} is not allocated; cannot register it")
        old = self._hash_of.get(block_id)
        if old is not None:
            if old != block_hash:
                raise BlockManagerError(
                    f"block id {block_id} is already cached under another hash")
            return True
        if block_hash in self._block_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's content (e.g. after an adapter's weights changed).

        Held blocks stay held but are emptied when freed; free cached blocks become empty.

        Returns:
            The number of cache entries dropped.
        """
        n = len(self._block_of)
        self._empty.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        return n

    def _check_id(self, b: int) -> None:
        if b >= self.num_blocks:
            raise BlockManagerError(
                f"block id {b} does not belong to this allocator "
                f"(ids are 0..{self.num_blocks - 1})"
            )

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free}, cached={self.num_cached})"
        )


class BlockTable:
    """The blocks one request holds, in logical order, and the token-to-slot mapping.

    Leading blocks may be shared with other requests (a cached prefix, see
    :meth:`share_prefix`); they are full and never written again, so every slot a request writes
    lies in a block only it holds.

    Args:
        allocator: where blocks come from and go back to.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self._blocks: list[int] = []
        self._num_cached = 0  # leading blocks taken from or offered to the prefix cache

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self.allocator.block_size

    @property
    def block_ids(self) -> list[int]:
        """A copy of the physical block ids, logical block 0 first."""
        return list(self._blocks)

    @property
    def num_blocks(self) -> int:
        """Number of blocks held."""
        return len(self._blocks)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the held blocks can store."""
        return len(self._blocks) * self.allocator.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Return how many more blocks are needed to hold ``num_tokens`` tokens.

        Args:
            num_tokens: total tokens the table must hold (>= 0).

        Returns:
            Extra blocks to allocate; 0 when the table is already large enough.
        """
        num_tokens = _as_int("num_tokens", num_tokens, 0, BlockManagerError)
        total = -(-num_tokens // self.allocator.block_size)  # ceil division
        return max(0, total - len(self._blocks))

    @property
    def num_cached_blocks(self) -> int:
        """Leading blocks taken from the prefix cache or already offered to it."""
        return self._num_cached

    def share_prefix(self, block_ids: Sequence[int]) -> None:
        """Start an empty table with cached blocks (from :meth:`BlockAllocator.lookup`).

        Args:
            block_ids: cached blocks of the request's first tokens, first block first; each
                gets one more reference.

        Raises:
            BlockManagerError: the table already holds blocks, or a block is not cached.
        """
        if self._blocks:
            raise BlockManagerError("a cached prefix can only start an empty block table")
        self.allocator.acquire(block_ids)
        self._blocks = list(block_ids)
        self._num_cached = len(self._blocks)

    def register_full_blocks(self, hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """Offer the blocks filled by the first ``num_tokens`` tokens to the prefix cache.

        Call it only once those tokens' KV entries are written. Blocks offered before are
        skipped, so calling it after every step costs only the new full blocks.

        Args:
            hashes: the chained hashes of the request's blocks, at least one per full block.
            num_tokens: tokens whose KV entries are in the cache.

        Returns:
            The number of blocks newly offered.
        """
        full = min(_as_int("num_tokens", num_tokens, 0, BlockManagerError)
                   // self.allocator.block_size, len(self._blocks))
        if len(hashes) < full:
            raise BlockManagerError(f"{full} full blocks but only {len(hashes)} hashes given")
        start = self._num_cached
        for i in range(start, full):
            self.allocator.register(self._blocks[i], hashes[i])
        self._num_cached = max(start, full)
        return self._num_cached - start

    def ensure_capacity(self, num_tokens: int) -> list[int]:
        """Allocate blocks until the table holds at least ``num_tokens`` tokens.

        Args:
            num_tokens: total tokens the table must hold (>= 0).

        Returns:
            The newly allocated block ids (empty when none were needed).

        Raises:
            OutOfBlocksError: not enough free blocks; the table is left unchanged.
        """
        new = self.allocator.allocate(self.blocks_needed(num_tokens))
        self._blocks.extend(new)
        return new

    def slot(self, position: int) -> int:
        """Return the flat cache slot of token ``position``.

        Args:
            position: token index within the request, ``0 <= position < capacity_tokens``.

        Returns:
            ``block_ids[position // block_size] * block_size + position % block_size``.

        Raises:
            BlockManagerError: the position is negative or beyond the held blocks.
        """
        position = _as_int("position", position, 0, BlockManagerError)
        if position >= self.capacity_tokens:
            raise BlockManagerError(
                f"position {position} is beyond the block table's capacity of "
                f"{self.capacity_tokens} tokens ({len(self._blocks)} blocks); "
                "call ensure_capacity first"
            )
        bs = self.allocator.block_size
        return self._blocks[position // bs] * bs + position % bs

    def slots(self, start: int, length: int) -> list[int]:
        """Return the slots of positions ``start .. start + length - 1``.

        Args:
            start: first position (>= 0).
            length: number of positions (>= 0).

        Returns:
            One slot id per position.
        """
        start = _as_int("start", start, 0, BlockManagerError)
        length = _as_int("length", length, 0, BlockManagerError)
        if length and start + length > self.capacity_tokens:
            self.slot(start + length - 1)  # raises the out-of-range error
        bs = self.allocator.block_size
        return [self._blocks[p // bs] * bs + p % bs for p in range(start, start + length)]

    def free(self) -> int:
        """Drop the table's reference to every block and empty the table.

        Cached blocks stay reusable by later requests until the allocator evicts them.

        Returns:
            The number of blocks released.
        """
        n = len(self._blocks)
        self.allocator.free(self._blocks)
        self._blocks = []
        self._num_cached = 0
        return n

    def __repr__(self) -> str:
        return f"BlockTable(blocks={self._blocks}, block_size={self.allocator.block_size})"


def kv_block_bytes(
    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, element_size: int
) -> int:
    """Bytes one KV-cache block takes across all layers (keys and values).

    Args:
        block_size: token slots per block.
        num_layers: decoder layers that keep a cache.
        num_kv_heads: KV heads per layer on this rank.
        head_dim: size of one head.
        element_size: bytes per element (2 for bf16/fp16).

    Returns:
        ``2 * num_layers * block_size * num_kv_heads * head_dim * element_size``.
    """
    dims = [
        _as_int(n, v, 1, ConfigError)
        for n, v in (
            ("block_size", block_size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("element_size", element_size),
        )
    ]
    result = 2  # keys and values
    for d in dims:
        result *= d
    return result


def num_blocks_from_memory(free_bytes: int, utilization: float, bytes_per_block: int) -> int:
    """How many KV-cache blocks fit in a share of the free memory.

    Args:
        free_bytes: memory available for the cache, in bytes (>= 0).
        utilization: fraction of ``free_bytes`` the cache may take, in ``(0, 1]``.
        bytes_per_block: bytes one block takes (see :func:`kv_block_bytes`).

    Returns:
        ``floor(free_bytes * utilization / bytes_per_block)``; may be 0.
    """
    free_bytes = _as_int("free_bytes", free_bytes, 0, ConfigError)
    bytes_per_block = _as_int("bytes_per_block", bytes_per_block, 1, ConfigError)
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)):
        raise TypeError(f"utilization must be a float, got {type(utilization).__name__}")
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"utilization must be in (0, 1], got {utilization}")
    return int(free_bytes * utilization) // bytes_per_block
