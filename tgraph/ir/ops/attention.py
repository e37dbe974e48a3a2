"""Rotary embedding, the paged KV cache and paged attention.

Layouts (shared with the Triton kernels):

- q ``[tokens, q_heads, head_dim]``, k/v ``[tokens, kv_heads, head_dim]``.
- cos/sin ``[tokens, rot_dim // 2]`` already gathered by position; ``rot_dim <= head_dim`` and
  dims past ``rot_dim`` are left as they are (partial rotary).
- KV cache ``[num_blocks, block_size, kv_heads, head_dim]``; a flat slot is
  ``block * block_size + offset``; a negative slot means "padding, write nothing".
- ``block_table`` ``[batch, max_blocks_per_seq]`` int32; ``seq_len`` ``[batch]`` tokens of each
  sequence in the cache, the new ones included.
- Paged attention: with ``query_start_loc`` (``[batch + 1]`` cumulative query counts) queries are
  packed over sequences (prefill, chunked prefill); without it there is one query per sequence
  (decode). Query ``i`` of sequence ``b`` sits at absolute position
  ``seq_len[b] - q_len[b] + i`` and attends keys ``j <= p`` with ``p - j < sliding_window``
  when a window is set (the Hugging Face Mistral convention).
"""
from __future__ import annotations

import torch

from tgraph.ir.ops.registry import (
    Meta,
    OpCategory,
    dim_of,
    register_op,
    require,
    require_float,
    require_int,
    require_rank,
    require_same_dtype,
)
from tgraph.ir.shape import dims_conflict


def rope_infer(q: Meta, k: Meta, cos: Meta, sin: Meta, *, interleaved: bool = False):
    for m, what in ((q, "rope q"), (k, "rope k")):
        require_rank(m, 3, what + " ([tokens, heads, head_dim])")
        require_float(m, what)
    for m, what in ((cos, "rope cos"), (sin, "rope sin")):
        require_rank(m, 2, what + " ([tokens, rot_dim / 2])")
    half = dim_of(cos, 1)
    for m in (q, k):
        d = dim_of(m, 2)
        if isinstance(half, int) and isinstance(d, int):
            require(2 * half <= d, f"rope: cos {cos} rotates {2 * half} dims, head_dim is {d}")
        require(not dims_conflict(dim_of(m, 0), dim_of(cos, 0)),
                f"rope: {m} and cos {cos} disagree on the token count")
    return Meta(q.shape, q.dtype), Meta(k.shape, k.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    half = cos.shape[-1]
    rot = 2 * half
    xf = x.to(torch.float32)
    c = cos.to(torch.float32)[:, None, :]
    s = sin.to(torch.float32)[:, None, :]
    if interleaved:
        x1, x2 = xf[..., 0:rot:2], xf[..., 1:rot:2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., :half], xf[..., half:rot]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated, xf[..., rot:]), dim=-1).to(x.dtype)


def rope_reference(q, k, cos, sin, *, interleaved=False):
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)


register_op("rope", infer=rope_infer, reference=rope_reference, category=OpCategory.ROPE)


def cache_infer(k: Meta, v: Meta, k_cache: Meta, v_cache: Meta, slots_mapping: Meta):
    require_rank(k, 3, "reshape_and_cache k ([tokens, kv_heads, head_dim])")
    require_rank(v, 3, "reshape_and_cache v")
    for m, what in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        require_rank(m, 4, f"{what} ([num_blocks, block_size, kv_heads, head_dim])")
    require_rank(slots_mapping, 1, "slots_mapping ([tokens])")
    require_int(slots_mapping, "slots_mapping")
    for src, cache in ((k, k_cache), (v, v_cache)):
        if src.shape is not None and cache.shape is not None:
            require(not dims_conflict(src.shape[1], cache.shape[2])
                    and not dims_conflict(src.shape[2], cache.shape[3]),
                    f"reshape_and_cache: {src} does not fit cache {cache} (heads, head_dim)")
    require(not dims_conflict(dim_of(k, 0), dim_of(slots_mapping, 0)),
            f"reshape_and_cache: {k} and slots_mapping {slots_mapping} disagree on the token count")
    return Meta(k_cache.shape, k_cache.dtype), Meta(v_cache.shape, v_cache.dtype)


