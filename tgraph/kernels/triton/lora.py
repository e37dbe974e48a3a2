"""Multi-LoRA shrink into a concatenated GEMM operand: every token of a batch may use a different
adapter, and the base linear and the adapters run as one GEMM.

A LoRA linear computes ``y[t] = x[t] @ W.T + scaling[s] * (x[t] @ A[s].T) @ B[s].T``, ``s`` being
the token's adapter slot (slot 0: no adapter). Written on concatenated operands this is one GEMM::

    y = [x | xa] @ [W | B_1 | B_2 | ... | B_{L-1}].T

where row ``t`` of ``xa`` holds ``scaling[s] * x[t] @ A[s].T`` in the column block of slot ``s``
and exact zeros everywhere else. :func:`lora_shrink_concat` writes ``xcat = [x | xa]`` in one
launch; the caller runs the GEMM on a weight whose B blocks sit beside ``W`` (see
:mod:`tgraph.layers.lora_bank`). ``xcat`` may also carry ``lead`` zero columns before the slot
blocks and zero padding after them (columns another feature's adapters own in the shared weight).

Adapters are stacked: ``lora_a [L, R, K]`` (``R`` the padded maximum rank; a smaller adapter has
zero rows). Slot ``s >= 1``'s block is ``xcat[:, K + lead + (s - 1) * R : K + lead + s * R]``.

This module is the public entry; the kernels live in:

- :mod:`tgraph.kernels.triton.lora_tile`: the slot-tile kernel with split K reduced in the same
  launch, :func:`lora_shrink_concat` and its launch heuristics (:func:`lora_concat_splits`).
- :mod:`tgraph.kernels.triton.lora_rows`: the per-token kernel of decode batches (taken by
  :func:`lora_shrink_concat` for up to 64 tokens) and :func:`lora_prologue_concat`, the same
  kernel with the RMSNorm (or add + RMSNorm) producing ``x`` folded in.
- :mod:`tgraph.kernels.triton.lora_common`: the second adapter set (:class:`AdapterSet`, two
  sets' columns written by one launch), its selection in both kernels, the argument checks.
"""
from __future__ import annotations

from tgraph.kernels.triton.lora_common import AdapterSet
from tgraph.kernels.triton.lora_rows import (
    PROLOGUES,
    lora_prologue_concat,
    prologue_fits,
    rows_overlap,
)
from tgraph.kernels.triton.lora_tile import (
    LORA_COUNTERS,
    lora_concat_splits,
    lora_segments,
    lora_shrink_concat,
    new_lora_counters,
)

__all__ = ["LORA_COUNTERS", "PROLOGUES", "AdapterSet", "lora_concat_splits",
           "lora_prologue_concat", "lora_segments", "lora_shrink_concat", "new_lora_counters",
           "prologue_fits", "rows_overlap"]
