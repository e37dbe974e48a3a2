"""Attention over the paged KV cache.

:class:`AttentionMetadata` carries the symbolic batch inputs every attention layer reads;
:class:`Attention` is the default (Llama) attention, which a family overrides only where it
differs (e.g. :meth:`Attention.qk_norm` for Qwen3, ``sliding_window`` for Mistral).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tgraph.io.model_config import ModelConfig
from tgraph.io.weights import WeightLoader
from tgraph.layers.attention_backends import DEFAULT_BACKEND, attend, check_backend
from tgraph.layers.linear import QKVParallelLinear, RowParallelLinear
from tgraph.nn import functional as F
from tgraph.nn.module import Module
from tgraph.nn.tensor import Tensor


@dataclass
class AttentionMetadata:
    """Symbolic inputs shared by all attention layers of one graph.

    Attributes:
        cos, sin: ``[tokens, rotary_dim / 2]`` for each token's position.
        slots_mapping: ``[tokens]`` flat cache slot of each token (negative: padding).
        block_table: ``[batch, max_blocks]`` cache blocks of each sequence.
        seq_len: ``[batch]`` tokens of each sequence in the cache after this step.
        query_start_loc: ``[batch + 1]`` for packed (prefill) queries; ``None`` in decode.
        kv_caches: ``(k_cache, v_cache)`` per layer.
    """

    cos: Tensor
    sin: Tensor
    slots_mapping: Tensor
    block_table: Tensor
    seq_len: Tensor
    query_start_loc: Tensor | None
    kv_caches: list[tuple[Tensor, Tensor]] = field(default_factory=list)


class Attention(Module):
    """Packed q/k/v projection, rotary embedding, cache write, paged attention, output projection.

    Args:
        config: the model config.
        loader: weight loader (this rank's shards are read).
        prefix: checkpoint prefix, e.g. ``model.layers.3.self_attn``.
        layer_idx: which KV cache this layer uses.
        qkv_bias / o_bias: whether the projections carry biases (the family decides).
        sliding_window: attend only to the last ``sliding_window`` positions.
        clip_qkv: clamp q, k and v to ``[-clip_qkv, clip_qkv]`` after :meth:`qk_norm` (OLMo's
            ``clip_qkv``); ``None`` leaves them.

    ``backend`` picks the attention op (:mod:`tgraph.layers.attention_backends`): ``"triton"``
    (default) or ``"sdpa"`` (torch SDPA for prefill); set it with :meth:`configure`.
    """

    def __init__(self, config: ModelConfig, loader: WeightLoader, prefix: str, layer_idx: int,
                 qkv_bias: bool = False, o_bias: bool = False,
                 sliding_window: int | None = None, clip_qkv: float | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.clip_qkv = clip_qkv
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            loader, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            config.hidden_size, config.head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(loader, f"{prefix}.o_proj",
                                        config.num_attention_heads * config.head_dim,
                                        config.hidden_size, bias=o_bias)
        self.scale = config.head_dim ** -0.5
        self.sliding_window = sliding_window
        self.backend = DEFAULT_BACKEND

    @classmethod
    def check_kwargs(cls, backend: str = DEFAULT_BACKEND) -> None:
        """Refuse unknown values of :meth:`configure`'s arguments (rules call it at load time)."""
        check_backend(backend)

    def configure(self, backend: str = DEFAULT_BACKEND) -> None:
        """Choose the attention backend (a ``replace: default`` rule with ``kwargs``).

        Args:
            backend: ``"triton"`` or ``"sdpa"``.

        Raises:
            ValueError: an unknown backend.
        """
        self.check_kwargs(backend)
        self.backend = backend

    def qk_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Hook applied to q and k before the rotary embedding (identity by default)."""
        return q, k

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        q, k, v = F.split(self.qkv_proj(x), self.qkv_proj.output_sizes, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # (tokens, heads, head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # (tokens, kv_heads, head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm(q, k)
        if self.clip_qkv is not None:
            q, k, v = (F.minimum(F.maximum(t, -self.clip_qkv), self.clip_qkv) for t in (q, k, v))
        q, k = F.rope(q, k, meta.cos, meta.sin)
        k_cache, v_cache = F.reshape_and_cache(k, v, *meta.kv_caches[self.layer_idx],
                                               meta.slots_mapping)
        out = attend(self.backend, q, k_cache, v_cache, meta, scale=self.scale,
                     sliding_window=self.sliding_window, new_kv=(k, v))
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return "" if self.backend == DEFAULT_BACKEND else f"backend={self.backend}"
