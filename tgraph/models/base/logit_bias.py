"""Per-request logit bias and allowed-token masks, added to the logits inside the graph.

OpenAI's ``logit_bias`` (``{token id: bias}``, bias in [-100, 100]) and an allow-list of token
ids (every other token gets ``-inf``: what constrained-decoding libraries drive, step by step)
become one additive row per sequence, added to the model's logits by the engine itself::

    model_out = model_out + gather(logit_bias_table, 0, logit_bias_rows)   # (rows, vocab)

* ``logit_bias_table`` ``[slots, vocab]`` is a resident input: slot 0 stays all zeros (the rows
  of sequences without a bias), every other slot holds one distinct :class:`LogitBias`;
* ``logit_bias_rows`` ``[rows]`` is the slot of each logits row, the feature's input through the
  model-inputs hook (:meth:`LogitBiasDecorator.update_model_inputs`). At decode the runner copies
  it into a tensor its captured CUDA graph reads by reference, so the step still costs one
  graph launch.

NOTE: a dense ``[rows, vocab]`` bias per step would be simpler, but it would copy rows x vocab
values to the device at every step (32 MB at batch 64 with a 128k vocabulary: longer than the
decode step itself). Here a table row is written only when a sequence's bias first appears or
changes (a new request, a new allow-list), on the device, from its few token ids; a steady
decode batch writes nothing and sends one int32 per row.

Slots are handed to the distinct biases of each step and kept while they are in use, least
recently used first out; the table doubles when one step needs more slots than it has (the
model's captured graphs are released then and captured again, as after a weight change).

Which rows: a biased sequence's row at its last scheduled token, the one the sampler reads;
other rows (the logits of prompt tokens, when asked for) are left unbiased. The sampler then
sees the biased logits: penalties, temperature and top-k/top-p/min-p apply on top, greedy takes
their argmax, and log-probabilities are those of the biased logits.

Settings (``LlmConfig.features["logit_bias"]``): none.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tgraph.models.base.batch import BatchMeta
from tgraph.models.base.features import FeatureDecorator
from tgraph.nn import functional as F
from tgraph.nn.tensor import Tensor

__all__ = ["BIAS_LIMIT", "LogitBias", "LogitBiasDecorator"]

BIAS_LIMIT = 100.0
"""Biases lie in ``[-BIAS_LIMIT, BIAS_LIMIT]``, as OpenAI's ``logit_bias`` does."""

_INITIAL_SLOTS = 16  # table rows at first use, slot 0 included


class LogitBias:
    """What one sequence adds to its next-token logits: a bias per token id and, optionally, an
    allow-list (tokens outside it get ``-inf``; allowed tokens keep their bias).

    Equal biases (same entries, same allow-list) compare and hash equal, so sequences that share
    one share a table slot.

    Args:
        bias: ``{token id: bias}``, biases finite and within ``[-100, 100]``.
        allowed: the only token ids that may be generated; ``None`` allows every token.

    Raises:
        ValueError: a negative token id, a bias out of range, or an empty allow-list.
    """

    __slots__ = ("allowed", "bias", "_hash")

    def __init__(self, bias: Mapping[int, float] | None = None,
                 allowed: Iterable[int] | None = None) -> None:
        self.allowed: tuple[int, ...] | None = None
        if allowed is not None:
            self.allowed = tuple(sorted({int(t) for t in allowed}))
            if not self.allowed:
                raise ValueError("LogitBias: the allow-list is empty: no token could be generated")
        entries = sorted((int(t), float(v)) for t, v in (bias or {}).items())
        for t, v in entries:
            if not (math.isfinite(v) and -BIAS_LIMIT <= v <= BIAS_LIMIT):
                raise ValueError(f"LogitBias: the bias of token {t} is {v}; expected a number in "
                                 f"[-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}]")
        if (entries and entries[0][0] < 0) or (self.allowed and self.allowed[0] < 0):
            raise ValueError("LogitBias: token ids must be >= 0")
        if self.allowed is not None:
            # A token outside the allow-list stays at -inf whatever its bias.
            allowed_set = set(self.allowed)
            entries = [(t, v) for t, v in entries if t in allowed_set]
        self.bias: tuple[tuple[int, float], ...] = tuple(entries)
        self._hash = hash((self.bias, self.allowed))

    def max_token_id(self) -> int:
        """The largest token id named (``-1`` when none is)."""
        return max(self.allowed[-1] if self.allowed else -1,
                   self.bias[-1][0] if self.bias else -1)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, LogitBias) and self._hash == other._hash
                and self.bias == other.bias and self.allowed == other.allowed)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        allowed = "all" if self.allowed is None else f"{len(self.allowed)} tokens"
        return f"LogitBias({len(self.bias)} biased, allowed: {allowed})"


