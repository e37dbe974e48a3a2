"""Qwen2: Llama with biases on the q/k/v projections (not on o)."""
from __future__ import annotations

from tgraph.layers.attention import Attention
from tgraph.models.base.decoder import BaseLayer, BaseModel
from tgraph.models.base.graph import torch_to_graph
from tgraph.models.base.logit_bias import LogitBiasDecorator
from tgraph.models.base.lora_features import MultiLoraDecorator, SingleLoraDecorator
from tgraph.models.base.vocab_parallel import VocabParallelDecorator
from tgraph.models.llama.modeling import LlamaLikeForCausalLM
from tgraph.models.registry import register_model


class Qwen2Layer(BaseLayer):
    def make_attention(self, config, loader, prefix, layer_idx):
        # attention_bias: always on for Qwen2's config, qkv_bias for Qwen2-MoE's (builders).
        return Attention(config, loader, prefix, layer_idx, qkv_bias=config.attention_bias,
                         o_bias=False, sliding_window=config.sliding_window)


class Qwen2Model(BaseModel):
    layer_cls = Qwen2Layer


@register_model(model_types=("qwen2",), architectures=("Qwen2ForCausalLM",))
@torch_to_graph(SingleLoraDecorator, MultiLoraDecorator, LogitBiasDecorator,
                VocabParallelDecorator)
class FlashQwen2ForCausalLM(LlamaLikeForCausalLM):
    model_cls = Qwen2Model