def reshape_and_cache_reference(k, v, k_cache, v_cache, slots_mapping):
    valid = slots_mapping >= 0
    flat = slots_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = flat // block_size, flat % block_size
    k_cache[blocks, offsets] = k[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[valid].to(v_cache.dtype)
    return k_cache, v_cache


register_op("reshape_and_cache", infer=cache_infer, reference=reshape_and_cache_reference,
            category=OpCategory.CACHE, view_of=(2, 3), mutates=(2, 3))


def attention_infer(q: Meta, k_cache: Meta, v_cache: Meta, block_table: Meta, seq_len: Meta,
                     query_start_loc: Meta | None = None, k_new: Meta | None = None,
                     v_new: Meta | None = None, *, scale: float | None = None,
                     sliding_window: int | None = None) -> Meta:
    require_rank(q, 3, "paged_attention q ([tokens, q_heads, head_dim])")
    require_float(q, "paged_attention q")
    require_rank(k_cache, 4, "k_cache ([num_blocks, block_size, kv_heads, head_dim])")
    require_rank(v_cache, 4, "v_cache")
    require_same_dtype(k_cache, v_cache, "k_cache and v_cache")
    require_rank(block_table, 2, "block_table ([batch, max_blocks])")
    require_int(block_table, "block_table")
    require_rank(seq_len, 1, "seq_len ([batch])")
    require_int(seq_len, "seq_len")
    if query_start_loc is not None:
        require_rank(query_start_loc, 1, "query_start_loc ([batch + 1])")
        require_int(query_start_loc, "query_start_loc")
    else:
        require(not dims_conflict(dim_of(q, 0), dim_of(seq_len, 0)),
                f"decode paged_attention: q {q} needs one query per sequence of seq_len {seq_len}")
    require(sliding_window is None or sliding_window > 0,
            f"sliding_window must be positive or None, got {sliding_window}")
    hq, hk = dim_of(q, 1), dim_of(k_cache, 2)
    if isinstance(hq, int) and isinstance(hk, int):
        require(hq % hk == 0, f"q heads ({hq}) must be a multiple of kv heads ({hk})")
    require(not dims_conflict(dim_of(q, 2), dim_of(k_cache, 3)),
            f"q {q} and k_cache {k_cache} disagree on head_dim")
    require((k_new is None) == (v_new is None),
            "paged_attention: give both k_new and v_new or neither")
    if k_new is not None:
        require(query_start_loc is not None,
                "paged_attention: k_new/v_new need query_start_loc (prefill)")
        for m, what in ((k_new, "k_new"), (v_new, "v_new")):
            require_rank(m, 3, f"paged_attention {what} ([tokens, kv_heads, head_dim])")
            require(m.dtype is None or k_cache.dtype is None or m.dtype == k_cache.dtype,
                    f"paged_attention {what} {m} must have the cache's dtype {k_cache.dtype}")
            require(not dims_conflict(dim_of(m, 0), dim_of(q, 0))
                    and not dims_conflict(dim_of(m, 1), dim_of(k_cache, 2))
                    and not dims_conflict(dim_of(m, 2), dim_of(k_cache, 3)),
                    f"paged_attention {what} {m} must be [tokens of q {q}, kv_heads, head_dim] "
                    f"of k_cache {k_cache}")
    return Meta(q.shape, q.dtype)


def paged_attention_reference(q, k_cache, v_cache, block_table, seq_len, query_start_loc=None,
                              k_new=None, v_new=None, *, scale=None, sliding_window=None):
    """Naive attention per sequence over keys gathered from the paged cache, in fp32.

    ``k_new``/``v_new`` are not read: they repeat what the cache holds (the contract of the op),
    so an engine that feeds the kernel wrong rows differs from this reference.
    """
    _, block_size, kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    lens = seq_len.tolist()
    starts = (query_start_loc.tolist() if query_start_loc is not None
              else list(range(len(lens) + 1)))
    out = torch.zeros_like(q)
    for b, n_keys in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        n = e - s
        if n == 0 or n_keys == 0:
            continue
        num_blocks = -(-n_keys // block_size)
        blocks = block_table[b, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:n_keys].float()
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:n_keys].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale
        q_pos = torch.arange(n_keys - n, n_keys, device=q.device)[:, None]
        k_pos = torch.arange(n_keys, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


register_op("paged_attention", infer=attention_infer, reference=paged_attention_reference,
            category=OpCategory.ATTENTION)
