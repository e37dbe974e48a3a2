"""Paged attention over a block-table KV cache: varlen causal prefill and split-KV decode.

Layout and semantics (shared with the op registry's torch reference):

- ``k_cache``, ``v_cache``: ``[num_blocks, block_size, Hk, D]``. Key ``j`` of sequence ``b``
  lives at ``cache[block_table[b, j // block_size], j % block_size]``.
- ``block_table``: int32 ``[B, max_blocks_per_seq]``; ``seq_len``: int32 ``[B]``, the tokens of
  each sequence in the cache *including* the ones of this step (the caller wrote them first).
- GQA: query head ``h`` reads kv head ``h // (Hq // Hk)``. ``scale`` defaults to ``1/sqrt(D)``.
- Causal with an optional sliding window ``W``: the query at absolute position ``p`` attends keys
  ``j <= p`` with ``p - j < W`` (the HF Mistral convention).

Both functions write into ``out`` and are CUDA-graph capturable: they never read device values
on the host, and their launch grids depend only on tensor shapes and Python ints. Checks are
therefore on shapes, dtypes and devices only; the values of ``seq_len``, ``query_start_loc`` and
``block_table`` are trusted (``q_len_b <= seq_len[b] <= max_blocks_per_seq * block_size``,
``query_start_loc[B] == T``, page ids < ``num_blocks``).
"""
from __future__ import annotations

import math

import torch

from tgraph import envs
from tgraph.kernels.triton.attention_decode import (
    NewKey,
    choose_num_splits,
    decode_config,
    launch_decode,
    workspace_numel,
)
from tgraph.kernels.triton.attention_prefill import launch_prefill, prefill_config
from tgraph.kernels.triton.device_info import sm_count
from tgraph.tuning import DecodeAttentionTuning

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_attention_args(
    op: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    out: torch.Tensor,
    sliding_window: int | None,
) -> None:
    """Raise TypeError/ValueError on arguments the kernels cannot take (shape/dtype/device only)."""
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,
             "seq_len": seq_len, "out": out}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: q must be float32, float16 or bfloat16, got {q.dtype}")
    for name in ("k_cache", "v_cache", "out"):
        if named[name].dtype != q.dtype:
            raise TypeError(f"{op}: {name} must have q's dtype {q.dtype}, got {named[name].dtype}")
    for name in ("block_table", "seq_len"):
        if named[name].dtype != torch.int32:
            raise TypeError(f"{op}: {name} must be int32, got {named[name].dtype}")
    for name, t in named.items():
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    if q.device.type == "cpu" and not envs.TRITON_INTERPRET:
        raise ValueError(
            f"{op}: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 set before "
            "triton is imported); use the torch reference kernels on CPU otherwise"
        )
    elif q.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{op}: tensors must be on CUDA (or CPU under TRITON_INTERPRET=1), got {q.device}"
        )

    if q.dim() != 3:
        raise ValueError(f"{op}: q must be 3-D [tokens, Hq, D], got shape {tuple(q.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"{op}: out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"{op}: k_cache must be 4-D [num_blocks, block_size, Hk, D], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{op}: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"{op}: k_cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"{op}: head_dim must be a power of two in [16, 256], got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"{op}: Hq ({num_q_heads}) must be a multiple of Hk ({num_kv_heads}) for GQA"
        )
    if k_cache.shape[1] < 1:
        raise ValueError(f"{op}: block_size (k_cache.shape[1]) must be >= 1")
    for name in ("q", "out", "k_cache", "v_cache"):
        if named[name].stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last dim (stride 1)")
    if block_table.dim() != 2:
        raise ValueError(
            f"{op}: block_table must be 2-D [B, max_blocks_per_seq], got {tuple(block_table.shape)}"
        )
    if seq_len.dim() != 1 or seq_len.shape[0] != block_table.shape[0]:
        raise ValueError(
            f"{op}: seq_len must be 1-D [B] with B = block_table.shape[0] = "
            f"{block_table.shape[0]}, got {tuple(seq_len.shape)}"
        )
    if not seq_len.is_contiguous():
        raise ValueError(f"{op}: seq_len must be contiguous")
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(
            f"{op}: sliding_window must be None or an int >= 1, got {sliding_window!r}"
        )


