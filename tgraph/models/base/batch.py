"""What the runner tells a model about one step's batch, and its conversion to engine inputs."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tgraph.models.base.logit_bias import LogitBias


@dataclass
class BatchMeta:
    """One step's batch, in plain lists (the scheduler's output maps onto it directly).

    Attributes:
        input_ids, position_ids, slots_mapping: one entry per scheduled token (sequences packed
            in order).
        query_lens: tokens scheduled per sequence this step (1 for a decoding sequence).
        seq_len: tokens of each sequence in the cache after this step.
        block_table: cache blocks of each sequence.
        lm_head_indices: rows (token indices) whose logits are wanted; ``None`` means one per
            sequence at its last token.
        is_prefill: ``False`` only when every sequence decodes exactly one token.
        loras: the adapter name per sequence (``None``: base model).
        logit_bias: what each sequence adds to its next-token logits (``None``: nothing; see
            :mod:`tgraph.models.base.logit_bias`).
    """

    input_ids: Sequence[int]
    position_ids: Sequence[int]
    slots_mapping: Sequence[int]
    query_lens: Sequence[int]
    seq_len: Sequence[int]
    block_table: Sequence[Sequence[int]]
    lm_head_indices: Sequence[int] | None = None
    is_prefill: bool = True
    loras: Sequence[str | None] | None = None
    logit_bias: Sequence[LogitBias | None] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def validate(self) -> None:
        n = len(self.input_ids)
        if not (len(self.position_ids) == len(self.slots_mapping) == n):
            raise ValueError(f"BatchMeta: input_ids ({n}), position_ids "
                             f"({len(self.position_ids)}) and slots_mapping "
                             f"({len(self.slots_mapping)}) must have one entry per token")
        if sum(self.query_lens) != n:
            raise ValueError(f"BatchMeta: query_lens sum to {sum(self.query_lens)}, but there are "
                             f"{n} tokens")
        if not (len(self.seq_len) == len(self.block_table) == self.num_seqs):
            raise ValueError("BatchMeta: seq_len, block_table and query_lens need one entry per "
                             "sequence")
        if not self.is_prefill and any(q != 1 for q in self.query_lens):
            raise ValueError("BatchMeta: a decode batch has exactly one token per sequence")

    def default_lm_head_indices(self) -> list[int]:
        if self.lm_head_indices is not None:
            return list(self.lm_head_indices)
        ends, total = [], 0
        for q in self.query_lens:
            total += q
            ends.append(total - 1)
        return ends


def pad_decode(meta: BatchMeta, batch: int) -> BatchMeta:
    """Pad a decode batch to ``batch`` sequences with inert entries (slot -1, seq_len 0)."""
    extra = batch - meta.num_seqs
    if extra < 0:
        raise ValueError(f"cannot pad {meta.num_seqs} sequences down to {batch}")
    if extra == 0:
        return meta
    return BatchMeta(
        input_ids=list(meta.input_ids) + [0] * extra,
        position_ids=list(meta.position_ids) + [0] * extra,
        slots_mapping=list(meta.slots_mapping) + [-1] * extra,
        query_lens=list(meta.query_lens) + [1] * extra,
        seq_len=list(meta.seq_len) + [0] * extra,
        block_table=list(meta.block_table) + [[]] * extra,
        lm_head_indices=None, is_prefill=False,
        loras=None if meta.loras is None else list(meta.loras) + [None] * extra,
        logit_bias=None if meta.logit_bias is None else list(meta.logit_bias) + [None] * extra,
        extra=dict(meta.extra))


def prefill_token_bucket(num_tokens: int, limit: int) -> int | None:
    """The token count a prefill of ``num_tokens`` is padded to for its CUDA graph, or None
    above ``limit``: multiples of 128 up to 1024, then of 256 (at most ~25% padding past 512
    tokens, and a bounded number of captured signatures)."""
    if num_tokens < 1 or num_tokens > limit:
        return None
    step = 128 if num_tokens <= 1024 else 256
    return min(-(-num_tokens // step) * step, limit)


def pad_prefill_arrays(arrays: dict[str, np.ndarray], tokens: int,
                       seqs: int) -> dict[str, np.ndarray]:
    """A prefill's int32 engine inputs padded to ``tokens`` tokens and ``seqs`` sequences.

    Pad tokens (id 0 at position 0) write no cache slot (-1) and belong to no sequence: the
    pad sequences are empty (``query_start_loc`` stays at the real token count, no context), so
    no real row attends to a pad row. The logits rows are padded to ``seqs`` with row 0; the
    caller keeps the first ``L``.

    Args:
        arrays: ``input_ids``, ``position_ids``, ``slots_mapping`` ``[T]``; ``seq_len`` ``[S]``;
            ``lm_head_indices`` ``[L]``; ``query_start_loc`` ``[S + 1]``; ``block_table``
            ``[S, W]``.
        tokens, seqs: the padded T and S (and L), at least the real ones.
    Returns:
        New arrays with the same names.
    Raises:
        ValueError: if the batch has more tokens, sequences or logits rows than asked for.
    """
    num_tokens, num_seqs = len(arrays["input_ids"]), len(arrays["seq_len"])
    num_logits = len(arrays["lm_head_indices"])
    if num_tokens > tokens or max(num_seqs, num_logits) > seqs:
        raise ValueError(f"cannot pad a prefill of {num_tokens} tokens, {num_seqs} sequences and "
                         f"{num_logits} logits rows to {tokens} tokens and {seqs} sequences")

    def grow(a: np.ndarray, n: int, fill: int) -> np.ndarray:
        out = np.full((n,) + a.shape[1:], fill, dtype=np.int32)
        out[:len(a)] = a
        return out

    return {
        "input_ids": grow(arrays["input_ids"], tokens, 0),
        "position_ids": grow(arrays["position_ids"], tokens, 0),
        "slots_mapping": grow(arrays["slots_mapping"], tokens, -1),
        "seq_len": grow(arrays["seq_len"], seqs, 0),
        "lm_head_indices": grow(arrays["lm_head_indices"], seqs, 0),
        "query_start_loc": grow(arrays["query_start_loc"], seqs + 1, num_tokens),
        "block_table": grow(arrays["block_table"], seqs, 0),
    }


def block_table_array(tables: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """Rows padded with zeros to ``width`` (padding entries are never read: seq_len bound them)."""
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, row in enumerate(tables):
        if len(row) > width:
            raise ValueError(f"a sequence holds {len(row)} cache blocks, more than the table "
                             f"width {width} (max_model_len / block_size)")
        out[i, :len(row)] = row
    return out
