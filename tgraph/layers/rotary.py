"""Rotary position embedding: cos/sin tables (all scaling types of ``rope_scaling``) as weights,
gathered by position inside the graph so a CUDA graph holds the lookup too."""
from __future__ import annotations

from tgraph.io.model_config import ModelConfig
from tgraph.layers.rope_scaling import cos_sin_table, rope_inv_freq
from tgraph.nn import functional as F
from tgraph.nn.module import Module, Parameter
from tgraph.nn.tensor import Tensor


class RotaryEmbedding(Module):
    """cos/sin ``[positions, rotary_dim / 2]`` tables for ``max_positions`` positions.

    Dynamic NTK scaling depends on the sequence length; it is tabulated once for
    ``max_positions`` (the serving context), which equals Hugging Face's value for sequences of
    that length and is the usual serving-time choice for shorter ones.
    """

    def __init__(self, config: ModelConfig, max_positions: int, device=None) -> None:
        super().__init__()
        seq_len = max_positions if config.rope_type == "dynamic" else None
        inv_freq, scaling = rope_inv_freq(config, seq_len)
        cos, sin = cos_sin_table(inv_freq, max_positions, scaling)
        self.cos_table = Parameter(cos.to(device) if device is not None else cos)
        self.sin_table = Parameter(sin.to(device) if device is not None else sin)
        self.max_positions = max_positions

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of each token's position: ``[tokens, rotary_dim / 2]`` fp32."""
        return F.embedding(positions, self.cos_table), F.embedding(positions, self.sin_table)