def _resolve_scale(op: str, scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a Python float or None, got {type(scale).__name__}")
    if not scale > 0:
        # The kernels track the running max of raw scores, which needs a positive scale.
        raise ValueError(f"{op}: scale must be > 0, got {scale}")
    return float(scale)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None,
    sliding_window: int | None,
    out: torch.Tensor,
    max_query_len: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Causal varlen attention of packed queries against a paged KV cache (prefill / chunked).

    Query ``i`` of sequence ``b`` (row ``query_start_loc[b] + i`` of ``q``) sits at absolute
    position ``seq_len[b] - q_len_b + i``, so a chunk of queries after cached context works the
    same as a plain prefill (``q_len_b == seq_len[b]``).

    Args:
        q: ``[T, Hq, D]`` queries packed over sequences; rows may be strided (e.g. a view of a
            fused qkv output), the last dim must be contiguous.
        k_cache: ``[num_blocks, block_size, Hk, D]``, already holding this step's keys.
        v_cache: same shape and dtype as ``k_cache``.
        block_table: int32 ``[B, max_blocks_per_seq]`` page ids (any strides).
        seq_len: int32 ``[B]`` tokens of each sequence in the cache, new ones included.
        query_start_loc: int32 ``[B + 1]`` cumulative query counts, ``query_start_loc[B] == T``.
        scale: softmax scale, None for ``1/sqrt(D)``.
        sliding_window: None, or W >= 1 (a query sees the W most recent keys, itself included).
        out: ``[T, Hq, D]`` in q's dtype; written, never allocated.
        max_query_len: optional host-known longest ``q_len``; lets short chunks use smaller tiles.
        new_kv: optional ``(k, v)``, each ``[T, Hk, D]`` in the cache's dtype: the keys and
            values this step wrote to the cache, in query order (row ``i`` belongs to query row
            ``i``). Sequences without cached context (``seq_len[b] == q_len_b``) then read their
            keys from these rows, contiguously (by TMA on Hopper) instead of through the page
            table; the result is the same. Rows may be strided, the last dim contiguous.

    Returns:
        None; the result is in ``out``.
    """
    op = "paged_attention_prefill"
    _check_attention_args(op, q, k_cache, v_cache, block_table, seq_len, out, sliding_window)
    if new_kv is not None:
        _check_new_kv(op, new_kv, q, k_cache)
    if not isinstance(query_start_loc, torch.Tensor):
        raise TypeError(f"{op}: query_start_loc must be a torch.Tensor")
    if query_start_loc.dtype != torch.int32:
        raise TypeError(f"{op}: query_start_loc must be int32, got {query_start_loc.dtype}")
    if query_start_loc.device != q.device:
        raise ValueError(f"{op}: query_start_loc is on {query_start_loc.device}, q on {q.device}")
    batch = seq_len.shape[0]
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"{op}: query_start_loc must be 1-D [B + 1] = [{batch + 1}], "
            f"got {tuple(query_start_loc.shape)}"
        )
    if not query_start_loc.is_contiguous():
        raise ValueError(f"{op}: query_start_loc must be contiguous")
    if max_query_len is not None and (not isinstance(max_query_len, int) or max_query_len < 0):
        raise ValueError(f"{op}: max_query_len must be None or an int >= 0, got {max_query_len!r}")
    scale = _resolve_scale(op, scale, q.shape[2])
    group = q.shape[1] // k_cache.shape[2]
    config = prefill_config(q.shape[2], max_query_len, q.device.type == "cuda", group)
    launch_prefill(
        q, k_cache, v_cache, block_table, seq_len, query_start_loc, scale, sliding_window, out,
        config, new_kv,
    )


def _check_new_kv(op: str, new_kv, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if not (isinstance(new_kv, (tuple, list)) and len(new_kv) == 2):
        raise TypeError(f"{op}: new_kv must be a (k, v) pair of tensors, "
                        f"got {type(new_kv).__name__}")
    want = (q.shape[0], k_cache.shape[2], k_cache.shape[3])
    for name, t in zip(("new k", "new v"), new_kv):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"{op}: {name} must be [T, Hk, D] = {list(want)}, got {list(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{op}: {name} must have the cache's dtype {k_cache.dtype}, "
                            f"got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")
        if t.numel() and t.stride(2) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last dim (stride 1)")


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    scale: float | None,
    sliding_window: int | None,
    out: torch.Tensor,
    num_splits: int | None = None,
    *,
    workspace: torch.Tensor | None = None,
    new_key: NewKey | None = None,
    tuning: DecodeAttentionTuning | None = None,
) -> None:
    """Attention of one query per sequence (at position ``seq_len[b] - 1``) over a paged cache.

    Split-KV flash decoding: each (sequence, kv head, split) program reads its slice of the KV
    once for the whole query group, then a second kernel merges the splits. A sequence with
    ``seq_len[b] == 0`` (batch padding) gets zeros.

    Args:
        q: ``[B, Hq, D]``; rows may be strided, the last dim must be contiguous.
        k_cache: ``[num_blocks, block_size, Hk, D]``, already holding this step's key.
        v_cache: same shape and dtype as ``k_cache``.
        block_table: int32 ``[B, max_blocks_per_seq]`` page ids (any strides).
        seq_len: int32 ``[B]`` tokens of each sequence in the cache, the new one included.
        scale: softmax scale, None for ``1/sqrt(D)``.
        sliding_window: None, or W >= 1.
        out: ``[B, Hq, D]`` in q's dtype; written, never allocated.
        num_splits: KV splits; None picks :func:`choose_num_splits` from the shapes.
        workspace: optional fp32 buffer of at least :func:`decode_workspace_numel` elements for
            the split partials (lets an engine plan it); allocated per call when None.
        new_key: the step's rope and cache write folded in (the ``rope_cache`` op before
            attention, without its launch): ``q`` is unrotated, the cache does not hold this
            step's key yet, and the kernel rotates q and ``new_key.k``, stores k and v at
            ``new_key.slots_mapping`` and uses the new key from registers. See :class:`NewKey`.
        tuning: the launch settings (the engine's; the defaults when None).

    Returns:
        None; the result is in ``out`` (and, with ``new_key``, the step's k/v in the cache).
    """
    op = "paged_attention_decode"
    _check_attention_args(op, q, k_cache, v_cache, block_table, seq_len, out, sliding_window)
    if new_key is not None:
        _check_new_key(op, new_key, q, k_cache)
    batch, num_q_heads, head_dim = q.shape
    if seq_len.shape[0] != batch:
        raise ValueError(f"{op}: seq_len has {seq_len.shape[0]} sequences but q has {batch} rows")
    tuning = DecodeAttentionTuning() if tuning is None else tuning
    if num_splits is None:
        max_context = block_table.shape[1] * k_cache.shape[1]
        num_splits = choose_num_splits(batch, k_cache.shape[2], max_context, sm_count(q.device),
                                       tuning)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{op}: num_splits must be None or an int >= 1, got {num_splits!r}")
    if workspace is not None:
        needed = workspace_numel(batch, num_q_heads, head_dim, num_splits)
        if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.float32:
            raise TypeError(f"{op}: workspace must be a float32 tensor")
        if workspace.device != q.device or not workspace.is_contiguous():
            raise ValueError(f"{op}: workspace must be contiguous and on {q.device}")
        if workspace.numel() < needed:
            raise ValueError(
                f"{op}: workspace has {workspace.numel()} elements, needs {needed} "
                f"(B={batch}, Hq={num_q_heads}, D={head_dim}, num_splits={num_splits})"
            )
    scale = _resolve_scale(op, scale, head_dim)
    programs = batch * k_cache.shape[2] * num_splits
    config = decode_config(head_dim, q.device.type == "cuda", programs, sm_count(q.device),
                           tuning)
    launch_decode(
        q, k_cache, v_cache, block_table, seq_len, scale, sliding_window, out, num_splits,
        workspace.view(-1) if workspace is not None else None, config, new_key,
        tuning.early_kv_max_programs_per_sm,
    )


def _check_new_key(op: str, nk: NewKey, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    batch, _, head_dim = q.shape
    kv_shape = (batch, k_cache.shape[2], head_dim)
    for name, t in (("k", nk.k), ("v", nk.v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != kv_shape:
            raise ValueError(f"{op}: new_key.{name} must be [B, Hk, D] = {list(kv_shape)}, got "
                             f"{list(getattr(t, 'shape', [type(t).__name__]))}")
        if t.dtype != q.dtype or t.device != q.device or t.stride(-1) != 1:
            raise ValueError(f"{op}: new_key.{name} must be {q.dtype} on {q.device} with a "
                             f"contiguous last dim, got {t.dtype} on {t.device}, strides "
                             f"{t.stride()}")
    for name, t in (("cos", nk.cos), ("sin", nk.sin)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2 \
                or t.shape[0] != batch or not 1 <= 2 * t.shape[1] <= head_dim \
                or t.device != q.device or t.stride(-1) != 1:
            raise ValueError(f"{op}: new_key.{name} must be float32 [B={batch}, R/2] with "
                             f"2 <= R <= D={head_dim} on {q.device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} "
                             f"{list(getattr(t, 'shape', []))}")
    if nk.sin.shape != nk.cos.shape:
        raise ValueError(f"{op}: new_key.sin {list(nk.sin.shape)} must match cos "
                         f"{list(nk.cos.shape)}")
    slots_mapping = nk.slots_mapping
    if not isinstance(slots_mapping, torch.Tensor) \
            or slots_mapping.dtype not in (torch.int32, torch.int64) \
            or tuple(slots_mapping.shape) != (batch,) or slots_mapping.device != q.device:
        raise ValueError(f"{op}: new_key.slots_mapping must be int32/int64 [{batch}] "
                         f"on {q.device}, "
                         f"got {getattr(slots_mapping, 'dtype', type(slots_mapping).__name__)} "
                         f"{list(getattr(slots_mapping, 'shape', []))}")
    if not isinstance(nk.interleaved, bool):
        raise TypeError(f"{op}: new_key.interleaved must be a bool, got {nk.interleaved!r}")
    if (nk.q_norm is None) != (nk.k_norm is None):
        raise ValueError(f"{op}: new_key.q_norm and k_norm come together (both or neither)")
    for name, t in (("q_norm", nk.q_norm), ("k_norm", nk.k_norm)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (head_dim,)
                              or t.device != q.device or not t.is_floating_point()
                              or t.stride(-1) != 1):
            raise ValueError(f"{op}: new_key.{name} must be a float [D={head_dim}] weight on "
                             f"{q.device}, got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{list(getattr(t, 'shape', []))}")


def decode_workspace_numel(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements :func:`paged_attention_decode` needs in ``workspace`` for these sizes.

    Args:
        batch, num_q_heads, head_dim: B, Hq and D of ``q``.
        num_splits: the split count the call will use (see :func:`choose_num_splits`).

    Returns:
        The element count; 0 when ``num_splits == 1`` (no workspace used).
    """
    return workspace_numel(batch, num_q_heads, head_dim, num_splits)


__all__ = [
    "NewKey",
    "choose_num_splits",
    "decode_workspace_numel",
    "paged_attention_decode",
    "paged_attention_prefill",
]
