"""The decoder stack shared by Llama-like families: a family subclasses only what differs."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from tgraph.io.model_config import SLIDING_ATTENTION, ModelConfig
from tgraph.io.weights import WeightLoader
from tgraph.layers.attention import Attention, AttentionMetadata
from tgraph.layers.embedding import ParallelEmbedding
from tgraph.layers.mlp import Mlp
from tgraph.layers.norm import RmsNorm
from tgraph.layers.rotary import RotaryEmbedding
from tgraph.nn.module import Module, ModuleList
from tgraph.nn.tensor import Tensor


class BaseLayer(Module):
    """A pre-norm decoder layer: ``h += attn(norm(h)); h += mlp(norm(h))``.

    Families change the pieces through :meth:`make_attention` / :meth:`make_mlp`. The residual
    adds and the norms after them are written plainly; the ``AddRmsNorm`` pass fuses them.
    """

    def __init__(self, config: ModelConfig, loader: WeightLoader, prefix: str,
                 layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # for families whose MLP differs by layer (MoE)
        self.input_layernorm = RmsNorm(loader, f"{prefix}.input_layernorm", config.hidden_size,
                                       config.rms_norm_eps)
        self.self_attn = self.make_attention(config, loader, f"{prefix}.self_attn", layer_idx)
        self.post_attention_layernorm = RmsNorm(loader, f"{prefix}.post_attention_layernorm",
                                                config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, loader, f"{prefix}.mlp")

    def make_attention(self, config: ModelConfig, loader: WeightLoader, prefix: str,
                       layer_idx: int) -> Module:
        bias = config.attention_bias
        return Attention(config, loader, prefix, layer_idx, qkv_bias=bias, o_bias=bias,
                         sliding_window=config.sliding_window)

    def make_mlp(self, config: ModelConfig, loader: WeightLoader, prefix: str) -> Module:
        return Mlp(config, loader, prefix, bias=config.mlp_bias)

    def forward(self, h: Tensor, meta: AttentionMetadata) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class BaseModel(Module):
    """Embedding, decoder layers and final norm (the ``model.`` part of a checkpoint).

    Args:
        config: the model config.
        loader: weight loader.
        prefix: checkpoint prefix of the stack (``"model"``).
        max_positions: rows of the rotary tables (the serving context length).
    """

    layer_cls: type[Module] = BaseLayer
    norm_cls: type[RmsNorm] = RmsNorm  # the final norm's

    def __init__(self, config: ModelConfig, loader: WeightLoader, prefix: str = "model",
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = ParallelEmbedding(loader, f"{prefix}.embed_tokens", config.vocab_size,
                                              config.hidden_size)
        # Each layer sees its own config where layers differ by type (windows, RoPE).
        self.layers = ModuleList(self.layer_cls(config.layer_config(i), loader,
                                                f"{prefix}.layers.{i}", i)
                                 for i in range(config.num_hidden_layers))
        self.norm = self.norm_cls(loader, f"{prefix}.norm", config.hidden_size,
                                  config.rms_norm_eps)
        positions = max_positions or config.max_position_embeddings
        self.rotary = RotaryEmbedding(config, positions, device=loader.device)
        # The sliding layers' own RoPE tables where they differ (OLMo 3).
        slides = config.sliding_rope is not None and SLIDING_ATTENTION in config.layer_types
        self.sliding_rotary = RotaryEmbedding(
            config.layer_config(config.layer_types.index(SLIDING_ATTENTION)), positions,
            device=loader.device) if slides else None

    def embed(self, input_ids: Tensor) -> Tensor:
        """The input embeddings of ``input_ids`` (a family may scale them)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: Tensor, position_ids: Tensor, slots_mapping: Tensor,
                block_table: Tensor, seq_len: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                query_start_loc: Tensor | None = None, **_: Any) -> Tensor:
        cos, sin = self.rotary(position_ids)
        meta = AttentionMetadata(cos, sin, slots_mapping, block_table, seq_len, query_start_loc,
                                 kv_caches)
        metas = [meta] * len(self.layers)
        if self.sliding_rotary is not None:
            local_cos, local_sin = self.sliding_rotary(position_ids)
            sliding = replace(meta, cos=local_cos, sin=local_sin)
            metas = [sliding if t == SLIDING_ATTENTION else meta
                     for t in self.config.layer_types]
        h = self.embed(input_ids)
        for layer, layer_meta in zip(self.layers, metas, strict=True):
            h = layer(h, layer_meta)
        return self.norm(h)
