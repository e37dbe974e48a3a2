"""Prefill attention through torch's ``scaled_dot_product_attention`` (the ``"sdpa"`` backend).

``sdpa_attention`` computes what ``paged_attention`` computes for packed (prefill) queries, with
the same operands and layouts (see :mod:`tgraph.ir.ops.attention`), but one SDPA call per
sequence: torch picks its fused kernel (FlashAttention, memory-efficient or cuDNN on CUDA).

K/V are read from the paged cache, after the step's own keys were written, so chunked prefill
and cached prefixes work: query ``i`` of sequence ``b`` sits at position
``seq_len[b] - q_len[b] + i`` and sees keys ``j <= p`` (and ``p - j < sliding_window``).

NOTE: the loop over sequences needs the lengths on the host (one device-to-host sync per call),
so the op is never put in a CUDA graph (the partitioner gives it a host segment); decode keeps
the paged kernel.
"""
from __future__ import annotations

import torch

from tgraph.ir.ops.attention import attention_infer
from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require


def _sdpa_infer(q: Meta, k_cache: Meta, v_cache: Meta, block_table: Meta, seq_len: Meta,
                query_start_loc: Meta | None = None, *, scale: float | None = None,
                sliding_window: int | None = None) -> Meta:
    require(query_start_loc is not None,
            "sdpa_attention is prefill attention: it needs query_start_loc ([batch + 1]); "
            "decode uses paged_attention")
    return attention_infer(q, k_cache, v_cache, block_table, seq_len, query_start_loc,
                            scale=scale, sliding_window=sliding_window)


def sdpa_attention_into(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: torch.Tensor,
                        query_start_loc: torch.Tensor, *, scale: float | None = None,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Write the attention of every packed query into ``out`` (``[tokens, q_heads, head_dim]``).

    Rows past ``query_start_loc[-1]`` are zeroed. Returns ``out``.
    """
    _, block_size, kv_heads, head_dim = k_cache.shape
    q_heads = q.shape[1]
    lens = seq_len.tolist()
    starts = query_start_loc.tolist()
    # SDPA's default is 1/sqrt(head_dim) too, but an explicit value keeps both backends equal.
    scale = head_dim ** -0.5 if scale is None else scale
    if starts[-1] < out.shape[0]:
        out[starts[-1]:].zero_()
    for b, n_keys in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        n = e - s
        if n == 0:
            continue
        blocks = block_table[b, :-(-n_keys // block_size)].long()
        # (n_keys, kv_heads, head_dim) gathered from the blocks, then heads first for SDPA.
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:n_keys].transpose(0, 1)
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:n_keys].transpose(0, 1)
        qb = q[s:e].transpose(0, 1)  # (q_heads, n, head_dim)
        mask = None
        if sliding_window is not None or n != n_keys:
            # Bottom-right aligned causal mask (SDPA's is_causal aligns top-left when n != n_keys).
            q_pos = torch.arange(n_keys - n, n_keys, device=q.device)[:, None]
            k_pos = torch.arange(n_keys, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= q_pos - k_pos < sliding_window
        o = torch.nn.functional.scaled_dot_product_attention(
            qb.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
            is_causal=mask is None, scale=scale, enable_gqa=q_heads != kv_heads)
        out[s:e] = o[0].transpose(0, 1)
    return out


def sdpa_attention_reference(q, k_cache, v_cache, block_table, seq_len, query_start_loc=None, *,
                             scale=None, sliding_window=None):
    """The op on new output memory (it *is* torch SDPA: the reference and the CPU backend)."""
    out = torch.empty_like(q)
    return sdpa_attention_into(out, q, k_cache, v_cache, block_table, seq_len, query_start_loc,
                               scale=scale, sliding_window=sliding_window)


register_op("sdpa_attention", infer=_sdpa_infer, reference=sdpa_attention_reference,
            category=OpCategory.ATTENTION,
            doc="packed prefill attention over the paged cache through torch SDPA")
