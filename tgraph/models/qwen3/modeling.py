"""Qwen3: Llama with an RMSNorm over head_dim applied to each q and k head before RoPE."""
from __future__ import annotations

from tgraph.layers.attention import Attention
from tgraph.layers.norm import RmsNorm
from tgraph.models.base.decoder import BaseLayer, BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.lora_features import MultiLoraDecorator, SingleLoraDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.registry import register_model


class Qwen3Attention(Attention):
    def __init__(self, config, loader, prefix, layer_idx, **kwargs):
        super().__init__(config, loader, prefix, layer_idx, **kwargs)
        self.q_norm = RmsNorm(loader, f"{prefix}.q_norm", config.head_dim, config.rms_norm_eps)
        self.k_norm = RmsNorm(loader, f"{prefix}.k_norm", config.head_dim, config.rms_norm_eps)

    def qk_norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)  # per head: (tokens, heads, head_dim)


class Qwen3Layer(BaseLayer):
    def make_attention(self, config, loader, prefix, layer_idx):
        bias = config.attention_bias
        return Qwen3Attention(config, loader, prefix, layer_idx, qkv_bias=bias, o_bias=bias,
                              sliding_window=config.sliding_window)


class Qwen3Model(BaseModel):
    layer_cls = Qwen3Layer


@register_model(model_types=("qwen3",), architectures=("Qwen3ForCausalLM",))
@torch_to_graph(SingleLoraDecorator, MultiLoraDecorator, LogitBiasDecorator,
                VocabParallelDecorator)
class FlashQwen3ForCausalLM(LlamaLikeForCausalLM):
    model_cls = Qwen3Model