class LogitBiasDecorator(FeatureDecorator):
    """Adds each sequence's :class:`LogitBias` (``BatchMeta.logit_bias``) to its logits row.

    A batch in which no sequence has a bias does not use the feature: it runs the engines
    without it. Stacks with both LoRA features (the bias is added after the LM head, which LoRA
    does not adapt).
    """

    name = "logit_bias"
    compatible_with = frozenset({"single_lora", "multi_lora"})
    takes_settings = False

    def __init__(self, model: Any, settings: dict | None = None) -> None:
        super().__init__(model, settings)
        self._table: torch.Tensor | None = None
        # The bias each slot holds, least recently used first.
        self._slot_of: OrderedDict[LogitBias, int] = OrderedDict()

    @property
    def vocab_size(self) -> int:
        return int(self.model.llm_config.model.vocab_size)

    # ---- recording -------------------------------------------------------------------------------
    def symbolic_inputs(self, is_prefill: bool) -> dict[str, Tensor]:
        rows = "num_logits" if is_prefill else "batch"
        dtype = self.model.llm_config.dtype
        return {"logit_bias_table": Tensor("logit_bias_table", dtype,
                                           ("logit_bias_slots", self.vocab_size)),
                "logit_bias_rows": Tensor("logit_bias_rows", torch.int32, (rows,))}

    def transform_outputs(self, outputs: dict[str, Tensor],
                          inputs: dict[str, Any]) -> dict[str, Tensor]:
        logits = outputs["model_out"]  # (rows, vocab)
        bias = F.gather(inputs["logit_bias_table"], 0, inputs["logit_bias_rows"])  # (rows, vocab)
        if bias.dtype != logits.dtype:
            bias = F.cast(bias, logits.dtype)
        return {**outputs, "model_out": logits + bias}

    # ---- running ---------------------------------------------------------------------------------
    def is_used(self, batch: BatchMeta) -> bool:
        return any(b is not None for b in (batch.logit_bias or ()))

    def resident_inputs(self) -> dict[str, torch.Tensor]:
        return {"logit_bias_table": self.table}

    @property
    def table(self) -> torch.Tensor:
        """The resident ``[slots, vocab]`` table (allocated on first use)."""
        if self._table is None:
            c = self.model.llm_config
            self._table = torch.zeros(_INITIAL_SLOTS, self.vocab_size, dtype=c.dtype,
                                      device=c.device)
        return self._table

    def update_model_inputs(self, batch: BatchMeta) -> tuple[dict[str, torch.Tensor],
                                                             dict[str, torch.Tensor],
                                                             dict[str, Any]]:
        """Write the batch's new biases into the table; return the slot of each logits row.

        Raises:
            ValueError: ``BatchMeta.logit_bias`` does not have one entry per sequence, or a bias
                names a token id outside the vocabulary.
        """
        biases = list(batch.logit_bias or [None] * batch.num_seqs)
        if len(biases) != batch.num_seqs:
            raise ValueError(f"BatchMeta.logit_bias has {len(biases)} entries for "
                             f"{batch.num_seqs} sequences; expected one LogitBias (or None) per "
                             "sequence")
        slots = np.asarray(self.assign_slots(biases), dtype=np.int32)
        if batch.is_prefill:
            rows = self._prefill_rows(batch, slots)
        else:
            rows = slots
        device = self.model.llm_config.device
        return {"logit_bias_rows": torch.from_numpy(rows).to(device)}, {}, {}

    @staticmethod
    def _prefill_rows(batch: BatchMeta, slots: np.ndarray) -> np.ndarray:
        """Each logits row's slot: its sequence's, if the row is that sequence's last token."""
        ends = np.cumsum(np.asarray(batch.query_lens, dtype=np.int64)) - 1
        indices = np.asarray(batch.default_lm_head_indices(), dtype=np.int64)
        seq = np.searchsorted(ends, indices)  # the sequence each row's token belongs to
        seq = np.minimum(seq, len(ends) - 1)
        return np.where(ends[seq] == indices, slots[seq], 0).astype(np.int32)

    def assign_slots(self, biases: Sequence[LogitBias | None]) -> list[int]:
        """The table slot of each bias (0 for ``None``), writing the ones not held yet.

        Raises:
            ValueError: a bias names a token id outside the vocabulary.
        """
        distinct = list(dict.fromkeys(b for b in biases if b is not None))
        held = self._slot_of
        for b in distinct:
            if b in held:
                held.move_to_end(b)
            elif b.max_token_id() >= self.vocab_size:
                raise ValueError(f"logit bias / allow-list names token id {b.max_token_id()}; "
                                 f"the vocabulary has {self.vocab_size} tokens")
        new = [b for b in distinct if b not in held]
        if not new:  # a steady batch: nothing to write
            return [0 if b is None else held[b] for b in biases]
        if len(distinct) >= self.table.shape[0]:
            self._grow(len(distinct) + 1)
        used = set(held.values())
        free = [s for s in range(self.table.shape[0] - 1, 0, -1) if s not in used]
        step = set(distinct)
        for b in new:
            if free:
                slot = free.pop()
            else:  # the least recently used bias not in this step gives its slot up
                old = next(k for k in held if k not in step)
                slot = held.pop(old)
            self._write(slot, b)
            held[b] = slot
        return [0 if b is None else held[b] for b in biases]

    def _write(self, slot: int, bias: LogitBias) -> None:
        row = self.table[slot]
        device = row.device
        if bias.allowed is None:
            row.zero_()
        else:
            row.fill_(float("-inf"))
            row.index_fill_(0, torch.tensor(bias.allowed, device=device), 0.0)
        if bias.bias:
            tokens, values = zip(*bias.bias)
            row.index_copy_(0, torch.tensor(tokens, device=device),
                            torch.tensor(values, dtype=row.dtype, device=device))

    def _grow(self, need: int) -> None:
        """A table of at least ``need`` slots (doubling), keeping the slots' contents."""
        old = self.table
        size = old.shape[0]
        while size < need:
            size *= 2
        table = torch.zeros(size, old.shape[1], dtype=old.dtype, device=old.device)
        table[:old.shape[0]].copy_(old)
        # Captured graphs and stagings read the old table by reference: drop them.
        release = getattr(self.model, "release_graphs", None)
        if release is not None:
            release()
        self._table = table
