"""Paged KV-cache bookkeeping: physical block ids and per-request block tables.

The KV cache is one flat array of ``num_blocks * block_size`` token slots. A request owns a list
of blocks (its block table); token ``position`` of the request lives in slot
``block_ids[position // block_size] * block_size + position % block_size``. Nothing here touches
tensors: the allocator only hands out integers, the engine owns the memory.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable

from tgraph.errors import ConfigError, TGraphError

__all__ = [
    "BlockAllocator",
    "BlockManagerError",
    "BlockTable",
    "OutOfBlocksError",
    "kv_block_bytes",
    "num_blocks_from_memory",
]


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


class BlockAllocator:
    """Hands out physical KV-cache block ids ``0 .. num_blocks - 1``.

    Allocation is all-or-nothing and every free is checked: a block id freed twice or never handed
    out raises :class:`BlockManagerError` before any state changes.

    Args:
        num_blocks: number of physical blocks in the cache (>= 1).
        block_size: token slots per block (>= 1).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks: int = _as_int("num_blocks", num_blocks, 1, ConfigError)
        self.block_size: int = _as_int("block_size", block_size, 1, ConfigError)
        # NOTE: FIFO reuse: a freed block goes to the back, so the block freed longest ago is
        # handed out first (the order a prefix cache would want for eviction later).
        self._free: deque[int] = deque(range(self.num_blocks))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        """Number of blocks that can be allocated now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Number of blocks currently handed out."""
        return len(self._in_use)

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole cache (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    def can_allocate(self, n: int) -> bool:
        """Return whether ``n`` blocks can be allocated now.

        Args:
            n: number of blocks (>= 0).

        Returns:
            True when at least ``n`` blocks are free.
        """
        return _as_int("n", n, 0, BlockManagerError) <= len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        """Allocate ``n`` blocks, all or none.

        Args:
            n: number of blocks (>= 0).

        Returns:
            The allocated block ids, in allocation order.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are free (nothing is allocated).
        """
        n = _as_int("n", n, 0, BlockManagerError)
        if n > len(self._free):
            raise OutOfBlocksError(
                f"cannot allocate {n} KV-cache blocks: only {len(self._free)} of "
                f"{self.num_blocks} are free"
            )
        ids = [self._free.popleft() for _ in range(n)]
        self._in_use.update(ids)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the allocator.

        All ids are checked before any is freed, so a bad call leaves the allocator unchanged.

        Args:
            block_ids: ids previously returned by :meth:`allocate` and not freed since.

        Raises:
            BlockManagerError: an id is out of range, was never allocated, was already freed, or
                appears twice in ``block_ids``.
        """
        ids = [_as_int("block id", b, 0, BlockManagerError) for b in block_ids]
        seen: set[int] = set()
        for b in ids:
            if b >= self.num_blocks:
                raise BlockManagerError(
                    f"block id {b} does not belong to this allocator "
                    f"(ids are 0..{self.num_blocks - 1})"
                )
            if b in seen:
                raise BlockManagerError(f"block id {b} appears twice in one free() call")
            if b not in self._in_use:
                raise BlockManagerError(f"block id {b} is not allocated (double free?)")
            seen.add(b)
        self._in_use.difference_update(ids)
        self._free.extend(ids)

    def is_allocated(self, block_id: int) -> bool:
        """Return whether ``block_id`` is currently handed out."""
        return block_id in self._in_use

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free})"
        )


class BlockTable:
    """The blocks one request owns, in logical order, and the token-to-slot mapping.

    Args:
        allocator: where blocks come from and go back to.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self._blocks: list[int] = []

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
        """Return every held block to the allocator and empty the table.

        Returns:
            The number of blocks freed.
        """
        n = len(self._blocks)
        self.allocator.free(self._blocks)
        self._blocks = []
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
