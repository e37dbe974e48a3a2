"""Triton-backend entries of the ops that attention backends and device placement added:
``sdpa_attention`` (torch SDPA, written straight into the planned buffer) and ``to_device`` (one
copy into the destination device's buffer).

Importing this module registers both into :mod:`tgraph.kernels.fast`'s kernel table (``fast``
imports it at its end).
"""
from __future__ import annotations

import torch

from tgraph.ir.ops.sdpa import sdpa_attention_into
from tgraph.kernels import fast

__all__ = ["sdpa_attention_kernel", "to_device_kernel"]


@fast._register("sdpa_attention")
def sdpa_attention_kernel(outs: fast.Outs, q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_len: torch.Tensor, query_start_loc: torch.Tensor, *,
                          scale: float | None = None,
                          sliding_window: int | None = None) -> torch.Tensor:
    """``outs[0] = sdpa_attention(...)`` (see :mod:`tgraph.ir.ops.sdpa`).

    Args:
        outs: one ``[tokens, q_heads, head_dim]`` buffer in q's dtype.
        q, k_cache, v_cache, block_table, seq_len, query_start_loc: as for ``paged_attention``.
        scale: softmax scale (``head_dim ** -0.5`` when ``None``).
        sliding_window: attend only the last ``sliding_window`` positions.

    Returns:
        ``outs[0]``.
    """
    return sdpa_attention_into(outs[0], q, k_cache, v_cache, block_table, seq_len,
                               query_start_loc, scale=scale, sliding_window=sliding_window)


@fast._register("to_device")
def to_device_kernel(outs: fast.Outs, x: torch.Tensor, *, device: str) -> torch.Tensor:
    """Copy ``x`` into ``outs[0]``, a buffer on the destination device.

    On CUDA, torch orders a cross-device copy after the work queued on both devices' current
    streams and makes the destination stream wait for it, so no explicit event is needed.

    Returns:
        ``outs[0]``.
    """
    outs[0].copy_(x, non_blocking=True)
    return outs[0]
