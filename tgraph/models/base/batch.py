"""What the runner tells a model about one step's batch, and its conversion to engine inputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class BatchMeta:
    """One step's batch, in plain lists (the scheduler's output maps onto it directly).

    Attributes:
        input_ids, positions, slots: one entry per scheduled token (sequences packed in order).
        query_lens: tokens scheduled per sequence this step (1 for a decoding sequence).
        kv_lens: tokens of each sequence in the cache after this step.
        block_tables: cache blocks of each sequence.
        logits_indices: rows (token indices) whose logits are wanted; ``None`` means one per
            sequence at its last token.
        is_prefill: ``False`` only when every sequence decodes exactly one token.
        loras: the adapter name per sequence (``None``: base model).
    """

    input_ids: Sequence[int]
    positions: Sequence[int]
    slots: Sequence[int]
    query_lens: Sequence[int]
    kv_lens: Sequence[int]
    block_tables: Sequence[Sequence[int]]
    logits_indices: Sequence[int] | None = None
    is_prefill: bool = True
    loras: Sequence[str | None] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def validate(self) -> None:
        n = len(self.input_ids)
        if not (len(self.positions) == len(self.slots) == n):
            raise ValueError(f"BatchMeta: input_ids ({n}), positions ({len(self.positions)}) and "
                             f"slots ({len(self.slots)}) must have one entry per token")
        if sum(self.query_lens) != n:
            raise ValueError(f"BatchMeta: query_lens sum to {sum(self.query_lens)}, but there are "
                             f"{n} tokens")
        if not (len(self.kv_lens) == len(self.block_tables) == self.num_seqs):
            raise ValueError("BatchMeta: kv_lens, block_tables and query_lens need one entry per "
                             "sequence")
        if not self.is_prefill and any(q != 1 for q in self.query_lens):
            raise ValueError("BatchMeta: a decode batch has exactly one token per sequence")

    def default_logits_indices(self) -> list[int]:
        if self.logits_indices is not None:
            return list(self.logits_indices)
        ends, total = [], 0
        for q in self.query_lens:
            total += q
            ends.append(total - 1)
        return ends


def pad_decode(meta: BatchMeta, batch: int) -> BatchMeta:
    """Pad a decode batch to ``batch`` sequences with inert entries (slot -1, kv_len 0)."""
    extra = batch - meta.num_seqs
    if extra < 0:
        raise ValueError(f"cannot pad {meta.num_seqs} sequences down to {batch}")
    if extra == 0:
        return meta
    return BatchMeta(
        input_ids=list(meta.input_ids) + [0] * extra,
        positions=list(meta.positions) + [0] * extra,
        slots=list(meta.slots) + [-1] * extra,
        query_lens=list(meta.query_lens) + [1] * extra,
        kv_lens=list(meta.kv_lens) + [0] * extra,
        block_tables=list(meta.block_tables) + [[]] * extra,
        logits_indices=None, is_prefill=False,
        loras=None if meta.loras is None else list(meta.loras) + [None] * extra,
        extra=dict(meta.extra))


def block_table_array(tables: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """Rows padded with zeros to ``width`` (padding entries are never read: kv_lens bound them)."""
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, row in enumerate(tables):
        if len(row) > width:
            raise ValueError(f"a sequence holds {len(row)} cache blocks, more than the table "
                             f"width {width} (max_model_len / block_size)")
        out[i, :len(row)] = row
    return out
