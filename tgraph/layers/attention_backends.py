"""Attention backends: which op computes attention once q and the KV cache are ready.

- ``"triton"`` (default): ``paged_attention``, our Triton kernels (prefill and decode).
- ``"sdpa"``: prefill through torch ``scaled_dot_product_attention`` per sequence
  (``sdpa_attention``, reading K/V from the paged cache: chunked prefill, GQA and sliding windows
  work); decode keeps ``paged_attention``, whose split-KV kernel is what decode needs.

An :class:`~tgraph.layers.attention.Attention` picks one with ``configure(backend=...)``, e.g.
from an injection rule::

    - match: {class: tgraph.layers.attention.Attention}
      replace: {class: default, kwargs: {backend: sdpa}}

Adding a backend is one function here and one entry in :data:`BACKENDS`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tgraph.nn import functional as F
from tgraph.nn.tensor import Tensor


class _Meta(Protocol):
    block_table: Tensor
    seq_len: Tensor
    query_start_loc: Tensor | None


AttendFn = Callable[..., Tensor]


def _paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: _Meta, *, scale: float,
           sliding_window: int | None, new_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    if meta.query_start_loc is None:
        new_kv = None  # decode reads one new key per sequence: nothing to gain
    return F.paged_attention(q, k_cache, v_cache, meta.block_table, meta.seq_len,
                             meta.query_start_loc, scale=scale, sliding_window=sliding_window,
                             new_kv=new_kv)


def _sdpa_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: _Meta, *, scale: float,
                  sliding_window: int | None,
                  new_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    if meta.query_start_loc is None:  # decode: one query per sequence, the paged kernel wins
        return _paged(q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window)
    return F.sdpa_attention(q, k_cache, v_cache, meta.block_table, meta.seq_len,
                            meta.query_start_loc, scale=scale, sliding_window=sliding_window)


BACKENDS: dict[str, AttendFn] = {"triton": _paged, "sdpa": _sdpa_prefill}
DEFAULT_BACKEND = "triton"


def check_backend(backend: str) -> None:
    """Refuse an unknown attention backend.

    Raises:
        ValueError: naming the known backends.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {sorted(BACKENDS)}, got {backend!r}")


def attend(backend: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: _Meta, *,
           scale: float, sliding_window: int | None = None,
           new_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Record the attention of ``q`` over the (already written) paged cache with ``backend``.

    Args:
        backend: a key of :data:`BACKENDS`.
        q: ``[tokens, q_heads, head_dim]``.
        k_cache, v_cache: the caches as returned by ``reshape_and_cache``.
        meta: the batch's attention metadata (block table, kv lengths, query starts).
        scale: softmax scale.
        sliding_window: attend only the last ``sliding_window`` positions.
        new_kv: the ``(k, v)`` just written to the cache, ``[tokens, kv_heads, head_dim]``; a
            backend may read a prefill's keys from them instead of the cache.

    Returns:
        ``[tokens, q_heads, head_dim]``.
    """
    return BACKENDS[backend](q, k_cache, v_cache, meta, scale=scale,
                             sliding_window=sliding_window, new_kv=new_kv)
