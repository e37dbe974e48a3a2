"""The ``sdpa_attention`` wrapper: torch SDPA (the ``sdpa`` attention backend of the rules),
written straight into the planned buffer."""
from __future__ import annotations

import torch

from tgraph.ir.ops.sdpa import sdpa_attention_into
from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton_backend.common import Outs

__all__ = ["KERNELS", "sdpa_attention_kernel"]


def sdpa_attention_kernel(outs: Outs, q: torch.Tensor, k_cache: torch.Tensor,
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


KERNELS = (KernelSpec("sdpa_attention", sdpa_attention_kernel),)
